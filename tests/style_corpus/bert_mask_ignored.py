"""BERT self-attention written the way Hugging Face's modeling_bert.py writes it.

Style: ``BertSelfAttention(config)`` reads config.hidden_size, config.num_attention_heads and
config.attention_probs_dropout_prob (the file defines no config: the caller's BertConfig supplies them). It has
``query`` / ``key`` / ``value`` Linear children and ``transpose_for_scores``, and returns a tuple (context,).
As in BERT, the output projection lives apart, in ``BertSelfOutput.dense``; ``BertAttention`` joins the two, and
is the module to check. BERT's residual LayerNorm and hidden dropout are left out of BertSelfOutput, so that
BertAttention is plain multi-head attention. attention_mask is the *extended* additive mask (B, 1, 1, T): 0 where a
key may be seen, a large negative (torch.finfo(dtype).min, or -10000.0 in older code) where it is padding.

Mistake: the mask is added out of place and the sum thrown away (add, not add_), so it never reaches the scores.
Line: attention_scores.add(attention_mask)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "mask_ignored"
TARGET = "BertAttention"
STYLE = "bert"
CALL = "forward(hidden_states, attention_mask=None): additive extended mask (B,1,1,T), 0 = keep, finfo.min or -10000 = padding; returns (output,)"


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                f"heads ({config.num_attention_heads})"
            )
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = (*x.size()[:-1], self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)  # (B, T, heads, head_size)
        return x.permute(0, 2, 1, 3)  # (B, heads, T, head_size)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))  # (B, heads, T, head_size)
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        # raw scores: every query against every key
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))  # (B, heads, T, T)
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # precomputed for all layers in BertModel.forward: 0 to keep, a large negative to hide
            attention_scores.add(attention_mask)

        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        # drops whole keys for a query, as the original Transformer does
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)  # (B, heads, T, head_size)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()  # (B, T, heads, head_size)
        new_context_layer_shape = (*context_layer.size()[:-2], self.all_head_size)
        context_layer = context_layer.view(new_context_layer_shape)  # (B, T, hidden)
        return (context_layer,)


class BertSelfOutput(nn.Module):
    """BERT's output projection, without its LayerNorm, residual and hidden dropout."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states):
        return self.dense(hidden_states)


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        self_outputs = self.self(hidden_states, attention_mask)
        attention_output = self.output(self_outputs[0])
        return (attention_output, *self_outputs[1:])
