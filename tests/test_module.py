"""The module's public contract: shapes, the seeds' calls, layouts, GQA, backend choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention


def test_seed_000_case_shapes(device):
    x = torch.randn(2, 10, 64).to(device)
    mha = MultiHeadAttention(64, 8).to(device)
    out = mha(x, x)  # seed 000: mha(x, x), x_context = x
    assert out.shape == (2, 10, 64)
    assert mha.head_dim == 8
    assert mha.last_backend == "sdpa" and mha.last_backend_reason is None


def test_seed_002_call_with_causal_bool_mask(device):
    q, k, v = torch.randn(3, 2, 7, 16).to(device).unbind(0)
    mha = MultiHeadAttention(16, 4).to(device)
    causal_bool = torch.tril(torch.ones(7, 7, dtype=torch.bool, device=device))
    out = mha(q, k, v, attn_mask=causal_bool)
    assert out.shape == (2, 7, 16)
    assert torch.allclose(out, mha(q, k, v, is_causal=True), atol=1e-6)


def test_self_attention_defaults_key_and_value(device):
    x = torch.randn(2, 5, 16).to(device)
    mha = MultiHeadAttention(16, 4).to(device)
    ref = mha(x, x, x)
    assert torch.equal(mha(x), ref)
    assert torch.equal(mha(x, x), ref)


def test_cross_attention_other_length_and_width(device):
    mha = MultiHeadAttention(16, 4, kdim=12, vdim=20).to(device)
    q, k, v = (t.to(device) for t in (torch.randn(2, 5, 16), torch.randn(2, 9, 12), torch.randn(2, 9, 20)))
    out, w = mha(q, k, v, need_weights=True)
    assert out.shape == (2, 5, 16) and w.shape == (2, 4, 5, 9)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 5, device=device))
    assert isinstance(mha.k_proj, nn.Linear) and mha.k_proj.weight.shape == (16, 12)


def test_projections_are_linear_children_owning_their_parameters():
    mha = MultiHeadAttention(16, 4, num_kv_heads=2)
    assert all(type(getattr(mha, n)) is nn.Linear for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert mha.k_proj.weight.shape == (8, 16) and mha.v_proj.weight.shape == (8, 16)
    assert [n for n, _ in mha.named_parameters()] == [
        f"{p}.{k}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for k in ("weight", "bias")
    ]


def test_init_is_xavier_per_projection_with_zero_bias():
    mha = MultiHeadAttention(64, 8, num_kv_heads=2)
    for proj in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj):
        fan_out, fan_in = proj.weight.shape
        bound = (6 / (fan_in + fan_out)) ** 0.5
        assert proj.weight.abs().max() <= bound
        assert proj.weight.abs().max() > 0.8 * bound  # uniform over the whole range, not a smaller one
        assert torch.all(proj.bias == 0)


def test_gqa_equals_mha_with_repeated_kv_weights(device):
    E, H, G = 32, 8, 2
    gqa = MultiHeadAttention(E, H, num_kv_heads=G)
    full = MultiHeadAttention(E, H)
    rep, D = H // G, E // H

    def repeat(t):  # (G*D, ...) -> (H*D, ...): K/V head g serves query heads g*rep .. g*rep+rep-1
        return t.unflatten(0, (G, D)).repeat_interleave(rep, 0).flatten(0, 1)

    with torch.no_grad():
        full.q_proj.weight.copy_(gqa.q_proj.weight)
        full.k_proj.weight.copy_(repeat(gqa.k_proj.weight))
        full.v_proj.weight.copy_(repeat(gqa.v_proj.weight))
        full.out_proj.weight.copy_(gqa.out_proj.weight)
        for a, b in ((full.q_proj, gqa.q_proj), (full.out_proj, gqa.out_proj)):
            a.bias.copy_(b.bias + torch.randn_like(b.bias))
            b.bias.copy_(a.bias)
        full.k_proj.bias.copy_(repeat(gqa.k_proj.bias))
    gqa, full = gqa.to(device), full.to(device)
    x = torch.randn(2, 6, E).to(device)
    for backend in ("math", "sdpa"):
        gqa.backend = full.backend = backend
        assert torch.allclose(gqa(x, is_causal=True), full(x, is_causal=True), atol=1e-6)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_non_contiguous_inputs(backend, device):
    mha = MultiHeadAttention(16, 4, backend=backend).to(device)
    base = torch.randn(7, 2, 16).to(device)
    x = base.transpose(0, 1)  # (2, 7, 16), not contiguous
    assert not x.is_contiguous()
    mask = torch.ones(7, 7, dtype=torch.bool, device=device).triu().contiguous().T  # causal, as a transposed view
    assert not mask.is_contiguous()
    out = mha(x, attn_mask=mask)
    assert torch.allclose(out, mha(x.contiguous(), attn_mask=mask.contiguous()), atol=1e-6)
    ctx = torch.randn(16, 2, 9).to(device)[:, :, :].permute(1, 2, 0)  # (2, 9, 16), strided
    assert torch.allclose(mha(x, ctx), mha(x.contiguous(), ctx.contiguous()), atol=1e-6)


def test_auto_backend_reports_why_math_ran(device):
    mha = MultiHeadAttention(16, 4).to(device)
    x = torch.randn(1, 3, 16).to(device)
    mha(x)
    assert (mha.last_backend, mha.last_backend_reason) == ("sdpa", None)
    mha(x, need_weights=True)
    assert mha.last_backend == "math" and "need_weights" in mha.last_backend_reason
    mha.backend = "math"
    mha(x)
    assert mha.last_backend == "math" and "requested" in mha.last_backend_reason


def test_backend_attribute_is_validated_and_sdpa_refuses_weights():
    mha = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'math', 'sdpa', 'flex'\), got 'flash'"):
        mha.backend = "flash"
    mha.backend = "sdpa"
    with pytest.raises(ValueError, match="need_weights=True with backend='sdpa'"):
        mha(torch.randn(1, 3, 16), need_weights=True)


def test_dropout_only_in_training(device):
    mha = MultiHeadAttention(16, 4, dropout=0.5, backend="math").to(device)
    x = torch.randn(2, 6, 16).to(device)
    mha.eval()
    assert torch.equal(mha(x), mha(x))
    mha.train()
    _, w = mha(x, need_weights=True)
    assert (w == 0).any()  # some weights were dropped
    torch.manual_seed(0)
    a = mha(x)
    torch.manual_seed(1)
    assert not torch.allclose(a, mha(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_softmax_runs_in_float32(dtype, device):
    mha = MultiHeadAttention(16, 4, backend="math").to(device)
    x = torch.randn(2, 5, 16).to(device)
    ref, _ = mha(x, need_weights=True)
    mha_h = MultiHeadAttention(16, 4, backend="math", dtype=dtype).to(device)
    mha_h.load_state_dict(mha.state_dict())
    out, w = mha_h(x.to(dtype), need_weights=True)
    assert out.dtype == dtype and w.dtype == dtype
    assert (out.float() - ref).abs().max() < (0.05 if dtype == torch.bfloat16 else 0.01)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_scale_is_used(backend, device):
    custom = MultiHeadAttention(16, 4, scale=0.9, backend=backend).to(device)
    default = MultiHeadAttention(16, 4, backend=backend).to(device)
    default.load_state_dict(custom.state_dict())
    with torch.no_grad():  # scaling Q by 0.9 * sqrt(D) must equal scaling the scores by 0.9
        default.q_proj.weight.mul_(0.9 * 2.0)
        default.q_proj.bias.mul_(0.9 * 2.0)
    x = torch.randn(2, 5, 16).to(device)
    assert torch.allclose(custom(x), default(x), atol=1e-6)
    plain = MultiHeadAttention(16, 4, backend=backend).to(device)
    plain.load_state_dict(custom.state_dict())
    assert not torch.allclose(custom(x), plain(x), atol=1e-3)  # the scale changed the result
