"""An online-softmax loop over key tiles of 64 in (B, T, H, D) that tracks the running maximum but never
rescales the accumulator when the maximum grows.

Mistake: acc = acc + p @ v without acc * exp(m - m_new) first (l is rescaled).
"""

import math

import torch

EXPECTED = "online_softmax_no_rescale"
TARGET = "attn"
LAYOUT = "BTHD"

BLOCK = 64


def attn(q, k, v, causal=False):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
    T_q, T_k = q.size(2), k.size(2)
    m = torch.full((*q.shape[:-1], 1), float("-inf"), dtype=q.dtype)
    denom = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for start in range(0, T_k, BLOCK):
        s = q @ k[:, :, start : start + BLOCK].transpose(-2, -1) / math.sqrt(q.size(-1))
        if causal:
            j = torch.arange(start, min(start + BLOCK, T_k))[None, :]
            i = torch.arange(T_q)[:, None] + T_k - T_q
            s = s.masked_fill(j > i, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = m_new.masked_fill(m_new.isinf(), 0.0)
        p = torch.exp(s - safe)
        denom = denom * torch.exp(m - safe) + p.sum(-1, keepdim=True)
        acc = acc + p @ v[:, :, start : start + BLOCK]  # the mistake: acc is never rescaled
        m = m_new
    return (acc / denom).transpose(1, 2)
