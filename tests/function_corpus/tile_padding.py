"""A blocked attention in (B, H, T, D) that pads K and V with zeros to whole tiles of 32 keys and never
masks the padding, as a kernel whose loads use other=0.0 without masking the scores.

Mistake: every padded key scores 0 and takes a share of the weights.
"""

import math

import torch

EXPECTED = "tile_padding_unmasked"
TARGET = "blocked_attention"
LAYOUT = "BHTD"

BLOCK = 32


def blocked_attention(q, k, v, causal=False):
    B, H, T_q, D = q.shape
    T_k = k.size(2)
    pad = (-T_k) % BLOCK
    k = torch.cat([k, k.new_zeros(B, H, pad, D)], 2)  # (B, H, T_k + pad, D): zero keys, not masked
    v = torch.cat([v, v.new_zeros(B, H, pad, D)], 2)
    s = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T_q, T_k + pad)
    if causal:
        i = torch.arange(T_q)[:, None] + T_k - T_q
        s = s.masked_fill(torch.arange(T_k + pad)[None, :] > i, float("-inf"))  # the future, padding included
    return torch.softmax(s, -1) @ v
