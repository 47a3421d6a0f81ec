"""Ring attention: K/V blocks pass around the ranks; each rank merges its queries' partial results.

Notation as in :mod:`attnlab.distributed.blocks`; ``N`` ranks, rank ``r`` holding ``L`` positions.

Forward, on rank ``r``, for steps ``s = 0 .. N-1``: it holds the K/V shard of rank ``src = r - s``
(mod N). It *posts* the transfer of that shard to rank ``r + 1`` (and the receive of the next one
from ``r - 1``) before computing, attends its query chunks to the held key chunks (chunk pairs that
causality or the window hide entirely are skipped), merges, then waits for the transfer. The ring
carries the ``G`` K/V heads as they are, never the ``H`` query heads.

Backward, the same ring: the K/V shards travel again, each followed by the accumulator of its
``dK, dV``. At step ``s`` rank ``r`` adds its queries' share of the held shard's ``dK, dV`` into
that shard's accumulator (``dQ`` stays local), then passes it to ``r + 1`` and takes the next
one from ``r - 1``; after ``N`` hops every accumulator is home. The K/V transfer is posted before
the step's compute and awaited after it; the accumulator hop follows the compute, dK then dV, so
that a rank holds one accumulator and at most one more arriving (memory, not time, is what
context parallelism is for; on a CPU the hop costs milliseconds against seconds of compute).

Precision: blocks, the output and the dQ/dK/dV accumulators are float32 at least (float64 stays
float64); the log-sum-exp and the merge weights are float64. Measured (``tests/support/cp_worker.py``'s
fp32 case, 2 ranks, 12 seeds), the parameter gradients' max error against the fp64 truth: with every
merge in float32, up to 1.9x the single-process fp32 run's; with float64 merge weights, at most 1.76x
(flash-attention's rule asks <= 2x).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core.variants import Structure
from .blocks import BlockMasks, block_backward, block_forward, merge_

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
    """A query tile (rows ``qs`` of this rank's shard) against a key tile (rows ``ks`` of the held shard)."""

    qs: slice
    ks: slice
    spec: BlockMasks
    pairs: int  # (query, key) pairs causality and the window let attend, real queries and keys only


# Rows per tile: a chunk longer than this is computed as tiles of it, so that a block's temporaries (its
# output, its gradients, the kernel's copies) stay a few MiB however long the shard is (T=16384 on 2 ranks: 4096-row
# chunks; 8192 with the contiguous layout), and the window can skip tiles, not only whole chunks.
TILE = 1024


def _tiles(start: int, stop: int) -> list[tuple[int, int]]:
    return [(a, min(a + TILE, stop)) for a in range(start, stop, TILE)]


def plan_pairs(
    cp: ContextParallel, rules: Rules, q_rank: int, k_rank: int, device: torch.device, dtype: torch.dtype
) -> tuple[list[Pair], int]:
    """The tile pairs rank ``q_rank`` computes against rank ``k_rank``'s shard, and how many it skips (hidden)."""
    plan = cp.plan(rules.length)
    c, T, W = plan.chunk, rules.length, rules.window
    out, skipped = [], 0
    for qi, q_chunk in enumerate(plan.chunk_ids(q_rank)):
        for qa, qb in _tiles(q_chunk * c, (q_chunk + 1) * c):  # query positions [qa, qb)
            for ki, k_chunk in enumerate(plan.chunk_ids(k_rank)):
                for ka, kb in _tiles(k_chunk * c, (k_chunk + 1) * c):
                    kb = min(kb, T)  # keys past T are padding: cut, never attended
                    if kb <= ka or (rules.causal and ka > qb - 1) or (W is not None and qa - (kb - 1) >= W):
                        skipped += 1  # no key of the tile is visible to any query of the tile
                        continue
                    pairs = _count_pairs(qa, min(qb, T), ka, kb, rules.causal, W)
                    q0, k0 = qi * c - q_chunk * c, ki * c - k_chunk * c  # position -> row of the shard
                    qs, ks = slice(q0 + qa, q0 + qb), slice(k0 + ka, k0 + kb)
                    inside = W is None or (qb - 1) - ka < W  # every pair of the tiles is within the window
                    fused = rules.plain and inside and rules.softcap is None
                    if fused and (not rules.causal or kb - 1 <= qa):
                        spec = BlockMasks("full")
                    elif fused and ka == qa:  # the diagonal: tiles on one grid, so top-left causal
                        spec = BlockMasks("causal")
                    else:
                        spec = BlockMasks("masked", _mask_fn(rules, qa, ka, kb, device, dtype), rules.softcap)
                    out.append(Pair(qs, ks, spec, pairs))
    return out, skipped


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


def _heads_last(t: Tensor) -> Tensor:
    """``(B, X, L, D)`` -> its ``(B, L, X, D)`` contiguous form: what the projections produced, so no copy is made
    for the module's tensors (``view`` + ``transpose``), and what the ring sends and accumulates in."""
    return t.transpose(1, 2).contiguous()


def _zeros_heads_last(B: int, X: int, L: int, D: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    """``(B, X, L, D)`` zeros stored ``(B, L, X, D)``: merging the heads afterwards (``transpose`` + ``view``) copies nothing."""
    return like.new_zeros(B, L, X, D, dtype=dtype).transpose(1, 2)


class _Ring(torch.autograd.Function):
    """Memory: every full-shard tensor the ring keeps is stored ``(B, L, heads, D)``, the layout of the projections
    that produced Q/K/V and of the output projection that consumes the context, so that neither the head split
    nor the merge copies; a rank holds one K/V shard in flight and one dK/dV accumulator (measured with
    ``attnlab bench --context-parallel``: see ``docs/howto/context-parallel.md``)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, cp: ContextParallel, rules: Rules
    ) -> Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)  # the blocks' and accumulators' dtype
        r, N = cp.rank, cp.world
        B, H, L, D = q.shape
        k_t, v_t = _heads_last(k), _heads_last(v)  # (B, L, G, D): sent as they are, no copy for the module's views
        out = _zeros_heads_last(B, H, L, D, q, acc)  # (B, H, L, D) view of (B, L, H, D)
        lse = q.new_full((B, H, L), -math.inf, dtype=torch.float64)
        if sinks is not None:  # the sink: one more term exp(s_h) in every row's denominator, with a value of 0
            lse = sinks.to(lse.dtype)[None, :, None].expand(B, H, L).clone()
        held = [k_t, v_t]  # the K/V shard of rank r - s, in the inputs' dtype: G heads, never H
        for s in range(N):
            src = (r - s) % N
            pending = cp.post_exchange(held, "forward", s) if s < N - 1 else None  # posted before the compute
            cp.note("compute", "forward", s)
            k_s, v_s = (t.transpose(1, 2).to(acc) for t in held)  # (B, G, L, D) views
            pairs, skipped = plan_pairs(cp, rules, r, src, q.device, acc)
            cp.stats.blocks += len(pairs)
            cp.stats.skipped += skipped
            for pair in pairs:
                o_b, l_b = block_forward(
                    q[:, :, pair.qs].to(acc), k_s[:, :, pair.ks], v_s[:, :, pair.ks], pair.spec, rules.scale
                )
                merge_(out[:, :, pair.qs], lse[:, :, pair.qs], o_b, l_b)
                cp.count_pairs(pair.pairs * H)  # (query, key, head) triples
            del k_s, v_s
            if pending is not None:
                held = cp.wait_exchange(pending, "forward", s)
                pending = None  # its handles hold the shard just sent: no third shard alive at the next post
        del held
        lse_acc = lse.to(acc)
        ctx.save_for_backward(q, sinks, out, lse_acc)
        # This rank's own K/V shard: held on ctx, not saved, so that the backward can let it go once it has been
        # computed on and sent on (step 0): the rank then holds the shards travelling, not its own as well.
        ctx.kv = [k_t, v_t]
        ctx.cp, ctx.rules = cp, rules
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, sinks, out, lse = ctx.saved_tensors
        if ctx.kv is None:
            raise RuntimeError(
                "context-parallel attention's backward ran twice (retain_graph=True): its first run let this "
                "rank's K/V shard go as the ring passed it on; run the forward again for a second backward."
            )
        held, ctx.kv = ctx.kv, None  # the only references now: freed when the ring has passed them on
        cp: ContextParallel = ctx.cp
        rules: Rules = ctx.rules
        acc = out.dtype
        r, N = cp.rank, cp.world
        B, H, L, D = q.shape
        G, kv_dtype = held[0].size(2), held[0].dtype
        do = dout.to(acc)  # strided (the merged heads' gradient seen as (B, H, L, D)): sliced, never copied whole
        dq = _zeros_heads_last(B, H, L, D, q, acc)
        grads = [q.new_zeros(B, L, G, D, dtype=acc), q.new_zeros(B, L, G, D, dtype=acc)]  # dK, dV (B, L, G, D)
        for s in range(N):
            src = (r - s) % N
            pending = cp.post_exchange(held, "backward", s) if s < N - 1 else None
            cp.note("compute", "backward", s)
            k_s, v_s = (t.transpose(1, 2).to(acc) for t in held)
            dk_acc, dv_acc = (g.transpose(1, 2) for g in grads)  # (B, G, L, D) views
            for pair in plan_pairs(cp, rules, r, src, q.device, acc)[0]:
                dq_b, dk_b, dv_b = block_backward(
                    q[:, :, pair.qs].to(acc),
                    k_s[:, :, pair.ks],
                    v_s[:, :, pair.ks],
                    out[:, :, pair.qs],
                    lse[:, :, pair.qs],
                    do[:, :, pair.qs],
                    pair.spec,
                    rules.scale,
                )
                dq[:, :, pair.qs] += dq_b
                dk_acc[:, :, pair.ks] += dk_b
                dv_acc[:, :, pair.ks] += dv_b
            del k_s, v_s, dk_acc, dv_acc
            held = cp.wait_exchange(pending, "backward", s) if pending is not None else []  # the last: none held on
            pending = None  # its handles hold the shard just sent: let it go (at step 0, this rank's own)
            for i in range(len(grads) if N > 1 else 0):  # on to the next holder (after N hops: home)
                # dK, then dV: one arriving buffer at a time; the handles die with the call, and the sent buffer with them
                grads[i] = cp.wait_exchange(cp.post_exchange([grads[i]], "backward-grads", s), "backward-grads", s)[0]
        dk, dv = (g.transpose(1, 2).to(kv_dtype) for g in grads)  # (B, G, L, D) views of (B, L, G, D)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # d s_h = -sum over rows of p_sink * rowsum(dO * O)
            p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)  # (B, H, L)
            dsinks = -(p_sink * (do * out).sum(-1)).sum(dim=(0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk, dv, dsinks, None, None


def ring_attention(
    cp: ContextParallel, q: Tensor, k: Tensor, v: Tensor, rules: Rules, sinks: Tensor | None = None
) -> Tensor:
    """``context (B, H, L, D)`` of this rank's queries over the whole sequence's keys, by the ring."""
    out: Tensor = _Ring.apply(q, k, v, sinks, cp, rules)
    return out
