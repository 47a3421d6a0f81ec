"""Parity with Hugging Face GPT-2 on the same random weights: logits, greedy generate, padding."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from attnlab import GPTConfig, TinyGPT
from attnlab.models.generation import generate, left_pad
from attnlab.weight_files.hf_gpt2 import to_hf_gpt2

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def hf_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    # initializer_range 0.5, not GPT-2's 0.02: logits that spread (std ~4) make greedy decoding
    # wander over many tokens instead of repeating one, so that token parity means something.
    config = GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=64,
        vocab_size=97,
        n_positions=64,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.5,
    )
    return GPT2LMHeadModel(config).eval()  # random init, nothing downloaded


def test_logits_match_hf(hf_model):
    ours = TinyGPT.from_hf_gpt2(hf_model).eval()
    idx = torch.randint(0, 97, (3, 20))
    with torch.no_grad():
        diff = (ours(idx) - hf_model(idx).logits).abs().max().item()
    assert diff <= 1e-4


@pytest.mark.parametrize("prefix", [True, False], ids=["transformer.-keys", "bare-keys"])
def test_import_from_a_safetensors_state_dict(hf_model, tmp_path, prefix):
    from safetensors.torch import load_file, save_file

    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    if not prefix:
        sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    sd["h.0.attn.bias" if not prefix else "transformer.h.0.attn.bias"] = torch.ones(1, 1, 64, 64)  # old mask buffer
    save_file(sd, tmp_path / "model.safetensors")
    ours = TinyGPT.from_hf_gpt2(load_file(tmp_path / "model.safetensors"), n_head=4).eval()
    assert (ours.config.n_layer, ours.config.block_size, ours.config.vocab_size) == (2, 64, 97)
    idx = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf_model(idx).logits, atol=1e-4, rtol=0)


def test_greedy_generate_matches_hf(hf_model):
    ours = TinyGPT.from_hf_gpt2(hf_model).eval()
    idx = torch.randint(0, 97, (2, 7))
    theirs = hf_model.generate(
        idx, attention_mask=torch.ones_like(idx), do_sample=False, max_new_tokens=20, pad_token_id=0
    )
    assert all(len(set(row.tolist())) >= 5 for row in theirs[:, 7:])  # a varied continuation, not one token repeated
    assert torch.equal(generate(ours, idx, 20, temperature=0), theirs)
    assert torch.equal(generate(ours, idx, 20, temperature=0, use_cache=False), theirs)


def test_left_padded_greedy_generate_matches_hf(hf_model):
    ours = TinyGPT.from_hf_gpt2(hf_model).eval()
    idx, pad = left_pad([[5, 8, 13], [2, 3, 5, 7, 11, 13, 17], [42, 1]], pad_token_id=0)
    theirs = hf_model.generate(idx, attention_mask=(~pad).long(), do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(generate(ours, idx, 12, temperature=0, key_padding_mask=pad), theirs)


def test_export_to_hf_round_trips():
    ours = TinyGPT(GPTConfig(vocab_size=61, block_size=40, n_layer=2, n_head=2, n_embd=32)).eval()
    hf = to_hf_gpt2(ours)
    idx = torch.randint(0, 61, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-4, rtol=0)
    back = TinyGPT.from_hf_gpt2(hf)
    for (k, a), (_, b) in zip(sorted(ours.state_dict().items()), sorted(back.state_dict().items()), strict=True):
        assert torch.equal(a, b), k


def test_configs_gpt2_cannot_express_are_refused(hf_model):
    with pytest.raises(
        ValueError, match=r"GPT-2 cannot express this TinyGPT \(n_kv_head=1 vs n_head=2.*only n_kv_head == n_head"
    ):
        to_hf_gpt2(TinyGPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8, n_kv_head=1)))
    with pytest.raises(ValueError, match=r"position='rotary'"):
        to_hf_gpt2(TinyGPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8, position="rotary")))
    odd = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=10, n_positions=8, scale_attn_by_inverse_layer_idx=True)
    )
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx=True, which TinyGPT cannot express"):
        TinyGPT.from_hf_gpt2(odd)
    with pytest.raises(
        ValueError,
        match=r"n_head=None with a state dict: GPT-2 weights do not record the number of heads; pass n_head=",
    ):
        TinyGPT.from_hf_gpt2(hf_model.state_dict())
    sd = dict(hf_model.state_dict())
    sd["transformer.h.0.attn.q_attn.weight"] = torch.zeros(64, 64)
    with pytest.raises(KeyError, match="unexpected key 'h.0.attn.q_attn.weight'"):
        TinyGPT.from_hf_gpt2(sd, n_head=4)
