"""attnlab's variants inside the real Hugging Face implementations, random-init from tiny configs.

Mistral (sliding window), Gemma 2 (attention and final logit soft-capping, sliding and full layers
alternating), gpt-oss (sinks, alternating windows, MoE), Qwen 3 (QK-norm per head, a sliding layer),
OLMo 2 (QK-norm over the whole projection) run with ``attn_implementation="attnlab"`` and are
compared with transformers' own eager attention (and SDPA where the model offers it) on the same
weights, fp32: logits, left padding, greedy generation through HF's cache, weights, gradients.
BLOOM does not call ``AttentionInterface`` (its attention is written inline, ALiBi included): there
each layer's attention is replaced by attnlab's ``MultiHeadAttention(alibi=True)`` holding that
layer's weights, and the whole model must still give BLOOM's logits.

Notation: B batch, T prompt length, H query heads, W sliding window.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import attnlab.hf
import attnlab.hf.attention as hf_attention
from attnlab import MultiHeadAttention
from attnlab.core import variants
from attnlab.hf import ATTENTION_NAME, attnlab_attention_forward, hf_mask_to_keep
from hf_helpers import left_padded_inputs, run_as

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

ATOL = 1e-5
VOCAB, LAYERS, H, T, W = 100, 2, 4, 40, 8
PAD = 5  # the first row of every batch is left-padded by this many tokens
FAMILIES = ("mistral", "gemma2", "gpt_oss", "qwen3", "olmo2")
# the models whose attention passes softcap or s_aux, i.e. runs attnlab.core.variants
VARIANT_FAMILIES = ("gemma2", "gpt_oss")


def config_class(name: str) -> type:
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} provides no {name}")
    return cls


def tiny_config(family: str, **overrides):
    decoder = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        num_key_value_heads=2,  # GQA: two query heads share each K/V head
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.1,  # not 0.02: decoding then wanders, and a wrong mask moves the logits far
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    if family == "mistral":
        config = config_class("MistralConfig")(sliding_window=W, **decoder)
    elif family == "gemma2":
        # layer 0 sliding, layer 1 full (Gemma 2's alternation); caps low enough to bite at this init (without
        # them the logits move by 0.3); an untied head, else the embedding (scaled by sqrt(hidden)) makes every
        # step predict the token it was fed
        config = config_class("Gemma2Config")(
            sliding_window=W,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=16,
            tie_word_embeddings=False,
            **decoder,
        )
    elif family == "gpt_oss":
        config = config_class("GptOssConfig")(
            sliding_window=W,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},  # not YaRN's 4096-token original
            **decoder,
        )
    elif family == "qwen3":
        # layer 0 full, layer 1 sliding (max_window_layers=1)
        config = config_class("Qwen3Config")(use_sliding_window=True, sliding_window=W, max_window_layers=1, **decoder)
    elif family == "olmo2":
        config = config_class("Olmo2Config")(**{k: v for k, v in decoder.items() if k != "head_dim"})
    else:
        raise AssertionError(family)
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def build(family: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(family, **overrides), attn_implementation=ATTENTION_NAME
    ).eval()
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (2, T) and an attention mask whose first row is left-padded by PAD."""
    return left_padded_inputs(VOCAB, T, PAD)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert attnlab.hf.register() == ATTENTION_NAME


@pytest.fixture
def spy(monkeypatch):
    """Record ``(T_q, T_k)`` of each call of the variant functions that the HF attention calls."""
    calls: dict[str, list[tuple[int, int]]] = {"variant_math": [], "variant_sdpa": []}
    for name in calls:
        real = getattr(variants, name)

        def counted(q, k, *args, _real=real, _name=name, **kwargs):
            calls[_name].append((q.size(2), k.size(2)))
            return _real(q, k, *args, **kwargs)

        monkeypatch.setattr(variants, name, counted)
    return calls


@pytest.fixture(params=["whole", "blocked"])
def blocks(request, monkeypatch):
    """Run the variants on the whole call, or in blocks of 16 queries (the fewest rows a block has)."""
    if request.param == "blocked":
        monkeypatch.setattr(hf_attention, "BLOCK_SCORES", 1)
    return request.param


def references(model: nn.Module) -> tuple[str, ...]:
    return ("eager", "sdpa") if model._supports_sdpa else ("eager",)


