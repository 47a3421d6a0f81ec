"""Causal self-attention with QK RMS norm over the full width, written the way Hugging Face's OLMo-2 (modeling_olmo2.py) writes it.

Style: ``Olmo2Attention(config, layer_idx)``; the file defines its own ``Olmo2Config`` dataclass with defaults.
Separate ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` without bias; ``q_norm`` and ``k_norm`` are RMS norms
over the whole projected width (num_heads * head_dim), applied before the heads are split (OLMo-2's choice,
where Qwen3 and StableLM normalise per head). Rotary (``rotate_half``) on all head features, cos/sin from an
``Olmo2RotaryEmbedding`` or passed in as ``position_embeddings``. Key/value heads repeated by ``repeat_kv``. The
attention itself goes through an ``sdpa_attention_forward`` helper in the HF manner: the 4D additive mask is
cut to the key length, and ``is_causal`` is taken when no mask is given and there is more than one query.
``forward(hidden_states, attention_mask=None, position_ids=None, position_embeddings=None)``; returns
(output, None).

Mistake: none.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "pass"
TARGET = "Olmo2Attention"
STYLE = "olmo2"
CALL = "forward(hidden_states, attention_mask=None, position_ids=None, position_embeddings=None): causal when attention_mask is None; attention_mask HF 4D additive (B,1,T,S); q_norm/k_norm RMS over the full width; rotary rotate_half; returns (output, None)"


@dataclass
class Olmo2Config:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    attention_bias: bool = False
    attention_dropout: float = 0.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 500000.0
    max_position_embeddings: int = 128


class Olmo2RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32 if input_dtype != torch.float64 else input_dtype)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class Olmo2RotaryEmbedding(nn.Module):
    def __init__(self, config: Olmo2Config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    causal_mask = attention_mask
    if attention_mask is not None:
        causal_mask = causal_mask[:, :, :, : key.shape[-2]]
    is_causal = query.shape[2] > 1 and causal_mask is None
    attn_output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=causal_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
    )
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None


class Olmo2Attention(nn.Module):
    def __init__(self, config: Olmo2Config, layer_idx: Optional[int] = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True

        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.q_norm = Olmo2RMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = Olmo2RMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps)
        self.rotary_emb = Olmo2RotaryEmbedding(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        position_embeddings: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_norm(self.q_proj(hidden_states))
        key_states = self.k_norm(self.k_proj(hidden_states))
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(hidden_shape).transpose(1, 2)
        key_states = key_states.view(hidden_shape).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        if position_embeddings is None:
            if position_ids is None:
                position_ids = torch.arange(input_shape[1], device=hidden_states.device)[None].expand(
                    input_shape[0], -1
                )
            position_embeddings = self.rotary_emb(value_states, position_ids)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        attn_output, attn_weights = sdpa_attention_forward(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
