"""Attention with rotary embeddings in the style of lucidrains' rotary-embedding-torch (RotaryEmbedding.rotate_queries_or_keys) (the style: see lucidrotary_correct.py).

Mistake: none. Repaired twin of lucidrotary_rotary_on_values.py: the same code with that one mistake fixed
(only q and k are rotated).
"""

import math

import torch
import torch.nn.functional as F
from torch import einsum, nn

EXPECTED = "pass"
TARGET = "Attention"
STYLE = "lucidrotary"
CALL = "forward(x, mask=None): x (B,T,dim); mask (B,T) bool True = keep; rotary (interleaved pairs, first dim_head//2 features, inv_freq buffer) applied inside to q and k; SDPA"


def exists(val):
    return val is not None


def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))  # '... (d r) -> ... d r', r = 2
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)  # '... d r -> ... (d r)'


def apply_rotary_emb(freqs, t, start_index=0):
    rot_dim = freqs.shape[-1]
    end_index = start_index + rot_dim
    t_left, t_mid, t_right = t[..., :start_index], t[..., start_index:end_index], t[..., end_index:]
    t_mid = (t_mid * freqs.cos()) + (rotate_half(t_mid) * freqs.sin())
    return torch.cat((t_left, t_mid, t_right), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rotate_queries_or_keys(self, t, seq_dim=-2):
        seq_len = t.shape[seq_dim]
        pos = torch.arange(seq_len, device=t.device, dtype=self.inv_freq.dtype)
        freqs = einsum("i , j -> i j", pos, self.inv_freq)  # (n, rot_dim // 2)
        freqs = freqs.repeat_interleave(2, dim=-1)  # '... n -> ... (n r)', r = 2
        if seq_dim == -3:
            freqs = freqs[:, None, :]  # 'n d -> n 1 d'
        return apply_rotary_emb(freqs, t)


class Attention(nn.Module):
    def __init__(self, dim, heads=8, dim_head=64, causal=False):
        super().__init__()
        inner_dim = heads * dim_head
        self.heads = heads
        self.causal = causal
        self.rotary_emb = RotaryEmbedding(dim=dim_head // 2)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))  # (b, h, n, d)

        q = self.rotary_emb.rotate_queries_or_keys(q)
        k = self.rotary_emb.rotate_queries_or_keys(k)

        attn_mask = None
        if exists(mask):
            attn_mask = mask[:, None, None, :]  # (b, 1, 1, n), True = keep
        if self.causal:
            causal = torch.ones((n, n), dtype=torch.bool, device=x.device).tril()
            attn_mask = causal if attn_mask is None else attn_mask & causal

        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (b, h, n, d)
        out = out.transpose(1, 2).flatten(2)  # 'b h n d -> b n (h d)'
        return self.to_out(out)
