"""Hand-written SDPA in (B, H, T, D) whose causal mask keeps one diagonal too many: tril(1).

Mistake: query i sees key i + 1, one step into the future.
"""

import math

import torch

EXPECTED = "causal_sees_next"
TARGET = "attention"
LAYOUT = "BHTD"


def attention(q, k, v, attn_mask=None, is_causal=False):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(s, -1) @ v