def logits(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = inputs()
    return model(ids).logits, model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager_and_sdpa(family, blocks, spy):
    model = build(family)
    real = inputs()[1].bool()  # padded positions' logits are meaningless in every implementation
    ours = run_as(model, ATTENTION_NAME, logits)
    for reference in references(model):
        theirs = run_as(model, reference, logits)
        torch.testing.assert_close(ours[0], theirs[0], atol=ATOL, rtol=0, msg=reference)
        torch.testing.assert_close(ours[1][real], theirs[1][real], atol=ATOL, rtol=0, msg=reference)
    # the padding reached attnlab: without it, the padded row's real positions would move
    assert (ours[1][0, PAD:] - ours[0][0, PAD:]).abs().max() > 0.1
    variant_calls = spy["variant_math"] + spy["variant_sdpa"]
    if family not in VARIANT_FAMILIES:
        assert variant_calls == []  # plain attention: attnlab.core.functional, as in test_hf_attention.py
    elif blocks == "whole":
        assert variant_calls == [(T, T)] * (2 * LAYERS)
    else:
        # blocks of 16 queries, layer 0 sliding, layer 1 full, in each of the two forwards: a sliding
        # block sees at most 16 + W - 1 keys, a full one the keys up to its last query
        sliding = [(16, 16), (16, 16 + W - 1), (8, 8 + W - 1)]
        full = [(16, 16), (16, 32), (8, 40)]
        assert variant_calls == 2 * (sliding + full)


@pytest.mark.parametrize(
    ("family", "feature"),
    [
        ("mistral", {"sliding_window": 4 * T}),
        ("gemma2", {"attn_logit_softcapping": None}),
        ("gemma2", {"sliding_window": 4 * T}),
        ("gpt_oss", {"sliding_window": 4 * T}),
        ("qwen3", {"sliding_window": 4 * T}),
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_each_variant_moves_the_logits(family, feature):
    """The configs are chosen so that each variant bites: a wrong window or softcap fails the tests above."""
    model, without = build(family), build(family, **feature)
    without.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (model(inputs()[0]).logits - without(inputs()[0]).logits).abs().max() > 0.05


def test_sinks_move_the_logits():
    model = build("gpt_oss")
    ids = inputs()[0]
    with torch.no_grad():
        before = model(ids).logits
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink nothing flows to: plain softmax
        assert (model(ids).logits - before).abs().max() > 0.05


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_the_cache_matches_eager(family, cache, blocks):
    model = build(family)
    ids, mask = inputs()
    new = 8  # past the window in the sliding layers, whose dynamic HF cache then rolls (T_k = W keys)

    def greedy(m):
        return m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation=cache,  # static: fixed-size buffers, T_k = T + new from the prefill on
        )

    ours = run_as(model, ATTENTION_NAME, greedy)
    assert ours.shape == (2, T + new)
    assert torch.equal(ours, run_as(model, "eager", greedy))
    assert max(len(set(row.tolist())) for row in ours[:, T:]) > 3  # decoding wanders: equality means something


@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_output_attentions_match_eager(family, spy):
    model = build(family)
    ids, mask = inputs()

    def attentions(m):
        out = m(ids, attention_mask=mask, output_attentions=True)
        return out.logits, out.attentions

    (ours, weights), (theirs, ref_weights) = (
        run_as(model, ATTENTION_NAME, attentions),
        run_as(model, "eager", attentions),
    )
    assert spy["variant_math"] == [(T, T)] * LAYERS and spy["variant_sdpa"] == []
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=ATOL, rtol=0)
    assert len(weights) == len(ref_weights) == LAYERS
    for w, ref in zip(weights, ref_weights, strict=True):
        assert w.shape == ref.shape == (2, H, T, T)
        torch.testing.assert_close(w[1], ref[1], atol=ATOL, rtol=0)
        torch.testing.assert_close(w[0, :, PAD:], ref[0, :, PAD:], atol=ATOL, rtol=0)
    if family == "gpt_oss":  # the sink takes a share: rows sum to less than 1
        assert weights[0][1].sum(-1).max() < 0.99


@pytest.mark.parametrize("family", VARIANT_FAMILIES)
def test_gradients_match_eager(family, blocks):
    """Fine-tuning through attnlab: every gradient, the sink logits' included, as eager's."""
    model = build(family).train()  # attention dropout is 0.0, so train mode is deterministic
    ids, mask = inputs()
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, PAD] = -100  # predicted from a padded position, whose output differs by design (zeros here)

    def grads(implementation):
        model.set_attn_implementation(implementation)
        model.zero_grad()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours, theirs = grads(ATTENTION_NAME), grads("eager")
    model.set_attn_implementation(ATTENTION_NAME)
    assert ours.keys() == theirs.keys()
    if family == "gpt_oss":
        assert "model.layers.0.self_attn.sinks" in ours
    for name, grad in ours.items():
        torch.testing.assert_close(grad, theirs[name], atol=ATOL, rtol=1e-5, msg=name)


