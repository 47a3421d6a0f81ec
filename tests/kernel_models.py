"""CPU models of fused attention kernels as they were measured on GPUs, so that what only a GPU shows is
held in the CPU suite.

Each model is a stand-in for ``torch.nn.functional.scaled_dot_product_attention`` (same signature, same
result where the kernel is right) that reproduces one measured or documented kernel fault exactly where it
occurs. attnlab calls SDPA as ``F.scaled_dot_product_attention`` (``F`` the module, read at call time), so
:func:`modelled_sdpa` patches the function on ``torch.nn.functional`` and every attnlab path meets the
model.

Notation: B batch, H query heads, G key/value heads, T_q queries, T_k keys, D head dim; a row is one query
of one head of one sequence, and its log-sum-exp (lse) is ``log sum_j exp(s_ij)`` over the keys it may see
(``-inf`` when it may see none).

The faults:

``cudnn``
    cuDNN's SDPA on Hopper, measured by attnlab on an H200 (torch 2.11.0+cu130, bf16 and fp16, issue 36):
    the forward returns 0 for a row that sees no key; the backward returns **NaN in dq for every row whose
    lse is below -88.7** (ln of float32's largest value: ``exp(-lse)`` overflows) whenever an explicit
    ``attn_mask`` is passed, whatever gradient comes in; dk and dv stay right. PyTorch #196678 narrows it to
    key lengths of 64 mod 128 (the padded half of the last 128-key tile is scored 0, and ``exp(0 - lse)``
    overflows); the model faults at every key length, so that a CPU test need not find the one that fails.
``nan_rows``
    The math and memory-efficient kernels before torch 2.5 (PyTorch #103749, #109517; fixed by #133882's
    ``_safe_softmax``): a row whose lse is below -88.7 (no visible key, or every key at the dtype's
    minimum) comes out **NaN in the forward**, and the backward carries it on: NaN dq in the row, and NaN
    dk and dv for every key of its sequence and head (softmax's backward multiplies the row's NaN
    probabilities by every key's gradient).

A model computes in float32 at least, as the kernels accumulate. Dropout is not modelled: a call with
``dropout_p > 0`` raises, so that no test believes it ran a model it did not.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

LSE_OVERFLOW = -math.log(torch.finfo(torch.float32).max)  # -88.72: below it exp(-lse) overflows float32
FAULTS = ("cudnn", "nan_rows")

_REAL_SDPA = F.scaled_dot_product_attention


def _visible(q: Tensor, k: Tensor, attn_mask: Tensor | None, is_causal: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(keep, bias)`` of one SDPA call, as SDPA reads its arguments: a bool mask keeps True, a float
    mask is added; ``is_causal`` is SDPA's own, top-left aligned."""
    T_q, T_k = q.size(-2), k.size(-2)
    keep, bias = None, None
    if is_causal:
        if attn_mask is not None:
            raise RuntimeError(
                "_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True"
            )
        keep = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril()  # (T_q, T_k)
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask
    elif attn_mask is not None:
        bias = attn_mask
        keep = attn_mask != float("-inf")
    return keep, bias


def _attention(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, bias: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    """``(out (B, H, T_q, D), lse (B, H, T_q, 1))`` in float32 at least; a row that sees no key gives 0 and
    lse ``-inf``, with gradients of 0 (never NaN) through this function."""
    acc = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T_q, T_k)
    if bias is not None:
        scores = scores + bias.to(acc)
    if keep is None:
        keep = torch.ones_like(scores, dtype=torch.bool)
    keep = keep.expand_as(scores)
    dead = ~keep.any(dim=-1, keepdim=True)  # (B, H, T_q, 1)
    safe = scores.masked_fill(~keep, -math.inf).masked_fill(dead, 0.0)  # dead rows finite, for the gradient
    lse = torch.logsumexp(safe, dim=-1, keepdim=True)  # (B, H, T_q, 1)
    p = torch.exp(safe - lse).masked_fill(dead, 0.0)  # (B, H, T_q, T_k)
    return p @ v, lse.masked_fill(dead, -math.inf)


