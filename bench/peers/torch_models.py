"""The PyTorch side of the peer benchmarks: moetrain's MoE layer and LM written as a PyTorch user
writes them (Mixtral's expert loop over index_select / index_add_, as in transformers'
MixtralSparseMoeBlock), the token shards moetrain prepares, and its learning-rate schedule.

The model follows moetrain's (src/model, docs/moe.md): RMSNorm, grouped-query attention with RoPE,
a top-k softmax router renormalised over the kept experts, SwiGLU experts, an untied LM head, the
loss CE + aux_coef * mean_layers(E * sum_i f_i P_i) + z_coef * mean_layers(mean_t lse_t^2), and the
initialisation N(0, init_std), residual outputs N(0, init_std / sqrt(2 L)), norms 1.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LmConfig:
    vocab: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    expert_hidden: int = 256
    n_experts: int = 8
    top_k: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    aux_coef: float = 0.01
    z_coef: float = 0.001


class Expert(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), Mixtral's MixtralBlockSparseTop2MLP."""

    def __init__(self, C, F_):
        super().__init__()
        self.w1 = nn.Linear(C, F_, bias=False)
        self.w3 = nn.Linear(C, F_, bias=False)
        self.w2 = nn.Linear(F_, C, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoeBlock(nn.Module):
    """Top-k softmax router, dropless, Mixtral's loop over the experts that received tokens.
    forward(x (N, C)) -> (y (N, C), aux, z): the unweighted balancing losses."""

    def __init__(self, C, F_, E, K):
        super().__init__()
        self.E, self.K = E, K
        self.gate = nn.Linear(C, E, bias=False)
        self.experts = nn.ModuleList(Expert(C, F_) for _ in range(E))

    def forward(self, x):
        N, C = x.shape
        logits = self.gate(x).float()
        probs = F.softmax(logits, dim=-1)
        weights, chosen = torch.topk(probs, self.K, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        # (E, K, N): which (token, slot) pairs each expert takes.
        mask = F.one_hot(chosen, num_classes=self.E).permute(2, 1, 0)
        for e in range(self.E):
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            h = self.experts[e](x.index_select(0, token)) * weights[token, slot, None]
            out.index_add_(0, token, h.to(out.dtype))
        # Switch loss: f_i = selections of expert i / (N K), P_i = mean router probability.
        f = mask.sum(dim=(1, 2)).float() / (N * self.K)
        aux = self.E * (f * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return out, aux, z


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


def rope_tables(T, HS, theta):
    inv = 1.0 / (theta ** (torch.arange(0, HS, 2, dtype=torch.float32) / HS))
    ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x, cos, sin):
    # Mixtral's rotate_half convention; x: (B, H, T, HS).
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class Block(nn.Module):
    def __init__(self, c: LmConfig):
        super().__init__()
        HS = c.dim // c.n_heads
        self.c, self.HS = c, HS
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.q_proj = nn.Linear(c.dim, c.n_heads * HS, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * HS, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * HS, bias=False)
        self.o_proj = nn.Linear(c.n_heads * HS, c.dim, bias=False)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.moe = MoeBlock(c.dim, c.expert_hidden, c.n_experts, c.top_k)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        c, HS = self.c, self.HS
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, c.n_heads, HS).transpose(1, 2)
        k = self.k_proj(h).view(B, T, c.n_kv_heads, HS).transpose(1, 2)
        v = self.v_proj(h).view(B, T, c.n_kv_heads, HS).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, C))
        y, aux, z = self.moe(self.post_attention_layernorm(x).view(B * T, C))
        return x + y.view(B, T, C), aux, z


