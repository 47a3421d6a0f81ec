"""Cross-attention with its maths in a separate processor, written the way Hugging Face's diffusers (attention_processor.py) writes it.

Style: ``Attention(query_dim, cross_attention_dim=None, heads=8, dim_head=64, dropout=0.0, bias=False,
out_bias=True, scale_qk=True, processor=None)``. The module holds ``to_q``, ``to_k``, ``to_v`` and ``to_out`` (a
ModuleList of the output Linear and a Dropout) and hands every call to a processor object:
``processor(attn, hidden_states, encoder_hidden_states, attention_mask)``. The classic ``AttnProcessor`` folds the
heads into the batch with ``attn.head_to_batch_dim`` ((B, T, H*D) -> (B*H, T, D)), gets the probabilities from
``attn.get_attention_scores`` (``torch.baddbmm`` with ``beta=0`` or the mask as its input and ``alpha=scale``,
then a softmax), multiplies them into the values with ``torch.bmm`` and unfolds with ``attn.batch_to_head_dim``.
The mask is additive, (B, S) or (B, 1, S), repeated over the heads by ``prepare_attention_mask``.
``forward(hidden_states, encoder_hidden_states=None, attention_mask=None, **cross_attention_kwargs)``.

Mistake: none.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "pass"
TARGET = "Attention"
STYLE = "diffusers"
CALL = "forward(hidden_states, encoder_hidden_states=None, attention_mask=None): attention_mask additive (B,S) or (B,1,S); cross-attention when encoder_hidden_states is given"


class AttnProcessor:
    """The default processor: attention in (B * heads, T, head_dim) with baddbmm and bmm."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None):
        residual = hidden_states
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        query = attn.head_to_batch_dim(query)
        key = attn.head_to_batch_dim(key)
        value = attn.head_to_batch_dim(value)

        attention_probs = attn.get_attention_scores(query, key, attention_mask)
        hidden_states = torch.bmm(attention_probs, value)
        hidden_states = attn.batch_to_head_dim(hidden_states)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)

        if attn.residual_connection:
            hidden_states = hidden_states + residual
        hidden_states = hidden_states / attn.rescale_output_factor
        return hidden_states


class Attention(nn.Module):
    def __init__(
        self,
        query_dim: int,
        cross_attention_dim: Optional[int] = None,
        heads: int = 8,
        dim_head: int = 64,
        dropout: float = 0.0,
        bias: bool = False,
        upcast_softmax: bool = False,
        out_bias: bool = True,
        scale_qk: bool = True,
        residual_connection: bool = False,
        rescale_output_factor: float = 1.0,
        processor: Optional[AttnProcessor] = None,
    ):
        super().__init__()
        self.inner_dim = dim_head * heads
        self.query_dim = query_dim
        self.cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.upcast_softmax = upcast_softmax
        self.residual_connection = residual_connection
        self.rescale_output_factor = rescale_output_factor
        self.scale_qk = scale_qk
        self.scale = dim_head**-0.5 if self.scale_qk else 1.0
        self.heads = heads

        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_v = nn.Linear(self.cross_attention_dim, self.inner_dim, bias=bias)
        self.to_out = nn.ModuleList([])
        self.to_out.append(nn.Linear(self.inner_dim, query_dim, bias=out_bias))
        self.to_out.append(nn.Dropout(dropout))

        self.processor = processor if processor is not None else AttnProcessor()

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **cross_attention_kwargs):
        return self.processor(
            self,
            hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            attention_mask=attention_mask,
            **cross_attention_kwargs,
        )

    def batch_to_head_dim(self, tensor):
        head_size = self.heads
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size // head_size, head_size, seq_len, dim)
        tensor = tensor.permute(0, 2, 1, 3).reshape(batch_size // head_size, seq_len, dim * head_size)
        return tensor

    def head_to_batch_dim(self, tensor, out_dim=3):
        head_size = self.heads
        batch_size, seq_len, dim = tensor.shape
        tensor = tensor.reshape(batch_size, seq_len, head_size, dim // head_size)
        tensor = tensor.permute(0, 2, 1, 3)
        if out_dim == 3:
            tensor = tensor.reshape(batch_size * head_size, seq_len, dim // head_size)
        return tensor

    def get_attention_scores(self, query, key, attention_mask=None):
        dtype = query.dtype
        if self.upcast_softmax:
            query = query.float()
            key = key.float()

        if attention_mask is None:
            baddbmm_input = torch.empty(
                query.shape[0], query.shape[1], key.shape[1], dtype=query.dtype, device=query.device
            )
            beta = 0
        else:
            baddbmm_input = attention_mask
            beta = 1

        attention_scores = torch.baddbmm(baddbmm_input, query, key.transpose(-1, -2), beta=beta, alpha=self.scale)
        del baddbmm_input

        if self.upcast_softmax:
            attention_scores = attention_scores.float()
        attention_probs = attention_scores.softmax(dim=-1)
        del attention_scores
        return attention_probs.to(dtype)

    def prepare_attention_mask(self, attention_mask, target_length, batch_size, out_dim=3):
        head_size = self.heads
        if attention_mask is None:
            return attention_mask
        current_length = attention_mask.shape[-1]
        if current_length != target_length:
            attention_mask = F.pad(attention_mask, (0, target_length), value=0.0)
        if attention_mask.ndim == 2:
            attention_mask = attention_mask.unsqueeze(1)
        if out_dim == 3:
            if attention_mask.shape[0] < batch_size * head_size:
                attention_mask = attention_mask.repeat_interleave(head_size, dim=0)
        elif out_dim == 4:
            attention_mask = attention_mask.unsqueeze(1)
            attention_mask = attention_mask.repeat_interleave(head_size, dim=1)
        return attention_mask
