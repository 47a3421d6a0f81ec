"""generate()'s prefill through the KV cache: the logits of the full forward, chunked or not, with padding, a
sliding window and packed documents; no causal leak; and never a mask over the empty slots of the buffer."""

from __future__ import annotations

import pytest
import torch

from attnlab import generate, left_pad
from attnlab.core import functional
from attnlab.core.masks import Masks
from attnlab.models import decoder as decoder_module
from attnlab.models.decoder import Decoder
from attnlab.models.generation import positions_from_padding, prefill
from attnlab.models.llama_config import LlamaConfig
from attnlab.runtime import UsageError

V = 61


def tiny(window: int | None = None) -> Decoder:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, block_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48)
    model = Decoder(cfg).double().eval()
    if window is not None:
        for block in model.blocks:
            block.attn.window = window  # a causal sliding window on every layer (the variants' path)
    return model


def run_prefill(
    model: Decoder, idx: torch.Tensor, pad: torch.Tensor, slots: int, chunk: int | str | None
) -> torch.Tensor:
    """generate()'s prefill of ``idx (B, T)`` left-padded by ``pad (B, T)`` into caches of ``slots`` slots."""
    B, T = idx.shape
    full_pad = torch.cat([pad, pad.new_zeros(B, slots - T)], dim=1)  # (B, S)
    positions = positions_from_padding(full_pad)
    caches = model.setup_caches(B, slots)
    with torch.no_grad():
        return prefill(model, idx, positions[:, :T], full_pad, caches, chunk=chunk)  # type: ignore[arg-type]


CHUNKS = [None, 1, 3, 4, 64]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("window", [None, 4])
def test_prefill_equals_the_full_forward(chunk, window):
    model = tiny(window)
    idx = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        full = model(idx)[:, -1]  # (B, V)
    got = run_prefill(model, idx, torch.zeros(2, 11, dtype=torch.bool), slots=40, chunk=chunk)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("window", [None, 3])
def test_left_padded_rows_prefill_as_they_do_alone(chunk, window):
    model = tiny(window)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (9, 4, 1)]
    idx, pad = left_pad(prompts)
    got = run_prefill(model, idx, pad, slots=30, chunk=chunk)
    for b, p in enumerate(prompts):
        with torch.no_grad():
            alone = model(torch.tensor([p]))[0, -1]
        torch.testing.assert_close(got[b], alone, rtol=1e-10, atol=1e-10)


