"""KVCache(dtype=float16 / bfloat16 / int8): the rounding it claims, the PyTorch paths through it, and the C++
one-query decode kernel that reads it in its own bytes (attnlab_quant::decode_attention, llama_decode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab import KVCache, MultiHeadAttention
from attnlab.core.kv_cache import (
    CPU_FUSED_FLOAT16_MAX_BYTES,
    CPU_FUSED_KV_DTYPE,
    CPU_FUSED_LONG_KV_DTYPE,
    INT8_BLOCK,
    RollingKVCache,
    dequantize_int8,
    kv_cache_bytes,
    kv_cache_choice,
    kv_values_per_position,
    quantize_int8,
    resolve_kv_dtype,
)
from attnlab.quant.kernels import decode_attention, kernel_status

KERNELS = kernel_status().available
FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# int8 against the float32 cache, attention output error over max |output| (measured, random keys/values of unit
# scale, D = 32..128, 1-2048 slots, 20 seeds: at most 0.0125 with the query in float32, 0.0203 with the query
# rounded to int8 as the AVX-512 VNNI kernel does; RoPE'd SmolLM2 keys are of the same order per block)
INT8_OUTPUT_BOUND = 0.025


def _cache_of(k: torch.Tensor, v: torch.Tensor, dtype: str) -> KVCache:
    """A cache of ``dtype`` storage holding ``k, v (B, G, S, D)`` float32 in all its slots (append mode)."""
    B, G, S, D = k.shape
    cache = KVCache(B, S, G, D, dtype=dtype, compute_dtype=torch.float32)
    cache.update(k, v)
    return cache


def _isas() -> list[int]:
    return sorted(
        {0, 1, int(torch.ops.attnlab_quant.cpu_isa())} & set(range(int(torch.ops.attnlab_quant.cpu_isa()) + 1))
    )


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, pad: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """float64 SDPA of one query per head ``q (B, H, D)`` over slots ``[0, n)`` of float ``k, v (B, G, S, D)``."""
    rep = q.size(1) // k.size(1)
    kk = k[:, :, :n].double().repeat_interleave(rep, 1)  # (B, H, n, D)
    vv = v[:, :, :n].double().repeat_interleave(rep, 1)
    mask = None if pad is None else ~pad[:, None, None, :n]  # (B, 1, 1, n): True = may attend
    out = F.scaled_dot_product_attention(q[:, :, None].double(), kk, vv, attn_mask=mask, scale=scale)
    return out[:, :, 0]  # (B, H, D)


# -- the cache --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 20])
def test_int8_rounds_each_value_to_half_its_block_scale(D):
    x = torch.randn(2, 3, 5, D) * torch.logspace(-3, 2, D)  # channels of very different sizes
    q, scale = quantize_int8(x, INT8_BLOCK if D % INT8_BLOCK == 0 else D)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 5, D // (INT8_BLOCK if D % 32 == 0 else D))
    back = dequantize_int8(q, scale, torch.float32)
    per_value = scale.repeat_interleave(D // scale.size(-1), -1)  # (2, 3, 5, D)
    assert ((back - x).abs() <= per_value / 2 * (1 + 1e-6)).all()
    assert (q.abs() <= 127).all() and (q.abs().amax(-1) == 127).all()  # the block's largest value is +-127
    zero_q, zero_scale = quantize_int8(torch.zeros(1, D), D)
    assert (zero_q == 0).all() and (zero_scale == 0).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("mode", ["append", "positions"])
def test_reads_give_the_rounded_values_back_in_the_compute_dtype(dtype, mode):
    k, v = torch.randn(2, 3, 7, 64), torch.randn(2, 3, 7, 64)
    cache = KVCache(2, 9, 3, 64, dtype=dtype, compute_dtype=torch.float32)
    if mode == "append":
        keys, values = cache.update(k, v)
    else:
        keys, values = cache.update(k, v, cache_positions=torch.arange(2, 9))
        keys, values = keys[:, :, 2:], values[:, :, 2:]
    assert keys.dtype == values.dtype == torch.float32 and keys.shape == (2, 3, 7, 64)
    if dtype == "int8":
        want_k = dequantize_int8(*quantize_int8(k, INT8_BLOCK), torch.float32)
        assert cache.k.dtype == torch.int8 and cache.k_scale is not None and cache.k_scale.shape == (2, 3, 9, 2)
    else:
        want_k = k.to(FLOATS.get(dtype, torch.float32)).float()
    assert torch.equal(keys, want_k)
    assert (values - v).abs().max() <= (0.0 if dtype == "float32" else 0.02 * v.abs().max())


def test_bytes_per_token_follow_the_storage():
    sizes = {d: KVCache(1, 4, 3, 64, dtype=d).bytes_per_token for d in ("float32", "float16", "bfloat16", "int8")}
    # K and V, 3 heads of 64: 4, 2 and 2 bytes a value; int8 one byte plus a float32 scale per 32 values
    assert sizes == {"float32": 1536, "float16": 768, "bfloat16": 768, "int8": 2 * 3 * (64 + 2 * 4)}


def test_the_bytes_auto_weighs_are_a_cache_s_own():
    for d in ("float32", "float16", "bfloat16", "int8"):
        assert kv_cache_bytes(d, 2 * 3 * 64) == KVCache(1, 4, 3, 64, dtype=d).bytes_per_token, d


def test_a_decoder_s_values_per_position_are_its_cache_s():
    from attnlab.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=64, block_size=16, n_layer=3, n_embd=32, n_head=4, n_kv_head=2))
    per = kv_values_per_position(model)
    assert per == 3 * 2 * 2 * 8  # layers x (K, V) x KV heads x head dim
    assert sum(c.bytes_per_token for c in model.setup_caches(1, 2, "float16")) == kv_cache_bytes("float16", per)


def test_auto_stores_float16_up_to_its_bytes_and_int8_past_them_on_a_fused_cpu():
    per = 11_520  # SmolLM2: 30 layers x (K, V) x 3 KV heads x 64
    longest = CPU_FUSED_FLOAT16_MAX_BYTES // kv_cache_bytes("float16", per)  # the most positions float16 keeps
    cpu = torch.device("cpu")
    short, why = resolve_kv_dtype("auto", cpu, True, slots=longest, per_slot=per)
    assert (short, why) == (
        CPU_FUSED_KV_DTYPE,
        "--kv-dtype auto on a CPU with the fused decode step (fewer bytes read per step)",
    )
    assert resolve_kv_dtype("auto", cpu, True)[0] == CPU_FUSED_KV_DTYPE  # the context not known: the short case
    long, why = resolve_kv_dtype("auto", cpu, True, slots=longest + 1, per_slot=per)
    assert long == CPU_FUSED_LONG_KV_DTYPE == "int8"
    half, packed = (kv_cache_bytes(d, (longest + 1) * per) / 1e6 for d in ("float16", "int8"))
    assert why.startswith(
        f"--kv-dtype auto on a CPU with the fused decode step, {longest + 1} positions: {packed:.0f} MB against "
        f"{half:.0f} MB in float16, over {CPU_FUSED_FLOAT16_MAX_BYTES / 1e6:.0f} MB; greedy agreement with float32"
    ), why
    storage, words = kv_cache_choice("auto", cpu, True, "kv_dtype", slots=8192, per_slot=per)
    assert storage == "int8" and words.startswith(
        "KV cache int8 (kv_dtype auto on a CPU with the fused decode step, 8192"
    )
    # without the fused step, or off the CPU, auto is the compute dtype at any length; a dtype asked for is kept
    assert resolve_kv_dtype("auto", cpu, False, slots=8192, per_slot=per)[0] is None
    assert resolve_kv_dtype("auto", torch.device("cuda"), True, slots=8192, per_slot=per)[0] is None
    assert resolve_kv_dtype("float16", cpu, True, slots=8192, per_slot=per) == (
        "float16",
        "--kv-dtype float16 asked for it",
    )


def test_a_storage_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match=r"KVCache dtype='int4' is not a cache storage; expected one of \['bfloat16'"):
        KVCache(1, 4, 1, 8, dtype="int4")


def test_keys_of_another_compute_dtype_are_refused():
    cache = KVCache(1, 4, 1, 8, dtype="int8")
    with pytest.raises(TypeError, match="kv_cache holds torch.float32 but this call's keys/values are torch.float64"):
        cache.update(torch.zeros(1, 1, 1, 8, dtype=torch.float64), torch.zeros(1, 1, 1, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("mode", ["append", "positions"])
def test_module_decode_through_a_compact_cache_equals_attention_over_its_rounded_keys(dtype, mode):
    # the PyTorch path: each step's output is exactly attention over the keys/values as the cache rounds them
    torch.manual_seed(0)
    mha = MultiHeadAttention(48, 6, num_kv_heads=2).eval()
    x = torch.randn(2, 9, 48)
    cache = KVCache.for_module(mha, 2, 9, dtype=dtype)
    with torch.no_grad():
        outs = []
        for t in range(9):
            kw = {"cache_positions": torch.tensor([t])} if mode == "positions" else {}
            outs.append(mha(x[:, t : t + 1], kv_cache=cache, is_causal=True, **kw))
        got = torch.cat(outs, 1)  # (B, T, E)
        q = mha._project(x, x, x)[0]  # (B, T, H*D)
        keys, values = cache.read()  # (B, G, 9, D): the rounded keys and values
        q = q.view(2, 9, 6, 8).transpose(1, 2)  # (B, H, T, D)
        ref = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1), is_causal=True
        )  # (B, H, T, D)
        want = mha.out_proj(ref.transpose(1, 2).reshape(2, 9, 48))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_rolling_cache_of_a_compact_dtype_decodes_as_its_float32_twin(dtype):
    # a sliding-window layer's rolling buffer rounds on write and reads back as KVCache does (prefill and decode)
    torch.manual_seed(5)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, window=6).eval()
    x = torch.randn(1, 30, 32)
    outs = {}
    for name in ("float32", dtype):
        cache = RollingKVCache.for_module(m, 1, dtype=name)
        with torch.no_grad():
            steps = [m(x[:, :10], is_causal=True, kv_cache=cache, cache_positions=torch.arange(10))]
            steps += [
                m(x[:, t : t + 1], is_causal=True, kv_cache=cache, cache_positions=torch.tensor([t]))
                for t in range(10, 30)
            ]
        outs[name] = torch.cat(steps, 1)
        assert cache.k.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[name]
    err = (outs[dtype] - outs["float32"]).abs().max() / outs["float32"].abs().max()
    assert 0 < err <= INT8_OUTPUT_BOUND


# -- the kernel ---------------------------------------------------------------------------------------------------

needs_kernels = pytest.mark.skipif(not KERNELS, reason="the decode kernel needs the compiled kernels")


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("D", [64, 32, 20])
def test_kernel_equals_sdpa_on_the_same_cache(dtype, heads, D):
    # lengths: 1 slot, a block (16) +- 1, a non-multiple of the block and of the 2-thread split, a long one
    torch.manual_seed(1)
    H, G = heads
    B, S = 2, 1031
    q, k, v = torch.randn(B, H, D), 2 * torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    cache = _cache_of(k, v, dtype)
    keys, values = cache.read()  # (B, G, S, D) float32: what the kernel must read
    for isa in _isas():
        for n in (1, 15, 16, 17, 101, 1031):
            pad = torch.zeros(B, S, dtype=torch.bool)
            pad[1, : min(n - 1, 7)] = True  # row 1 left-padded (never its last slot)
            out = decode_attention(q, cache.k, cache.v, n, k_scale=cache.k_scale, v_scale=cache.v_scale,
                                   key_padding_mask=pad, isa=isa)  # fmt: skip
            ref = _sdpa(q, keys, values, n, pad)
            err = (out.double() - ref).abs().max() / ref.abs().max()
            assert err <= 1e-5, f"isa={isa} n={n}: {err:.2e}"


@needs_kernels
@pytest.mark.parametrize(("D", "block"), [(64, 8), (64, 16), (64, 32), (64, 64), (96, 48)])
def test_kernel_reads_int8_rows_of_any_block_as_their_dequantized_floats(D, block):
    # the int8 read at every block the cache may be given (scripts/kv_cache_agreement.py --int8-block measures
    # them): the kernel's output is attention over dequantize_int8's floats, on every ISA (a block under 16 runs
    # plain C++; 16 and up the vector paths; AVX-512 reads a scale by a shift, so a block of 48 takes AVX2's)
    torch.manual_seed(6)
    B, H, G, S = 2, 6, 2, 203
    q, k, v = torch.randn(B, H, D), 3 * torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    (kq, ks), (vq, vs) = quantize_int8(k, block), quantize_int8(v, block)  # (B, G, S, D), (B, G, S, D / block)
    keys, values = dequantize_int8(kq, ks, torch.float32), dequantize_int8(vq, vs, torch.float32)
    for isa in _isas():
        for n in (1, 17, 203):
            out = decode_attention(q, kq, vq, n, k_scale=ks, v_scale=vs, isa=isa)
            ref = _sdpa(q, keys, values, n, None)
            err = (out.double() - ref).abs().max() / ref.abs().max()
            assert err <= 1e-5, f"block={block} isa={isa} n={n}: {err:.2e}"


needs_vnni = pytest.mark.skipif(
    not KERNELS or kernel_status().tiles_isa != "AVX-512 VNNI", reason="the int8 products need AVX-512 VNNI"
)


def _q8_query(q: torch.Tensor, scale: float) -> torch.Tensor:
    """``q * scale`` rounded per block of 32 values to int8 times its block's max / 127 (GGML's q8_0), computed in
    float32 as the kernel does (round half to even), returned in float64."""
    qb = (q.float() * scale).reshape(*q.shape[:-1], -1, 32)
    amax = qb.abs().amax(-1, keepdim=True)
    ints = (qb * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).round()
    return (ints.double() * (amax / 127).double()).reshape(q.shape)


@needs_vnni
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (4, 4)], ids=["gqa3", "gqa4", "mha"])
@pytest.mark.parametrize("D", [64, 128])
def test_vnni_kernel_is_attention_with_the_query_rounded_to_int8(heads, D):
    # isa=3 (the default on a VNNI CPU) multiplies the int8 keys by the query rounded to int8: its output is
    # attention over the dequantized cache with that rounded query, up to float32 rounding (measured <= 1e-6)
    torch.manual_seed(7)
    H, G = heads
    B, S = 2, 1031
    q, k, v = torch.randn(B, H, D), 2 * torch.randn(B, G, S, D), torch.randn(B, G, S, D)
    (kq, ks), (vq, vs) = quantize_int8(k, 32), quantize_int8(v, 32)
    keys, values = dequantize_int8(kq, ks, torch.float64), dequantize_int8(vq, vs, torch.float64)
    rounded = _q8_query(q, D**-0.5)
    for n in (1, 15, 16, 17, 101, 1031):
        pad = torch.zeros(B, S, dtype=torch.bool)
        pad[1, : min(n - 1, 7)] = True
        out = decode_attention(q, kq, vq, n, k_scale=ks, v_scale=vs, key_padding_mask=pad, isa=3)
        ref = _sdpa(rounded, keys, values, n, pad, scale=1.0)
        err = (out.double() - ref).abs().max() / ref.abs().max()
        assert err <= 1e-5, f"n={n}: {err:.2e}"
        default = decode_attention(q, kq, vq, n, k_scale=ks, v_scale=vs, key_padding_mask=pad)
        assert torch.equal(default, out)  # -1 picks it on this CPU


@needs_vnni
def test_vnni_isa_reads_other_caches_as_avx512_does():
    # only an int8 cache of blocks of 32 and D a multiple of 64 takes the int8 products; the rest, bit for bit isa=2
    torch.manual_seed(8)
    q, k, v = torch.randn(1, 6, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    assert torch.equal(decode_attention(q, k, v, 300, isa=3), decode_attention(q, k, v, 300, isa=2))
    (kq, ks), (vq, vs) = quantize_int8(k, 16), quantize_int8(v, 16)
    assert torch.equal(decode_attention(q, kq, vq, 300, k_scale=ks, v_scale=vs, isa=3),
                       decode_attention(q, kq, vq, 300, k_scale=ks, v_scale=vs, isa=2))  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_split_over_threads_changes_only_the_rounding(threads):
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 9, 64), torch.randn(1, 3, 500, 64), torch.randn(1, 3, 500, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = decode_attention(q, k, v, 499)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), _sdpa(q, k, v, 499, None), atol=1e-6, rtol=1e-5)


@needs_kernels
def test_kernel_gives_zeros_where_every_slot_is_padding():
    q, k, v = torch.randn(2, 2, 32), torch.randn(2, 1, 40, 32), torch.randn(2, 1, 40, 32)
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[0] = True  # row 0 attends to nothing: zeros, not NaN (softmax_weights' rule)
    out = decode_attention(q, k, v, 40, key_padding_mask=pad)
    assert torch.equal(out[0], torch.zeros(2, 32))
    torch.testing.assert_close(out[1].double(), _sdpa(q, k, v, 40, pad)[1], atol=1e-6, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("n", [1, 77, 2048])
def test_float16_cache_within_twice_the_plain_float16_error(n):
    # flash-attention's rule: against float64, the kernel over a float16 cache errs at most 2x what plain float16
    # attention (q, k, v and the math in float16) errs, plus a floor
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 9, 64), torch.randn(1, 3, n, 64), torch.randn(1, 3, n, 64)
    ref = _sdpa(q, k, v, n, None)
    cache = _cache_of(k, v, "float16")
    ours = decode_attention(q, cache.k, cache.v, n).double()
    rep = 3
    plain = F.scaled_dot_product_attention(
        q[:, :, None].half(), k.half().repeat_interleave(rep, 1), v.half().repeat_interleave(rep, 1)
    )[:, :, 0].double()
    assert (ours - ref).abs().max() <= 2 * (plain - ref).abs().max() + 1e-5


@needs_kernels
@pytest.mark.parametrize("n", [1, 100, 2048])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_int8_cache_within_its_measured_bound_of_the_float32_cache(n, D):
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 9, D), torch.randn(1, 3, n, D), torch.randn(1, 3, n, D)
    exact = decode_attention(q, k, v, n).double()
    cache = _cache_of(k, v, "int8")
    ours = decode_attention(q, cache.k, cache.v, n, k_scale=cache.k_scale, v_scale=cache.v_scale).double()
    assert (ours - exact).abs().max() <= INT8_OUTPUT_BOUND * exact.abs().max()


@needs_kernels
def test_kernel_refuses_an_int8_cache_without_scales():
    k = torch.zeros(1, 1, 4, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="an int8 k needs its float32 scales"):
        decode_attention(torch.zeros(1, 1, 32), k, k, 4)


# -- the fused GGUF decode step ---------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "int8"])
def test_fused_step_over_a_compact_cache_equals_the_python_step(tmp_path, kv_dtype):
    gguf = pytest.importorskip("gguf")
    from attnlab import from_pretrained
    from test_pretrained import write_llama_gguf

    path = tmp_path / "q.gguf"
    write_llama_gguf(path, tied=False, all_quantized=gguf.GGMLQuantizationType.Q8_0)
    model, _ = from_pretrained(path, dtype="gguf")
    assert model.has_fused_decode
    B, S = 2, 40
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :5] = True
    positions = ((~pad).long().cumsum(1) - 1).clamp(min=0)
    idx = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(5))
    runs = []
    for fused in (True, False):
        caches = model.setup_caches(B, S, kv_dtype)
        with torch.no_grad():
            model(idx[:, :3], positions=positions[:, :3], key_padding_mask=pad, caches=caches,
                  cache_positions=torch.arange(3))  # fmt: skip
            if not fused:
                model.__dict__["_fused_cache"] = (None,)
            steps = [
                model(idx[:, s : s + 1], positions=positions[:, s : s + 1], key_padding_mask=pad, caches=caches,
                      cache_positions=torch.tensor([s]), only_last=True)
                for s in range(3, S)
            ]  # fmt: skip
            model.__dict__.pop("_fused_cache", None)
        runs.append((torch.cat(steps, 1), caches))
    (fast, fast_caches), (slow, slow_caches) = runs
    assert fast_caches[0].k.dtype == {"int8": torch.int8, **FLOATS}[kv_dtype]
    assert (fast - slow).abs().max() <= 2e-2 * slow.abs().max()
    for a, b in zip(fast_caches, slow_caches, strict=True):
        (ak, av), (bk, bv) = a.read(), b.read()
        assert torch.allclose(ak, bk, atol=2e-2) and torch.allclose(av, bv, atol=2e-2)
