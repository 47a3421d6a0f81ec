"""An xformers-style memory_efficient_attention in (B, T, H, D) that accepts attn_bias and never adds it.

Mistake: the bias (an additive mask) is dropped: masked keys are attended to.
"""

import math

import torch

EXPECTED = "mask_ignored"
TARGET = "memory_efficient_attention"
LAYOUT = "BTHD"


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None):
    scale = scale if scale is not None else 1 / math.sqrt(query.size(-1))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, H, T, D)
    s = q @ k.transpose(-2, -1) * scale  # attn_bias never reaches the scores
    w = torch.nn.functional.dropout(torch.softmax(s, -1), p)
    return (w @ v).transpose(1, 2)
