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

The buffers may hold fewer bytes than the keys and values computed (``dtype=``, see :data:`KV_DTYPES`):
float16 or bfloat16 (2 bytes a value), or ``"int8"``: symmetric int8 with one float32 scale per block of
:data:`INT8_BLOCK` = 32 values of a token's head (GGML's Q8_0 layout; 1.125 bytes a value). Writes round
(:func:`quantize_int8`), reads give the keys and values back in the compute dtype (``compute_dtype``), so
every PyTorch attention path reads the same numbers the C++ decode kernel reads from the compact rows.
Why a scale per block of 32 and not per token-head: one outlying channel (RoPE'd keys have a few large
ones) then coarsens only its block, and it is the layout llama.cpp's ``-ctk q8_0`` and its kernels use; the
second scale costs 4 of a head's 72 bytes (SmolLM2, D = 64). The stated bound: a value reads back within half its
block's scale, ``|x - read| <= max|block| / 254`` (tests/test_kv_cache_dtype.py). What it does to greedy text:
scripts/kv_cache_agreement.py, reported in docs/howto/real-models.md (the 8-bit KV cache against the float32 cache).
"""

from __future__ import annotations

import math
import mmap
from typing import Literal, cast

import torch
from torch import Tensor, nn

KVDtype = Literal["float32", "float16", "bfloat16", "int8"]
KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}  # a cache's storage: the name users pass (``--kv-dtype``) and the buffers' dtype
INT8_BLOCK = 32  # values of one token's head per int8 scale (GGML's Q8_0 block)


def kv_storage_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The buffers' dtype for a ``KVCache(dtype=...)``: a name of :data:`KV_DTYPES` or a float / int8 torch dtype."""
    if isinstance(dtype, str) and dtype in KV_DTYPES:
        return KV_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype == torch.int8):
        return dtype
    raise ValueError(
        f"KVCache dtype={dtype!r} is not a cache storage; expected one of {sorted(KV_DTYPES)} (or a float torch dtype)."
    )


def int8_block(head_dim: int) -> int:
    """Values per int8 scale for a head of ``head_dim``: :data:`INT8_BLOCK`, or the whole head when it does not divide."""
    return INT8_BLOCK if head_dim % INT8_BLOCK == 0 else head_dim


