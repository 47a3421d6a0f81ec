"""``MLACache``: the KV cache of one multi-head latent attention layer (DeepSeek-V2/V3).

Shapes: B batch, S cache slots (``max_len``), T tokens of one call, C = ``kv_lora_rank`` (the latent),
R = ``qk_rope_head_dim`` (the decoupled rotary key, shared by every head).

Per token the cache holds only ``C + R`` values (576 for DeepSeek-V3), whatever the number of heads: the
normalised latent ``c_KV`` and the rotated key ``k_R``. Both live in one buffer ``kv (B, S, C + R)``, each
row ``[c_KV | k_R]``; :attr:`MLACache.latent` ``(B, S, C)`` and :attr:`MLACache.rope_key` ``(B, S, R)`` are
views of it. One buffer, not two, because the absorbed path attends to that row as it is (one key of
width ``C + R``, its first ``C`` channels the value), so a decode step reads the cache without
concatenating it first (vLLM's MLA cache has the same layout).

The two modes are :class:`attnlab.KVCache`'s (see :mod:`attnlab.core.kv_cache`): **append**
(``cache_positions=None``: ``length`` slots filled, attention over them) and **position** (``cache_positions``
given: writes at those slots, attention over the whole buffer with the causal mask hiding later slots; fixed
shapes, so a decode step compiles once with ``torch.compile(fullgraph=True)``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .kv_cache import append_slots, check_positions_shape

__all__ = ["MLACache"]


class MLACache(nn.Module):
    """Latent and rotary-key buffer of one MLA layer.

    Args:
        batch_size: B.
        max_len: S, slots per sequence; prompt plus generated tokens must fit.
        kv_lora_rank: C (``mla.kv_lora_rank``).
        qk_rope_head_dim: R (``mla.qk_rope_head_dim``).
        dtype, device: of the buffer; must match the attention's weights.
    """

    kv: Tensor

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("max_len", max_len),
            ("kv_lora_rank", kv_lora_rank),
            ("qk_rope_head_dim", qk_rope_head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise TypeError(f"MLACache {name} must be a positive int, got {value!r}.")
        self.kv_lora_rank = kv_lora_rank  # C
        self.qk_rope_head_dim = qk_rope_head_dim  # R
        shape = (batch_size, max_len, kv_lora_rank + qk_rope_head_dim)  # (B, S, C + R)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.length = 0  # filled slots in append mode

    @classmethod
    def for_module(cls, mla: nn.Module, batch_size: int, max_len: int) -> MLACache:
        """A cache sized for ``mla`` (an :class:`attnlab.MultiHeadLatentAttention`), on its device and dtype."""
        w = next(mla.parameters())
        C, R = getattr(mla, "kv_lora_rank"), getattr(mla, "qk_rope_head_dim")  # noqa: B009 (untyped nn.Module attributes)
        return cls(batch_size, max_len, int(C), int(R), dtype=w.dtype, device=w.device)

    @property
    def batch_size(self) -> int:
        return self.kv.size(0)

    @property
    def max_len(self) -> int:
        return self.kv.size(1)

    @property
    def latent(self) -> Tensor:
        """The normalised latents ``c_KV`` ``(B, S, C)``: a view of :attr:`kv`."""
        return self.kv[..., : self.kv_lora_rank]  # (B, S, C)

    @property
    def rope_key(self) -> Tensor:
        """The rotated shared keys ``k_R`` ``(B, S, R)``: a view of :attr:`kv`."""
        return self.kv[..., self.kv_lora_rank :]  # (B, S, R)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in this layer's cache, per sequence: ``(C + R) * itemsize``, for all heads."""
        return self.kv.size(2) * self.kv.element_size()

    def reset(self) -> None:
        """Empty the cache for reuse (the buffer is kept; stale values are never read)."""
        self.length = 0

    def extra_repr(self) -> str:
        B, S, _ = self.kv.shape
        return (
            f"batch_size={B}, max_len={S}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, dtype={self.kv.dtype}, length={self.length}"
        )

    def _check(self, rows: Tensor) -> None:
        if rows.size(0) != self.kv.size(0):
            raise ValueError(
                f"kv_cache was built for batch size {self.kv.size(0)} but this call has batch size {rows.size(0)}; "
                f"build a cache with MLACache.for_module(mla, batch_size={rows.size(0)}, max_len=...)."
            )
        if rows.dtype != self.kv.dtype:
            raise TypeError(
                f"kv_cache holds {self.kv.dtype} but this call's latents are {rows.dtype}; build the cache with "
                f"dtype={rows.dtype} (MLACache.for_module follows the module's dtype)."
            )
        if rows.size(2) != self.kv.size(2) or rows.device != self.kv.device:
            raise ValueError(
                f"kv_cache stores kv_lora_rank + qk_rope_head_dim = {self.kv.size(2)} values per token on "
                f"{self.kv.device} but this layer writes {rows.size(2)} on {rows.device}; build it with "
                f"MLACache.for_module(mla, ...)."
            )

    def update(self, rows: Tensor, cache_positions: Tensor | None = None) -> Tensor:
        """Write this call's rows ``[c_KV | k_R]`` ``(B, T, C + R)``; return the rows to attend over.

        Append mode returns the filled slots ``(B, length, C + R)``; position mode writes at
        ``cache_positions`` ``(T,)`` and returns the whole buffer ``(B, S, C + R)``.
        """
        self._check(rows)
        T = rows.size(1)
        if cache_positions is None:
            start, end = append_slots(self.length, T, self.max_len)
            self.kv[:, start:end] = rows  # (B, T, C + R) written at slots [start, end)
            self.length = end
            return self.kv[:, :end]  # (B, end, C + R): a view, no copy
        check_positions_shape(cache_positions, T)
        cache_positions = self.prepare_positions(cache_positions)  # (T,) int64 on the buffer's device
        self.kv.index_copy_(1, cache_positions, rows)  # (B, S, C + R), slots cache_positions written
        return self.kv

    def prepare_positions(self, cache_positions: Tensor) -> Tensor:
        """``cache_positions`` ``(T,)`` as int64 on the buffer's device, bounds checked first where that is free
        (a CPU tensor, outside ``torch.compile``), as :meth:`attnlab.KVCache.prepare_positions` does."""
        if not torch.compiler.is_compiling() and cache_positions.device.type == "cpu" and cache_positions.numel():
            lo, hi = int(cache_positions.min()), int(cache_positions.max())
            if lo < 0:
                raise ValueError(
                    f"cache_positions span [{lo}, {hi}]; slots are numbered 0 to max_len - 1 = {self.max_len - 1}: "
                    f"pass the tokens' positions counted from 0."
                )
            if hi >= self.max_len:
                raise ValueError(
                    f"kv_cache overflow: cache_positions span [{lo}, {hi}] but max_len={self.max_len}; "
                    f"build the cache with max_len >= {hi + 1}."
                )
        return cache_positions.to(device=self.kv.device, dtype=torch.long)
