"""Multi-head attention with a packed in_proj_weight Parameter laid out (p h d), written the way Meta's audiocraft (audiocraft/modules/transformer.py, StreamingMultiheadAttention with custom=True) writes it (the style: see audiocraft_correct.py).

Mistake: the packed projection is cut as b t (p d h): within each part head h takes features h, h + H, ... instead of the block h*D .. (h+1)*D.
Line: packed = projected.view(b, t, 3, -1, self.num_heads).transpose(-1, -2)
"""

import math
import typing as tp

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "heads_interleaved"
TARGET = "StreamingMultiheadAttention"
STYLE = "audiocraft"
CALL = "forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None, ...): batch-first self-attention on query (key and value must be the query unless cross_attention); no mask; returns (output, None)"


class StreamingMultiheadAttention(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = False,
        past_context: tp.Optional[int] = None,
        custom: bool = True,
        memory_efficient: bool = False,
        attention_as_float32: bool = False,
        cross_attention: bool = False,
        qk_layer_norm: bool = False,
        kv_repeat: int = 1,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.causal = causal
        self.past_context = past_context
        self.memory_efficient = memory_efficient
        self.attention_as_float32 = attention_as_float32
        self.cross_attention = cross_attention
        self.num_heads = num_heads
        self.dropout = dropout
        self.kv_repeat = kv_repeat
        assert custom, "this port keeps the custom path only"
        assert kv_repeat == 1, "kv_repeat is not supported here"

        out_dim = embed_dim
        num_kv = out_dim // num_heads * num_heads
        out_dim += 2 * num_kv
        in_proj = nn.Linear(embed_dim, out_dim, bias=bias, **factory_kwargs)
        self.in_proj_weight = in_proj.weight
        self.in_proj_bias = in_proj.bias
        if bias:
            self.in_proj_bias.data.zero_()
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory_kwargs)
        if bias:
            self.out_proj.bias.data.zero_()
        self.qk_layer_norm = qk_layer_norm
        if qk_layer_norm:
            self.q_layer_norm = nn.LayerNorm(embed_dim)
            self.k_layer_norm = nn.LayerNorm(embed_dim)

    def _get_mask(self, current_steps: int, device: torch.device, dtype: torch.dtype):
        if not self.causal:
            return None
        queries_pos = torch.arange(current_steps, device=device).view(-1, 1)
        keys_pos = torch.arange(current_steps, device=device).view(1, -1)
        delta = queries_pos - keys_pos
        valid = delta >= 0
        if self.past_context is not None:
            valid &= delta <= self.past_context
        return torch.where(
            valid,
            torch.zeros([], device=device, dtype=dtype),
            torch.full([], float("-inf"), device=device, dtype=dtype),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask=None,
        need_weights=False,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        assert not is_causal, "new param added in torch 2.0.1 not supported, use the causal args in the constructor."
        assert attn_mask is None
        assert not need_weights
        assert key_padding_mask is None
        if not self.cross_attention:
            assert key is query and value is query, "self-attention: key and value must be the query"

        T = query.shape[1]
        attn_mask = self._get_mask(T, query.device, query.dtype)

        if self.cross_attention:
            dim = self.in_proj_weight.shape[0] // 3
            bias_q = bias_k = bias_v = None
            if self.in_proj_bias is not None:
                bias_q, bias_k, bias_v = (
                    self.in_proj_bias[:dim],
                    self.in_proj_bias[dim : 2 * dim],
                    self.in_proj_bias[2 * dim :],
                )
            q = F.linear(query, self.in_proj_weight[:dim], bias_q)
            k = F.linear(key, self.in_proj_weight[dim : 2 * dim], bias_k)
            v = F.linear(value, self.in_proj_weight[2 * dim :], bias_v)
            q, k, v = [t.view(t.shape[0], t.shape[1], self.num_heads, -1) for t in (q, k, v)]
        else:
            projected = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            b, t, _ = projected.shape
            packed = projected.view(b, t, 3, -1, self.num_heads).transpose(-1, -2)  # b t (p d h) -> b t p h d
            q, k, v = packed.unbind(dim=2)

        q, k, v = [x.transpose(1, 2) for x in (q, k, v)]  # b t h d -> b h t d
        q = q * (q.shape[-1] ** -0.5)
        pre_w = q @ k.transpose(-1, -2)
        if attn_mask is not None:
            pre_w = pre_w + attn_mask
        w = torch.softmax(pre_w, dim=-1)
        w = F.dropout(w, self.dropout, training=self.training)
        x = (w @ v).to(v.dtype)
        x = x.transpose(1, 2).reshape(x.shape[0], T, self.embed_dim)  # b h t d -> b t (h d)
        x = self.out_proj(x)
        return x, None
