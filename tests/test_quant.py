"""attnlab.quant: GGUF blocks kept as stored, their kernels, the layers and the models built of them.

References: the ``gguf`` package (llama.cpp's own Python reader) for every dequantized weight, bit for
bit; float64 matmuls for every product, held to a bound derived from the formats:

- float32 routes (row layout, PyTorch fallback): float32 summation, ``|err| <= 1e-5 * sum_j |w_j x_j|``
  (K <= 1536 terms: K * 2^-24 = 9e-5 in the worst case, far less for random signs);
- the int8 route (tiled, llama.cpp's): x is rounded per block of 32 to ``dx * q`` with ``dx = max|x| / 127``,
  so ``|err| <= sum_b (dx_b / 2) * sum_{j in b} |w_j|`` plus the float32 term.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab.quant import FORMATS, QuantEmbedding, QuantLinear, build_kernels, dequantize_blocks, kernel_status
from attnlab.quant import kernels as kernels_module
from attnlab.quant import layers as layers_module

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

STATUS = build_kernels(quiet=True)
needs_kernels = pytest.mark.skipif(not STATUS.available, reason=f"kernels not built: {STATUS.reason}")
ISAS = [] if not STATUS.available else list(range(int(torch.ops.attnlab_quant.cpu_isa()) + 1))
# the tiled int8 kernel's levels on this CPU: 0 plain C++, 1 AVX2, 2 AVX-512 VNNI
TILE_ISAS = [] if not STATUS.available else list(range(int(torch.ops.attnlab_quant.cpu_tile_isa()) + 1))
QTYPES = {"Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q8_0": Q.Q8_0}


def blocks_of(name: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by gguf: ``(blocks (rows, row bytes) uint8, gguf's dequantized float32)``."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    raw = gguf_quantize(w, QTYPES[name])
    ref = gguf_dequantize(raw, QTYPES[name]).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(raw)).reshape(rows, -1), torch.from_numpy(ref)


def float_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-30


def int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    dx = x.reshape(x.size(0), -1, 32).abs().amax(-1).double() / 127  # (M, blocks)
    wabs = w.abs().reshape(w.size(0), -1, 32).sum(-1).double()  # (N, blocks)
    return (dx / 2) @ wabs.T + float_bound(x, w)


@pytest.mark.parametrize("name", FORMATS)
def test_pytorch_dequantize_equals_gguf_bit_for_bit(name):
    blocks, ref = blocks_of(name, 7, 96)
    assert torch.equal(dequantize_blocks(blocks, FORMATS[name], 96), ref)


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
def test_kernel_dequantize_and_row_matmul_on_every_isa(name):
    blocks, ref = blocks_of(name, 45, 160)
    ops, kind = torch.ops.attnlab_quant, FORMATS[name].ggml_type
    for isa in ISAS:
        assert torch.equal(ops.dequantize(blocks, kind, 160, isa), ref), isa
        for m in (1, 2, 5, 8, 11):  # passes of 8 rows of x, and a remainder
            x = torch.randn(m, 160)
            err = (ops.qmatmul(x, blocks, kind, 160, isa).double() - x.double() @ ref.double().T).abs()
            assert (err <= float_bound(x, ref)).all(), (isa, m, err.max())


@needs_kernels
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows", [16, 45, 200])  # a whole tile, padding rows, a parallel split
def test_tiles_keep_every_weight_and_the_int8_product_meets_its_bound_on_every_isa(name, rows):
    blocks, ref = blocks_of(name, rows, 192, seed=rows)
    ops, kind = torch.ops.attnlab_quant, FORMATS[name].ggml_type
    tiled = ops.repack_tiles(blocks, kind, 192)
    assert tiled.shape == (-(-rows // 16) * 16, blocks.size(1))  # the same bytes per row, rows padded to 16
    assert torch.equal(ops.dequantize_tiles(tiled, kind, 192, torch.arange(rows)), ref)
    picked = torch.tensor([rows - 1, 0, rows // 2, 0])
    assert torch.equal(ops.dequantize_tiles(tiled, kind, 192, picked), ref[picked])
    for m in (1, 3, 4, 5, 9):
        x = torch.randn(m, 192) * torch.linspace(0.1, 3, 192)  # uneven magnitudes across blocks
        x[0, :32] = 0  # an all-zero block: dx = 0
        y = ops.qmatmul_tiles(x, tiled, kind, 192, rows)  # the best kernel this CPU has
        err = (y.double() - x.double() @ ref.double().T).abs()
        assert y.shape == (m, rows) and (err <= int8_bound(x, ref)).all(), (m, (err / int8_bound(x, ref)).max())
        for isa in TILE_ISAS:  # every level sums the same integers and scales them alike: the same floats
            assert torch.equal(ops.qmatmul_tiles(x, tiled, kind, 192, rows, isa), y), (isa, m)


@needs_kernels
def test_tiles_at_the_int8_extremes_on_every_isa():
    # Q8_0 weights of -128 and 127 against x rounded to +-127: the AVX2 route's int16 pairs are at their
    # widest there (|q| * 127 * 2 = 32512), and Q4 nibbles of 15 summed over a whole block (8 * 3810)
    ops = torch.ops.attnlab_quant
    raw = torch.zeros(32, 34, dtype=torch.uint8)
    raw[:, 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # d = 1.0 (fp16 0x3C00)
    q = torch.full((32, 32), -128, dtype=torch.int8)
    q[1::2] = 127
    q[5, ::3] = -127
    raw[:, 2:] = q.view(torch.uint8)
    ref = dequantize_blocks(raw, FORMATS["Q8_0"], 32)
    x = torch.full((3, 32), 127.0)  # dx = 1: x rounds to itself, and every sum is an exact integer
    x[1] = -127.0
    x[2, ::2] = -127.0
    tiled = ops.repack_tiles(raw, 8, 32)
    want = x.double() @ ref.double().T
    for isa in TILE_ISAS:
        assert torch.equal(ops.qmatmul_tiles(x, tiled, 8, 32, 32, isa).double(), want), isa
    raw4 = torch.zeros(16, 20, dtype=torch.uint8)
    raw4[:, 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)
    raw4[:, 4:] = 0xFF  # every nibble 15, m = 0
    ref4 = dequantize_blocks(raw4, FORMATS["Q4_1"], 32)
    tiled4 = ops.repack_tiles(raw4, 3, 32)
    for isa in TILE_ISAS:
        assert torch.equal(ops.qmatmul_tiles(x, tiled4, 3, 32, 16, isa).double(), x.double() @ ref4.double().T), isa


@needs_kernels
@pytest.mark.parametrize("scale", [0.0, 1e-30, 1.0, 3e4, 1e30])
def test_activation_rounding_is_the_same_on_every_isa(scale):
    ops = torch.ops.attnlab_quant
    x = torch.randn(8 * 32, generator=torch.Generator().manual_seed(5)) * scale
    x[40] = 0.5 * x[32:64].abs().max()  # a tie after division: rounds to even
    xb = x.reshape(-1, 32)
    dx = xb.abs().amax(-1) / 127  # float32, as the kernel computes it
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    want = torch.round(xb * inv[:, None]).clamp(-127, 127).to(torch.int8).reshape(-1)  # round half to even
    for isa in TILE_ISAS:
        q, d = ops.quantize_x(x, isa)
        assert torch.equal(d, dx) and torch.equal(q, want), isa


@needs_kernels
def test_kernel_errors_name_the_argument():
    blocks, _ = blocks_of("Q4_1", 4, 64)
    ops = torch.ops.attnlab_quant
    with pytest.raises(RuntimeError, match=r"x must be a 2-D float32 CPU tensor with 64 columns, got Double"):
        ops.qmatmul(torch.randn(1, 64, dtype=torch.float64), blocks, 3, 64)
    with pytest.raises(RuntimeError, match=r"w has 40 bytes per row, expected 60 for 96 inputs"):
        ops.qmatmul(torch.randn(1, 96), blocks, 3, 96)
    with pytest.raises(RuntimeError, match=r"unknown block kind 5 \(expected 2 = Q4_0, 3 = Q4_1, 8 = Q8_0\)"):
        ops.dequantize(blocks, 5, 64)
    if ISAS and ISAS[-1] < 2:
        with pytest.raises(RuntimeError, match=r"this CPU offers at most"):
            ops.qmatmul(torch.randn(1, 64), blocks, 3, 64, 2)
    tiled = ops.repack_tiles(blocks, 3, 64)
    if TILE_ISAS[-1] < 2:
        with pytest.raises(RuntimeError, match=r"tiles isa=2 was asked for, but this CPU offers at most 1 \(0 = plain"):
            ops.qmatmul_tiles(torch.randn(1, 64), tiled, 3, 64, 4, 2)
    with pytest.raises(RuntimeError, match=r"a tiled tensor of 16 rows cannot hold 17 outputs"):
        ops.qmatmul_tiles(torch.randn(1, 64), tiled, 3, 64, 17)


def quant_linear(name: str, rows: int, cols: int, layout: str, bias: bool = False) -> tuple[QuantLinear, torch.Tensor]:
    blocks, ref = blocks_of(name, rows, cols, seed=3)
    layer = QuantLinear(cols, rows, name, bias=bias)
    layer.blocks.copy_(blocks)
    if bias:
        torch.nn.init.normal_(layer.bias)
    layer.pack(layout)
    return layer, ref


LAYOUTS = ["rows", pytest.param("tiles", marks=needs_kernels)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tokens", [1, 7, 40, 60])  # direct kernel, and dequantize + GEMM past (TILED_)DIRECT_ROWS
def test_quant_linear_forward_and_input_gradient(layout, tokens):
    layer, ref = quant_linear("Q4_1", 48, 64, layout, bias=True)
    x = torch.randn(2, tokens, 64, requires_grad=True)
    y = layer(x)
    want = x.double() @ ref.double().T + layer.bias.double()
    limit = layers_module.direct_rows(layout)
    int8 = layout == "tiles" and (limit is None or 2 * tokens <= limit)
    bound = (int8_bound if int8 else float_bound)(x.reshape(-1, 64).detach(), ref)
    assert y.shape == (2, tokens, 48)
    assert ((y.double() - want).abs().reshape(-1, 48) <= bound + 1e-6).all()
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.allclose(x.grad.double(), g.double() @ ref.double(), atol=1e-5)  # dX = dY @ W, W as the file holds
    assert layer.bias.grad is not None and torch.allclose(layer.bias.grad, g.sum((0, 1)))
    assert layer.blocks.grad is None and not layer.blocks.requires_grad  # the blocks are frozen bytes
    assert torch.equal(layer.dequantize(), ref)


def test_quant_layers_refuse_bad_input_by_name():
    layer, _ = quant_linear("Q8_0", 16, 64, "rows")
    with pytest.raises(TypeError, match=r"QuantLinear \(Q8_0\) computes in float32, got input of dtype torch.bfloat16"):
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"expects inputs with 64 features \(last dim\), got shape \(1, 63\)"):
        layer(torch.randn(1, 63))
    with pytest.raises(ValueError, match=r"in_features=48; GGML blocks hold 32 weights of a row"):
        QuantLinear(48, 16, "Q4_0")
    with pytest.raises(ValueError, match=r"format must be one of \['Q4_0', 'Q4_1', 'Q8_0'\], got 'Q6_K'"):
        QuantLinear(64, 16, "Q6_K")
    with pytest.raises(ValueError, match=r"layout must be one of \('rows', 'tiles'\), got 'cols'"):
        layer.pack("cols")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quant_embedding_rows_and_tied_head(layout):
    blocks, ref = blocks_of("Q8_0", 37, 64)
    emb = QuantEmbedding(37, 64, "Q8_0")
    emb.blocks.copy_(blocks)
    emb.pack(layout)
    idx = torch.tensor([[0, 36, 5], [5, 5, 1]])
    assert torch.equal(emb(idx), ref[idx])
    x = torch.randn(3, 64)
    bound = int8_bound(x, ref) if layout == "tiles" else float_bound(x, ref)
    assert ((emb.logits(x).double() - x.double() @ ref.double().T).abs() <= bound).all()


def test_without_kernels_the_pytorch_fallback_runs_and_says_why(monkeypatch):
    off = kernels_module.KernelStatus(False, "none", "ATTNLAB_QUANT_KERNELS=0 is set; unset it", "/x")
    monkeypatch.setattr(kernels_module, "_status", off)
    layer, ref = quant_linear("Q4_0", 32, 96, "rows")
    x = torch.randn(3, 96)
    assert ((layer(x).double() - x.double() @ ref.double().T).abs() <= float_bound(x, ref)).all()
    assert torch.equal(layer.dequantize(), ref)
    assert layers_module.best_layout() == "rows"
    with pytest.raises(RuntimeError, match=r"layout='tiles' needs attnlab's compiled kernels: ATTNLAB_QUANT_KERNELS=0"):
        layer.pack("tiles")
    assert (
        kernel_status().describe()
        == "attnlab's quantized kernels are not in use: ATTNLAB_QUANT_KERNELS=0 is set; unset it"
    )


def test_kernels_switched_off_by_environment(monkeypatch):
    monkeypatch.setattr(kernels_module, "_status", None)
    monkeypatch.setenv("ATTNLAB_QUANT_KERNELS", "0")
    status = build_kernels()
    assert not status.available and status.reason.startswith("ATTNLAB_QUANT_KERNELS=0 is set")


def test_a_failed_build_falls_back_with_the_reason(monkeypatch):
    def broken(build_dir, quiet):
        raise RuntimeError("Error building extension 'attnlab_quant': c++: command not found")

    monkeypatch.setattr(kernels_module, "_status", None)
    monkeypatch.delenv("ATTNLAB_QUANT_KERNELS", raising=False)
    monkeypatch.setattr(kernels_module, "_compile", broken)
    status = build_kernels()
    assert not status.available
    assert status.reason == (  # the cause read from the compiler's words (tests/test_kernel_build_lock.py: each cause)
        "building the kernels needs a C++17 compiler, and `c++` is not on PATH; install one (`apt-get install g++`, "
        "`xcode-select --install`) or point CXX at one"
    )
