"""Mask semantics as properties: no causal leak, padding invariance, fully masked rows."""

from __future__ import annotations

import pytest
import torch

from attnlab import MultiHeadAttention
from conftest import to_device

BACKENDS = ["math", "sdpa"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_no_causal_leak(backend, kv_heads, device):
    mha = MultiHeadAttention(16, 4, num_kv_heads=kv_heads, backend=backend).to(device)
    x = torch.randn(2, 8, 16).to(device)
    y = x.clone()
    y[:, 5:] = torch.randn(2, 3, 16).to(device)  # change the future of position 4
    a, b = mha(x, is_causal=True), mha(y, is_causal=True)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6)
    assert not torch.allclose(a[:, 5:], b[:, 5:], atol=1e-3)  # later positions do see the change


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_with_cached_prefix_is_bottom_right(backend, device):
    """T_q < T_k: the last T_q positions of a sequence, as in a KV-cache append."""
    mha = MultiHeadAttention(16, 4, backend=backend).to(device)
    x = torch.randn(2, 9, 16).to(device)
    full = mha(x, is_causal=True)
    tail = mha(x[:, 6:], x, is_causal=True)  # queries at positions 6, 7, 8 against all 9 keys
    assert torch.allclose(full[:, 6:], tail, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_padding_invariance(backend, causal, device):
    mha = MultiHeadAttention(16, 4, backend=backend).to(device)
    x = torch.randn(2, 7, 16).to(device)
    pad = torch.zeros(2, 7, dtype=torch.bool, device=device)
    pad[0, 5:] = True
    pad[1, 6:] = True
    y = x.clone()
    y[0, 5:] = 100 * torch.randn(2, 16).to(device)  # garbage at padded positions
    y[1, 6:] = -50.0
    a = mha(x, key_padding_mask=pad, is_causal=causal)
    b = mha(y, key_padding_mask=pad, is_causal=causal)
    assert torch.allclose(a[0, :5], b[0, :5], atol=1e-5) and torch.allclose(a[1, :6], b[1, :6], atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_three_masks_together(backend, device):
    mha = MultiHeadAttention(16, 4, backend=backend).to(device)
    x = torch.randn(2, 6, 16).to(device)
    keep = torch.ones(6, 6, dtype=torch.bool, device=device)
    keep[:, 2] = False
    pad = torch.zeros(2, 6, dtype=torch.bool, device=device)
    pad[1, 0] = True
    out = mha(x, attn_mask=keep, key_padding_mask=pad, is_causal=True)
    explicit = torch.ones(6, 6, dtype=torch.bool, device=device).tril() & keep
    explicit = explicit[None, None] & ~pad[:, None, None, :]  # (2, 1, 6, 6)
    assert torch.allclose(out, mha(x, attn_mask=explicit), atol=1e-6)


def _fully_masked_cases():
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[2] = False  # query 2 sees nothing
    bias = torch.zeros(4, 4)
    bias[2] = float("-inf")
    pad = torch.tensor([[True, True, True, True], [False, False, False, True]])  # batch 0 all padding
    left_pad = torch.tensor([[False] * 4, [True, True, False, False]])  # left padding + causal
    return {
        "bool": ({"attn_mask": keep}, [(slice(None), 2)]),
        "float_-inf": ({"attn_mask": bias}, [(slice(None), 2)]),
        "padding": ({"key_padding_mask": pad}, [(0, slice(None))]),
        "left_padding_causal": ({"key_padding_mask": left_pad, "is_causal": True}, [(1, 0), (1, 1)]),
    }


@pytest.mark.parametrize("backend,need_weights", [("math", False), ("sdpa", False), ("auto", False), ("auto", True)])
@pytest.mark.parametrize("case", list(_fully_masked_cases()))
def test_fully_masked_rows_are_zero_with_finite_grads(backend, need_weights, case, device):
    kw, rows = _fully_masked_cases()[case]
    kw = to_device(kw, device)
    mha = MultiHeadAttention(8, 2, backend=backend)
    with torch.no_grad():
        mha.out_proj.bias.normal_()
    mha = mha.to(device)
    x = torch.randn(2, 4, 8).to(device).requires_grad_()
    res = mha(x, need_weights=need_weights, **kw)
    out = res[0] if need_weights else res
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in mha.parameters())
    for b, i in rows:
        # context is zero, so the output is exactly the output projection's bias
        assert torch.allclose(out[b, i], mha.out_proj.bias.expand_as(out[b, i]), atol=1e-6)
        if need_weights:
            assert torch.all(res[1][b, :, i] == 0)


def test_prepared_masks_are_shared_across_layers_unchanged(device):
    from attnlab.core.masks import prepare_masks

    layers = [MultiHeadAttention(16, 4).to(device) for _ in range(3)]
    x = torch.randn(2, 6, 16).to(device)
    pad = torch.zeros(2, 6, dtype=torch.bool, device=device)
    pad[1, :2] = True
    masks = prepare_masks(None, pad, True, batch=2, heads=4, q_len=6, k_len=6, dtype=x.dtype, device=x.device)
    a = b = x
    for layer in layers:
        a = layer(a, attn_mask=masks)
        b = layer(b, key_padding_mask=pad, is_causal=True)
    assert torch.equal(a, b)
    with pytest.raises(
        ValueError,
        match="attn_mask is an already-converted attnlab Masks, so key_padding_mask and is_causal must be left unset",
    ):
        layers[0](x, attn_mask=masks, is_causal=True)
