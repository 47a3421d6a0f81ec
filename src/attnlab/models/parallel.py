"""Positions of a context-parallel shard, shared by the decoders (:class:`TinyGPT`, :class:`Llama`)."""

from __future__ import annotations

from torch import Tensor

from ..core.attention import ContextParallelAttention

__all__ = ["context_parallel_positions"]


def context_parallel_positions(
    cp: ContextParallelAttention,
    idx: Tensor,
    positions: Tensor | None,
    caches: object | None,
    cache_positions: Tensor | None,
    document_ids: Tensor | None,
    block_size: int | None,
) -> Tensor:
    """``(L,)`` or ``(B, L)`` int64: the true sequence position of each token of this rank's shard ``idx (B, L)``.

    They come from the layout (``cp.positions()``), restarting in each document with ``document_ids``.
    Padding rows (a length not divisible by the chunks) get the last real position: any in-range one
    would do, as their outputs are dropped, and a learned table must not be indexed past its end.
    """
    if positions is not None or caches is not None or cache_positions is not None:
        given = ", ".join(
            n
            for n, v in (("positions", positions), ("caches", caches), ("cache_positions", cache_positions))
            if v is not None
        )
        raise ValueError(
            f"context_parallel sets each shard's positions from its layout, so {given} cannot be passed with it; "
            f"decode with a cache on one process, without context_parallel."
        )
    pos = cp.positions(idx.device) if document_ids is None else cp.document_positions(document_ids)
    length = cp.length if cp.length is not None else pos.numel()
    if block_size is not None and length > block_size:
        raise ValueError(
            f"the sharded sequence has T={length} tokens, more than block_size={block_size} positions the model "
            f"has embeddings for; shard a sequence of at most {block_size} tokens."
        )
    return pos.clamp(max=max(length - 1, 0))
