"""The compiled quantized-matmul kernels (``csrc/qmatmul.cpp``): built once, found at run time, or a stated fallback.

The extension is compiled with ``torch.utils.cpp_extension.load`` (a C++ compiler and ``ninja``)
into a cache directory named after the torch version and the source's hash, so that a rebuild
happens only when either changes: ``make test`` / ``make demo`` build it during set-up
(``python -m attnlab.quant build``), and the first use in a fresh environment builds it then
(about 15 s, said on stderr). It picks its instruction set at run time from the CPU's flags, so
one build serves any x86-64: AVX-512 VNNI, else AVX2, else plain C++ for the int8 tiles (the route
quantized models take), and AVX-512, AVX2 or plain C++ for the float32 rows.

When it cannot be had (no compiler, a full disk, a failed build, or ``ATTNLAB_QUANT_KERNELS=0``), every
quantized layer runs :func:`~attnlab.quant.formats.dequantize_blocks` then ``F.linear``: the same
numbers, much slower; :func:`kernel_status` says which, and why (:mod:`.kernel_build` reads the cause).
One process builds at a time, under a lock the OS releases when its holder dies.

Env: ``ATTNLAB_QUANT_KERNELS=0`` (never build or load them), ``ATTNLAB_KERNEL_DIR`` (where to build; else
``$XDG_CACHE_HOME/attnlab``, else ``~/.cache/attnlab``), ``ATTNLAB_KERNEL_BUILD_WAIT`` (seconds to wait for
another process's build, default 600).
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .formats import BlockFormat, dequantize_blocks
from .kernel_build import build_lock, explain, preflight

__all__ = [
    "KernelStatus",
    "kernel_status",
    "build_kernels",
    "qmatmul",
    "dequantize",
    "decode_attention",
    "ISA_NAMES",
    "TILE_ISA_NAMES",
    "SOURCE",
]

SOURCE = Path(__file__).parent / "csrc" / "qmatmul.cpp"
ISA_NAMES = {0: "plain C++", 1: "AVX2", 2: "AVX-512"}  # the row kernel's levels (qmatmul's isa=)
TILE_ISA_NAMES = {0: "plain C++", 1: "AVX2", 2: "AVX-512 VNNI"}  # the tiled int8 kernel's (qmatmul_tiles's isa=)
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class KernelStatus:
    """Whether the compiled kernels run, on which instruction set, and if not, why (with the fix)."""

    available: bool
    isa: str  # the float32 row kernel's: "AVX-512", "AVX2", "plain C++", or "none" (the PyTorch fallback)
    reason: str  # why they are not available; "" when they are
    build_dir: str
    tiles_isa: str = "none"  # the int8 tiled kernel's (llama.cpp's route): "AVX-512 VNNI", "AVX2", "plain C++"
    fix: str = ""  # the one fix when they are not available (the end of ``reason``)

    @property
    def vnni(self) -> bool:
        """Whether the int8 tiles run on AVX-512 VNNI (vpdpbusd)."""
        return self.tiles_isa == TILE_ISA_NAMES[2]

    def describe(self) -> str:
        if self.available:
            return (
                f"attnlab's quantized kernels: int8 tiles on {self.tiles_isa}, float32 rows on {self.isa} "
                f"(built in {self.build_dir})"
            )
        return f"attnlab's quantized kernels are not in use: {self.reason}"


_lock = threading.Lock()
_status: KernelStatus | None = None


def _build_dir() -> Path:
    chosen = os.environ.get("ATTNLAB_KERNEL_DIR")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"
    base = Path(chosen) if chosen else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attnlab"
    return base / "kernels" / tag


def _note(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):  # stderr closed or full: the build goes on without its note
        pass


def _compile(build_dir: Path, quiet: bool) -> None:
    """Build (if needed) and load the library, under the build lock (:mod:`.kernel_build`: a killed build
    wedges nothing, a failure is said by its cause)."""
    from torch.utils import cpp_extension

    building = not (build_dir / "attnlab_quant.so").exists()
    preflight(build_dir, building=building)
    with build_lock(build_dir, _note):
        if not (build_dir / "attnlab_quant.so").exists() and not quiet:
            _note(
                f"attnlab: compiling its quantized-matmul kernels into {build_dir} (once per torch version, ~15 s) ..."
            )
        cpp_extension.load(
            "attnlab_quant",
            [str(SOURCE)],
            extra_cflags=["-O3", "-std=c++17", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )


def _register_python_parts() -> None:
    """Shapes for torch.compile's tracing, and the gradient with respect to x (the weights are frozen)."""

    @torch.library.register_fake("attnlab_quant::qmatmul")
    def _(x: Tensor, w: Tensor, kind: int, in_features: int, isa: int = -1) -> Tensor:
        return x.new_empty(x.size(0), w.size(0))

    @torch.library.register_fake("attnlab_quant::dequantize")
    def _(w: Tensor, kind: int, in_features: int, isa: int = -1) -> Tensor:
        return w.new_empty(w.size(0), in_features, dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        _, w, kind, in_features, _ = inputs
        ctx.save_for_backward(w)
        ctx.kind, ctx.in_features = kind, in_features

    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        dx = grad @ torch.ops.attnlab_quant.dequantize(w, ctx.kind, ctx.in_features)  # (M, N) @ (N, K)
        return dx, None, None, None, None

    torch.library.register_autograd("attnlab_quant::qmatmul", backward, setup_context=setup_context)

    @torch.library.register_fake("attnlab_quant::qmatmul_tiles")
    def _(x: Tensor, w: Tensor, kind: int, in_features: int, out_features: int, isa: int = -1) -> Tensor:
        return x.new_empty(x.size(0), out_features)

    @torch.library.register_fake("attnlab_quant::dequantize_tiles")
    def _(w: Tensor, kind: int, in_features: int, rows: Tensor) -> Tensor:
        return w.new_empty(rows.size(0), in_features, dtype=torch.float32)

    def setup_tiles(ctx, inputs, output):
        _, w, kind, in_features, out_features, _ = inputs
        ctx.save_for_backward(w)
        ctx.kind, ctx.in_features, ctx.out_features = kind, in_features, out_features

    def backward_tiles(ctx, grad):
        (w,) = ctx.saved_tensors
        rows = torch.arange(ctx.out_features, device=w.device)
        dx = grad @ torch.ops.attnlab_quant.dequantize_tiles(w, ctx.kind, ctx.in_features, rows)
        return dx, None, None, None, None, None

    torch.library.register_autograd("attnlab_quant::qmatmul_tiles", backward_tiles, setup_context=setup_tiles)

    @torch.library.register_fake("attnlab_quant::decode_attention")
    def _(q, k, v, k_scale, v_scale, pad, length: int, scale: float, isa: int = -1) -> Tensor:
        return q.new_empty(q.shape)


def build_kernels(quiet: bool = False) -> KernelStatus:
    """Build (if needed) and load the kernels; the result is kept for the process. Never raises."""
    global _status
    with _lock:
        if _status is not None:
            return _status
        build_dir = _build_dir()
        if os.environ.get("ATTNLAB_QUANT_KERNELS", "1").strip().lower() in _OFF:
            _status = KernelStatus(
                False,
                "none",
                "ATTNLAB_QUANT_KERNELS=0 is set; unset it to build and use them",
                str(build_dir),
                fix="unset it to build and use them",
            )
            return _status
        try:
            _compile(build_dir, quiet)
            _register_python_parts()
            ops = torch.ops.attnlab_quant
            isa = ISA_NAMES.get(int(ops.cpu_isa()), "plain C++")
            tiles = TILE_ISA_NAMES.get(int(ops.cpu_tile_isa()), "plain C++")
            _status = KernelStatus(True, isa, "", str(build_dir), tiles)
        except Exception as err:  # a full disk, no compiler, a compile error...: the fallback runs, and says why
            if os.environ.get("ATTNLAB_DEBUG"):  # the whole error (torch's build log) for a bug report
                traceback.print_exc()
            why = explain(err, build_dir)
            _status = KernelStatus(False, "none", str(why), str(build_dir), fix=why.fix)
        return _status


def kernel_status() -> KernelStatus:
    """:func:`build_kernels`'s result: built on first call, then kept."""
    return _status if _status is not None else build_kernels()


def _use_kernel(x: Tensor) -> bool:
    return x.device.type == "cpu" and kernel_status().available


def qmatmul(x: Tensor, blocks: Tensor, fmt: BlockFormat, in_features: int) -> Tensor:
    """``(M, N)`` = ``x (M, K) @ dequantize(blocks).T`` in float32: the kernel on a CPU, else dequantize + matmul."""
    if _use_kernel(x):
        return torch.ops.attnlab_quant.qmatmul(x, blocks, fmt.ggml_type, in_features)
    return x @ dequantize_blocks(blocks, fmt, in_features).T


def dequantize(blocks: Tensor, fmt: BlockFormat, in_features: int) -> Tensor:
    """``(N, K)`` float32 weights of ``(N, row_bytes)`` blocks: the kernel on a CPU, else plain PyTorch (same floats)."""
    if _use_kernel(blocks):
        return torch.ops.attnlab_quant.dequantize(blocks, fmt.ggml_type, in_features)
    return dequantize_blocks(blocks, fmt, in_features)


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    length: int,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    isa: int = -1,
) -> Tensor:
    """One query per row against slots ``[0, length)`` of a KV cache, read in its own bytes (the C++ kernel).

    Args:
        q: ``(B, H, D)`` float32, one query per head.
        k, v: ``(B, G, S, D)`` float32, float16, bfloat16 or int8 cache rows (:attr:`attnlab.KVCache.k`), ``H % G == 0``.
        length: slots attended, ``1 <= length <= S``.
        k_scale, v_scale: ``(B, G, S, D / block)`` float32, the int8 cache's scales.
        key_padding_mask: ``(B, S)`` bool, True = a padding slot (weight 0).
        scale: of the scores; default ``1 / sqrt(D)``.
        isa: 0 plain C++, 1 AVX2, 2 AVX-512, 3 AVX-512 VNNI (an int8 cache's keys multiplied by the query
            rounded to int8 per block of 32, GGML's q8_0 dot product; other caches as 2); -1 the best this CPU
            has (3 where it has VNNI).

    Returns ``(B, H, D)`` float32. Needs the compiled kernels (:func:`kernel_status`).
    """
    status = kernel_status()
    if not status.available:
        raise RuntimeError(f"decode_attention needs attnlab's compiled kernels: {status.reason}")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return torch.ops.attnlab_quant.decode_attention(q, k, v, k_scale, v_scale, key_padding_mask, length, scale, isa)