# --- the function itself, called as Gemma 2's and gpt-oss's layers call it ---------------------------


class FakeLayer(nn.Module):
    is_causal = True


def reference(q, k, v, keep, scale, softcap=None, sinks=None):
    """Soft-capping and sinks written out in float64 over a (B, 1, T_q, T_k) keep mask; empty rows zero."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = (q.double() @ k.transpose(-2, -1)) * scale  # (B, H, T_q, T_k)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    e = torch.exp(s - s.amax(-1, keepdim=True)) * keep  # (B, H, T_q, T_k), blocked keys 0
    total = e.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks.double()[None, :, None, None] - s.amax(-1, keepdim=True))
    w = torch.where(total > 0, e / total, 0.0)
    return (w @ v).transpose(1, 2).float()  # (B, T_q, H, D)


@pytest.mark.parametrize("blocked", [False, True], ids=["whole", "blocked"])
@pytest.mark.parametrize("variant", ["softcap", "sinks", "both"])
def test_variants_match_a_float64_reference(variant, blocked, monkeypatch):
    if blocked:
        monkeypatch.setattr(hf_attention, "BLOCK_SCORES", 1)  # blocks of 16 queries
    g = torch.Generator().manual_seed(2)
    B, G, T_, D = 2, 2, 50, 8
    q, k, v = (torch.randn(B, n, T_, D, generator=g) * 2 for n in (H, G, G))
    i, j = torch.arange(T_)[:, None], torch.arange(T_)[None, :]
    keep = ((j <= i) & (i - j < 6)).expand(B, 1, T_, T_).clone()  # causal, window 6
    keep[0, :, :, :20] = False  # row 0 left-padded by 20: its first block of 16 queries sees no key at all
    softcap = 1.5 if variant != "sinks" else None
    sinks = torch.randn(H, generator=g) if variant != "softcap" else None
    out, none = attnlab_attention_forward(FakeLayer(), q, k, v, keep, scaling=0.3, softcap=softcap, s_aux=sinks)
    assert none is None and out.shape == (B, T_, H, D)
    torch.testing.assert_close(out, reference(q, k, v, keep, 0.3, softcap, sinks), atol=ATOL, rtol=0)
    assert torch.equal(out[0, :20], torch.zeros(20, H, D))  # padded queries: zeros, not NaN


@pytest.mark.parametrize("variant", ["softcap", "sinks"])
def test_bf16_is_as_accurate_as_transformers_eager(variant):
    """flash-attention's rule: error against a float64 reference at most 2x that of plain bf16 attention,
    here the model's own eager function (Gemma 2's for softcap, gpt-oss's for sinks) in bf16."""
    name = "gemma2" if variant == "softcap" else "gpt_oss"
    eager = pytest.importorskip(f"transformers.models.{name}.modeling_{name}").eager_attention_forward
    g = torch.Generator().manual_seed(3)
    B, G, T_, D = 2, 2, 64, 16
    q, k, v = (torch.randn(B, n, T_, D, generator=g) * 2 for n in (H, G, G))
    i, j = torch.arange(T_)[:, None], torch.arange(T_)[None, :]
    keep = ((j <= i) & (i - j < 24)).expand(B, 1, T_, T_)  # causal, window 24
    softcap = 3.0 if variant == "softcap" else None
    sinks = torch.randn(H, generator=g) if variant == "sinks" else None
    expected = reference(q, k, v, keep, 0.25, softcap, sinks)  # (B, T, H, D)

    bf16 = [t.bfloat16() for t in (q, k, v)]
    layer = FakeLayer()  # what the eager functions read from their layer
    layer.num_key_value_groups, layer.head_dim = H // G, D
    layer.sinks = None if sinks is None else sinks.bfloat16()
    ours, _ = attnlab_attention_forward(layer, *bf16, keep, scaling=0.25, softcap=softcap, s_aux=layer.sinks)
    additive = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill(~keep, torch.finfo(torch.bfloat16).min)
    theirs, _ = eager(layer, *bf16, additive, scaling=0.25, **({} if softcap is None else {"softcap": softcap}))
    error, plain = ((out.float() - expected).abs().max() for out in (ours, theirs))
    assert error <= 2 * plain, (error, plain)


