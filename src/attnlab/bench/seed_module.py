"""Seed 000's ``MultiHeadAttention``, kept as the user's post wrote it, as a benchmark peer.

It is the starting point attnlab is measured against (``attnlab bench``): four ``nn.Linear``,
``view`` + ``transpose`` into heads, an explicit ``QK^T / sqrt(d)``, ``masked_fill(mask == 0,
-1e9)``, softmax, dropout, weighted sum, ``contiguous().view()`` merge. Not used by attnlab
itself. (Comments translated; the code's behaviour is the seed's.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SeedMultiHeadAttention(nn.Module):
    """Seed 000's module: ``forward(x_query, x_context, mask=None)``; mask 0 = blocked."""

    def __init__(self, model_dim: int, num_heads: int, dropout_p: float = 0.0) -> None:
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

    def forward(
        self, x_query: torch.Tensor, x_context: torch.Tensor | None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
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
