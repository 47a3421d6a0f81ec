"""Additive position biases inside Hugging Face models: T5's relative attention under ``attn_implementation="attnlab"``.

T5 (and mT5, UMT5, LongT5, Switch Transformers, Pix2Struct, UDOP) hands its attention function a
``position_bias`` kwarg, ``(1, H, T_q, T_k)``, beside the mask, and ``scaling=1.0``. A tiny
random-init T5ForConditionalGeneration (d_model 32, 4 heads of 8, 2 + 2 layers, 8 buckets), fp32
and fp64, is checked against transformers' own "eager" and "sdpa" on the same weights: logits with
padding in the encoder and the decoder, cached greedy and beam generation, and gradients, the
relative-attention embedding's included. The function itself is checked against a float64
reference and HF's own SDPA function for the cases T5 does not reach: a bias broadcast over the
batch, a full ``(B, H, T_q, T_k)`` bias, padding and causality together, fully masked rows.

Notation: B batch, H query heads, G key/value heads, T_q queries, T_k keys, D head dim.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import attnlab.hf
from attnlab.core import functional
from attnlab.hf import ATTENTION_NAME, attnlab_attention_forward

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

LAYERS, HEADS, VOCAB = 2, 4, 100


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert attnlab.hf.register() == ATTENTION_NAME


def build_t5(dtype: torch.dtype = torch.float32) -> nn.Module:
    """The tiny T5. Weights re-drawn wider than T5's init (projections N(0, 0.5), the relative-attention
    embedding N(0, 3)): at T5's own init the decoder repeats one token whatever the attention does,
    and a bias this size moves the greedy tokens when dropped (checked below)."""
    torch.manual_seed(0)
    config = T5Config(
        d_model=32,
        d_kv=8,
        num_heads=HEADS,
        d_ff=64,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        vocab_size=VOCAB,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,  # train mode (for the gradients) is then deterministic
        tie_word_embeddings=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=None,  # every generation runs its full length
    )
    model = T5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_(0.0, 3.0)
            elif p.dim() == 2 and not name.startswith(("shared", "lm_head")):
                p.normal_(0.0, 0.5)
    model.set_attn_implementation(ATTENTION_NAME)
    return model.to(dtype).eval()


def t5_inputs() -> dict[str, torch.Tensor]:
    """Encoder ids (2, 7), row 1 right-padded by 2; decoder ids (2, 5), row 0 left-padded by 2 (so
    its first two queries see no key at all: fully masked rows inside a real model)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    dec = torch.randint(2, VOCAB, (2, 5), generator=g)
    dec_mask = torch.ones(2, 5, dtype=torch.long)
    dec_mask[0, :2] = 0
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)


@pytest.fixture
def bias_spy(monkeypatch):
    """Each call of attnlab's backends, as (backend, whether it got a bias)."""
    calls: list[tuple[str, bool]] = []
    for name in ("math_attention", "sdpa_attention"):
        real = getattr(functional, name)

        def counted(q, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("bias") is not None))
            return _real(q, *args, **kwargs)

        monkeypatch.setattr(functional, name, counted)
    return calls


