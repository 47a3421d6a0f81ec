"""Bidirectional ViT self-attention, written the way jeonsworld's ViT-pytorch (models/modeling.py) writes it (the style: see vit_correct.py).

Mistake: the context (B, H, N, D) is viewed as (B, N, E) without permuting the heads back.
Line: context_layer = context_layer.contiguous()
"""

import math
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import Dropout, Linear, Softmax

EXPECTED = "merge_without_transpose"
TARGET = "Attention"
STYLE = "vit"
CALL = "forward(hidden_states): no mask (image patches); returns (output, weights or None)"


def get_b16_config():
    """A tiny stand-in for the ViT-B/16 config."""
    config = SimpleNamespace()
    config.hidden_size = 32
    config.transformer = {"num_heads": 4, "attention_dropout_rate": 0.0, "dropout_rate": 0.0}
    return config


class Attention(nn.Module):
    def __init__(self, config=None, vis=False):
        super(Attention, self).__init__()
        config = config if config is not None else get_b16_config()
        self.vis = vis
        self.num_attention_heads = config.transformer["num_heads"]
        self.attention_head_size = int(config.hidden_size / self.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = Linear(config.hidden_size, self.all_head_size)
        self.key = Linear(config.hidden_size, self.all_head_size)
        self.value = Linear(config.hidden_size, self.all_head_size)

        self.out = Linear(config.hidden_size, config.hidden_size)
        self.attn_dropout = Dropout(config.transformer["attention_dropout_rate"])
        self.proj_dropout = Dropout(config.transformer["attention_dropout_rate"])

        self.softmax = Softmax(dim=-1)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states):
        mixed_query_layer = self.query(hidden_states)
        mixed_key_layer = self.key(hidden_states)
        mixed_value_layer = self.value(hidden_states)

        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(mixed_key_layer)
        value_layer = self.transpose_for_scores(mixed_value_layer)

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_probs = self.softmax(attention_scores)
        weights = attention_probs if self.vis else None
        attention_probs = self.attn_dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.contiguous()
        new_context_layer_shape = (context_layer.size(0), context_layer.size(2), self.all_head_size)
        context_layer = context_layer.view(*new_context_layer_shape)
        attention_output = self.out(context_layer)
        attention_output = self.proj_dropout(attention_output)
        return attention_output, weights
