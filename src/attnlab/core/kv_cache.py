"""``KVCache``: preallocated per-layer key/value buffers for incremental decoding.

The buffers are ``(B, G, max_len, D)``: only the G key/value heads are stored, so GQA/MQA
shrink the cache by ``H / G``. What is filled is always explicit, never guessed from the
buffer's contents:

* **append mode** (``cache_positions=None``): ``length`` slots are filled; an update writes at
  ``[length, length + T)``, advances ``length``, and attention runs over the filled slots
  only. Simple and fast in eager mode.
* **position mode** (``cache_positions`` given, as in gpt-fast): an update writes at the given
  slots and attention runs over the whole buffer, the causal mask hiding every slot after a
  query's own. All shapes stay fixed, so a decode step compiles once with
  ``torch.compile(fullgraph=True)``. The caller owns the fill level; :meth:`KVCache.update`
  leaves ``length`` alone there (set it yourself if you mix the modes).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class KVCache(nn.Module):
    """Key/value buffers of one attention layer.

    Args:
        batch_size: B.
        max_len: slots per sequence; prompt plus generated tokens must fit.
        num_kv_heads: G (``mha.num_kv_heads``).
        head_dim: D (``mha.head_dim``).
        dtype, device: of the buffers; must match the attention's K/V.
    """

    k: Tensor
    v: Tensor

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("max_len", max_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TypeError(f"KVCache {name} must be a positive int, got {value!r}.")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.length = 0  # filled slots in append mode

    @classmethod
    def for_module(cls, mha: nn.Module, batch_size: int, max_len: int) -> KVCache:
        """A cache sized for ``mha`` (an :class:`attnlab.MultiHeadAttention`), on its device and dtype."""
        w = next(mha.parameters())
        G, D = getattr(mha, "num_kv_heads"), getattr(mha, "head_dim")  # noqa: B009 (nn.Module attributes are untyped)
        return cls(batch_size, max_len, int(G), int(D), dtype=w.dtype, device=w.device)

    @property
    def batch_size(self) -> int:
        return self.k.size(0)

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in this layer's cache, per sequence: K and V, G heads of D."""
        return 2 * self.k.size(1) * self.k.size(3) * self.k.element_size()

    def reset(self) -> None:
        """Empty the cache for reuse (the buffers are kept; stale values are never read)."""
        self.length = 0

    def extra_repr(self) -> str:
        B, G, L, D = self.k.shape
        return (
            f"batch_size={B}, num_kv_heads={G}, max_len={L}, head_dim={D}, dtype={self.k.dtype}, length={self.length}"
        )

    def _check(self, k: Tensor, v: Tensor) -> None:
        if k.size(0) != self.k.size(0):
            raise ValueError(
                f"kv_cache was built for batch size {self.k.size(0)} but this call has batch size "
                f"{k.size(0)}; build a cache with KVCache.for_module(mha, batch_size={k.size(0)}, max_len=...)."
            )
        if k.dtype != self.k.dtype or v.dtype != self.v.dtype:
            raise TypeError(
                f"kv_cache holds {self.k.dtype} but this call's keys/values are {k.dtype}; build the "
                f"cache with dtype={k.dtype} (KVCache.for_module follows the module's dtype)."
            )
        if k.shape[1::2] != self.k.shape[1::2] or k.device != self.k.device:
            raise ValueError(
                f"kv_cache stores (G, D) = {tuple(self.k.shape[1::2])} on {self.k.device} but the keys "
                f"are (G, D) = {tuple(k.shape[1::2])} on {k.device}; build it with KVCache.for_module(mha, ...)."
            )

    def update(self, k: Tensor, v: Tensor, cache_positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write this step's ``k, v`` ``(B, G, T, D)``; return the keys/values to attend over.

        Append mode returns the filled slots ``(B, G, length, D)``; position mode writes at
        ``cache_positions`` ``(T,)`` and returns the whole buffers ``(B, G, max_len, D)``.
        """
        self._check(k, v)
        T = k.size(2)
        if cache_positions is None:
            start, end = self.length, self.length + T
            if end > self.max_len:
                raise ValueError(
                    f"kv_cache overflow: {self.length} slots are filled and this call appends {T}, "
                    f"but max_len={self.max_len}; build the cache with max_len >= {end} or call reset()."
                )
            self.k[:, :, start:end] = k  # (B, G, T, D) written at slots [start, end)
            self.v[:, :, start:end] = v
            self.length = end
            return self.k[:, :, :end], self.v[:, :, :end]  # (B, G, end, D): views, no copy
        if cache_positions.shape != (T,):
            raise ValueError(
                f"cache_positions has shape {tuple(cache_positions.shape)}; expected ({T},), the slot "
                f"of each of this call's {T} new tokens."
            )
        if not torch.compiler.is_compiling() and cache_positions.device.type == "cpu" and T:
            lo, hi = int(cache_positions.min()), int(cache_positions.max())  # free on CPU: no device sync
            if lo < 0 or hi >= self.max_len:
                raise ValueError(
                    f"kv_cache overflow: cache_positions span [{lo}, {hi}] but max_len={self.max_len}; "
                    f"build the cache with max_len >= {hi + 1}."
                )
        self.k.index_copy_(2, cache_positions, k)  # (B, G, max_len, D), slots cache_positions written
        self.v.index_copy_(2, cache_positions, v)
        return self.k, self.v
