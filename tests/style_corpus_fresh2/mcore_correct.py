"""Grouped-query self-attention written the way Megatron-core (megatron/core/transformer/attention.py: SelfAttention; dot_product_attention.py: DotProductAttention) writes it.

Style: ``SelfAttention(config, layer_number=1)``; the file defines its own ``TransformerConfig`` dataclass with
defaults (hidden_size, num_attention_heads, num_query_groups, attention_dropout, add_bias_linear, add_qkv_bias).
Hidden states are sequence-first, [sq, b, h]. One fused ``linear_qkv`` (bias on it only) whose output is viewed
[sq, b, ng, (np/ng + 2) * hn] per query group and split into the group's np/ng query heads, its key head and its
value head (``get_query_key_value_tensors``). ``DotProductAttention`` repeats each key/value head np/ng times in
place (``repeat_interleave``), folds [sq, b * np, hn], scores by ``torch.baddbmm`` on an empty buffer with beta=0
and alpha = 1/sqrt(hn), then the unfused path of the scale-mask-softmax: a causal mask (triu) made when no mask is
given, a given [b, 1, sq, sk] bool mask (True = masked) used alone, masked_fill -10000.0 and softmax. The context
[b, np, sq, hn] is permuted back to [sq, b, np, hn] and merged; ``linear_proj`` maps back. ``forward(hidden_states,
attention_mask=None)`` returns (output, bias), bias None (added inside).

Mistake: none.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "SelfAttention"
STYLE = "mcore"
CALL = "forward(hidden_states, attention_mask=None): sequence-first (T,B,E); causal when no mask is given, else attention_mask [b,1,sq,sk] bool True = masked alone; grouped-query linear_qkv [sq,b,ng,(np/ng+2)*hn], 2 groups; returns (output, bias)"


@dataclass
class TransformerConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_query_groups: int = 2
    attention_dropout: float = 0.0
    add_bias_linear: bool = False
    add_qkv_bias: bool = True


class ScaleMaskSoftmax(nn.Module):
    """The unfused path of Megatron-core's FusedScaleMaskSoftmax: a causal mask made here when none is given."""

    def __init__(self, causal: bool = True, scale: Optional[float] = None) -> None:
        super().__init__()
        self.causal = causal
        self.scale = scale

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        # input: [b, np, sq, sk]
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.size(2), input.size(3)
        if self.causal and mask is None and sq > 1:
            mask = torch.triu(torch.ones((sq, sk), device=input.device, dtype=torch.bool), diagonal=1)[None, None]
        mask_output = input.masked_fill(mask, -10000.0) if mask is not None else input
        return torch.nn.Softmax(dim=-1)(mask_output)


class DotProductAttention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.hidden_size_per_partition = config.hidden_size
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.num_query_groups_per_partition = config.num_query_groups
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.scale_mask_softmax = ScaleMaskSoftmax(causal=True)
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, query, key, value, attention_mask):
        # expand the key and value [sk, b, ng, hn] -> [sk, b, np, hn]
        if self.num_attention_heads_per_partition // self.num_query_groups_per_partition > 1:
            key = key.repeat_interleave(
                self.num_attention_heads_per_partition // self.num_query_groups_per_partition, dim=2
            )
            value = value.repeat_interleave(
                self.num_attention_heads_per_partition // self.num_query_groups_per_partition, dim=2
            )

        # [b, np, sq, sk]
        output_size = (query.size(1), query.size(2), query.size(0), key.size(0))

        # [sq, b, np, hn] -> [sq, b * np, hn]
        # This will be a simple view when doing normal attention, but in group query attention
        # the key and value tensors are repeated to match the queries so you can't use simple strides
        # to extract the queries.
        query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)
        # [sk, b, np, hn] -> [sk, b * np, hn]
        key = key.view(output_size[3], output_size[0] * output_size[1], -1)

        # preallocating input tensor: [b * np, sq, sk]
        matmul_input_buffer = torch.empty(
            (output_size[0] * output_size[1], output_size[2], output_size[3]), dtype=query.dtype, device=query.device
        )

        # Raw attention scores. [b * np, sq, sk]
        matmul_result = torch.baddbmm(
            matmul_input_buffer,
            query.transpose(0, 1),  # [b * np, sq, hn]
            key.transpose(0, 1).transpose(1, 2),  # [b * np, hn, sk]
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )

        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.view(*output_size)

        # attention scores and attention mask [b, np, sq, sk]
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        attention_probs = self.attention_dropout(attention_probs)

        # context layer shape: [b, np, sq, hn]
        output_size = (value.size(1), value.size(2), query.size(0), value.size(3))

        # change view [sk, b * np, hn]
        value = value.view(value.size(0), output_size[0] * output_size[1], -1)

        # change view [b * np, sq, sk]
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)

        # matmul: [b * np, sq, hn]
        context = torch.bmm(attention_probs, value.transpose(0, 1))

        # change view [b, np, sq, hn]
        context = context.view(*output_size)

        # [b, np, sq, hn] --> [sq, b, np, hn]
        context = context.permute(2, 0, 1, 3).contiguous()

        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_shape = context.size()[:-2] + (self.hidden_size_per_partition,)
        context = context.view(*new_context_shape)
        return context


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig, layer_number: int = 1) -> None:
        super().__init__()
        self.config = config
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.num_query_groups_per_partition = config.num_query_groups
        self.query_projection_size = config.hidden_size
        self.kv_projection_size = self.hidden_size_per_attention_head * config.num_query_groups
        self.linear_qkv = nn.Linear(
            config.hidden_size,
            self.query_projection_size + 2 * self.kv_projection_size,
            bias=config.add_bias_linear or config.add_qkv_bias,
        )
        self.core_attention = DotProductAttention(config, layer_number)
        self.linear_proj = nn.Linear(self.query_projection_size, config.hidden_size, bias=config.add_bias_linear)

    def get_query_key_value_tensors(self, hidden_states):
        # Attention heads [sq, b, h] --> [sq, b, ng * (np/ng + 2) * hn)]
        mixed_qkv = self.linear_qkv(hidden_states)

        # [sq, b, hp] --> [sq, b, ng, (np/ng + 2) * hn]
        new_tensor_shape = mixed_qkv.size()[:-1] + (
            self.num_query_groups_per_partition,
            (
                (self.num_attention_heads_per_partition // self.num_query_groups_per_partition + 2)
                * self.hidden_size_per_attention_head
            ),
        )
        mixed_qkv = mixed_qkv.view(*new_tensor_shape)

        split_arg_list = [
            (
                self.num_attention_heads_per_partition
                // self.num_query_groups_per_partition
                * self.hidden_size_per_attention_head
            ),
            self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
        ]

        # [sq, b, ng, (np/ng + 2) * hn] --> [sq, b, ng, np/ng * hn], [sq, b, ng, hn], [sq, b, ng, hn]
        (query, key, value) = torch.split(mixed_qkv, split_arg_list, dim=3)

        # [sq, b, ng, np/ng * hn] -> [sq, b, np, hn]
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
        return query, key, value

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None):
        # hidden_states: [sq, b, h]
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        core_attn_out = self.core_attention(query, key, value, attention_mask)

        # Output. [sq, b, h]
        output = self.linear_proj(core_attn_out)
        return output, None
