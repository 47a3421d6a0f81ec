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


# A position no query reaches: an empty slot of a RollingKVCache is hidden by the causal test k_pos <= q_pos.
EMPTY_SLOT = 2**62


class RollingKVCache(KVCache):
    """A sliding-window layer's cache that keeps only the last ``window`` positions: memory bounded by
    the window, not by the sequence (Mistral's rolling buffer).

    Position ``p`` lives in slot ``p % window``; ``pos`` ``(window,)`` records which position each slot
    holds (empty slots hold a position no query reaches). Position mode only: every call passes
    ``cache_positions`` (the absolute positions of its tokens, consecutive). Use with a
    :class:`attnlab.MultiHeadAttention` built with ``window <= this window``: a decode step attends
    over the ``window`` slots, the mask built from ``pos``; a prefill of ``T`` tokens attends over
    the slots as they were plus its own ``T`` keys, then keeps the last ``window`` of them.
    """

    pos: Tensor

    def __init__(
        self,
        batch_size: int,
        window: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(batch_size, window, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.register_buffer(
            "pos", torch.full((window,), EMPTY_SLOT, dtype=torch.long, device=device), persistent=False
        )

    @classmethod
    def for_module(cls, mha: nn.Module, batch_size: int, max_len: int | None = None) -> RollingKVCache:
        """A cache of ``mha.window`` slots (``max_len`` is ignored: the window bounds it)."""
        window = getattr(mha, "window", None)
        if not isinstance(window, int):
            raise ValueError("RollingKVCache.for_module needs a module built with window=W (a sliding-window layer).")
        w = next(mha.parameters())
        G, D = getattr(mha, "num_kv_heads"), getattr(mha, "head_dim")  # noqa: B009
        return cls(batch_size, window, int(G), int(D), dtype=w.dtype, device=w.device)

    @property
    def window(self) -> int:
        return self.k.size(2)

    def reset(self) -> None:
        """Empty the cache: every slot marked empty."""
        self.pos.fill_(EMPTY_SLOT)

    def update(self, k: Tensor, v: Tensor, cache_positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        keys, values, _ = self.update_rolling(k, v, cache_positions)
        return keys, values

    def update_rolling(self, k: Tensor, v: Tensor, cache_positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Write ``k, v`` ``(B, G, T, D)`` at positions ``cache_positions`` ``(T,)``; return the keys,
        values and key positions to attend over: ``(B, G, S, D)`` twice and ``(S,)``."""
        self._check(k, v)
        if cache_positions is None:
            raise ValueError(
                "RollingKVCache needs cache_positions (the absolute position of each new token); slot = position % window."
            )
        T = k.size(2)
        W = self.window
        if T == 1:  # decode: write the slot, attend over the window (fixed shapes: compiles once)
            slot = cache_positions % W
            self.k.index_copy_(2, slot, k)
            self.v.index_copy_(2, slot, v)
            self.pos.index_copy_(0, slot, cache_positions)
            return self.k, self.v, self.pos
        # prefill: this call's queries need their own keys even where they overwrite each other's slots
        keys = torch.cat([self.k, k], dim=2)  # (B, G, W + T, D)
        values = torch.cat([self.v, v], dim=2)
        positions = torch.cat([self.pos, cache_positions])  # (W + T,)
        keep = slice(max(0, T - W), T)  # the last W of this call's tokens stay in the buffer
        slot = cache_positions[keep] % W
        self.k.index_copy_(2, slot, k[:, :, keep])
        self.v.index_copy_(2, slot, v[:, :, keep])
        self.pos.index_copy_(0, slot, cache_positions[keep])
        return keys, values, positions
