"""``ContextParallel``: one long sequence split over the ranks of a ``torch.distributed`` group.

    cp = ContextParallel(layout="zigzag", method="ring")  # after torch.distributed.init_process_group
    x_local = cp.shard(x, dim=1)               # this rank's positions (also masks, ids, positions)
    y_local = mha(x_local, is_causal=True, context_parallel=cp)
    y = cp.gather(y_local, dim=1)              # the whole sequence, in order, on every rank

Everything position-wise (projections, MLPs, norms, the loss) runs on the shard as it is; attention,
the one step that mixes positions, runs through :meth:`ContextParallel.attend` by the ring
(:mod:`attnlab.distributed.ring`) or the all-to-all (:mod:`attnlab.distributed.alltoall`).
Gradients: the attention's backward is distributed too (``dQ`` local, ``dK, dV`` travel back around
the ring); parameter gradients are partial sums per rank, summed by :meth:`all_reduce_grads` (or by
DDP over the group, with the loss scaled as :meth:`all_reduce_grads` explains).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.variants import document_positions, document_runs
from .alltoall import alltoall_attention
from .group import RankGroup
from .layout import ShardPlan
from .ring import Rules, ring_attention

__all__ = ["ContextParallel"]


class ContextParallel(RankGroup):
    """Split one sequence over the ranks of ``group`` and run exact attention across them.

    Args:
        group: a ``torch.distributed`` process group; None is the default (world) group. It must be
            initialised (``torch.distributed.init_process_group``, as under ``torchrun``).
        layout: ``"zigzag"`` (each rank holds chunks ``r`` and ``2N-1-r``: balanced causal work) or
            ``"contiguous"`` (rank ``r`` holds the ``r``-th ``1/N`` of the sequence).
        method: ``"ring"`` (K/V blocks pass around the ranks; any head count) or ``"alltoall"``
            (DeepSpeed Ulysses: heads exchanged for positions; ``H`` and ``G`` divisible by ``N``).
        record_events: keep the order of posts, computes and waits in ``stats.events`` (for tests
            and profiles: shows that each transfer is posted before the compute it overlaps).
    """

    # -- the split ------------------------------------------------------------------------------
    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's positions of the full ``x`` along ``dim`` (the sequence dim), padded to whole chunks.

        Shard everything position-wise with it, the same way: the input, ``key_padding_mask``,
        ``document_ids``, targets. A length not divisible by the chunks is padded (zeros, False);
        padded keys are never attended, and :meth:`gather` drops the padded rows.
        Records the full length, which :meth:`attend` and :meth:`positions` use.
        """
        if not isinstance(x, Tensor) or x.dim() == 0:
            raise ValueError(f"cp.shard expects a tensor with a sequence dim, got {type(x).__name__}.")
        dim = dim % x.dim()
        self.length = x.size(dim)
        return self.plan().shard(x, self.rank, dim)

    def positions(self, device: torch.device | str | None = None) -> Tensor:
        """``(L,)`` int64: the sequence position of each row of this rank's shard (for RoPE, learned positions)."""
        return self.plan().positions(self.rank, device)

    def valid(self, device: torch.device | str | None = None) -> Tensor:
        """``(L,)`` bool: True where a row of this rank's shard is a real position, False for padding."""
        return self.positions(device) < self._length()

    def document_positions(self, document_ids: Tensor) -> Tensor:
        """``(B, L)`` positions that restart at each document, from this rank's ``document_ids (B, L)`` shard."""
        full = self._gather_rows(document_ids)  # (B, T_pad) in order
        return self.plan().shard(document_positions(full)[:, : self._length()], self.rank, 1)

    def gather(self, y: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence, in order and unpadded, on every rank, from this rank's shard ``y``.

        Differentiable. Its backward hands each rank its own slice of the incoming gradient, which is
        right when every rank computes the same function of the gathered tensor (the same loss).
        """
        dim = dim % y.dim()
        out: Tensor = _Gather.apply(y, self, dim)
        return out

    # -- attention -------------------------------------------------------------------------------
    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        is_causal: bool,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
        alibi: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """``context (B, H, L, D)`` of this rank's ``q (B, H, L, D)`` over every rank's ``k, v (B, G, L, D)``.

        ``key_padding_mask (B, L)`` (True = padding) and ``document_ids (B, L)`` are this rank's shards.
        """
        T = self._length()
        plan = self.plan()
        self._check_shapes(q, k, key_padding_mask, document_ids, T, plan)
        self.stats.calls += 1
        if key_padding_mask is not None:  # 0 * NaN is NaN: what a caller left in padded keys must not leak
            pad = key_padding_mask[:, None, :, None]  # (B, 1, L, 1)
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
        key_pad = None if key_padding_mask is None else self._gather_rows(key_padding_mask)  # (B, T_pad), True = pad
        runs = None if document_ids is None else document_runs(self._gather_rows(document_ids))  # (B, T_pad)
        if self.method == "alltoall":
            rules = Rules(scale=scale, causal=is_causal, length=T, window=window, softcap=softcap, alibi=alibi)
            return alltoall_attention(
                self,
                q,
                k,
                v,
                rules,
                None if key_pad is None else key_pad[:, :T],
                None if runs is None else runs[:, :T],
                sinks,
            )
        key_keep = None if key_pad is None else ~key_pad
        rules = Rules(
            scale=scale,
            causal=is_causal,
            length=T,
            window=window,
            softcap=softcap,
            alibi=alibi,
            key_keep=key_keep,
            docs=runs,
        )
        return ring_attention(self, q, k, v, rules, sinks)

    def _check_shapes(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None,
        document_ids: Tensor | None,
        T: int,
        plan: ShardPlan,
    ) -> None:
        """Refuse a call whose shards cannot be one sequence, on *every* rank at once: a rank that raised
        alone would leave the others waiting in the ring forever."""
        B, H, L, D = q.shape
        G = k.size(1)
        problem = self._local_problem(B, H, L, G, key_padding_mask, document_ids, T, plan)
        rows = self.agree(problem, q.device, (L, B, H, G, D, T))
        if len(set(rows)) > 1:
            listing = "; ".join(
                f"rank {i}: L={r[0]}, B={r[1]}, H={r[2]}, G={r[3]}, D={r[4]}, T={r[5]}" for i, r in enumerate(rows)
            )
            raise ValueError(
                f"context_parallel: the ranks' shards do not match ({listing}); every rank must call the module on "
                f"its cp.shard of the same sequence (same T, batch and heads)."
            )

    def _local_problem(
        self,
        B: int,
        H: int,
        L: int,
        G: int,
        key_padding_mask: Tensor | None,
        document_ids: Tensor | None,
        T: int,
        plan: ShardPlan,
    ) -> str | None:
        """Why this rank's inputs cannot be its shard of the last sharded sequence, or None."""
        if L != plan.local:
            full = " (the full sequence's: pass cp.shard(x, dim=1))" if L == T else ""
            return (
                f"context_parallel: this rank's input has {L} positions{full}; the last cp.shard split T={T} into "
                f"{self.world} shards of {plan.local}. Shard every input of the call with the same cp.shard."
            )
        for name, t in (("key_padding_mask", key_padding_mask), ("document_ids", document_ids)):
            if t is None:
                continue
            if name == "key_padding_mask" and t.dtype != torch.bool:
                return (
                    f"context_parallel: key_padding_mask must be bool (True = padding), got {t.dtype}; "
                    f"pass mask.bool() for a 0/1 mask."
                )
            if t.dim() != 2 or t.size(0) != B or t.size(1) != L:
                hint = (
                    f"it is shaped for the full sequence: pass cp.shard({name}, dim=1)"
                    if t.dim() == 2 and t.size(1) == T and T != L
                    else f"expected this rank's shard (B, L) = ({B}, {L}), from cp.shard({name}, dim=1)"
                )
                return f"context_parallel: {name} has shape {tuple(t.shape)}; {hint}."
        if self.method == "alltoall" and (H % self.world or G % self.world):
            return (
                f"method='alltoall' splits the heads over the {self.world} ranks, so num_heads ({H}) and "
                f"num_kv_heads ({G}) must both be divisible by {self.world}; use method='ring' (any head count) "
                f"or a group whose size divides both."
            )
        return None

    # -- gradients -------------------------------------------------------------------------------
    def all_reduce_grads(self, module: nn.Module) -> None:
        """Sum every parameter's ``.grad`` over the group, as DDP does (without its division).

        Each rank's backward gives the parameters the share of its positions (and, through the ring,
        of the keys it holds); the sum over ranks is the single-process gradient when each rank's loss
        is its positions' share of the full loss (e.g. summed token losses over the global count).
        Under DDP over this group instead, scale that loss by ``N``: DDP divides by ``N``.
        """
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: Tensor, cp: ContextParallel, dim: int) -> Tensor:
        plan = cp.plan()
        problem = None
        if y.size(dim) != plan.local:
            problem = (
                f"cp.gather: the tensor has {y.size(dim)} positions along dim {dim}; this rank's shard of "
                f"T={plan.length} has {plan.local}. Gather what the module returned for cp.shard's input."
            )
        cp.agree(problem, y.device)  # every rank raises, or none: all_gather needs every rank's equal share
        y = y.contiguous()  # before empty_like, which keeps a strided tensor's strides
        parts = [torch.empty_like(y) for _ in range(cp.world)]
        dist.all_gather(parts, y, group=cp.group)
        ctx.cp, ctx.dim, ctx.plan = cp, dim, plan
        return plan.unshard(torch.cat(parts, dim=dim), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        return ctx.plan.shard(grad, ctx.cp.rank, ctx.dim), None, None
