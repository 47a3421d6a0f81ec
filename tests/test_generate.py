"""Generation: cached == recomputed, left padding, sampling, eos, errors, compiled decode step."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab import GPTConfig, TinyGPT
from attnlab.models.generation import generate, generate_steps, left_pad, sample_next

FLAGS = [dict(n_kv_head=g, position=p) for g in (4, 2, 1) for p in ("learned", "rotary")]
IDS = [f"{'mha' if f['n_kv_head'] == 4 else 'gqa' if f['n_kv_head'] == 2 else 'mqa'}-{f['position']}" for f in FLAGS]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def tiny(**overrides) -> TinyGPT:
    kw = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32) | overrides
    return TinyGPT(GPTConfig(**kw)).eval()


@pytest.mark.parametrize("flags", FLAGS, ids=IDS)
def test_cached_greedy_equals_recompute(flags, device):
    model = tiny(**flags).to(device)
    idx = torch.randint(0, 50, (2, 5)).to(device)
    cached = list(generate_steps(model, idx, 12, temperature=0))
    recomputed = list(generate_steps(model, idx, 12, temperature=0, use_cache=False))
    assert len(cached) == len(recomputed) == 12
    for a, b in zip(cached, recomputed, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags", FLAGS, ids=IDS)
@pytest.mark.parametrize("chunks", [(1,) * 9, (4, 1, 3, 1), (2, 5, 2)], ids=["1-token", "mixed", "multi-token"])
def test_cache_appends_of_any_size_equal_full_forward(flags, chunks, device):
    """Chunks of several tokens at once (speculative/multi-token appends) see the same logits."""
    model = tiny(**flags).to(device)
    idx = torch.randint(0, 50, (2, 9)).to(device)
    full = model(idx)  # (2, 9, 50)
    caches = model.setup_caches(2, 16)
    outs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            slots = torch.arange(start, start + size, device=device)
            outs.append(model(idx[:, start : start + size], caches=caches, cache_positions=slots))
            start += size
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flags", FLAGS[::2] + FLAGS[3:4], ids=IDS[::2] + IDS[3:4])
@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_equals_each_prompt_alone(flags, use_cache, device):
    model = tiny(**flags).to(device)
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6, 5, 3], [5]]
    idx, pad = (t.to(device) for t in left_pad(prompts, pad_token_id=0))
    batch = generate(model, idx, 8, temperature=0, key_padding_mask=pad, use_cache=use_cache)
    assert batch.shape == (3, 7 + 8)
    assert torch.equal(batch[:, :7], idx)  # the prompt comes back first, padding included
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt], device=device), 8, temperature=0, use_cache=use_cache)
        assert torch.equal(batch[row, 7:], alone[0, len(prompt) :]), f"row {row}"


def test_sampling_is_reproducible_with_a_seeded_generator(device):
    model = tiny().to(device)
    idx = torch.randint(0, 50, (2, 4)).to(device)

    def run(seed, **kw):
        g = torch.Generator(device=device).manual_seed(seed)  # sampling draws on the logits' device
        return generate(model, idx, 16, temperature=1.5, generator=g, **kw)

    assert torch.equal(run(0), run(0))
    assert torch.equal(run(0, top_k=5, top_p=0.9), run(0, top_k=5, top_p=0.9))
    assert not torch.equal(run(0), run(1))
    assert torch.equal(run(3), run(3, use_cache=False))  # same draws with and without the cache


def test_top_k_and_top_p_restrict_the_support(device):
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]], device=device).expand(2000, -1)  # (2000, 6)
    g = torch.Generator(device=device).manual_seed(0)
    k3 = sample_next(logits, temperature=1.0, top_k=3, generator=g)
    assert set(k3.tolist()) == {0, 1, 2}  # all of the top 3 drawn, nothing else
    probs = logits[0].softmax(-1)  # 0.64, 0.24, 0.09, ...: the nucleus of 0.85 is tokens {0, 1}
    assert probs[:1].sum() < 0.85 <= probs[:2].sum()
    p = sample_next(logits, temperature=1.0, top_p=0.85, generator=g)
    assert set(p.tolist()) == {0, 1}
    zeros = torch.zeros(2000, dtype=torch.long, device=device)
    assert torch.equal(sample_next(logits, temperature=1.0, top_k=1, generator=g), zeros)
    assert torch.equal(sample_next(logits, temperature=0), zeros)


def test_finished_rows_keep_emitting_eos_and_generation_stops_when_all_finish(device):
    model = tiny().to(device)
    idx = torch.randint(0, 50, (2, 4)).to(device)
    free = generate(model, idx, 10, temperature=0)
    eos = int(free[0, 4 + 2])  # row 0 emits it at step 2
    steps = list(generate_steps(model, idx, 10, temperature=0, eos_token_id=eos))
    tokens = torch.stack([s.tokens for s in steps], dim=1)  # (2, n)
    first = (free[0, 4:] == eos).nonzero()[0].item()
    assert torch.all(tokens[0, first:] == eos)
    assert torch.equal(tokens[0, :first], free[0, 4 : 4 + first])
    row1_hits = (free[1, 4:] == eos).nonzero()
    if len(row1_hits):  # both rows finish: generation stops at the later one
        assert tokens.size(1) == max(first, row1_hits[0].item()) + 1
    else:
        assert tokens.size(1) == 10 and torch.equal(tokens[1], free[1, 4:])


def test_generation_errors_name_the_argument_and_the_fix():
    model = tiny()
    with pytest.raises(
        ValueError,
        match=r"prompt length 30 \+ max_new_tokens 5 = 35 exceeds block_size=32, .*keep the prompt's last 27 tokens \(idx\[:, -27:\]\) or ask for at most 2 new tokens\.$",
    ):
        generate(model, torch.zeros(1, 30, dtype=torch.long), 5)
    # more new tokens than the model has positions: cropping the prompt cannot help, so it is not offered
    with pytest.raises(ValueError, match=r"= 201 exceeds block_size=32, .*; ask for at most 31 new tokens\.$"):
        generate(model, torch.zeros(1, 1, dtype=torch.long), 200)
    with pytest.raises(
        ValueError, match=r"= 232 exceeds .*; keep the prompt's last 16 tokens and ask for at most 16 new tokens\.$"
    ):
        generate(model, torch.zeros(1, 32, dtype=torch.long), 200)
    with pytest.raises(ValueError, match="prompts must be padded on the left"):
        generate(
            model, torch.zeros(2, 3, dtype=torch.long), 2, key_padding_mask=torch.tensor([[False, False, True]] * 2)
        )
    with pytest.raises(ValueError, match=r"^temperature must be a number >= 0, got -1; 0 is greedy\.$"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, temperature=-1)
    with pytest.raises(TypeError, match=r"idx must be an int64 tensor \(B, T\).*left_pad"):
        generate(model, torch.zeros(3), 2)
    with pytest.raises(ValueError, match="every row needs at least one token"):
        left_pad([[1], []])


@pytest.mark.slow  # inductor compiles a whole decoder's step, ~25 s on 2 cores; tests/test_kv_cache.py compiles the attention step fullgraph quick
def test_decode_step_compiles_once_fullgraph_and_matches_eager(device):
    """On CUDA the compiled step runs under CUDA graphs (mode="reduce-overhead"); the same counts hold."""
    torch._dynamo.reset()
    model = tiny(n_kv_head=2, position="rotary").to(device)
    prompts = [[3, 1, 4, 1], [5, 9]]
    idx, pad = (t.to(device) for t in left_pad(prompts))
    counters.clear()
    compiled = list(generate_steps(model, idx, 8, temperature=0, key_padding_mask=pad, compile=True))
    assert counters["stats"]["unique_graphs"] == 1  # 7 decode steps, one graph: shapes never change
    assert not counters["graph_break"]
    eager = list(generate_steps(model, idx, 8, temperature=0, key_padding_mask=pad))
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    prompt = torch.tensor([[7, 7, 1, 2, 3, 4]], device=device)
    other = generate(model, prompt, 11, temperature=0, compile=True)  # new B, T and length
    again = generate(model, prompt, 11, temperature=0, compile=True)
    assert torch.equal(other, generate(model, prompt, 11, temperature=0))
    assert torch.equal(other, again)
    assert counters["stats"]["unique_graphs"] == 2  # one more for batch size 1; the same cache size reused


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_out_of_vocabulary_prompt_ids_name_the_id_the_place_and_the_vocabulary(dtype, device):
    """On a GPU an out-of-range id would reach the embedding as a device-side assert, fatal to the
    CUDA context: the check must stop it first, on every device."""
    model = tiny().to(device)  # vocab_size 50
    idx = torch.tensor([[1, 2, 3], [4, 50, 50]], dtype=dtype, device=device)
    with pytest.raises(
        ValueError,
        match=r"^idx holds token id 50 at \[1, 1\], outside the model's vocabulary of 50 ids \(0 \.\. 49\); encode the "
        r"text with the model's own tokenizer, or build the model with GPTConfig\(vocab_size=51\) or more\.$",
    ):
        generate(model, idx, 2)
    with pytest.raises(
        ValueError, match=r"^idx holds token id -1 at \[0, 0\], .*; token ids are >= 0; pad with a real id"
    ):
        generate(model, torch.tensor([[-1, 3]], dtype=dtype, device=device), 2, use_cache=False)
    with pytest.raises(ValueError, match=r"token id 99 at \[0, 0\]"):  # left-padding ids are embedded too
        padded, pad = left_pad([[3], [1, 2]], pad_token_id=99)
        generate(model, padded.to(device), 2, key_padding_mask=pad.to(device))


def _spread(model: TinyGPT) -> TinyGPT:
    """Weights N(0, 0.3) instead of GPT-2's 0.02: logits far apart, so that greedy tokens do not hinge on
    rounding (near-ties would make a bf16 comparison a coin toss)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("flags", FLAGS, ids=IDS)
