"""Quantized weights kept as GGUF files store them (GGML's Q4_0, Q4_1, Q8_0), and the CPU kernels that compute with them.

:class:`QuantLinear` and :class:`QuantEmbedding` hold a tensor's blocks as they are in the file;
``attnlab.from_pretrained(path, dtype="gguf")`` builds a Llama of them. Their matmul runs in the
compiled kernels of :mod:`attnlab.quant.kernels` (AVX-512 / AVX2 / C++, chosen at run time) or,
where those cannot be built, in plain PyTorch (:func:`kernel_status` says which and why).
"""

from .formats import BLOCK, FORMATS, BlockFormat, dequantize_blocks, format_named
from .kernels import KernelStatus, build_kernels, dequantize, kernel_status, qmatmul
from .layers import DIRECT_ROWS, QuantEmbedding, QuantLinear

__all__ = [
    "QuantLinear",
    "QuantEmbedding",
    "BlockFormat",
    "FORMATS",
    "BLOCK",
    "DIRECT_ROWS",
    "format_named",
    "dequantize_blocks",
    "dequantize",
    "qmatmul",
    "kernel_status",
    "build_kernels",
    "KernelStatus",
]
