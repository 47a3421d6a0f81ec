"""Seed 000: the blog's full MultiHeadAttention code exactly as published.

Mistake: masked scores are filled with -1e9 and all-masked rows are not zeroed, so they average all values.
Line: scores = scores.masked_fill(mask == 0, -1e9)
Also wrong: -1e9 does not fit in float16 (masked_fill raises), and padded value rows are not zeroed.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "fully_masked_uniform"
ALSO = ["fill_overflows_half", "padded_values_nan"]


class MultiHeadAttention(nn.Module):
    """
    多头注意力模块
    支持自注意力（Self-Attention）和交叉注意力（Cross-Attention）：
    - 自注意力：Q = K = V = x_query
    - 交叉注意力：Q = x_query, K = V = x_context
    """

    def __init__(self, model_dim, num_heads, dropout_p=0.0):
        super().__init__()
        assert model_dim % num_heads == 0, "model_dim must be divisible by num_heads"
        self.model_dim = model_dim
        self.num_heads = num_heads
        self.head_dim = model_dim // num_heads
        self.w_q = nn.Linear(model_dim, model_dim)
        self.w_k = nn.Linear(model_dim, model_dim)
        self.w_v = nn.Linear(model_dim, model_dim)
        self.w_o = nn.Linear(model_dim, model_dim)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, x_query, x_context, mask=None):
        # x_query: [batch_size, seq_len_q, model_dim]; x_context: [batch_size, seq_len_k, model_dim]
        # mask: [batch_size, 1, seq_len_q, seq_len_k] 或 [1, 1, seq_len_q, seq_len_k]
        batch_size = x_query.size(0)
        q = self.w_q(x_query)
        if x_context is not None:
            k = self.w_k(x_context)
            v = self.w_v(x_context)
        else:
            k = self.w_k(x_query)
            v = self.w_v(x_query)
        q = q.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        attn_weights = F.softmax(scores, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context = torch.matmul(attn_weights, v)
        context = context.transpose(1, 2)
        context = context.contiguous()
        output = context.view(batch_size, -1, self.model_dim)
        output = self.w_o(output)
        return output
