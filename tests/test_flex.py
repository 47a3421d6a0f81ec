"""The FlexAttention backend (attnlab.core.flex) against the math reference, its BlockMask against the dense
mask it stands for, and how ``auto`` chooses it (or not) and says why.

Parity runs torch's unfused flex (``compiled=False``: the same mask_mod and score_mod, no compilation, but it
ignores the BlockMask), so the tile verdicts are checked on their own against the dense mask, and a few
compiled calls (``slow``) check that the kernel, which does skip tiles, agrees too.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import attnlab.core.flex as flex
from attnlab import MultiHeadAttention
from attnlab.core.attention import BAND_MIN_TOKENS
from attnlab.core.flex import FLEX_BLOCK, Crossover, flex_available, flex_variant
from attnlab.core.masks import prepare_masks
from attnlab.core.variants import Structure, alibi_slopes, variant_math

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
REAL_FLEX_VARIANT = flex.flex_variant  # before any test swaps it for the uncompiled one


def case(
    *,
    B=2,
    H=4,
    G=4,
    T_q=200,
    T_k=200,
    D=16,
    causal=True,
    window=None,
    softcap=None,
    alibi=False,
    sinks=False,
    docs=False,
    padding=False,
    keep=False,
    bias=False,
    empty_row=False,
):
    """``(q, k, v, masks, structure)`` for one combination, with the module's default positions."""
    g = torch.Generator().manual_seed(T_q * 7 + G)
    q = torch.randn(B, H, T_q, D, generator=g)
    k, v = torch.randn(B, G, T_k, D, generator=g), torch.randn(B, G, T_k, D, generator=g)
    attn_mask = None
    if keep:
        attn_mask = torch.rand(B, T_q, T_k, generator=g) > 0.3  # (B, T_q, T_k)
    if bias:
        attn_mask = torch.randn(1, H, T_q, T_k, generator=g)  # a float mask: added to the scores, per head
    if empty_row:
        attn_mask = torch.ones(B, T_q, T_k, dtype=torch.bool)
        attn_mask[0, 3] = False  # query 3 of sequence 0 sees nothing
    pad = None
    if padding:
        pad = torch.zeros(B, T_k, dtype=torch.bool)
        pad[0, -70:], pad[1, :5] = True, True
    masks = prepare_masks(attn_mask, pad, False, batch=B, heads=H, q_len=T_q, k_len=T_k, dtype=q.dtype, device=q.device)
    doc = None
    if docs:
        doc = torch.zeros(B, T_q, dtype=torch.long)
        doc[0, 60:], doc[0, 150:], doc[1, 130:] = 1, 2, 1
    st = Structure(
        q_pos=torch.arange(T_k - T_q, T_k),
        k_pos=torch.arange(T_k),
        causal=causal,
        window=window,
        softcap=softcap,
        alibi=alibi_slopes(H) if alibi else None,
        sinks=torch.randn(H, generator=g) if sinks else None,
        q_doc=doc,
        k_doc=doc,
    )
    return q, k, v, masks, st


