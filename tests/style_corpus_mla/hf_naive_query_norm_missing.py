"""Multi-head latent attention written the way Hugging Face's modeling_deepseek_v3.py writes it (the naive form).

Style: ``DeepseekV3Attention(config, layer_idx=None)`` reads config.hidden_size, num_attention_heads, q_lora_rank,
kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave and rms_norm_eps. The query goes
through q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa gives the latent (C) and the shared rotary key
(R); kv_a_layernorm normalises the latent; kv_b_proj expands it to every head's key and value. The caller passes
``position_embeddings = (cos, sin)`` (B, T, R), each angle repeated in both halves (HF's rotary embedding), and an
additive attention_mask (B, 1, T, T), 0 to keep and finfo.min to hide (causal, padding). Returns (output, weights).
The RMSNorm and the softmax run in max(float32, the input's dtype) rather than float32, so float64 stays float64.

Mistake: the query latent goes into q_b_proj without q_a_layernorm.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "mla_query_norm_missing"
TARGET = "DeepseekV3Attention"
STYLE = "hf_mla"
CALL = "forward(hidden_states, position_embeddings, attention_mask): (cos, sin) and an additive (B,1,T,T) mask"


class DeepseekV3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_interleave(q, k, cos, sin):
    """Rotate adjacent channel pairs: regroup (x0 x1 x2 x3 ..) as (x0 x2 .. | x1 x3 ..), then rotate halves."""
    cos = cos.unsqueeze(1)  # (B, 1, T, R)
    sin = sin.unsqueeze(1)
    b, h, s, d = q.shape
    q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    b, h, s, d = k.shape
    k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class DeepseekV3Attention(nn.Module):
    def __init__(self, config, layer_idx=None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.v_head_dim = config.v_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.scaling = self.qk_head_dim ** (-0.5)

        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None):
        batch_size, seq_length = hidden_states.shape[:-1]
        query_shape = (batch_size, seq_length, -1, self.qk_head_dim)
        key_shape = (batch_size, seq_length, -1, self.qk_nope_head_dim + self.v_head_dim)

        q_states = self.q_b_proj(self.q_a_proj(hidden_states))
        q_states = q_states.view(query_shape).transpose(1, 2)  # (B, H, T, N+R)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)  # (B, T, C+R)
        k_pass, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)).view(key_shape).transpose(1, 2)  # (B, H, T, N+Dv)
        k_pass, value_states = torch.split(k_pass, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        k_rot = k_rot.view(batch_size, 1, seq_length, self.qk_rope_head_dim)  # (B, 1, T, R): one for all heads
        cos, sin = position_embeddings
        q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        k_rot = k_rot.expand(*k_pass.shape[:-1], -1)  # (B, H, T, R)

        query_states = torch.cat((q_pass, q_rot), dim=-1)  # (B, H, T, N+R)
        key_states = torch.cat((k_pass, k_rot), dim=-1)  # (B, H, T, N+R)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scaling  # (B, H, T, T)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        softmax_dtype = torch.promote_types(attn_weights.dtype, torch.float32)
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=softmax_dtype).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)  # (B, H, T, Dv)
        attn_output = attn_output.transpose(1, 2).reshape(batch_size, seq_length, -1).contiguous()  # (B, T, H*Dv)
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights
