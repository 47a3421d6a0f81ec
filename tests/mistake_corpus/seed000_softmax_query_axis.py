"""Multi-head attention in the style of seed 000 (model_dim / w_q ... w_o, x_context).

Mistake: Softmax is taken over the query axis (dim=-2) instead of the key axis.
Line: attn_weights = F.softmax(scores, dim=-2)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "softmax_query_axis"


class MultiHeadAttention(nn.Module):
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
        batch_size = x_query.size(0)
        if x_context is None:  # self-attention
            x_context = x_query
        q = self.w_q(x_query)  # [B, T_q, model_dim]
        k = self.w_k(x_context)  # [B, T_k, model_dim]
        v = self.w_v(x_context)  # [B, T_k, model_dim]

        # 分头: [B, T, model_dim] -> [B, T, H, d] -> [B, H, T, d]
        q = q.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T_q, d]
        k = k.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T_k, d]
        v = v.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T_k, d]

        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)  # [B, H, T_q, T_k]
        if mask is not None:  # mask 为 0 的位置不能看
            keep = (mask != 0).expand_as(scores)
            scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
            v = v.masked_fill(~keep.any(dim=-2)[..., None], 0.0)  # never-visible keys

        attn_weights = F.softmax(scores, dim=-2)
        if mask is not None:  # a query that sees nothing gets zeros
            attn_weights = attn_weights.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
        attn_weights = self.dropout(attn_weights)

        context = torch.matmul(attn_weights, v)  # [B, H, T_q, d]
        # 合并多头: transpose(1, 2) 之后要 contiguous() 才能 view
        context = context.transpose(1, 2).contiguous()
        output = context.view(batch_size, -1, self.model_dim)
        return self.w_o(output)
