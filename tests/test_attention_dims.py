"""``MultiHeadAttention`` with head dims apart from the width, a value head dim of its own, partial RoPE and
output gates (issue 41), against a float64 reference written here from the equations.

Notation: b batch, i/j query/key positions, h query head, g key/value head, d query/key channel (D of them),
e value channel (Dv); E embed_dim, H query heads, G key/value heads, R = rope_dims.

The reference (:func:`reference`), one line per equation:
    q[b,i,h,:] = (x W_q^T + b_q)[b,i, h*D:(h+1)*D]      k[b,j,g,:] likewise (D),  v[b,j,g,:] (Dv)
    qk-norm:   t / sqrt(mean(t^2) + eps) * w             per head ("head") or over all channels ("full")
    RoPE:      pair (c, c + R/2), c < R/2, turned by pos * 10000^(-2c/R); channels R.. pass through
    s[b,h,i,j] = scale * sum_d q[b,i,h,d] k[b,j,h // (H/G),d]       then masked, softmax over j
    ctx[b,i,h,e] = sum_j p[b,h,i,j] v[b,j,h // (H/G),e]
    gate:      ctx * sigmoid(x W_g^T + b_g), per channel h*Dv+e ("elementwise") or per head h ("headwise")
    out = ctx.reshape(b, i, H*Dv) W_o^T + b_o
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention
from attnlab.core.functional import one_query_attention
from attnlab.core.kv_cache import KVCache, RollingKVCache
from attnlab.core.rope import apply_rope, rope_cos_sin

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

B, T = 2, 7
# name -> (embed_dim, num_heads, options): each feature alone, then all at once
CONFIGS = {
    "head_dim": (24, 4, dict(num_kv_heads=2, head_dim=10)),  # H*D = 40 != E = 24
    "uneven": (20, 3, dict(num_kv_heads=1, head_dim=8)),  # E not divisible by H
    "v_head_dim": (24, 4, dict(num_kv_heads=2, head_dim=8, v_head_dim=12)),  # Dv != D (MLA)
    "rope_dims": (24, 4, dict(num_kv_heads=2, rope_dims=2)),  # D = 6, RoPE on 2 of them
    "gate_elementwise": (24, 4, dict(num_kv_heads=2, output_gate="elementwise", v_head_dim=4)),
    "gate_headwise": (24, 4, dict(num_kv_heads=2, output_gate="headwise", head_dim=8, v_head_dim=6)),
    "qk_norm_full": (24, 4, dict(num_kv_heads=2, head_dim=10, qk_norm="full")),
    "everything": (
        24,
        4,
        dict(num_kv_heads=2, head_dim=12, v_head_dim=6, rope_dims=4, output_gate="elementwise", qk_norm="head"),
    ),
}
NAMES = list(CONFIGS)


def build(name: str, dtype: torch.dtype = torch.float32, **overrides) -> MultiHeadAttention:
    """The config's module with every parameter drawn at random (biases and norm weights too: their defaults,
    zeros and ones, would hide a bias or a weight applied in the wrong place)."""
    E, H, options = CONFIGS[name]
    torch.manual_seed(0)
    m = MultiHeadAttention(E, H, **(options | overrides), dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            std = p.size(1) ** -0.5 if p.dim() == 2 else 0.3
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    return m.eval()


def inputs(m: MultiHeadAttention, dtype: torch.dtype = torch.float32, length: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(B, length, m.embed_dim, generator=g, dtype=torch.float64).to(dtype)  # (B, T, E)


def angles(positions: torch.Tensor, R: int) -> torch.Tensor:
    """(T, R/2) float64: the angle of pair (c, c + R/2) at each position, pos * 10000^(-2c/R)."""
    c = torch.arange(R // 2, dtype=torch.float64)
    return positions.double()[:, None] * 10000.0 ** (-2.0 * c / R)


def cos_sin(positions: torch.Tensor, R: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, R) cos and sin of :func:`angles`, computed in float64 before the cast (attnlab's rope_cos_sin computes
    its angles in float32: :func:`test_rope_cos_sin_is_the_angles` holds it to these)."""
    theta = angles(positions, R)
    theta = torch.cat([theta, theta], dim=-1)  # (T, R): channel c and c + R/2 share an angle
    return theta.cos().to(dtype), theta.sin().to(dtype)


