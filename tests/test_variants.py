"""The attention variants (window, softcap, ALiBi, sinks, QK-norm, packed documents) against references
written independently of attnlab.core.variants: explicit masks on the plain module, formulas in float64,
Hugging Face BLOOM's ALiBi slopes, and each packed document run on its own."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab import MultiHeadAttention
from attnlab.core.attention import BAND_MIN_TOKENS
from attnlab.core.kv_cache import RollingKVCache
from attnlab.core.variants import alibi_slopes

E, H = 32, 4


def module(seed: int = 0, dtype=torch.float64, device: torch.device | str = "cpu", **kw) -> MultiHeadAttention:
    """Weights drawn on the CPU, so that every device gets the same module."""
    torch.manual_seed(seed)
    m = MultiHeadAttention(E, H, **kw).to(dtype).eval()
    if m.sinks is not None:
        with torch.no_grad():
            m.sinks.normal_()  # zeros at init would hide a wrong sign
    return m.to(device)


def randn(*shape: int, dtype=torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype).to(device)


def reference(m: MultiHeadAttention, x, *, keep=None, bias=None, softcap=None, sinks=None):
    """Attention written out in float64 from the module's own projections."""
    B, T, _ = x.shape
    G, D = m.num_kv_heads, m.head_dim
    q = m.q_proj(x).view(B, T, H, D).transpose(1, 2)
    k = m.k_proj(x).view(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    v = m.v_proj(x).view(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        e = torch.exp(s - s.amax(-1, keepdim=True))
        sink = torch.exp(sinks[None, :, None, None] - s.amax(-1, keepdim=True))
        w = e / (e.sum(-1, keepdim=True) + sink)
    else:
        w = torch.softmax(s, -1)
    ctx = (w @ v).transpose(1, 2).reshape(B, T, E)
    return m.out_proj(ctx)


def causal(T, device="cpu"):
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def window_keep(T, W, device="cpu"):
    i, j = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None, :]
    return (j <= i) & (i - j < W)


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("G", [4, 2, 1])
def test_window_equals_an_explicit_band_mask(backend, G, device_with_float64):
    device = device_with_float64
    m = module(num_kv_heads=G, window=5, backend=backend, device=device)
    x = randn(2, 17, E, device=device)
    want = reference(m, x, keep=window_keep(17, 5, device))
    torch.testing.assert_close(m(x, is_causal=True), want)
    plain = module(num_kv_heads=G, device=device)  # same seed, same weights: the plain module, the band as a mask
    torch.testing.assert_close(plain(x, attn_mask=window_keep(17, 5, device)), want)


def test_window_larger_than_the_sequence_is_plain_causal(device_with_float64):
    m, plain = module(window=100, device=device_with_float64), module(device=device_with_float64)
    x = randn(1, 20, E, device=device_with_float64)
    torch.testing.assert_close(m(x, is_causal=True), plain(x, is_causal=True))


@pytest.mark.parametrize("backend", ["math", "auto"])
def test_softcap_equals_the_formula(backend, device_with_float64):
    m = module(softcap=2.0, backend=backend, device=device_with_float64)
    x = 3 * randn(2, 11, E, device=device_with_float64)  # large scores, so the cap bites
    want = reference(m, x, keep=causal(11, device_with_float64), softcap=2.0)
    torch.testing.assert_close(m(x, is_causal=True), want)
    assert m.last_backend == "math" or backend == "math"


def test_alibi_slopes_match_bloom_for_every_head_count():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for heads in (1, 2, 3, 4, 6, 8, 12, 16, 20, 32):
        alibi = bloom.build_alibi_tensor(torch.ones(1, 4), heads, torch.float32)  # (heads, 1, 4): slope * position
        torch.testing.assert_close(alibi_slopes(heads), alibi[:, 0, 1])
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-k for k in range(1, 9)]))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("G", [4, 2])
def test_alibi_equals_an_explicit_bias(backend, G, device_with_float64):
    device = device_with_float64
    m = module(num_kv_heads=G, alibi=True, backend=backend, device=device)
    T = 13
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    bias = (-alibi_slopes(H).double()[:, None, None] * (i - j).abs()).to(device)  # (H, T, T)
    x = randn(2, T, E, device=device)
    torch.testing.assert_close(m(x, is_causal=True), reference(m, x, keep=causal(T, device), bias=bias[None]))
    torch.testing.assert_close(m(x), reference(m, x, bias=bias[None]))  # bidirectional too


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("G", [4, 1])
def test_sinks_add_a_term_to_the_softmax_denominator(backend, G, device_with_float64):
    m = module(num_kv_heads=G, sinks=True, backend=backend, device=device_with_float64)
    x = randn(2, 9, E, device=device_with_float64)
    want = reference(m, x, keep=causal(9, device_with_float64), sinks=m.sinks)
    torch.testing.assert_close(m(x, is_causal=True), want)
    m.backend = "math"
    _, w = m(x, is_causal=True, need_weights=True)
    assert torch.all(w.sum(-1) < 1)  # the sink takes a share of every row


