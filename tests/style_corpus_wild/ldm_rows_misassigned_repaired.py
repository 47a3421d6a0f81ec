"""Cross-attention written the way Stable Diffusion's ldm/modules/attention.py (CompVis) writes it (the style: see ldm_correct.py).

Mistake: none. Repaired twin of ldm_rows_misassigned.py: the same code with that one mistake fixed
(mask.repeat_interleave(h, dim=0), sequence-major like the (b h) fold).
"""

import math

import torch
import torch.nn.functional as F
from torch import einsum, nn

EXPECTED = "pass"
TARGET = "CrossAttention"
STYLE = "ldm"
CALL = "forward(x, context=None, mask=None): x (B,T,query_dim); context (B,S,context_dim) defaults to x; mask (B,S) bool True = keep, filled with -finfo.max; heads folded into (B*H)"


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.0):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)

        self.scale = dim_head**-0.5
        self.heads = heads

        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)

        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None):
        h = self.heads

        q = self.to_q(x)
        context = default(context, x)
        k = self.to_k(context)
        v = self.to_v(context)

        # 'b n (h d) -> (b h) n d'
        q, k, v = (t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2).flatten(0, 1) for t in (q, k, v))

        sim = einsum("b i d, b j d -> b i j", q, k) * self.scale  # (B*H, T, S)

        if exists(mask):
            mask = mask.reshape(mask.shape[0], -1)  # 'b ... -> b (...)'
            max_neg_value = -torch.finfo(sim.dtype).max
            mask = mask.repeat_interleave(h, dim=0)[:, None, :]  # 'b j -> (b h) () j'
            sim.masked_fill_(~mask, max_neg_value)

        attn = sim.softmax(dim=-1)

        out = einsum("b i j, b j d -> b i d", attn, v)  # (B*H, T, D)
        # '(b h) n d -> b n (h d)'
        out = out.unflatten(0, (-1, h)).transpose(1, 2).flatten(2)
        return self.to_out(out)
