"""Seed 002 style, one mistake: Q is computed with k_proj.

Mistake: the query goes through the key projection.
Line: q = self.k_proj(query).view(B, T_q, H, D).transpose(1, 2)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "q_uses_k_proj"


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        assert embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads"
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = nn.Dropout(dropout)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        for proj in [self.q_proj, self.k_proj, self.v_proj, self.out_proj]:
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.constant_(proj.bias, 0.0)

    def forward(self, query, key, value, attn_mask=None, need_weights=False):
        B, T_q, _ = query.shape
        T_k = key.size(1)
        H, D = self.num_heads, self.head_dim
        # 1. 线性投影 + 拆分成多头: (B, T, E) -> (B, T, H, D) -> (B, H, T, D)
        q = self.k_proj(query).view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D)
        k = self.k_proj(key).view(B, T_k, H, D).transpose(1, 2)  # (B, H, T_k, D)
        v = self.v_proj(value).view(B, T_k, H, D).transpose(1, 2)  # (B, H, T_k, D)

        # 2. 缩放点积: 除以 sqrt(head_dim)
        scores = q @ k.transpose(-2, -1) / math.sqrt(D)  # (B, H, T_q, T_k)
        keep = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                keep = attn_mask.expand_as(scores)  # True 表示保留
            else:
                scores = scores + attn_mask.to(scores.dtype)  # additive mask
                keep = ~torch.isneginf(attn_mask).expand_as(scores)
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
            # keys that no query may see (padding): zero them so NaN/inf cannot leak
            v = v.masked_fill(~keep.any(dim=-2)[..., None], 0.0)

        # 3. softmax (half 精度时在 float32 里算) + dropout
        acc = torch.promote_types(scores.dtype, torch.float32)
        attn_weights = torch.softmax(scores, dim=-1, dtype=acc).to(scores.dtype)
        if keep is not None:  # a query with no visible key gets a zero context
            attn_weights = attn_weights.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
        attn_weights = self.dropout(attn_weights)

        out = attn_weights @ v  # (B, H, T_q, D)
        # 4. 合并多头: transpose -> contiguous -> view
        out = out.transpose(1, 2).contiguous().view(B, T_q, self.embed_dim)
        out = self.out_proj(out)
        if need_weights:
            return out, attn_weights
        return out