def logits_as(model: nn.Module, implementation: str, **inputs: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            return model(**inputs).logits
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


# logits reach 20 here: transformers' own sdpa and eager differ by up to 2.2e-5 in fp32 and 2e-14 in fp64
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_t5_logits_match_eager_and_sdpa(bias_spy, dtype, atol):
    model, inputs = build_t5(dtype), t5_inputs()
    ours = logits_as(model, ATTENTION_NAME, **inputs)  # (B, T_dec, V)
    # encoder self, decoder self and cross-attention per layer, each with its bias (zeros for cross)
    assert bias_spy == [("sdpa_attention", True)] * (3 * LAYERS)
    assert not ours.isnan().any()  # the decoder's fully masked rows too
    real = inputs["decoder_attention_mask"].bool()  # a padded query's output differs by design: zeros, not HF's mean
    for implementation in ("eager", "sdpa"):
        theirs = logits_as(model, implementation, **inputs)
        torch.testing.assert_close(ours[real], theirs[real], atol=atol, rtol=0, msg=implementation)


def test_t5_in_bf16_is_as_accurate_as_transformers_own():
    """flash-attention's rule against the fp32 model: at most twice the error of HF's own bf16 attention."""
    inputs = t5_inputs()
    real = inputs["decoder_attention_mask"].bool()
    reference = logits_as(build_t5(), "eager", **inputs)[real]
    model = build_t5(torch.bfloat16)
    errors = {
        implementation: (logits_as(model, implementation, **inputs)[real].float() - reference).abs().max().item()
        for implementation in (ATTENTION_NAME, "eager", "sdpa")
    }
    assert errors[ATTENTION_NAME] <= 2 * min(errors["eager"], errors["sdpa"]), errors


def test_t5_attention_weights_match_eager():
    model, inputs = build_t5(), t5_inputs()
    inputs["decoder_attention_mask"] = torch.ones(2, 5, dtype=torch.long)  # rows HF's eager leaves uniform differ

    def weights(implementation: str) -> list[torch.Tensor]:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            out = model(**inputs, output_attentions=True)
        return [*out.encoder_attentions, *out.decoder_attentions, *out.cross_attentions]

    ours, theirs = weights(ATTENTION_NAME), weights("eager")
    assert len(ours) == 3 * LAYERS
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("beams", "cache"), [(1, "dynamic"), (2, "dynamic"), (1, "static")], ids=["greedy", "beams2", "greedy-static"]
)
def test_t5_generate_with_the_cache_matches_eager_and_sdpa(bias_spy, beams, cache):
    """Decoder self-attention with the cache: T_q = 1 and T_k growing (a static cache: T_k its whole
    length, the empty slots masked), each step's bias the last row of T5's relative bias."""
    model, inputs = build_t5(), t5_inputs()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]

    def generate(implementation: str) -> list[list[int]]:
        model.set_attn_implementation(implementation)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=4, num_beams=beams, do_sample=False, cache_implementation=cache
        )
        return out.tolist()

    ours = generate(ATTENTION_NAME)
    assert len(bias_spy) > 3 * LAYERS and all(has_bias for _, has_bias in bias_spy)  # every step ran attnlab's
    assert ours == generate("eager") == generate("sdpa")
    if beams == 1 and cache == "dynamic":  # the test can fail: without its position bias T5 generates other tokens
        with torch.no_grad():
            for block in (model.encoder.block[0], model.decoder.block[0]):
                block.layer[0].SelfAttention.relative_attention_bias.weight.zero_()
        assert generate("eager") != ours


