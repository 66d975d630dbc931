# The trace corpus: ten real PyTorch programs, each a different family of shape variation.
#
# Every generator takes (steps, seed), builds a small model with random weights (nothing is
# downloaded), and yields once per step (a training step, a serving step, a request). The
# recorder (python/corpus/record.py) marks each yield in the trace as a step boundary.
# Models are sized to run in well under a minute on one H100 while still reaching a few GiB.
import math
import random

import torch
import torch.nn as nn
import torch.nn.functional as F


def _seed(seed):
    torch.manual_seed(seed)
    return random.Random(seed)


# 1. LLM fine-tuning: GPT-2-medium (transformers' GPT2 config, random weights), packed and
# bucketed sequences under a token budget, activation checkpointing, bf16 autocast with fp32
# master weights and AdamW.
def gpt2_finetune(steps, seed):
    from transformers import GPT2Config, GPT2LMHeadModel
    g = _seed(seed)
    cfg = GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=50257,
                     use_cache=False)
    with torch.device("cuda"):  # initialized on the GPU: seconds less than on the host
        model = GPT2LMHeadModel(cfg)
    try:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except TypeError:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    budget = 12288
    for step in range(steps):
        if g.random() < 0.3:
            L = 1024  # packed: documents concatenated to the full context
        else:
            L = g.choice([128, 192, 256, 384, 512, 768])  # length bucket
        B = max(1, budget // L)
        ids = torch.randint(0, cfg.vocab_size, (B, L), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 2. LLM serving: a decoder with a per-request KV cache grown by concatenation (as a dynamic
# cache does), continuous batching: requests arrive and finish at different steps, prefill of
# new requests and one decode token for every running request per step.
class _DecoderLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, caches):
        # x: [sum of new tokens, d] for the requests in `caches` (list of [k, v, n_new]).
        d = x.shape[-1]
        qkv = self.qkv(self.ln1(x))
        outs, at = [], 0
        for c in caches:
            n = c[2]
            q, k, v = qkv[at:at + n].view(n, 3, self.h, d // self.h).unbind(1)
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            c[0] = k.contiguous() if c[0] is None else torch.cat([c[0], k], 1)
            c[1] = v.contiguous() if c[1] is None else torch.cat([c[1], v], 1)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), c[0], c[1], is_causal=n > 1)
            outs.append(a.transpose(0, 1).reshape(n, d))
            at += n
        x = x + self.o(torch.cat(outs))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def llm_serving(steps, seed):
    g = _seed(seed)
    V, d, h, nl = 32000, 2048, 16, 8
    emb = nn.Embedding(V, d).cuda().half()
    layers = nn.ModuleList(_DecoderLayer(d, h) for _ in range(nl)).cuda().half()
    head = nn.Linear(d, V, bias=False).cuda().half()
    running = []  # [tokens_left, [[k, v, n] per layer], last_token]
    with torch.inference_mode():
        for step in range(steps):
            arrivals = sum(1 for _ in range(4) if g.random() < 0.1) if len(running) < 32 else 0
            new = []
            for _ in range(arrivals):
                prompt = int(math.exp(g.uniform(math.log(16), math.log(1024))))
                new.append([g.randint(8, 200), [[None, None, prompt] for _ in range(nl)], prompt])
            for r in running:
                for c in r[1]:
                    c[2] = 1
            batch = running + new
            if not batch:
                yield step
                continue
            toks = torch.randint(0, V, (sum(r[1][0][2] for r in batch),), device="cuda")
            x = emb(toks)
            for i, layer in enumerate(layers):
                x = layer(x, [r[1][i] for r in batch])
            # Last position of every request feeds the sampler.
            ends = torch.tensor(list(_cumsum([r[1][0][2] for r in batch])), device="cuda") - 1
            logits = head(x[ends]).float()
            nxt = torch.multinomial(torch.softmax(logits, -1), 1)
            del x, logits, nxt
            running = []
            for r in batch:
                r[0] -= 1
                if r[0] > 0:
                    running.append(r)
            yield step


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


# 3. Diffusion UNet training with aspect-ratio buckets: the latent's height and width change per
# batch, the batch size keeps the pixel budget.
class _ResBlock(nn.Module):
    def __init__(self, cin, cout, temb):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(temb, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, t):
        h = self.c1(F.silu(self.n1(x))) + self.t(t)[:, :, None, None]
        h = self.c2(F.silu(self.n2(h)))
        return h + self.skip(x)


class _Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n = nn.GroupNorm(32, c)
        self.a = nn.MultiheadAttention(c, 8, batch_first=True)

    def forward(self, x):
        B, C, H, W = x.shape
        s = self.n(x).flatten(2).transpose(1, 2)
        return x + self.a(s, s, s, need_weights=False)[0].transpose(1, 2).reshape(B, C, H, W)


class _UNet(nn.Module):
    def __init__(self, ch=(128, 256, 512), temb=512):
        super().__init__()
        self.temb = nn.Sequential(nn.Linear(128, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(4, ch[0], 3, padding=1)
        self.down, self.up = nn.ModuleList(), nn.ModuleList()
        c = ch[0]
        skips = []
        for i, co in enumerate(ch):
            self.down.append(nn.ModuleList([_ResBlock(c, co, temb), _ResBlock(co, co, temb)]))
            skips.append(co)
            c = co
        self.mid = nn.ModuleList([_ResBlock(c, c, temb), _Attn(c), _ResBlock(c, c, temb)])
        for i, co in reversed(list(enumerate(ch))):
            self.up.append(nn.ModuleList([_ResBlock(c + skips[i], co, temb), _ResBlock(co, co, temb)]))
            c = co
        self.out = nn.Sequential(nn.GroupNorm(32, c), nn.SiLU(), nn.Conv2d(c, 4, 3, padding=1))

    def forward(self, x, t):
        half = torch.exp(-math.log(10000) * torch.arange(64, device=x.device) / 64)
        te = self.temb(torch.cat([torch.sin(t[:, None] * half), torch.cos(t[:, None] * half)], 1))
        h = self.inp(x)
        hs = []
        for i, (r1, r2) in enumerate(self.down):
            h = r2(r1(h, te), te)
            hs.append(h)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.mid[2](self.mid[1](self.mid[0](h, te)), te)
        for i, (r1, r2) in enumerate(self.up):
            s = hs.pop()
            if h.shape[-2:] != s.shape[-2:]:
                h = F.interpolate(h, size=s.shape[-2:], mode="nearest")
            h = r2(r1(torch.cat([h, s], 1), te), te)
        return self.out(h)


def unet_buckets(steps, seed):
    g = _seed(seed)
    model = _UNet().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # Latent sizes (pixels / 8) of SDXL-style aspect-ratio buckets around 1024x1024 / 8 = 128^2,
    # scaled down to 64^2 latents here.
    buckets = [(64, 64), (56, 72), (72, 56), (48, 80), (80, 48), (44, 92), (92, 44), (40, 104),
               (104, 40), (60, 68), (68, 60), (52, 76), (76, 52)]
    budget = 16 * 64 * 64
    for step in range(steps):
        H, W = g.choice(buckets)
        B = max(1, budget // (H * W))
        x0 = torch.randn(B, 4, H, W, device="cuda").to(memory_format=torch.channels_last)
        t = torch.randint(0, 1000, (B,), device="cuda").float()
        noise = torch.randn_like(x0)
        a = (1 - t / 1000).view(B, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(model(xt, t).float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 4. Detection: torchvision Faster R-CNN with FPN (random weights), multi-scale training with a
# varying number of boxes per image and varying aspect ratios.
def detection_frcnn(steps, seed):
    import torchvision
    g = _seed(seed)
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91,
        min_size=(480, 544, 608, 672, 736, 800), max_size=1333).cuda()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9, weight_decay=1e-4)
    for step in range(steps):
        B = g.choice([2, 2, 4])
        imgs, targets = [], []
        for _ in range(B):
            h, w = g.randrange(360, 1025, 8), g.randrange(360, 1025, 8)
            imgs.append(torch.rand(3, h, w, device="cuda"))
            n = g.randint(1, 60)
            xy = torch.rand(n, 2, device="cuda") * torch.tensor([w * 0.8, h * 0.8], device="cuda")
            wh = torch.rand(n, 2, device="cuda") * torch.tensor([w * 0.3, h * 0.3], device="cuda") + 4
            targets.append(dict(boxes=torch.cat([xy, xy + wh], 1),
                                labels=torch.randint(1, 91, (n,), device="cuda")))
        losses = model(imgs, targets)
        loss = sum(losses.values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del imgs, targets, losses, loss
        yield step


# 5. Speech: 2-D conv subsampling front end + transformer encoder + CTC, utterances of variable
# length batched by a frame budget and padded within the batch.
def speech_ctc(steps, seed):
    g = _seed(seed)
    d = 512

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.front = nn.Sequential(nn.Conv2d(1, 256, 3, 2), nn.ReLU(), nn.Conv2d(256, 256, 3, 2),
                                       nn.ReLU())
            self.proj = nn.Linear(256 * 19, d)
            self.enc = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(d, 8, 2048, 0.1, batch_first=True, norm_first=True), 12)
            self.out = nn.Linear(d, 1024)

        def forward(self, x, pad):
            h = self.front(x.unsqueeze(1))  # [B, C, T/4, 19]
            h = self.proj(h.permute(0, 2, 1, 3).flatten(2))
            return self.out(self.enc(h, src_key_padding_mask=pad))

    model = M().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    budget = 48000  # frames of 10 ms per batch
    for step in range(steps):
        longest = int(math.exp(g.uniform(math.log(150), math.log(3000))))
        B = max(1, budget // longest)
        lens = [max(40, int(longest * g.uniform(0.6, 1.0))) for _ in range(B)]
        lens[0] = longest
        x = torch.randn(B, longest, 80, device="cuda")
        T = ((longest - 3) // 2 + 1 - 3) // 2 + 1
        out_lens = torch.tensor([((n - 3) // 2 + 1 - 3) // 2 + 1 for n in lens], device="cuda")
        pad = torch.arange(T, device="cuda")[None, :] >= out_lens[:, None]
        tl = torch.tensor([max(1, n // 12) for n in lens], device="cuda")
        tgt = torch.randint(1, 1024, (int(tl.sum()),), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x, pad)
        lp = logits.float().log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(lp, tgt, out_lens, tl, zero_infinity=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 6. GNN: message passing over batches of graphs of varying size with plain gather / index_add_
# (no graph library): node and edge counts change every step.
def gnn_varsize(steps, seed):
    g = _seed(seed)
    d, nl = 128, 6
    lins = nn.ModuleList(nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, d))
                         for _ in range(nl)).cuda()
    enc = nn.Linear(64, d).cuda()
    edge_mlp = nn.ModuleList(nn.Linear(d + 16, d) for _ in range(nl)).cuda()
    head = nn.Linear(d, 10).cuda()
    params = list(lins.parameters()) + list(enc.parameters()) + list(edge_mlp.parameters()) + \
        list(head.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    for step in range(steps):
        n_graphs = g.randint(8, 64)
        sizes = [int(math.exp(g.uniform(math.log(20), math.log(2000)))) for _ in range(n_graphs)]
        N = sum(sizes)
        deg = g.uniform(2, 8)
        E = int(N * deg)
        x = torch.randn(N, 64, device="cuda")
        graph_of = torch.repeat_interleave(torch.arange(n_graphs, device="cuda"),
                                           torch.tensor(sizes, device="cuda"))
        starts = torch.tensor([0] + list(_cumsum(sizes))[:-1], device="cuda")
        gs = torch.tensor(sizes, device="cuda")
        src_graph = graph_of[torch.randint(0, N, (E,), device="cuda")]
        src = starts[src_graph] + (torch.rand(E, device="cuda") * gs[src_graph]).long()
        dst = starts[src_graph] + (torch.rand(E, device="cuda") * gs[src_graph]).long()
        ea = torch.randn(E, 16, device="cuda")
        h = enc(x)
        for lin, em in zip(lins, edge_mlp):
            m = F.relu(em(torch.cat([h[src], ea], 1)))
            agg = torch.zeros_like(h).index_add_(0, dst, m)
            h = h + lin(torch.cat([h, agg], 1))
        pooled = torch.zeros(n_graphs, d, device="cuda").index_add_(0, graph_of, h)
        loss = F.cross_entropy(head(pooled), torch.randint(0, 10, (n_graphs,), device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 7. Mixture of experts: a transformer whose MLPs are 8 experts with top-2 routing; tokens are
# gathered per expert, so every expert's batch size changes every step and layer.
class _MoE(nn.Module):
    def __init__(self, d, n_exp=8, hidden=2048):
        super().__init__()
        self.router = nn.Linear(d, n_exp)
        self.w1 = nn.ModuleList(nn.Linear(d, hidden) for _ in range(n_exp))
        self.w2 = nn.ModuleList(nn.Linear(hidden, d) for _ in range(n_exp))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        gate = self.router(x).softmax(-1)
        w, idx = gate.topk(2, -1)
        out = torch.zeros_like(x)
        for e in range(len(self.w1)):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            y = self.w2[e](F.gelu(self.w1[e](x[tok])))
            out = out.index_add(0, tok, (y * w[tok, slot, None]).to(out.dtype))
        return out.view(shape)


def moe_train(steps, seed):
    g = _seed(seed)
    d, nl, V = 768, 8, 32000

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, 12, batch_first=True)
            self.moe = _MoE(d)

        def forward(self, x, mask):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.moe(self.ln2(x))

    emb = nn.Embedding(V, d).cuda()
    blocks = nn.ModuleList(Block() for _ in range(nl)).cuda()
    head = nn.Linear(d, V).cuda()
    params = list(emb.parameters()) + list(blocks.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    budget = 16384
    for step in range(steps):
        L = int(math.exp(g.uniform(math.log(64), math.log(1024))))
        B = max(1, budget // L)
        ids = torch.randint(0, V, (B, L), device="cuda")
        # Skew the router's input a little per step so expert loads differ step to step.
        mask = torch.triu(torch.full((L, L), float("-inf"), device="cuda"), 1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = emb(ids) * (1 + 0.5 * g.random())
            for b in blocks:
                x = b(x, mask)
            loss = F.cross_entropy(head(x).float().view(-1, V), ids.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 8. Vision transformer with variable patch counts (native-resolution training): image size and
# aspect ratio vary, so the token count per image varies; batch by a token budget.
def vit_varpatch(steps, seed):
    g = _seed(seed)
    d, P = 768, 16
    patch = nn.Conv2d(3, d, P, P).cuda()
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 12, 3072, 0.0, batch_first=True,
                                                           norm_first=True, activation="gelu"),
                                12).cuda()
    head = nn.Linear(d, 1000).cuda()
    pos = nn.Parameter(torch.randn(1, 64 * 64, d, device="cuda") * 0.02)
    params = list(patch.parameters()) + list(enc.parameters()) + list(head.parameters()) + [pos]
    opt = torch.optim.AdamW(params, lr=1e-4)
    budget = 32768
    for step in range(steps):
        hp, wp = g.randint(6, 40), g.randint(6, 40)
        B = max(1, budget // (hp * wp))
        x = torch.randn(B, 3, hp * P, wp * P, device="cuda")
        y = torch.randint(0, 1000, (B,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            t = patch(x).flatten(2).transpose(1, 2) + pos[:, :hp * wp]
            loss = F.cross_entropy(head(enc(t).mean(1)), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 9. Small-batch inference server on several streams: four worker streams take requests in turn
# (batch 1..8, varying image size, two models), outputs copied to the host.
def multistream_infer(steps, seed):
    import torchvision
    g = _seed(seed)
    cnn = torchvision.models.resnet50().cuda().eval().half()
    txt = nn.TransformerEncoder(nn.TransformerEncoderLayer(768, 12, 3072, 0.0, batch_first=True),
                                6).cuda().eval().half()
    streams = [torch.cuda.Stream() for _ in range(4)]
    pending = []
    with torch.inference_mode():
        for step in range(steps):
            s = streams[step % len(streams)]
            with torch.cuda.stream(s):
                B = g.randint(1, 8)
                if g.random() < 0.6:
                    side = g.choice([160, 192, 224, 256, 288, 320, 384])
                    out = cnn(torch.randn(B, 3, side, side, device="cuda", dtype=torch.half))
                else:
                    L = g.randint(8, 512)
                    out = txt(torch.randn(B, L, 768, device="cuda", dtype=torch.half)).mean(1)
                host = out.to("cpu", non_blocking=True)
                pending.append((s, out, host))
            if len(pending) > 6:
                s0, o0, h0 = pending.pop(0)
                s0.synchronize()
                del o0, h0
            yield step
        for s in streams:
            s.synchronize()


# 10. Dynamic control flow: an early-exit / adaptive-depth transformer whose depth, branch and
# number of refinement iterations depend on the data (host syncs on GPU values), on variable
# sequence lengths.
def dynamic_control(steps, seed):
    g = _seed(seed)
    d = 768
    layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 12, 3072, 0.0, batch_first=True)
                           for _ in range(12)).cuda()
    conv_branch = nn.Sequential(nn.Conv1d(d, d, 5, padding=2), nn.GELU(),
                                nn.Conv1d(d, d, 5, padding=2)).cuda()
    halt = nn.Linear(d, 1).cuda()
    refine = nn.GRUCell(d, d).cuda()
    head = nn.Linear(d, 100).cuda()
    params = [p for m in (layers, conv_branch, halt, refine, head) for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    for step in range(steps):
        L = int(math.exp(g.uniform(math.log(16), math.log(1024))))
        B = max(1, 8192 // L)
        x = torch.randn(B, L, d, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = x
            for i, layer in enumerate(layers):
                h = layer(h)
                # Data-dependent exit: stop once the mean halting score crosses a threshold.
                if i >= 2 and torch.sigmoid(halt(h.mean(1))).mean().item() > 0.5 + 0.04 * g.random():
                    break
            if h.float().std().item() > 1.0 or g.random() < 0.3:
                h = h + conv_branch(h.transpose(1, 2)).transpose(1, 2)
            s = h.mean(1).float()
            state = torch.zeros_like(s)
            for _ in range(g.randint(1, 6)):
                state = refine(s, state)
                if state.norm(dim=1).mean().item() > 4.0:
                    break
            loss = F.cross_entropy(head(state), torch.randint(0, 100, (B,), device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 11. Recommendation: embedding-bag lookups over ragged multi-hot features (variable bag
# lengths per sample) feeding an MLP; lookups and their gradients change size every step.
def recsys_ragged(steps, seed):
    g = _seed(seed)
    tables = nn.ModuleList(nn.EmbeddingBag(200_000, 128, mode="sum") for _ in range(8)).cuda()
    mlp = nn.Sequential(nn.Linear(8 * 128, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                        nn.Linear(512, 1)).cuda()
    opt = torch.optim.Adagrad(list(tables.parameters()) + list(mlp.parameters()), lr=0.01)
    for step in range(steps):
        B = g.choice([512, 1024, 2048, 4096])
        feats = []
        for t in tables:
            mean_len = g.uniform(1, 40)
            lens = torch.poisson(torch.full((B,), mean_len, device="cuda")).long().clamp_(min=1)
            offs = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), lens.cumsum(0)[:-1]])
            idx = torch.randint(0, 200_000, (int(lens.sum()),), device="cuda")
            feats.append(t(idx, offs))
        loss = F.binary_cross_entropy_with_logits(mlp(torch.cat(feats, 1)).squeeze(1),
                                                  torch.rand(B, device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# name -> (generator, step cap). The caps keep each trace to a few MB of gzip.
FAMILIES = dict(
    gpt2_finetune=(gpt2_finetune, 60),
    llm_serving=(llm_serving, 250),
    unet_buckets=(unet_buckets, 80),
    detection_frcnn=(detection_frcnn, 60),
    speech_ctc=(speech_ctc, 100),
    gnn_varsize=(gnn_varsize, 120),
    moe_train=(moe_train, 60),
    vit_varpatch=(vit_varpatch, 100),
    multistream_infer=(multistream_infer, 600),
    dynamic_control=(dynamic_control, 120),
    recsys_ragged=(recsys_ragged, 150),
)
