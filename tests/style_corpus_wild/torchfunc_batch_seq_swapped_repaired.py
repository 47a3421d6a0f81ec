"""A module that holds nn.MultiheadAttention's parameters itself and calls torch.nn.functional.multi_head_attention_forward (the style: see torchfunc_correct.py).

Mistake: none. Repaired twin of torchfunc_batch_seq_swapped.py: the same code with that one mistake fixed
(the inputs are transposed to (T, B, E) before the call and the output back after it).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "pass"
TARGET = "FunctionalMultiheadAttention"
STYLE = "torchfunc"
CALL = "forward(query, key, value, key_padding_mask=None, attn_mask=None): batch_first (B,T,E) by default; key_padding_mask (B,S) True/1 = keep, converted to the functional's True = pad; attn_mask (T,S) bool True = blocked or additive float; packed in_proj_weight Parameter"


class FunctionalMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, batch_first=True):
        super().__init__()
        assert embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads"
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first

        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self._reset_parameters()

    def _reset_parameters(self):
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.uniform_(self.in_proj_bias, -0.1, 0.1)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask == 0  # keep (True/1) -> the functional's True = pad

        if self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (T, B, E)

        attn_output, _ = F.multi_head_attention_forward(
            query,
            key,
            value,
            self.embed_dim,
            self.num_heads,
            self.in_proj_weight,
            self.in_proj_bias,
            None,
            None,
            False,
            self.dropout,
            self.out_proj.weight,
            self.out_proj.bias,
            training=self.training,
            key_padding_mask=key_padding_mask,
            need_weights=False,
            attn_mask=attn_mask,
        )
        if self.batch_first:
            attn_output = attn_output.transpose(0, 1)  # (B, T, E)
        return attn_output
