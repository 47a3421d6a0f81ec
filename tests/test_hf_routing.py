"""Models whose attention is inline (never called by name) under ``attn_implementation="attnlab"``.

transformers accepts any registered name on any model. BLOOM and MPNet (transformers 5.24) compute
attention inline but build their masks through the mask function registered under the name; given
``sdpa_mask``'s bool mask they would add it to the scores (+1 kept, +0 blocked) and padding would
stop blocking. attnlab gives them HF's eager mask instead and warns once (src/attnlab/hf/routing.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnlab.hf  # noqa: E402
from attnlab.hf import routing  # noqa: E402

TINY = {
    "mpnet": ("MPNetModel", "MPNetConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_head=4)),
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
    ),
}


def _run(model_type: str, impl: str, mask_function=None):
    model_name, config_name, kw = TINY[model_type]
    layers = {"n_layer": 2} if model_type == "bloom" else {"num_hidden_layers": 2}
    config = getattr(transformers, config_name)(vocab_size=99, **layers, **kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)._from_config(config, attn_implementation=impl).eval()
    ids = torch.randint(1, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding in row 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(input_ids=ids, attention_mask=mask)
    hidden = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return hidden[mask.bool()], [str(w.message) for w in caught if "computed inline" in str(w.message)]


@pytest.fixture(autouse=True)
def _registered():
    attnlab.hf.register()
    routing._warn_inline.cache_clear()


@pytest.mark.parametrize("model_type", ["mpnet", "bloom"])
def test_an_inline_attention_model_gets_eager_masks_and_is_told(model_type):
    eager, _ = _run(model_type, "eager")
    ours, warned = _run(model_type, "attnlab")
    assert torch.equal(ours, eager)
    assert len(warned) == 1
    assert warned[0].startswith(f"attn_implementation='attnlab' was set on a {model_type!r} model, whose attention")
    assert "attnlab's attention does not run there" in warned[0] and "attn_implementation='eager'" in warned[0]


@pytest.mark.parametrize("model_type", ["mpnet", "bloom"])
def test_without_the_guard_padding_would_silently_stop_blocking(model_type, monkeypatch):
    """What the guard prevents: the bool mask reaching the inline code moves the real positions' outputs."""
    monkeypatch.setattr(routing, "calls_attention_by_name", lambda config: True)  # the guard off
    eager, _ = _run(model_type, "eager")
    unguarded, _ = _run(model_type, "attnlab")
    assert (unguarded - eager).abs().max() > 1e-3


def test_a_model_that_calls_by_name_keeps_sdpa_masks_and_no_warning():
    eager, _ = _run("llama", "eager")
    ours, warned = _run("llama", "attnlab")
    assert warned == []
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=0)


def test_which_models_call_by_name():
    assert routing.calls_attention_by_name(transformers.LlamaConfig()) is True
    assert routing.calls_attention_by_name(transformers.T5Config()) is True  # not "backend compatible", yet by name
    assert routing.calls_attention_by_name(transformers.BloomConfig()) is False
    assert routing.calls_attention_by_name(transformers.MPNetConfig()) is False

    class RemoteCode:
        model_type = "not-a-transformers-model"

    assert routing.calls_attention_by_name(RemoteCode()) is None
    assert routing.calls_attention_by_name(object()) is None