class _Faulty(torch.autograd.Function):
    """SDPA whose forward and backward are exact except where ``fault`` says the kernel goes wrong."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, fault: str
    ) -> Tensor:
        keep, bias = _visible(q, k, mask, is_causal)
        out, lse = _attention(q, k, v, keep, bias, scale)
        hit = (lse < LSE_OVERFLOW) if mask is not None else torch.zeros_like(lse, dtype=torch.bool)  # (B, H, T_q, 1)
        ctx.save_for_backward(q, k, v, mask, hit)
        ctx.is_causal, ctx.scale, ctx.fault = is_causal, scale, fault
        if fault == "nan_rows":
            out = out.masked_fill(hit, math.nan)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, mask, hit = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            bias_in = None
            if mask is not None and mask.is_floating_point() and mask.requires_grad:
                bias_in = mask.detach().requires_grad_()
            keep, bias = _visible(inputs[0], inputs[1], bias_in if bias_in is not None else mask, ctx.is_causal)
            out, _ = _attention(*inputs, keep, bias, ctx.scale)
            wrt = inputs + ([bias_in] if bias_in is not None else [])
            grads = list(torch.autograd.grad(out, wrt, dout.to(out.dtype), allow_unused=True))
        dq, dk, dv = grads[0], grads[1], grads[2]
        dmask = grads[3] if bias_in is not None else None
        if ctx.fault == "cudnn" or ctx.fault == "nan_rows":
            dq = dq.masked_fill(hit, math.nan)  # (B, H, T_q, D): the rows whose lse is below -88.7
        if ctx.fault == "nan_rows":
            rep = q.size(1) // k.size(1)
            poisoned = hit.any(dim=2, keepdim=True)  # (B, H, 1, 1): a NaN row reaches every key of its head
            poisoned = poisoned.view(q.size(0), k.size(1), rep, 1, 1).any(dim=2)  # (B, G, 1, 1)
            dk, dv = dk.masked_fill(poisoned, math.nan), dv.masked_fill(poisoned, math.nan)
        cast = [g.to(t.dtype) if g is not None else None for g, t in zip((dq, dk, dv), (q, k, v), strict=True)]
        return (*cast, None if dmask is None else dmask.to(mask.dtype), None, None, None)


def faulty_sdpa(fault: str):
    """A stand-in for ``F.scaled_dot_product_attention`` with ``fault`` (one of :data:`FAULTS`)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")

    def sdpa(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if dropout_p > 0.0:
            raise NotImplementedError(f"the {fault!r} SDPA model has no dropout (dropout_p={dropout_p})")
        if query.size(-3) != key.size(-3) and not enable_gqa:
            raise RuntimeError(
                f"the query has {query.size(-3)} heads and the key {key.size(-3)}: SDPA needs enable_gqa=True"
            )
        s = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        return _Faulty.apply(query, key, value, attn_mask, is_causal, s, fault)

    sdpa.fault = fault  # type: ignore[attr-defined]
    return sdpa


@contextlib.contextmanager
def modelled_sdpa(fault: str, monkeypatch: pytest.MonkeyPatch | None = None) -> Iterator[None]:
    """Every ``F.scaled_dot_product_attention`` call inside runs the model of ``fault``."""
    with contextlib.ExitStack() as stack:
        mp = monkeypatch if monkeypatch is not None else stack.enter_context(pytest.MonkeyPatch.context())
        mp.setattr(F, "scaled_dot_product_attention", faulty_sdpa(fault))
        yield


# -- flex ----------------------------------------------------------------------------------------------------------
class FlexModel:
    """A stand-in for compiled ``flex_attention`` on the CPU, where torch has no flex backward: the same function,
    differentiable, computed densely from the ``BlockMask`` as the kernel reads it (tiles not listed are skipped,
    ``mask_mod`` is evaluated in partial tiles only, full tiles keep every pair) and ``score_mod``.

    A row with no kept key gives 0 and a log-sum-exp of ``-inf``, as torch 2.13's Triton template does
    (``flex_attention.py.jinja``: "Handle fully masked out rows"; its backward reads ``-inf`` as 0). attnlab
    promises more: no fused kernel is handed such a row at all. ``rows_without_key`` counts the rows this
    model was handed that see no key, so that a test asserts the promise itself.
    """

    def __init__(self) -> None:
        self.rows_without_key = 0
        self.calls = 0

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        score_mod=None,
        block_mask=None,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_aux=None,
        **unused,
    ):
        self.calls += 1
        B, H, T_q, D = query.shape
        T_k = key.size(2)
        acc = torch.promote_types(query.dtype, torch.float32)
        q, k, v = query.to(acc), key.to(acc), value.to(acc)
        rep = H // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
        b = torch.arange(B)[:, None, None, None]
        h = torch.arange(H)[None, :, None, None]
        i = torch.arange(T_q)[None, None, :, None]
        j = torch.arange(T_k)[None, None, None, :]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D) if scale is None else scale)  # (B, H, T_q, T_k)
        if score_mod is not None:
            scores = score_mod(scores, b, h, i, j)
        keep = torch.ones(B, H, T_q, T_k, dtype=torch.bool)
        if block_mask is not None:
            keep = self._pairs(block_mask, b, h, i, j, B, H, T_q, T_k)
        dead = ~keep.any(-1, keepdim=True)  # (B, H, T_q, 1)
        self.rows_without_key += int(dead.sum())
        safe = scores.masked_fill(~keep, -math.inf).masked_fill(dead, 0.0)
        lse = torch.logsumexp(safe, dim=-1, keepdim=True)  # (B, H, T_q, 1)
        out = (torch.exp(safe - lse).masked_fill(dead, 0.0) @ v).to(query.dtype)  # (B, H, T_q, D)
        if return_aux is None:
            return out
        aux = type("Aux", (), {})()
        aux.lse = lse.masked_fill(dead, -math.inf)[..., 0]  # (B, H, T_q) float32
        return out, aux

    @staticmethod
    def _pairs(block_mask, b, h, i, j, B, H, T_q, T_k) -> Tensor:
        """Bool ``(B, H, T_q, T_k)``: the pairs the kernel keeps, tile by tile."""
        n = block_mask.BLOCK_SIZE[0]

        def tiles(num, idx):  # (B|1, H|1, nq) counts and (.., nq, nk) indices -> (B|1, H|1, nq, nk) bool
            listed = torch.arange(idx.size(-1)) < num[..., None]
            grid = torch.zeros(*idx.shape[:-1], idx.size(-1) + 1, dtype=torch.bool)
            return grid.scatter(-1, torch.where(listed, idx.long(), idx.size(-1)), True)[..., :-1]

        partial = tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = (
            tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
            if block_mask.full_kv_num_blocks is not None
            else torch.zeros_like(partial)
        )
        ti, tj = (i // n).expand(1, 1, T_q, T_k), (j // n).expand(1, 1, T_q, T_k)
        bi = torch.arange(partial.size(0))[:, None, None, None]
        hi = torch.arange(partial.size(1))[None, :, None, None]
        in_partial, in_full = partial[bi, hi, ti, tj], full[bi, hi, ti, tj]  # (B|1, H|1, T_q, T_k)
        evaluated = block_mask.mask_mod(b, h, i, j).expand(B, H, T_q, T_k)
        return (in_full | (in_partial & evaluated)).expand(B, H, T_q, T_k)


@contextlib.contextmanager
def modelled_flex(monkeypatch: pytest.MonkeyPatch, *, sinks_by_lse: bool = True) -> Iterator[FlexModel]:
    """attnlab's compiled flex runs :class:`FlexModel` inside; ``sinks_by_lse``: the GPU's sink path (the gate
    on the returned log-sum-exp) rather than the CPU's extra key."""
    from attnlab.core import flex

    model = FlexModel()
    monkeypatch.setattr(flex, "_compiled_flex", lambda: model)
    monkeypatch.setattr(flex, "_sinks_by_lse", lambda device: sinks_by_lse)
    yield model