def test_malformed_sinks_are_refused():
    q, k, v = (torch.randn(1, n, 5, 8) for n in (H, 2, 2))
    with pytest.raises(ValueError, match=r"FakeLayer passed s_aux of shape \(2,\); .* shape \(4,\)"):
        attnlab_attention_forward(FakeLayer(), q, k, v, None, s_aux=torch.zeros(2))


# --- BLOOM: ALiBi, written inline in BLOOM's attention -----------------------------------------------


class AttnlabBloomAttention(nn.Module):
    """BLOOM's attention layer computed by ``MultiHeadAttention(alibi=True)`` with the layer's own weights.

    BLOOM adds ``m_h * j`` (``j`` the key's position among the real tokens) and attnlab ``-m_h * |i - j|``:
    for the keys a causal query sees the two differ by ``m_h * i``, the same over a row, which the
    softmax ignores; so the slopes and the sign must be right and nothing else is shared.
    """

    def __init__(self, hf_layer: nn.Module) -> None:
        super().__init__()
        E, heads = hf_layer.hidden_size, hf_layer.num_heads
        D = E // heads
        self.mha = MultiHeadAttention(E, heads, alibi=True)
        # BLOOM's fused projection interleaves per head: rows (H, 3, D), not (3, H, D)
        weight = hf_layer.query_key_value.weight.view(heads, 3, D, E)
        bias = hf_layer.query_key_value.bias.view(heads, 3, D)
        with torch.no_grad():
            for s, proj in enumerate((self.mha.q_proj, self.mha.k_proj, self.mha.v_proj)):
                proj.weight.copy_(weight[:, s].reshape(E, E))
                proj.bias.copy_(bias[:, s].reshape(E))
            self.mha.out_proj.load_state_dict(hf_layer.dense.state_dict())

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False, **kwargs):
        assert layer_past is None, "run BLOOM with use_cache=False: this layer keeps no cache"
        keep = None if attention_mask is None else hf_mask_to_keep(attention_mask)[0]  # (B, 1, T, T)
        return self.mha(hidden_states, attn_mask=keep, is_causal=True) + residual, None


def bloom_pair() -> tuple[nn.Module, nn.Module]:
    """A tiny random BLOOM, and a copy whose layers' attention is attnlab's (:class:`AttnlabBloomAttention`)."""
    torch.manual_seed(0)
    config = config_class("BloomConfig")(
        vocab_size=VOCAB,
        hidden_size=64,
        n_layer=LAYERS,
        n_head=H,
        pad_token_id=0,
        initializer_range=0.1,  # attention then moves the logits, and decoding wanders
        tie_word_embeddings=False,  # else each greedy step repeats the token it was fed
    )
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    ours = copy.deepcopy(theirs)
    for block in ours.transformer.h:
        block.self_attention = AttnlabBloomAttention(block.self_attention)
    return ours, theirs


def test_bloom_alibi_through_multi_head_attention():
    ours, theirs = bloom_pair()
    ids, mask = inputs()
    real = mask.bool()
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            expected = theirs(ids, use_cache=False, **kwargs).logits
            got = ours(ids, use_cache=False, **kwargs).logits
            torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=0)
        # ALiBi bites here: without it the logits move
        for block in ours.transformer.h:
            block.self_attention.mha.alibi_slopes = None
        assert (ours(ids, use_cache=False).logits - expected).abs().max() > 0.05
        for block in ours.transformer.h:
            block.self_attention.mha.alibi_slopes = torch.ones(H)  # wrong slopes: moved too
        assert (ours(ids, use_cache=False).logits - expected).abs().max() > 0.05


def test_bloom_greedy_generate_through_multi_head_attention():
    """Without a cache on either side (attnlab's layer here keeps none): each step recomputes the prompt."""
    ours, theirs = bloom_pair()
    ids, mask = inputs()

    def greedy(m):
        return m.generate(
            ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False, use_cache=False
        )

    with torch.no_grad():
        got, expected = greedy(ours), greedy(theirs)
    assert torch.equal(got, expected)
    assert max(len(set(row.tolist())) for row in got[:, T:]) > 3
