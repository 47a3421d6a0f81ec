"""A flash-attention style function in plain PyTorch: (B, T, H, D) tensors, an online softmax over key
tiles of 32, softmax_scale and a causal flag aligned bottom-right (flash-attention >= 2.1), and GQA by
K/V with fewer heads than q.
"""

import math

import torch

EXPECTED = "pass"
TARGET = "flash_attn_func"
LAYOUT = "BTHD"
FOUND = "causal: causal=True, bottom-right"

BLOCK = 32


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    B, T_q, H, D = q.shape
    T_k, G = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(D)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|G, T, D)
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)  # (B, H, T_k, D)
    m = torch.full((B, H, T_q, 1), float("-inf"), dtype=q.dtype, device=q.device)
    denom = torch.zeros(B, H, T_q, 1, dtype=q.dtype, device=q.device)
    acc = torch.zeros(B, H, T_q, D, dtype=q.dtype, device=q.device)
    i = torch.arange(T_q, device=q.device)[:, None] + (T_k - T_q)  # the query's absolute position
    for start in range(0, T_k, BLOCK):
        s = q @ k[:, :, start : start + BLOCK].transpose(-2, -1) * scale  # (B, H, T_q, block)
        if causal:
            j = torch.arange(start, min(start + BLOCK, T_k), device=q.device)[None, :]
            s = s.masked_fill(j > i, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = m_new.masked_fill(m_new.isinf(), 0.0)
        p = torch.exp(s - safe)
        alpha = torch.exp(m - safe)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ v[:, :, start : start + BLOCK]
        m = m_new
    return (acc / denom).transpose(1, 2)  # (B, T_q, H, D)
