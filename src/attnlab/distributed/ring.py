"""Ring attention: K/V blocks pass around the ranks; each rank merges its queries' partial results.

Notation as in :mod:`attnlab.distributed.blocks`; ``N`` ranks, rank ``r`` holding ``L`` positions.

Forward, on rank ``r``, for steps ``s = 0 .. N-1``: it holds the K/V shard of rank ``src = r - s``
(mod N). It *posts* the transfer of that shard to rank ``r + 1`` (and the receive of the next one
from ``r - 1``) before computing, attends its query chunks to the held key chunks (chunk pairs that
causality or the window hide entirely are skipped), merges, then waits for the transfer. The ring
carries the ``G`` K/V heads as they are, never the ``H`` query heads.

Backward, the same ring: the K/V shards travel again, each with the accumulator of its ``dK, dV``.
At step ``s`` rank ``r`` computes its queries' share of the held shard's ``dK, dV`` (``dQ`` stays
local), adds the accumulator that arrived from ``r - 1`` and sends it on; after ``N`` hops every
accumulator is home.

Precision: blocks compute in float32 at least (float64 stays float64); the merged output, the
log-sum-exp, ``dQ`` and each step's ``dK, dV`` sums are float64, and the accumulators travel in
the blocks' dtype. Measured (``tests/support/cp_worker.py``, fp32, 2 and 4 ranks, 12 seeds): with
float32 accumulators the parameter gradients were up to 1.9x as far from the fp64 truth as the
single-process fp32 run's; with float64 ones, at most 1.65x.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core.variants import Structure
from .blocks import BlockMasks, block_backward, block_forward, merge

if TYPE_CHECKING:
    from .group import RankGroup as ContextParallel

__all__ = ["Rules", "ring_attention"]


@dataclass(frozen=True)
class Rules:
    """What one call's masking is, the same for every block: positions come from the shard plan.

    ``key_keep (B, T_pad)`` bool, True = may attend (the gathered ``key_padding_mask`` inverted, padding
    positions False), or None when only the tail past ``length`` is padding. ``docs (B, T_pad)``: the
    documents' run ids over the whole sequence, or None.
    """

    scale: float
    causal: bool
    length: int
    window: int | None = None
    softcap: float | None = None
    alibi: Tensor | None = None  # (H,) slopes
    key_keep: Tensor | None = None
    docs: Tensor | None = None

    @property
    def plain(self) -> bool:
        """Whether a block's mask is causality alone (the fused kernel can run it)."""
        return self.alibi is None and self.key_keep is None and self.docs is None


@dataclass(frozen=True)
class Pair:
    """A query chunk (rows ``qs`` of this rank's shard) against a key chunk (rows ``ks`` of the held shard)."""

    qs: slice
    ks: slice
    spec: BlockMasks
    pairs: int  # (query, key) pairs causality and the window let attend, real queries and keys only


def plan_pairs(
    cp: ContextParallel, rules: Rules, q_rank: int, k_rank: int, device: torch.device, dtype: torch.dtype
) -> list[Pair]:
    """The chunk pairs rank ``q_rank`` computes against rank ``k_rank``'s shard; hidden ones left out."""
    plan = cp.plan(rules.length)
    c, T, W = plan.chunk, rules.length, rules.window
    out = []
    for qi, q_chunk in enumerate(plan.chunk_ids(q_rank)):
        qa, qb = q_chunk * c, (q_chunk + 1) * c  # query positions [qa, qb)
        for ki, k_chunk in enumerate(plan.chunk_ids(k_rank)):
            ka = k_chunk * c
            kb = min((k_chunk + 1) * c, T)  # keys past T are padding: cut, never attended
            if kb <= ka or (rules.causal and ka > qb - 1) or (W is not None and qa - (kb - 1) >= W):
                continue  # no key of the chunk is visible to any query of the chunk
            pairs = _count_pairs(qa, min(qb, T), ka, kb, rules.causal, W)
            qs, ks = slice(qi * c, (qi + 1) * c), slice(ki * c, ki * c + (kb - ka))
            inside = W is None or (qb - 1) - ka < W  # every pair of the chunks is within the window
            if rules.plain and inside and rules.softcap is None and (not rules.causal or kb - 1 <= qa):
                spec = BlockMasks("full")
            elif rules.plain and inside and rules.softcap is None and ka == qa:
                spec = BlockMasks("causal")
            else:
                spec = BlockMasks("masked", _mask_fn(rules, qa, ka, kb, device, dtype), rules.softcap)
            out.append(Pair(qs, ks, spec, pairs))
    return out


@functools.lru_cache(maxsize=4096)
def _count_pairs(qa: int, qb: int, ka: int, kb: int, causal: bool, window: int | None) -> int:
    """Exactly how many (i, j), ``qa <= i < qb``, ``ka <= j < kb``, causality and the window let attend."""
    total = 0
    for i in range(qa, qb):
        hi = min(kb - 1, i) if causal else kb - 1
        lo = max(ka, i - window + 1) if window is not None else ka
        total += max(0, hi - lo + 1)
    return total