def quantize_int8(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``x (..., D)`` as int8 ``q (..., D)`` and float32 ``scale (..., D / block)``: per block of ``block`` values,
    ``scale = max|x| / 127`` and ``q = round(x / scale)`` (an all-zero block: scale 0, q 0). The C++ decode step
    rounds the same way (``write_cache_row`` in quant/csrc/qmatmul.cpp)."""
    xb = x.float().reshape(*x.shape[:-1], -1, block)  # (..., D / block, block)
    scale = xb.abs().amax(-1) / 127.0  # (..., D / block)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (xb / safe[..., None]).round().clamp_(-127, 127).to(torch.int8)  # (..., D / block, block)
    return q.flatten(-2), scale


def dequantize_int8(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``q (..., D)`` int8 times its ``scale (..., D / block)``, as ``dtype``."""
    out = q.reshape(*q.shape[:-1], scale.size(-1), -1).float() * scale[..., None]  # (..., D / block, block)
    return out.flatten(-2).to(dtype)


def dequantize_int8_into(out: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    """:func:`dequantize_int8` written into ``out (..., D)`` (any float dtype, a strided view of a larger buffer
    too), with no temporary: the same numbers, each ``float32(q) * scale`` rounded once to ``out``'s dtype."""
    out.copy_(q)  # int8 values are exact in every float dtype
    out.view(*out.shape[:-1], scale.size(-1), -1).mul_(scale[..., None])  # (..., D / block, block), in float32
    return out


# Buffers of at least this many bytes are mapped lazily by lazy_zeros.
LAZY_ZEROS_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
    """``torch.zeros(shape)`` whose memory becomes resident only as it is written.

    On a CPU, a buffer of :data:`LAZY_ZEROS_BYTES` or more is an anonymous memory map of its own: the OS hands out
    zero pages on first touch, and gives the whole map back when the tensor is freed. ``torch.zeros`` writes every
    byte at once, so a cache of ``max_len`` slots was resident in full before the prompt's first token (SmolLM2's
    float16 cache at 8192 slots: 189 MB from the start), and a run stopped early never needed most of it. Elsewhere,
    and for small buffers, ``torch.zeros``.
    """
    dev = torch.device(device) if device is not None else torch.get_default_device()
    nbytes = math.prod(shape) * dtype.itemsize
    if dev.type != "cpu" or nbytes < LAZY_ZEROS_BYTES:
        return torch.zeros(shape, dtype=dtype, device=dev)
    pages = mmap.mmap(-1, nbytes)  # anonymous, private, zero-filled; the tensor keeps it alive
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def share_read_scratch(caches: nn.ModuleList | list[KVCache]) -> None:
    """Let the compact caches of one model share one buffer for their reads (:meth:`KVCache.read`).

    A cache stored in fewer bytes than it computes in (float16, int8) is read back as a new tensor in the compute
    dtype on each call: at 8184 slots SmolLM2's keys and values come back as 12.6 MB of float32 per layer and
    prefill chunk, of a size that grows with every chunk (glibc cannot reuse the freed, smaller holes: the heap grew
    by ~100 MB over a long prefill, measured). The layers run one after another, so one buffer of the largest
    cache's size serves them all, written in place. Only reads without autograd use it (a backward pass would need
    every layer's keys at once); the tensors such a read returns are valid until the next read of a cache sharing
    the buffer. :meth:`attnlab.models.decoder.Decoder.setup_caches` calls this for its compact caches.
    """
    scratch: dict[str, Tensor] = {}
    for cache in caches:
        if isinstance(cache, KVCache) and cache.k.dtype != cache.compute_dtype:
            cache.read_scratch = scratch


def append_slots(length: int, new: int, max_len: int) -> tuple[int, int]:
    """``(start, end)``: the slots ``[start, end)`` that an append-mode call of ``new`` tokens writes into a cache
    of ``max_len`` slots whose first ``length`` are filled; an overflow is refused, saying how to avoid it."""
    end = length + new
    if end > max_len:
        raise ValueError(
            f"kv_cache overflow: {length} slots are filled and this call appends {new}, "
            f"but max_len={max_len}; build the cache with max_len >= {end} or call reset()."
        )
    return length, end


def check_positions_shape(cache_positions: Tensor, new: int) -> None:
    """``cache_positions`` is ``(new,)``: one slot for each of a position-mode call's ``new`` tokens."""
    if cache_positions.shape != (new,):
        raise ValueError(
            f"cache_positions has shape {tuple(cache_positions.shape)}; expected ({new},), the slot "
            f"of each of this call's {new} new tokens."
        )


class KVCache(nn.Module):
    """Key/value buffers of one attention layer.

    Args:
        batch_size: B.
        max_len: slots per sequence; prompt plus generated tokens must fit.
        num_kv_heads: G (``mha.num_kv_heads``).
        head_dim: D (``mha.head_dim``), the width of each cached key head.
        v_head_dim: Dv (``mha.v_head_dim``), the width of each cached value head; default ``head_dim``.
        dtype: the buffers' storage: ``torch.float32`` (exact for float32 attention), ``float16``, ``bfloat16``
            or ``"int8"`` (names as in :data:`KV_DTYPES`); see the module docstring.
        compute_dtype: the dtype of the keys/values written and read back (the attention's); default
            ``dtype`` when that is a float dtype, else float32.
        device: of the buffers.
    """

    k: Tensor
    v: Tensor
    k_scale: Tensor | None  # int8 only: (B, G, max_len, D / block) float32
    v_scale: Tensor | None

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        v_head_dim: int | None = None,
        dtype: torch.dtype | str = torch.float32,
        compute_dtype: torch.dtype | None = None,
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
        storage = kv_storage_dtype(dtype)
        self.compute_dtype = compute_dtype or (storage if storage.is_floating_point else torch.float32)
        shape = (batch_size, num_kv_heads, max_len, head_dim)  # (B, G, max_len, D)
        v_shape = (batch_size, num_kv_heads, max_len, v_head_dim)  # (B, G, max_len, Dv)
        # zeros (position mode reads every slot, the unwritten ones masked: they must be finite), resident as written
        self.register_buffer("k", lazy_zeros(shape, storage, device), persistent=False)
        self.register_buffer("v", lazy_zeros(v_shape, storage, device), persistent=False)
        for name, dim in (("k_scale", head_dim), ("v_scale", v_head_dim)):
            scales = None
            if storage == torch.int8:  # (B, G, max_len, D / block)
                scales = lazy_zeros((*shape[:3], dim // int8_block(dim)), torch.float32, device)
            self.register_buffer(name, scales, persistent=False)
        self.length = 0  # filled slots in append mode
        # shared with the model's other caches by share_read_scratch: where reads in the compute dtype are written
        self.read_scratch: dict[str, Tensor] | None = None

    @classmethod
    def for_module(
        cls, mha: nn.Module, batch_size: int, max_len: int, *, dtype: torch.dtype | str | None = None
    ) -> KVCache:
        """A cache sized for ``mha`` (an :class:`attnlab.MultiHeadAttention`), on its device, computing in its dtype;
        ``dtype`` the storage (default the module's dtype)."""
        w = next(mha.parameters())
        G, D = getattr(mha, "num_kv_heads"), getattr(mha, "head_dim")  # noqa: B009 (nn.Module attributes are untyped)
        Dv = getattr(mha, "v_head_dim", D)
        storage = w.dtype if dtype is None else dtype
        return cls(
            batch_size,
            max_len,
            int(G),
            int(D),
            v_head_dim=int(Dv),
            dtype=storage,
            compute_dtype=w.dtype,
            device=w.device,
        )

    @property
    def batch_size(self) -> int:
        return self.k.size(0)

    @property
    def max_len(self) -> int:
        return self.k.size(2)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in this layer's cache, per sequence: K and V, G heads of D and of Dv (and the
        int8 scales)."""
        per_slot = [t[0, :, 0].nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        return sum(per_slot)

    @property
    def dtype(self) -> torch.dtype:
        """The buffers' storage dtype (``torch.int8`` for the int8 form)."""
        return self.k.dtype

    def reset(self) -> None:
        """Empty the cache for reuse (the buffers are kept; stale values are never read)."""
        self.length = 0

    def extra_repr(self) -> str:
        B, G, L, D = self.k.shape
        v_head = f", v_head_dim={self.v.size(3)}" if self.v.size(3) != D else ""
        return (
            f"batch_size={B}, num_kv_heads={G}, max_len={L}, head_dim={D}{v_head}, dtype={self.k.dtype}, "
            f"compute_dtype={self.compute_dtype}, length={self.length}"
        )

    def _check(self, k: Tensor, v: Tensor) -> None:
        if k.size(0) != self.k.size(0):
            raise ValueError(
                f"kv_cache was built for batch size {self.k.size(0)} but this call has batch size "
                f"{k.size(0)}; build a cache with KVCache.for_module(mha, batch_size={k.size(0)}, max_len=...)."
            )
        if k.dtype != self.compute_dtype or v.dtype != self.compute_dtype:
            raise TypeError(
                f"kv_cache holds {self.compute_dtype} but this call's keys/values are {k.dtype}; build the "
                f"cache with compute_dtype={k.dtype} (KVCache.for_module follows the module's dtype)."
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
            start, end = append_slots(self.length, T, self.max_len)
            self._write(slice(start, end), k, v)  # (B, G, T, D) written at slots [start, end)
            self.length = end
            return self.read(end)  # (B, G, end, D): views, no copy, where storage = compute dtype
        check_positions_shape(cache_positions, T)
        cache_positions = self.prepare_positions(cache_positions)  # (T,) int64 on the buffers' device
        self._write(cache_positions, k, v)  # (B, G, max_len, D), slots cache_positions written
        return self.read()

    def _write(self, slots: slice | Tensor, k: Tensor, v: Tensor) -> None:
        """``k (B, G, T, D)``, ``v (B, G, T, Dv)`` rounded to the storage and written at ``slots`` (a slice, or
        ``(T,)`` int64 slot indices)."""
        for buf, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if scales is not None:
                q, sc = quantize_int8(x, x.size(-1) // scales.size(-1))  # (B, G, T, D), (B, G, T, D / block)
                parts = [(buf, q), (scales, sc)]
            else:  # no .to() where the dtypes agree: a traced decode step stays the ops it was
                parts = [(buf, x if x.dtype == buf.dtype else x.to(buf.dtype))]
            for dst, src in parts:
                if isinstance(slots, slice):
                    dst[:, :, slots] = src
                else:
                    dst.index_copy_(2, slots, src)

    def read(self, end: int | None = None) -> tuple[Tensor, Tensor]:
        """The keys ``(B, G, end, D)`` and values ``(B, G, end, Dv)`` of slots ``[0, end)`` (default all) in the compute
        dtype: views when the storage is the compute dtype, else dequantized copies (without autograd, into the
        buffer :func:`share_read_scratch` gave this cache, if any: valid until the next read of a cache sharing it)."""
        scratch = self.read_scratch
        if scratch is not None and (torch.is_grad_enabled() or torch.compiler.is_compiling()):
            scratch = None
        out = []
        for name, buf, scales in (("k", self.k, self.k_scale), ("v", self.v, self.v_scale)):
            part = buf if end is None else buf[:, :, :end]
            if scratch is not None:
                out.append(
                    self._read_into(scratch, name, buf, part, None if scales is None else scales[:, :, : part.size(2)])
                )
                continue
            if scales is not None:
                part = dequantize_int8(part, scales if end is None else scales[:, :, :end], self.compute_dtype)
            out.append(part if part.dtype == self.compute_dtype else part.to(self.compute_dtype))
        return out[0], out[1]

    def _read_into(
        self, scratch: dict[str, Tensor], name: str, buf: Tensor, part: Tensor, scales: Tensor | None
    ) -> Tensor:
        """``part`` (the first slots of ``buf``) in the compute dtype, written into ``scratch[name]``; that buffer is
        (re)made, lazily resident, where it is missing or smaller than ``buf``."""
        dst = scratch.get(name)
        B, G, S, D = buf.shape
        if (
            dst is None
            or dst.dtype != self.compute_dtype
            or dst.device != buf.device
            or dst.shape[:2] != (B, G)
            or dst.size(2) < S
            or dst.size(3) != D
        ):
            dst = scratch[name] = lazy_zeros((B, G, S, D), self.compute_dtype, buf.device)
        view = dst[:, :, : part.size(2)]  # (B, G, end, D), a strided view of the shared buffer
        return view.copy_(part) if scales is None else dequantize_int8_into(view, part, scales)

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
        dtype: torch.dtype | str = torch.float32,
        compute_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            batch_size,
            window,
            num_kv_heads,
            head_dim,
            v_head_dim=v_head_dim,
            dtype=dtype,
            compute_dtype=compute_dtype,
            device=device,
        )
        self.register_buffer(
            "pos", torch.full((window,), EMPTY_SLOT, dtype=torch.long, device=device), persistent=False
        )

    @classmethod
    def for_module(
        cls, mha: nn.Module, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype | str | None = None
    ) -> RollingKVCache:
        """A cache of ``mha.window`` slots (``max_len`` is ignored: the window bounds it); ``dtype`` the storage."""
        window = getattr(mha, "window", None)
        if not isinstance(window, int):
            raise ValueError("RollingKVCache.for_module needs a module built with window=W (a sliding-window layer).")
        return cast(RollingKVCache, super().for_module(mha, batch_size, window, dtype=dtype))

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
            self._write(slot, k, v)
            self.pos.index_copy_(0, slot, cache_positions)
            return *self.read(), self.pos
        # prefill: this call's queries need their own keys even where they overwrite each other's slots
        old_k, old_v = self.read()
        keys = torch.cat([old_k, k], dim=2)  # (B, G, W + T, D)
        values = torch.cat([old_v, v], dim=2)  # (B, G, W + T, Dv)
        positions = torch.cat([self.pos, cache_positions])  # (W + T,)
        keep = slice(max(0, T - W), T)  # the last W of this call's tokens stay in the buffer
        slot = cache_positions[keep] % W
        self._write(slot, k[:, :, keep], v[:, :, keep])
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


# What ``--kv-dtype auto`` stores on a CPU where the fused C++ decode step reads the cache (SmolLM2 from its GGUF).
# Measured (scripts/bench_decode_attention.py, AMD EPYC Zen 5, 1 thread, CPU time on a loaded machine): the step at
# 7000 slots took 25.6 ms over float32, 20.1 over float16, 21.6 over int8 (the old kernel: 51.5); at 8192 30.9,
# 22.2, 23.6: float16 was the fastest then (int8's widening and scaling cost more than its bytes saved). Since the
# int8 keys meet the query in int8 products on AVX-512 VNNI (qmatmul.cpp, scores_q8_vnni), the same script (AMD EPYC
# Zen 4, 2 threads, quiet, wall time, medians of 2 alternated runs) gives float16 / int8: 6.17 / 6.22 ms at 512
# slots, 9.46 / 8.20 at 2048, 19.00 / 14.07 at 8192. So float16 stays the default while its cache is small: as fast
# as int8 there, and the closest to float32 (scripts/kv_cache_agreement.py); int8 takes over where it is both the
# faster and the smaller.
CPU_FUSED_KV_DTYPE: KVDtype = "float16"
# ... up to this many bytes of float16 cache; a call whose cache would hold more stores int8 (issue 51: peak RSS).
# SmolLM2 caches 23,040 bytes a position in float16, 12,960 in int8: over 32 MB from 1389 positions, 189 MB against
# 106 MB at its 8192. The int8 cache's cost (docs/howto/real-models.md, "The 8-bit KV cache against the float32
# cache"): teacher-forced over 20 chat prompts it takes the float32 cache's greedy token at 97.0% of the positions,
# where the float32 cache itself, summed in another order (2 threads instead of 1), takes it at 97.7%.
CPU_FUSED_FLOAT16_MAX_BYTES = 32_000_000
CPU_FUSED_LONG_KV_DTYPE: KVDtype = "int8"


def kv_cache_bytes(dtype: str, values: int) -> int:
    """Bytes a cache of ``values`` K/V values takes stored as ``dtype`` (a name of :data:`KV_DTYPES`), int8's
    float32 scales (one per :data:`INT8_BLOCK` values) counted."""
    if dtype == "int8":
        return values + 4 * (values // INT8_BLOCK)
    return values * KV_DTYPES[dtype].itemsize


def resolve_kv_dtype(
    asked: str, device: torch.device, fused: bool, flag: str = "--kv-dtype", *, slots: int = 0, per_slot: int = 0
) -> tuple[str | None, str]:
    """``(storage, why)`` for a command's ``--kv-dtype``: a name of :data:`KV_DTYPES`, or None for the compute dtype.

    ``auto``: on a CPU whose decode step is the fused C++ one (``fused``, it reads compact rows in their own bytes)
    :data:`CPU_FUSED_KV_DTYPE`, or :data:`CPU_FUSED_LONG_KV_DTYPE` where the call's cache would take more than
    :data:`CPU_FUSED_FLOAT16_MAX_BYTES` in float16: ``slots`` the positions it will reach (prompt and new tokens,
    over all its rows), ``per_slot`` the K/V values one position caches over all layers (0 when not known: the
    short case). Elsewhere the dtype K/V are computed in, exact (a PyTorch path would only add a dequantizing copy
    per step). Raises ``ValueError`` naming ``flag`` for anything else.
    """
    name = asked.strip().lower()
    if name == "auto":
        if fused and device.type == "cpu":
            where = f"{flag} auto on a CPU with the fused decode step"
            half = kv_cache_bytes("float16", slots * per_slot)
            if half <= CPU_FUSED_FLOAT16_MAX_BYTES:
                return CPU_FUSED_KV_DTYPE, f"{where} (fewer bytes read per step)"
            long = CPU_FUSED_LONG_KV_DTYPE
            return long, (
                f"{where}, {slots} positions: {kv_cache_bytes(long, slots * per_slot) / 1e6:.0f} MB against "
                f"{half / 1e6:.0f} MB in float16, over {CPU_FUSED_FLOAT16_MAX_BYTES / 1e6:.0f} MB; greedy agreement with "
                f"float32, teacher-forced: 97.0%, against 97.7% for float32 summed in another order"
            )
        return None, f"{flag} auto: the compute dtype, exact (no compact-cache kernel on this path)"
    if name not in KV_DTYPES:
        raise ValueError(f"{flag} {asked!r} is not a KV-cache dtype; use auto, {', '.join(KV_DTYPES)}.")
    return name, f"{flag} {name} asked for it"


def kv_cache_choice(
    asked: str, device: torch.device, fused: bool, flag: str = "--kv-dtype", *, slots: int = 0, per_slot: int = 0
) -> tuple[str | None, str]:
    """``(storage, words)``: :func:`resolve_kv_dtype`, and what the weights line adds for it (``"KV cache float16
    (why)"``; none for a cache in the compute dtype: the exact cache says nothing). ``attnlab generate`` (its
    chat too) and ``attnlab.stream`` both choose here, so that they run the same cache and print the same line."""
    storage, why = resolve_kv_dtype(asked, device, fused, flag, slots=slots, per_slot=per_slot)
    return storage, f"KV cache {storage} ({why})" if storage else ""


def kv_values_per_position(model: nn.Module) -> int:
    """The K/V values one position of ``model``'s cache holds over all its layers (a decoder's
    ``kv_cache_bytes_per_token`` over its compute dtype's size; 0 for a model that says neither)."""
    per_token = int(getattr(model, "kv_cache_bytes_per_token", 0))
    dtype = getattr(model, "_kv_dtype", None)
    return per_token // dtype().itemsize if per_token and callable(dtype) else 0
