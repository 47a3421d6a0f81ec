"""attnlab's Llama on tiny random configs: its pieces against Hugging Face's, the KV cache against
recomputation, padding invariance, the compiled decode step, and GGUF's Q/K row order.

Whole-model parity with HF's ``LlamaForCausalLM`` (random weights through ``save_pretrained``) is in
``test_pretrained.py``; with the real SmolLM2 in ``test_smollm2.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from attnlab import generate, left_pad
from attnlab.models.generation import generate_steps
from attnlab.models.llama import Llama, LlamaConfig, RMSNorm
from attnlab.models.weight_maps import unpermute_qk

transformers = pytest.importorskip("transformers")


def tiny(**overrides) -> Llama:
    kw = dict(
        vocab_size=61, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48, rope_base=500.0
    )
    kw.update(overrides)
    model = Llama(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-unit norms and nonzero biases, so that a mistake in either shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_hf_llama_rmsnorm_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = RMSNorm(24, eps=1e-5).to(dtype), LlamaRMSNorm(24, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = (torch.randn(3, 5, 24) * 4).to(dtype)
    assert torch.equal(ours(x), theirs(x))
    assert ours(x).dtype == dtype


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # GQA, tied
        dict(n_kv_head=4, tie_embeddings=False),  # MHA, untied head
        dict(n_kv_head=1, attention_bias=True, mlp_bias=True),  # MQA, every bias
    ],
    ids=["gqa-tied", "mha-untied", "mqa-biases"],
)
def test_cached_generation_equals_recomputation(overrides, one_thread):
    model = tiny(**overrides)
    idx = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    cached = list(generate_steps(model, idx, 10, temperature=0))
    recomputed = list(generate_steps(model, idx, 10, temperature=0, use_cache=False))
    for a, b in zip(cached, recomputed, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)


def test_each_row_of_a_left_padded_batch_equals_that_prompt_alone(one_thread):
    model = tiny()
    prompts = [[5, 8], [2, 3, 5, 7, 11], [13, 17, 19]]
    idx, pad = left_pad(prompts)
    batch = generate(model, idx, 8, temperature=0, key_padding_mask=pad)
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), 8, temperature=0)
        assert torch.equal(batch[row, idx.size(1) :], alone[0, len(prompt) :]), row


def test_untied_head_is_its_own_matrix_and_tied_has_none():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert tied.lm_head is None and tied.output_weight is tied.embed.weight
    assert "lm_head.weight" not in tied.state_dict()
    assert untied.output_weight is untied.lm_head.weight
    assert untied.num_params() == tied.num_params() + 61 * 32


@pytest.mark.slow  # torch.compile of a 2-layer model: ~10-20 s on 2 CPU cores
def test_decode_step_compiles_once_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    model = tiny()
    idx, pad = left_pad([[3, 1, 4, 1], [5, 9]])
    counters.clear()
    compiled = list(generate_steps(model, idx, 6, temperature=0, key_padding_mask=pad, compile=True))
    assert counters["stats"]["unique_graphs"] == 1  # every decode step has the same shapes
    assert not counters["graph_break"]
    eager = list(generate_steps(model, idx, 6, temperature=0, key_padding_mask=pad))
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)


def test_bf16_model_keeps_bf16_cache_and_agrees_with_fp32():
    model = tiny()
    idx = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    ref = model(idx)
    low = model.to(torch.bfloat16)
    assert low.setup_caches(1, 8)[0].k.dtype == torch.bfloat16
    out = low(idx)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute``: what GGUF files hold for Q/K."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(3 * 8, 5), (3 * 8,)], ids=["weight", "bias"])
def test_unpermute_qk_inverts_llama_cpp_and_matches_transformers(shape):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    stored = llama_cpp_permute(w, heads=3)
    assert not np.array_equal(stored, w)  # the permutation does move rows
    ours = unpermute_qk(torch.from_numpy(stored), heads=3)
    assert torch.equal(ours, torch.from_numpy(w))
    theirs = LlamaTensorProcessor()._reverse_permute_weights(stored, 3, 3)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs)))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(n_embd=30, n_head=4), r"n_embd divisible by n_head with an even head dim.*n_embd=30, n_head=4"),
        (dict(n_head=4, n_kv_head=3), r"n_kv_head=3 must divide n_head=4"),
        (dict(n_layer=0), r"LlamaConfig.n_layer must be a positive int, got 0"),
        (dict(rope_base=1.0), r"rope_base must be > 1"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**overrides)


def test_out_of_vocabulary_ids_and_too_long_caches_are_one_sentence():
    model = tiny()
    with pytest.raises(ValueError, match=r"token id 61 at \[0, 1\], outside the model's vocabulary of 61 ids"):
        model(torch.tensor([[1, 61]]))
    with pytest.raises(ValueError, match=r"max_len=65 exceeds block_size=64"):
        model.setup_caches(1, 65)
