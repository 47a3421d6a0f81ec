"""The math reference and the SDPA path agree on outputs and gradients for every feature."""

from __future__ import annotations

import pytest
import torch

from attnlab import MultiHeadAttention
from conftest import MASK_KINDS, make_masks, to_device


def _run(mha, backend, q, ctx, kw):
    mha.zero_grad()
    mha.backend = backend
    q = q.detach().requires_grad_()
    ctx = None if ctx is None else ctx.detach().requires_grad_()
    out = mha(q, ctx, **kw)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    grads = [p.grad.clone() for p in mha.parameters()]
    return out, q.grad, None if ctx is None else ctx.grad, grads


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("cross", [False, True])
def test_math_and_sdpa_agree(mask, kv_heads, cross, device):
    if cross and "causal" in mask:
        T_q, T_k = 5, 8  # causal cross-attention: bottom-right aligned
    else:
        T_q, T_k = 6, (8 if cross else 6)
    mha = MultiHeadAttention(16, 4, num_kv_heads=kv_heads)
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(0.1 * torch.randn_like(p))
    mha = mha.to(device)
    q = torch.randn(2, T_q, 16).to(device)
    ctx = torch.randn(2, T_k, 16).to(device) if cross else None
    kw = to_device(make_masks(mask, 2, T_q, T_k), device)
    a = _run(mha, "math", q, ctx, kw)
    b = _run(mha, "sdpa", q, ctx, kw)
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    for ga, gb in zip(a[1:3], b[1:3], strict=True):
        if ga is not None:
            torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)
    for ga, gb in zip(a[3], b[3], strict=True):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_both_backends(dtype, device):
    mha = MultiHeadAttention(32, 4).to(device)
    x = torch.randn(2, 8, 32).to(device)
    ref = mha(x, is_causal=True)
    for backend in ("math", "sdpa"):
        mha.backend = backend
        with torch.autocast(device.type, dtype=dtype):
            out = mha(x, is_causal=True)
        assert out.dtype == dtype
        assert (out.float() - ref).abs().max() < 0.05
