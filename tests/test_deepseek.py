"""A DeepSeek-V3 checkpoint in attnlab's own decoder: the family added as data (a config and a weight map).

A tiny random Hugging Face ``DeepseekV3ForCausalLM`` (dense layers) is converted into
``attnlab.models.deepseek.DeepSeekV3``; on both paths of the latent attention its logits equal HF's
eager ones, greedy decoding gives HF's tokens, and the cache holds ``kv_lora_rank + qk_rope_head_dim``
values per token and layer.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.core.mla import MultiHeadLatentAttention
from attnlab.core.mla_cache import MLACache
from attnlab.models.deepseek import DeepSeekV3, DeepSeekV3Config, config_from_hf

transformers = pytest.importorskip("transformers")


def tiny_hf(q_lora_rank: int | None = 24, seed: int = 0):
    config = transformers.DeepseekV3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=2,  # both layers dense
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM._from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # HF initialises the norms to one: make them visible in the comparison
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("path", ["naive", "absorbed"])
def test_converted_model_gives_hf_logits(path, q_lora_rank):
    hf = tiny_hf(q_lora_rank)
    ours = DeepSeekV3.from_hf(hf, mla_path=path).eval()
    assert all(isinstance(b.attn, MultiHeadLatentAttention) for b in ours.blocks)
    idx = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        expected = hf(idx).logits
        got = ours(idx)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert {b.attn.last_path for b in ours.blocks} == {path}


def test_greedy_tokens_equal_hfs_on_both_paths():
    hf = tiny_hf()
    prompt = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for path in ("naive", "absorbed", "auto"):
        ours = DeepSeekV3.from_hf(hf, mla_path=path).eval()
        assert torch.equal(ours.generate(prompt, 12, temperature=0), theirs), path


def test_the_cache_holds_the_latent_and_the_rope_key_only():
    ours = DeepSeekV3.from_hf(tiny_hf()).eval()
    caches = ours.setup_caches(2, 20)
    assert all(isinstance(c, MLACache) for c in caches)
    assert ours.kv_cache_bytes_per_token == 2 * (16 + 8) * 4  # n_layer * (C + R) * float32
    assert sum(c.bytes_per_token for c in caches) == ours.kv_cache_bytes_per_token
    idx = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        full = ours(idx)
        prefill = ours(idx[:, :5], caches=caches, cache_positions=torch.arange(5))
        steps = [ours(idx[:, t : t + 1], caches=caches, cache_positions=torch.tensor([t])) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat([prefill, *steps], 1), full, rtol=1e-5, atol=1e-5)


def test_a_moe_checkpoint_is_refused_with_the_fix():
    config = transformers.DeepseekV3Config(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8)
    with pytest.raises(
        ValueError, match=r"mixture-of-experts layers .* set first_k_dense_replace >= num_hidden_layers"
    ):
        config_from_hf(config)


def test_unsupported_calls_say_so():
    model = DeepSeekV3(DeepSeekV3Config(vocab_size=50, n_layer=1, n_head=2, n_embd=16, intermediate_size=24,
                                        kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                        v_head_dim=4))  # fmt: skip
    idx = torch.randint(0, 50, (1, 4))
    with pytest.raises(ValueError, match=r"document_ids is not supported with attention='mla'"):
        model(idx, document_ids=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.slow
def test_compiled_decode_gives_hfs_greedy_tokens():
    """The latent cache and both paths under torch.compile(fullgraph=True): one graph, HF's tokens."""
    hf = tiny_hf()
    prompt = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    ours = DeepSeekV3.from_hf(hf, mla_path="absorbed").eval()
    assert torch.equal(ours.generate(prompt, 8, temperature=0, compile=True), theirs)
