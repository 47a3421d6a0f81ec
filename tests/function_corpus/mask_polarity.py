"""Hand-written SDPA whose bool mask is read as True = blocked (nn.MultiheadAttention's reading), where SDPA's
True = may attend is expected.

Mistake: scores.masked_fill(attn_mask, -inf) where masked_fill(~attn_mask, -inf) belongs.
"""

import math

import torch

EXPECTED = "mask_polarity"
TARGET = "sdpa"
LAYOUT = "BHTD"


def sdpa(q, k, v, attn_mask=None, is_causal=False):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(attn_mask, float("-inf"))
    return torch.softmax(s, -1) @ v
