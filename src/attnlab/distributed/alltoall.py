"""All-to-all context parallelism (DeepSpeed Ulysses): trade the sequence split for a head split.

Notation: ``N`` ranks, ``L`` positions per rank, ``T`` the sequence (``T_pad = N L`` with padding),
``H``/``G`` query and K/V heads, both divisible by ``N``.

Each rank starts with all ``H`` heads of its ``L`` positions. One all-to-all sends head group ``j``
(``H / N`` query heads, ``G / N`` K/V heads) of every rank to rank ``j``, which then holds *all* ``T``
positions of its head group: ordinary single-process attention runs there, with every mask and
variant the module has. A second all-to-all sends the contexts back. Query head ``h`` reads K/V
head ``h // (H / G)``; splitting both into ``N`` contiguous groups keeps that pairing on one rank.

Per rank and call, forward: Q, K, V and the context each cross once, ``(N - 1) / N`` of them leaves
the rank: ``(2 H + 2 G) D L (N - 1) / N`` elements, constant as ``T`` and ``N`` grow together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.dispatch import attend
from ..core.masks import Masks
from ..core.variants import Structure, variant_math, variant_sdpa

if TYPE_CHECKING:
    from .group import RankGroup as ContextParallel
    from .ring import Rules

__all__ = ["alltoall_attention"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over dim 0 in equal splits, differentiable: its backward is the same exchange
    (what rank ``i`` sent to rank ``j`` comes back from ``j`` to ``i``)."""

    @staticmethod
    def forward(ctx: Any, send: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp = cp
        group = cp.group
        send = send.contiguous()
        got = torch.empty_like(send)  # after .contiguous(): empty_like keeps a strided input's strides
        dist.all_to_all_single(got, send, group=group)
        return got

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()  # the gradient of a permuted view arrives strided
        back = torch.empty_like(grad)
        dist.all_to_all_single(back, grad, group=ctx.cp.group)
        ctx.cp.count_bytes(_leaving(grad, ctx.cp.world))
        return back, None


def _leaving(t: Tensor, N: int) -> int:
    """Bytes of an all-to-all's ``t (N, ...)`` that leave the rank: every share but its own."""
    return t.numel() * t.element_size() * (N - 1) // N


def _to_heads(cp: ContextParallel, t: Tensor, length: int) -> Tensor:
    """``(B, X, L, D)`` shard of all heads -> ``(B, X / N, T, D)``: this rank's head group, every position in order."""
    B, X, L, D = t.shape
    N = cp.world
    send = t.reshape(B, N, X // N, L, D).transpose(0, 1).contiguous()  # (N, B, X/N, L, D): group j goes to rank j
    got = _AllToAll.apply(send, cp)  # (N, B, X/N, L, D): from rank j
    cp.count_bytes(_leaving(send, N))
    parts = got.permute(1, 2, 0, 3, 4).reshape(B, X // N, N * L, D)  # shards in rank order
    return cp.plan(length).unshard(parts, dim=2)  # (B, X/N, T, D)


def _to_sequence(cp: ContextParallel, t: Tensor, length: int) -> Tensor:
    """The inverse of :func:`_to_heads`: ``(B, H / N, T, D)`` -> ``(B, H, L, D)``."""
    B, Xn, _, D = t.shape
    N = cp.world
    plan = cp.plan(length)
    full = torch.cat([t, t.new_zeros(B, Xn, plan.padded - length, D)], dim=2)  # padding rows: zeros
    parts = full.index_select(2, plan.order(t.device))  # (B, X/N, N L, D): the shards in rank order
    send = parts.view(B, Xn, N, plan.local, D).permute(2, 0, 1, 3, 4).contiguous()  # (N, B, X/N, L, D)
    got = _AllToAll.apply(send, cp)  # (N, B, X/N, L, D): group j
    cp.count_bytes(_leaving(send, N))
    return got.permute(1, 0, 2, 3, 4).reshape(B, N * Xn, plan.local, D)


def alltoall_attention(
    cp: ContextParallel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rules: Rules,
    key_padding_mask: Tensor | None,
    document_runs: Tensor | None,
    sinks: Tensor | None = None,
) -> Tensor:
    """``context (B, H, L, D)`` of this rank's positions, through the head-split all-to-all.

    ``key_padding_mask (B, T)`` (True = padding) and ``document_runs (B, T)`` are the whole sequence's."""
    T, N, r = rules.length, cp.world, cp.rank
    H = q.size(1)
    q_f, k_f, v_f = (_to_heads(cp, t, T) for t in (q, k, v))  # (B, H/N, T, D), (B, G/N, T, D) x 2
    heads = slice(r * H // N, (r + 1) * H // N)
    cp.note("compute", "forward", 0)
    cp.count_pairs(_full_pairs(T, rules.causal, rules.window) * (H // N))  # (query, key, head) triples
    variants = rules.window is not None or rules.softcap is not None or rules.alibi is not None or sinks is not None
    if variants or document_runs is not None:
        st = Structure(
            q_pos=torch.arange(T, device=q.device),
            k_pos=torch.arange(T, device=q.device),
            causal=rules.causal,
            window=rules.window,
            softcap=rules.softcap,
            alibi=None if rules.alibi is None else rules.alibi[heads],
            sinks=None if sinks is None else sinks[heads],
            q_doc=document_runs,
            k_doc=document_runs,
        )
        masks = Masks(keep=None if key_padding_mask is None else ~key_padding_mask[:, None, None, :], empty_rows=True)
        if rules.softcap is not None:
            context, _ = variant_math(q_f, k_f, v_f, masks, st, scale=rules.scale)
        else:
            context = variant_sdpa(q_f, k_f, v_f, masks, st, scale=rules.scale)
    else:
        masks = Masks(
            keep=None if key_padding_mask is None else ~key_padding_mask[:, None, None, :],
            causal=rules.causal,
            empty_rows=key_padding_mask is not None,
        )
        if masks.keep is not None and rules.causal:  # padding and causality together: one bool mask
            causal_keep = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            masks = Masks(keep=masks.keep & causal_keep, empty_rows=True)
        context, _, _ = attend("sdpa", q_f, k_f, v_f, masks, scale=rules.scale)
    return _to_sequence(cp, context, T)


def _full_pairs(T: int, causal: bool, window: int | None) -> int:
    """(query, key) pairs of the whole sequence causality and the window let attend (per head group and batch row)."""
    if not causal:
        return T * T
    if window is None:
        return T * (T + 1) // 2
    return sum(min(i + 1, window) for i in range(T))
