"""``QuantLinear`` and ``QuantEmbedding``: layers that keep a GGUF tensor's blocks as the file stores them.

Inference layers with frozen weights: the blocks are a uint8 buffer (not a parameter), so
``model.parameters()`` holds only what is trainable in float (norms, biases). The input may carry
a gradient: ``dX`` flows through (``dY @ W``, W dequantized), so adapters such as LoRA can train on
top of a quantized base; the blocks themselves never get one.

Shapes: ``x (..., K)`` -> ``(..., N)``, blocks ``(N, K / 32 * block_bytes)`` uint8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .formats import BLOCK, BlockFormat, format_named
from .kernels import dequantize, kernel_status, qmatmul

__all__ = [
    "QuantLinear",
    "QuantEmbedding",
    "DIRECT_ROWS",
    "TILED_DIRECT_ROWS",
    "direct_rows",
    "LAYOUTS",
    "best_layout",
    "fuse_rows",
]

# "rows": the file's own order, float32 activations (any CPU, any device: the PyTorch fallback reads it).
# "tiles": rows interleaved 16 at a time, int8 activations (llama.cpp's route), for the compiled kernels
# (AVX-512 VNNI, AVX2 or plain C++, chosen at run time).
LAYOUTS = ("rows", "tiles")


def best_layout() -> str:
    """ "tiles" where the compiled kernels run (any x86-64 CPU with a C++ compiler at set-up), else "rows" (the
    PyTorch fallback reads the file's own order)."""
    return "tiles" if kernel_status().available else "rows"


# Rows of x up to which the kernel reads the blocks directly (decode: B rows, prompts); beyond it the
# weight is dequantized once per call and float32 GEMM runs. The float32 row kernel passes over the
# weights once per 8 rows, so it stops soon. The int8 tiles are faster than dequantize + GEMM at any
# row count where they run vectorised (SmolLM2's matrices, 2 threads, ms, tiles / dequantize + GEMM):
# - AVX2, AMD EPYC (Zen 3), measured: 3072x576 at 1024 rows 22.8 / 30.3, 576x1536 12.2 / 13.1, the
#   49152x576 head at 256 rows 159 / 262; every size from 32 to 1024 rows alike.
# - AVX-512 VNNI, Intel Xeon: the limit was 96 rows from a whole-prefill measurement (fp32 model /
#   dequantize + GEMM / tiles: 128 rows 129 / 148 / 138, 256 rows 217 / 224 / 245) in which the tiles
#   rounded x in scalar code on one thread: ~25M values at 4.1 ns each (the old routine's rate, measured
#   on the AMD EPYC), an estimated ~100 ms of the 245 at 256 rows. They now round it 8 lanes at a time
#   (0.36 ns a value, same machine) on every thread, so that prefill is estimated at ~150 ms, under the
#   fp32 model's 217: no limit. (An estimate: not yet measured on a Xeon.)
# - plain C++: the row kernel's.
DIRECT_ROWS = 16
TILED_DIRECT_ROWS: dict[str, int | None] = {"AVX-512 VNNI": None, "AVX2": None, "plain C++": DIRECT_ROWS}


def direct_rows(layout: str) -> int | None:
    """Rows of x up to which a layer of ``layout`` reads its blocks directly on this CPU (None: any number)."""
    if layout != "tiles":
        return DIRECT_ROWS
    return TILED_DIRECT_ROWS.get(kernel_status().tiles_isa, DIRECT_ROWS)


def _check_shape(name: str, in_features: int) -> None:
    if in_features <= 0 or in_features % BLOCK:
        raise ValueError(
            f"{name}: in_features={in_features}; GGML blocks hold 32 weights of a row, so in_features must be a "
            f"positive multiple of 32."
        )


class _Blocks(nn.Module):
    """What both layers share: the blocks buffer, its format, and a float32 anchor for device/dtype checks."""

    def __init__(self, rows: int, in_features: int, fmt: str | BlockFormat, device: torch.device | str | None) -> None:
        super().__init__()
        self.fmt = fmt if isinstance(fmt, BlockFormat) else format_named(fmt)
        _check_shape(type(self).__name__, in_features)
        self.in_features = in_features
        self.rows = rows
        self.layout = "rows"
        self.is_fusion = False  # True for fuse_rows's result, whose blocks are other layers' bytes
        self.register_buffer(
            "blocks", torch.zeros(rows, self.fmt.row_bytes(in_features), dtype=torch.uint8, device=device)
        )
        # The dtype and device this layer computes in, for callers that check inputs against a layer's
        # weight (attnlab's attention reads `weight`, else this): float32, wherever the blocks are.
        self.register_buffer("compute_reference", torch.empty(0, device=device), persistent=False)

    blocks: Tensor
    compute_reference: Tensor

    @property
    def weight_bytes(self) -> int:
        """Bytes of the blocks: what one full pass over this layer's weights reads."""
        return self.blocks.numel()

    def pack(self, layout: str | None = None) -> None:
        """Put the blocks in ``layout`` ("rows" or "tiles"; default :func:`best_layout`). The same bytes, reordered
        (tiles pad the rows to a multiple of 16); the weights do not change."""
        layout = best_layout() if layout is None else layout
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}.")
        if layout == self.layout:
            return
        if layout == "tiles":
            status = kernel_status()
            if not status.available:
                raise RuntimeError(
                    f"layout='tiles' needs attnlab's compiled kernels: {status.reason}. Use layout='rows'."
                )
            self.blocks = torch.ops.attnlab_quant.repack_tiles(self.blocks, self.fmt.ggml_type, self.in_features)
        else:
            raise ValueError(
                f"{type(self).__name__} is already tiled, and tiles are not turned back into rows; load the model "
                f"again with layout='rows'."
            )
        self.layout = layout

    def dequantize(self) -> Tensor:
        """The float32 weight matrix ``(rows, in_features)`` (a new tensor), as gguf.quants.dequantize gives it."""
        if self.layout == "tiles":
            rows = torch.arange(self.rows, device=self.blocks.device)
            return torch.ops.attnlab_quant.dequantize_tiles(self.blocks, self.fmt.ggml_type, self.in_features, rows)
        return dequantize(self.blocks, self.fmt, self.in_features)

    def _matmul(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32:
            raise TypeError(
                f"{type(self).__name__} ({self.fmt.name}) computes in float32, got input of dtype {x.dtype}; pass "
                f"x.float(), or load the model with dtype=torch.bfloat16 for a bf16 model."
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        limit = direct_rows(self.layout)
        if limit is not None and x2.size(0) > limit:
            y = F.linear(x2, self.dequantize())
        elif self.layout == "tiles":
            y = torch.ops.attnlab_quant.qmatmul_tiles(
                x2.contiguous(), self.blocks, self.fmt.ggml_type, self.in_features, self.rows
            )
        else:
            y = qmatmul(x2.contiguous(), self.blocks, self.fmt, self.in_features)
        return y.reshape(*lead, self.rows)


class QuantLinear(_Blocks):
    """``nn.Linear``'s forward (``x @ W.T + b``) with W held as GGML blocks of ``fmt`` ("Q4_0", "Q4_1", "Q8_0").

    Args:
        in_features, out_features: as ``nn.Linear``'s; ``in_features`` a multiple of 32.
        fmt: the block format.
        bias: whether a float32 bias parameter is added.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str | BlockFormat,
        bias: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(out_features, in_features, fmt, device)
        self.out_features = out_features
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if x.size(-1) != self.in_features:
            raise ValueError(
                f"QuantLinear expects inputs with {self.in_features} features (last dim), got shape {tuple(x.shape)}."
            )
        y = self._matmul(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt.name}, "
            f"bias={self.bias is not None}, layout={self.layout}"
        )


def fuse_rows(layers: list[QuantLinear]) -> QuantLinear:
    """One :class:`QuantLinear` computing ``cat([layer(x) for layer in layers], -1)`` in a single matmul.

    The layers (same input width, format and layout, no bias; tiled row counts multiples of 16) keep
    working on their own: their blocks become views of the fused buffer, so no byte is held twice. The
    fused buffer is not saved in ``state_dict`` (the layers' own entries are).
    """
    first = layers[0]
    same = all(
        (m.in_features, m.fmt, m.layout) == (first.in_features, first.fmt, first.layout) and m.bias is None
        for m in layers
    )
    if not same or (first.layout == "tiles" and any(m.rows % 16 for m in layers)):
        raise ValueError(
            "fuse_rows: the layers must share in_features, format and layout, have no bias, and (tiled) "
            "hold a multiple of 16 rows each."
        )
    rows = sum(m.rows for m in layers)
    fused = QuantLinear(first.in_features, rows, first.fmt, device=first.blocks.device)
    fused.register_buffer("blocks", torch.cat([m.blocks for m in layers]), persistent=False)
    fused.layout = first.layout
    fused.is_fusion = True  # its bytes are the layers' own: counted once, through them
    start = 0
    for m in layers:
        m.blocks = fused.blocks[start : start + m.blocks.size(0)]  # a view: the same bytes
        start += m.blocks.size(0)
    return fused


class QuantEmbedding(_Blocks):
    """``nn.Embedding`` (rows looked up and dequantized) whose table can also serve as a tied output head (:meth:`logits`)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, fmt: str | BlockFormat, device: torch.device | str | None = None
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, fmt, device)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim

    def forward(self, idx: Tensor) -> Tensor:
        flat = idx.reshape(-1)
        if self.layout == "tiles":
            rows = torch.ops.attnlab_quant.dequantize_tiles(self.blocks, self.fmt.ggml_type, self.embedding_dim, flat)
        else:
            rows = dequantize(self.blocks.index_select(0, flat), self.fmt, self.embedding_dim)  # (B*T, E)
        return rows.reshape(*idx.shape, self.embedding_dim)

    def logits(self, x: Tensor) -> Tensor:
        """``x (..., E) @ table.T`` -> ``(..., V)``: the tied output head."""
        return self._matmul(x)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt.name}, layout={self.layout}"
