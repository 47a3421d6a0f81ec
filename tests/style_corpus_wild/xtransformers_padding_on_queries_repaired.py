"""Attention written the way lucidrains' x-transformers (x_transformers/x_transformers.py) writes it (the style: see xtransformers_correct.py).

Mistake: none. Repaired twin of xtransformers_padding_on_queries.py: the same code with that one mistake fixed
(the key mask is broadcast as 'b j -> b 1 1 j').
"""

# b - batch, h - heads, n - sequence, i - query positions, j - key positions, d - head dim
import math

import torch
import torch.nn.functional as F
from torch import einsum, nn

EXPECTED = "pass"
TARGET = "Attention"
STYLE = "xtransformers"
CALL = "forward(x, context=None, mask=None, context_mask=None, attn_mask=None): x (B,T,dim); mask (B,T) bool True = keep (self); context_mask (B,S) True = keep (cross); attn_mask (T,S) or (B,T,S) bool True = keep; fill -finfo.max"


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


class Attention(nn.Module):
    def __init__(self, dim, dim_head=64, heads=8, causal=False, dropout=0.0, dim_context=None):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        self.causal = causal
        inner_dim = dim_head * heads
        dim_context = default(dim_context, dim)

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim_context, inner_dim, bias=False)
        self.to_v = nn.Linear(dim_context, inner_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, context=None, mask=None, context_mask=None, attn_mask=None):
        h = self.heads
        kv_input = default(context, x)

        q = self.to_q(x)
        k = self.to_k(kv_input)
        v = self.to_v(kv_input)
        # 'b n (h d) -> b h n d'
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))

        dots = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        mask_value = max_neg_value(dots)

        input_mask = context_mask if exists(context) else mask
        if exists(input_mask):
            dots = dots.masked_fill(~input_mask[:, None, None, :], mask_value)  # 'b j -> b 1 1 j'

        if exists(attn_mask):
            if attn_mask.ndim == 2:
                attn_mask = attn_mask[None, None]  # 'i j -> 1 1 i j'
            elif attn_mask.ndim == 3:
                attn_mask = attn_mask[:, None]  # 'b i j -> b 1 i j'
            dots = dots.masked_fill(~attn_mask, mask_value)

        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)

        attn = dots.softmax(dim=-1)
        attn = self.attn_dropout(attn)

        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = out.transpose(1, 2).flatten(2)  # 'b h n d -> b n (h d)'
        return self.to_out(out)
