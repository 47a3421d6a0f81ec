"""Hand-written attention in (B, H, T, D) whose softmax runs over dim=1, the heads axis.

Mistake: torch.softmax(scores, dim=1) where dim=-1 belongs. The function also runs on (B*H, T, D) tensors,
where dim=1 is the query axis: the layout must still be read as (B, H, T, D).
"""

import math

import torch

EXPECTED = "softmax_head_axis"
TARGET = "attention"
LAYOUT = "BHTD"


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    return torch.softmax(scores, dim=1) @ v