CASES = {
    "window": dict(window=32),
    "window wider than a tile": dict(window=130),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "documents": dict(docs=True),
    "key padding": dict(padding=True),
    "bool mask": dict(keep=True),
    "float bias": dict(bias=True),
    "GQA": dict(G=2, window=40),
    "MQA": dict(G=1, window=40),
    "not causal": dict(causal=False, padding=True, sinks=True),
    "fewer queries than keys": dict(T_q=100, T_k=300, window=64),
    "one query": dict(T_q=1, T_k=300, window=64),
    "a row that sees nothing": dict(empty_row=True, sinks=True),
    "everything": dict(window=50, softcap=3.0, alibi=True, sinks=True, docs=True, padding=True, G=2),
}


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_flex_equals_the_math_reference(kw):
    q, k, v, masks, st = case(**kw)
    want, _ = variant_math(q, k, v, masks, st, scale=0.25)
    got = flex_variant(q, k, v, masks, st, scale=0.25, compiled=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sinks_through_the_lse_equal_sinks_as_a_key(monkeypatch):
    """Where compiled flex returns the LSE (GPUs), sinks rescale the output: out * sigmoid(lse - s_h)."""
    monkeypatch.setattr(flex, "_sinks_by_lse", lambda device: True)
    for kw in (dict(sinks=True, window=32, G=2), dict(sinks=True, empty_row=True)):
        q, k, v, masks, st = case(**kw)
        want, _ = variant_math(q, k, v, masks, st, scale=0.25)
        got = flex_variant(q, k, v, masks, st, scale=0.25, compiled=False)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def dense_tiles(keep: torch.Tensor, n_q: int, n_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Any / every kept pair per tile of a dense (B, H, T_q, T_k) mask; tail tiles padded with False."""
    B, H, T_q, T_k = keep.shape
    padded = torch.zeros(B, H, n_q * FLEX_BLOCK, n_k * FLEX_BLOCK, dtype=torch.bool)
    padded[..., :T_q, :T_k] = keep
    tiles = padded.view(B, H, n_q, FLEX_BLOCK, n_k, FLEX_BLOCK)
    return tiles.any(5).any(3), tiles.all(5).all(3)


TILE_CASES = {
    "window 256": dict(T_q=1000, T_k=1000, window=256),
    "window 100, offset queries": dict(T_q=300, T_k=700, window=100),
    "documents": dict(T_q=600, T_k=600, window=None, docs=True),
    "padding and a bool mask": dict(T_q=300, T_k=300, window=200, padding=True, keep=True),
    "not causal": dict(T_q=256, T_k=384, causal=False),
}


@pytest.mark.parametrize("kw", TILE_CASES.values(), ids=TILE_CASES.keys())
@pytest.mark.parametrize("sink_key", [False, True])
def test_block_mask_lists_every_tile_with_a_kept_pair_and_calls_full_only_full_tiles(kw, sink_key):
    docs = kw.pop("docs", False)
    *_, masks, st = case(H=1, G=1, D=4, **kw)
    if docs:  # documents of a few hundred tokens: tiles inside one document are full
        doc = (torch.arange(kw["T_q"]) // 256).expand(2, -1)
        st = Structure(q_pos=st.q_pos, k_pos=st.k_pos, q_doc=doc, k_doc=doc)
    T_q, T_k = kw["T_q"], kw["T_k"]
    keep = st.keep()
    keep = torch.ones(1, 1, T_q, T_k, dtype=torch.bool) if keep is None else keep
    if masks.keep is not None:
        keep = keep & masks.keep
    keep = keep.expand(2, 1, T_q, T_k)
    if sink_key:  # the sink is one more key, always visible
        keep = torch.cat([keep, torch.ones(2, 1, T_q, 1, dtype=torch.bool)], dim=-1)
    n_q, n_k = -(-T_q // FLEX_BLOCK), -(-(T_k + sink_key) // FLEX_BLOCK)
    want_some, want_every = dense_tiles(keep, n_q, n_k)
    some, every = flex._tile_verdicts(st, masks.keep, T_q, T_k, sink_key)
    some, every = some.expand_as(want_some), every.expand_as(want_every)
    assert not (want_some & ~some).any(), "a tile holding a kept pair is missing: its keys would be skipped"
    assert not (every & ~want_every).any(), "a tile called full holds a masked pair: mask_mod would be skipped"
    if masks.keep is None and not docs:  # positions alone: the verdicts are exact
        assert torch.equal(some, want_some) and torch.equal(every, want_every)
    if docs:
        assert every.any(), "tiles inside one document should be full"


def test_flex_availability_says_why():
    cpu = torch.device("cpu")
    assert flex_available(cpu, False) == (True, "")
    ok, why = flex_available(cpu, True)
    assert not ok and "no CPU backward" in why
    ok, why = flex_available(cpu, False, torch.float64)
    assert not ok and "float32" in why


# -- auto's choice -------------------------------------------------------------------------------
E, H = 32, 4


def window_module(**kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(E, H, **kw).eval()


@pytest.fixture
def eager_flex(monkeypatch):
    """Auto's choice without compiling: the module's flex calls run torch's unfused flex; crossovers at T=64."""
    real = flex.flex_variant
    monkeypatch.setattr(flex, "flex_variant", lambda *a, **kw: real(*a, **kw, compiled=False))
    for key in list(flex.FLEX_CROSSOVERS):
        monkeypatch.setitem(flex.FLEX_CROSSOVERS, key, Crossover(64, (torch.float32,), f"a test's crossover for {key}"))
    monkeypatch.setattr(flex, "_FAILED", {})


def test_auto_picks_flex_for_cpu_inference_past_the_crossover_and_says_so(eager_flex):
    m = window_module(window=16)
    x = torch.randn(1, 80, E)
    with torch.no_grad():
        out = m(x, is_causal=True)
    assert m.last_backend == "flex"
    assert "window=16, T=80, cpu inference: flex (measured a test's crossover" in m.last_backend_reason
    m.backend = "math"
    torch.testing.assert_close(out, m(x, is_causal=True), atol=1e-5, rtol=1e-5)
    m.backend = "auto"
    with torch.no_grad():
        m(x[:, :40], is_causal=True)  # below the crossover
    assert m.last_backend == "sdpa" and "flex not used below T=64" in m.last_backend_reason


def test_auto_keeps_training_on_sdpa_on_a_cpu_and_says_why(eager_flex):
    m = window_module(window=16)
    m(torch.randn(1, 80, E), is_causal=True)  # grad mode on: this forward may be backpropagated
    assert m.last_backend == "sdpa" and "no CPU backward" in m.last_backend_reason
    T = BAND_MIN_TOKENS
    m(torch.randn(1, T, E), is_causal=True)
    assert m.last_backend == "sdpa-band" and f"T={T}, cpu training" in m.last_backend_reason


def test_auto_runs_softcap_on_flex_in_inference_and_on_math_in_training(eager_flex):
    m = window_module(softcap=5.0)
    x = torch.randn(1, 80, E)
    with torch.no_grad():
        out = m(x, is_causal=True)
    assert m.last_backend == "flex" and "softcap=5.0" in m.last_backend_reason
    want = m(x, is_causal=True)
    assert m.last_backend == "math" and "no CPU backward" in m.last_backend_reason
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_auto_never_sends_dropout_float64_unmeasured_dtypes_or_cases_to_flex(eager_flex, monkeypatch):
    m = window_module(window=16, dropout=0.1).train()
    with torch.no_grad():
        m(torch.randn(1, 80, E), is_causal=True)
    assert m.last_backend == "sdpa" and "dropout=0.1" in m.last_backend_reason
    m = window_module(window=16).double()
    with torch.no_grad():
        m(torch.randn(1, 80, E, dtype=torch.float64), is_causal=True)
    assert m.last_backend == "sdpa" and "float32, bfloat16 and float16 only" in m.last_backend_reason
    m = window_module(window=16).to(torch.bfloat16)
    with torch.no_grad():
        m(torch.randn(1, 80, E, dtype=torch.bfloat16), is_causal=True)
    assert m.last_backend == "sdpa" and "measured in torch.float32, not torch.bfloat16" in m.last_backend_reason
    monkeypatch.delitem(flex.FLEX_CROSSOVERS, ("cpu", False, "window"))
    m = window_module(window=16)
    with torch.no_grad():
        m(torch.randn(1, 80, E), is_causal=True)
    assert m.last_backend == "sdpa" and "no measurement" in m.last_backend_reason


def test_a_flex_failure_falls_back_once_and_auto_stops_trying(eager_flex, monkeypatch):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor could not build the kernel")

    monkeypatch.setattr(flex, "flex_variant", REAL_FLEX_VARIANT)  # compiled, so that its failure path runs
    monkeypatch.setattr(flex, "_flex", broken)
    m = window_module(window=16)
    x = torch.randn(1, 80, E)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="inductor could not build the kernel.*SDPA"):
        out = m(x, is_causal=True)
    with torch.no_grad():
        again = m(x, is_causal=True)
    assert len(calls) == 1, "flex was tried again after it failed"
    assert m.last_backend == "sdpa" and "flex failed earlier in this process on cpu" in m.last_backend_reason
    m.backend = "math"
    torch.testing.assert_close(out, m(x, is_causal=True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, out, atol=1e-5, rtol=1e-5)
    m.backend = "flex"
    with torch.no_grad(), pytest.raises(ValueError, match="flex failed earlier"):
        m(x, is_causal=True)


def test_explicit_flex_with_grad_on_a_cpu_names_the_fix():
    m = window_module(window=16, backend="flex")
    with pytest.raises(ValueError, match=r"backend='flex' cannot run this call: torch has no CPU backward.*no_grad"):
        m(torch.randn(1, 80, E), is_causal=True)
    q, k, v, masks, st = case(window=16)
    with pytest.raises(ValueError, match="no CPU backward"):
        flex_variant(q.requires_grad_(), k, v, masks, st, scale=0.25)
    m = window_module(window=16, backend="flex", dropout=0.1).train()
    with torch.no_grad(), pytest.raises(ValueError, match="flex_attention has no dropout; call mha.eval()"):
        m(torch.randn(1, 80, E), is_causal=True)


# -- compiled ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_flex_skips_tiles_and_still_equals_the_reference(one_thread):
    """One compiled kernel for every variant at once (T=200: a tail tile, GQA, documents, padding, sinks)."""
    q, k, v, masks, st = case(**CASES["everything"])
    want, _ = variant_math(q, k, v, masks, st, scale=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a silent fallback would pass without testing flex
        got = flex_variant(q, k, v, masks, st, scale=0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_module_with_flex_equals_math_also_inside_a_callers_torch_compile(one_thread):
    m = window_module(window=100, num_kv_heads=2, backend="flex")
    x = torch.randn(1, 384, E)  # three tiles: full, partial and skipped ones
    with torch.no_grad():
        out = m(x, is_causal=True)
    assert m.last_backend == "flex"
    with torch.no_grad():
        compiled = torch.compile(m)(x, is_causal=True)  # a caller's compile leaves flex_variant to itself
    m.backend = "math"
    want = m(x, is_causal=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled, want, atol=1e-5, rtol=1e-5)