class MoeLm(nn.Module):
    def __init__(self, c: LmConfig, max_T: int):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        cos, sin = rope_tables(max_T, c.dim // c.n_heads, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        out_std = c.init_std / math.sqrt(2.0 * c.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                residual_out = name.endswith("o_proj.weight") or name.endswith(".w2.weight")
                nn.init.normal_(p, 0.0, out_std if residual_out else c.init_std)

    def forward(self, tokens, targets):
        """-> (total loss, cross-entropy)."""
        T = tokens.shape[1]
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embed_tokens(tokens)
        aux = z = 0.0
        for layer in self.layers:
            x, a, zz = layer(x, cos, sin)
            aux, z = aux + a, z + zz
        logits = self.lm_head(self.norm(x)).float()
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        L = len(self.layers)
        return ce + self.c.aux_coef * aux / L + self.c.z_coef * z / L, ce

    def param_groups(self, weight_decay):
        """moetrain's rule: matrices decay, norms and the router do not."""
        decay, keep = [], []
        for name, p in self.named_parameters():
            (keep if p.dim() == 1 or name.endswith("gate.weight") else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay},
                {"params": keep, "weight_decay": 0.0}]


def read_shard(path):
    """A moetrain token shard (src/data/shard.h): 24-byte header, then uint16 or uint32 tokens."""
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:8] != b"MOETOK01":
            raise ValueError(f"{path}: not a moetrain token shard")
        version = int.from_bytes(head[8:12], "little")
        count = int.from_bytes(head[16:24], "little")
        dtype = np.uint16 if version == 1 else np.uint32
        return np.fromfile(f, dtype=dtype, count=count).astype(np.int64)


class Windows:
    """moetrain's windows (src/data/loader.h): window w holds tokens [w T, w T + T]. Training
    visits them in a fresh permutation per epoch; evaluation takes the first ones in order."""

    def __init__(self, tokens, T, seed=0):
        self.tokens, self.T = torch.from_numpy(tokens), T
        self.n = (len(tokens) - 1) // T
        self.gen = torch.Generator().manual_seed(seed)
        self.perm, self.pos = torch.randperm(self.n, generator=self.gen), 0

    def _rows(self, starts):
        idx = starts[:, None] + torch.arange(self.T + 1)[None, :]
        rows = self.tokens[idx]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def next_batch(self, B):
        ws, rows = [], 0
        while rows < B:
            if self.pos == self.n:
                self.perm, self.pos = torch.randperm(self.n, generator=self.gen), 0
            take = min(B - rows, self.n - self.pos)
            ws.append(self.perm[self.pos:self.pos + take])
            self.pos, rows = self.pos + take, rows + take
        return self._rows(torch.cat(ws) * self.T)

    def eval_batches(self, B, max_batches):
        n = min(self.n, B * max_batches)
        for i in range(0, n, B):
            yield self._rows(torch.arange(i, min(i + B, n)) * self.T)


def lr_at(step, lr, min_lr, warmup, total):
    """moetrain's schedule (src/optim/schedule.cpp, run_config.cpp) at 0-based step `step`:
    linear warm-up from lr / warmup, then cosine to min_lr at `total`."""
    if step < warmup:
        init = lr / warmup
        return init + (lr - init) * step / warmup
    if step >= total:
        return min_lr
    p = (step - warmup) / (total - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def load_moetrain_weights(model, path):
    """Loads a moetrain checkpoint's model.safetensors (Hugging Face Mixtral names, f32 or bf16)
    into a MoeLm: safetensors read by hand (8-byte header size, JSON header, raw tensors)."""
    import json
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        blob = f.read()
    own = dict(model.named_parameters())
    loaded = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        key = name.removeprefix("model.").replace("self_attn.", "").replace("block_sparse_moe.",
                                                                          "moe.")
        a, b = info["data_offsets"]
        if info["dtype"] == "F32":
            t = torch.from_numpy(np.frombuffer(blob[a:b], dtype=np.float32).copy())
        elif info["dtype"] == "BF16":
            raw = np.frombuffer(blob[a:b], dtype=np.uint16).astype(np.uint32) << 16
            t = torch.from_numpy(raw.view(np.float32).copy())
        else:
            raise ValueError(f"{path}: {name}: dtype {info['dtype']} not read here")
        if key not in own or tuple(own[key].shape) != tuple(info["shape"]):
            raise ValueError(f"{path}: {name} ({info['shape']}) has no place in the PyTorch model")
        with torch.no_grad():
            own[key].copy_(t.view(info["shape"]))
        loaded += 1
    if loaded != len(own):
        raise ValueError(f"{path}: {loaded} tensors for the model's {len(own)}")
