"""KVCache: cached decoding equals full recomputation, both modes, both backends, errors."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab import KVCache, MultiHeadAttention
from attnlab.core.rope import rope_cos_sin


def _decode(mha, x, chunks, *, mode, rope=False, max_len=16):
    """Feed x (B, T, E) through mha chunk by chunk with a cache; return the concatenated outputs."""
    cache = KVCache.for_module(mha, x.size(0), max_len)
    outs, start = [], 0
    for size in chunks:
        xs = x[:, start : start + size]
        kw = {}
        positions = torch.arange(start, start + size, device=x.device)
        if rope:
            kw["rope"] = rope_cos_sin(positions, mha.head_dim)
        if mode == "positions":
            kw["cache_positions"] = positions
        outs.append(mha(xs, kv_cache=cache, is_causal=True, **kw))
        start += size
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mode", ["append", "positions"])
@pytest.mark.parametrize("chunks", [(1,) * 7, (3, 1, 1, 2), (4, 3)])
@pytest.mark.parametrize("rope", [False, True])
def test_cached_equals_uncached(backend, kv_heads, mode, chunks, rope, device):
    mha = MultiHeadAttention(16, 4, num_kv_heads=kv_heads, backend=backend).to(device)
    x = torch.randn(2, 7, 16).to(device)
    kw = {"rope": rope_cos_sin(torch.arange(7, device=device), 4)} if rope else {}
    full = mha(x, is_causal=True, **kw)
    cached, cache = _decode(mha, x, chunks, mode=mode, rope=rope)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    if mode == "append":
        assert cache.length == 7


def test_bytes_per_token_shrink_with_gqa():
    sizes = [KVCache.for_module(MultiHeadAttention(64, 8, num_kv_heads=g), 1, 8).bytes_per_token for g in (8, 2, 1)]
    assert sizes == [2 * 8 * 8 * 4, 2 * 2 * 8 * 4, 2 * 1 * 8 * 4]


def test_cache_errors_and_reset(device_with_float64):
    """On any device; the overflow check of ``cache_positions`` reads them only when they are on the CPU
    (free there; on a GPU it would sync), so those positions are CPU tensors here."""
    device = device_with_float64
    mha = MultiHeadAttention(16, 4).to(device)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, dtype=dtype).to(device)

    cache = KVCache.for_module(mha, batch_size=2, max_len=4)
    mha(randn(2, 3, 16), kv_cache=cache, is_causal=True)
    with pytest.raises(
        ValueError,
        match=r"kv_cache overflow: 3 slots are filled and this call appends 2, but max_len=4; build the cache with max_len >= 5 or call reset\(\)",
    ):
        mha(randn(2, 2, 16), kv_cache=cache, is_causal=True)
    with pytest.raises(ValueError, match="kv_cache was built for batch size 2 but this call has batch size 3"):
        mha(randn(3, 1, 16), kv_cache=cache, is_causal=True)
    with pytest.raises(ValueError, match=r"kv_cache overflow: cache_positions span \[4, 4\] but max_len=4"):
        mha(randn(2, 1, 16), kv_cache=cache, cache_positions=torch.tensor([4]), is_causal=True)
    with pytest.raises(ValueError, match="cache_positions was given with is_causal=False"):
        mha(randn(2, 1, 16), kv_cache=cache, cache_positions=torch.tensor([3]))
    half = MultiHeadAttention(16, 4, dtype=torch.float64).to(device)
    half.load_state_dict({k: v.double() for k, v in mha.state_dict().items()})
    with pytest.raises(TypeError, match="kv_cache holds torch.float32 but this call's keys/values are torch.float64"):
        half(randn(2, 1, 16, dtype=torch.float64), kv_cache=cache, is_causal=True)
    with pytest.raises(ValueError, match="kv_cache was given for cross-attention"):
        mha(randn(2, 1, 16), randn(2, 5, 16), kv_cache=cache)
    cache.reset()
    assert cache.length == 0
    x = randn(2, 4, 16)
    torch.testing.assert_close(mha(x, kv_cache=cache, is_causal=True), mha(x, is_causal=True))


def test_decode_step_compiles_fullgraph(device):
    torch._dynamo.reset()
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).eval().to(device)
    cache = KVCache.for_module(mha, 1, 8)
    x = torch.randn(1, 8, 16).to(device)
    full = mha(x, is_causal=True)

    def step(tok, pos):
        return mha(tok, kv_cache=cache, cache_positions=pos, is_causal=True)

    compiled = torch.compile(step, fullgraph=True)
    counters.clear()
    with torch.no_grad():
        outs = [compiled(x[:, i : i + 1], torch.tensor([i], device=device)) for i in range(8)]
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # fixed shapes: compiled once for all 8 steps
    assert not counters["graph_break"]
