"""A (B, T, H, D) attention function that takes softmax_scale and never uses it.

Mistake: the scale is always 1/sqrt(D), whatever softmax_scale says.
"""

import math

import torch

EXPECTED = "scale_argument_ignored"
TARGET = "attn_bthd"
LAYOUT = "BTHD"


def attn_bthd(q, k, v, softmax_scale=None, causal=False):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # softmax_scale is never read
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(k.size(2) - q.size(2)), float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)
