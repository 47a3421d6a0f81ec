"""Bidirectional attention with a T5 relative position bias, written the way lucidrains' x-transformers writes it.

Style: ``Attention(dim, heads=8, dim_head=64, ...)`` with a separate ``RelativePositionBias`` module handed to
``forward`` (x-transformers keeps one in the AttentionLayers and passes ``rel_pos``); here the attention owns one
as ``self.rel_pos``. Bias-free ``to_q``, ``to_k``, ``to_v`` and a ``to_out`` with bias; heads split by a local
``rearrange``-like helper (view + transpose), ``einsum('b h i d, b h j d -> b h i j')`` for the scores times
``self.scale`` = dim_head ** -0.5. The bias: T5's buckets (half the buckets for keys before the query, half after;
exact below max_exact, logarithmic up to max_distance), looked up in a learned ``nn.Embedding(num_buckets, heads)``
(initialised at random here, as a trained table would be) and added to the scaled scores as (H, i, j). A 2D
``mask`` (B, N), True = keep, fills padded keys with -finfo.max. Not causal. ``forward(x, mask=None)`` returns
the output.

Mistake: none.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import einsum, nn

EXPECTED = "pass"
TARGET = "Attention"
STYLE = "xtransformers"
CALL = "forward(x, mask=None): not causal; mask (B,N) bool True = keep, -finfo.max fill; T5 bucketed relative bias (learned Embedding(num_buckets, heads)) added after the einsum scores times dim_head**-0.5; returns output"
POSITIONS = "relative"


def exists(val):
    return val is not None


def split_heads(t, h):
    # 'b n (h d) -> b h n d'
    b, n, _ = t.shape
    return t.view(b, n, h, -1).transpose(1, 2)


def merge_heads(t):
    # 'b h n d -> b n (h d)'
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


class RelativePositionBias(nn.Module):
    def __init__(self, scale=1.0, causal=False, num_buckets=32, max_distance=128, heads=8):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)

    @staticmethod
    def _relative_position_bucket(relative_position, causal=True, num_buckets=32, max_distance=128):
        ret = 0
        n = -relative_position
        if not causal:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = torch.abs(n)
        else:
            n = torch.max(n, torch.zeros_like(n))

        max_exact = num_buckets // 2
        is_small = n < max_exact

        val_if_large = (
            max_exact
            + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
        )
        val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))

        ret += torch.where(is_small, n, val_if_large)
        return ret

    @property
    def device(self):
        return next(self.parameters()).device

    def forward(self, i, j):
        device = self.device
        q_pos = torch.arange(j - i, j, dtype=torch.long, device=device)
        k_pos = torch.arange(j, dtype=torch.long, device=device)
        rel_pos = k_pos[None, :] - q_pos[:, None]
        rp_bucket = self._relative_position_bucket(
            rel_pos, causal=self.causal, num_buckets=self.num_buckets, max_distance=self.max_distance
        )
        values = self.relative_attention_bias(rp_bucket)  # i j h
        bias = values.permute(2, 0, 1)  # 'i j h -> h i j'
        return bias * self.scale


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, dim_head=8, dropout=0.0, num_buckets=8, max_distance=16):
        super().__init__()
        self.scale = dim_head**-0.5
        self.heads = heads
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.to_out = nn.Linear(inner_dim, dim)
        self.rel_pos = RelativePositionBias(
            causal=False, heads=heads, num_buckets=num_buckets, max_distance=max_distance
        )

    def forward(self, x, mask: Optional[torch.Tensor] = None):
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = (split_heads(t, h) for t in (q, k, v))

        dots = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = dots.shape[-2:]
        dots = dots + self.rel_pos(i, j)

        mask_value = -torch.finfo(dots.dtype).max
        if exists(mask):
            dots = dots.masked_fill(~mask[:, None, None, :], mask_value)

        attn = dots.softmax(dim=-1)
        attn = self.dropout(attn)

        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        out = merge_heads(out)
        return self.to_out(out)
