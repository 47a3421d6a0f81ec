"""Hypothesis: attnlab.MultiHeadAttention against the float64 reference of ``attnlab check``
over random shapes, head counts, GQA groups, mask kinds, dtypes and backends."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import MultiHeadAttention
from attnlab.check import ModuleAdapter, reference_attention

MASKS = ("none", "bool2d", "bool3d", "float", "padding", "causal", "causal+padding", "bool3d+float+padding")


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    case = {
        "B": draw(st.integers(1, 3)),
        "T_q": draw(st.integers(1, 6)),
        "H": heads,
        "G": draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0])),
        "D": draw(st.sampled_from([1, 2, 4])),
        "cross": draw(st.booleans()),
        "mask": draw(st.sampled_from(MASKS)),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "backend": draw(st.sampled_from(["math", "sdpa", "auto"])),
        "seed": draw(st.integers(0, 2**16)),
    }
    # causal masking needs T_q <= T_k (bottom-right aligned)
    low = case["T_q"] if "causal" in case["mask"] else 1
    case["T_k"] = draw(st.integers(low, 7)) if case["cross"] else case["T_q"]
    case["kdim"] = draw(st.sampled_from([None, 3, 5])) if case["cross"] else None
    return case


def build(c: dict):
    """Module, inputs and the mask keywords of one drawn case (random masks may empty whole rows)."""
    g = torch.Generator().manual_seed(c["seed"])
    torch.manual_seed(c["seed"])
    E, dt = c["H"] * c["D"], c["dtype"]
    m = MultiHeadAttention(
        E, c["H"], num_kv_heads=c["G"], kdim=c["kdim"], vdim=c["kdim"], backend=c["backend"], dtype=dt
    )
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=dt))  # nonzero biases too
    B, T_q, T_k = c["B"], c["T_q"], c["T_k"]
    q = torch.randn(B, T_q, E, generator=g, dtype=dt)
    kv = torch.randn(B, T_k, c["kdim"] or E, generator=g, dtype=dt) if c["cross"] else q
    module_kw, ref_kw = {}, {}
    kind = c["mask"]
    if "bool2d" in kind:
        module_kw["attn_mask"] = ref_kw["keep_mask"] = torch.rand(T_q, T_k, generator=g) > 0.3
    if "bool3d" in kind:
        module_kw["attn_mask"] = ref_kw["keep_mask"] = torch.rand(B, T_q, T_k, generator=g) > 0.3
    if "float" in kind:
        bias = torch.randn(T_q, T_k, generator=g, dtype=dt)
        bias[torch.rand(T_q, T_k, generator=g) < 0.2] = float("-inf")
        if "attn_mask" in module_kw:  # one attn_mask only: fold the bool mask into the float one
            bias = bias.masked_fill(~module_kw["attn_mask"], float("-inf"))  # (B, T_q, T_k)
            ref_kw.pop("keep_mask")
        module_kw["attn_mask"] = ref_kw["bias"] = bias
    if "padding" in kind:
        module_kw["key_padding_mask"] = ref_kw["key_padding_mask"] = torch.rand(B, T_k, generator=g) < 0.3
    if "causal" in kind:
        module_kw["is_causal"] = ref_kw["is_causal"] = True
    return m, q, kv, module_kw, ref_kw


def reference(m, q, kv, ref_kw):
    a = ModuleAdapter(m)
    return reference_attention(
        a.projections(), q, kv, kv, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, scale=a.scale, **ref_kw
    )


def tolerances(dtype):
    return {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-10, "rtol": 1e-9}


@settings(max_examples=300, deadline=None)
@given(cases())
def test_output_matches_reference(c):
    m, q, kv, module_kw, ref_kw = build(c)
    out = m(q, kv, kv, **module_kw) if c["cross"] else m(q, **module_kw)
    assert out.dtype == c["dtype"] and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(m, q, kv, ref_kw), **tolerances(c["dtype"]))


@settings(max_examples=120, deadline=None)
@given(cases())
def test_input_gradients_match_reference(c):
    m, q, kv, module_kw, ref_kw = build(c)
    up = torch.randn((*q.shape[:2], m.embed_dim), dtype=c["dtype"])  # upstream gradient (B, T_q, E)
    leaves = [q.detach().clone().requires_grad_()]
    if c["cross"]:
        leaves.append(kv.detach().clone().requires_grad_())
    out = m(leaves[0], leaves[-1], leaves[-1], **module_kw) if c["cross"] else m(leaves[0], **module_kw)
    got = torch.autograd.grad((out * up).sum(), leaves)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(m, leaves64[0], leaves64[-1], ref_kw)
    want = torch.autograd.grad((ref * up.double()).sum(), leaves64)
    for gg, ww in zip(got, want, strict=True):
        assert torch.isfinite(gg).all()
        torch.testing.assert_close(gg.double(), ww, **tolerances(c["dtype"]))