def test_generate_runs_under_autocast(flags, device):
    """Under torch.autocast(bf16) the K/V projections return bf16: the cache holds bf16 (it held the
    model's float32 and refused the first write, with advice the caller could not follow)."""
    model = _spread(tiny(**flags)).to(device)
    idx = torch.randint(0, 50, (2, 5)).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        cached = list(generate_steps(model, idx, 10, temperature=0))
        recomputed = list(generate_steps(model, idx, 10, temperature=0, use_cache=False))
        caches = model.setup_caches(2, 16)
    assert caches[0].k.dtype == torch.bfloat16 and model.setup_caches(2, 16)[0].k.dtype == torch.float32
    for a, b in zip(cached, recomputed, strict=True):
        assert torch.equal(a.tokens, b.tokens) and a.logits.dtype == torch.bfloat16
        assert 0 <= int(a.tokens.min()) and int(a.tokens.max()) < 50
    with torch.no_grad():
        full = model(idx)[:, -1]  # float32 logits of the first new token
    torch.testing.assert_close(cached[0].logits.float(), full, atol=0.1 * full.abs().max().item(), rtol=0)


@pytest.mark.slow  # two inductor compiles, ~10 s on 2 cores
def test_compiled_generate_rechecks_guards_on_each_call():
    """A model changed between compiled calls (here to float64) is re-guarded and recompiled,
    never run through the old graph."""
    torch._dynamo.reset()
    model = _spread(tiny(n_kv_head=2, position="rotary"))
    idx = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(1))
    first = generate(model, idx, 6, temperature=0, compile=True)
    assert torch.equal(first, generate(model, idx, 6, temperature=0))
    counters.clear()
    model.double()
    steps = list(generate_steps(model, idx, 6, temperature=0, compile=True))
    assert counters["stats"]["unique_graphs"] == 1  # a new graph for float64
    assert all(s.logits.dtype == torch.float64 for s in steps)
    eager = list(generate_steps(model, idx, 6, temperature=0))
    for a, b in zip(steps, eager, strict=True):  # the rotary tables are float32 math either way
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-6, rtol=1e-5)
