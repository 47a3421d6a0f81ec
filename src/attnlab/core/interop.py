"""Weight conversion between attnlab and ``torch.nn.MultiheadAttention`` (either layout).

Below :mod:`attnlab.core.attention` in the layering: the functions take the attnlab module's
class (or instance) as an argument and never import it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, TypeVar

import torch
from torch import nn

from .validation import Backend

# The attnlab module: typed loosely here because this file sits below it (no import back up).
Ours = TypeVar("Ours", bound=nn.Module)


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


def from_torch_mha(cls: type[Ours], m: nn.MultiheadAttention, *, backend: Backend = "auto") -> Ours:
    """``cls`` (attnlab's ``MultiHeadAttention``) built with the weights of the torch module ``m``."""
    check_representable(m, "from_torch")
    if not m.batch_first:
        warnings.warn(
            "from_torch: this nn.MultiheadAttention is sequence-first (batch_first=False, torch's default), "
            "but attnlab's MultiHeadAttention is always batch-first and returns a tensor, not (output, weights). "
            "Feed it (B, T, E) inputs (x.transpose(0, 1)), or use attnlab.compat.MultiheadAttention, a drop-in "
            "with torch's layout, return value and mask polarity.",
            UserWarning,
            stacklevel=3,
        )
    weight = m.out_proj.weight
    ours = cls(
        m.embed_dim,
        m.num_heads,
        kdim=m.kdim,
        vdim=m.vdim,
        dropout=m.dropout,
        bias=m.in_proj_bias is not None,
        backend=backend,
        device=weight.device,
        dtype=weight.dtype,
    )
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)  # (E, E) each
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight  # (E, E), (E, kdim), (E, vdim)
    with torch.no_grad():
        for name, w in (("q_proj", wq), ("k_proj", wk), ("v_proj", wv), ("out_proj", m.out_proj.weight)):
            _tensor(ours, f"{name}.weight").copy_(w)
        if m.in_proj_bias is not None:
            for name, b in zip(("q_proj", "k_proj", "v_proj"), m.in_proj_bias.chunk(3), strict=True):
                _tensor(ours, f"{name}.bias").copy_(b)
            _tensor(ours, "out_proj.bias").copy_(m.out_proj.bias)
    return ours


def _tensor(module: nn.Module, path: str) -> torch.Tensor:
    """``module.<path>`` (e.g. ``"q_proj.weight"``) as a tensor: the way to reach a child's weight
    without knowing the child's class."""
    owner, _, name = path.rpartition(".")
    t = getattr(module.get_submodule(owner), name)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{path} is {type(t).__name__}, expected a tensor.")
    return t


def check_torch_dims(ours: Any) -> None:
    """Refuse what ``nn.MultiheadAttention`` cannot hold: its heads always split ``embed_dim`` (D = E // H, the
    same D for Q, K and V), and it has no output gate."""
    E, H = ours.embed_dim, ours.num_heads
    if ours.head_dim * H != E or ours.v_head_dim != ours.head_dim:
        raise ValueError(
            f"to_torch: this module has head_dim={ours.head_dim}, v_head_dim={ours.v_head_dim} with embed_dim={E}, "
            f"num_heads={H}, but nn.MultiheadAttention's heads always split embed_dim (head_dim = v_head_dim = "
            f"{E} // {H} = {E // H}); its weights have no place there. Keep attnlab's module, or build one with "
            f"head_dim=None and v_head_dim=None."
        )
    if ours.output_gate is not None:
        raise ValueError(
            f"to_torch: this module has output_gate={ours.output_gate!r}, which nn.MultiheadAttention cannot "
            f"compute (it has no gate before out_proj); keep attnlab's module, or build one with output_gate=False."
        )


def to_torch_mha(ours: Any, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """A torch module computing what ``ours`` (an attnlab ``MultiHeadAttention``) computes; refused
    (:func:`check_torch_dims`) where torch's module cannot hold it."""
    check_torch_dims(ours)
    weight = ours.out_proj.weight
    has_bias = ours.out_proj.bias is not None
    m = nn.MultiheadAttention(
        ours.embed_dim,
        ours.num_heads,
        dropout=ours.dropout,
        bias=has_bias,
        kdim=ours.kdim,
        vdim=ours.vdim,
        batch_first=batch_first,
        device=weight.device,
        dtype=weight.dtype,
    )
    rep = ours.num_heads // ours.num_kv_heads
    D = ours.head_dim

    def per_query_head(t: torch.Tensor) -> torch.Tensor:
        """(G*D, ...) K/V rows -> (H*D, ...): K/V head g serves query heads g*rep ... g*rep+rep-1."""
        grouped = t.reshape(ours.num_kv_heads, D, *t.shape[1:])  # (G, D, ...)
        return grouped.repeat_interleave(rep, dim=0).flatten(0, 1)  # (G*rep*D, ...) = (H*D, ...)

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
            m.in_proj_bias.copy_(
                torch.cat(
                    [ours.q_proj.bias * q_gain, per_query_head(ours.k_proj.bias), per_query_head(ours.v_proj.bias)]
                )
            )
            m.out_proj.bias.copy_(ours.out_proj.bias)
    return m