def rope_for(m: MultiHeadAttention, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for the module: R = rope_dims wide, or the whole head."""
    return cos_sin(positions, m.rope_dims or m.head_dim, dtype)


def padding() -> torch.Tensor:
    """key_padding_mask (B, T), True = pad: keys 1 and 2 of row 0 (no query is left without a key)."""
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, 1:3] = True
    return pad


# --- the reference ----------------------------------------------------------------------------------------------


def _rotate(t: torch.Tensor, positions: torch.Tensor, R: int) -> torch.Tensor:
    """RoPE from its angles, on the first R channels of t (b, i, heads, d); the rest passes through."""
    theta = angles(positions, R)  # (i, R/2)
    cos, sin = theta.cos()[None, :, None], theta.sin()[None, :, None]  # (1, i, 1, R/2)
    a, b, rest = t[..., : R // 2], t[..., R // 2 : R], t[..., R:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def reference(
    m: MultiHeadAttention, x: torch.Tensor, *, rope: bool = True, causal: bool = True, pad: torch.Tensor | None = None
) -> torch.Tensor:
    """The module's function in float64, from the equations in the module docstring."""
    P = {name: t.detach().double() for name, t in m.named_parameters()}
    x = x.double()
    b_, n, _ = x.shape
    H, G, D, Dv = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim

    def linear(name: str, t: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("bio,po->bip", t, P[f"{name}.weight"])
        return y + P[f"{name}.bias"] if f"{name}.bias" in P else y

    def rms(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + m.q_norm.eps) * w

    q, k, v = linear("q_proj", x), linear("k_proj", x), linear("v_proj", x)
    if m.qk_norm == "full":
        q, k = rms(q, P["q_norm.weight"]), rms(k, P["k_norm.weight"])
    q, k, v = q.reshape(b_, n, H, D), k.reshape(b_, n, G, D), v.reshape(b_, n, G, Dv)
    if m.qk_norm == "head":
        q, k = rms(q, P["q_norm.weight"]), rms(k, P["k_norm.weight"])
    if rope:
        q, k = _rotate(q, torch.arange(n), m.rope_dims or D), _rotate(k, torch.arange(n), m.rope_dims or D)
    group = torch.arange(H) // (H // G)  # query head h reads K/V head h // (H/G)
    s = torch.einsum("bihd,bjhd->bhij", q, k[:, :, group]) * m.scale
    keep = torch.ones(b_, 1, n, n, dtype=torch.bool)
    if causal:
        keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
    if pad is not None:
        keep = keep & ~pad[:, None, None, :]
    p = s.masked_fill(~keep, float("-inf")).softmax(-1)
    ctx = torch.einsum("bhij,bjhe->bihe", p, v[:, :, group])  # (b, i, H, Dv)
    if m.output_gate == "elementwise":
        ctx = ctx * torch.sigmoid(linear("gate_proj", x)).reshape(b_, n, H, Dv)
    elif m.output_gate == "headwise":
        ctx = ctx * torch.sigmoid(linear("gate_proj", x))[..., None]  # (b, i, H, 1)
    return linear("out_proj", ctx.reshape(b_, n, H * Dv))


# --- the function -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_matches_the_float64_reference(name):
    """float64: the formulas exactly (1e-12); float32: to rounding (measured <= 7.2e-7, outputs of order 1)."""
    pad = padding()
    for dtype, atol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        m = build(name, dtype)
        x = inputs(m, dtype)
        expected = reference(m, x, pad=pad)
        for backend in ("math", "sdpa"):
            m.backend = backend
            with torch.no_grad():
                out = m(x, is_causal=True, key_padding_mask=pad, rope=rope_for(m, torch.arange(T), dtype))
            assert out.shape == (B, T, m.embed_dim) and out.dtype == dtype
            torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_math_equals_sdpa(name):
    m = build(name)
    x = inputs(m)
    kwargs = dict(is_causal=True, key_padding_mask=padding(), rope=rope_for(m, torch.arange(T), torch.float32))
    with torch.no_grad():
        m.backend = "math"
        math_out, weights = m(x, need_weights=True, **kwargs)
        m.backend = "sdpa"
        sdpa_out = m(x, **kwargs)
    assert weights.shape == (B, m.num_heads, T, T)
    torch.testing.assert_close(sdpa_out, math_out, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("name", NAMES)
def test_gradcheck(name, backend):
    """float64 gradients of the output in the input, in each projection's output (through its bias: the weights'
    gradients are that one times the input) and in the norms' weights."""
    m = build(name, torch.float64, backend=backend)
    x = inputs(m, torch.float64, length=3)[:1].requires_grad_()
    rope = rope_for(m, torch.arange(3), torch.float64)
    params = {n: p for n, p in m.named_parameters() if n.endswith(".bias") or n.endswith("norm.weight")}

    def f(x, *weights):
        return torch.func.functional_call(
            m, dict(zip(params, weights, strict=True)), (x,), dict(is_causal=True, rope=rope)
        )

    assert ("gate_proj.bias" in params) == (m.output_gate is not None)
    assert torch.autograd.gradcheck(f, (x, *(p.detach().requires_grad_() for p in params.values())))


@pytest.mark.parametrize("name", NAMES)
def test_no_causal_leak(name):
    """No output before position t depends on an input at or after t: its gradient there is exactly 0
    (the gate reads only its own position's input)."""
    m = build(name)
    x = inputs(m).requires_grad_()
    out = m(x, is_causal=True, rope=rope_for(m, torch.arange(T), torch.float32))
    t = 4
    out[:, :t].sum().backward()
    assert x.grad[:, t:].abs().max() == 0.0
    assert x.grad[:, :t].abs().min() > 0.0  # and the earlier inputs do reach it


@pytest.mark.parametrize("mode", ["append", "positions"])
@pytest.mark.parametrize("name", ["head_dim", "v_head_dim", "rope_dims", "everything"])
def test_cached_decode_equals_recompute(name, mode):
    """Prefill 3 tokens, then decode one at a time through a KVCache: the outputs of one causal call, in float64."""
    m = build(name, torch.float64)
    x = inputs(m, torch.float64)
    full = m(x, is_causal=True, rope=rope_for(m, torch.arange(T), torch.float64))
    cache = KVCache.for_module(m, B, max_len=T)
    assert (cache.k.size(-1), cache.v.size(-1)) == (m.head_dim, m.v_head_dim)
    steps, outs = [(0, 3)] + [(t, t + 1) for t in range(3, T)], []
    for start, stop in steps:
        pos = torch.arange(start, stop)
        where = dict(cache_positions=pos) if mode == "positions" else {}
        outs.append(m(x[:, start:stop], is_causal=True, kv_cache=cache, rope=rope_for(m, pos, torch.float64), **where))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-12, rtol=0)


def test_rolling_cache_keeps_value_heads_of_their_own_width():
    m = build("v_head_dim", torch.float64, window=3)
    x = inputs(m, torch.float64)
    full = m(x, is_causal=True)
    cache = RollingKVCache.for_module(m, B)
    assert (cache.k.shape, cache.v.shape) == ((B, 2, 3, 8), (B, 2, 3, 12))
    outs = [m(x[:, :4], is_causal=True, kv_cache=cache, cache_positions=torch.arange(4))]
    outs += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache, cache_positions=torch.tensor([t])) for t in range(4, T)]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-12, rtol=0)


