"""Causal self-attention with a packed Wqkv and QK layer norm, written the way MosaicML's llm-foundry (MPT's attention.py) writes it.

Style: ``MultiheadAttention(d_model, n_heads, attn_impl="torch", clip_qkv=None, qk_ln=True, softmax_scale=None,
attn_pdrop=0.0, norm_type="layernorm", fc_type="torch", device=None)``. One ``Wqkv`` linear packs queries, keys and
values; with ``qk_ln`` a LayerNorm over the full width (not per head) normalises queries (``q_ln``) and keys
(``k_ln``); ``clip_qkv`` clamps the packed projection. A free function
``scaled_multihead_dot_product_attention`` does the rest in einops-like steps written by hand: q as
(b, h, s, d), k already transposed to (b, h, d, s), ``q.matmul(k) * softmax_scale``, an additive ``attn_bias``,
a bool ``key_padding_mask`` (True keep) through ``masked_fill`` with finfo.min, a causal mask built as
``ones(s, s).tril()`` cut to the last s_q rows, softmax, dropout, times v, and back to (b, s, h*d).
``forward(x, past_key_value=None, attn_bias=None, attention_mask=None, is_causal=True, needs_weights=False)``;
returns (out_proj(context), attn_weights, past_key_value).

Mistake: none.
"""

import math
import warnings
from typing import Optional

import torch
import torch.nn as nn

EXPECTED = "pass"
TARGET = "MultiheadAttention"
STYLE = "mpt"
CALL = "forward(x, past_key_value=None, attn_bias=None, attention_mask=None, is_causal=True, needs_weights=False): attention_mask bool (B,T) True keep; causal by default; returns (output, attn_weights, past_key_value)"


def _split_heads(t: torch.Tensor, n_heads: int, transpose_last: bool = False) -> torch.Tensor:
    b, s, hd = t.shape
    t = t.view(b, s, n_heads, hd // n_heads)
    return t.permute(0, 2, 3, 1) if transpose_last else t.permute(0, 2, 1, 3)


def scaled_multihead_dot_product_attention(
    query,
    key,
    value,
    n_heads,
    kv_n_heads,
    past_key_value=None,
    softmax_scale=None,
    attn_bias=None,
    key_padding_mask=None,
    is_causal=False,
    dropout_p=0.0,
    training=False,
    needs_weights=False,
):
    q = _split_heads(query, n_heads)  # (b, h, s_q, d)
    k = _split_heads(key, kv_n_heads, transpose_last=True)  # (b, h_kv, d, s_k)
    v = _split_heads(value, kv_n_heads)  # (b, h_kv, s_k, d)

    if past_key_value is not None:
        if len(past_key_value) != 0:
            k = torch.cat([past_key_value[0], k], dim=3)
            v = torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (k, v)

    b, _, s_q, d = q.shape
    s_k = k.size(-1)

    if kv_n_heads > 1 and kv_n_heads < n_heads:
        k = k.repeat_interleave(n_heads // kv_n_heads, dim=1)
        v = v.repeat_interleave(n_heads // kv_n_heads, dim=1)

    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)

    attn_weight = q.matmul(k) * softmax_scale

    if attn_bias is not None:
        _s_q = max(0, attn_bias.size(2) - s_q)
        _s_k = max(0, attn_bias.size(3) - s_k)
        attn_bias = attn_bias[:, :, _s_q:, _s_k:]
        attn_weight = attn_weight + attn_bias

    min_val = torch.finfo(q.dtype).min

    if key_padding_mask is not None:
        if attn_bias is not None:
            warnings.warn(
                "Propagating key_padding_mask to the attention module and applying it within the attention module can cause unnecessary computation/memory usage."
            )
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view((b, 1, 1, s_k)), min_val)

    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float32)
        causal_mask = causal_mask.tril()
        causal_mask = causal_mask.to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)

    attn_weight = torch.softmax(attn_weight, dim=-1)

    if dropout_p:
        attn_weight = torch.nn.functional.dropout(attn_weight, p=dropout_p, training=training, inplace=True)

    out = attn_weight.to(v.dtype).matmul(v)
    out = out.permute(0, 2, 1, 3).reshape(b, s_q, n_heads * d)

    if needs_weights:
        return out, attn_weight, past_key_value
    return out, None, past_key_value


class MultiheadAttention(nn.Module):
    """Multi-head self attention (one key/value head per query head)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        attn_impl: str = "torch",
        clip_qkv: Optional[float] = None,
        qk_ln: bool = True,
        softmax_scale: Optional[float] = None,
        attn_pdrop: float = 0.0,
        norm_type: str = "layernorm",
        fc_type: str = "torch",
        device: Optional[str] = None,
    ):
        super().__init__()
        self.attn_impl = attn_impl
        self.clip_qkv = clip_qkv
        self.qk_ln = qk_ln
        self.d_model = d_model
        self.n_heads = n_heads
        self.kv_n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.softmax_scale = softmax_scale
        if self.softmax_scale is None:
            self.softmax_scale = 1 / math.sqrt(self.d_model / self.n_heads)
        self.attn_dropout_p = attn_pdrop

        self.Wqkv = nn.Linear(self.d_model, self.d_model + 2 * self.kv_n_heads * self.head_dim, device=device)
        fuse_splits = [i * self.head_dim for i in range(1, self.n_heads + 2 * self.kv_n_heads)]
        self.Wqkv._fused = (0, fuse_splits)

        if self.qk_ln:
            self.q_ln = nn.LayerNorm(self.d_model, device=device)
            self.k_ln = nn.LayerNorm(self.kv_n_heads * self.head_dim, device=device)

        self.attn_fn = scaled_multihead_dot_product_attention
        self.out_proj = nn.Linear(self.d_model, self.d_model, device=device)
        self.out_proj._is_residual = True

    def forward(self, x, past_key_value=None, attn_bias=None, attention_mask=None, is_causal=True, needs_weights=False):
        qkv = self.Wqkv(x)

        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)

        query, key, value = qkv.split(
            [self.d_model, self.kv_n_heads * self.head_dim, self.kv_n_heads * self.head_dim], dim=2
        )

        key_padding_mask = attention_mask

        if self.qk_ln:
            dtype = query.dtype
            query = self.q_ln(query).to(dtype)
            key = self.k_ln(key).to(dtype)

        context, attn_weights, past_key_value = self.attn_fn(
            query,
            key,
            value,
            self.n_heads,
            self.kv_n_heads,
            past_key_value=past_key_value,
            softmax_scale=self.softmax_scale,
            attn_bias=attn_bias,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            dropout_p=self.attn_dropout_p,
            training=self.training,
            needs_weights=needs_weights,
        )

        return self.out_proj(context), attn_weights, past_key_value
