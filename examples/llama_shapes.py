"""Llama-3 factories at the sizes people train, for ``python -m autoshard plan``.

    python -m autoshard plan autoshard.examples.llama_shapes:llama3_8b --world-size 8 \
        --seq 8192 --device-profile h100

Llama-3-8B: 32 layers, width 4096, 32 query heads sharing 8 key/value heads (grouped-query
attention), SwiGLU feed-forward of 14336, vocabulary 128256; Llama-3-70B: 80 layers, width
8192, 64 heads, 8 key/value heads, feed-forward 28672 (Meta's model cards). RMSNorm, rotary
position embeddings and untied input and output embeddings, bf16 parameters as such runs
keep them; attention through ``F.scaled_dot_product_attention`` (a fused kernel, causal).
The rotary tables are computed in the forward (no buffer), so a model built on the meta
device plans with no memory of its own.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 128256


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.type_as(x) * self.weight


def _rotary(x, theta: float = 500000.0):
    """Rotary position embedding of ``x`` (batch, heads, seq, head_dim), rotating halves."""
    b, h, t, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotary(q), _rotary(k)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    """A Llama-3 decoder: token embedding, ``layers`` blocks, RMSNorm, output projection."""

    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4, kv_heads: int = 2,
                 ffn: int = 128, layers: int = 2, dtype=torch.bfloat16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, dtype=dtype)
        self.blocks = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, ffn).to(dtype)
                                    for _ in range(layers))
        self.norm = RMSNorm(dim).to(dtype)
        self.head = nn.Linear(dim, vocab, bias=False, dtype=dtype)

    def forward(self, idx):
        x = self.tok(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def llama3_8b():
    return Llama(VOCAB, 4096, 32, 8, 14336, 32)


def llama3_70b():
    return Llama(VOCAB, 8192, 64, 8, 28672, 80)


def llama_small():
    """A small Llama of the same structure, for quick looks and tests."""
    return Llama()