def test_sinks_and_a_fully_masked_row_give_zeros_not_nan(device_with_float64):
    m = module(sinks=True, device=device_with_float64)
    x = randn(2, 6, E, device=device_with_float64)
    pad = torch.zeros(2, 6, dtype=torch.bool, device=device_with_float64)
    pad[1] = True  # every key of row 1 is padding
    for backend in ("math", "sdpa"):
        m.backend = backend
        out = m(x, key_padding_mask=pad)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[1], m.out_proj.bias.expand(6, E))


@pytest.mark.parametrize("mode", ["head", "full"])
def test_qk_norm_normalises_q_and_k(mode, device_with_float64):
    m = module(qk_norm=mode, num_kv_heads=2)
    with torch.no_grad():
        m.q_norm.weight.uniform_(0.5, 1.5)
        m.k_norm.weight.uniform_(0.5, 1.5)
    m = m.to(device_with_float64)
    x = randn(2, 7, E, device=device_with_float64)
    B, T, D, G = 2, 7, m.head_dim, 2

    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    q, k, v = m.q_proj(x), m.k_proj(x), m.v_proj(x)
    if mode == "full":
        q, k = rms(q, m.q_norm.weight), rms(k, m.k_norm.weight)
    q = q.view(B, T, H, D).transpose(1, 2)
    k = k.view(B, T, G, D).transpose(1, 2)
    if mode == "head":
        q, k = rms(q, m.q_norm.weight), rms(k, m.k_norm.weight)
    k, v = k.repeat_interleave(2, 1), v.view(B, T, G, D).transpose(1, 2).repeat_interleave(2, 1)
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, E)
    torch.testing.assert_close(m(x, is_causal=True), m.out_proj(ctx))
    assert m.q_norm.weight.shape == ((D,) if mode == "head" else (E,))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_packed_documents_equal_each_document_alone(backend, device_with_float64):
    m = module(backend=backend, num_kv_heads=2, alibi=True, window=4, device=device_with_float64)
    lengths = [5, 1, 7, 3]
    x = randn(1, sum(lengths), E, device=device_with_float64)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].to(device_with_float64)
    packed = m(x, is_causal=True, document_ids=ids)
    alone, start = [], 0
    for n in lengths:
        alone.append(m(x[:, start : start + n], is_causal=True))
        start += n
    torch.testing.assert_close(packed, torch.cat(alone, 1))


def test_all_variants_together_pass_gradcheck_in_float64(device_with_float64):
    device = device_with_float64
    m = module(
        num_kv_heads=2, window=3, softcap=4.0, alibi=True, sinks=True, qk_norm=True, backend="math", device=device
    )
    x = randn(1, 6, E, device=device).requires_grad_()
    ids = torch.tensor([[0, 0, 0, 0, 1, 1]], device=device)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True, document_ids=ids), (x,))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "kw", [{"window": 4}, {"alibi": True}, {"sinks": True}, {"window": 3, "alibi": True, "sinks": True}]
)
@pytest.mark.parametrize("G", [4, 2])
def test_sdpa_backend_matches_the_math_reference(kw, G, dtype, tol, device):
    m = module(num_kv_heads=G, dtype=dtype, device=device, **kw)
    x = randn(2, 19, E, dtype=dtype, device=device)
    m.backend = "math"
    want = m(x, is_causal=True).float()
    m.backend = "sdpa"
    torch.testing.assert_close(m(x, is_causal=True).float(), want, atol=tol, rtol=tol)


