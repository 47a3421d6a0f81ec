"""Attention in (B, H, T, D) that takes a key padding mask (B, T_k), True = padding, as
nn.MultiheadAttention and Hugging Face models pass one: an argument named a padding mask is expected to mean
True = padding, and the mask's shape is found by calling it.
"""

import math

import torch

EXPECTED = "pass"
TARGET = "padded_attention"
LAYOUT = "BHTD"
FOUND = "mask: key_padding_mask = bool block, shapes (B, T_k)"


def padded_attention(q, k, v, key_padding_mask=None):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T_q, T_k)
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))  # (B, 1, 1, T_k)
    return torch.softmax(s, -1) @ v
