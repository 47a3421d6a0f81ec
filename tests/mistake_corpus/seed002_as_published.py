"""Seed 002, section 2.2: the blog's MultiHeadAttention exactly as published.

Mistake: softmax is hard-cast to float32, so a float64 module computes its weights in float32.
Line: attn_weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
Also wrong: -inf fill with no handling of all-masked rows (NaN), and padded value rows are not zeroed.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "float64_downcast"
ALSO = ["fully_masked_nan", "padded_values_nan"]


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        assert embed_dim % num_heads == 0, f"embed_dim({embed_dim}) must be divisible by num_heads({num_heads})"
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = nn.Dropout(dropout)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self._reset_parameters()

    def _reset_parameters(self):
        # Transformer 里常见的初始化方式，保证训练初期更稳定
        for proj in [self.q_proj, self.k_proj, self.v_proj, self.out_proj]:
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.constant_(proj.bias, 0.0)

    def forward(self, query, key, value, attn_mask=None, need_weights=False):
        B, T_q, _ = query.shape
        T_k = key.size(1)
        H = self.num_heads
        D = self.head_dim
        # 1. 线性投影
        q = self.q_proj(query)  # (B, T_q, embed_dim)
        k = self.k_proj(key)  # (B, T_k, embed_dim)
        v = self.v_proj(value)  # (B, T_k, embed_dim)
        # 2. 拆分成多头，并调整张量维度顺序
        # view: (B, T, embed_dim) -> (B, T, H, D); transpose: (B, T, H, D) -> (B, H, T, D)
        q = q.view(B, T_q, H, D).transpose(1, 2)
        k = k.view(B, T_k, H, D).transpose(1, 2)
        v = v.view(B, T_k, H, D).transpose(1, 2)
        # 3. 计算缩放点积注意力分数
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # scores: (B, H, T_q, T_k)
        # 4. 处理 mask
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                # True 表示保留，False 表示 mask 掉
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                # float 类型作为 additive mask，直接加到分数上
                scores = scores + attn_mask
        # 5. softmax + dropout
        attn_weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
        attn_weights = attn_weights.to(scores.dtype)
        attn_weights = self.dropout(attn_weights)
        # 6. 加权聚合
        out = attn_weights @ v  # (B, H, T_q, D)
        # 7. 把头维度合并回特征维度
        out = out.transpose(1, 2).contiguous().view(B, T_q, self.embed_dim)
        # 8. 输出投影
        out = self.out_proj(out)
        if need_weights:
            return out, attn_weights
        return out
