"""Attention with a softmax written out by hand: exp(scores) / sum, no maximum subtracted.

Mistake: exp overflows to inf once a score passes 88.7 (float32) or 11.1 (float16): NaN outputs.
"""

import math

import torch

EXPECTED = "softmax_overflow"
TARGET = "attention"
LAYOUT = "BHTD"


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    p = torch.exp(scores)
    return (p / p.sum(-1, keepdim=True)) @ v
