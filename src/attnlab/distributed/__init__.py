"""Context parallelism: exact attention over one sequence split across ``torch.distributed`` ranks.

:class:`ContextParallel` shards a sequence (``zigzag`` or ``contiguous`` layout), runs attention
across the ranks by the ring (:mod:`.ring`) or the all-to-all (:mod:`.alltoall`), forward and
backward, and gathers the result. ``MultiHeadAttention(..., context_parallel=cp)`` and the models
take it; see ``docs/howto/context-parallel.md`` for what each method sends.
"""

from .context import ContextParallel
from .group import METHODS, CPStats
from .layout import LAYOUTS, ShardPlan

__all__ = ["LAYOUTS", "METHODS", "CPStats", "ContextParallel", "ShardPlan"]