def test_each_packed_document_prefills_through_the_cache_as_in_the_packed_forward():
    model = tiny()
    idx = torch.randint(0, V, (1, 12))
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    with torch.no_grad():
        packed = model(idx, document_ids=docs)  # (1, 12, V): attention within each document, positions restarting
    for end, start in ((5, 0), (9, 5), (12, 9)):
        doc = idx[:, start:end]
        got = run_prefill(model, doc, torch.zeros_like(doc, dtype=torch.bool), slots=20, chunk=2)
        torch.testing.assert_close(got[0], packed[0, end - 1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("chunk", [None, 3])
def test_no_causal_leak_into_the_cache(chunk):
    """The keys and values cached for slots < t do not change when the prompt's tokens from t on do."""
    model = tiny()
    idx = torch.randint(0, V, (1, 10))
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 7) % V
    caches = []
    for x in (idx, changed):
        pad = torch.zeros(1, 16, dtype=torch.bool)
        c = model.setup_caches(1, 16)
        with torch.no_grad():
            prefill(model, x, positions_from_padding(pad)[:, :10], pad, c, chunk=chunk)
        caches.append(c)
    for a, b in zip(caches[0], caches[1], strict=True):
        assert torch.equal(a.k[:, :, :6], b.k[:, :, :6]) and torch.equal(a.v[:, :, :6], b.v[:, :, :6])
        assert not torch.equal(a.k[:, :, 6:10], b.k[:, :, 6:10])  # the later slots do see the change


def spy_masks(monkeypatch) -> tuple[list[Masks], list[tuple[tuple[int, ...] | None, bool, int]]]:
    """Record every Masks a decoder call builds and, per SDPA call, (mask shape, is_causal, keys)."""
    built: list[Masks] = []
    real_masks = decoder_module.decoder_masks

    def masks(*a, **k):
        built.append(real_masks(*a, **k))
        return built[-1]

    calls: list[tuple[tuple[int, ...] | None, bool, int]] = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((None if attn_mask is None else tuple(attn_mask.shape), is_causal, k.size(-2)))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(decoder_module, "decoder_masks", masks)
    monkeypatch.setattr(functional.F, "scaled_dot_product_attention", sdpa)
    return built, calls


def test_unpadded_prefill_runs_sdpa_causal_without_any_mask_tensor(monkeypatch):
    model = tiny().float()
    built, calls = spy_masks(monkeypatch)
    run_prefill(model, torch.randint(0, V, (1, 20)), torch.zeros(1, 20, dtype=torch.bool), slots=90, chunk=None)
    assert len(built) == 1 and built[0].keep is None and built[0].opened_bias is None and built[0].causal
    assert calls == [(None, True, 20)] * 2  # both layers: SDPA's causal path over the 20 keys filled, not 90


def test_chunked_and_padded_prefill_masks_cover_the_filled_slots_only(monkeypatch):
    """The T x max_len float mask of issue 51 (198 MB at 7000 tokens) is never built: every mask a chunk
    builds is (chunk, filled), and the largest is chunk x T."""
    model = tiny().float()
    built, calls = spy_masks(monkeypatch)
    idx, pad = left_pad([torch.randint(0, V, (n,)).tolist() for n in (20, 13)])
    run_prefill(model, idx, pad, slots=90, chunk=8)
    assert len(built) == 3  # chunks of 8, 8 and 4 queries
    for m, end in zip(built, (8, 16, 20), strict=True):
        for t in (m.keep, m.opened, m.opened_bias):
            assert t is None or (t.shape[-1] == end and t.shape[-2] in (8, 4))
    assert {c[2] for c in calls} == {8, 16, 20} and all(c[0] is not None and c[0][-1] == c[2] for c in calls)


def test_auto_chunks_a_prompt_longer_than_a_chunk(monkeypatch):
    """chunk="auto" without padding: the first PREFILL_FIRST tokens in one causal call (no mask), then
    PREFILL_CHUNK a call (the work memory bounded); with padding PREFILL_CHUNK a call from the start."""
    monkeypatch.setattr("attnlab.models.generation.PREFILL_CHUNK", 8)
    monkeypatch.setattr("attnlab.models.generation.PREFILL_FIRST", 12)
    model = tiny().float()
    built, _ = spy_masks(monkeypatch)
    run_prefill(model, torch.randint(0, V, (2, 12)), torch.zeros(2, 12, dtype=torch.bool), slots=30, chunk="auto")
    assert len(built) == 1 and built[0].causal
    built.clear()
    run_prefill(model, torch.randint(0, V, (2, 25)), torch.zeros(2, 25, dtype=torch.bool), slots=30, chunk="auto")
    assert len(built) == 3 and built[0].causal and built[0].keep is None  # 12 tokens: SDPA's causal path
    for m, shape in zip(built[1:], ((8, 20), (5, 25)), strict=True):  # then their causal mask over the filled slots
        assert m.keep is not None and tuple(m.keep.shape[-2:]) == shape
        # made float once for every layer (SDPA would convert the bool mask in each one): 0 where kept, -inf not
        assert m.opened_bias is not None and torch.equal(m.opened_bias == 0, m.keep.expand_as(m.opened_bias))
        assert bool(m.opened_bias[~m.keep.expand_as(m.opened_bias)].eq(float("-inf")).all())
    built.clear()
    idx, pad = left_pad([torch.randint(0, V, (n,)).tolist() for n in (20, 13)])
    run_prefill(model, idx, pad, slots=30, chunk="auto")
    assert len(built) == 3
    with pytest.raises(UsageError, match="chunk must be an integer >= 1"):
        run_prefill(model, idx, pad, slots=30, chunk=0)


def test_generate_after_a_chunked_prefill_gives_the_recomputed_tokens(monkeypatch):
    """Append-mode prefill, then position-mode decode steps: the greedy tokens of the full recompute."""
    monkeypatch.setattr("attnlab.models.generation.PREFILL_CHUNK", 5)
    model = tiny()
    idx, pad = left_pad([torch.randint(0, V, (n,)).tolist() for n in (12, 7)])
    cached = generate(model, idx, 6, temperature=0, key_padding_mask=pad)
    recomputed = generate(model, idx, 6, temperature=0, key_padding_mask=pad, use_cache=False)
    assert torch.equal(cached, recomputed)