def test_long_windows_run_on_key_bands_without_a_dense_mask():
    T = BAND_MIN_TOKENS + 37  # not a multiple of the block size
    m = module(dtype=torch.float32, window=40, num_kv_heads=2, sinks=True)
    x = torch.randn(1, T, E)
    out = m(x, is_causal=True)
    assert m.last_backend == "sdpa-band" and "band" in m.last_backend_reason
    m.backend = "math"
    torch.testing.assert_close(out, m(x, is_causal=True), atol=1e-5, rtol=1e-5)


def test_rolling_cache_decodes_exactly_with_memory_bounded_by_the_window(device_with_float64):
    device = device_with_float64
    m = module(window=6, num_kv_heads=2, alibi=True, sinks=True, device=device)
    x = randn(2, 40, E, device=device)
    full = m(x, is_causal=True)
    cache = RollingKVCache.for_module(m, 2)
    assert cache.k.shape == (2, 2, 6, m.head_dim)  # 6 slots, whatever the sequence length
    outs = [m(x[:, :15], is_causal=True, kv_cache=cache, cache_positions=torch.arange(15, device=device))]
    for t in range(15, 40):
        positions = torch.tensor([t], device=device)
        outs.append(m(x[:, t : t + 1], is_causal=True, kv_cache=cache, cache_positions=positions))
    torch.testing.assert_close(torch.cat(outs, 1), full)


