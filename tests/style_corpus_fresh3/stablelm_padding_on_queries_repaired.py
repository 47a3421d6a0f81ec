"""Causal self-attention with partial rotary and per-head QK layer norm, written the way Hugging Face's StableLM (modeling_stablelm.py) writes it (the style: see stablelm_correct.py).

Mistake: none. Repaired twin of stablelm_padding_on_queries.py: the same code with that one mistake fixed
(attention_mask[:, None, None, :]: the mask runs along the keys).
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

EXPECTED = "pass"
TARGET = "StableLmAttention"
STYLE = "stablelm"
CALL = "forward(hidden_states, attention_mask=None, position_ids=None): always causal; attention_mask HF 2D (B,T) 1 keep / 0 padding; per-head LayerNorm on q and k; partial rotary (rotate_half); returns (output, attn_weights)"


@dataclass
class StableLmConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    use_qkv_bias: bool = True
    qk_layernorm: bool = True
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    max_position_embeddings: int = 128


def _prepare_4d_causal_attention_mask(attention_mask, batch_size, query_length, key_length, dtype, device):
    min_value = torch.finfo(dtype).min
    causal = torch.full((query_length, key_length), min_value, dtype=dtype, device=device)
    causal = torch.triu(causal, diagonal=key_length - query_length + 1)
    causal = causal[None, None, :, :].expand(batch_size, 1, query_length, key_length).clone()
    if attention_mask is not None:
        padding = attention_mask[:, None, None, :].to(dtype)
        causal = causal.masked_fill(padding == 0, min_value)
    return causal


class StableLmRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq_expanded @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class StableLmLayerNormPerHead(nn.Module):
    def __init__(self, dim, num_heads, eps=1e-5, bias=False):
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.norms = nn.ModuleList([nn.LayerNorm(dim, eps=eps, bias=bias) for _ in range(self.num_heads)])

    def forward(self, hidden_states: torch.Tensor):
        # (B, H, T, D) -> H x (B, 1, T, D)
        states_per_heads = torch.split(hidden_states, 1, dim=1)
        return torch.cat([norm(hidden_states) for norm, hidden_states in zip(self.norms, states_per_heads)], dim=1)


class StableLmAttention(nn.Module):
    def __init__(self, config: StableLmConfig, layer_idx: Optional[int] = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.rope_theta = config.rope_theta
        self.rotary_ndims = int(self.head_dim * config.partial_rotary_factor)
        self.is_causal = True

        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=config.use_qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.use_qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=config.use_qkv_bias)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = StableLmLayerNormPerHead(self.head_dim, self.num_heads, eps=config.layer_norm_eps)
            self.k_layernorm = StableLmLayerNormPerHead(
                self.head_dim, self.num_key_value_heads, eps=config.layer_norm_eps
            )

        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.rotary_emb = StableLmRotaryEmbedding(self.rotary_ndims, base=self.rope_theta)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
    ):
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        if self.qk_layernorm:
            query_states = self.q_layernorm(query_states)
            key_states = self.k_layernorm(key_states)

        if position_ids is None:
            position_ids = torch.arange(q_len, device=hidden_states.device)[None].expand(bsz, -1)
        cos, sin = self.rotary_emb(value_states, position_ids)

        # Partial rotary embedding
        query_rot, query_pass = query_states[..., : self.rotary_ndims], query_states[..., self.rotary_ndims :]
        key_rot, key_pass = key_states[..., : self.rotary_ndims], key_states[..., self.rotary_ndims :]
        query_rot, key_rot = apply_rotary_pos_emb(query_rot, key_rot, cos, sin)
        query_states = torch.cat((query_rot, query_pass), dim=-1)
        key_states = torch.cat((key_rot, key_pass), dim=-1)

        key_states = key_states.repeat_interleave(self.num_key_value_groups, dim=1)
        value_states = value_states.repeat_interleave(self.num_key_value_groups, dim=1)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)

        causal_mask = _prepare_4d_causal_attention_mask(
            attention_mask, bsz, q_len, key_states.shape[-2], attn_weights.dtype, attn_weights.device
        )
        attn_weights = attn_weights + causal_mask

        upcast = torch.float64 if value_states.dtype == torch.float64 else torch.float32
        attn_weights = nn.functional.softmax(attn_weights, dtype=upcast, dim=-1).to(query_states.dtype)
        attn_weights = self.attention_dropout(attn_weights)

        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.reshape(bsz, q_len, self.hidden_size)
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
