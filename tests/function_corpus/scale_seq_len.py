"""Hand-written SDPA whose scale reads the wrong axis: q.size(2) is T in (B, H, T, D), not the head dim.

Mistake: scores / sqrt(q.size(2)) = 1/sqrt(T_q) where 1/sqrt(D) belongs.
"""

import math

import torch

EXPECTED = "scale_seq_len"
TARGET = "attention"
LAYOUT = "BHTD"


def attention(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(2))  # (B, H, T_q, T_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v
