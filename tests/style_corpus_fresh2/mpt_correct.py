"""Causal self-attention with ALiBi, written the way MosaicML's llm-foundry (MPT's attention.py) writes it.

Style: ``MultiheadAttention(d_model, n_heads, ...)`` with keyword arguments as llm-foundry's constructor takes them
(``softmax_scale``, ``attn_pdrop``, ``alibi``, ``alibi_bias_max``). One fused ``Wqkv`` Linear, cut with
``qkv.chunk(3, dim=2)``; heads split in a module-level functional ``scaled_multihead_dot_product_attention`` by
``view`` and ``permute`` (K straight to (B, H, D, S), no transpose at the product). ALiBi as llm-foundry builds it:
``build_alibi_bias(n_heads, seq_len)`` returns a (1, H, 1, S) bias, the slopes ``1 / 2^(8 (h + 1) / H)`` times
``arange(1 - S, 1)`` (the key's offset from the last position), added to the scaled scores; softmax's shift
invariance makes it -slope * distance per query. Causal by default (``is_causal``): a bool upper triangle filled
with finfo.min after the bias; a 2D ``attention_mask`` (B, S), True = keep, fills padded keys the same way.
``forward(x, attention_mask=None)`` returns (output, weights, None), as llm-foundry's returns a past key value.

Mistake: none.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "pass"
TARGET = "MultiheadAttention"
STYLE = "mpt"
CALL = "forward(x, attention_mask=None): causal (is_causal=True); attention_mask (B,S) bool True = keep; ALiBi (1,H,1,S) from arange(1-S, 1) * slopes added after the scale; Wqkv chunk(3); returns (output, weights, None)"
POSITIONS = "alibi"


def gen_slopes(n_heads: int, alibi_bias_max: int = 8, device=None) -> torch.Tensor:
    _n_heads = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, _n_heads + 1, dtype=torch.float32, device=device)
    m = m.mul(alibi_bias_max / _n_heads)
    slopes = 1.0 / torch.pow(2, m)
    if _n_heads != n_heads:
        # the odd slopes of the next power of two first, then the even ones
        slopes = torch.concat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes.view(1, n_heads, 1, 1)


def build_alibi_bias(n_heads: int, seq_len: int, alibi_bias_max: int = 8, device=None, dtype=None) -> torch.Tensor:
    alibi_bias = torch.arange(1 - seq_len, 1, dtype=torch.int32, device=device).view(1, 1, 1, seq_len)
    slopes = gen_slopes(n_heads, alibi_bias_max, device=device)
    alibi_bias = alibi_bias * slopes
    return alibi_bias.to(dtype=dtype)


def scaled_multihead_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    n_heads: int,
    softmax_scale: Optional[float] = None,
    attn_bias: Optional[torch.Tensor] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    training: bool = False,
):
    b, s_q, d_model = query.shape
    s_k = key.size(1)
    head_dim = d_model // n_heads
    q = query.view(b, s_q, n_heads, head_dim).permute(0, 2, 1, 3)  # b h s d
    k = key.view(b, s_k, n_heads, head_dim).permute(0, 2, 3, 1)  # b h d s
    v = value.view(b, s_k, n_heads, head_dim).permute(0, 2, 1, 3)  # b h s d

    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(head_dim)
    attn_weight = q.matmul(k) * softmax_scale

    if attn_bias is not None:
        attn_weight = attn_weight + attn_bias[:, :, -s_q:, -s_k:]

    min_val = torch.finfo(q.dtype).min
    if key_padding_mask is not None:
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view((b, 1, 1, s_k)), min_val)
    if is_causal and s_q > 1:
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float32)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)

    attn_weight = torch.softmax(attn_weight, dim=-1)
    if dropout_p:
        attn_weight = F.dropout(attn_weight, p=dropout_p, training=training, inplace=True)

    out = attn_weight.to(v.dtype).matmul(v)
    out = out.permute(0, 2, 1, 3).reshape(b, s_q, d_model)  # b s (h d)
    return out, attn_weight


class MultiheadAttention(nn.Module):
    def __init__(
        self,
        d_model: int = 32,
        n_heads: int = 4,
        softmax_scale: Optional[float] = None,
        attn_pdrop: float = 0.0,
        alibi: bool = True,
        alibi_bias_max: int = 8,
        is_causal: bool = True,
    ):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.softmax_scale = softmax_scale
        if self.softmax_scale is None:
            self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.attn_dropout_p = attn_pdrop
        self.alibi = alibi
        self.alibi_bias_max = alibi_bias_max
        self.is_causal = is_causal
        self.Wqkv = nn.Linear(self.d_model, 3 * self.d_model)
        self.out_proj = nn.Linear(self.d_model, self.d_model)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        qkv = self.Wqkv(x)
        query, key, value = qkv.chunk(3, dim=2)
        attn_bias = None
        if self.alibi:
            attn_bias = build_alibi_bias(self.n_heads, x.size(1), self.alibi_bias_max, device=x.device, dtype=x.dtype)
        context, attn_weights = scaled_multihead_dot_product_attention(
            query,
            key,
            value,
            self.n_heads,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            key_padding_mask=attention_mask,
            is_causal=self.is_causal,
            dropout_p=self.attn_dropout_p,
            training=self.training,
        )
        return self.out_proj(context), attn_weights, None
