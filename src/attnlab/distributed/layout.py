"""Which positions of the sequence each rank holds: the ``zigzag`` and ``contiguous`` layouts.

Notation: ``T`` the true sequence length, ``N`` the ranks of the group, ``T_pad`` the length padded
so that it splits into whole chunks, ``c`` one chunk's length, ``L = T_pad / N`` a rank's share.

* ``contiguous``: ``N`` chunks; rank ``r`` holds chunk ``r``. Under causal masking rank ``N - 1``
  computes ``(2N - 1) / N`` times the mean work: its queries come last and see every key.
* ``zigzag`` (head-tail): ``2N`` chunks; rank ``r`` holds chunks ``r`` and ``2N - 1 - r``, one early and
  one late, so every rank computes exactly the same number of causal (query, key) pairs.

Positions ``>= T`` are padding: their keys are never attended and their outputs are dropped by
:meth:`ShardPlan.unshard`. The plan is pure arithmetic, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["LAYOUTS", "Layout", "ShardPlan"]

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


@dataclass(frozen=True)
class ShardPlan:
    """The split of a sequence of ``length`` positions over ``world`` ranks in ``layout``."""

    length: int  # T
    world: int  # N
    layout: str = "zigzag"

    @property
    def num_chunks(self) -> int:
        return 2 * self.world if self.layout == "zigzag" else self.world

    @property
    def chunk(self) -> int:
        """``c``: positions per chunk (at least 1)."""
        return max(1, -(-self.length // self.num_chunks))

    @property
    def padded(self) -> int:
        """``T_pad = c * chunks >= T``."""
        return self.chunk * self.num_chunks

    @property
    def local(self) -> int:
        """``L``: positions per rank."""
        return self.padded // self.world

    def chunk_ids(self, rank: int) -> tuple[int, ...]:
        """The chunks rank ``rank`` holds, in the order its shard stores them."""
        if self.layout == "zigzag":
            return (rank, 2 * self.world - 1 - rank)
        return (rank,)

    def positions(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """``(L,)`` int64: the sequence position of each row of rank ``rank``'s shard."""
        c = self.chunk
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunk_ids(rank)])

    def order(self, device: torch.device | str | None = None) -> Tensor:
        """``(T_pad,)``: the positions of the ranks' shards concatenated in rank order."""
        return torch.cat([self.positions(r, device) for r in range(self.world)])

    def shard(self, x: Tensor, rank: int, dim: int) -> Tensor:
        """Rank ``rank``'s part of the full ``x``, padded with zeros (False for bool) along ``dim`` to ``T_pad``."""
        if x.size(dim) != self.length:
            raise ValueError(f"expected length {self.length} along dim {dim}, got {x.size(dim)}")
        if self.padded > self.length:
            pad_shape = list(x.shape)
            pad_shape[dim] = self.padded - self.length
            x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
        c = self.chunk
        return torch.cat([x.narrow(dim, i * c, c) for i in self.chunk_ids(rank)], dim=dim)

    def unshard(self, parts: Tensor, dim: int) -> Tensor:
        """The full sequence, in order and unpadded, from the shards concatenated in rank order along ``dim``."""
        inverse = torch.argsort(self.order(parts.device))  # where each position sits in the concatenation
        return parts.index_select(dim, inverse[: self.length])