def test_t5_gradients_match_eager():
    model, inputs = build_t5(), t5_inputs()
    model.train()
    labels = inputs.pop("decoder_input_ids").masked_fill(inputs["decoder_attention_mask"] == 0, -100)
    labels[0, 2] = -100  # its decoder input is a padded position, whose output differs by design

    def grads(implementation: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        model.to(dtype).set_attn_implementation(implementation)
        model.zero_grad()
        model(**inputs, labels=labels).loss.backward()
        return {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}

    ours, theirs = grads(ATTENTION_NAME), grads("eager")
    exact = grads("eager", torch.float64)  # the reference both float32 runs are measured against
    ours64 = grads(ATTENTION_NAME, torch.float64)
    assert ours.keys() == theirs.keys() == exact.keys()
    embeddings = [n for n in ours if "relative_attention_bias" in n]
    assert len(embeddings) == 2 and all(ours[n].abs().sum() > 0 for n in embeddings)  # encoder and decoder
    for name, grad in ours.items():
        # float64: the same gradient to rounding; float32: flash-attention's rule, attnlab's error against the
        # float64 reference at most twice eager's own (both are ~4e-4 on gradients of ~20 here, measured)
        torch.testing.assert_close(ours64[name], exact[name], atol=1e-10, rtol=1e-10, msg=name)
        ours_err, eager_err = (grad - exact[name]).abs().max(), (theirs[name] - exact[name]).abs().max()
        assert ours_err <= 2 * eager_err + 1e-6, (name, ours_err, eager_err)


KIN = {  # model class name -> config class name, extra config
    "MT5ForConditionalGeneration": ("MT5Config", {}),
    "UMT5ForConditionalGeneration": ("UMT5Config", {}),  # a relative bias in every layer, not only the first
    "LongT5ForConditionalGeneration": ("LongT5Config", {"encoder_attention_type": "local", "local_radius": 2}),
    "SwitchTransformersForConditionalGeneration": (
        "SwitchTransformersConfig",
        {"num_experts": 2, "expert_capacity": 8, "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1},
    ),
}


@pytest.mark.parametrize("model_class", sorted(KIN))
def test_t5s_kin_match_eager(bias_spy, model_class):
    """T5's kin pass position_bias alike. LongT5 (its decoder; the encoder's local attention is its own)
    and Switch Transformers have no sdpa in transformers: attnlab gives them a fused path."""
    import transformers

    config_class, extra = KIN[model_class]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        d_model=32, d_kv=8, num_heads=HEADS, d_ff=64, num_layers=LAYERS, num_decoder_layers=LAYERS,
        vocab_size=VOCAB, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, **extra,
    )  # fmt: skip
    model = getattr(transformers, model_class)(config).eval()
    model.set_attn_implementation(ATTENTION_NAME)
    inputs = t5_inputs()
    ours = logits_as(model, ATTENTION_NAME, **inputs)
    assert len(bias_spy) >= 2 * LAYERS and all(has_bias for _, has_bias in bias_spy)
    real = inputs["decoder_attention_mask"].bool()
    torch.testing.assert_close(ours[real], logits_as(model, "eager", **inputs)[real], atol=1e-5, rtol=0)


# --- the function itself, with biases T5 does not make ----------------------------------------------


class FakeLayer(nn.Module):
    """What attnlab (and HF's SDPA function) read from a calling layer."""

    def __init__(self, is_causal: bool = True, groups: int = 2):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups  # HF's SDPA function repeats K/V heads by this


def qkv(B=2, H=4, G=2, T_q=5, T_k=5, D=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(B, n, t, D, generator=g, dtype=dtype) for n, t in ((H, T_q), (G, T_k), (G, T_k)))


def reference(q, k, v, bias, keep, scale):
    """Float64 eager attention, ``(B, T_q, H, D)``: scores * scale + bias, then ``keep``; fully masked rows zero."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    scores = (q.double() @ k.transpose(-2, -1)) * scale + bias.double()  # (B, H, T_q, T_k)
    weights = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)  # (B, H, T_q, T_k)
    return (weights @ v).transpose(1, 2)  # (B, T_q, H, D)


def padded_causal_keep(B=2, T_q=5, T_k=5):
    """Bool (B, 1, T_q, T_k): causal (bottom-right), row 0 left-padded by 2 (its first two queries see nothing)."""
    keep = torch.ones(B, 1, T_q, T_k, dtype=torch.bool).tril(diagonal=T_k - T_q)
    keep[0, :, :, :2] = False
    return keep


@pytest.mark.parametrize("bias_batch", [1, 2], ids=["batch-broadcast", "full-BHTS"])
@pytest.mark.parametrize("mask_form", ["bool", "float"])
def test_a_bias_with_padding_and_causality_matches_the_reference(bias_batch, mask_form):
    q, k, v = qkv()
    bias = torch.randn(bias_batch, 4, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    keep = padded_causal_keep()
    mask = keep if mask_form == "bool" else torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, -torch.inf)
    expected = reference(q, k, v, bias.expand(2, -1, -1, -1), keep, 1.0)
    for weights_asked in (False, True):  # SDPA, and the math backend
        out, _ = attnlab_attention_forward(
            FakeLayer(), q, k, v, mask, scaling=1.0, position_bias=bias, output_attentions=weights_asked
        )
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
        assert torch.equal(out[0, :2], torch.zeros(2, 4, 8, dtype=q.dtype))  # fully masked rows: zeros, not NaN
    # HF's own SDPA function agrees wherever a query sees some key (it averages V where none is seen)
    theirs, _ = sdpa_attention_forward(FakeLayer(), q, k, v, keep, scaling=1.0, position_bias=bias)
    seen = keep.any(-1)[:, 0]  # (B, T_q)
    torch.testing.assert_close(out[seen], theirs[seen], atol=1e-12, rtol=0)


def test_a_per_head_float_mask_is_a_bias_too():
    """A model that folds its per-head bias into a float ``(B, H, T_q, T_k)`` attention_mask, HF's eager form."""
    q, k, v = qkv()
    keep = padded_causal_keep().expand(2, 4, 5, 5)
    bias = torch.randn(2, 4, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    folded = bias.masked_fill(~keep, torch.finfo(torch.float64).min)  # (B, H, T_q, T_k)
    out, _ = attnlab_attention_forward(FakeLayer(), q, k, v, folded, scaling=0.5)
    torch.testing.assert_close(out, reference(q, k, v, bias, keep, 0.5), atol=1e-12, rtol=0)
    # the same blocks, folded into position_bias instead, with no mask at all (a non-causal layer)
    out, _ = attnlab_attention_forward(FakeLayer(is_causal=False), q, k, v, None, scaling=0.5, position_bias=folded)
    torch.testing.assert_close(out, reference(q, k, v, bias, keep, 0.5), atol=1e-12, rtol=0)
    assert not out.isnan().any()


@pytest.mark.parametrize(
    ("T_q", "T_k", "causal"),
    [(5, 5, True), (1, 6, True), (3, 7, True), (3, 7, False)],
    ids=["square-causal", "decode-step", "static-prefill", "cross"],
)
def test_a_bias_without_a_mask_matches_hf_sdpa(T_q, T_k, causal):
    """No mask: causal layers are causal (T_q = 1: every key; 1 < T_q < T_k: HF's top-left, the keys past
    T_q a static cache's empty slots, the bias cropped with them), other layers see every key."""
    q, k, v = qkv(T_q=T_q, T_k=T_k)
    bias = torch.randn(1, 4, T_q, T_k, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    layer = FakeLayer(is_causal=causal)
    ours, _ = attnlab_attention_forward(layer, q, k, v, None, scaling=1.0, position_bias=bias)
    theirs, _ = sdpa_attention_forward(layer, q, k, v, None, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    top_left = torch.ones(T_q, T_k, dtype=torch.bool).tril() if causal and T_q > 1 else torch.ones(T_q, T_k).bool()
    torch.testing.assert_close(ours, reference(q, k, v, bias, top_left, 1.0), atol=1e-12, rtol=0)


def test_gradients_flow_into_the_bias_as_in_the_reference():
    q, k, v = qkv()
    bias = torch.randn(1, 4, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    keep = padded_causal_keep()
    probe = torch.randn(2, 5, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    grads = []
    for run in (
        lambda q, b: attnlab_attention_forward(FakeLayer(), q, k, v, keep, scaling=1.0, position_bias=b)[0],
        lambda q, b: reference(q, k, v, b.expand(2, -1, -1, -1), keep, 1.0),
    ):
        q_, b_ = q.clone().requires_grad_(), bias.clone().requires_grad_()
        (run(q_, b_) * probe).sum().backward()
        grads.append((q_.grad, b_.grad))
    assert grads[0][1].abs().sum() > 0
    for ours, theirs in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


def test_a_bias_with_softcapping_runs_the_variant():
    """Gemma 2's softcap with a bias: tanh on the scaled scores, then the bias, then the mask."""
    q, k, v = qkv()
    bias = torch.randn(1, 4, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    keep = padded_causal_keep()
    out, _ = attnlab_attention_forward(FakeLayer(), q, k, v, keep, scaling=0.5, position_bias=bias, softcap=2.0)
    rep_k, rep_v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = 2.0 * torch.tanh((q @ rep_k.transpose(-2, -1)) * 0.5 / 2.0) + bias  # (B, H, T_q, T_k)
    weights = scores.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    torch.testing.assert_close(out, (weights @ rep_v).transpose(1, 2), atol=1e-12, rtol=0)


def test_malformed_biases_are_refused():
    q, k, v = qkv()
    layer = FakeLayer()
    with pytest.raises(
        ValueError,
        match=r"FakeLayer passed position_bias of shape \(1, 4, 5, 4\), which does not broadcast to the scores' "
        r"\(B, H, T_q, T_k\) = \(2, 4, 5, 5\); .* e\.g\. \(1, 4, 5, 5\) as T5's compute_bias makes",
    ):
        attnlab_attention_forward(layer, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 4, dtype=q.dtype))
    with pytest.raises(ValueError, match=r"position_bias of shape \(4, 5, 5\)"):
        attnlab_attention_forward(layer, q, k, v, None, position_bias=torch.zeros(4, 5, 5, dtype=q.dtype))
    with pytest.raises(TypeError, match=r"FakeLayer passed position_bias as a torch.int64 tensor; .* float tensor"):
        attnlab_attention_forward(layer, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5, dtype=torch.long))
    with pytest.raises(TypeError, match=r"passed position_bias as a list"):
        attnlab_attention_forward(layer, q, k, v, None, position_bias=[0.0])
    with pytest.raises(ValueError, match=r"position_bias on meta but the query is on cpu"):
        attnlab_attention_forward(layer, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5, device="meta"))
