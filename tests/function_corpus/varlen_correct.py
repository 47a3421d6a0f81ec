"""A varlen attention function as flash-attention's flash_attn_varlen_func takes it: packed q (total_q, H, D),
k and v (total_k, H, D), cumulative lengths cu_seqlens_q/cu_seqlens_k (B + 1,), causal bottom-right per
sequence.
"""

import math

import torch

EXPECTED = "pass"
TARGET = "varlen_attention"
LAYOUT = "varlen"
FOUND = "layout packed (total, H, D) with cu_seqlens"


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False):
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.size(-1))
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qb, kb, vb = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)  # (H, T, D)
        s = qb @ kb.transpose(-2, -1) * scale  # (H, T_q, T_k)
        if causal:
            T_q, T_k = qe - qs, ke - ks
            keep = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril(T_k - T_q)
            s = s.masked_fill(~keep, float("-inf"))
        out[qs:qe] = (torch.softmax(s, -1) @ vb).transpose(0, 1)
    return out
