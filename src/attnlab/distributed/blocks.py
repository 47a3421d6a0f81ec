"""One block of ring attention: a chunk of queries against a chunk of keys, as ``(out, lse)``, and its backward.

Notation: ``B`` batch, ``H`` query heads, ``G`` key/value heads (``R = H / G`` query heads share one),
``cq``/``ck`` the chunk lengths, ``D`` the head dim. ``lse`` is each query row's log-sum-exp of its
scaled scores over this block's keys (``-inf`` where the block hides every key from it).

A ring step attends a rank's query chunks to the key chunks it holds at that step. Partial results
merge exactly (:func:`merge_`): with ``o_i`` a block's softmax-weighted values and ``l_i`` its
log-sum-exp, the full-row result is ``sum_i exp(l_i - l) o_i`` with ``l = logaddexp_i l_i``. The
backward of a block needs only the *merged* output and log-sum-exp of its rows (flash attention's
identity): ``P = exp(S - l)``, ``dS = P * (dO V^T - rowsum(dO * O))``.

Two ways to compute a block, the same function:

* ``fused``: the CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``),
  which returns the log-sum-exp and never holds the ``cq x ck`` scores. Used on a CPU for blocks with
  no mask but causality (every key visible, or the top-left causal diagonal).
* ``math``: the scores materialised a slab of queries at a time, with every mask and bias the
  structure holds (window, documents, padding, ALiBi, softcap). On any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BlockMasks", "block_backward", "block_forward", "merge_"]

# Scores held at once by the math path, in elements (2^23 float32 = 32 MiB): a slab of queries is as
# tall as this allows, so a block's memory does not grow with the chunk length squared.
SLAB_ELEMENTS = 2**23

MaskFn = Callable[[slice], tuple[Tensor | None, Tensor | None]]


@dataclass(frozen=True)
class BlockMasks:
    """How one block is masked: ``kind`` ``"full"`` (no mask), ``"causal"`` (the top-left causal diagonal:
    query ``i`` of the chunk sees keys ``j <= i``) or ``"masked"`` (``masks(qs)`` builds the bool keep
    ``(B|1, 1, tq, ck)`` and float bias ``(B|1, H, tq, ck)`` for the queries ``qs`` of the chunk)."""

    kind: str
    masks: MaskFn | None = None
    softcap: float | None = None


def _fused_ok(q: Tensor, spec: BlockMasks) -> bool:
    return spec.kind in ("full", "causal") and spec.softcap is None and q.device.type == "cpu"


def _expand_heads(t: Tensor, R: int) -> Tensor:
    """``(B, G, ck, D)`` -> ``(B, G*R, ck, D)``: each K/V head repeated for its ``R`` query heads."""
    return t if R == 1 else t.repeat_interleave(R, dim=1)


def block_forward(q: Tensor, k: Tensor, v: Tensor, spec: BlockMasks, scale: float) -> tuple[Tensor, Tensor]:
    """``(out (B, H, cq, D), lse (B, H, cq))`` of ``q (B, H, cq, D)`` over ``k, v (B, G, ck, D)``, all in one dtype."""
    B, H, cq, D = q.shape
    G = k.size(1)
    if _fused_ok(q, spec):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand_heads(k, H // G), _expand_heads(v, H // G), 0.0, spec.kind == "causal", scale=scale
        )
        return out, lse
    out = q.new_empty(B, H, cq, D)
    lse = q.new_empty(B, H, cq)
    for qs in _slabs(B, H, cq, k.size(2)):
        scores, _ = _scores(q[:, :, qs], k, spec, qs, scale)  # (B, H, tq, ck), masked entries -inf
        lse_s = torch.logsumexp(scores, dim=-1)  # (B, H, tq); -inf where every key is hidden
        p = torch.exp(scores - _finite(lse_s)[..., None])  # hidden keys: exp(-inf) = 0
        out[:, :, qs] = _pv(p, v)
        lse[:, :, qs] = lse_s
    return out, lse


def block_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    spec: BlockMasks,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq (B, H, cq, D), dk, dv (B, G, ck, D))``: this block's share of the gradients, given the rows' *merged*
    ``out (B, H, cq, D)`` and ``lse (B, H, cq)`` and the incoming ``dout``."""
    B, H, cq, D = q.shape
    G = k.size(1)
    R = H // G
    if _fused_ok(q, spec):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, _expand_heads(k, R), _expand_heads(v, R), out, lse, 0.0, spec.kind == "causal", scale=scale
        )
        ck = k.size(2)
        return dq, dk.view(B, G, R, ck, D).sum(2), dv.view(B, G, R, ck, D).sum(2)  # R query heads' shares summed
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    ck = k.size(2)
    for qs in _slabs(B, H, cq, ck):
        q_s, do_s = q[:, :, qs], dout[:, :, qs]
        scores, tanh = _scores(q_s, k, spec, qs, scale)
        p = torch.exp(scores - _finite(lse[:, :, qs])[..., None])  # (B, H, tq, ck)
        tq = p.size(2)
        p5, do5 = p.view(B, G, R, tq, ck), do_s.reshape(B, G, R, tq, D)
        dv += (p5.transpose(-1, -2) @ do5).sum(2)  # (B, G, ck, D)
        dp = (do5 @ v[:, :, None].transpose(-1, -2)).view(B, H, tq, ck)  # dO V^T
        delta = (do_s * out[:, :, qs]).sum(-1, keepdim=True)  # (B, H, tq, 1): rowsum(dO * O)
        ds = p * (dp - delta)
        if tanh is not None:  # scores = C tanh(raw / C): d raw = d scores * (1 - tanh^2)
            ds = ds * (1.0 - tanh * tanh)
        ds5 = ds.view(B, G, R, tq, ck)
        dq[:, :, qs] = (ds5 @ k[:, :, None]).view(B, H, tq, D) * scale
        dk += (ds5.transpose(-1, -2) @ q_s.reshape(B, G, R, tq, D)).sum(2) * scale
    return dq, dk, dv


def merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Merge a block's partial result into ``out`` (B, H, cq, D) and ``lse`` (B, H, cq), in place.

    Exact for disjoint keys: ``lse' = logaddexp(lse, lse_b)``, ``out' = exp(lse - lse') out + exp(lse_b - lse') out_b``.
    The weights are computed in ``lse``'s dtype (float64 in the ring) and applied in ``out``'s.
    """
    new = torch.logaddexp(lse, lse_b.to(lse.dtype))  # -inf only where both are (every key hidden so far)
    base = _finite(new)
    w_old = torch.exp(lse - base).to(out.dtype)[..., None]  # (B, H, cq, 1)
    w_b = torch.exp(lse_b.to(lse.dtype) - base).to(out.dtype)[..., None]
    out.mul_(w_old).add_(out_b * w_b)
    lse.copy_(new)


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with ``-inf`` (rows whose keys are all hidden) replaced by 0, so that ``exp(-inf - lse) = 0``."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _slabs(B: int, H: int, cq: int, ck: int) -> list[slice]:
    rows = max(1, SLAB_ELEMENTS // max(1, B * H * ck))
    return [slice(i, min(i + rows, cq)) for i in range(0, cq, rows)]


def _scores(q: Tensor, k: Tensor, spec: BlockMasks, qs: slice, scale: float) -> tuple[Tensor, Tensor | None]:
    """Masked scaled scores ``(B, H, tq, ck)`` of a slab of queries ``q (B, H, tq, D)``, and ``tanh(raw / C)`` for softcap."""
    B, H, tq, D = q.shape
    G, ck = k.size(1), k.size(2)
    raw = (q.reshape(B, G, H // G, tq, D) @ k[:, :, None].transpose(-1, -2)).view(B, H, tq, ck) * scale
    tanh = None
    scores = raw
    if spec.softcap is not None:
        tanh = torch.tanh(raw / spec.softcap)
        scores = spec.softcap * tanh
    if spec.kind == "causal":
        keep = torch.ones(tq, ck, dtype=torch.bool, device=q.device).tril(diagonal=qs.start)  # rows start at qs.start
        scores = scores.masked_fill(~keep, -math.inf)
    elif spec.kind == "masked":
        assert spec.masks is not None
        keep_m, bias = spec.masks(qs)
        if bias is not None:
            scores = scores + bias
        if keep_m is not None:
            scores = scores.masked_fill(~keep_m, -math.inf)
    return scores, tanh


def _pv(p: Tensor, v: Tensor) -> Tensor:
    """``p (B, H, tq, ck) @ v (B, G, ck, D)`` -> ``(B, H, tq, D)``, each query head on its K/V head."""
    B, H, tq, ck = p.shape
    G, D = v.size(1), v.size(-1)
    return (p.view(B, G, H // G, tq, ck) @ v[:, :, None]).view(B, H, tq, D)
