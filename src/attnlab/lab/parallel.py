"""Context parallelism in the lab: ``torchrun --nproc-per-node C*D -m attnlab train --context-parallel C``.

Process layout (rank = the torchrun ``RANK``, ``C`` = ``--context-parallel``, ``D = WORLD_SIZE / C``):

* context-parallel group ``g`` (``g = 0 .. D-1``) is the ``C`` consecutive ranks ``g*C .. g*C + C-1``: they
  hold one data-parallel replica and split its sequences along time (``cp.shard``), rank ``g*C + j``
  holding shard ``j``. Consecutive ranks, because torchrun numbers one node's processes consecutively and
  the ring's traffic (every attention layer, forward and backward) is the heavy one: it stays on a node.
* data-parallel group ``j`` (``j = 0 .. C-1``) is the ranks ``j, j + C, ..., j + (D-1)*C``: the ranks
  holding shard ``j`` of every replica. The lab reduces gradients with DDP over the whole world instead
  of over these groups (see :func:`cp_loss`), so they are listed in ``summary.json`` but not created.

Replica ``g`` gets ``task.batch(step, g, D)``, the rows DDP with ``D`` processes gives rank ``g``; its
``C`` ranks all build that same batch and keep their shard of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed import ContextParallel
from ..distributed.failures import DEFAULT_RANK_TIMEOUT
from ..runtime import UsageError
from .config import TrainConfig
from .data import IGNORE

__all__ = ["ProcessLayout", "check_context_parallel", "make_context_parallel", "shard_batch", "cp_loss"]


@dataclass(frozen=True)
class ProcessLayout:
    """Where this process sits in the ``C x D`` grid of a run (``C = context``, ``D = data``)."""

    world: int  # WORLD_SIZE = C * D
    rank: int  # this process's global rank
    context: int = 1  # C: ranks that split one replica's sequences

    @property
    def data(self) -> int:
        """``D``: data-parallel replicas, each a group of ``C`` ranks."""
        return self.world // self.context

    @property
    def replica(self) -> int:
        """This rank's replica (its context-parallel group), the ``rank`` its batch is drawn for."""
        return self.rank // self.context

    def context_groups(self) -> list[list[int]]:
        """The ranks of each context-parallel group: ``C`` consecutive ones per replica."""
        C = self.context
        return [list(range(g * C, (g + 1) * C)) for g in range(self.data)]

    def data_groups(self) -> list[list[int]]:
        """The ranks holding the same shard position of every replica (one group per shard)."""
        return [list(range(j, self.world, self.context)) for j in range(self.context)]

    def describe(self) -> dict[str, Any]:
        """The layout as ``summary.json`` records it."""
        return {
            "context_parallel": self.context,
            "data_parallel": self.data,
            "context_parallel_groups": self.context_groups(),
            "data_parallel_groups": self.data_groups(),
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_context_parallel(cfg: TrainConfig, world: int, device: torch.device) -> None:
    """Refuse, before any process group exists, a ``--context-parallel`` this run cannot honour."""
    C = cfg.context_parallel
    if C == 1:
        return
    if world == 1:
        raise UsageError(
            f"--context-parallel {C} splits each sequence over {C} processes, but this is one process (WORLD_SIZE 1, "
            f"expected a multiple of {C}); launch it with `torchrun --nproc-per-node {C} -m attnlab train ...`, "
            f"or pass --context-parallel 1."
        )
    if world % C:
        raise UsageError(
            f"--context-parallel {C} must divide the {world} processes torchrun started (WORLD_SIZE {world}), so that "
            f"every data-parallel replica has {C} ranks; pass --context-parallel among {_divisors(world)}, "
            f"or start a multiple of {C} processes."
        )
    if cfg.model.kind != "gpt":
        raise UsageError(
            f"--context-parallel {C} needs --model.kind gpt, got --model.kind {cfg.model.kind}: seed 002's "
            f"MinimalFormerBlock stack has no context-parallel forward; pass --model.kind gpt, or --context-parallel 1."
        )
    if cfg.model.dropout > 0:
        raise UsageError(
            f"--context-parallel {C} needs --model.dropout 0, got {cfg.model.dropout}: attention dropout cannot be "
            f"drawn across ranks, and a shard's dropout masks would not be the single-process run's; pass "
            f"--model.dropout 0, or --context-parallel 1."
        )
    if device.type not in ("cpu", "cuda"):
        raise UsageError(
            f"--device {device.type} with --context-parallel {C}: the ring runs on cpu (gloo) or cuda (nccl), "
            f"expected one of those; pass --device cpu."
        )


def make_context_parallel(layout: ProcessLayout, timeout_s: float = DEFAULT_RANK_TIMEOUT) -> ContextParallel | None:
    """This rank's :class:`ContextParallel` over its replica's ranks (None when ``C == 1``).

    ``new_group`` is collective over the whole world: every rank creates every group, in the same order,
    and keeps its own. Each group's transfers (the ring's sends and receives) fail after ``timeout_s``
    (``--rank-timeout``) when a rank of it stops answering: ``new_group`` would otherwise give them
    gloo's default of 30 minutes, not the world group's timeout.
    """
    if layout.context == 1:
        return None
    mine: Any = None
    for ranks in layout.context_groups():
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
        if layout.rank in ranks:
            mine = group
    return ContextParallel(mine, layout="zigzag", method="ring")


def shard_batch(cp: ContextParallel, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's ``(x, y)`` shards of the replica's batch and the replica's scored-token count.

    Padding rows (a length not divisible by the ``2C`` chunks) get ``IGNORE`` targets: they are never
    scored. The count is the full batch's, taken before sharding, so no rank needs to ask the others.
    """
    count = (y != IGNORE).sum()  # () scored tokens of the whole replica batch
    x_local = cp.shard(x, dim=1)  # (B, L)
    y_local = cp.shard(y, dim=1).masked_fill(~cp.valid(y.device)[None, :], IGNORE)  # (B, L)
    return x_local, y_local, count


def cp_loss(loss_sum: Tensor, replica_count: Tensor, context: int) -> Tensor:
    """The loss this rank backpropagates: its shard's summed token losses over the replica's count, times ``C``.

    Summed over the replica's ``C`` ranks, ``loss_sum / count`` is the replica's mean loss, so its gradients
    sum to the single-process one. DDP runs over the whole world (``C * D`` ranks) and *averages*, so each
    rank's loss is scaled by ``C``: the average over the world is then the average over the ``D`` replicas,
    as plain DDP gives. One DDP over the world was chosen over ``cp.all_reduce_grads`` plus a data-parallel
    reduction: it keeps the lab's one gradient path (bucketed all-reduces overlapped with the backward,
    the initial weight broadcast) and needs no data-parallel groups.
    """
    return loss_sum * context / replica_count.clamp(min=1)
