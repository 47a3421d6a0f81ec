"""Parity with torch.nn.MultiheadAttention after from_torch, and the round trip to_torch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention
from conftest import to_device

TOL = 1e-5  # max abs error in float32, as the issue asks


def _torch_call(t: nn.MultiheadAttention, q, k, v, attn_mask=None, key_padding_mask=None):
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = ~attn_mask  # torch's bool mask means True = blocked; attnlab's True = may attend
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask.repeat_interleave(t.num_heads, dim=0)  # torch wants (B*H, T_q, T_k)
    out, w = t(
        q, k, v, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=True, average_attn_weights=False
    )
    return out, w


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mode", ["self", "cross", "kdim_vdim"])
@pytest.mark.parametrize("mask", ["none", "bool2d", "bool3d", "float", "padding", "bool+padding"])
def test_parity_with_torch_mha(bias, mode, mask, device):
    E, H, B, T_q = 32, 4, 3, 6
    T_k = T_q if mode == "self" else 9
    kdim, vdim = (12, 20) if mode == "kdim_vdim" else (None, None)
    t = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True).eval()
    if bias:
        with torch.no_grad():  # torch inits biases to zero: make them matter
            t.in_proj_bias.normal_()
            t.out_proj.bias.normal_()
    t = t.to(device)
    ours = MultiHeadAttention.from_torch(t).eval()
    q = torch.randn(B, T_q, E).to(device)
    k = q if mode == "self" else torch.randn(B, T_k, kdim or E).to(device)
    v = q if mode == "self" else torch.randn(B, T_k, vdim or E).to(device)
    kw = {}
    if mask.startswith("bool"):
        keep = torch.rand(B, T_q, T_k) > 0.4
        keep[..., 0] = True
        kw["attn_mask"] = keep[0] if mask == "bool2d" else keep
    if mask == "float":
        kw["attn_mask"] = torch.randn(T_q, T_k)
    if "padding" in mask:
        pad = torch.zeros(B, T_k, dtype=torch.bool)
        pad[1, -3:] = True
        kw["key_padding_mask"] = pad
    kw = to_device(kw, device)
    ref_out, ref_w = _torch_call(t, q, k, v, **kw)
    for backend in ("math", "sdpa", "auto"):
        ours.backend = backend
        out = ours(q, k, v, **kw)
        assert (out - ref_out).abs().max() <= TOL, backend
    ours.backend = "auto"
    out, w = ours(q, k, v, need_weights=True, **kw)
    assert (w - ref_w).abs().max() <= TOL


def test_parity_with_seq_first_torch_module(device):
    t = nn.MultiheadAttention(16, 2, batch_first=False).eval().to(device)
    with pytest.warns(UserWarning, match=r"sequence-first .* always batch-first .* attnlab.compat.MultiheadAttention"):
        ours = MultiHeadAttention.from_torch(t)
    x = torch.randn(2, 5, 16).to(device)
    ref, _ = t(x.transpose(0, 1), x.transpose(0, 1), x.transpose(0, 1))
    assert (ours(x) - ref.transpose(0, 1)).abs().max() <= TOL


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kv_heads,kdim,scale", [(4, None, None), (2, None, None), (1, None, 0.3), (4, 12, None)])
def test_to_torch_round_trip(batch_first, kv_heads, kdim, scale, device):
    ours = MultiHeadAttention(32, 4, num_kv_heads=kv_heads, kdim=kdim, vdim=kdim, scale=scale).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours = ours.to(device)
    t = ours.to_torch(batch_first=batch_first).eval()
    assert t.batch_first == batch_first
    x = torch.randn(2, 5, 32).to(device)
    ctx = torch.randn(2, 7, kdim or 32).to(device)
    ref = ours(x, ctx, is_causal=False)
    tin = (x, ctx, ctx) if batch_first else (x.transpose(0, 1), ctx.transpose(0, 1), ctx.transpose(0, 1))
    out, _ = t(*tin)
    out = out if batch_first else out.transpose(0, 1)
    assert (out - ref).abs().max() <= TOL
    if kv_heads == 4 and scale is None:  # plain MHA comes back unchanged
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the seq-first warning is tested above
            back = MultiHeadAttention.from_torch(t)
        for a, b in zip(back.state_dict().values(), ours.state_dict().values(), strict=True):
            assert torch.equal(a, b)


def test_from_torch_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="add_bias_kv=True or add_zero_attn=True"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="expects a torch.nn.MultiheadAttention, got Linear"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_from_torch_keeps_dtype_and_dropout():
    t = nn.MultiheadAttention(16, 2, dropout=0.25, dtype=torch.float64, batch_first=True)
    ours = MultiHeadAttention.from_torch(t)
    assert ours.out_proj.weight.dtype == torch.float64 and ours.dropout == 0.25


def test_batch_first_torch_module_converts_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MultiHeadAttention.from_torch(nn.MultiheadAttention(16, 2, batch_first=True))
