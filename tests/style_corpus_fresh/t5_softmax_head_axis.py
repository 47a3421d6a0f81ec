"""Attention written the way Hugging Face's T5 (transformers/models/t5/modeling_t5.py) writes T5Attention, in a layer without its own relative position bias (the style: see t5_correct.py).

Mistake: the softmax runs over dim=1, the heads, not over the keys.
Line: attn_weights = nn.functional.softmax(scores, dim=1).type_as(scores)
"""

from typing import Optional

import torch
import torch.nn as nn

EXPECTED = "softmax_head_axis"
TARGET = "T5Attention"
STYLE = "t5"
CALL = "forward(hidden_states, mask=None, key_value_states=None, position_bias=None): hidden_states (B,T,d_model); mask additive (B,1,1,S) finfo.min = blocked, folded into position_bias; key_value_states (B,S,d_model) for cross-attention; returns (output, position_bias)"


class T5Config:
    def __init__(
        self,
        d_model=512,
        d_kv=64,
        num_heads=8,
        dropout_rate=0.1,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        is_decoder=False,
    ):
        self.d_model = d_model
        self.d_kv = d_kv
        self.num_heads = num_heads
        self.dropout_rate = dropout_rate
        self.relative_attention_num_buckets = relative_attention_num_buckets
        self.relative_attention_max_distance = relative_attention_max_distance
        self.is_decoder = is_decoder


class T5Attention(nn.Module):
    def __init__(self, config: T5Config, has_relative_attention_bias=False):
        super().__init__()
        self.is_decoder = config.is_decoder
        self.has_relative_attention_bias = has_relative_attention_bias
        self.relative_attention_num_buckets = config.relative_attention_num_buckets
        self.d_model = config.d_model
        self.key_value_proj_dim = config.d_kv
        self.n_heads = config.num_heads
        self.dropout = config.dropout_rate
        self.inner_dim = self.n_heads * self.key_value_proj_dim

        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)

        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.relative_attention_num_buckets, self.n_heads)

    def forward(
        self,
        hidden_states,
        mask: Optional[torch.Tensor] = None,
        key_value_states: Optional[torch.Tensor] = None,
        position_bias: Optional[torch.Tensor] = None,
    ):
        # Input is (batch_size, seq_length, dim)
        batch_size, seq_length = hidden_states.shape[:2]
        key_length = seq_length if key_value_states is None else key_value_states.shape[1]

        def shape(states):
            """projection"""
            return states.view(batch_size, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        def unshape(states):
            """reshape"""
            return states.transpose(1, 2).contiguous().view(batch_size, -1, self.inner_dim)

        # get query states
        query_states = shape(self.q(hidden_states))  # (batch_size, n_heads, seq_length, dim_per_head)

        # get key/value states
        source = hidden_states if key_value_states is None else key_value_states
        key_states = shape(self.k(source))
        value_states = shape(self.v(source))

        # compute scores
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        scores = scores * self.key_value_proj_dim**-0.5

        if position_bias is None:
            if not self.has_relative_attention_bias:
                position_bias = torch.zeros(
                    (1, self.n_heads, seq_length, key_length), device=scores.device, dtype=scores.dtype
                )
            else:
                raise NotImplementedError("this port keeps only the layers without their own bias")

            if mask is not None:
                position_bias = position_bias + mask  # (batch_size, n_heads, seq_length, key_length)

        scores += position_bias
        attn_weights = nn.functional.softmax(scores, dim=1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)

        attn_output = unshape(torch.matmul(attn_weights, value_states))  # (batch_size, seq_length, dim)
        attn_output = self.o(attn_output)

        return attn_output, position_bias
