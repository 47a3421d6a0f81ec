"""Multi-headed attention written the way OpenNMT-py's onmt/modules/multi_headed_attn.py writes it (the style: see opennmt_correct.py).

Mistake: none. Repaired twin of opennmt_padding_inverted.py: the same code with that one mistake fixed
(scores.masked_fill(mask, -1e18), True = masked).
"""

import math

import torch
import torch.nn as nn

EXPECTED = "pass"
TARGET = "MultiHeadedAttention"
STYLE = "opennmt"
CALL = "forward(key, value, query, mask=None): argument order key, value, query, each (B,len,E); mask bool (B,1,S) or (B,T,S) True = masked, filled -1e18; returns (output, first head's weights)"


class MultiHeadedAttention(nn.Module):
    """Multi-Head Attention module from "Attention is All You Need"."""

    def __init__(self, head_count, model_dim, dropout=0.1):
        assert model_dim % head_count == 0
        self.dim_per_head = model_dim // head_count
        self.model_dim = model_dim

        super(MultiHeadedAttention, self).__init__()
        self.head_count = head_count

        self.linear_keys = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_values = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.linear_query = nn.Linear(model_dim, head_count * self.dim_per_head)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)
        self.final_linear = nn.Linear(model_dim, model_dim)

    def forward(self, key, value, query, mask=None):
        batch_size = key.size(0)
        dim_per_head = self.dim_per_head
        head_count = self.head_count
        key_len = key.size(1)
        query_len = query.size(1)

        def shape(x):
            """projection -> (batch, head, len, dim_per_head)"""
            return x.view(batch_size, -1, head_count, dim_per_head).transpose(1, 2)

        def unshape(x):
            """(batch, head, len, dim_per_head) -> (batch, len, model_dim)"""
            return x.transpose(1, 2).contiguous().view(batch_size, -1, head_count * dim_per_head)

        key = shape(self.linear_keys(key))
        value = shape(self.linear_values(value))
        query = shape(self.linear_query(query))

        query = query / math.sqrt(dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3))  # (batch, head, query_len, key_len)

        if mask is not None:
            mask = mask.unsqueeze(1)  # [B, 1, 1|T_q, T_k]
            scores = scores.masked_fill(mask, -1e18)

        attn = self.softmax(scores)
        drop_attn = self.dropout(attn)
        context = unshape(torch.matmul(drop_attn, value))

        output = self.final_linear(context)
        top_attn = attn.view(batch_size, head_count, query_len, key_len)[:, 0, :, :].contiguous()
        return output, top_attn