def test_kv_cache_sizes_its_value_buffer():
    cache = KVCache(2, 16, 3, 8, v_head_dim=4)
    assert cache.v.shape == (2, 3, 16, 4) and cache.bytes_per_token == 3 * (8 + 4) * 4
    assert "head_dim=8, v_head_dim=4" in repr(cache)
    assert "v_head_dim" not in repr(KVCache(2, 16, 3, 8))


# --- partial RoPE -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("R", [2, 4, 16])
def test_rope_cos_sin_is_the_angles(R):
    """attnlab's cos/sin of width R against the angles above (float32 angles: 1e-5 at positions up to 63)."""
    cos, sin = rope_cos_sin(torch.arange(64), R, dtype=torch.float64)
    theta = angles(torch.arange(64), R)
    torch.testing.assert_close(cos, torch.cat([theta, theta], -1).cos(), atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, torch.cat([theta, theta], -1).sin(), atol=1e-5, rtol=0)


def test_partial_rope_rotates_the_first_channels_and_passes_the_rest():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64)  # (B, heads, T, D)
    cos, sin = rope_cos_sin(torch.arange(5), 4, dtype=torch.float64)  # (T, 4)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4], apply_rope(x[..., :4], cos, sin), atol=0, rtol=0)
    assert (out[:, :, 1:, :4] - x[:, :, 1:, :4]).abs().max() > 0.1  # position 0 is the identity; the others turn