def _mask_fn(rules: Rules, qa: int, ka: int, kb: int, device: torch.device, dtype: torch.dtype) -> Any:
    """``masks(qs) -> (keep, bias)`` for the queries ``qs`` of the chunk starting at ``qa``, keys ``[ka, kb)``."""
    k_pos = torch.arange(ka, kb, device=device)

    def masks(qs: slice) -> tuple[Tensor | None, Tensor | None]:
        q_pos = torch.arange(qa + qs.start, qa + qs.stop, device=device)
        st = Structure(
            q_pos=q_pos,
            k_pos=k_pos,
            causal=rules.causal,
            window=rules.window,
            alibi=rules.alibi,
            q_doc=None if rules.docs is None else rules.docs[:, q_pos],
            k_doc=None if rules.docs is None else rules.docs[:, ka:kb],
        )
        keep = st.keep()  # (B|1, 1, tq, ck) or None
        if rules.key_keep is not None:
            key_keep = rules.key_keep[:, None, None, ka:kb]  # (B, 1, 1, ck)
            keep = key_keep if keep is None else keep & key_keep
        return keep, st.bias(dtype=dtype)  # ALiBi, (1, H, tq, ck), or None

    return masks


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, cp: ContextParallel, rules: Rules
    ) -> Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)  # the blocks' dtype
        r, N = cp.rank, cp.world
        qc = q.to(acc)
        B, H, L, D = q.shape
        out = q.new_zeros(B, H, L, D, dtype=torch.float64)
        lse = q.new_full((B, H, L), -math.inf, dtype=torch.float64)
        if sinks is not None:  # the sink: one more term exp(s_h) in every row's denominator, with a value of 0
            lse = sinks.to(lse.dtype)[None, :, None].expand(B, H, L).clone()
        kv = torch.stack([k, v])  # (2, B, G, L, D): one message per hop, in the inputs' dtype
        plan = cp.plan(rules.length)
        for s in range(N):
            src = (r - s) % N
            pending = cp.post_exchange(kv, "forward", s) if s < N - 1 else None  # posted before the compute
            cp.note("compute", "forward", s)
            k_s, v_s = kv[0].to(acc), kv[1].to(acc)
            pairs = plan_pairs(cp, rules, r, src, q.device, acc)
            cp.stats.blocks += len(pairs)
            cp.stats.skipped += len(plan.chunk_ids(r)) * len(plan.chunk_ids(src)) - len(pairs)
            for pair in pairs:
                o_b, l_b = block_forward(
                    qc[:, :, pair.qs], k_s[:, :, pair.ks], v_s[:, :, pair.ks], pair.spec, rules.scale
                )
                out[:, :, pair.qs], lse[:, :, pair.qs] = merge(
                    out[:, :, pair.qs], lse[:, :, pair.qs], o_b.to(out.dtype), l_b.to(lse.dtype)
                )
                cp.count_pairs(pair.pairs * H)  # (query, key, head) triples
            if pending is not None:
                kv = cp.wait_exchange(pending, "forward", s)
        out, lse = out.to(acc), lse.to(acc)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.cp, ctx.rules = cp, rules
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, sinks, out, lse = ctx.saved_tensors
        cp: ContextParallel = ctx.cp
        rules: Rules = ctx.rules
        acc = out.dtype
        r, N = cp.rank, cp.world
        qc, do = q.to(acc), dout.to(acc).contiguous()
        dq = torch.zeros_like(qc, dtype=torch.float64)
        kv = torch.stack([k, v])
        incoming = None  # the dK/dV accumulator travelling with the held shard
        for s in range(N):
            src = (r - s) % N
            pending = cp.post_exchange(kv, "backward", s) if s < N - 1 else None
            cp.note("compute", "backward", s)
            k_s, v_s = kv[0].to(acc), kv[1].to(acc)
            dkv = torch.zeros(2, *k_s.shape, dtype=torch.float64, device=q.device)  # (2, B, G, L, D)
            for pair in plan_pairs(cp, rules, r, src, q.device, acc):
                dq_b, dk_b, dv_b = block_backward(
                    qc[:, :, pair.qs],
                    k_s[:, :, pair.ks],
                    v_s[:, :, pair.ks],
                    out[:, :, pair.qs],
                    lse[:, :, pair.qs],
                    do[:, :, pair.qs],
                    pair.spec,
                    rules.scale,
                )
                dq[:, :, pair.qs] += dq_b
                dkv[0][:, :, pair.ks] += dk_b
                dkv[1][:, :, pair.ks] += dv_b
            if incoming is not None:
                dkv += cp.wait_exchange(incoming, "backward-grads", s - 1)
            dkv = dkv.to(acc)  # travels in the blocks' dtype (float32 at least): half the bytes of float64
            incoming = cp.post_exchange(dkv, "backward-grads", s) if N > 1 else None  # on to its next holder
            if pending is not None:
                kv = cp.wait_exchange(pending, "backward", s)
        dkv = cp.wait_exchange(incoming, "backward-grads", N - 1) if incoming is not None else dkv  # home again
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # d s_h = -sum over rows of p_sink * rowsum(dO * O)
            p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)  # (B, H, L)
            dsinks = -(p_sink * (do * out).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None


def ring_attention(
    cp: ContextParallel, q: Tensor, k: Tensor, v: Tensor, rules: Rules, sinks: Tensor | None = None
) -> Tensor:
    """``context (B, H, L, D)`` of this rank's queries over the whole sequence's keys, by the ring."""
    out: Tensor = _Ring.apply(q, k, v, sinks, cp, rules)
    return out
