"""A user's own attention module, written the textbook way, for ``attnlab check`` to audit.

It follows attnlab's calling convention (bool ``attn_mask`` True = may attend, ``key_padding_mask``
True = pad, ``is_causal``) and exposes ``q_proj``/``k_proj``/``v_proj``/``out_proj``, so a
factory returning it works with ``attnlab check --target check_factories:tiny``. Each step is
a method so that tests can break exactly one of them in a subclass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.check import ModuleAdapter


class TinyAttention(nn.Module):
    def __init__(self, embed_dim: int = 16, num_heads: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))
        with torch.no_grad():  # nonzero biases, so that a bias bug would show
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
                lin.bias.normal_(0.0, 0.1)

    def score_scale(self) -> float:
        return 1.0 / math.sqrt(self.embed_dim // self.num_heads)

    @property
    def device(self) -> torch.device:
        return self.q_proj.weight.device

    def causal(self, T_q: int, T_k: int) -> Tensor:
        keep = torch.ones(T_q, T_k, dtype=torch.bool, device=self.device)
        return keep.tril(T_k - T_q)  # (T_q, T_k), True = may attend

    def keep(self, attn_mask, key_padding_mask, is_causal, B, T_q, T_k) -> Tensor | None:
        """Every mask as one bool (B, 1, T_q, T_k), True = may attend."""
        keep = torch.ones(B, 1, T_q, T_k, dtype=torch.bool, device=self.device)
        if attn_mask is not None:
            keep = keep & (attn_mask if attn_mask.dim() == 3 else attn_mask[None])[:, None]  # (B, 1, T_q, T_k)
        if key_padding_mask is not None:
            keep = keep & ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k)
        if is_causal:
            keep = keep & self.causal(T_q, T_k)
        return keep

    def softmax(self, scores: Tensor, keep: Tensor) -> Tensor:
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)  # finite: no NaN in empty rows
        # at least float32 for bf16/fp16 exp(); float64 stays float64 (gradcheck caught a bare .float())
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)
        return weights.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # a query with no key attends to nothing

    def clear_padded_values(self, v: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        """Zero the padded rows of V ``(B, H, T_k, D)``: a pad row may hold NaN or inf (an unwritten
        buffer), and its weight 0 times NaN is still NaN. (A NaN score of a padded key is already
        replaced by the mask fill.)"""
        return v if key_padding_mask is None else v.masked_fill(key_padding_mask[:, None, :, None], 0.0)

    def attn_dropout(self, weights: Tensor) -> Tensor:
        return F.dropout(weights, self.dropout, self.training)  # scales the kept weights by 1/(1-p)

    def merge(self, context: Tensor) -> Tensor:
        B, H, T, D = context.shape
        return context.transpose(1, 2).reshape(B, T, H * D)  # (B, T, E)

    def forward(self, query, key=None, value=None, *, attn_mask=None, key_padding_mask=None, is_causal=False):
        key = query if key is None else key
        value = key if value is None else value
        B, T_q, E = query.shape
        T_k, H = key.size(1), self.num_heads
        q = self.q_proj(query).view(B, T_q, H, E // H).transpose(1, 2)  # (B, H, T_q, D)
        k = self.k_proj(key).view(B, T_k, H, E // H).transpose(1, 2)  # (B, H, T_k, D)
        v = self.v_proj(value).view(B, T_k, H, E // H).transpose(1, 2)  # (B, H, T_k, D)
        v = self.clear_padded_values(v, key_padding_mask)
        scores = q @ k.transpose(-2, -1) * self.score_scale()  # (B, H, T_q, T_k)
        weights = self.softmax(scores, self.keep(attn_mask, key_padding_mask, is_causal, B, T_q, T_k))
        weights = self.attn_dropout(weights)
        return self.out_proj(self.merge(weights @ v))  # (B, H, T_q, D) -> (B, T_q, E)


def tiny(embed_dim: int = 16, num_heads: int = 2) -> nn.Module:
    """Factory for ``--target check_factories:tiny``: gets --embed-dim and --num-heads."""
    torch.manual_seed(0)
    return TinyAttention(embed_dim, num_heads)


class SeqFirstAdapter(ModuleAdapter):
    """Adapter for a sequence-first call convention: the protocol's example of a translation."""

    name = "seq-first TinyAttention"

    def __call__(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        out = self.module(
            query.transpose(0, 1),
            key.transpose(0, 1),
            value.transpose(0, 1),
            attn_mask=keep_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
        )
        return out.transpose(0, 1)  # (T_q, B, E) -> (B, T_q, E)

    def raw_bool_mask(self, query, mask):
        q = query.transpose(0, 1)  # (T, B, E)
        return self.module(q, q, q, attn_mask=mask).transpose(0, 1)  # (B, T, E)


class SeqFirstTiny(TinyAttention):
    def forward(self, query, key=None, value=None, **kw):  # (T, B, E) in and out
        key = query if key is None else key
        value = key if value is None else value
        return super().forward(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), **kw).transpose(0, 1)


def seq_first_adapter() -> SeqFirstAdapter:
    """Factory returning an adapter, for ``--target check_factories:seq_first_adapter``."""
    torch.manual_seed(0)
    return SeqFirstAdapter(SeqFirstTiny(), name="seq-first TinyAttention")