def test_partial_rope_scores_depend_on_the_distance_only():
    """q_i . k_j with RoPE on 4 of 8 channels: shifting every position by 5 leaves the scores unchanged."""
    m = build("rope_dims", torch.float64, rope_dims=4, head_dim=8)
    x = inputs(m, torch.float64)
    with torch.no_grad():
        a = m(x, is_causal=True, rope=cos_sin(torch.arange(T), 4, torch.float64))
        b = m(x, is_causal=True, rope=cos_sin(torch.arange(T) + 5, 4, torch.float64))
        c = m(x, is_causal=True)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert (a - c).abs().max() > 1e-3  # and RoPE did something


def test_rope_of_the_whole_head_is_refused_when_rope_dims_is_set():
    m = build("rope_dims")  # D = 6, rope_dims = 2
    x = inputs(m)
    message = (
        "rope cos/sin have shape (7, 6); this module rotates rope_dims=2 of each head's 6 channels, so expected "
        "(T_q, rope_dims) = (7, 2) or (B, T_q, rope_dims): build them with rope_cos_sin(positions, 2)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        m(x, is_causal=True, rope=rope_cos_sin(torch.arange(T), 6))


# --- the gate ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,width", [("elementwise", 4 * 6), ("headwise", 4)])
def test_gate_is_a_plain_linear_child(kind, width):
    m = MultiHeadAttention(24, 4, v_head_dim=6, output_gate=kind)
    assert isinstance(m.gate_proj, nn.Linear) and (m.gate_proj.in_features, m.gate_proj.out_features) == (24, width)
    linears = {name for name, child in m.named_modules() if isinstance(child, nn.Linear)}
    assert linears == {"q_proj", "k_proj", "v_proj", "out_proj", "gate_proj"}  # what PEFT's target_modules match
    assert {"gate_proj.weight", "gate_proj.bias"} <= set(m.state_dict())


def test_a_closed_gate_silences_and_an_open_one_passes():
    """Bias -inf: sigmoid 0, the output is out_proj's bias; bias +inf: sigmoid 1, the ungated module."""
    m = build("gate_headwise")
    x = inputs(m)
    plain = build("gate_headwise", output_gate=False)
    with torch.no_grad():
        m.gate_proj.weight.zero_()
        m.gate_proj.bias.fill_(-1e4)
        torch.testing.assert_close(m(x, is_causal=True), m.out_proj.bias.expand(B, T, -1), atol=0, rtol=0)
        m.gate_proj.bias.fill_(1e4)
        torch.testing.assert_close(m(x, is_causal=True), plain(x, is_causal=True), atol=0, rtol=0)


# --- the defaults stay as they were ------------------------------------------------------------------------------


def test_the_default_module_is_unchanged(monkeypatch):
    m = MultiHeadAttention(32, 4, num_kv_heads=2)
    assert m.extra_repr() == "embed_dim=32, num_heads=4, num_kv_heads=2, dropout=0.0, backend='auto'"
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (32, 32),
        "q_proj.bias": (32,),
        "k_proj.weight": (16, 32),
        "k_proj.bias": (16,),
        "v_proj.weight": (16, 32),
        "v_proj.bias": (16,),
        "out_proj.weight": (32, 32),
        "out_proj.bias": (32,),
    }
    assert (m.head_dim, m.v_head_dim, m.rope_dims, m.output_gate, m.gate_proj) == (8, 8, None, None, None)
    assert "gate_proj" not in m._modules and m.scale == 1.0 / math.sqrt(8)
    assert MultiHeadAttention(32, 4, output_gate=None).gate_proj is None  # None, as False: no gate
    # the same numbers as the same module with its head dims named explicitly, drawn from the same seed
    torch.manual_seed(5)
    a = MultiHeadAttention(32, 4, num_kv_heads=2)
    torch.manual_seed(5)
    b = MultiHeadAttention(32, 4, num_kv_heads=2, head_dim=8, v_head_dim=8, rope_dims=None, output_gate=False)
    x = torch.randn(2, 5, 32)
    monkeypatch.setattr(MultiHeadAttention, "_gate", lambda *args: pytest.fail("the gate ran on a module without one"))
    with torch.no_grad():
        assert torch.equal(a(x, is_causal=True), b(x, is_causal=True))
    assert b.extra_repr() == a.extra_repr()


