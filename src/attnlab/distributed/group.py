"""The ranks of a context-parallel group: who is next on the ring, the shard plan, the transfers, the counts.

:class:`RankGroup` is the part of :class:`attnlab.distributed.ContextParallel` that the ring and the
all-to-all use; it holds no attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import LAYOUTS, ShardPlan

__all__ = ["METHODS", "CPStats", "RankGroup"]

METHODS: tuple[str, ...] = ("ring", "alltoall")
_TAGS = {"forward": 11, "backward": 12, "backward-grads": 13}


@dataclass
class CPStats:
    """What this rank did since the last :meth:`ContextParallel.reset_stats`.

    ``pairs``: (query, key, head) triples that causality and the window let attend, per batch row,
    over the blocks this rank computed (skipped blocks count nothing), forward only. ``bytes_sent``:
    bytes this rank put on the wire, forward and backward (ring hops, all-to-all shares; not the small
    shape checks). ``calls``: attention calls.
    """

    pairs: int = 0
    bytes_sent: int = 0
    calls: int = 0
    blocks: int = 0  # ring tile pairs computed (forward)
    skipped: int = 0  # ring tile pairs left out: causality or the window hides every pair of them
    events: list[tuple[str, str, int]] | None = field(default=None, repr=False)


class RankGroup:
    """A ``torch.distributed`` group, its ring order and shard plan, and what this rank sent (see :class:`ContextParallel`)."""

    def __init__(
        self, group: Any = None, *, layout: str = "zigzag", method: str = "ring", record_events: bool = False
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ContextParallel needs an initialised torch.distributed process group, and none is: call "
                "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (GPU) first, as torchrun's "
                "processes do, or run a single process without context_parallel."
            )
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}.")
        if method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}.")
        world_group: Any = dist.group.WORLD
        self.group: Any = group if group is not None else world_group
        self.rank: int = dist.get_rank(self.group)  # r, this process's index in the group
        self.world: int = dist.get_world_size(self.group)  # N
        if self.rank < 0:
            raise ValueError("this process is not a member of the group passed to ContextParallel.")
        self.layout, self.method = layout, method
        self.length: int | None = None  # T of the sequence last sharded
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        self.stats = CPStats(events=[] if record_events else None)

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, world={self.world}, layout={self.layout!r}, method={self.method!r})"

    # -- the split ------------------------------------------------------------------------------
    def plan(self, length: int | None = None) -> ShardPlan:
        """The :class:`~attnlab.distributed.layout.ShardPlan` of a sequence of ``length`` (default: the last sharded)."""
        length = self._length() if length is None else length
        return ShardPlan(length, self.world, self.layout)

    def _length(self) -> int:
        if self.length is None:
            raise ValueError(
                "this ContextParallel has not sharded a sequence yet, so it does not know the full length: call "
                "cp.shard(x, dim=1) on the full input first (every rank, the same length)."
            )
        return self.length

    def _gather_rows(self, t: Tensor) -> Tensor:
        """``(B, L, ...)`` shards -> ``(B, T_pad, ...)`` in position order (padding rows kept), not differentiable."""
        t = t.contiguous()  # before empty_like, which keeps a strided tensor's strides
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t, group=self.group)
        inverse = torch.argsort(self.plan().order(t.device))
        return torch.cat(parts, dim=1).index_select(1, inverse)

    def agree(self, problem: str | None, device: torch.device, header: Sequence[int] = ()) -> list[tuple[int, ...]]:
        """Raise ``problem`` on this rank and a pointer to it on every other: one rank must not raise alone.

        ``header``: small ints every rank shares in the same collective; returns each rank's, in rank order."""
        if self.world == 1:
            if problem is not None:
                raise ValueError(problem)
            return [tuple(header)]
        mine = torch.tensor([*header, problem is not None], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            mine = mine.to(device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        rows = [tuple(int(x) for x in e.tolist()) for e in every]
        if problem is not None:
            raise ValueError(problem)
        refused = [i for i, row in enumerate(rows) if row[-1]]
        if refused:
            raise ValueError(
                f"context_parallel: rank {refused[0]} refused its inputs (its error says why); this rank stops too, "
                f"so that no rank waits for the others forever."
            )
        return [row[:-1] for row in rows]

    # -- transport (ring) ------------------------------------------------------------------------
    def post_exchange(self, tensors: Sequence[Tensor], phase: str, step: int) -> tuple[list[Any], list[Tensor]]:
        """Post sending ``tensors`` (contiguous) to the next rank and receiving their likes from the previous one."""
        got = [torch.empty_like(t) for t in tensors]
        tag = _TAGS[phase]
        ops = [dist.P2POp(dist.isend, t, self._next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, self._prev, self.group, tag) for g in got]
        reqs = dist.batch_isend_irecv(ops)
        self.count_bytes(sum(t.numel() * t.element_size() for t in tensors))
        self.note("post", phase, step)
        return reqs, got

    def wait_exchange(self, pending: tuple[list[Any], list[Tensor]], phase: str, step: int) -> list[Tensor]:
        """Wait for a posted exchange; the received tensors (the sent ones may be freed after this)."""
        reqs, got = pending
        for req in reqs:
            req.wait()
        self.note("wait", phase, step)
        return got

    def note(self, what: str, phase: str, step: int) -> None:
        if self.stats.events is not None:
            self.stats.events.append((what, phase, step))

    def count_pairs(self, n: int) -> None:
        self.stats.pairs += n

    def count_bytes(self, n: int) -> None:
        self.stats.bytes_sent += n

    def reset_stats(self) -> None:
        self.stats = CPStats(events=None if self.stats.events is None else [])
