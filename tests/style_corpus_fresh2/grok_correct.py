"""Causal grouped-query attention with a tanh cap of 30 on the logits, written the way xAI's Grok-1 (model.py) writes it, ported to PyTorch.

Style: ``MultiHeadAttention(num_q_heads, num_kv_heads, key_size, model_size, attn_output_multiplier)``, positional
sizes as Grok's Haiku module takes them; bias-free ``query``, ``key``, ``value`` projections and a ``linear`` out,
Grok's names. The query heads are grouped under their K/V head, (B, T, G, H/G, D), and one
``einsum("bthHd,bThd->bhHtT")`` makes the logits of every group at once (no repeat of K or V). The logits are
multiplied by ``attn_output_multiplier`` (= key_size ** -0.5 here, as Grok's 0.0884 is 128 ** -0.5), then
capped: ``max_attn_val * tanh(logits / max_attn_val)`` with max_attn_val = 30.0. The mask (B, 1, T, T) bool,
True = attend, is the causal triangle and'ed with the 2D padding mask; blocked logits become -1e30 after the cap.
Softmax in float32 (float64 kept), ``einsum("bhHtT,bThd->bthHd")`` for the context. ``forward(inputs,
mask=None)``: mask (B, T), 1 = keep. Returns the output.

Mistake: none.
"""

from typing import Optional

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "MultiHeadAttention"
STYLE = "grok"
CALL = "forward(inputs, mask=None): always causal; mask (B,T) 1 keep / 0 padding; GQA grouped (B,T,G,H/G,D) in one einsum; logits * attn_output_multiplier then 30 * tanh(logits / 30), -1e30 where blocked; returns output"
POSITIONS = "softcap"


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        num_q_heads: int = 4,
        num_kv_heads: int = 2,
        key_size: int = 8,
        model_size: int = 32,
        attn_output_multiplier: Optional[float] = None,
        with_bias: bool = False,
    ):
        super().__init__()
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.key_size = key_size
        self.model_size = model_size
        self.attn_output_multiplier = key_size**-0.5 if attn_output_multiplier is None else attn_output_multiplier
        self.query = nn.Linear(model_size, num_q_heads * key_size, bias=with_bias)
        self.key = nn.Linear(model_size, num_kv_heads * key_size, bias=with_bias)
        self.value = nn.Linear(model_size, num_kv_heads * key_size, bias=with_bias)
        self.linear = nn.Linear(num_q_heads * key_size, model_size, bias=with_bias)

    def _linear_projection(self, x: torch.Tensor, layer: nn.Linear, num_heads: int) -> torch.Tensor:
        y = layer(x)
        *leading_dims, _ = x.shape
        return y.reshape(*leading_dims, num_heads, self.key_size)

    def forward(self, inputs: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq_len, _ = inputs.shape
        query_heads = self._linear_projection(inputs, self.query, self.num_q_heads)  # [B, T, H, D]
        key_heads = self._linear_projection(inputs, self.key, self.num_kv_heads)  # [B, T, K, D]
        value_heads = self._linear_projection(inputs, self.value, self.num_kv_heads)  # [B, T, K, D]

        causal = torch.tril(torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=inputs.device))
        if mask is not None:
            causal = causal & mask.bool()[:, None, None, :]
        mask = causal

        b, t, h, d = query_heads.shape
        _, _, kv_h, _ = key_heads.shape
        query_heads = query_heads.reshape(b, t, kv_h, h // kv_h, d)

        attn_logits = torch.einsum("bthHd,bThd->bhHtT", query_heads, key_heads)
        attn_logits = attn_logits * self.attn_output_multiplier
        max_attn_val = 30.0
        attn_logits = max_attn_val * torch.tanh(attn_logits / max_attn_val)

        mask = mask[:, :, None, :, :]  # [B, 1, 1, T, T] over the groups
        attn_logits = torch.where(mask, attn_logits, torch.full_like(attn_logits, -1e30))
        upcast = torch.float64 if attn_logits.dtype == torch.float64 else torch.float32
        attn_weights = torch.softmax(attn_logits.to(upcast), dim=-1).to(query_heads.dtype)

        attn = torch.einsum("bhHtT,bThd->bthHd", attn_weights, value_heads)
        attn = attn.reshape(batch, seq_len, h * d)
        return self.linear(attn)
