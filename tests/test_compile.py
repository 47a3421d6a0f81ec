"""torch.compile(fullgraph=True) captures the module whole: no graph break, with every mask
kind, GQA, cross-attention and the cache; forward and backward agree with eager."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab import KVCache, MultiHeadAttention
from conftest import make_masks


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float", "causal+padding"])
def test_forward_and_backward_compile_without_graph_breaks(backend, mask):
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend)
    compiled = torch.compile(mha, fullgraph=True)
    x = torch.randn(2, 6, 16, requires_grad=True)
    kw = make_masks(mask, 2, 6, 6)
    out = compiled(x, **kw)
    out.sum().backward()
    grad_compiled = x.grad.clone()
    x.grad = None
    ref = mha(x, **kw)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_compiled, x.grad, atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"]


@pytest.mark.slow
def test_cross_attention_compiles():
    mha = MultiHeadAttention(16, 4, kdim=12, vdim=12)
    compiled = torch.compile(mha, fullgraph=True)
    q, ctx = torch.randn(2, 5, 16), torch.randn(2, 7, 12)
    torch.testing.assert_close(compiled(q, ctx), mha(q, ctx), atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"]


@pytest.mark.slow
def test_compiled_forward_with_cache_in_append_mode():
    """Append mode changes the attended length every call: allowed to recompile, never to break."""
    mha = MultiHeadAttention(16, 4).eval()
    cache = KVCache.for_module(mha, 1, 8)
    compiled = torch.compile(mha, fullgraph=True)
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        outs = [compiled(x[:, :4], kv_cache=cache, is_causal=True)]
        outs += [compiled(x[:, i : i + 1], kv_cache=cache, is_causal=True) for i in range(4, 8)]
    torch.testing.assert_close(torch.cat(outs, 1), mha(x, is_causal=True), atol=1e-5, rtol=1e-5)
    assert not counters["graph_break"]


@pytest.mark.slow  # an inductor compile of ~20 s
def test_autocast_under_compile():
    mha = MultiHeadAttention(16, 4)
    compiled = torch.compile(mha, fullgraph=True)
    x = torch.randn(2, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, is_causal=True)
    assert out.dtype == torch.bfloat16
    assert (out.float() - mha(x, is_causal=True)).abs().max() < 0.05
    assert not counters["graph_break"]


@pytest.mark.parametrize("mask_kind", ["keep", "bias"])
def test_compiled_one_query_attention_matches_math_without_sdpa(mask_kind):
    """A compiled CPU call with one query (a decode step) runs one_query_attention, not SDPA, and
    equals the math reference: GQA, a bool keep mask with a row that sees no key (zeros, not NaN),
    a float bias."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from attnlab.core.functional import math_attention, sdpa_attention

    gen = torch.Generator().manual_seed(0)
    B, H, G, S, D = 3, 6, 2, 11, 8
    q = torch.randn(B, H, 1, D, generator=gen)
    k, v = (torch.randn(B, G, S, D, generator=gen) for _ in range(2))
    keep = torch.rand(B, 1, 1, S, generator=gen) > 0.3
    keep[0] = True
    keep[2] = False  # row 2 sees no key
    bias = torch.randn(B, H, 1, S, generator=gen)
    kw: dict = {"keep": keep} if mask_kind == "keep" else {"bias": bias}
    backend = EagerAndRecordGraphs()
    out, _ = torch.compile(sdpa_attention, backend=backend, fullgraph=True)(q, k, v, scale=0.3, **kw)
    ref, _ = math_attention(q, k, v, scale=0.3, **kw)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    if mask_kind == "keep":
        assert torch.equal(out[2], torch.zeros_like(out[2]))
    code = "\n".join(g.code for g in backend.graphs)
    assert "scaled_dot_product_attention" not in code
    assert code.count(" @ ") == 2  # scores and context


def test_compiled_one_query_attention_hands_long_caches_to_sdpa():
    """Past ONE_QUERY_MAX_KEYS keys SDPA's kernel reads K/V faster (measured): it is used again."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from attnlab.core.functional import ONE_QUERY_MAX_KEYS, math_attention, sdpa_attention

    q = torch.randn(1, 2, 1, 4)
    k, v = torch.randn(1, 2, ONE_QUERY_MAX_KEYS + 1, 4), torch.randn(1, 2, ONE_QUERY_MAX_KEYS + 1, 4)
    backend = EagerAndRecordGraphs()
    out, _ = torch.compile(sdpa_attention, backend=backend, fullgraph=True)(q, k, v, scale=0.5)
    torch.testing.assert_close(out, math_attention(q, k, v, scale=0.5)[0], atol=1e-6, rtol=1e-5)
    assert "scaled_dot_product_attention" in backend.graphs[0].code
