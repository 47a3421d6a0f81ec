"""Low precision and alignment: no overflow in fp16/bf16, errors within flash-attention's rule on
every backend ``auto`` can pick, and the two public attention functions agree on every input.

flash-attention's rule (tests/test_flash_attn.py there): in fp16/bf16 a kernel's error against
a float64 reference may be at most twice the error of plain PyTorch attention run in the same
low precision, plus a small floor so that two near-zero errors do not fail on noise.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import MultiHeadAttention
from attnlab.core import functional as fn
from conftest import assert_low_precision_close

LOW = [torch.bfloat16, torch.float16]
FLOOR = 1e-4  # absolute, on outputs and gradients of order 1


def plain_attention(q, k, v, keep, scale):
    """Plain PyTorch in the inputs' precision, as flash-attention's reference: scale q, softmax,
    cast the probabilities to V's dtype, multiply."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q * scale) @ k.transpose(-2, -1)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    if keep is not None:
        p = p.masked_fill(~keep.any(-1, keepdim=True), 0.0)
    return p @ v


def _grads(run, q0, k0, v0, dout, dtype):
    q, k, v = (t.detach().to(dtype).clone().requires_grad_() for t in (q0, k0, v0))
    out = run(q, k, v)
    out.backward(dout.to(dtype))
    return [t.detach().double() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("G", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_module_outputs_and_grads_meet_flash_attention_rule(dtype, G, mask, backend, device_with_float64):
    """Through the module's own backend choice (``auto`` picks one of these two per call)."""
    device = device_with_float64
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 256, 32
    q0, k0, v0 = torch.randn(B, H, T, D), torch.randn(B, G, T, D), torch.randn(B, G, T, D)
    q0, k0, v0 = (t.to(dtype).double().to(device) for t in (q0, k0, v0))  # exactly representable in `dtype`
    dout = torch.randn(B, H, T, D).to(device)
    keep, causal = None, mask == "causal"
    if mask == "padding":
        pad = torch.zeros(B, T, dtype=torch.bool, device=device)
        pad[0, -T // 3 :] = True
        keep = (~pad)[:, None, None, :]
    full_keep = fn.causal_keep(T, T, device) if causal else keep
    scale = 1 / math.sqrt(D)

    def ours(q, k, v):
        if backend == "math":
            return fn.math_attention(q, k, v, keep=keep, causal=causal, scale=scale)[0]
        compute_dtype, _ = fn.sdpa_compute_dtype(q)  # what the module runs
        return fn.sdpa_attention(q, k, v, keep=keep, causal=causal, scale=scale, compute_dtype=compute_dtype)[0]

    ref = _grads(lambda q, k, v: plain_attention(q, k, v, full_keep, scale), q0, k0, v0, dout.double(), torch.float64)
    base = _grads(lambda q, k, v: plain_attention(q, k, v, full_keep, scale), q0, k0, v0, dout, dtype)
    got = _grads(ours, q0, k0, v0, dout, dtype)
    for name, g, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref, strict=True):
        assert_low_precision_close(g, b, r, floor=FLOOR, name=name)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
def test_large_scores_do_not_overflow(dtype, backend, device):
    """q, k ~ N(0, 40^2), D = 128: q . k reaches ~1e5 > fp16's 65504 before scaling."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 2, 64, 128) * 40).to(device, dtype), (torch.randn(2, 2, 64, 128) * 40).to(device, dtype)
    v = torch.randn(2, 2, 64, 128).to(device, dtype)
    assert ((q.float() @ k.float().transpose(-2, -1)).abs().max() > 65504).item()
    out, w = fn.math_attention(q, k, v, scale=128**-0.5, need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    mha = MultiHeadAttention(256, 2, backend=backend, dtype=dtype)
    x = (torch.randn(2, 64, 256) * 40).to(device, dtype)
    with torch.no_grad():
        mha.q_proj.weight.copy_(torch.eye(256) * 4)  # large q and k
        mha.k_proj.weight.copy_(torch.eye(256) * 4)
    mha = mha.to(device)
    assert torch.isfinite(mha(x)).all()
    if backend != "sdpa":
        _, w = mha(x, need_weights=True)
        assert torch.isfinite(w).all()


@pytest.mark.parametrize("T_q,T_k", [(3, 7), (7, 3), (5, 5)])
@pytest.mark.parametrize("with_keep", [False, True])
def test_math_and_sdpa_agree_on_causal_with_any_lengths(T_q, T_k, with_keep, device_with_float64):
    """Both bottom-right aligned; causal combines with ``keep`` instead of replacing it; a query
    that sees no key (T_q > T_k) gets zeros on both."""
    device = device_with_float64
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, T_q, 8), torch.randn(2, 2, T_k, 8), torch.randn(2, 2, T_k, 8)
    keep = (torch.rand(2, 1, T_q, T_k) > 0.3).to(device) if with_keep else None
    q, k, v = q.to(device), k.to(device), v.to(device)
    a, _ = fn.math_attention(q, k, v, keep=keep, causal=True, scale=0.3)
    b, _ = fn.sdpa_attention(q, k, v, keep=keep, causal=True, scale=0.3)
    assert torch.allclose(a, b, atol=1e-6)
    causal = fn.causal_keep(T_q, T_k, device)
    allowed = causal if keep is None else causal & keep
    ref = plain_attention(q.double(), k.double(), v.double(), allowed, 0.3).float()
    assert torch.allclose(a, ref, atol=1e-5)
    if T_q > T_k:
        assert torch.all(a[:, :, : T_q - T_k] == 0)


def test_causal_keeps_the_other_mask(device):
    """``math_attention(keep=..., causal=True)`` once dropped ``keep``: a blocked key must stay blocked."""
    q, k, v = (torch.randn(1, 1, 4, 8).to(device) for _ in range(3))
    keep = torch.ones(4, 4, dtype=torch.bool, device=device)
    keep[:, 0] = False  # nobody sees key 0
    v2 = v.clone()
    v2[..., 0, :] += 100.0
    for f in (fn.math_attention, fn.sdpa_attention):
        a, _ = f(q, k, v, keep=keep, causal=True, scale=0.3)
        b, _ = f(q, k, v2, keep=keep, causal=True, scale=0.3)
        assert torch.allclose(a, b), f.__name__


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_or_inf_in_padded_keys_never_reaches_the_output(backend, poison, device):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend).to(device)
    x, ctx = torch.randn(2, 5, 16).to(device), torch.randn(2, 7, 16).to(device)
    pad = torch.zeros(2, 7, dtype=torch.bool, device=device)
    pad[0, -2:] = True
    clean = mha(x, ctx, key_padding_mask=pad)
    dirty = ctx.clone()
    dirty[0, -2:] = poison
    out = mha(x, dirty, key_padding_mask=pad)
    assert torch.isfinite(out).all() and torch.allclose(out, clean, atol=1e-6)


@pytest.mark.cpu_only("fp16/bf16 SDPA computes in float32 on a CPU only (functional.sdpa_compute_dtype)")
def test_cpu_low_precision_says_how_sdpa_ran():
    mha = MultiHeadAttention(16, 4, dtype=torch.bfloat16)
    mha(torch.randn(1, 3, 16, dtype=torch.bfloat16))
    assert mha.last_backend == "sdpa" and "computed in float32" in mha.last_backend_reason
    mha32 = MultiHeadAttention(16, 4)
    mha32(torch.randn(1, 3, 16))
    assert mha32.last_backend == "sdpa" and mha32.last_backend_reason is None


def test_key_and_value_defaults_refuse_other_widths():
    """``value`` defaults to ``key`` and ``key`` to ``query``: with kdim/vdim that cannot hold, a clear error."""
    mha = MultiHeadAttention(64, 8, kdim=32)  # vdim defaults to 64
    with pytest.raises(ValueError, match=r"value was not given, so it defaulted to key, but .* vdim=64 != kdim=32"):
        mha(torch.randn(2, 5, 64), torch.randn(2, 7, 32))
    with pytest.raises(ValueError, match=r"key was not given, so it defaulted to query .* kdim=32 != embed_dim=64"):
        mha(torch.randn(2, 5, 64))
    ok = MultiHeadAttention(64, 8, kdim=32, vdim=32)
    assert ok(torch.randn(2, 5, 64), torch.randn(2, 7, 32)).shape == (2, 5, 64)
