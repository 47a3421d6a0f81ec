"""Issue 51's memory paths give the numbers of the paths they replace, bit for bit: a compact cache read into the
buffer the layers share (share_read_scratch), a prefill chunk's causal mask converted to float once per call
(decoder_masks' opened_bias), and cache buffers from lazy_zeros."""

from __future__ import annotations

import pytest
import torch

from attnlab.core import functional
from attnlab.core.kv_cache import KVCache, dequantize_int8, dequantize_int8_into, lazy_zeros, share_read_scratch
from attnlab.core.masks import decoder_masks
from attnlab.models.decoder import Decoder
from attnlab.models.generation import positions_from_padding, prefill
from attnlab.models.llama_config import LlamaConfig


def test_lazy_zeros_are_zeros_of_the_shape_and_dtype():
    for shape, dtype in (((3, 4), torch.float32), ((2, 3, 1 << 16, 8), torch.int8), ((4, 1 << 18), torch.float16)):
        t = lazy_zeros(shape, dtype, "cpu")
        assert t.shape == shape and t.dtype == dtype and not t.any()
        t.fill_(1)  # writable
        assert bool(t.all())


@pytest.mark.parametrize("storage", ["float16", "int8"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_a_read_into_the_shared_buffer_equals_the_plain_read(storage, compute):
    caches = [KVCache(2, 40, 3, 64, dtype=storage, compute_dtype=compute) for _ in range(2)]
    plain = [KVCache(2, 40, 3, 64, dtype=storage, compute_dtype=compute) for _ in range(2)]
    share_read_scratch(caches)
    assert caches[0].read_scratch is caches[1].read_scratch is not None
    with torch.no_grad():
        for step in (17, 9):
            for a, b in zip(caches, plain, strict=True):
                k, v = torch.randn(2, 3, step, 64).to(compute), torch.randn(2, 3, step, 64).to(compute)
                got, want = a.update(k, v), b.update(k, v)
                assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    with torch.enable_grad():  # autograd keeps every layer's keys: a read of its own then
        k, _ = caches[0].read(10)
        assert k.data_ptr() != caches[0].read_scratch["k"].data_ptr()


def test_dequantize_into_a_strided_view_equals_dequantize():
    q = torch.randint(-127, 128, (2, 3, 11, 64), dtype=torch.int8)
    scale = torch.rand(2, 3, 11, 2)
    out = torch.empty(2, 3, 20, 64)[:, :, :11]
    assert torch.equal(dequantize_int8_into(out, q, scale), dequantize_int8(q, scale, torch.float32))


def test_a_chunk_mask_converted_once_gives_sdpa_the_same_numbers():
    q, k, v = torch.randn(1, 6, 24, 16), torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)
    cache = KVCache(1, 80, 2, 16)
    cache.length = 46  # 46 slots filled before this chunk of 24
    masks = decoder_masks(
        None, batch=1, heads=6, q_len=24, cache=cache, cache_positions=None, dtype=q.dtype, device=q.device
    )
    assert masks.keep is not None and masks.opened_bias is not None
    assert torch.equal(masks.opened_bias == 0, masks.keep)
    shared, _ = functional.sdpa_attention(q, k, v, keep=masks.keep, opened_bias=masks.opened_bias, scale=0.25)
    alone, _ = functional.sdpa_attention(q, k, v, keep=masks.keep, scale=0.25)
    assert torch.equal(shared, alone)


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_a_chunked_prefill_with_the_shared_buffer_equals_one_without(kv_dtype):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, block_size=128, n_layer=3, n_head=6, n_kv_head=2, n_embd=48, intermediate_size=96)
    model = Decoder(cfg).eval()
    idx = torch.randint(0, 97, (2, 70))
    pad = torch.zeros(2, 78, dtype=torch.bool)
    out = []
    for shared in (True, False):
        caches = model.setup_caches(2, 78, kv_dtype)
        if not shared:
            for c in caches:
                c.read_scratch = None
        with torch.no_grad():
            out.append(prefill(model, idx, positions_from_padding(pad)[:, :70], pad, caches, chunk=16))
    assert torch.equal(out[0], out[1])


def test_a_long_prompt_s_last_prefill_calls_give_each_layer_s_freed_memory_back(monkeypatch):
    """Where the cache is fullest (the calls ending within three chunks of the prompt's end) each layer's freed work
    memory goes back to the OS; the earlier calls, and a prompt of one call, leave it to the trim after the call."""
    import attnlab.models.decoder as decoder

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, block_size=128, n_layer=3, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32)
    model = Decoder(cfg).eval()
    trims: list[int] = []
    monkeypatch.setattr(decoder, "release_freed_heap", lambda: trims.append(1) or True)
    pad = torch.zeros(1, 80, dtype=torch.bool)
    for T, chunk, calls_trimmed in ((70, 16, 4), (40, None, 0)):  # ends 32, 48, 64, 70 of 16 .. 70; one call
        trims.clear()
        with torch.no_grad():
            prefill(
                model,
                torch.randint(0, 64, (1, T)),
                positions_from_padding(pad)[:, :T],
                pad,
                model.setup_caches(1, 80),
                chunk=chunk,
            )
        assert len(trims) == calls_trimmed * cfg.n_layer, (T, len(trims))
        assert not decoder.trims_each_layer()  # the context is left
