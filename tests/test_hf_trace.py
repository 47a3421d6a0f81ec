"""``trace`` on a Hugging Face model running ``attn_implementation="attnlab"``: each layer's call of attnlab's
attention, with the shapes that flowed, the backend that ran and the error against the float64 reference; and
``last_backend`` / ``last_backend_reason`` on each HF layer, as on attnlab's own modules.

Tiny random models built from a config (no download): Llama with GQA 4/2, GPT-2, Gemma 2 (soft-capping).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, GPT2LMHeadModel, LlamaConfig

import attnlab.hf
from attnlab.hf import attention as hf_attention
from attnlab.hf.trace import FLOAT32_ALLOWED, HFAttentionCall, trace_hf
from attnlab.tools.trace import trace

attnlab.hf.register()


def _llama(implementation: str = "attnlab") -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=implementation).eval()


IDS = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))  # (B, T)


def test_trace_records_each_layers_call_with_its_shapes_backend_and_reference():
    model = _llama()
    with torch.no_grad(), trace(model) as calls:
        model(IDS)
    assert [c.module for c in calls] == [
        "model.layers.0.self_attn (LlamaAttention, layer 0)",
        "model.layers.1.self_attn (LlamaAttention, layer 1)",
    ]
    call = calls[0]
    assert isinstance(call, HFAttentionCall)
    shapes = {r.stage: r.shape for r in call.rows}
    assert shapes == {
        "query": [2, 4, 10, 16],  # (B, H, T_q, D): 64 wide in 4 heads
        "key": [2, 2, 10, 16],  # 2 K/V heads: GQA as the model has it
        "value": [2, 2, 10, 16],
        "mask": None,  # no padding: HF hands no mask, attnlab applies causality itself
        "scale": None,
        "context": [2, 4, 10, 16],
        "output": [2, 10, 4, 16],
    }
    assert (call.backend, call.reason, call.dtype) == ("sdpa", None, "float32")
    assert 0 < call.error < 1e-6 and call.allowed == FLOAT32_ALLOWED and call.agrees
    text = call.to_text()
    assert text.splitlines()[0] == "model.layers.0.self_attn (LlamaAttention, layer 0)"
    assert "2 K/V heads for 4 query heads (GQA)" in text and "none handed: causal, attnlab's own" in text
    assert text.endswith(f"largest error {call.error:.1e} of the output's scale, allowed 2e-05 in float32: agrees")
    assert json.loads(json.dumps(call.to_dict()))["agrees"] is True


def test_the_reference_catches_a_wrong_output(monkeypatch):
    """The float64 comparison is the call run again on the math backend: an attention whose SDPA result is off
    by 1e-3 is reported as disagreeing."""
    real = hf_attention.attend

    def off(backend, *args, **kwargs):
        context, weights, adapted = real(backend, *args, **kwargs)
        return (context + 1e-3 if backend == "sdpa" else context), weights, adapted

    monkeypatch.setattr(hf_attention, "attend", off)
    model = _llama()
    with torch.no_grad(), trace(model) as calls:
        model(IDS)
    assert all(c.error > 1e-4 and not c.agrees for c in calls)
    assert calls[0].to_text().endswith("in float32: DISAGREES")


def test_one_layer_with_padding_and_the_weights_asked_for():
    model = _llama()
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0  # the first row left-padded by 3
    with torch.no_grad(), trace_hf(model, layer=1) as calls:
        model(IDS, attention_mask=mask, output_attentions=True)
    (call,) = calls
    assert call.module == "model.layers.1.self_attn (LlamaAttention, layer 1)"
    mask_row = next(r for r in call.rows if r.stage == "mask")
    assert mask_row.shape == [2, 1, 10, 10] and "bool, True = may attend" in mask_row.what
    # causal: the 45 entries above the diagonal of each 10 x 10 row; padding: keys 0-2 of row 0 for the queries
    # at or after them (10 + 9 + 8)
    assert f"{2 * 45 + 27} of 200 entries blocked" in mask_row.what, mask_row.what
    assert call.backend == "math" and call.reason.startswith("output_attentions=True")
    assert call.agrees


def test_last_backend_and_its_reason_on_each_hf_layer_as_on_attnlabs_own_modules():
    model = _llama()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        model(IDS)
        assert (attn.last_backend, attn.last_backend_reason) == ("sdpa", None)
        model(IDS, output_attentions=True)
        assert attn.last_backend == "math" and "weights were asked for" in attn.last_backend_reason
    assert attnlab.hf.backends_used(model) == dict.fromkeys(
        ["model.layers.0.self_attn", "model.layers.1.self_attn"], "math"
    )

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=4, n_embd=32, vocab_size=100)).eval().to(torch.bfloat16)
    gpt2.set_attn_implementation("attnlab")
    with torch.no_grad(), trace(gpt2) as calls:
        gpt2(torch.randint(0, 100, (1, 12)))
    layer = gpt2.transformer.h[0].attn
    assert layer.last_backend == "sdpa" and "computed in float32" in layer.last_backend_reason
    (call,) = calls
    assert call.dtype == "bfloat16" and call.reason == layer.last_backend_reason
    assert FLOAT32_ALLOWED < call.allowed < 2e-2 and call.agrees  # flash-attention's rule in bf16


def test_soft_capping_runs_on_math_and_says_why():
    torch.manual_seed(0)
    cfg = Gemma2Config(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, attn_logit_softcapping=2.0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnlab").eval()
    with torch.no_grad(), trace(model) as calls:
        model(torch.randint(0, 100, (1, 12)))
    assert [c.backend for c in calls] == ["math", "math"]
    assert all(c.reason.startswith("softcap=2.0: SDPA cannot apply tanh") and c.agrees for c in calls)


def test_a_model_on_another_implementation_is_refused_with_the_call_that_switches_it():
    model = _llama("sdpa")
    with pytest.raises(ValueError) as err, trace(model):
        pass
    assert str(err.value) == (
        "trace found no attnlab attention in LlamaForCausalLM: its config runs attn_implementation='sdpa', and "
        "attnlab traces the layers that call its own; switch the model first with "
        "model.set_attn_implementation('attnlab') (or load it with attn_implementation='attnlab')."
    )
    with pytest.raises(ValueError, match=r"^layer=2, but LlamaForCausalLM's attention layers are numbered 0 \.\. 1;"):
        with trace_hf(_llama(), layer=2):
            pass


def test_the_recorder_is_gone_after_the_block_even_when_the_forward_raises():
    model = _llama()
    with pytest.raises(IndexError), trace(model):
        model(torch.tensor([[500]]))  # past the vocabulary
    assert hf_attention.OBSERVERS == []
    with torch.no_grad(), trace(model) as calls:
        model(IDS)
    model(IDS)  # outside the block: nothing more recorded
    assert len(calls) == 2 and hf_attention.OBSERVERS == []
