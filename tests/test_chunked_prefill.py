"""A long prompt prefilled in chunks through the KV cache (issue 51: generate's default past PREFILL_CHUNK tokens)
gives the logits, the cache and the greedy tokens of the whole prompt in one call, in float32 on a CPU, with a
float32, float16 or int8 cache."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.decoder import Decoder
from attnlab.models.generation import generate, positions_from_padding, prefill
from attnlab.models.llama_config import LlamaConfig

V = 97


def tiny() -> Decoder:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, block_size=128, n_layer=3, n_head=6, n_kv_head=2, n_embd=48, intermediate_size=96)
    return Decoder(cfg).eval()


def run_prefill(model: Decoder, idx: torch.Tensor, chunk: int | None, kv_dtype: str | None = None):
    """``(last logits (B, V), caches)`` of a prefill of ``idx`` (no padding) into caches of ``T + 8`` slots."""
    B, T = idx.shape
    pad = torch.zeros(B, T + 8, dtype=torch.bool)
    caches = model.setup_caches(B, T + 8, kv_dtype)
    with torch.no_grad():
        logits = prefill(model, idx, positions_from_padding(pad)[:, :T], pad, caches, chunk=chunk)
    return logits, caches


@pytest.mark.parametrize("kv_dtype", [None, "float16", "int8"])
@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunked_prefill_gives_the_logits_and_cache_of_one_call_exactly(chunk, kv_dtype):
    """Chunks of a multiple of 16 rows (PREFILL_CHUNK is 512): every number equal, the logits and every cache
    buffer (keys, values, int8 scales): torch's CPU flash kernel walks the keys in the same blocks with or without
    the chunk's causal mask, and a masked key adds exactly 0."""
    model = tiny()
    idx = torch.randint(0, V, (2, 70))
    whole, whole_caches = run_prefill(model, idx, None, kv_dtype)
    got, caches = run_prefill(model, idx, chunk, kv_dtype)
    assert torch.equal(got, whole)
    for a, b in zip(caches, whole_caches, strict=True):
        assert a.length == b.length == 70
        for name in ("k", "v", "k_scale", "v_scale"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name


@pytest.mark.parametrize("chunk", [1, 7])
def test_odd_chunks_give_the_logits_and_cache_of_one_call_within_float32_rounding(chunk):
    """At 1 or 7 rows this float32 model's projections (MKL's GEMM) round some rows differently than at 70: equal
    within float32 rounding, not bit for bit (the GGUF model's quantized matmuls take each row alone)."""
    model = tiny()
    idx = torch.randint(0, V, (2, 70))
    whole, whole_caches = run_prefill(model, idx, None)
    got, caches = run_prefill(model, idx, chunk)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    for a, b in zip(caches, whole_caches, strict=True):
        torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.v, b.v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [None, "float16", "int8"])
def test_generate_with_a_chunked_prefill_gives_the_tokens_of_the_whole_one(monkeypatch, kv_dtype):
    model = tiny()
    prompt = torch.randint(0, V, (2, 60))
    monkeypatch.setattr("attnlab.models.generation.PREFILL_FIRST", 1000)  # one call
    whole = generate(model, prompt, 8, temperature=0, kv_dtype=kv_dtype)
    monkeypatch.setattr("attnlab.models.generation.PREFILL_FIRST", 32)
    monkeypatch.setattr("attnlab.models.generation.PREFILL_CHUNK", 16)  # calls of 32, 16 and 12 tokens
    assert torch.equal(generate(model, prompt, 8, temperature=0, kv_dtype=kv_dtype), whole)
