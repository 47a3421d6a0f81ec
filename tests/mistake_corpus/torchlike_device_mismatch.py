"""Batch-first multi-head attention imitating nn.MultiheadAttention's call.

Mistake: the mask is started inside forward with torch.zeros(...) and no device=, so it is made on the
CPU whatever device the inputs are on: right on a CPU, and on a GPU every call raises "Expected all
tensors to be on the same device".
Line: blocked = torch.zeros(B, H, T_q, T_k, dtype=torch.bool)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "device_mismatch"
# Right where the inputs are on the CPU: attnlab check --device cuda finds it (tests/test_check_diagnosis.py
# models that device on a CPU machine).
DEVICE_ONLY = True


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None):
        B, T_q, E = query.shape
        T_k = key.shape[1]
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(query).view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D)
        k = self.k_proj(key).view(B, T_k, H, D).transpose(1, 2)  # (B, H, T_k, D)
        v = self.v_proj(value).view(B, T_k, H, D).transpose(1, 2)  # (B, H, T_k, D)

        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)  # (B, H, T_q, T_k)
        blocked = torch.zeros(B, H, T_q, T_k, dtype=torch.bool)
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # (B*H, T_q, T_k)
                attn_mask = attn_mask.view(B, H, T_q, T_k)
            if attn_mask.dtype == torch.bool:
                blocked = blocked | attn_mask
            else:
                scores = scores + attn_mask.to(scores.dtype)
                blocked = blocked | torch.isneginf(attn_mask)
        if key_padding_mask is not None:  # (B, T_k), True = pad
            blocked = blocked | key_padding_mask[:, None, None, :]
        scores = scores.masked_fill(blocked, float("-inf"))
        v = v.masked_fill(blocked.all(dim=2)[..., None], 0.0)  # padded values never leak

        weights = F.softmax(scores, dim=-1)
        weights = weights.masked_fill(blocked.all(dim=-1, keepdim=True), 0.0)  # all-blocked rows
        weights = F.dropout(weights, p=self.dropout, training=self.training)

        out = torch.matmul(weights, v)  # (B, H, T_q, D)
        out = out.transpose(1, 2).reshape(B, T_q, E)
        out = self.out_proj(out)
        if need_weights:
            return out, weights.mean(dim=1)  # (B, T_q, T_k)
        return out, None