def test_extra_repr_names_the_new_options():
    m = MultiHeadAttention(24, 4, head_dim=12, v_head_dim=6, rope_dims=4, output_gate="headwise")
    assert m.extra_repr() == (
        "embed_dim=24, num_heads=4, head_dim=12, v_head_dim=6, rope_dims=4, output_gate='headwise', dropout=0.0, "
        "backend='auto'"
    )
    assert "head_dim=8" in MultiHeadAttention(20, 3, head_dim=8).extra_repr()


def test_fused_qkv_projection_splits_by_each_width():
    """The fused path (one Linear computing [q | k | v], as attnlab.models sets for quantized layers)."""
    m = build("everything")
    x = inputs(m)
    with torch.no_grad():
        expected = m(x, is_causal=True)
        fused = nn.Linear(m.embed_dim, m.q_width + m.kv_dim + m.v_width)
        fused.weight.copy_(torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]))
        fused.bias.copy_(torch.cat([m.q_proj.bias, m.k_proj.bias, m.v_proj.bias]))
        m.qkv_proj = fused
        torch.testing.assert_close(m(x, is_causal=True), expected, atol=1e-6, rtol=0)


def test_a_fused_in_proj_state_dict_loads_with_head_dims():
    m = build("everything")
    state = m.state_dict()
    for kind in ("weight", "bias"):
        state[f"in_proj.{kind}"] = torch.cat([state.pop(f"{n}.{kind}") for n in ("q_proj", "k_proj", "v_proj")])
    fresh = MultiHeadAttention(24, 4, **CONFIGS["everything"][2])
    fresh.load_state_dict(state)
    for name, p in m.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], p), name
    state["in_proj.weight"] = state["in_proj.weight"][:-1]
    message = (
        "in_proj.weight has 83 rows; this module expects 84 (num_heads * head_dim + num_kv_heads * head_dim + "
        "num_kv_heads * v_head_dim = 48 + 24 + 12)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        fresh.load_state_dict(state)


# --- the variants with a value head dim of its own -----------------------------------------------------------------


@pytest.mark.parametrize("variant", [dict(window=3), dict(sinks=True), dict(alibi=True), dict(softcap=5.0)])
def test_variants_with_value_heads_of_their_own_width(variant):
    m = build("v_head_dim", **variant)
    if m.sinks is not None:
        with torch.no_grad():
            m.sinks.copy_(torch.linspace(-1.0, 1.0, 4))
    x = inputs(m)
    with torch.no_grad():
        m.backend = "math"
        expected = m(x, is_causal=True, key_padding_mask=padding())
        m.backend = "auto"
        out = m(x, is_causal=True, key_padding_mask=padding())
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_document_ids_with_value_heads_of_their_own_width():
    m = build("everything")
    x = inputs(m)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0] * T])
    rope = rope_for(m, torch.arange(T), torch.float32)
    with torch.no_grad():
        packed = m(x, is_causal=True, document_ids=docs, rope=rope)
        alone = m(x[:1, 3:], is_causal=True, rope=rope_for(m, torch.arange(3, T), torch.float32))
    torch.testing.assert_close(packed[:1, 3:], alone, atol=1e-6, rtol=0)


