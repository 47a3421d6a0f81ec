"""GQA attention in (B, H, T, D) that expands K/V heads with repeat (g0 g1 g0 g1 ..), not repeat_interleave.

Mistake: query head h reads K/V head h % G instead of h // (H / G).
"""

import math

import torch

EXPECTED = "gqa_kv_heads_tiled"
TARGET = "gqa_attention"
LAYOUT = "BHTD"


def gqa_attention(q, k, v, is_causal=False):
    rep = q.size(1) // k.size(1)
    k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)  # the mistake
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v
