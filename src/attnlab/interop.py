"""Weight conversion between attnlab and ``torch.nn.MultiheadAttention`` (either layout)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .attention import Backend, MultiHeadAttention


def check_representable(m: object, who: str) -> None:
    """Refuse what attnlab's attention cannot express: not a torch MHA, or one with an extra
    learned key/value row (``add_bias_kv``) or an all-zero one (``add_zero_attn``)."""
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"{who} expects a torch.nn.MultiheadAttention, got {type(m).__name__}.")
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError(
            f"{who} got an nn.MultiheadAttention built with add_bias_kv=True or add_zero_attn=True; "
            "attnlab has no learned extra key/value row, so its outputs could not agree. Use a "
            "module built without them."
        )


def from_torch_mha(cls: type[MultiHeadAttention], m: nn.MultiheadAttention, *, backend: Backend = "auto") -> MultiHeadAttention:
    check_representable(m, "from_torch")
    weight = m.out_proj.weight
    ours = cls(
        m.embed_dim, m.num_heads, kdim=m.kdim, vdim=m.vdim, dropout=m.dropout,
        bias=m.in_proj_bias is not None, backend=backend, device=weight.device, dtype=weight.dtype,
    )
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)  # (E, E) each
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight  # (E, E), (E, kdim), (E, vdim)
    with torch.no_grad():
        for proj, w in ((ours.q_proj, wq), (ours.k_proj, wk), (ours.v_proj, wv)):
            proj.weight.copy_(w)
        ours.out_proj.weight.copy_(m.out_proj.weight)
        if m.in_proj_bias is not None:
            for proj, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), m.in_proj_bias.chunk(3)):
                proj.bias.copy_(b)
            ours.out_proj.bias.copy_(m.out_proj.bias)
    return ours


def to_torch_mha(ours: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    weight = ours.out_proj.weight
    has_bias = ours.out_proj.bias is not None
    m = nn.MultiheadAttention(
        ours.embed_dim, ours.num_heads, dropout=ours.dropout, bias=has_bias,
        kdim=ours.kdim, vdim=ours.vdim, batch_first=batch_first,
        device=weight.device, dtype=weight.dtype,
    )
    rep = ours.num_heads // ours.num_kv_heads
    D = ours.head_dim

    def per_query_head(t: torch.Tensor) -> torch.Tensor:
        """(G*D, ...) K/V rows -> (H*D, ...): K/V head g serves query heads g*rep ... g*rep+rep-1."""
        return t.unflatten(0, (ours.num_kv_heads, D)).repeat_interleave(rep, dim=0).flatten(0, 1)

    # torch always scales by 1/sqrt(D): fold any other scale into the query projection.
    q_gain = ours.scale * math.sqrt(D)
    with torch.no_grad():
        wq = ours.q_proj.weight * q_gain
        wk, wv = per_query_head(ours.k_proj.weight), per_query_head(ours.v_proj.weight)
        if m._qkv_same_embed_dim:
            m.in_proj_weight.copy_(torch.cat([wq, wk, wv]))
        else:
            m.q_proj_weight.copy_(wq)
            m.k_proj_weight.copy_(wk)
            m.v_proj_weight.copy_(wv)
        m.out_proj.weight.copy_(ours.out_proj.weight)
        if has_bias:
            m.in_proj_bias.copy_(torch.cat([ours.q_proj.bias * q_gain, per_query_head(ours.k_proj.bias),
                                            per_query_head(ours.v_proj.bias)]))
            m.out_proj.bias.copy_(ours.out_proj.bias)
    return m
