"""``attend``: one call that runs the chosen backend on converted masks.

:class:`attnlab.MultiHeadAttention`, :class:`attnlab.compat.MultiheadAttention` and
:mod:`attnlab.hf`'s attention function all end in it, so that a backend's adaptations (fp16/bf16
computed in float32 on a CPU, see :func:`~attnlab.core.functional.sdpa_compute_dtype`) live in
one place. Shapes as in :mod:`attnlab.core.functional`.
"""

from __future__ import annotations

from torch import Tensor

from . import functional  # called through the module, so that tests can count the calls
from .masks import Masks

__all__ = ["attend"]


def attend(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: Masks,
    *,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None, str | None]:
    """Run ``backend`` (``"math"`` or ``"sdpa"``) on ``q (B, H, T_q, D)``, ``k, v (B, G, T_k, D)``.

    Returns ``(context (B, H, T_q, D), weights (B, H, T_q, T_k) or None, how SDPA was adapted or None)``.
    """
    rows = None if masks.opened is None or masks.dead is None else (masks.opened, masks.dead)
    if backend == "math":
        context, weights = functional.math_attention(
            q,
            k,
            v,
            keep=masks.keep,
            bias=masks.bias,
            causal=masks.causal,
            empty_rows=masks.empty_rows,
            scale=scale,
            dropout_p=dropout_p,
            need_weights=need_weights,
            rows=rows,
        )
        return context, weights, None
    compute_dtype, why = functional.sdpa_compute_dtype(q)
    if compute_dtype is None:  # the policy keeps the inputs' dtype: say so, rather than have SDPA ask again
        compute_dtype = q.dtype
    context, _ = functional.sdpa_attention(
        q,
        k,
        v,
        keep=masks.keep,
        bias=masks.bias,
        causal=masks.causal,
        empty_rows=masks.empty_rows,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        compute_dtype=compute_dtype,
        rows=rows,
        opened_bias=masks.opened_bias,
    )
    return context, None, why
