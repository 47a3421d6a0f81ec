"""MultiHeadLatentAttention (issue 41): both paths against the paper's equations in float64, against each other,
against Hugging Face's DeepseekV3Attention, with a latent cache, under every mask, and its errors.

Tiny shapes throughout: E=32, H=4, C=kv_lora_rank=16, N=qk_nope_head_dim=8, R=qk_rope_head_dim=4, Dv=6,
Q=q_lora_rank=12 (or None: one q_proj). Every weight, norm weight and bias is drawn at random, so that a
norm or a bias applied in the wrong place shows.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from attnlab import KVCache, MultiHeadAttention, MultiHeadLatentAttention
from attnlab.core import functional
from attnlab.core import mla as mla_module
from attnlab.core.mla import mla_reference, path_costs
from attnlab.core.mla_cache import MLACache
from attnlab.core.rope import rope_cos_sin
from conftest import assert_low_precision_close, make_masks

E, H, C, N, R, Dv, Q = 32, 4, 16, 8, 4, 6, 12
SHAPE = {"kv_lora_rank": C, "qk_nope_head_dim": N, "qk_rope_head_dim": R, "v_head_dim": Dv}
B, T = 2, 7
PATHS = ("naive", "absorbed")
BACKENDS = ("math", "sdpa")
Q_LORA = pytest.mark.parametrize("q_lora_rank", [None, Q], ids=["q_proj", "q_lora"])


def build(q_lora_rank=Q, *, dtype=torch.float32, seed=0, **kw) -> MultiHeadLatentAttention:
    """A module whose every parameter is random (norm weights around 1, biases around 0)."""
    torch.manual_seed(seed)
    kw = {"attention_bias": True, **kw}
    mla = MultiHeadLatentAttention(E, H, q_lora_rank=q_lora_rank, **SHAPE, **kw)
    with torch.no_grad():
        for name, p in mla.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 1 / math.sqrt(p.size(1)))
    return mla.to(dtype)


def inputs(dtype=torch.float32, *, batch=B, length=T, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, E, generator=g).to(dtype)
    rope = rope_cos_sin(torch.arange(length), R, dtype=dtype)  # (T, R) each
    return x, rope


def reference_masks(kw: dict) -> dict:
    """The forward's mask arguments as mla_reference's: bool keep, float bias, is_causal."""
    out: dict = {"is_causal": kw.get("is_causal", False)}
    mask = kw.get("attn_mask")
    if mask is not None:
        out["keep" if mask.dtype == torch.bool else "bias"] = mask
    if kw.get("key_padding_mask") is not None:
        not_pad = ~kw["key_padding_mask"][:, None, :]  # (B, 1, S)
        out["keep"] = not_pad if "keep" not in out else out["keep"] & not_pad
    return out


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


# -- the paper's equations -------------------------------------------------------------------------------
@Q_LORA
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", ["none", "bool", "float", "padding", "causal", "all"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
def test_each_path_is_the_paper_in_float32(q_lora_rank, path, backend, mask, interleave):
    """fp32 against the float64 equations to rounding: measured at most 9.1e-7 (outputs of size ~1-5)."""
    mla = build(q_lora_rank, path=path, backend=backend, rope_interleave=interleave)
    x, rope = inputs()
    kw = make_masks(mask, B, T, T)
    with torch.no_grad():
        got = mla(x, rope=rope, **kw)
        want = mla_reference(mla, x, rope=rope, **reference_masks(kw))
    assert mla.last_path == path
    assert max_err(got, want) < 4e-6


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_meets_flash_attentions_rule(path, dtype):
    """In fp16/bf16 each path's error against the float64 equations (on the same low-precision weights) is at
    most 2x that of the equations run plainly in that dtype, output and input gradient alike."""
    mla = build(dtype=dtype, path=path)
    x, rope = inputs(dtype)
    kw = make_masks("causal+padding", B, T, T)
    ref_kw = reference_masks(kw)

    def run(fn):
        xg = x.detach().clone().requires_grad_()
        out = fn(xg)
        out.float().pow(2).sum().backward()
        return out.detach(), xg.grad

    got, got_grad = run(lambda xg: mla(xg, rope=rope, **kw))
    plain, plain_grad = run(lambda xg: mla_reference(mla, xg, rope=rope, dtype=dtype, **ref_kw))
    want, want_grad = run(lambda xg: mla_reference(mla, xg, rope=rope, **ref_kw))
    assert_low_precision_close(got, plain, want, name=f"{path} {dtype} output")
    assert_low_precision_close(got_grad, plain_grad, want_grad, name=f"{path} {dtype} d/dx")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_in_float64(path, backend):
    """Both paths' gradients w.r.t. the input, kv_b_proj (W_UK, W_UV: what absorption rearranges) and q_b_proj."""
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(
        8, 2, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=3, q_lora_rank=5, path=path
    )
    mla = mla.double()
    mla.backend = backend
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    rope = rope_cos_sin(torch.arange(3), 2, dtype=torch.float64)
    names = ("kv_b_proj.weight", "q_b_proj.weight")
    weights = tuple(dict(mla.named_parameters())[n].detach().clone().requires_grad_() for n in names)

    def f(x, *ws):
        return torch.func.functional_call(
            mla, dict(zip(names, ws, strict=True)), (x,), {"rope": rope, "is_causal": True}
        )

    assert torch.autograd.gradcheck(f, (x, *weights))


