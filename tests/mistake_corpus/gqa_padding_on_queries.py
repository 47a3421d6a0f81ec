"""Grouped-query attention (num_kv_heads K/V heads shared by groups of query heads).

Mistake: Key_padding_mask is broadcast over the query axis ([:, None, :, None]) instead of the key axis.
Line: keep = keep & ~key_padding_mask[:, None, :, None]
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "padding_on_queries"


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, num_kv_heads, dropout=0.0):
        super().__init__()
        assert embed_dim % num_heads == 0 and num_heads % num_kv_heads == 0
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None, is_causal=False):
        B, T_q, _ = query.shape
        T_k = key.shape[1]
        H, H_kv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D)
        k = self.k_proj(key).view(B, T_k, H_kv, D).transpose(1, 2)  # (B, H_kv, T_k, D)
        v = self.v_proj(value).view(B, T_k, H_kv, D).transpose(1, 2)  # (B, H_kv, T_k, D)
        k = k.repeat_interleave(H // H_kv, dim=1)  # (B, H, T_k, D)
        v = v.repeat_interleave(H // H_kv, dim=1)

        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(D))  # (B, H, T_q, T_k)
        keep = torch.ones_like(scores, dtype=torch.bool)
        if attn_mask is not None:  # True = keep
            if attn_mask.dtype == torch.bool:
                keep = keep & attn_mask
            else:
                scores = scores + attn_mask.to(scores.dtype)
                keep = keep & ~torch.isneginf(attn_mask)
        if key_padding_mask is not None:  # True = pad
            keep = keep & ~key_padding_mask[:, None, :, None]
        if is_causal:  # query i sees keys j <= i + T_k - T_q
            causal = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril(diagonal=T_k - T_q)
            keep = keep & causal
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        v = v.masked_fill(~keep.any(dim=2)[..., None], 0.0)  # padded values never leak

        attn = torch.softmax(scores, dim=-1)
        attn = attn.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)  # queries that see nothing
        attn = F.dropout(attn, p=self.dropout, training=self.training)

        out = attn @ v  # (B, H, T_q, D)
        out = out.transpose(1, 2).reshape(B, T_q, self.embed_dim)
        return self.out_proj(out)
