# The corpus programs (python/corpus/families.py) are in WORKLOADS too. The workload generators nmt and
# cnn_multiscale that python/harness.py and python/test_gpu.py import, and the original
# trace-capture command line (python/workloads.py WORKLOAD OUT_JSON [--trace OUT] [--steps N]).
#
# Runs one real PyTorch workload on the GPU, under whatever PYTORCH_CUDA_ALLOC_CONF
# the environment sets, and reports the allocator's figures. With --trace it also
# records the allocator's request stream and writes it in the plain trace format:
#   a <id> <bytes> <stream>   allocation (id unique for the whole trace)
#   f <id>                    free
# Usage: trace_capture.py WORKLOAD OUT_JSON [--trace OUT_TRACE_GZ] [--steps N]
import argparse, gzip, json, math, os, random, sys, time
import torch
import torch.nn as nn

def nmt(steps, seed):
    # The seed's scenario: transformer NMT, token budget B*L fixed, B and L vary per batch.
    g = random.Random(seed)
    V, D = 32000, 1024
    model = nn.ModuleDict(dict(
        emb=nn.Embedding(V, D),
        tr=nn.Transformer(d_model=D, nhead=16, num_encoder_layers=6, num_decoder_layers=6,
                          dim_feedforward=4096, dropout=0.1, batch_first=True),
        out=nn.Linear(D, V))).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    budget = 8192
    for step in range(steps):
        L = int(math.exp(g.uniform(math.log(8), math.log(512))))
        Lt = max(4, int(L * g.uniform(0.8, 1.25)))
        B = max(1, budget // max(L, Lt))
        src = torch.randint(0, V, (B, L), device="cuda")
        tgt = torch.randint(0, V, (B, Lt), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = model["tr"](model["emb"](src), model["emb"](tgt),
                            tgt_mask=nn.Transformer.generate_square_subsequent_mask(Lt, device="cuda"))
            logits = model["out"](h)
            loss = nn.functional.cross_entropy(logits.float().view(-1, V), tgt.view(-1))
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        yield step

def cnn_multiscale(steps, seed):
    # Detection-style multi-scale training: image side varies, pixel budget fixed.
    import torchvision
    g = random.Random(seed)
    model = torchvision.models.resnet50(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    budget = 64 * 224 * 224
    for step in range(steps):
        side = g.randrange(160, 801, 32)
        B = max(1, budget // (side * side))
        x = torch.randn(B, 3, side, side, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (B,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        yield step

WORKLOADS = dict(nmt=nmt, cnn_multiscale=cnn_multiscale)

# The trace corpus's programs (python/corpus/families.py) and the held-out ones
# (python/corpus/holdout.py, holdout2.py) run under the same names, e.g.
# `python/harness.py --workloads gpt2_finetune` or `python/workloads.py moe_train OUT.json`.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus"))
from families import FAMILIES  # noqa: E402
from holdout import HOLDOUT  # noqa: E402
from holdout2 import HOLDOUT2  # noqa: E402
WORKLOADS.update({name: gen for name, (gen, _) in FAMILIES.items()})
WORKLOADS.update({name: gen for name, (gen, _) in HOLDOUT.items()})
WORKLOADS.update({name: gen for name, (gen, _) in HOLDOUT2.items()})

def write_trace(snap, path):
    ids, next_id, n = {}, 0, 0
    with gzip.open(path, "wt") as f:
        f.write("# plain allocation trace v1: 'a <id> <bytes> <stream>' allocates, 'f <id>' frees\n")
        for e in snap["device_traces"][0]:
            act = e["action"]
            if act == "alloc":
                ids[e["addr"]] = next_id
                f.write(f"a {next_id} {e['size']} {e.get('stream', 0)}\n"); next_id += 1; n += 1
            elif act == "free_requested":
                i = ids.pop(e["addr"], None)
                if i is not None:
                    f.write(f"f {i}\n"); n += 1
    return n

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload"); ap.add_argument("out")
    ap.add_argument("--trace"); ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.cuda.init()
    if a.trace:
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=4_000_000)
    torch.manual_seed(a.seed)
    times = []
    t = time.perf_counter()
    for step in WORKLOADS[a.workload](a.steps, a.seed):
        torch.cuda.synchronize()
        now = time.perf_counter(); times.append(now - t); t = now
    st = torch.cuda.memory_stats()
    res = dict(workload=a.workload, conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
               steps=a.steps, seconds_total=sum(times), seconds_median_step=sorted(times)[len(times)//2],
               max_allocated=torch.cuda.max_memory_allocated(), max_reserved=torch.cuda.max_memory_reserved())
    for k in ["num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
              "inactive_split_bytes.all.peak", "requested_bytes.all.peak", "allocation.all.allocated",
              "segment.all.peak"]:
        if k in st: res[k] = st[k]
    res["ratio_reserved_over_allocated"] = res["max_reserved"] / max(1, res["max_allocated"])
    if a.trace:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        res["trace_events"] = write_trace(snap, a.trace)
        res["trace_raw_entries"] = len(snap["device_traces"][0])
    json.dump(res, open(a.out, "w"), indent=1)
    print(json.dumps(res))

if __name__ == "__main__":
    main()