@Q_LORA
@pytest.mark.parametrize("mask", ["none", "float", "causal+padding", "all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_naive_and_absorbed_agree_to_1e12_in_float64(q_lora_rank, mask, backend):
    """The two forms are one function: forward and every gradient (input, each weight) to 1e-12 in float64."""
    mla = build(q_lora_rank, dtype=torch.float64, backend=backend)
    x, rope = inputs(torch.float64)
    kw = make_masks(mask, B, T, T, dtype=torch.float64)
    results = {}
    for path in PATHS:
        mla.path = path
        mla.zero_grad()
        xg = x.clone().requires_grad_()
        out = mla(xg, rope=rope, **kw)
        out.pow(2).sum().backward()
        results[path] = (out.detach(), xg.grad, {n: p.grad.clone() for n, p in mla.named_parameters()})
    (out_n, dx_n, dw_n), (out_a, dx_a, dw_a) = results["naive"], results["absorbed"]
    assert max_err(out_n, out_a) < 1e-12
    assert max_err(dx_n, dx_a) < 1e-12
    assert dw_n.keys() == dw_a.keys() and len(dw_n) == (10 if q_lora_rank else 7)
    for name in dw_n:
        assert max_err(dw_n[name], dw_a[name]) < 1e-12, name


def test_the_scale_is_the_query_key_head_dim_on_both_paths(monkeypatch):
    """1/sqrt(N + R), the paper's d_h + d_R, even where the absorbed path's queries are C + R wide."""
    seen = []
    real_attend = mla_module.attend

    def spy(backend, q, k, v, masks, *, scale, **kw):
        seen.append((q.size(-1), v.size(-1), scale))
        return real_attend(backend, q, k, v, masks, scale=scale, **kw)

    monkeypatch.setattr(mla_module, "attend", spy)
    mla = build()
    x, rope = inputs()
    for path in PATHS:
        mla.path = path
        mla(x, rope=rope, is_causal=True)
    assert seen == [(N + R, Dv, 1 / math.sqrt(N + R)), (C + R, C, 1 / math.sqrt(N + R))]


# -- the cache ---------------------------------------------------------------------------------------------
def decode(mla, x, chunks, *, mode, max_len=T):
    """``x`` fed chunk by chunk through ``mla`` with an MLACache; the outputs and the paths taken."""
    cache = MLACache.for_module(mla, x.size(0), max_len)
    outs, paths, start = [], [], 0
    for size in chunks:
        positions = torch.arange(start, start + size)
        kw = {"cache_positions": positions} if mode == "positions" else {}
        rope = rope_cos_sin(positions, R, dtype=x.dtype)
        outs.append(mla(x[:, start : start + size], rope=rope, kv_cache=cache, is_causal=True, **kw))
        paths.append(mla.last_path)
        start += size
    return torch.cat(outs, dim=1), paths, cache


@pytest.mark.parametrize("path", [*PATHS, "auto"])
@pytest.mark.parametrize("mode", ["append", "positions"])
@pytest.mark.parametrize("chunks", [(1,) * 7, (4, 1, 1, 1), (3, 4)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decode_equals_recomputation(path, mode, chunks, backend):
    mla = build(path=path, backend=backend)
    x, rope = inputs()
    with torch.no_grad():
        full = mla_reference(mla, x, rope=rope, is_causal=True)
        cached, _, cache = decode(mla, x, chunks, mode=mode)
    assert max_err(cached, full) < 4e-6
    assert cache.length == (T if mode == "append" else 0)


def test_auto_prefills_naive_and_decodes_absorbed_from_one_cache():
    """The cache holds latents, so one path may write it and the other read it: prefill 14 tokens, decode 2."""
    mla = build()
    x, rope = inputs(length=16)
    with torch.no_grad():
        full = mla_reference(mla, x, rope=rope, is_causal=True)
        cached, paths, _ = decode(mla, x, (14, 1, 1), mode="append", max_len=16)
    assert paths == ["naive", "absorbed", "absorbed"]
    assert max_err(cached, full) < 4e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cache_bytes_per_token_are_the_latent_and_the_rope_key(dtype):
    mla = build(dtype=dtype)
    cache = MLACache.for_module(mla, 3, 8)
    itemsize = torch.empty((), dtype=dtype).element_size()
    assert cache.bytes_per_token == (C + R) * itemsize
    assert cache.latent.shape == (3, 8, C) and cache.rope_key.shape == (3, 8, R)
    assert cache.latent.data_ptr() == cache.kv.data_ptr()  # views of the one buffer


def test_deepseek_v3_caches_576_values_a_token():
    """V3's shapes: 576 bf16 values (1152 bytes) per token and layer, against 2 x 128 heads x 192 for MHA's cache."""
    v3 = MLACache(1, 4, 512, 64, dtype=torch.bfloat16)
    assert v3.bytes_per_token == 576 * 2 == 1152
    assert KVCache(1, 4, 128, 192, dtype=torch.bfloat16).bytes_per_token == 2 * 128 * 192 * 2  # 85x more


def test_cache_reads_its_rows_where_it_wrote_them():
    mla = build()
    x, rope = inputs()
    cache = MLACache.for_module(mla, B, 10)
    with torch.no_grad():
        mla(
            x[:, :3],
            rope=(rope[0][:3], rope[1][:3]),
            kv_cache=cache,
            cache_positions=torch.tensor([5, 6, 7]),
            is_causal=True,
        )
        compressed = mla.kv_a_proj_with_mqa(x[:, :3])  # (B, 3, C + R)
    torch.testing.assert_close(cache.latent[:, 5:8], mla.kv_a_layernorm(compressed[..., :C]))
    assert cache.kv[:, :5].abs().sum() == 0 and cache.kv[:, 8:].abs().sum() == 0


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_decode_step_compiles_fullgraph(path):
    """Position mode: fixed shapes, one graph for every step, no graph break, the eager result."""
    torch._dynamo.reset()
    mla = build(path=path).eval()
    x, rope = inputs(batch=1)
    cache = MLACache.for_module(mla, 1, T)

    def step(tok, pos, cos, sin):
        return mla(tok, rope=(cos, sin), kv_cache=cache, cache_positions=pos, is_causal=True)

    compiled = torch.compile(step, fullgraph=True)
    counters.clear()
    with torch.no_grad():
        full = mla(x, rope=rope, is_causal=True)
        outs = [compiled(x[:, i : i + 1], torch.tensor([i]), rope[0][i : i + 1], rope[1][i : i + 1]) for i in range(T)]
    assert max_err(torch.cat(outs, 1), full) < 4e-6
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_a_compiled_one_query_step_returns_values_of_their_own_width():
    """What a compiled CPU decode step runs instead of SDPA (attnlab.core.functional.one_query_attention) keeps
    V's width when it differs from Q's and K's (the naive path: N + R against Dv); it once assumed they agree."""
    q, k = torch.randn(2, 4, 1, N + R), torch.randn(2, 4, 5, N + R)
    v = torch.randn(2, 4, 5, Dv)
    got = functional.one_query_attention(q, k, v, None, 0.3)  # (B, H, 1, Dv)
    want, _ = functional.math_attention(q, k, v, scale=0.3)
    assert got.shape == (2, 4, 1, Dv) and max_err(got, want) < 1e-6


# -- masks -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_invariance(path, backend):
    """Whatever the padded tokens hold (here NaN), the real tokens' outputs are the same."""
    mla = build(path=path, backend=backend)
    x, rope = inputs()
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True
    other = x.clone()
    other[0, -2:] = float("nan")
    with torch.no_grad():
        a = mla(x, rope=rope, key_padding_mask=pad)
        b = mla(other, rope=rope, key_padding_mask=pad)
    real = ~pad
    assert torch.equal(a[real], b[real])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_causal_leak(path, backend):
    """Changing token 4 changes nothing before it, and no gradient flows back from earlier outputs into it."""
    mla = build(path=path, backend=backend)
    x, rope = inputs()
    changed = x.clone()
    changed[:, 4] += 10.0
    with torch.no_grad():
        a, b = mla(x, rope=rope, is_causal=True), mla(changed, rope=rope, is_causal=True)
    assert torch.equal(a[:, :4], b[:, :4]) and not torch.equal(a[:, 4], b[:, 4])
    xg = x.clone().requires_grad_()
    mla(xg, rope=rope, is_causal=True)[:, :4].sum().backward()
    assert torch.equal(xg.grad[:, 4:], torch.zeros_like(xg.grad[:, 4:]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fully_masked_row_gives_the_output_bias_and_finite_gradients(path, backend):
    mla = build(path=path, backend=backend)
    x, rope = inputs()
    keep = torch.rand(B, T, T) > 0.3
    keep[..., 0] = True
    keep[1, 2] = False  # query 2 of sequence 1 may see no key
    xg = x.clone().requires_grad_()
    out = mla(xg, rope=rope, attn_mask=keep)
    assert torch.equal(out[1, 2], mla.o_proj.bias)
    out.sum().backward()
    assert all(torch.isfinite(t).all() for t in (xg.grad, *(p.grad for p in mla.parameters())))
    with torch.no_grad():
        want = mla_reference(mla, x, rope=rope, keep=keep)
    assert max_err(out, want) < 4e-6


# -- Hugging Face's DeepseekV3Attention --------------------------------------------------------------------
def hf_attention(q_lora_rank, interleave):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    config = transformers.DeepseekV3Config(
        hidden_size=E,
        num_attention_heads=H,
        num_key_value_heads=H,
        q_lora_rank=q_lora_rank,
        rope_interleave=interleave,
        attention_bias=True,
        vocab_size=16,
        intermediate_size=16,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        **SHAPE,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    attention = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in attention.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "layernorm" in name else 0.3 * torch.randn_like(p))
    return attention, hf.DeepseekV3RotaryEmbedding(config)


@Q_LORA
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("path", PATHS)
def test_matches_hugging_faces_deepseek_v3_attention(q_lora_rank, interleave, path):
    """HF's state dict loads as it is (same module names); outputs agree to fp32 rounding: measured at most
    1.3e-6 on outputs up to 5.5 (2.9e-7 of the largest)."""
    theirs, rotary = hf_attention(q_lora_rank, interleave)
    ours = MultiHeadLatentAttention(
        E, H, q_lora_rank=q_lora_rank, rope_interleave=interleave, attention_bias=True, path=path, **SHAPE
    )
    ours.load_state_dict(theirs.state_dict())  # strict: every name matches
    x, _ = inputs()
    cos, sin = rotary(x, torch.arange(T)[None].expand(B, T))  # (B, T, R) each
    causal = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T)  # HF's additive 4-D mask
    with torch.no_grad():
        want, _ = theirs(x, (cos, sin), causal)
        got = ours(x, rope=(cos, sin), is_causal=True)
    assert max_err(got, want) < 1e-6 * want.abs().max().item()


# -- path="auto" ---------------------------------------------------------------------------------------------
def test_auto_picks_by_counting_multiply_adds_and_says_why():
    mla = build()
    x, rope = inputs(length=16)
    cache = MLACache.for_module(mla, B, 17)
    with torch.no_grad():
        mla(x, rope=rope, kv_cache=cache, is_causal=True)
        assert (mla.last_path, mla.last_backend) == ("naive", "sdpa")
        assert mla.last_backend_reason == (
            "auto: naive, T_q=16 over T_k=16 keys: 0.0512M multiply-adds absorbed, 0.0328M naive "
            "(absorbed attends 20 channels wide instead of 12, for each of the 16 queries)"
        )
        step = rope_cos_sin(torch.tensor([16]), R)
        mla(x[:, :1], rope=step, kv_cache=cache)
        assert mla.last_path == "absorbed"
        assert mla.last_backend_reason == (
            "auto: absorbed, T_q=1 over T_k=17 keys: 0.00334M multiply-adds absorbed, 0.0165M naive "
            "(naive expands all 17 latents through kv_b_proj; absorbed only the queries)"
        )
    mla.path = "naive"
    mla.backend = "math"
    mla(x, rope=rope)
    assert (mla.last_path, mla.last_backend, mla.last_backend_reason) == ("naive", "math", "path='naive' was requested")


def test_auto_reports_how_sdpa_was_adapted():
    mla = build(dtype=torch.bfloat16, path="absorbed")
    x, rope = inputs(torch.bfloat16)
    mla(x, rope=rope)
    assert mla.last_backend_reason == (
        "path='absorbed' was requested; cpu torch.bfloat16: SDPA computed in float32 (faster and more exact on CPU)"
    )


@pytest.mark.parametrize("S", [512, 4096, 32768])
def test_path_costs_turn_where_the_formula_says(S):
    """Absorbed is cheaper below T_q = S C (N+Dv) / (S (2C - N - Dv) + C (N+Dv)) queries (V3: 128 at S=512,
    164 at 4096, 171 for a long cache), naive above; a decode step costs absorbed ~60x less at V3's shapes."""
    v3 = {"heads": 128, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    turn = S * 512 * 256 / (S * (1024 - 256) + 512 * 256)
    naive, absorbed = path_costs(1, S, **v3)
    assert absorbed < naive / 60
    naive, absorbed = path_costs(math.floor(turn), S, **v3)
    assert absorbed <= naive
    naive, absorbed = path_costs(math.floor(turn) + 1, S, **v3)
    assert absorbed > naive


# -- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"kv_lora_rank": 0}, ValueError, "kv_lora_rank must be a positive int (DeepSeek-V3 uses 512), got 0."),
        ({"kv_lora_rank": 16.0}, ValueError, "kv_lora_rank must be a positive int (DeepSeek-V3 uses 512), got 16.0."),
        (
            {"qk_rope_head_dim": 5},
            ValueError,
            "qk_rope_head_dim=5 is odd; rotary embeddings rotate channel pairs, so it must be even "
            "(DeepSeek-V3 uses 64): choose 4 or 6.",
        ),
        (
            {"q_lora_rank": 0},
            ValueError,
            "q_lora_rank must be a positive int or None (one q_proj) (DeepSeek-V3 uses 1536), got 0.",
        ),
        ({"v_head_dim": -1}, ValueError, "v_head_dim must be a positive int (DeepSeek-V3 uses 128), got -1."),
        (
            {"path": "foo"},
            ValueError,
            "path must be one of ('auto', 'naive', 'absorbed'), got 'foo': 'naive' expands the latents into "
            "per-head keys and values (prefill), 'absorbed' attends over the latents themselves (decode), "
            "'auto' picks per call.",
        ),
        (
            {"backend": "flex"},
            ValueError,
            "backend must be one of ('auto', 'math', 'sdpa') for MultiHeadLatentAttention, got 'flex'.",
        ),
        (
            {"scale": 0.0},
            ValueError,
            "scale must be a positive float (default 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = 0.2887), got 0.0.",
        ),
        (
            {"norm_eps": 0},
            ValueError,
            "norm_eps must be a positive float (the RMSNorms' epsilon, 1e-6 in DeepSeek-V3), got 0.",
        ),
        ({"rope_interleave": "yes"}, TypeError, "rope_interleave must be True or False, got 'yes' (str)."),
    ],
)
def test_constructor_errors(kw, error, message):
    with pytest.raises(error) as info:
        MultiHeadLatentAttention(E, H, **{**SHAPE, **kw})
    assert str(info.value) == message


def test_forward_errors():
    mla = build()
    x, rope = inputs()

    def message(error, *args, **kw):
        with pytest.raises(error) as info:
            mla(*args, **kw)
        return str(info.value)

    assert message(ValueError, x[..., :16]) == (
        "hidden_states must be a floating tensor (B, T, hidden_size=32), got shape (2, 7, 16), torch.float32; "
        "MLA is batch-first self-attention (add a batch dimension with .unsqueeze(0) to a (T, 32) input)."
    )
    assert message(ValueError, x.double()) == (
        "hidden_states is torch.float64 on cpu but the module's weights are torch.float32 on cpu; move one of them: "
        "hidden_states.to('cpu', torch.float32) or mla.to(...)."
    )
    mha_cache = KVCache.for_module(MultiHeadAttention(E, H), B, 8)
    assert message(TypeError, x, kv_cache=mha_cache) == (
        "kv_cache must be an MLACache (one row of kv_lora_rank + qk_rope_head_dim values per token), got KVCache; "
        "build one with MLACache.for_module(mla, batch_size, max_len)."
    )
    assert message(ValueError, x, rope=rope_cos_sin(torch.arange(T), N + R)) == (
        "rope cos/sin have shape (7, 12); expected (T, qk_rope_head_dim) = (7, 4) or (B, T, 4): MLA rotates only "
        "the R rotary channels, so build them with rope_cos_sin(positions, 4)."
    )
    assert message(ValueError, x, cache_positions=torch.arange(T)) == (
        "cache_positions was given without kv_cache; it names slots of an MLACache, pass kv_cache=... too."
    )
    cache = MLACache.for_module(mla, B, 8)
    mla(x, rope=rope, kv_cache=cache, is_causal=True)
    assert message(ValueError, x[:, :2], kv_cache=cache, is_causal=True) == (
        "kv_cache overflow: 7 slots are filled and this call appends 2, but max_len=8; build the cache with "
        "max_len >= 9 or call reset()."
    )
    assert message(ValueError, x[:, :1], kv_cache=cache, cache_positions=torch.tensor([8]), is_causal=True) == (
        "kv_cache overflow: cache_positions span [8, 8] but max_len=8; build the cache with max_len >= 9."
    )
    assert message(ValueError, x[:1, :1], kv_cache=cache) == (
        "kv_cache was built for batch size 2 but this call has batch size 1; build a cache with "
        "MLACache.for_module(mla, batch_size=1, max_len=...)."
    )
    assert message(ValueError, x[:, :1], kv_cache=cache, cache_positions=torch.tensor([7])) == (
        "cache_positions was given with is_causal=False; position mode attends over the whole cache buffer and "
        "relies on the causal mask to hide unwritten slots: pass is_causal=True."
    )
    mla.kv_b_proj = nn.Sequential(mla.kv_b_proj)
    assert message(ValueError, x) == (
        "kv_b_proj is a Sequential; both MLA paths read its weight (H*(N+Dv), C) = (56, 16) as the matrices W_UK "
        "and W_UV, so it must be an nn.Linear without bias: merge an adapter into it (peft's merge_and_unload) "
        "before calling the module."
    )


def test_the_module_says_its_shape():
    mla = build(None, path="absorbed")
    assert mla.extra_repr() == (
        "hidden_size=32, num_heads=4, kv_lora_rank=16, q_lora_rank=None, "
        "qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, path='absorbed', backend='auto'"
    )
    assert MLACache.for_module(mla, 2, 5).extra_repr() == (
        "batch_size=2, max_len=5, kv_lora_rank=16, qk_rope_head_dim=4, dtype=torch.float32, length=0"
    )
