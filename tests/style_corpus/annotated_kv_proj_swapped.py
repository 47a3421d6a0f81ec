"""Multi-headed attention written the way The Annotated Transformer writes it.

Style: a module-level ``attention`` function, a ``clones`` helper, and four ``nn.Linear(d_model, d_model)`` in
``self.linears``, used in order for q, k, v and then the output. The mask is a keep-mask (1/True = may attend) of
shape (B, 1, T_k) for source padding or (B, T_q, T_k) for a decoder; ``mask.unsqueeze(1)`` gives it a head axis.

Mistake: the key and value projections are swapped: keys go through ``self.linears[2]`` and values
through ``self.linears[1]``.
"""

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "kv_proj_swapped"
TARGET = "MultiHeadedAttention"
STYLE = "annotated"
CALL = (
    "forward(query, key, value, mask=None): keep-mask (B,1,T_k) or (B,T_q,T_k), 1/True = keep, unsqueeze(1) for heads"
)


def clones(module, N):
    "N deep copies of one layer, each with its own parameters."
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def attention(query, key, value, mask=None, dropout=None):
    "Scaled dot-product attention over (B, h, T, d_k) tensors; returns the context and the weights."
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)  # (B, h, T_q, T_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)  # (B, h, T_q, T_k)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn  # (B, h, T_q, d_k)


class MultiHeadedAttention(nn.Module):
    def __init__(self, h, d_model, dropout=0.1):
        "h heads of width d_model // h each."
        super().__init__()
        assert d_model % h == 0
        self.d_k = d_model // h  # values get the same width as keys
        self.h = h
        self.linears = clones(nn.Linear(d_model, d_model), 4)
        self.attn = None  # the last weights, kept for plotting
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # (B, 1, 1|T_q, T_k): one mask shared by every head
        nbatches = query.size(0)

        # 1) project and cut d_model into h heads: (B, T, d_model) -> (B, h, T, d_k)
        q_lin, k_lin, v_lin = self.linears[0], self.linears[2], self.linears[1]
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip((q_lin, k_lin, v_lin), (query, key, value), strict=False)
        ]

        # 2) every head attends at once
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)

        # 3) glue the heads back together: (B, h, T_q, d_k) -> (B, T_q, d_model), then the last linear
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query, key, value
        return self.linears[-1](x)
