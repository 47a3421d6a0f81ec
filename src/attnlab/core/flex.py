"""The FlexAttention backend: the variants of :mod:`attnlab.core.variants` as a ``mask_mod`` and a ``score_mod``.

Notation: b batch, h query head, q/k query/key *index* in this call's tensors (a key's position, which
the variants are written in, comes from the :class:`~attnlab.core.variants.Structure`), B, H, G, T_q,
T_k, D as everywhere in attnlab.

``torch.nn.attention.flex_attention`` (compiled) computes ``softmax(score_mod(q k^T * scale)) @ v``
over the keys that ``mask_mod`` keeps, and only in the ``128 x 128`` tiles that a ``BlockMask``
lists: a tile is *full* (every pair kept: ``mask_mod`` skipped), *partial* (``mask_mod`` evaluated
per pair) or absent (skipped). A sliding window of 256 keeps about 3 tiles per row of tiles, so the
cost grows linearly in T, and no ``T x T`` mask is ever built.

Here every variant becomes one of those pieces:

* causal, window, documents, the user's bool mask and key padding: ``mask_mod``;
* softcap, ALiBi and the user's float bias: ``score_mod``, in the reference's order (softcap, then
  the biases);
* sinks: flex has no sink term. The sink adds ``exp(s_h)`` to each row's denominator, so
  ``out_sink = out * Z / (Z + exp(s_h)) = out * sigmoid(lse - s_h)`` with ``lse = log Z`` (exact);
  compiled CPU flex cannot return the LSE (torch 2.13), so on a CPU the sink joins instead as one
  extra key of zeros whose score is ``s_h`` (as the SDPA path does; one more tile per row of tiles);
* GQA: ``enable_gqa=True`` (query head h reads K/V head ``h // (H // G)``). In fp16/bf16 the grouped heads'
  dK/dV are summed in float32: torch 2.13's flex backward kernel (``flex_backwards.py.jinja``) loops over the
  ``H // G`` query heads of a K/V head into float32 accumulators before one store. That kernel runs on GPUs only
  (no CPU backward), so it is not measured here; when compiled flex fails, the fallbacks
  (:func:`~attnlab.core.variants.banded_sdpa`, :func:`~attnlab.core.variants.variant_sdpa`) follow
  :func:`~attnlab.core.functional.sdpa_compute_dtype` as every SDPA path does.

The ``BlockMask`` is not built by ``create_block_mask``: that evaluates ``mask_mod`` on every
``(q, k)`` pair, which at T=16384 took 3.1 s and 2.4 GB in eager mode (measured, torch 2.13 CPU),
more than the attention itself. Causal, window and document masks are monotone in the positions,
so each tile's verdict follows from its positions' minimum and maximum (:func:`_tile_verdicts`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import Masks
from .variants import Structure, banded_sdpa, document_start, variant_math, variant_sdpa

__all__ = [
    "FLEX_BLOCK",
    "FLEX_CROSSOVERS",
    "FLEX_MIN_HEAD_DIM",
    "Crossover",
    "FlexCall",
    "flex_available",
    "flex_choice",
    "flex_variant",
]

FLEX_BLOCK = 128  # tile size of the BlockMask (flex's default), queries and keys alike
# compiled kernels per process (one per shape and variant: static shapes, since dynamic ones failed to build on CPU)
FLEX_MAX_COMPILES = 32

# Flex's Triton kernel, which every device but the CPU (its own C++ template, kernel/flex/flex_cpu.py: no such
# limit) and MPS runs, refuses a query/key or value head dim below 16 before it builds anything:
# torch/_inductor/kernel/flex/flex_attention.py (torch 2.13, lowering of flex_attention: "tl.dot does not support
# embedding size less than 16", NotImplementedError "NYI: embedding dimension of the query, key, and value must be
# at least 16 but got E=... and Ev=..."). Measured on an H200, torch 2.11: InductorError at E=8. Any D >= 16
# runs: one that is not a power of two is padded to the next inside the kernel (QK_HEAD_DIM_ROUNDED,
# kernel/flex/common.py), not refused. The module checks the smaller of its q/k and v head dims (E and Ev).
FLEX_MIN_HEAD_DIM = 16


def flex_min_head_dim(device: torch.device) -> int | None:
    """The smallest head dim flex's kernel on ``device`` takes: :data:`FLEX_MIN_HEAD_DIM` where the Triton kernel
    runs (CUDA, XPU), None elsewhere (the CPU template has no limit; MPS is not a flex device here)."""
    return FLEX_MIN_HEAD_DIM if device.type in ("cuda", "xpu") else None


@dataclass(frozen=True)
class FlexCall:
    """What one compiled flex kernel is built for, and so the key a failure is remembered under.

    ``torch.compile(flex_attention, dynamic=False)`` specialises each kernel on the device, the dtype, the
    shapes of ``q (B, H, T_q, D)`` and ``k (B, G, T_k, D)``, whether a backward is traced, and the code of
    ``mask_mod`` / ``score_mod``, which changes with the variants that are on (the sinks' LSE path, ALiBi's
    slopes, a user's mask or bias are each traced into it). A kernel that failed to build says nothing
    about another of these: only this one is refused again.
    """

    device: torch.device
    dtype: torch.dtype
    q_shape: tuple[int, ...]  # (B, H, T_q, D)
    k_shape: tuple[int, ...]  # (B, G, T_k, D)
    grad: bool  # some input requires grad: the backward is traced with the forward
    variants: tuple[str, ...]  # what mask_mod / score_mod compute, in the module's words

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor, masks: Masks, st: Structure) -> FlexCall:
        """The kernel :func:`_flex_variant` builds for these inputs."""
        parts = {
            "causal": st.causal or masks.causal,
            "window": st.window is not None,
            "softcap": st.softcap is not None,
            "alibi": st.alibi is not None,
            "sinks": st.sinks is not None,
            "documents": st.q_doc is not None,
            "mask": masks.keep is not None,
            "bias": masks.bias is not None,
        }
        return cls(
            device=q.device,
            dtype=q.dtype,
            q_shape=tuple(q.shape),
            k_shape=tuple(k.shape),
            grad=any(t.requires_grad for t in (q, k, v)),
            variants=tuple(name for name, on in parts.items() if on),
        )

    def __str__(self) -> str:
        mode = "training" if self.grad else "inference"
        variants = "+".join(self.variants) or "no variant"
        return f"q {self.q_shape}, k {self.k_shape}, {self.dtype}, {self.device} {mode}, {variants}"


# kernel -> why it failed in this process. auto does not try that kernel again, nor does backend='flex': a failed
# compilation left in place was measured to slow every later forward to 1.6-7.6 s (eager flex). Only the kernel
# that failed is refused: on an H200, one failure at head dim 8 remembered for the whole device made every later
# flex call in the process refuse, at any head dim (5 test failures).
_FAILED: dict[FlexCall, str] = {}


@dataclass(frozen=True)
class Crossover:
    """From which query length ``auto`` sends a case to flex, in which dtypes, and the measurement that says so."""

    min_tokens: int
    dtypes: tuple[torch.dtype, ...]  # the dtypes measured; others keep the SDPA / math path (unless in `same_kernel`)
    evidence: str  # the measurement: device, dtype, sizes and figures
    same_kernel: tuple[torch.dtype, ...] = ()  # not measured, listed on `same_kernel_why`: flex runs them as `dtypes`
    same_kernel_why: str = ""


# (device type, grad mode, case) -> Crossover. A case not listed is never sent to flex by auto: no measurement,
# no choice (CPU training: torch has no CPU flex backward).
#
# CPU inference, window (attnlab bench --variant window: W=256, E=512, H=8, B=1, float32, torch 2.13, a 2-core
# AVX-512 CPU shared with other jobs, 1 thread; docs/bench_window.json): forward ms of the kernels, flex / band
# SDPA / dense-mask SDPA, 13.3 / 12.9 / 18.7 at T=1024 and 26.9 / 27.4 / 78.0 at 2048 (medians of 5), then 51 /
# 53 / 313 at 4096, 106 / 105 / 1251 at 8192 and 222 / 214 / 4902 at 16384 (minima of 5). Flex ties band in
# time from T=2048, needs a third of its peak memory (16 / 42 MiB at 8192), and stays steady on a loaded CPU:
# with 2 threads and another job running, median 131 vs 2212 ms at T=8192 (band's many small parallel SDPA
# calls each wait for both threads). Its price: compiling once per new shape, 0.4-6.6 s measured.
# CPU inference, softcap (scripts/flex_softcap_crossover.py: C=50, E=512, H=8, causal, 1 thread): flex vs the
# math backend 1.07x at T=256, 2.1x at 512, 3.7x at 1024, 4.8x at 2048.
# CUDA, window (scripts/gpu_check.py window step = attnlab bench --variant window: W=256, E=1024, H=16, bfloat16,
# an H200, torch 2.11, issue 36): the module with backend='flex' vs the module with auto, which ran SDPA on key
# bands, forward 0.8 vs 1.1 ms and forward+backward 3.3 vs 3.6 ms at T=8192; 1.4 vs 2.7 and 4.0 vs 6.3 ms at
# T=32768 (the bare flex kernel: 0.2 / 1.4 and 0.5 / 1.8 ms). Flex won at both lengths measured; the smallest
# was 8192, so the crossover is 8192: below it nothing was measured, and auto keeps the band / dense path.
# Measured in bfloat16 only. Float16 is listed on reasoning, not on a measurement: flex runs the same Triton
# template for both, with the same 2-byte elements (the same tiles, loads and float32 accumulators), so the
# same timings are expected. Float32 (4-byte elements, other tile configurations) is not listed.
_CUDA_WINDOW = "an H200, bfloat16, W=256, E=1024, H=16, torch 2.11 (scripts/gpu_check.py window step)"
_SAME_TRITON_KERNEL = (
    "flex runs float16 through the same Triton template as bfloat16, with the same 2-byte elements; "
    "listed on that reasoning, not measured"
)
FLEX_CROSSOVERS: dict[tuple[str, bool, str], Crossover] = {
    ("cpu", False, "window"): Crossover(
        2048,
        (torch.float32,),
        "flex kernel = band SDPA in time from T=2048, a third of its memory, 12x dense-mask SDPA at T=8192",
    ),
    ("cpu", False, "softcap"): Crossover(512, (torch.float32,), "2.1x the math backend at T=512, 4.8x at T=2048"),
    ("cuda", False, "window"): Crossover(
        8192,
        (torch.bfloat16,),
        f"on {_CUDA_WINDOW}: module forward on flex 0.8 ms vs 1.1 ms on band SDPA at T=8192, 1.4 vs 2.7 at T=32768",
        (torch.float16,),
        _SAME_TRITON_KERNEL,
    ),
    ("cuda", True, "window"): Crossover(
        8192,
        (torch.bfloat16,),
        f"on {_CUDA_WINDOW}: module forward+backward on flex 3.3 ms vs 3.6 ms on band SDPA at T=8192, "
        f"4.0 vs 6.3 at T=32768",
        (torch.float16,),
        _SAME_TRITON_KERNEL,
    ),
}

_MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (b, h, q, k) -> bool
_ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]  # (score, b, h, q, k) -> score


def flex_available(
    device: torch.device,
    requires_grad: bool,
    dtype: torch.dtype | None = None,
    *,
    head_dim: int | None = None,
    call: FlexCall | None = None,
) -> tuple[bool, str]:
    """Whether compiled flex can run a call on ``device`` (inputs requiring grad or not), and why not.

    Its known limits are checked here, before any compilation: no CPU backward, no float64 on a CPU, a
    ``head_dim`` of at least :data:`FLEX_MIN_HEAD_DIM` for the Triton kernel (CUDA, XPU). ``call``: the kernel
    this call would build; refused if that same kernel failed earlier in this process (:func:`record_failure`).
    Touches no device: the decision for ``torch.device("cuda")`` can be asked on a CPU-only machine.
    """
    try:
        import torch.nn.attention.flex_attention
    except ImportError as err:
        return False, f"torch.nn.attention.flex_attention is not importable ({err})"
    if device.type not in ("cpu", "cuda", "xpu"):
        return False, f"flex_attention has no {device.type} kernel"
    if device.type == "cpu" and requires_grad:
        return False, "torch has no CPU backward for flex_attention (compiled CPU flex is inference only)"
    if device.type == "cpu" and dtype == torch.float64:
        return False, "flex on CPU runs float32, bfloat16 and float16 only"
    least = flex_min_head_dim(device)
    if head_dim is not None and least is not None and head_dim < least:
        return False, (
            f"head_dim={head_dim}, but flex_attention's Triton kernel on {device.type} needs a head dim of at least "
            f"{least} (torch's lowering refuses less: tl.dot needs 16)"
        )
    if call is not None and call in _FAILED:
        return False, f"flex failed earlier in this process on {device.type} for this kernel ({call}): {_FAILED[call]}"
    return True, ""


def flex_choice(
    case: str,
    T_q: int,
    device: torch.device,
    grad: bool,
    dtype: torch.dtype,
    dropout_p: float = 0.0,
    *,
    head_dim: int | None = None,
    call: FlexCall | None = None,
) -> tuple[bool, str]:
    """Whether ``auto`` sends a ``case`` ("window" or "softcap") call of ``T_q`` queries to flex, and why
    (a reason fragment naming the measurement, its device and dtype): only past a measured crossover
    (:data:`FLEX_CROSSOVERS`) and within flex's limits (:func:`flex_available`, given ``head_dim``).

    ``call``: the kernel the call would build, checked past the crossover only; refused if that kernel failed
    earlier. (The module checks it itself once flex is chosen, so that a decode step never builds the key.)
    """
    ok, why = flex_available(device, grad, dtype, head_dim=head_dim)
    crossover = FLEX_CROSSOVERS.get((device.type, grad, case))
    mode = f"{device.type} {'training' if grad else 'inference'}"
    if ok and dropout_p > 0.0:
        ok, why = False, f"dropout={dropout_p} is on and flex_attention has no dropout"
    if ok and crossover is None:
        ok, why = False, f"no measurement of flex against the other paths for {case} on {mode}"
    if not ok or crossover is None:
        return False, f"flex not used: {why}"
    if dtype not in crossover.dtypes + crossover.same_kernel:
        measured = ", ".join(map(str, crossover.dtypes))
        if crossover.same_kernel:
            measured += f" ({', '.join(map(str, crossover.same_kernel))} by the same kernel)"
        return False, f"flex not used: measured in {measured}, not {dtype}"
    if T_q < crossover.min_tokens:
        return False, f"flex not used below T={crossover.min_tokens} (measured {crossover.evidence})"
    if call is not None:
        ok, why = flex_available(device, grad, dtype, head_dim=head_dim, call=call)
        if not ok:
            return False, f"flex not used: {why}"
    since = f"auto picks it from T >= {crossover.min_tokens}"
    if dtype in crossover.same_kernel:
        return True, f"flex ({dtype}: {crossover.same_kernel_why}; measured {crossover.evidence}; {since})"
    return True, f"flex (measured {crossover.evidence}; {since})"


def record_failure(call: FlexCall, err: BaseException) -> str:
    """Remember that compiled flex failed for ``call``'s kernel, so that neither ``auto`` nor ``backend='flex'``
    builds it again in this process; other shapes, dtypes and variants still run flex. Returns what failed."""
    _FAILED[call] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    return _FAILED[call]


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """``torch.compile(flex_attention)``, once per process: uncompiled flex materialises every score."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)  # static shapes: one kernel per T, the fastest on CPU


# -- positions ---------------------------------------------------------------------------------
def _arange_offset(pos: Tensor, length: int) -> int | None:
    """``o`` when ``pos`` is exactly ``o, o + 1, ..., o + length - 1`` (the module's default positions).

    Reads ``pos`` (a device sync on a GPU): a plain arange lets the mods use index arithmetic and the
    BlockMask come from the cache."""
    if pos.dim() != 1 or pos.numel() != length or length == 0:
        return None
    offset = int(pos[0])
    return offset if torch.equal(pos, torch.arange(offset, offset + length, device=pos.device)) else None


def _position_fn(pos: Tensor, length: int) -> Callable[[Tensor, Tensor], Tensor]:
    """``(b, idx) -> position`` inside a mod: index arithmetic for an arange, else a gather (clamped:
    flex may evaluate indices past the end of a tile)."""
    offset = _arange_offset(pos, length)
    if offset is not None:
        return lambda b, i: i + offset
    if pos.dim() == 1:
        return lambda b, i: pos[i.clamp(max=length - 1)]
    return lambda b, i: pos[b, i.clamp(max=length - 1)]  # (B, T): per-sequence positions


def _index4(t: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """``t[b, h, q, k]`` of a tensor broadcastable to (B, H, T_q, T_k): its size-1 dims read index 0."""
    zero = torch.zeros_like(b)
    idx = [i if n > 1 else zero for i, n in zip((b, h, q, k), t.shape, strict=True)]
    return t[idx[0], idx[1], idx[2], idx[3]]


# -- mask_mod and score_mod --------------------------------------------------------------------
def _mask_mod(
    st: Structure, keep: Tensor | None, T_q: int, T_k: int, sink_key: bool, dead: Tensor | None = None
) -> _MaskMod:
    """``mask_mod(b, h, q, k)``: what :meth:`Structure.keep` and the user's ``keep`` allow, for one pair; a query
    row in ``dead`` (bool ``(B|1, H|1, T_q)``: it sees no key) sees every key (:func:`_dead_rows`)."""
    q_pos, k_pos = _position_fn(st.q_pos, T_q), _position_fn(st.k_pos, T_k)
    causal, window, q_doc, k_doc = st.causal, st.window, st.q_doc, st.k_doc

    def mask_mod(b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        i, j = q_pos(b, q), k_pos(b, k)
        ok = torch.ones_like(q, dtype=torch.bool)
        if causal:
            ok = ok & (j <= i)
        if window is not None:
            ok = ok & (i - j < window)  # with causal: i - W < j <= i
        if q_doc is not None and k_doc is not None:
            ok = ok & (q_doc[b, q.clamp(max=T_q - 1)] == k_doc[b, k.clamp(max=T_k - 1)])
        if keep is not None:
            ok = ok & _index4(keep, b, h, q.clamp(max=T_q - 1), k.clamp(max=T_k - 1))
        if sink_key:
            ok = ok | (k == T_k)  # the sink, one extra key after the real ones, is always visible
        if dead is not None:
            zero = torch.zeros_like(b)
            idx = [i if n > 1 else zero for i, n in zip((b, h, q.clamp(max=T_q - 1)), dead.shape, strict=True)]
            ok = ok | dead[idx[0], idx[1], idx[2]]  # opened to every key; zeroed after the call
        return ok

    return mask_mod


def _score_mod(st: Structure, bias: Tensor | None, T_q: int, T_k: int, sink_key: bool) -> _ScoreMod | None:
    """``score_mod(score, b, h, q, k)`` for softcap, the user's float bias, ALiBi and the sink key; None if none."""
    cap, slopes, sinks = st.softcap, st.alibi, st.sinks if sink_key else None
    if cap is None and bias is None and slopes is None and sinks is None:
        return None
    q_pos, k_pos = _position_fn(st.q_pos, T_q), _position_fn(st.k_pos, T_k)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        if bias is not None:
            score = score + _index4(bias, b, h, q.clamp(max=T_q - 1), k.clamp(max=T_k - 1))
        if slopes is not None:
            score = score - slopes[h] * (q_pos(b, q) - k_pos(b, k)).abs()
        if sinks is not None:
            score = torch.where(k == T_k, sinks[h], score)  # the sink key's score is the sink logit
        return score

    return score_mod


# -- the BlockMask -----------------------------------------------------------------------------
def _tile_range(x: Tensor, n_tiles: int) -> tuple[Tensor, Tensor]:
    """Min and max of ``x`` (..., T) over each tile of FLEX_BLOCK entries: (..., n_tiles) each."""
    pad = n_tiles * FLEX_BLOCK - x.size(-1)
    if pad > 0:  # repeat the last entry: the tail tile's range is that of its real entries
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    tiles = x.reshape(*x.shape[:-1], n_tiles, FLEX_BLOCK)  # (..., n_tiles, FLEX_BLOCK)
    return tiles.amin(-1), tiles.amax(-1)


def _tile_any_all(keep: Tensor, nq: int, nk: int) -> tuple[Tensor, Tensor]:
    """Whether any / every pair of each tile is kept by a bool ``keep`` (B|1, H|1, T_q|1, T_k|1).

    Returns ``(B|1, H|1, nq|1, nk|1)`` each; a broadcast dim (size 1) stays one.
    """
    some, every = keep, keep
    if keep.size(2) > 1:  # pad with False: a tail tile is then never "every pair kept"
        rows = F.pad(keep, (0, 0, 0, nq * FLEX_BLOCK - keep.size(2)))  # (.., nq * 128, T_k|1)
        rows = rows.view(keep.size(0), keep.size(1), nq, FLEX_BLOCK, keep.size(3))  # (.., nq, 128, T_k|1)
        some, every = rows.any(3), rows.all(3)  # (.., nq, T_k|1)
    if keep.size(3) > 1:
        pad = (0, nk * FLEX_BLOCK - keep.size(3))
        tiles = (*some.shape[:3], nk, FLEX_BLOCK)
        some = F.pad(some, pad).view(tiles).any(4)  # (.., nq|1, nk)
        every = F.pad(every, pad).view(tiles).all(4)
    return some, every


def _tile_verdicts(
    st: Structure, keep: Tensor | None, T_q: int, T_k: int, sink_key: bool, dead: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(some, every)``: bool ``(B|1, H|1, n_q, n_k)`` tiles where some / every (q, k) pair is kept.

    For ``j <= i`` over a tile: some pair passes iff ``min k_pos <= max q_pos``, every pair iff
    ``max k_pos <= min q_pos``; alike for the window and for documents (same id throughout both). A row of
    tiles holding a ``dead`` query (``(B|1, H|1, T_q)``, opened to every key) lists every tile as partial.
    """
    nq, nk = -(-T_q // FLEX_BLOCK), -(-(T_k + sink_key) // FLEX_BLOCK)
    q_lo, q_hi = _tile_range(st.q_pos, nq)  # (.., nq)
    k_lo, k_hi = _tile_range(st.k_pos, nk)  # (.., nk): with a sink key, its tile is set below
    q_lo, q_hi, k_lo, k_hi = q_lo[..., :, None], q_hi[..., :, None], k_lo[..., None, :], k_hi[..., None, :]
    some = torch.ones(nq, nk, dtype=torch.bool, device=st.q_pos.device)
    every = some.clone()
    if st.causal:
        some, every = some & (k_lo <= q_hi), every & (k_hi <= q_lo)
    if st.window is not None:
        some, every = some & (q_lo - k_hi < st.window), every & (q_hi - k_lo < st.window)
    if st.q_doc is not None and st.k_doc is not None:
        (dq_lo, dq_hi), (dk_lo, dk_hi) = _tile_range(st.q_doc, nq), _tile_range(st.k_doc, nk)
        dq_lo, dq_hi, dk_lo, dk_hi = dq_lo[:, :, None], dq_hi[:, :, None], dk_lo[:, None, :], dk_hi[:, None, :]
        some = some & (dq_lo <= dk_hi) & (dk_lo <= dq_hi)  # (B, nq, nk): the id ranges overlap
        every = every & (dq_lo == dq_hi) & (dk_lo == dk_hi) & (dq_lo == dk_lo)
    some = some[None, None] if some.dim() == 2 else some[:, None]  # (B|1, 1, nq, nk)
    every = every[None, None] if every.dim() == 2 else every[:, None]
    if keep is not None:
        k_some, k_every = _tile_any_all(keep, nq, -(-T_k // FLEX_BLOCK))
        if k_some.size(-1) not in (1, nk):  # a sink key alone in the last tile: keep has nothing there
            k_some, k_every = F.pad(k_some, (0, 1)), F.pad(k_every, (0, 1))
        some, every = some & k_some, every & k_every
    every = every.clone()  # (B|1, H|1, nq, nk), written below
    if T_q % FLEX_BLOCK:  # a tail tile is never "full": its pairs past the end must still be masked
        every[..., -1, :] = False
    if (T_k + sink_key) % FLEX_BLOCK:
        every[..., :, -1] = False
    if sink_key:  # every row sees the sink, the last key; mask_mod decides the rest of its tile
        some = some.expand_as(every).clone()
        some[..., -1] = True
        every[..., -1] = False
    if dead is not None:  # (B|1, H|1, T_q) -> (B|1, H|1, nq, 1): a row of tiles with a dead query sees every tile
        dead_tiles = F.pad(dead, (0, nq * FLEX_BLOCK - T_q)).view(*dead.shape[:2], nq, FLEX_BLOCK).any(-1)
        some = some | dead_tiles[..., None]
    return some, every


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """Bool ``(B, H, n_q, n_k)`` -> ``(counts (B, H, n_q), indices (B, H, n_q, n_k))`` int32, listed tiles first."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts, indices


def _build_block_mask(
    st: Structure, keep: Tensor | None, T_q: int, T_k: int, sink_key: bool, dead: Tensor | None = None
) -> Any:
    from torch.nn.attention.flex_attention import BlockMask

    some, every = _tile_verdicts(st, keep, T_q, T_k, sink_key, dead)
    partial_n, partial_idx = _ordered(some & ~every)
    full_n, full_idx = _ordered(every)
    return BlockMask.from_kv_blocks(
        partial_n,
        partial_idx,
        full_n,
        full_idx,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=_mask_mod(st, keep, T_q, T_k, sink_key, dead),
        seq_lengths=(T_q, T_k + sink_key),
    )


@functools.lru_cache(maxsize=32)
def _cached_block_mask(
    T_q: int, T_k: int, q_offset: int, window: int | None, causal: bool, sink_key: bool, device: torch.device
) -> Any:
    """The BlockMask of plain positions (``q_pos = q_offset + arange(T_q)``, ``k_pos = arange(T_k)``), built once."""
    st = Structure(
        q_pos=torch.arange(q_offset, q_offset + T_q, device=device),
        k_pos=torch.arange(T_k, device=device),
        causal=causal,
        window=window,
    )
    return _build_block_mask(st, None, T_q, T_k, sink_key)


def _block_mask(
    st: Structure, keep: Tensor | None, T_q: int, T_k: int, sink_key: bool, dead: Tensor | None = None
) -> Any:
    """The call's BlockMask: cached for plain positions without documents, user masks or dead rows, else built."""
    q_offset = _arange_offset(st.q_pos, T_q)
    plain = keep is None and dead is None and st.q_doc is None
    if plain and q_offset is not None and _arange_offset(st.k_pos, T_k) == 0:
        return _cached_block_mask(T_q, T_k, q_offset, st.window, st.causal, sink_key, st.q_pos.device)
    return _build_block_mask(st, keep, T_q, T_k, sink_key, dead)


# Rows of queries evaluated at once when dead rows must be found pair by pair (2^22 pairs: 4 MiB of bools).
DEAD_ROWS_PAIRS = 1 << 22


def _dead_rows(st: Structure, keep: Tensor | None, T_q: int, T_k: int) -> Tensor | None:
    """Bool ``(B|1, H|1, T_q)``: the query rows that see no key under ``st`` and ``keep``, or None when none can.

    Flex's own kernel copes with such a row (torch's template sets its sum to 1 and its log-sum-exp to
    ``-inf``, and the backward reads ``-inf`` as 0), but attnlab hands no fused kernel a row without a key
    (:func:`attnlab.core.functional.unmask_dead_rows` says why): flex's handling is not measured on every torch,
    and the sinks' gate differentiates through that log-sum-exp. Found without a ``T_q x T_k`` mask where it can:

    * none: no mask at all, or causal / window / documents with every query's own position among the keys
      (positions ``o .. o + T_q - 1`` over keys ``0 .. T_k - 1`` with ``0 <= o <= T_k - T_q``, documents the
      same runs on both sides), and no user mask: each query sees itself;
    * a key mask (padding, ``keep`` ``(B|1, 1, 1, T_k)``) with causal masking, a window and documents on such
      positions: the kept keys counted in each query's span by a cumulative sum, ``O(B (T_q + T_k))``;
    * anything else (a user mask over pairs, cache positions): the pairs evaluated :data:`DEAD_ROWS_PAIRS` at a
      time.
    """
    offset, k_offset = _arange_offset(st.q_pos, T_q), _arange_offset(st.k_pos, T_k)
    aligned = offset is not None and k_offset == 0 and 0 <= offset <= T_k - T_q
    same_docs = st.q_doc is None or (st.q_doc is st.k_doc and T_q == T_k and offset == 0)
    if keep is None and ((aligned and same_docs) or (not st.causal and st.window is None and st.q_doc is None)):
        return None
    if keep is not None and keep.size(1) == 1 and keep.size(2) == 1 and aligned and same_docs and st.causal:
        assert offset is not None
        kept = F.pad(keep[:, 0, 0].long().cumsum(-1), (1, 0))  # (B|1, T_k + 1): kept keys before each index
        i = torch.arange(offset, offset + T_q, device=keep.device)  # (T_q,): each query's position = its key
        lo = i - st.window + 1 if st.window is not None else torch.zeros_like(i)
        lo = lo.clamp(min=0).expand(kept.size(0), T_q)  # (B|1, T_q): the span's first key
        if st.q_doc is not None:  # runs: a document starts where its id changes
            first = document_start(st.q_doc)  # (B, T): the index where each position's run starts
            lo = torch.maximum(lo, first)
            kept = kept.expand(first.size(0), -1)
        hi = (i + 1).expand(lo.shape)  # one past the span's last key: the query itself
        seen = kept.gather(1, hi) - kept.gather(1, lo)  # (B|1, T_q): kept keys in the span
        return (seen == 0)[:, None, :]
    rows = max(1, DEAD_ROWS_PAIRS // max(1, T_k))
    parts = []
    for start in range(0, T_q, rows):
        qs = slice(start, min(start + rows, T_q))
        pairs = st.keep(qs)  # (B|1, 1, tq, T_k) or None
        if keep is not None:
            user = keep[:, :, qs] if keep.size(2) > 1 else keep
            pairs = user if pairs is None else pairs & user
        assert pairs is not None
        parts.append(~pairs.any(-1))  # (B|1, H|1, tq)
    return torch.cat(parts, dim=-1)  # (B|1, H|1, T_q); not read back (a GPU would sync): all False costs an OR


# -- the backend -------------------------------------------------------------------------------
def _sinks_by_lse(device: torch.device) -> bool:
    """Sinks from the LSE (exact, no extra key) where compiled flex can return it: not on a CPU."""
    return device.type != "cpu"


def _flex_variant(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: Masks,
    st: Structure,
    *,
    scale: float,
    compiled: bool = True,
    fallback: bool = True,
) -> Tensor:
    """The variants through FlexAttention: ``q (B, H, T_q, D)``, ``k, v (B, G, T_k, D)`` -> context ``(B, H, T_q, D)``.

    The same function as :func:`attnlab.core.variants.variant_math` (no dropout, no weights); a row
    that sees no key gives zeros. ``compiled=False`` runs torch's unfused flex, which materialises
    every score (tests, debugging the mods). Flex's known limits (:func:`flex_available`: a CPU backward,
    float64 on a CPU, a head dim below :data:`FLEX_MIN_HEAD_DIM` on a GPU) raise a ValueError before any
    compilation. If compiled flex raises all the same (``fallback=True``), the failure is remembered for
    this kernel only (:class:`FlexCall`: device, dtype, q and k shapes, grad mode, variants), a warning
    names it, and this call runs the SDPA path (key bands for a window) or, for softcap, the math reference.
    """
    call = FlexCall.of(q, k, v, masks, st)
    if compiled:
        ok, why = flex_available(q.device, call.grad, q.dtype, head_dim=min(q.size(-1), v.size(-1)), call=call)
        if not ok:
            no_grad = q.device.type == "cpu" and call.grad  # the reason is then the missing CPU backward
            raise ValueError(
                f"backend='flex' cannot run this call: {why}. Use backend='auto' (it then runs the SDPA or "
                f"math path and says why in last_backend_reason)"
                + (", or for inference on a CPU call the module under torch.no_grad()." if no_grad else ".")
            )
    try:
        # past its recompile limit torch silently runs flex uncompiled, every score materialised (seen here at
        # the 9th shape/variant of a process: torch's default limit is 8); raising lets the failure path take over
        with torch._dynamo.config.patch(recompile_limit=FLEX_MAX_COMPILES, fail_on_recompile_limit_hit=True):
            return _flex(q, k, v, masks, st, scale=scale, compiled=compiled)
    except Exception as err:  # torch.compile / inductor failures come in many exception types
        if not compiled:
            raise
        failure = record_failure(call, err)
        if not fallback:
            raise RuntimeError(f"compiled flex_attention failed on {q.device.type} ({call}): {failure}") from err
        name, run = _fallback(q, st)
        warnings.warn(
            f"compiled flex_attention failed on {q.device.type} ({failure}) for {call}; this call runs {name} "
            f"instead, and flex is not tried again for these shapes, dtype and variants in this process "
            f"(other calls still run it).",
            RuntimeWarning,
            stacklevel=2,
        )
        return run(q, k, v, masks, st, scale=scale)


flex_variant: Callable[..., Tensor]  # :func:`_flex_variant`, made by the module's ``__getattr__`` on first use


def __getattr__(name: str) -> Callable[..., Tensor]:
    """``flex_variant``: :func:`_flex_variant` under ``torch.compiler.disable`` (a caller's torch.compile runs
    it as it is: it compiles flex_attention itself), made on first use, because the decorator imports
    torch._dynamo: 2-3 s of every ``attnlab`` start (measured on a CPU, torch 2.13) that no flex call paid for."""
    if name != "flex_variant":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    disabled = cast(Callable[..., Tensor], torch.compiler.disable(_flex_variant))  # type: ignore[no-untyped-call]
    globals()["flex_variant"] = disabled  # later lookups find it without coming here
    return disabled


def _fallback(q: Tensor, st: Structure) -> tuple[str, Callable[..., Tensor]]:
    """What runs a call when flex fails: band SDPA for a plain causal window, dense SDPA, or (softcap) math."""
    if st.softcap is not None:
        return "the math reference (softcap)", lambda *args, **kw: variant_math(*args, **kw)[0]
    T = q.size(2)
    plain = _arange_offset(st.q_pos, T) == 0 and _arange_offset(st.k_pos, T) == 0
    if st.window is not None and st.causal and plain:
        return "SDPA on key bands", banded_sdpa
    return "dense-mask SDPA", variant_sdpa


def _flex(q: Tensor, k: Tensor, v: Tensor, masks: Masks, st: Structure, *, scale: float, compiled: bool) -> Tensor:
    """One flex_attention call (see the module docstring for how each variant maps onto it)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    B, H, T_q, _ = q.shape  # (B, H, T_q, D)
    G, T_k = k.size(1), k.size(2)  # k, v: (B, G, T_k, D)
    if masks.causal:  # prepare_masks leaves it only for a plain square causal call; here the Structure has it
        st = replace(st, causal=True)
    sink_key = st.sinks is not None and not _sinks_by_lse(q.device)
    if sink_key:
        k = torch.cat([k, k.new_zeros(B, G, 1, k.size(-1))], dim=2)  # (B, G, T_k + 1, D)
        v = torch.cat([v, v.new_zeros(B, G, 1, v.size(-1))], dim=2)  # (B, G, T_k + 1, Dv)
    dead = None if sink_key else _dead_rows(st, masks.keep, T_q, T_k)  # (B|1, H|1, T_q): rows that see no key
    bias = masks.bias
    if dead is not None and bias is not None:
        bias = bias.masked_fill(dead[..., None], 0.0)  # a dead row's -inf bias entries would keep it dead
    block_mask = _block_mask(st, masks.keep, T_q, T_k, sink_key, dead)
    score_mod = _score_mod(st, bias, T_q, T_k, sink_key)
    # the module's head split is a strided view, which CPU flex read 20-40% slower than a copy costs (T=4096, D=64)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    attend = _compiled_flex() if compiled else cast(Callable[..., Any], flex_attention)
    out: Tensor
    if st.sinks is not None and not sink_key:  # out * Z / (Z + exp(s_h)) = out * sigmoid(lse - s_h)
        out, aux = attend(
            q, k, v, score_mod, block_mask, scale=scale, enable_gqa=G != H, return_aux=AuxRequest(lse=True)
        )
        gate = torch.sigmoid(aux.lse - st.sinks.to(aux.lse.dtype)[None, :, None])  # (B, H, T_q)
        out = (out * gate[..., None]).to(q.dtype)  # (B, H, T_q, D)
    else:
        out = attend(q, k, v, score_mod, block_mask, scale=scale, enable_gqa=G != H)  # (B, H, T_q, D)
    if dead is not None:
        out = out.masked_fill(dead[..., None], 0.0)  # exact zeros, and a zero gradient into the kernel
    return out
