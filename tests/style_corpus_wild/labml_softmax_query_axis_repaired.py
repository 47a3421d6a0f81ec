"""Multi-head attention written the way labml.ai's annotated implementations (labml_nn/transformers/mha.py) write it (the style: see labml_correct.py).

Mistake: none. Repaired twin of labml_softmax_query_axis.py: the same code with that one mistake fixed
(nn.Softmax(dim=1), the keys).
"""

import math
from typing import List, Optional

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "MultiHeadAttention"
STYLE = "labml"
CALL = "forward(*, query, key, value, mask=None): keyword-only, time-first [T,B,E]; mask [T_q or 1, T_k, B] 1/True = keep; scores laid out [i, j, b, h]"


class PrepareForMultiHeadAttention(nn.Module):
    """A linear transformation split into heads: [seq_len, batch_size, d_model] -> [seq_len, batch_size, heads, d_k]."""

    def __init__(self, d_model: int, heads: int, d_k: int, bias: bool):
        super().__init__()
        self.linear = nn.Linear(d_model, heads * d_k, bias=bias)
        self.heads = heads
        self.d_k = d_k

    def forward(self, x: torch.Tensor):
        head_shape = x.shape[:-1]
        x = self.linear(x)
        x = x.view(*head_shape, self.heads, self.d_k)
        return x


class MultiHeadAttention(nn.Module):
    def __init__(self, heads: int, d_model: int, dropout_prob: float = 0.1, bias: bool = True):
        super().__init__()
        self.d_k = d_model // heads
        self.heads = heads

        self.query = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.key = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=bias)
        self.value = PrepareForMultiHeadAttention(d_model, heads, self.d_k, bias=True)

        # softmax along the key (time) dimension of [seq_len_q, seq_len_k, batch_size, heads]
        self.softmax = nn.Softmax(dim=1)
        self.output = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout_prob)
        self.scale = 1 / math.sqrt(self.d_k)
        self.attn = None

    def get_scores(self, query: torch.Tensor, key: torch.Tensor):
        return torch.einsum("ibhd,jbhd->ijbh", query, key)

    def prepare_mask(self, mask: torch.Tensor, query_shape: List[int], key_shape: List[int]):
        assert mask.shape[0] == 1 or mask.shape[0] == query_shape[0]
        assert mask.shape[1] == key_shape[0]
        assert mask.shape[2] == 1 or mask.shape[2] == query_shape[1]
        # same mask for all heads: [seq_len_q, seq_len_k, batch_size, heads]
        mask = mask.unsqueeze(-1)
        return mask

    def forward(
        self,
        *,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
    ):
        seq_len, batch_size, _ = query.shape

        if mask is not None:
            mask = self.prepare_mask(mask, query.shape, key.shape)

        query = self.query(query)
        key = self.key(key)
        value = self.value(value)

        scores = self.get_scores(query, key)
        scores *= self.scale

        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))

        attn = self.softmax(scores)
        attn = self.dropout(attn)

        x = torch.einsum("ijbh,jbhd->ibhd", attn, value)
        self.attn = attn.detach()
        x = x.reshape(seq_len, batch_size, -1)
        return self.output(x)