def test_band_sdpa_with_value_heads_of_their_own_width():
    """A long windowed call runs SDPA on key bands; its gathered value bands are Dv wide."""
    m = build("v_head_dim", window=16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 1024, 24, generator=g)
    with torch.no_grad():
        out = m(x, is_causal=True)
        assert m.last_backend == "sdpa-band"
        m.backend = "math"
        expected = m(x, is_causal=True)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_one_query_attention_returns_value_wide_heads():
    """The compiled CPU decode step's kernel: q (B, H, 1, D), v (B, G, S, Dv) -> (B, H, 1, Dv)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(2, 4, 1, 8, generator=g),
        torch.randn(2, 2, 9, 8, generator=g),
        torch.randn(2, 2, 9, 3, generator=g),
    )
    out = one_query_attention(q, k, v, None, 0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    assert out.shape == (2, 4, 1, 3)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


@pytest.mark.slow  # compiles a flex kernel: 3-10 s
def test_flex_with_value_heads_of_their_own_width():
    m = build("v_head_dim", window=3, backend="flex")
    x = inputs(m)
    with torch.no_grad():
        out = m(x, is_causal=True)
        assert m.last_backend == "flex"
        m.backend = "math"
        torch.testing.assert_close(out, m(x, is_causal=True), atol=1e-6, rtol=0)


# --- what is refused, and how it is said ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,error,message",
    [
        (
            dict(head_dim=0),
            ValueError,
            "head_dim must be a positive int or None (default embed_dim // num_heads = 4), got 0; each head needs at "
            "least one channel: pass e.g. head_dim=64, or leave it None.",
        ),
        (
            dict(head_dim=-8),
            ValueError,
            "head_dim must be a positive int or None (default embed_dim // num_heads = 4), got -8; each head needs "
            "at least one channel: pass e.g. head_dim=64, or leave it None.",
        ),
        (
            dict(head_dim=8.0),
            TypeError,
            "head_dim must be a positive int or None (default embed_dim // num_heads = 4), got 8.0 (float); pass an "
            "int, e.g. head_dim=64.",
        ),
        (
            dict(v_head_dim=0),
            ValueError,
            "v_head_dim must be a positive int or None (default head_dim), got 0; each head needs at least one "
            "channel: pass e.g. v_head_dim=64, or leave it None.",
        ),
        (
            dict(rope_dims=3),
            ValueError,
            "rope_dims=3 is odd: RoPE rotates channel pairs (c, c + rope_dims/2) of each query/key head; use "
            "rope_dims=2 or 4.",
        ),
        (
            dict(rope_dims=0),
            ValueError,
            "rope_dims must be a positive even int or None (RoPE on the whole head), got 0; for no rotary embedding "
            "at all, pass no rope= to forward.",
        ),
        (
            dict(rope_dims=6),
            ValueError,
            "rope_dims=6 exceeds the query/key head dim 4: RoPE rotates the first rope_dims channels of each head "
            "and passes the rest through; use rope_dims <= 4 (a rotary fraction f is rope_dims=int(4 * f)), or None "
            "for the whole head.",
        ),
        (
            dict(rope_dims=0.5),
            TypeError,
            "rope_dims must be an even int or None (RoPE on the whole head), got 0.5 (float); for a rotary fraction "
            "f pass rope_dims=int(head_dim * f).",
        ),
        (
            dict(output_gate="sigmoid"),
            ValueError,
            "output_gate must be False, 'elementwise' (a sigmoid gate per output channel, H * v_head_dim, as "
            "Qwen3-Next) or 'headwise' (one per head, H); got 'sigmoid'.",
        ),
        (
            dict(output_gate=True),
            ValueError,
            "output_gate must be False, 'elementwise' (a sigmoid gate per output channel, H * v_head_dim, as "
            "Qwen3-Next) or 'headwise' (one per head, H); got True (True is ambiguous: name the kind).",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_argument(options, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        MultiHeadAttention(16, 4, **options)


def test_rope_dims_is_checked_against_the_head_dim_it_is_given():
    assert MultiHeadAttention(16, 4, head_dim=8, rope_dims=8).rope_dims == 8  # 16 // 4 = 4 would refuse it
    with pytest.raises(ValueError, match=r"^rope_dims=10 exceeds the query/key head dim 8"):
        MultiHeadAttention(16, 4, head_dim=8, rope_dims=10)


def test_a_cache_without_the_value_head_dim_is_refused():
    m = build("v_head_dim")
    cache = KVCache(B, T, 2, 8)  # values 8 wide, the module's are 12
    message = (
        "kv_cache stores values of (G, Dv) = (2, 8) but this call's values are (G, Dv) = (2, 12); build it with "
        "KVCache.for_module(mha, ...), which reads the module's v_head_dim."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        m(inputs(m), is_causal=True, kv_cache=cache)


@pytest.mark.parametrize(
    "name,message",
    [
        (
            "head_dim",
            "to_torch: this module has head_dim=10, v_head_dim=10 with embed_dim=24, num_heads=4, but "
            "nn.MultiheadAttention's heads always split embed_dim (head_dim = v_head_dim = 24 // 4 = 6); its weights "
            "have no place there. Keep attnlab's module, or build one with head_dim=None and v_head_dim=None.",
        ),
        (
            "gate_elementwise",
            "to_torch: this module has head_dim=6, v_head_dim=4 with embed_dim=24, num_heads=4, but "
            "nn.MultiheadAttention's heads always split embed_dim (head_dim = v_head_dim = 24 // 4 = 6); its weights "
            "have no place there. Keep attnlab's module, or build one with head_dim=None and v_head_dim=None.",
        ),
    ],
)
def test_to_torch_refuses_what_torch_cannot_hold(name, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build(name).to_torch()


def test_to_torch_refuses_a_gate():
    with pytest.raises(
        ValueError, match=r"^to_torch: this module has output_gate='headwise', which nn\.MultiheadAttention"
    ):
        MultiHeadAttention(24, 4, output_gate="headwise").to_torch()


def test_torch_round_trip_still_works_with_rope_dims():
    """rope_dims alone changes no weight shape: torch's module holds the projections (RoPE is the caller's)."""
    m = build("rope_dims")
    x = inputs(m)
    with torch.no_grad():
        torch.testing.assert_close(m.to_torch()(x, x, x, need_weights=False)[0], m(x), atol=1e-6, rtol=0)


def test_context_parallel_refuses_value_heads_of_their_own_width():
    m = build("v_head_dim")
    message = (
        "context_parallel with v_head_dim=12 != head_dim=8: the ring's block kernels hold one head dim for q, k "
        "and v; call the module without context_parallel, or build it with v_head_dim=None (= head_dim)."
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        m(inputs(m), is_causal=True, context_parallel=object())


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(head_dim=16), r"head_dim=16 \(embed_dim // num_heads = 32 // 4 = 8\)"),
        (dict(head_dim=8, v_head_dim=12), r"v_head_dim=12 \(head_dim=8\)"),
        (dict(output_gate="headwise"), r"output_gate='headwise'"),
    ],
)
def test_check_refuses_what_its_reference_does_not_compute(kwargs, named):
    """attnlab check's float64 reference is 2017-style MHA: a module with these options is refused before any row
    runs, naming the option, instead of crashing mid-run or reading the option as a mistake."""
    from attnlab.check import run_checks
    from attnlab.check.projections import NotAttention

    with pytest.raises(NotAttention, match=rf"MultiHeadAttention has {named}, which attnlab check's float64 reference"):
        run_checks(MultiHeadAttention(32, 4, **kwargs))
