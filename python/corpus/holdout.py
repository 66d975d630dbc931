# Held-out workloads: five more real PyTorch programs, each a family of shape variation that the
# corpus (families.py) does not have. Their traces (traces/holdout/) are replayed to check that the
# allocation policy holds on programs it was not shaped on; no rule or default is chosen on them.
#
# Same contract as families.py: every generator takes (steps, seed), builds a small model with
# random weights (nothing is downloaded) and yields once per step.
import torch
import torch.nn as nn
import torch.nn.functional as F

from families import _seed


# 1. Recurrent language model: a 3-layer cuDNN LSTM, truncated back-propagation through time over
# segments of 32-256 tokens, batch by a token budget, fp16 autocast, gradient clipping, Adam.
def lstm_lm(steps, seed):
    g = _seed(seed)
    V, d = 32000, 1024
    emb = nn.Embedding(V, d).cuda()
    rnn = nn.LSTM(d, d, num_layers=3, batch_first=True).cuda()
    head = nn.Linear(d, V).cuda()
    params = [*emb.parameters(), *rnn.parameters(), *head.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    budget = 12288
    for step in range(steps):
        L = g.randint(32, 256)
        B = max(1, budget // L)
        ids = torch.randint(0, V, (B, L + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            h, _ = rnn(emb(ids[:, :-1]))
            logits = head(h).float()
            loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 2. Contrastive image-text training (CLIP-like): a ResNet-18 image tower at 160-224 px and a
# 6-layer text transformer over 8-77 tokens, batch 64-256, the batch x batch similarity matrix
# and its symmetric cross-entropy, bf16 autocast, AdamW.
def clip_contrastive(steps, seed):
    import torchvision
    g = _seed(seed)
    d, V = 512, 49408
    img = torchvision.models.resnet18(num_classes=d).cuda()
    tok = nn.Embedding(V, d).cuda()
    pos = nn.Parameter(torch.randn(1, 77, d, device="cuda") * 0.01)
    txt = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.0, batch_first=True,
                                                           norm_first=True), 6).cuda()
    proj = nn.Linear(d, d).cuda()
    params = [*img.parameters(), *tok.parameters(), pos, *txt.parameters(), *proj.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    for step in range(steps):
        B = g.choice([64, 96, 128, 192, 256])
        side = g.choice([160, 192, 224])
        L = g.randint(8, 77)
        x = torch.randn(B, 3, side, side, device="cuda")
        ids = torch.randint(0, V, (B, L), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fi = F.normalize(img(x).float(), dim=-1)
            t = txt(tok(ids) + pos[:, :L])
            ft = F.normalize(proj(t.mean(1)).float(), dim=-1)
            logits = fi @ ft.t() * 14.3
            labels = torch.arange(B, device="cuda")
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 3. Video classification: a 3D ResNet-18 (torchvision r3d_18) on clips of 4-16
# frames at 96-160 px, batch by a voxel budget, with cudnn.benchmark on (so every new clip shape
# runs the convolution autotuner and its workspaces), fp16 autocast, SGD with momentum.
def video_conv3d(steps, seed):
    from torchvision.models.video import r3d_18
    g = _seed(seed)
    torch.backends.cudnn.benchmark = True
    model = r3d_18(num_classes=400).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    budget = 12 * 16 * 112 * 112
    for step in range(steps):
        T = g.choice([4, 8, 12, 16])
        S = g.choice([96, 112, 128, 160])
        B = max(1, budget // (T * S * S))
        x = torch.randn(B, 3, T, S, S, device="cuda")
        y = torch.randint(0, 400, (B,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 4. Translation inference with beam search: a 6+6-layer fp16 transformer, batches of 4-32
# sentences of 8-128 tokens, 4 beams, the decoder re-run over the growing prefix, and sentences
# leaving the batch as they finish (the batch shrinks during decoding).
def seq2seq_beam(steps, seed):
    g = _seed(seed)
    d, V, K = 512, 32000, 4
    model = nn.Transformer(d, 8, 6, 6, 2048, 0.0, batch_first=True).cuda().eval().half()
    emb = nn.Embedding(V, d).cuda().half()
    out = nn.Linear(d, V).cuda().half()
    with torch.inference_mode():
        for step in range(steps):
            B = g.randint(4, 32)
            S = g.randint(8, 128)
            mem = model.encoder(emb(torch.randint(0, V, (B, S), device="cuda")))
            mem = mem.repeat_interleave(K, 0)
            tgt = torch.zeros(B * K, 1, dtype=torch.long, device="cuda")
            scores = torch.zeros(B * K, device="cuda")
            for t in range(min(S + 16, 96)):
                T = tgt.shape[1]
                mask = nn.Transformer.generate_square_subsequent_mask(T, device="cuda",
                                                                      dtype=torch.half)
                h = model.decoder(emb(tgt), mem, tgt_mask=mask)
                logp = F.log_softmax(out(h[:, -1]).float(), -1)
                n = tgt.shape[0] // K
                top, idx = (scores[:, None] + logp).view(n, K * V).topk(K, dim=1)
                sel = (torch.arange(n, device="cuda")[:, None] * K + idx // V).view(-1)
                tgt = torch.cat([tgt[sel], (idx % V).view(-1, 1)], 1)
                scores = top.view(-1)
                if t > 4:
                    keep = [i for i in range(n) if g.random() > 0.04]
                    if not keep:
                        break
                    if len(keep) < n:
                        rows = (torch.tensor(keep, device="cuda")[:, None] * K
                                + torch.arange(K, device="cuda")).view(-1)
                        tgt, scores, mem = tgt[rows], scores[rows], mem[rows]
            yield step


# 5. Point clouds: a DGCNN-style network (k-nearest-neighbour graphs rebuilt in every layer from
# pairwise distances, edge features gathered per point) over clouds of 512-4096 points, batch by
# a point budget, per-point segmentation loss, Adam.
def pointcloud_knn(steps, seed):
    g = _seed(seed)
    k = 20
    widths = [3, 64, 64, 128, 256]
    edge_mlps = nn.ModuleList(nn.Sequential(nn.Linear(2 * a, b), nn.LayerNorm(b), nn.GELU())
                              for a, b in zip(widths, widths[1:])).cuda()
    seg = nn.Sequential(nn.Linear(sum(widths[1:]) + 512, 256), nn.GELU(),
                        nn.Linear(256, 50)).cuda()
    glob = nn.Linear(sum(widths[1:]), 512).cuda()
    params = [*edge_mlps.parameters(), *seg.parameters(), *glob.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    budget = 24576
    for step in range(steps):
        N = g.choice([512, 1024, 1536, 2048, 3072, 4096])
        B = max(1, budget // N)
        x = torch.randn(B, N, 3, device="cuda")
        feats = []
        h = x
        for mlp in edge_mlps:
            idx = torch.cdist(h, h).topk(k, dim=-1, largest=False).indices
            nb = h[torch.arange(B, device="cuda")[:, None, None], idx]
            e = torch.cat([nb - h[:, :, None], h[:, :, None].expand(-1, -1, k, -1)], -1)
            h = mlp(e).amax(2)
            feats.append(h)
        f = torch.cat(feats, -1)
        gf = glob(f).amax(1, keepdim=True).expand(-1, N, -1)
        logits = seg(torch.cat([f, gf], -1))
        loss = F.cross_entropy(logits.reshape(-1, 50),
                               torch.randint(0, 50, (B * N,), device="cuda"))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# name -> (generator, step cap), as families.FAMILIES.
HOLDOUT = dict(
    lstm_lm=(lstm_lm, 150),
    clip_contrastive=(clip_contrastive, 100),
    video_conv3d=(video_conv3d, 80),
    seq2seq_beam=(seq2seq_beam, 60),
    pointcloud_knn=(pointcloud_knn, 120),
)
