"""Multi-head attention written the way d2l.ai (Dive into Deep Learning) writes it.

Style: ``masked_softmax`` fills the keys at and past each valid length with -1e6; ``DotProductAttention`` works on
(B * num_heads, T, d) batches; ``transpose_qkv`` / ``transpose_output`` fold the heads into the batch axis and back;
every projection is an ``nn.LazyLinear(num_hiddens, bias=bias)``, so the weights exist only after the first call.
valid_lens is (B,) (one length per sequence) or (B, T_q) (one per query) and is repeated per head with
``torch.repeat_interleave`` so that folded row b * num_heads + h keeps sequence b's lengths.

Mistake: the values are projected with W_k.
Line: values = transpose_qkv(self.W_k(values), self.num_heads)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "v_uses_k_proj"
TARGET = "MultiHeadAttention"
STYLE = "d2l"
CALL = "forward(queries, keys, values, valid_lens): valid_lens (B,) or (B,T_q) ints, key j of a row kept iff j < length; None = no mask"


def sequence_mask(X, valid_len, value=0):
    """Set X[i, j] to value for every j >= valid_len[i]; X is (N, T)."""
    maxlen = X.size(1)
    mask = torch.arange(maxlen, dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]  # (N, T)
    return X.masked_fill(~mask, value)


def masked_softmax(X, valid_lens):
    """Softmax over the last axis of X (N, T_q, T_k), the keys past each valid length masked out."""
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])  # one length per query row
    else:
        valid_lens = valid_lens.reshape(-1)
    # a large negative score rather than -inf: its exponential is 0 and no row turns into NaN
    X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)  # (N * T_q, T_k)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention on (N, T, d) batches."""

    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)  # (N, T_q, T_k)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)  # (N, T_q, d)


def transpose_qkv(X, num_heads):
    """(B, T, num_hiddens) -> (B * num_heads, T, num_hiddens / num_heads), for parallel heads."""
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1)  # (B, T, num_heads, d)
    X = X.permute(0, 2, 1, 3)  # (B, num_heads, T, d)
    return X.reshape(-1, X.shape[2], X.shape[3])  # (B * num_heads, T, d)


def transpose_output(X, num_heads):
    """Undo transpose_qkv: (B * num_heads, T, d) -> (B, T, num_hiddens)."""
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2])  # (B, num_heads, T, d)
    X = X.permute(0, 2, 1, 3)  # (B, T, num_heads, d)
    return X.reshape(X.shape[0], X.shape[1], -1)  # (B, T, num_hiddens)


class MultiHeadAttention(nn.Module):
    """Multi-head attention; num_hiddens is both the projected width and the output width."""

    def __init__(self, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

    def forward(self, queries, keys, values, valid_lens):
        # queries: (B, T_q, ·); keys, values: (B, T_k, ·); valid_lens: (B,) or (B, T_q)
        queries = transpose_qkv(self.W_q(queries), self.num_heads)  # (B * num_heads, T_q, d)
        keys = transpose_qkv(self.W_k(keys), self.num_heads)  # (B * num_heads, T_k, d)
        values = transpose_qkv(self.W_k(values), self.num_heads)  # (B * num_heads, T_k, d)
        if valid_lens is not None:
            # folded row b * num_heads + h is sequence b: each length is repeated num_heads times in place
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)  # (B * num_heads, T_q, d)
        output_concat = transpose_output(output, self.num_heads)  # (B, T_q, num_hiddens)
        return self.W_o(output_concat)
