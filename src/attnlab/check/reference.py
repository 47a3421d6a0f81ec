"""What a target should compute: attnlab's float64 reference, and a plain low-precision run.

Notation: B batch, T_q query positions, T_k key positions, E embed_dim, H query heads,
G key/value heads, D head dim. Masks arrive in the adapter protocol's forms: ``keep_mask``
bool (True = may attend) ``(T_q, T_k)`` or ``(B, T_q, T_k)``, ``key_padding_mask`` bool
``(B, T_k)`` (True = padding), ``bias`` float ``(T_q, T_k)`` or ``(B, T_q, T_k)`` added to
the scores, ``is_causal`` bottom-right aligned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.functional import causal_keep, math_attention
from .adapters import Projections
from .recipe import recipe_attention

__all__ = ["combined_keep", "plain_attention", "reference_attention"]


def combined_keep(
    B: int,
    T_q: int,
    T_k: int,
    *,
    keep_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    device: torch.device | None = None,
) -> Tensor | None:
    """Every mask folded into one bool ``(B, 1, T_q, T_k)``, True = may attend (None: no mask)."""
    keep = torch.ones(B, 1, T_q, T_k, dtype=torch.bool, device=device)
    if keep_mask is not None:
        keep = keep & (keep_mask if keep_mask.dim() == 3 else keep_mask[None])[:, None]  # (B, 1, T_q, T_k)
    if bias is not None:
        keep = keep & (bias != float("-inf")).reshape(-1, 1, T_q, T_k)  # (B or 1, 1, T_q, T_k)
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k) broadcast over queries
    if is_causal:
        keep = keep & causal_keep(T_q, T_k, device)  # (T_q, T_k) broadcast
    no_mask = keep_mask is None and bias is None and key_padding_mask is None and not is_causal
    return None if no_mask else keep


def _project(
    p: Projections, query: Tensor, key: Tensor, value: Tensor, H: int, G: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Split-head Q ``(B, H, T_q, D)`` and K, V ``(B, G, T_k, D)``."""
    B, T_q, T_k = query.size(0), query.size(1), key.size(1)
    D = p.q_weight.size(0) // H
    q = F.linear(query, p.q_weight, p.q_bias).view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D)
    k = F.linear(key, p.k_weight, p.k_bias).view(B, T_k, G, D).transpose(1, 2)  # (B, G, T_k, D)
    v = F.linear(value, p.v_weight, p.v_bias).view(B, T_k, G, D).transpose(1, 2)  # (B, G, T_k, D)
    return p.rotate(p.normed("q", q)), p.rotate(p.normed("k", k)), v


def _merge(p: Projections, context: Tensor, inputs: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    B, H, T_q, D = context.shape
    merged = context.transpose(1, 2).reshape(B, T_q, H * D)  # (B, T_q, H*D): heads merged after transpose
    return F.linear(p.gated(merged, *inputs), p.out_weight, p.out_bias)  # (B, T_q, E); gated where the module is


def reference_attention(
    p: Projections,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    keep_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    plain: bool = False,
) -> Tensor:
    """The expected output ``(B, T_q, E)``, computed in float64 by :func:`attnlab.math_attention`.

    A query with no visible key gets a zero context (output = the out-projection bias).
    Differentiable with respect to the float64 inputs it is given. ``plain``: :func:`plain_attention` instead.
    """
    if not plain and p.score_map is not None:  # the module's score map between the scale and the softmax
        return recipe_attention(
            p, query, key, value, num_heads=num_heads, num_kv_heads=num_kv_heads, scale=scale, keep_mask=keep_mask,
            key_padding_mask=key_padding_mask, bias=bias, is_causal=is_causal,
        )["out"]  # fmt: skip
    dtype = query.dtype if plain else torch.float64
    w = p.to(dtype)
    q, k, v = _project(w, query.to(dtype), key.to(dtype), value.to(dtype), num_heads, num_kv_heads)
    B, T_q, T_k = query.size(0), query.size(1), key.size(1)
    keep = combined_keep(
        B, T_q, T_k, keep_mask=keep_mask, key_padding_mask=key_padding_mask, bias=bias, is_causal=is_causal,
        device=query.device,
    )  # fmt: skip
    if not plain:
        bias4 = None if bias is None else bias.to(dtype).reshape(-1, 1, T_q, T_k)  # (B or 1, 1, T_q, T_k)
        context, _ = math_attention(q, k, v, keep=keep, bias=bias4, scale=scale)  # (B, H, T_q, D)
        return _merge(w, context, (query, key, value))
    rep = num_heads // num_kv_heads
    k = k.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
    v = v.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
    scores = w.mapped((q @ k.transpose(-2, -1)) * scale)  # (B, H, T_q, T_k)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, H, T_q, T_k), in the low dtype
    return _merge(w, weights @ v, (query, key, value))  # (B, H, T_q, D) merged -> (B, T_q, E)


def plain_attention(p: Projections, query: Tensor, key: Tensor, value: Tensor, **heads_and_masks) -> Tensor:
    """Textbook eager attention run entirely in the inputs' dtype, softmax included (the arguments of
    :func:`reference_attention` but ``bias``).

    The yardstick of the low-precision check (flash-attention's method): what a plain PyTorch
    implementation loses in bf16/fp16 is the error budget a module may spend, twice over.
    Differentiable: its input gradients are the yardstick of the backward pass likewise. A
    query with no visible key gives NaN here: the checks never build one.
    """
    return reference_attention(p, query, key, value, plain=True, **heads_and_masks)
