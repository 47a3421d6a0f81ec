"""GGML's block formats Q4_0, Q4_1 and Q8_0, and their dequantization in plain PyTorch (the reference and the fallback).

Each format cuts a weight row into blocks of 32 consecutive weights, stored as one fp16 scale
``d`` (Q4_1: also an fp16 offset ``m``) and 32 small integers ``q`` (ggml-common.h):

========  =============  ==================  ==============================================
format    bytes / block  bits / weight       weight ``j`` of a block
========  =============  ==================  ==============================================
Q4_0      18             4.5                 ``d * (q_j - 8)``, ``q_j`` a nibble 0..15
Q4_1      20             5.0                 ``d * q_j + m``
Q8_0      34             8.5                 ``d * q_j``, ``q_j`` an int8
========  =============  ==================  ==============================================

In Q4_0 and Q4_1, byte ``j`` of the 16 packs weight ``j`` in its low nibble and weight ``j + 16``
in its high one. :func:`dequantize_blocks` computes every weight as the ``gguf`` package's
``gguf.quants.dequantize`` does, operation for operation (float32 multiply, then add), so that the
two agree bit for bit; the tests hold them to that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["BlockFormat", "FORMATS", "BLOCK", "format_named", "dequantize_blocks"]

BLOCK = 32  # weights per block, in every format here


@dataclass(frozen=True)
class BlockFormat:
    """One GGML block format: its name, GGML type id, and bytes per block of 32 weights."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value: what the C++ kernels are told
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / BLOCK

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of ``in_features`` weights (a multiple of 32)."""
        return in_features // BLOCK * self.block_bytes


FORMATS: dict[str, BlockFormat] = {
    "Q4_0": BlockFormat("Q4_0", 2, 18),
    "Q4_1": BlockFormat("Q4_1", 3, 20),
    "Q8_0": BlockFormat("Q8_0", 8, 34),
}


def format_named(name: str) -> BlockFormat:
    """The :class:`BlockFormat` called ``name`` ("Q4_0", "Q4_1", "Q8_0"); a ValueError names the choices otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {name!r}.")
    return fmt


def _halves(b: Tensor) -> Tensor:
    """``(..., 2)`` uint8 little-endian fp16 bytes -> ``(..., 1)`` float32."""
    return b.contiguous().view(torch.float16).float()


def dequantize_blocks(blocks: Tensor, fmt: BlockFormat, in_features: int) -> Tensor:
    """``(N, in_features)`` float32 weights of ``(N, row_bytes)`` uint8 blocks, in plain PyTorch.

    Works on any device and under ``torch.compile``; the C++ kernel's ``dequantize`` gives the
    same floats faster on a CPU.
    """
    n = blocks.size(0)
    b = blocks.reshape(n, in_features // BLOCK, fmt.block_bytes)  # (N, blocks, bytes)
    d = _halves(b[..., 0:2])  # (N, nb, 1)
    if fmt.name == "Q8_0":
        q = b[..., 2:].view(torch.int8).float()  # (N, nb, 32)
        return (q * d).reshape(n, in_features)
    start = 4 if fmt.name == "Q4_1" else 2
    packed = b[..., start : start + BLOCK // 2]  # (N, nb, 16): low nibble weight j, high nibble weight j + 16
    q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)  # (N, nb, 32) uint8
    if fmt.name == "Q4_0":
        return (d * (q.to(torch.int8) - 8).float()).reshape(n, in_features)
    m = _halves(b[..., 2:4])
    return (d * q.float() + m).reshape(n, in_features)
