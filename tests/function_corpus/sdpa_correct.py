"""Scaled dot-product attention written by hand with SDPA's signature and conventions.

q (B, H, T_q, D), k and v (B, G, T_k, D); attn_mask bool (True = may attend) or additive float, broadcast
to (B, H, T_q, T_k); is_causal top-left (query i sees keys j <= i, as torch's SDPA); enable_gqa repeats each
K/V head H/G times in a row.
"""

import math

import torch

EXPECTED = "pass"
TARGET = "attention"
LAYOUT = "BHTD"
FOUND = "mask: attn_mask = bool keep"


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    T_q, T_k = q.size(-2), k.size(-2)
    scale = 1 / math.sqrt(q.size(-1)) if scale is None else scale
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)  # (B, H, T_k, D)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, T_q, T_k)
    if is_causal:
        keep = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    weights = torch.dropout(weights, dropout_p, train=dropout_p > 0)
    return weights @ v  # (B, H, T_q, D)
