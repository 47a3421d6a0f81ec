"""A flash-attention style (B, T, H, D) function documented as flash-attention >= 2.1 (causal aligned
bottom-right, for decoding with a KV cache) whose causal mask is built with tril(): top-left.

Mistake: with T_q < T_k, query i sees keys j <= i instead of j <= i + T_k - T_q.
"""

import math

import torch

EXPECTED = "causal_alignment"
TARGET = "flash_attn_func"
LAYOUT = "BTHD"
CAUSAL_ALIGNMENT = "bottom-right"


def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    scale = softmax_scale or 1 / math.sqrt(q.size(-1))
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        keep = torch.ones(q.size(2), k.size(2), dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)
