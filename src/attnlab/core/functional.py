"""The attention math: the explicit reference and the fused SDPA path, behind one signature.

Notation used in every shape comment of attnlab:
    B batch, H query heads, G key/value heads (H = G * R, R queries share one K/V head),
    T_q query positions (i), T_k key positions (j), D head dim.

Both functions take the heads already split, ``q: (B, H, T_q, D)``, ``k, v: (B, G, T_k, D)``,
and masks already in attnlab's one internal convention (see :mod:`attnlab.core.masks`):

* ``keep``: bool, broadcastable to ``(B, H, T_q, T_k)``, **True = may attend**;
* ``bias``: float, broadcastable likewise, added to the scores (``-inf`` entries are also
  False in ``keep``);
* ``causal``: square causal masking that was *not* materialised into ``keep`` (``T_q == T_k``,
  no other mask), so that SDPA can take its ``is_causal`` fast path;
* ``empty_rows``: whether ``keep`` may block every key of some query (key padding, user masks;
  never causal masking alone), so that such rows must be zeroed.

A query row whose keys are all masked attends to nothing: its context is zeros, never NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["math_attention", "sdpa_attention", "causal_keep"]


def causal_keep(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """Bool ``(T_q, T_k)``: query i (at absolute position ``T_k - T_q + i``) may see key j <= it.

    Aligned bottom-right, so it is right both for a full sequence (``T_q == T_k``) and for
    the last ``T_q`` positions of a sequence whose first ``T_k - T_q`` keys are cached.
    """
    ones = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return ones.tril(diagonal=k_len - q_len)  # (T_q, T_k)


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    empty_rows: bool = True,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The reference: the seeds' algorithm written out, float64-capable, can return weights.

    Returns ``(context (B, H, T_q, D), weights (B, H, T_q, T_k) or None)``; the weights are
    those multiplied with V (after dropout, when dropout is on).
    """
    rep = q.size(1) // k.size(1)
    if rep > 1:  # GQA/MQA: query head n reads K/V head n // rep (Llama's repeat_kv grouping)
        k = k.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
        v = v.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
    if causal:
        keep = causal_keep(q.size(-2), k.size(-2), q.device)  # (T_q, T_k)

    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T_q, D) @ (B, H, D, T_k) -> (B, H, T_q, T_k)
    if bias is not None:
        scores = scores + bias  # (B, H, T_q, T_k)
    if keep is not None:
        # A finite fill, not -inf: a row with every key masked then stays NaN-free (softmax of
        # equal values) in both directions, and is zeroed below.
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    # Softmax in float32 at least (fp16/bf16 exp() saturates); float64 stays float64.
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    if keep is not None and empty_rows:
        weights = weights.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)  # fully masked rows
    weights = weights.to(v.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    context = weights @ v  # (B, H, T_q, T_k) @ (B, H, T_k, D) -> (B, H, T_q, D)
    return context, (weights if need_weights else None)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    empty_rows: bool = True,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The fused path: ``F.scaled_dot_product_attention`` (flash / memory-efficient / CPU flash).

    Same signature and result as :func:`math_attention`; it cannot return weights.
    """
    if need_weights:
        raise ValueError(
            "need_weights=True cannot be served by the 'sdpa' backend, which never materialises "
            "the weights; use backend='math' or 'auto'."
        )
    mask = keep
    if bias is not None:  # SDPA takes one mask: fold the blocked positions into the bias
        mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
    context = F.scaled_dot_product_attention(
        q,
        k,
        v,  # (B, H, T_q, D), (B, G, T_k, D), (B, G, T_k, D)
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.size(1) != k.size(1),
    )  # (B, H, T_q, D)
    if keep is not None and empty_rows:
        # Zero rows with no visible key ourselves: whether a kernel returns 0 or NaN there
        # differs across kernels and torch releases.
        context = context.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)
    return context, None
