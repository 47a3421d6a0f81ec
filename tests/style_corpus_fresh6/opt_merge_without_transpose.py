"""Self-attention written the way Meta's OPT (transformers, modeling_opt.py: OPTAttention) writes it (the style: see opt_correct.py).

Mistake: the heads are merged straight from (B, H, T, D) with ``reshape(bsz, tgt_len, embed_dim)``, without
transposing back to (B, T, H, D): positions and heads are mixed.
Line: attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPECTED = "merge_without_transpose"
TARGET = "OPTAttention"
STYLE = "opt"
CALL = "forward(hidden_states, key_value_states=None, attention_mask=None): attention_mask additive (B,1,T,S); returns (out, weights)"


@dataclass
class OPTConfig:
    hidden_size: int = 768
    num_attention_heads: int = 12
    attention_dropout: float = 0.0
    enable_bias: bool = True


class OPTAttention(nn.Module):
    def __init__(self, config: OPTConfig, is_decoder: bool = True):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.dropout = config.attention_dropout
        self.head_dim = self.embed_dim // self.num_heads
        if self.head_dim * self.num_heads != self.embed_dim:
            raise ValueError(f"hidden_size {self.embed_dim} is not a multiple of num_heads {self.num_heads}")
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)
        self.v_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)
        self.q_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.enable_bias)

    def _shape(self, tensor: torch.Tensor, seq_len: int, bsz: int):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        output_attentions: bool = False,
    ):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        source = hidden_states if key_value_states is None else key_value_states
        key_states = self._shape(self.k_proj(source), -1, bsz)
        value_states = self._shape(self.v_proj(source), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        src_len = key_states.size(1)

        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = torch.max(
                attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min, device=attn_weights.device)
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights_reshaped = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) if output_attentions else None
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)

        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        attn_output = self.out_proj(attn_output)
        return attn_output, attn_weights_reshaped
