"""The data-flow reading takes projections that are no ``nn.Linear``: bare Parameters of any shape whose
reshape is a linear map, applied by whatever op (einsum with ``...``, ``bmm`` or ``matmul`` per head,
``tensordot``, ``F.linear`` on a reshaped view). Each module here computes textbook attention; the weights read
must reproduce its output through the float64 reference, and each role must be read off its own kernel.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.check.capture import Op
from attnlab.check.dataflow import product_sides, read_dataflow
from attnlab.check.probe import ProbedAdapter
from attnlab.check.reference import reference_attention

E, H = 32, 4
D = E // H


def _attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(B, H, T, D) each -> (B, H, T, D)."""
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v


class EinsumEllipsis(nn.Module):
    """Flax's DenseGeneral: kernels (E, H, D), out (H, D, E), every product an einsum over ``...``."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(E, H, D) / math.sqrt(E)) for _ in range(3))
        self.bq = nn.Parameter(0.1 * torch.randn(H, D))
        self.wo = nn.Parameter(torch.randn(H, D, E) / math.sqrt(E))

    def forward(self, x: Tensor) -> Tensor:
        q = torch.einsum("...e,ehd->...hd", x, self.wq) + self.bq
        k = torch.einsum("...e,ehd->...hd", x, self.wk)
        v = torch.einsum("...e,ehd->...hd", x, self.wv)
        w = torch.softmax(torch.einsum("...qhd,...khd->...hqk", q / math.sqrt(D), k), dim=-1)
        ctx = torch.einsum("...hqk,...khd->...qhd", w, v)
        return torch.einsum("...hd,hde->...e", ctx, self.wo)


class PerHeadMatmul(nn.Module):
    """Per-head kernels (H, E, D) applied by broadcast matmul; the heads merged by tensordot with (H, D, E)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(torch.randn(H, E, D) / math.sqrt(E)) for _ in range(3))
        self.o = nn.Parameter(torch.randn(H, D, E) / math.sqrt(E))

    def forward(self, x: Tensor) -> Tensor:
        xs = x[:, None]  # (B, 1, T, E)
        ctx = _attend(xs @ self.q, xs @ self.k, xs @ self.v)  # (B, H, T, D)
        return torch.tensordot(ctx.transpose(1, 2), self.o, dims=([2, 3], [0, 1]))  # (B, T, E)


class PerHeadBmm(nn.Module):
    """Per-head kernels (H, E, D) applied by bmm on the batch folded with the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Parameter(torch.randn(H, E, D) / math.sqrt(E)) for _ in range(3))
        self.out = nn.Parameter(torch.randn(E, H * D) / math.sqrt(E))

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        xs = x[:, None].expand(B, H, T, E).reshape(B * H, T, E)

        def proj(w: Tensor) -> Tensor:
            return torch.bmm(xs, w.repeat(B, 1, 1)).view(B, H, T, D)

        ctx = _attend(proj(self.q), proj(self.k), proj(self.v))
        return F.linear(ctx.transpose(1, 2).reshape(B, T, E), self.out)


class LinearOfAView(nn.Module):
    """Kernels kept (H, D, E), applied by F.linear on their (H*D, E) view; one fused (3, H, D, E) for q, k, v."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3, H, D, E) / math.sqrt(E))
        self.qkv_bias = nn.Parameter(0.1 * torch.randn(3, H, D))
        self.o = nn.Parameter(torch.randn(E, H, D) / math.sqrt(E))

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        y = F.linear(x, self.qkv.reshape(3 * E, E), self.qkv_bias.reshape(-1))  # (B, T, 3E)
        q, k, v = y.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
        ctx = _attend(q, k, v).transpose(1, 2).reshape(B, T, E)
        return F.linear(ctx, self.o.reshape(E, E))


MODULES = [EinsumEllipsis, PerHeadMatmul, PerHeadBmm, LinearOfAView]


@pytest.mark.parametrize("cls", MODULES, ids=lambda c: c.__name__)
def test_kernels_of_any_shape_are_read_as_linear_maps_and_reproduce_the_module(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    m = cls()
    reading = read_dataflow(m, lambda mod, x: mod(x), E)
    assert reading is not None
    assert (reading.num_heads, reading.num_kv_heads, reading.head_dim) == (H, H, D)
    used = [src.parts[0][0] for src in (reading.q, reading.k, reading.v)]
    if cls is LinearOfAView:  # one fused kernel: each role its own third
        assert [src.parts[0][2][0] for src in (reading.q, reading.k, reading.v)] == [0, E, 2 * E]
    else:
        assert len(set(used)) == 3, used
    adapter = ProbedAdapter(m, embed_dim=E)
    assert adapter.use_reading
    x = torch.randn(2, 7, E)
    want = reference_attention(adapter.projections(), x, x, x, num_heads=H, num_kv_heads=H, scale=D**-0.5)
    with torch.no_grad():
        got = m(x)
    assert torch.allclose(got.double(), want, atol=1e-5), float((got.double() - want).abs().max())


@pytest.mark.parametrize(
    ("eq", "a_shape", "b_shape"),
    [
        ("...qhd,...khd->...hqk", (2, 5, 4, 8), (2, 6, 4, 8)),
        ("...qd,...kd->...qk", (3, 2, 5, 8), (3, 2, 6, 8)),
        ("...qd,...kd->...qk", (2, 4, 5, 8), (2, 1, 6, 8)),  # K shared by the heads: broadcast
        ("...qd,...kd->...qk", (2, 4, 5, 8), (4, 6, 8)),  # a shorter '...': right-aligned
    ],
)
def test_einsum_with_ellipsis_is_read_as_q_against_k(eq: str, a_shape: tuple, b_shape: tuple) -> None:
    a, b = torch.randn(*a_shape), torch.randn(*b_shape)
    out = torch.einsum(eq, a, b)
    op = Op("einsum", [eq, -1, -2], {}, list(out.shape), out.dtype, "new", out, inputs=[-1, -2])
    q, k, scores = product_sides(op, [op], [a, b], first_is_weights=False)
    assert q.shape[-2:] == (5, 8) and k.shape[-2:] == (6, 8)
    assert torch.allclose(q @ k.transpose(-2, -1), scores, atol=1e-5)
