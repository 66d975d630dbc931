# A second held-out set: five more real PyTorch programs, each a family of shape variation that
# neither the corpus (families.py) nor the first held-out set (holdout.py) has. Their traces
# (traces/holdout2/) are replayed to check that the allocation policy holds on programs it was
# not shaped on; no rule or default is chosen on them.
#
# Same contract as families.py: every generator takes (steps, seed), builds a small model with
# random weights (nothing is downloaded) and yields once per step.
import torch
import torch.nn as nn
import torch.nn.functional as F

from families import _seed


# 1. Text generation with a key/value cache grown by torch.cat at every token (the dynamic cache
# of most generate() loops): an 8-layer fp16 decoder (d=1024), batches of 1-16 prompts of 16-512
# tokens, 16-128 new tokens greedily, so each layer's cache is reallocated one token longer at
# every step of the loop.
def kv_cat_generate(steps, seed):
    g = _seed(seed)
    d, heads, depth, V = 1024, 16, 8, 32000
    dh = d // heads

    def layer():
        return nn.ModuleDict(dict(ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d),
                                  o=nn.Linear(d, d), ln2=nn.LayerNorm(d),
                                  up=nn.Linear(d, 4 * d), down=nn.Linear(4 * d, d)))

    emb = nn.Embedding(V, d).cuda().half()
    layers = nn.ModuleList(layer() for _ in range(depth)).cuda().half()
    lnf = nn.LayerNorm(d).cuda().half()
    head = nn.Linear(d, V, bias=False).cuda().half()

    def block(blk, x, cache):
        B, T, _ = x.shape
        q, k, v = blk["qkv"](blk["ln1"](x)).view(B, T, 3, heads, dh).permute(2, 0, 3, 1, 4)
        if cache is not None:
            k = torch.cat([cache[0], k], 2)
            v = torch.cat([cache[1], v], 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None)
        x = x + blk["o"](a.transpose(1, 2).reshape(B, T, d))
        x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        return x, (k, v)

    with torch.inference_mode():
        for step in range(steps):
            B = g.choice([1, 2, 4, 8, 16])
            P = g.randint(16, 512)
            N = g.randint(16, 128)
            x = emb(torch.randint(0, V, (B, P), device="cuda"))
            caches = []
            for blk in layers:
                x, c = block(blk, x, None)
                caches.append(c)
            tok = head(lnf(x[:, -1:])).argmax(-1)
            for _ in range(N):
                x = emb(tok)
                for i, blk in enumerate(layers):
                    x, caches[i] = block(blk, x, caches[i])
                tok = head(lnf(x)).argmax(-1)
            del caches, x, tok
            yield step


# 2. Diffusion sampling with a transformer denoiser (DiT-like): 12 fp16 layers (d=768) over
# 2x2 patches of 32-64 px latents, batch 1-8 doubled for classifier-free guidance, 10-30
# denoising steps per batch.
def dit_sampling(steps, seed):
    g = _seed(seed)
    d, depth, C, p = 768, 12, 4, 2
    enc = nn.TransformerEncoderLayer(d, 12, 4 * d, 0.0, batch_first=True, norm_first=True)
    body = nn.TransformerEncoder(enc, depth, enable_nested_tensor=False).cuda().half().eval()
    patch = nn.Linear(C * p * p, d).cuda().half()
    unpatch = nn.Linear(d, 2 * C * p * p).cuda().half()
    temb = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d)).cuda().half()
    with torch.inference_mode():
        for step in range(steps):
            B = g.choice([1, 2, 4, 8])
            S = g.choice([32, 48, 64])
            n = g.choice([10, 20, 30])
            hw = S // p
            x = torch.randn(B, C, S, S, device="cuda", dtype=torch.half)
            for i in range(n):
                xx = torch.cat([x, x])
                tok = (xx.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5)
                       .reshape(2 * B, hw * hw, C * p * p))
                t = torch.full((2 * B, 256), i / n, device="cuda", dtype=torch.half)
                h = body(patch(tok) + temb(t)[:, None])
                out = (unpatch(h)[..., :C * p * p].reshape(2 * B, hw, hw, C, p, p)
                       .permute(0, 3, 1, 4, 2, 5).reshape(2 * B, C, S, S))
                cond, unc = out.chunk(2)
                x = x - (unc + 4.0 * (cond - unc)) / n
            yield step


