"""A varlen function that masks queries to their sequence but lets every query see every packed key.

Mistake: keys are not cut at cu_seqlens_k: sequences attend across their boundaries.
"""

import math

import torch

EXPECTED = "varlen_leak"
TARGET = "varlen_attention"
LAYOUT = "varlen"


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None):
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.size(-1))
    s = q.transpose(0, 1) @ k.transpose(0, 1).transpose(-2, -1) * scale  # (H, total_q, total_k)
    return (torch.softmax(s, -1) @ v.transpose(0, 1)).transpose(0, 1)
