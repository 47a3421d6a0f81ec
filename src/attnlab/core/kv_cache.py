"""``KVCache``: preallocated per-layer key/value buffers for incremental decoding.

The buffers are ``(B, G, max_len, D)`` (values ``(B, G, max_len, Dv)`` where a module's ``v_head_dim``
differs from its ``head_dim``): only the G key/value heads are stored, so GQA/MQA shrink the cache by ``H / G``. What is filled is always explicit, never guessed from the
buffer's contents:

* **append mode** (``cache_positions=None``): ``length`` slots are filled; an update writes at
  ``[length, length + T)``, advances ``length``, and attention runs over the filled slots
  only. Simple and fast in eager mode.
* **position mode** (``cache_positions`` given, as in gpt-fast): an update writes at the given
  slots and attention runs over the whole buffer, the causal mask hiding every slot after a
  query's own. All shapes stay fixed, so a decode step compiles once with
  ``torch.compile(fullgraph=True)``. The caller owns the fill level; :meth:`KVCache.update`
  leaves ``length`` alone there (set it yourself if you mix the modes). The positions may be on
  any device, int64 or int32: :meth:`KVCache.prepare_positions` checks them where that is free
  (on the CPU) and moves them to the buffers.
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
        head_dim: D (``mha.head_dim``), the width of each cached key head.
        v_head_dim: Dv (``mha.v_head_dim``), the width of each cached value head; default ``head_dim``.
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
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, value in (
            ("batch_size", batch_size),
            ("max_len", max_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("v_head_dim", v_head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TypeError(f"KVCache {name} must be a positive int, got {value!r}.")
        shape = (batch_size, num_kv_heads, max_len, head_dim)  # (B, G, max_len, D)
        v_shape = (batch_size, num_kv_heads, max_len, v_head_dim)  # (B, G, max_len, Dv)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(v_shape, dtype=dtype, device=device), persistent=False)
        self.length = 0  # filled slots in append mode

    @classmethod
    def for_module(cls, mha: nn.Module, batch_size: int, max_len: int) -> KVCache:
        """A cache sized for ``mha`` (an :class:`attnlab.MultiHeadAttention`), on its device and dtype."""
        w = next(mha.parameters())
        G, D = getattr(mha, "num_kv_heads"), getattr(mha, "head_dim")  # noqa: B009 (nn.Module attributes are untyped)
        Dv = getattr(mha, "v_head_dim", D)
        return cls(batch_size, max_len, int(G), int(D), v_head_dim=int(Dv), dtype=w.dtype, device=w.device)

    @property
    def batch_size(self) -> int:
        return self.k.size(0)

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in this layer's cache, per sequence: K and V, G heads of D and of Dv."""
        return self.k.size(1) * (self.k.size(3) + self.v.size(3)) * self.k.element_size()

    def reset(self) -> None:
        """Empty the cache for reuse (the buffers are kept; stale values are never read)."""
        self.length = 0

    def extra_repr(self) -> str:
        B, G, L, D = self.k.shape
        v_head = f", v_head_dim={self.v.size(3)}" if self.v.size(3) != D else ""
        return (
            f"batch_size={B}, num_kv_heads={G}, max_len={L}, head_dim={D}{v_head}, dtype={self.k.dtype}, "
            f"length={self.length}"
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
        if v.shape[1::2] != self.v.shape[1::2]:
            raise ValueError(
                f"kv_cache stores values of (G, Dv) = {tuple(self.v.shape[1::2])} but this call's values are "
                f"(G, Dv) = {tuple(v.shape[1::2])}; build it with KVCache.for_module(mha, ...), which reads the "
                f"module's v_head_dim."
            )

    def update(self, k: Tensor, v: Tensor, cache_positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Write this step's ``k (B, G, T, D)``, ``v (B, G, T, Dv)``; return the keys/values to attend over.

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
            self.v[:, :, start:end] = v  # (B, G, T, Dv)
            self.length = end
            return self.k[:, :, :end], self.v[:, :, :end]  # (B, G, end, D): views, no copy
        if cache_positions.shape != (T,):
            raise ValueError(
                f"cache_positions has shape {tuple(cache_positions.shape)}; expected ({T},), the slot "
                f"of each of this call's {T} new tokens."
            )
        cache_positions = self.prepare_positions(cache_positions)  # (T,) int64 on the buffers' device
        self.k.index_copy_(2, cache_positions, k)  # (B, G, max_len, D), slots cache_positions written
        self.v.index_copy_(2, cache_positions, v)
        return self.k, self.v

    def prepare_positions(self, cache_positions: Tensor) -> Tensor:
        """``cache_positions`` ``(T,)`` as int64 on this cache's device, checked against ``max_len`` first where
        that is free: a CPU tensor, outside ``torch.compile``.

        Positions may come from any device and as int32 (``torch.tensor([3])`` is built on the CPU, as users
        write it), but ``index_copy_`` needs an int64 index on the buffers' device (on an H200 a CPU index
        raised ``Expected all tensors to be on the same device``), so they are moved here; transformers 5's
        static cache layers likewise index with positions on the cache's own device. Positions already there
        (what :func:`attnlab.generate` passes) are returned as they are: no copy, no device sync, nothing
        new in a compiled step's graph.
        """
        if not torch.compiler.is_compiling() and cache_positions.device.type == "cpu" and cache_positions.numel():
            self._check_positions(cache_positions)
        return cache_positions.to(device=self.k.device, dtype=torch.long)

    def _check_positions(self, cache_positions: Tensor) -> None:
        """Bounds of CPU positions (free there: no device sync): every slot in ``[0, max_len)``."""
        lo, hi = int(cache_positions.min()), int(cache_positions.max())
        if lo < 0 or hi >= self.max_len:
            raise ValueError(
                f"kv_cache overflow: cache_positions span [{lo}, {hi}] but max_len={self.max_len}; "
                f"build the cache with max_len >= {hi + 1}."
            )


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
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(batch_size, window, num_kv_heads, head_dim, v_head_dim=v_head_dim, dtype=dtype, device=device)
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
        Dv = getattr(mha, "v_head_dim", D)
        return cls(batch_size, window, int(G), int(D), v_head_dim=int(Dv), dtype=w.dtype, device=w.device)

    @property
    def window(self) -> int:
        return self.k.size(2)

    def reset(self) -> None:
        """Empty the cache: every slot marked empty."""
        self.pos.fill_(EMPTY_SLOT)

    def update(self, k: Tensor, v: Tensor, cache_positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        keys, values, _ = self.update_rolling(k, v, cache_positions)
        return keys, values

    def _check_positions(self, cache_positions: Tensor) -> None:
        """Any position fits: position ``p`` lives in slot ``p % window``."""

    def update_rolling(self, k: Tensor, v: Tensor, cache_positions: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Write ``k (B, G, T, D)``, ``v (B, G, T, Dv)`` at positions ``cache_positions`` ``(T,)``; return the keys,
        values and key positions to attend over: ``(B, G, S, D)``, ``(B, G, S, Dv)`` and ``(S,)``."""
        self._check(k, v)
        if cache_positions is None:
            raise ValueError(
                "RollingKVCache needs cache_positions (the absolute position of each new token); slot = position % window."
            )
        T = k.size(2)
        W = self.window
        cache_positions = self.prepare_positions(cache_positions)  # (T,) int64 on the buffers' device
        if T == 1:  # decode: write the slot, attend over the window (fixed shapes: compiles once)
            slot = cache_positions % W
            self.k.index_copy_(2, slot, k)
            self.v.index_copy_(2, slot, v)
            self.pos.index_copy_(0, slot, cache_positions)
            return self.k, self.v, self.pos
        # prefill: this call's queries need their own keys even where they overwrite each other's slots
        keys = torch.cat([self.k, k], dim=2)  # (B, G, W + T, D)
        values = torch.cat([self.v, v], dim=2)  # (B, G, W + T, Dv)
        positions = torch.cat([self.pos, cache_positions])  # (W + T,)
        keep = slice(max(0, T - W), T)  # the last W of this call's tokens stay in the buffer
        slot = cache_positions[keep] % W
        self.k.index_copy_(2, slot, k[:, :, keep])
        self.v.index_copy_(2, slot, v[:, :, keep])
        self.pos.index_copy_(0, slot, cache_positions[keep])
        return keys, values, positions


def decoder_positions(
    device: torch.device, positions: Tensor | None, cache_positions: Tensor | None, caches: nn.ModuleList | None
) -> tuple[Tensor | None, Tensor | None]:
    """A decoder call's ``positions`` ``(T,)`` / ``(B, T)`` and ``cache_positions`` ``(T,)`` on its weights' ``device``.

    Moved once per model call, for the embeddings, RoPE, the masks and every layer's cache; the cache positions
    through the first cache's :meth:`KVCache.prepare_positions` (bounds checked first while they are on the CPU).
    Tensors already there come back as they are, so a compiled decode step gains nothing.
    """
    if cache_positions is not None and (cache_positions.device != device or cache_positions.dtype != torch.long):
        first = caches[0] if caches is not None and len(caches) else None
        if isinstance(first, KVCache):
            cache_positions = first.prepare_positions(cache_positions)
        else:
            cache_positions = cache_positions.to(device=device, dtype=torch.long)
    if positions is not None and positions.device != device:
        positions = positions.to(device)
    return positions, cache_positions
