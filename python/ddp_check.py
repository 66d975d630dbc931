"""DDP training on two or more GPUs under torchrun, with whichever allocator
the environment installs (CACHEALLOC_TORCH=1: cachealloc in every rank).

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/ddp_check.py

Each rank trains the same small MLP on batches of a size that changes every
step; afterwards the parameters must be identical on every rank, memory must
be accounted on the rank's own device only, and rank 0 prints
"DDP_OK <world size> <allocator>". `parity.py`'s `ddp` check runs this."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def allocator():
    try:
        import cachealloc_torch as ca
    except ImportError:
        return "native"
    return f"cachealloc-{ca.mode()}" if ca.is_enabled() else "native"


def main():
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    want = os.environ.get("DDP_CHECK_ALLOCATOR")
    got = allocator()
    assert want is None or got.startswith(want), f"rank {rank}: allocator {got}, want {want}"

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    ).cuda()
    ddp = DDP(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    first = last = None
    for step in range(30):
        g = torch.Generator(device="cuda").manual_seed(1000 * rank + step)
        n = 64 + 48 * ((step + rank) % 5)  # batch sizes differ per rank and step
        x = torch.randn(n, 256, device="cuda", generator=g)
        y = torch.randn(n, 256, device="cuda", generator=g)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    assert all(torch.equal(o, flat) for o in every), "parameters differ between ranks"
    here = torch.cuda.memory_allocated(local)
    assert here > 0, f"rank {rank}: nothing allocated on cuda:{local}"
    for d in range(torch.cuda.device_count()):
        if d != local and torch.cuda.memory_allocated(d) != 0:
            raise AssertionError(f"rank {rank}: memory accounted on cuda:{d}")
    torch.cuda.synchronize()
    if rank == 0:
        print(f"DDP_OK {world} {got} loss {first:.3f} -> {last:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
