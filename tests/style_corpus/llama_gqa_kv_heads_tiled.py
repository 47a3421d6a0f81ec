"""Grouped-query attention written the way Hugging Face's modeling_llama.py writes it, without RoPE.

Style: ``LlamaAttention(config, layer_idx=None)`` reads config.hidden_size, config.num_attention_heads,
config.num_key_value_heads, config.head_dim (optional; hidden_size // num_attention_heads when absent) and
config.attention_dropout (the file defines no config: the caller's LlamaConfig supplies them). q_proj, k_proj,
v_proj and o_proj have no bias; ``repeat_kv`` (expand + reshape) repeats each K/V head in place
(kv0 kv0 kv1 kv1 ...), like repeat_interleave. Rotary embeddings are left out so that the ground truth is plain
attention. attention_mask is additive, (B, 1, T_q, T_k), 0 to keep and torch.finfo(dtype).min to hide, and built
by the caller (causal, padding, or both); the module builds no mask. Returns (attn_output, attn_weights).
Softmax runs in max(float32, the scores' dtype) rather than in float32 as upstream, so float64 stays float64.

Mistake: repeat_kv inserts the new axis before the K/V heads, so they come out tiled (kv0 kv1 kv0 kv1 ...)
and query head h reads K/V head h % kv_heads instead of h // n_rep.
Line: hidden_states = hidden_states[:, None, :, :, :].expand(batch, n_rep, num_key_value_heads, slen, head_dim)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "gqa_kv_heads_tiled"
TARGET = "LlamaAttention"
STYLE = "llama"
CALL = "forward(hidden_states, attention_mask=None): additive (B,1,T_q,T_k), 0 = keep, finfo.min = blocked, built by the caller (e.g. causal); returns (output, weights)"


def repeat_kv(hidden_states, n_rep):
    """(B, kv_heads, T, D) -> (B, kv_heads * n_rep, T, D), each K/V head n_rep times in a row."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, None, :, :, :].expand(batch, n_rep, num_key_value_heads, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout

        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None):
        input_shape = hidden_states.shape[:-1]  # (B, T)
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, G, T, D)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, G, T, D)

        key_states = repeat_kv(key_states, self.num_key_value_groups)  # (B, H, T, D)
        value_states = repeat_kv(value_states, self.num_key_value_groups)  # (B, H, T, D)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling  # (B, H, T_q, T_k)
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
            attn_weights = attn_weights + causal_mask

        softmax_dtype = torch.promote_types(attn_weights.dtype, torch.float32)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(query_states.dtype)
        attn_weights = F.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)  # (B, H, T_q, D)
        attn_output = attn_output.transpose(1, 2).contiguous()  # (B, T_q, H, D)

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # (B, T_q, H * D)
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