# 3. Training with periodic evaluation: ResNet-50 at 128-224 px, batch 16-64, bf16 autocast,
# SGD with Nesterov momentum, an exponential moving average of the weights, and every 8 steps
# two evaluation batches of 128 images at 224 px through the averaged model.
def train_with_eval(steps, seed):
    import copy
    import torchvision
    g = _seed(seed)
    model = torchvision.models.resnet50(num_classes=1000).cuda()
    ema = copy.deepcopy(model).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    for step in range(steps):
        B = g.choice([16, 32, 48, 64])
        S = g.choice([128, 160, 192, 224])
        x = torch.randn(B, 3, S, S, device="cuda")
        y = torch.randint(0, 1000, (B,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.001)
        if step % 8 == 7:
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                for _ in range(2):
                    ema(torch.randn(128, 3, 224, 224, device="cuda")).argmax(-1)
        yield step


# 4. A selective state-space model (Mamba-like) with its scan written in plain PyTorch: 2 blocks
# (d=512, state 16), a token-by-token recurrence over sequences of 32-256 tokens, batch by a
# token budget, trained with AdamW (the backward pass walks the scan's many small tensors).
def ssm_scan(steps, seed):
    g = _seed(seed)
    d, N, V = 512, 16, 16000

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.inp = nn.Linear(d, 2 * d)
            self.conv = nn.Conv1d(d, d, 4, groups=d, padding=3)
            self.dt = nn.Linear(d, d)
            self.bc = nn.Linear(d, 2 * N)
            self.A = nn.Parameter(-torch.rand(d, N))
            self.out = nn.Linear(d, d)

        def forward(self, x):
            B, L, _ = x.shape
            u, z = self.inp(self.norm(x)).chunk(2, -1)
            u = F.silu(self.conv(u.transpose(1, 2))[..., :L].transpose(1, 2))
            dt = F.softplus(self.dt(u))
            Bm, Cm = self.bc(u).chunk(2, -1)
            h = torch.zeros(B, d, N, device=x.device, dtype=x.dtype)
            ys = []
            for t in range(L):
                dtt = dt[:, t, :, None]
                h = torch.exp(dtt * self.A) * h + (dtt * u[:, t, :, None]) * Bm[:, t, None, :]
                ys.append((h * Cm[:, t, None, :]).sum(-1))
            return x + self.out(torch.stack(ys, 1) * F.silu(z))

    emb = nn.Embedding(V, d).cuda()
    blocks = nn.Sequential(Block(), Block()).cuda()
    head = nn.Linear(d, V).cuda()
    params = [*emb.parameters(), *blocks.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    budget = 1024
    for step in range(steps):
        L = g.randint(32, 256)
        B = max(1, budget // L)
        ids = torch.randint(0, V, (B, L + 1), device="cuda")
        logits = head(blocks(emb(ids[:, :-1])))
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield step


# 5. Reinforcement learning (PPO): rollouts of 16-256 steps over 64-512 environments with an
# MLP policy and value function, generalized advantage estimation step by step, then 4 epochs of
# minibatch updates over the rollout (its size changes every iteration).
def ppo_rollout(steps, seed):
    g = _seed(seed)
    obs_dim, acts, hid = 256, 18, 1024

    def mlp(out):
        return nn.Sequential(nn.Linear(obs_dim, hid), nn.Tanh(), nn.Linear(hid, hid), nn.Tanh(),
                             nn.Linear(hid, out)).cuda()

    pi, vf = mlp(acts), mlp(1)
    opt = torch.optim.Adam([*pi.parameters(), *vf.parameters()], lr=3e-4)
    for step in range(steps):
        E = g.choice([64, 128, 256, 512])
        T = g.randint(16, 256)
        obs, act, logp, val, rew = [], [], [], [], []
        with torch.no_grad():
            o = torch.randn(E, obs_dim, device="cuda")
            for _ in range(T):
                dist = torch.distributions.Categorical(logits=pi(o))
                a = dist.sample()
                obs.append(o)
                act.append(a)
                logp.append(dist.log_prob(a))
                val.append(vf(o).squeeze(-1))
                rew.append(torch.randn(E, device="cuda"))
                o = torch.tanh(o + 0.1 * torch.randn_like(o))
            O, A, LP, Vl, R = (torch.stack(v) for v in (obs, act, logp, val, rew))
            del obs, act, logp, val, rew
            adv = torch.zeros_like(R)
            last = torch.zeros(E, device="cuda")
            for t in reversed(range(T)):
                nxt = Vl[t + 1] if t + 1 < T else torch.zeros(E, device="cuda")
                last = R[t] + 0.99 * nxt - Vl[t] + 0.99 * 0.95 * last
                adv[t] = last
            ret = adv + Vl
        O, A, LP, adv, ret = O.flatten(0, 1), A.flatten(), LP.flatten(), adv.flatten(), ret.flatten()
        n = O.shape[0]
        for _ in range(4):
            for mb in torch.randperm(n, device="cuda").split(max(256, n // 4)):
                dist = torch.distributions.Categorical(logits=pi(O[mb]))
                ratio = torch.exp(dist.log_prob(A[mb]) - LP[mb])
                a_ = adv[mb]
                loss = (-torch.min(ratio * a_, ratio.clamp(0.8, 1.2) * a_).mean()
                        + 0.5 * (vf(O[mb]).squeeze(-1) - ret[mb]).pow(2).mean()
                        - 0.01 * dist.entropy().mean())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        yield step


# name -> (generator, step cap), as families.FAMILIES.
HOLDOUT2 = dict(
    kv_cat_generate=(kv_cat_generate, 40),
    dit_sampling=(dit_sampling, 60),
    train_with_eval=(train_with_eval, 120),
    ssm_scan=(ssm_scan, 60),
    ppo_rollout=(ppo_rollout, 50),
)
