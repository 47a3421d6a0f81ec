"""Self-attention written the way Megatron-LM (megatron/model/transformer.py: ParallelAttention, CoreAttention) writes it (the style: see megatron_correct.py).

Mistake: the norm factor is sqrt of the whole hidden width (hidden_size_per_partition), not of one head's.
Line: self.norm_factor = math.sqrt(self.hidden_size_per_partition)
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPECTED = "scale_embed_dim"
TARGET = "ParallelAttention"
STYLE = "megatron"
CALL = "forward(hidden_states, attention_mask=None): sequence-first (T,B,E); always causal; attention_mask [b,1,sq,sk] bool True = masked; query_key_value per head [s,b,np,3*hn]; returns (output, bias)"


@dataclass
class TransformerConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    attention_dropout: float = 0.0
    apply_query_key_layer_scaling: bool = False
    add_bias_linear: bool = True


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class CoreAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.hidden_size_per_partition = config.hidden_size
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_partition)
        if config.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff
        self.coeff = coeff
        self.attention_dropout = nn.Dropout(config.attention_dropout)

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))

        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        # [sk, b, np, hn] -> [sk, b * np, hn]
        key_layer = key_layer.view(output_size[3], output_size[0] * output_size[1], -1)

        matmul_input_buffer = torch.empty(
            output_size[0] * output_size[1], output_size[2], output_size[3],
            dtype=query_layer.dtype, device=query_layer.device,
        )  # fmt: skip

        # Raw attention scores. [b * np, sq, sk]
        matmul_result = torch.baddbmm(
            matmul_input_buffer,
            query_layer.transpose(0, 1),  # [b * np, sq, hn]
            key_layer.transpose(0, 1).transpose(1, 2),  # [b * np, hn, sk]
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )
        attention_scores = matmul_result.view(*output_size)

        # scale-mask-softmax, causal
        if self.coeff is not None:
            attention_scores = attention_scores * self.coeff
        sq, sk = output_size[2], output_size[3]
        causal = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=attention_scores.device), diagonal=1)
        mask = causal.view(1, 1, sq, sk)
        if attention_mask is not None:
            mask = mask | attention_mask
        attention_probs = torch.nn.Softmax(dim=-1)(attention_mask_func(attention_scores, mask))
        attention_probs = self.attention_dropout(attention_probs)

        # [b, np, sq, hn]
        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)

        # [b, np, sq, hn] --> [sq, b, np, hn]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()
        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        context_layer = context_layer.view(*new_context_layer_shape)
        return context_layer


class ParallelAttention(nn.Module):
    def __init__(self, config, layer_number=1):
        super().__init__()
        self.layer_number = max(1, layer_number)
        self.hidden_size_per_attention_head = config.hidden_size // config.num_attention_heads
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.add_bias_linear)
        self.core_attention = CoreAttention(config, self.layer_number)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.add_bias_linear)

    def forward(self, hidden_states, attention_mask: Optional[torch.Tensor] = None):
        # hidden_states: [sq, b, h]
        # Attention heads [sq, b, h] --> [sq, b, (np * 3 * hn)]
        mixed_x_layer = self.query_key_value(hidden_states)

        # [sq, b, (np * 3 * hn)] --> [sq, b, np, 3 * hn]
        new_tensor_shape = mixed_x_layer.size()[:-1] + (
            self.num_attention_heads_per_partition,
            3 * self.hidden_size_per_attention_head,
        )
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)

        # [sq, b, np, 3 * hn] --> 3 [sq, b, np, hn]
        (query_layer, key_layer, value_layer) = torch.split(mixed_x_layer, self.hidden_size_per_attention_head, dim=3)

        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)

        # Output. [sq, b, h]
        output = self.dense(context_layer)
        return output, None