@pytest.mark.slow
def test_rolling_cache_decode_step_compiles_once(device):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = module(dtype=torch.float32, window=8, num_kv_heads=2, device=device)
    cache = RollingKVCache.for_module(m, 1)
    x = randn(1, 30, E, dtype=torch.float32, device=device)
    ref = m(x, is_causal=True)

    def step(xt, pos):
        return m(xt, is_causal=True, kv_cache=cache, cache_positions=pos)

    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        outs = [m(x[:, :4], is_causal=True, kv_cache=cache, cache_positions=torch.arange(4, device=device))]
        outs += [compiled(x[:, t : t + 1], torch.tensor([t], device=device)) for t in range(4, 30)]
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    "kwargs,call,message",
    [
        ({"window": 0}, {}, r"window must be a positive int"),
        ({"softcap": -1.0}, {}, r"softcap must be a positive float"),
        ({"alibi": 1}, {}, r"alibi must be True or False"),
        ({"qk_norm": "layer"}, {}, r"qk_norm must be False, True or 'head'"),
        (
            {"window": 4},
            {"is_causal": False},
            r"window=4 is a causal sliding window .* call the module with is_causal=True",
        ),
        (
            {"softcap": 5.0, "backend": "sdpa"},
            {"is_causal": True},
            r"softcap=5.0 applies tanh .* use backend='auto', 'math' or 'flex'",
        ),
        ({"alibi": True}, {"document_ids": torch.zeros(2, 5)}, r"document_ids must be an integer tensor"),
        (
            {"alibi": True},
            {"document_ids": torch.zeros(2, 4, dtype=torch.long)},
            r"document_ids has shape \(2, 4\); expected \(B, T\) = \(2, 5\)",
        ),
    ],
)
def test_variant_errors_name_the_argument_and_the_fix(kwargs, call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        m = module(**kwargs)
        m(torch.randn(2, 5, E, dtype=torch.float64), **call)


def test_rolling_cache_refuses_a_module_with_a_wider_window():
    m = module(window=8)
    cache = RollingKVCache(1, 4, H, m.head_dim, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"RollingKVCache of 4 slots serves a sliding-window layer with window <= 4"):
        m(torch.randn(1, 1, E, dtype=torch.float64), is_causal=True, kv_cache=cache, cache_positions=torch.tensor([0]))


def test_variants_show_in_repr_and_state_dict():
    m = module(window=8, softcap=30.0, alibi=True, sinks=True, qk_norm=True)
    text = repr(m)
    for part in ("window=8", "softcap=30.0", "alibi=True", "sinks=True", "qk_norm='head'"):
        assert part in text
    keys = set(m.state_dict())
    assert {"sinks", "q_norm.weight", "k_norm.weight"} <= keys and "alibi_slopes" not in keys


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_tinygpt_packed_row_gives_each_document_its_own_logits(position, device):
    from attnlab import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32, position=position))
    model = model.eval().to(device)
    lengths = [6, 3, 9]
    idx = torch.randint(0, 50, (1, sum(lengths))).to(device)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None].to(device)
    with torch.no_grad():
        packed = model(idx, document_ids=ids)
        alone = torch.cat([model(part) for part in idx.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_document_positions_restart_at_each_document():
    from attnlab.core.variants import document_positions

    ids = torch.tensor([[7, 7, 7, 2, 2, 7], [0, 1, 1, 1, 1, 1]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]


def test_trace_shows_each_variant_as_a_stage(capsys):
    from attnlab.cli import main

    argv = ["trace", "--causal", "--window", "4", "--softcap", "30", "--alibi", "--sinks", "--json"]
    assert main([*argv, "--seq-len", "6", "--embed-dim", "16", "--num-heads", "2"]) == 0
    import json

    stages = [row["stage"] for row in json.loads(capsys.readouterr().out)[0]["rows"]]
    order = [
        "scale by 1/sqrt(d) = 0.3536",
        "softcap: scores / 30",
        "softcap: tanh",
        "softcap: 30 * tanh(scores / 30)",
        "add ALiBi bias -m_h |i - j|",
        "mask: causal + window 4 (before softmax)",
        "sinks: append each head's sink logit",
        "softmax over keys",
        "sinks: drop the sink's share",
    ]
    assert [s for s in stages if s in order] == order
    assert main(["trace", "--window", "4"]) == 2
    assert "--window 4 is a causal sliding window; add --causal." in capsys.readouterr().err


@pytest.mark.parametrize("case", ["plain", "alibi", "sinks", "documents", "padding", "pair_mask"])
def test_banded_sdpa_equals_the_reference_values_and_gradients(case):
    """The batched key bands (one SDPA call, gathered bands) against the math reference, blocks not
    dividing T; a user mask over (query, key) pairs takes the block-by-block path."""
    from attnlab.core.masks import Masks
    from attnlab.core.variants import Structure, banded_sdpa, variant_math

    torch.manual_seed(0)
    B, H, G, T, W = 2, 4, 2, 150, 23
    q, k, v = (torch.randn(B, n, T, 8, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    pos = torch.arange(T)
    extra: dict = {}
    masks = Masks()
    if case == "alibi":
        extra["alibi"] = alibi_slopes(H).double()
    if case == "sinks":
        extra["sinks"] = torch.randn(H, dtype=torch.float64)
    if case == "documents":
        docs = torch.randint(0, 4, (B, T)).sort(dim=1).values
        extra.update(q_doc=docs, k_doc=docs)
    if case == "padding":
        keep = torch.ones(B, 1, 1, T, dtype=torch.bool)
        keep[0, ..., :9] = False  # the first 9 keys of row 0 are padding: its first queries see nothing
        masks = Masks(keep=keep)
    if case == "pair_mask":
        masks = Masks(keep=torch.rand(1, 1, T, T) > 0.2)
    st = Structure(pos, pos, True, W, **extra)
    up = torch.randn(B, H, T, 8, dtype=torch.float64)
    got = banded_sdpa(q, k, v, masks, st, scale=0.3, block=32)
    want = variant_math(q, k, v, masks, st, scale=0.3)[0]
    torch.testing.assert_close(got, want)
    for a, b in zip(
        torch.autograd.grad((got * up).sum(), (q, k, v)), torch.autograd.grad((want * up).sum(), (q, k, v)), strict=True
    ):
        torch.testing.assert_close(a, b)


def test_an_id_that_comes_back_starts_a_new_document():
    """[0, 0, 1, 0]: the last token is a third document, not the first one again (as its position restarts)."""
    from attnlab.core.variants import document_runs

    assert document_runs(torch.tensor([[7, 7, 2, 7]])).tolist() == [[0, 0, 1, 2]]
    m = module(window=8)
    x = torch.randn(1, 7, E, dtype=torch.float64)
    ids = torch.tensor([[0, 0, 0, 1, 1, 0, 0]])
    packed = m(x, is_causal=True, document_ids=ids)
    alone = torch.cat([m(part, is_causal=True) for part in x.split([3, 2, 2], dim=1)], dim=1)
    torch.testing.assert_close(packed, alone)
