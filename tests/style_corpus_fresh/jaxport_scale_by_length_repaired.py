"""Multi-head attention ported from JAX/Flax (flax/linen/attention.py's MultiHeadDotProductAttention and dot_product_attention) to PyTorch, the way ports of T5X, big_vision and scenic models write it (the style: see jaxport_correct.py).

Mistake: none. Repaired twin of jaxport_scale_by_length.py: the same code with that one mistake fixed
(depth = query.shape[-1]).
"""

import math
from typing import Optional, Tuple

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "MultiHeadDotProductAttention"
STYLE = "jaxport"
CALL = "forward(inputs_q, inputs_k=None, inputs_v=None, mask=None): inputs (B,T,E); inputs_k defaults to inputs_q and inputs_v to inputs_k; mask bool broadcast to (B,H,T,S) True = attend; einsum bqhd,bkhd->bhqk; kernels as bare Parameters, no nn.Linear"


class DenseGeneral(nn.Module):
    """Flax's DenseGeneral over the last axis: x (..., in) -> (..., *features), kernel (in, *features)."""

    def __init__(self, in_features: int, features: Tuple[int, ...], use_bias: bool = True):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(in_features, *features) * in_features**-0.5)
        self.bias = nn.Parameter(torch.zeros(*features)) if use_bias else None

    def forward(self, x):
        y = torch.einsum("...e,ehd->...hd", x, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        return y


class DenseOut(nn.Module):
    """Flax's DenseGeneral with axis=(-2, -1): x (..., H, D) -> (..., features), kernel (H, D, features)."""

    def __init__(self, num_heads: int, head_dim: int, features: int, use_bias: bool = True):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(num_heads, head_dim, features) * (num_heads * head_dim) ** -0.5)
        self.bias = nn.Parameter(torch.zeros(features)) if use_bias else None

    def forward(self, x):
        y = torch.einsum("...hd,hde->...e", x, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        return y


def dot_product_attention_weights(query, key, bias=None, mask=None):
    """query (..., q, h, d), key (..., k, h, d) -> weights (..., h, q, k)."""
    depth = query.shape[-1]
    query = query / math.sqrt(depth)
    attn_weights = torch.einsum("...qhd,...khd->...hqk", query, key)
    if bias is not None:
        attn_weights = attn_weights + bias
    if mask is not None:
        big_neg = torch.finfo(attn_weights.dtype).min
        attn_weights = torch.where(mask, attn_weights, big_neg)
    return torch.softmax(attn_weights, dim=-1)


def dot_product_attention(query, key, value, bias=None, mask=None):
    attn_weights = dot_product_attention_weights(query, key, bias, mask)
    return torch.einsum("...hqk,...khd->...qhd", attn_weights, value)


class MultiHeadDotProductAttention(nn.Module):
    def __init__(self, num_heads: int, qkv_features: int, out_features: Optional[int] = None, use_bias: bool = True):
        super().__init__()
        assert qkv_features % num_heads == 0, "Memory dimension must be divisible by number of heads."
        self.num_heads = num_heads
        self.head_dim = qkv_features // num_heads
        out_features = out_features or qkv_features
        self.query = DenseGeneral(qkv_features, (num_heads, self.head_dim), use_bias)
        self.key = DenseGeneral(qkv_features, (num_heads, self.head_dim), use_bias)
        self.value = DenseGeneral(qkv_features, (num_heads, self.head_dim), use_bias)
        self.out = DenseOut(num_heads, self.head_dim, out_features, use_bias)

    def forward(self, inputs_q, inputs_k=None, inputs_v=None, mask: Optional[torch.Tensor] = None):
        if inputs_k is None:
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k

        # project inputs_q to multi-headed q/k/v: dimensions are then [batch..., length, n_heads, n_features_per_head]
        query = self.query(inputs_q)
        key = self.key(inputs_k)
        value = self.value(inputs_v)

        x = dot_product_attention(query, key, value, mask=mask)  # (B, T, H, D)
        return self.out(x)
