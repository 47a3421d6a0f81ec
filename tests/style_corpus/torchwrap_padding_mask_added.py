"""A self-attention layer wrapping nn.MultiheadAttention, written the way the PyTorch tutorials write one.

Style: the user module holds ``self.attn = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout,
batch_first=True)`` and passes both masks straight through, in nn.MultiheadAttention's own convention:
key_padding_mask (B, T) with True = padding, attn_mask (T, T) bool with True = may NOT attend (or additive float).
It returns the attention output only (need_weights=False).

Mistake: key_padding_mask is turned into a float (to silence the warning about mixed mask types), and
nn.MultiheadAttention adds a float mask to the scores: padded keys get +1.0 instead of being blocked.
Line: key_padding_mask = key_padding_mask.float()
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "padding_mask_added"
TARGET = "SelfAttention"
STYLE = "torchwrap"
CALL = "forward(x, key_padding_mask=None, attn_mask=None): x (B,T,E); key_padding_mask (B,T) True = pad; attn_mask (T,T) bool True = blocked; returns output only"


class SelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        # x arrives as (batch, seq, feature)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True)

    def forward(self, x, key_padding_mask=None, attn_mask=None):
        # x: (B, T, E); key_padding_mask: (B, T), True = pad; attn_mask: (T, T), True = blocked
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.float()  # same type as a float attn_mask
        out, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)
        return out  # (B, T, E)
