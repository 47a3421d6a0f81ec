"""attnlab's module as today's Hugging Face attention layers, on their own weights; and attnlab's attention
inside their whole models.

Notation: B batch, T positions, E hidden size, H query heads, G key/value heads, D query/key head dim.

Part 1, one layer at a time. Each test builds a tiny random transformers config and the layer itself
(``Qwen3NextAttention``, ``GPTNeoXAttention``, ``Gemma3Attention``, ``Llama4TextAttention``), draws every
parameter at random (the norms' weights too, so that Qwen3-Next's and Gemma 3's ``1 + weight`` is exercised),
converts it with :mod:`attnlab.hf.layers`, feeds both the same hidden states and the same position embeddings
(the model's own rotary module), HF the mask its model builds (transformers' own mask functions, "eager" form)
and attnlab the same pattern in its own words (``is_causal``, ``key_padding_mask``, the module's ``window``,
``document_ids`` for Llama 4's chunks), and compares the outputs of the query positions that are not padding.

Part 2, whole models through the plug-in (``attn_implementation="attnlab"``): tiny random DeepSeek-V3 (MLA,
Dv != D), Qwen3-Next, Gemma 3 (text) and Llama 4 (text) CausalLMs match "eager" on the logits.

Tolerances (fp32): HF's layers cast to float32 inside (eager's softmax, the RMSNorms, Llama 4's complex RoPE), so
float64 is only tighter for GPT-NeoX (its float64 run uses HF's SDPA path, which keeps float64 throughout).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    GPTNeoXConfig,
    Llama4TextConfig,
    PretrainedConfig,
    Qwen3NextConfig,
)
from transformers.masking_utils import create_causal_mask, create_chunked_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma3.modeling_gemma3 import Gemma3Attention, Gemma3RotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding
from transformers.models.llama4.modeling_llama4 import Llama4TextAttention, Llama4TextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextAttention, Qwen3NextRotaryEmbedding

import attnlab.hf
from attnlab.core.rope import rope_cos_sin
from attnlab.hf import ATTENTION_NAME
from attnlab.hf.layers import from_gemma3, from_gpt_neox, from_llama4_text, from_qwen3_next, llama4_rope
from hf_helpers import left_padded_inputs, run_as

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

LAYER_ATOL = 2e-6  # fp32, one layer, outputs up to ~6: measured 1.8e-7 to 9.5e-7 (see each test)
LOGITS_ATOL = 1e-5  # fp32, a whole 2-layer model's logits: measured 4.8e-7 to 8.3e-7
B, T, PAD = 2, 12, 3  # row 0 is left-padded by PAD tokens


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter drawn at random: a weight (out, in) from N(0, 1/in), so that outputs stay of order 1 and an
    absolute tolerance means the same for every layer; a bias or a norm's weight from N(0, 0.2^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            std = p.size(1) ** -0.5 if p.dim() == 2 else 0.2
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * std)
    return module.eval()


def hidden_states(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(B, T, config.hidden_size, generator=g, dtype=torch.float64).to(dtype)  # (B, T, E)


def padding() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's 2-D attention mask (1 = token), attnlab's key_padding_mask (True = pad) and the real positions (B, T)."""
    attention_mask = torch.ones(B, T, dtype=torch.long)
    attention_mask[0, :PAD] = 0
    return attention_mask, attention_mask == 0, attention_mask.bool()


def hf_mask(make, config: PretrainedConfig, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The 4-D mask transformers' model would hand its layers, built by its own mask function."""
    mask = make(
        config=config,
        inputs_embeds=x,
        attention_mask=attention_mask,
        cache=None,
        position_ids=torch.arange(T)[None].expand(B, T),
        allow_is_causal_skip=False,
    )
    assert isinstance(mask, torch.Tensor) and mask.shape == (B, 1, T, T)
    return mask


def positions() -> torch.Tensor:
    return torch.arange(T)[None].expand(B, T)  # (B, T)


def assert_real_rows_close(ours: torch.Tensor, theirs: torch.Tensor, real: torch.Tensor, atol: float) -> float:
    """Compare the outputs ``(B, T, E)`` of the positions that are not padding; return the largest difference."""
    err = (ours[real] - theirs[real]).abs().max().item()
    assert err <= atol, f"max |attnlab - HF| = {err:.3g} > {atol:g}"
    return err


# --- Qwen3-Next: gated full attention, partial RoPE 0.25, (1 + weight) qk-norm ---------------------------------


def qwen3_next_config() -> Qwen3NextConfig:
    config = Qwen3NextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # H * D = 64 != E = 32
        num_hidden_layers=1,
        layer_types=["full_attention"],
        vocab_size=61,
    )
    config._attn_implementation = "eager"
    return config


def test_qwen3_next_layer_converts_as_stated():
    config = qwen3_next_config()
    assert config.rope_parameters["partial_rotary_factor"] == 0.25  # the model's own default
    layer = randomize(Qwen3NextAttention(config, layer_idx=0), seed=1)
    mha = from_qwen3_next(layer)
    assert (mha.head_dim, mha.v_head_dim, mha.rope_dims, mha.output_gate) == (16, 16, 4, "elementwise")
    assert isinstance(mha.gate_proj, nn.Linear) and mha.gate_proj.weight.shape == (4 * 16, 32)
    # HF's rows: per head, 16 query rows then 16 gate rows
    rows = layer.q_proj.weight.view(4, 2, 16, 32)
    torch.testing.assert_close(mha.q_proj.weight[16:32], rows[1, 0], rtol=0, atol=0)
    torch.testing.assert_close(mha.gate_proj.weight[16:32], rows[1, 1], rtol=0, atol=0)
    torch.testing.assert_close(mha.q_norm.weight, 1.0 + layer.q_norm.weight, rtol=0, atol=0)


def test_qwen3_next_gated_attention_matches_hf():
    config = qwen3_next_config()
    layer = randomize(Qwen3NextAttention(config, layer_idx=0), seed=1)
    mha = from_qwen3_next(layer)
    x = hidden_states(config)
    attention_mask, pad, real = padding()
    cos, sin = Qwen3NextRotaryEmbedding(config)(x, positions())  # (B, T, 4): rope_dims wide
    assert cos.shape == (B, T, 4)
    with torch.no_grad():
        theirs, _ = layer(x, (cos, sin), hf_mask(create_causal_mask, config, x, attention_mask))
        ours = mha(x, rope=(cos, sin), is_causal=True, key_padding_mask=pad)
        assert_real_rows_close(ours, theirs, real, LAYER_ATOL)  # measured 1.8e-7
        # the gate matters: the same module without it is far off
        gate, mha.gate_proj = mha.gate_proj, None
        assert (mha(x, rope=(cos, sin), is_causal=True, key_padding_mask=pad) - ours)[real].abs().max() > 0.05
        mha.gate_proj = gate


# --- GPT-NeoX: partial RoPE (rotary_pct 0.25), fused per-head QKV ------------------------------------------------


def gpt_neox_config(implementation: str) -> GPTNeoXConfig:
    config = GPTNeoXConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64, vocab_size=61, rotary_pct=0.25
    )
    config._attn_implementation = implementation
    return config


@pytest.mark.parametrize(
    "dtype,implementation,atol",
    [(torch.float32, "eager", LAYER_ATOL), (torch.float64, "sdpa", 1e-12)],  # measured 4.8e-7 and 6.7e-16
)
def test_gpt_neox_partial_rope_matches_hf(dtype, implementation, atol):
    config = gpt_neox_config(implementation)
    layer = randomize(GPTNeoXAttention(config, layer_idx=0), seed=2).to(dtype)
    mha = from_gpt_neox(layer)
    assert (mha.head_dim, mha.rope_dims) == (16, 4)
    x = hidden_states(config, dtype)
    attention_mask, pad, real = padding()
    cos, sin = GPTNeoXRotaryEmbedding(config)(x, positions())  # (B, T, 4)
    with torch.no_grad():
        theirs, _ = layer(x, hf_mask(create_causal_mask, config, x, attention_mask), position_embeddings=(cos, sin))
        ours = mha(x, rope=(cos, sin), is_causal=True, key_padding_mask=pad)
    assert_real_rows_close(ours, theirs, real, atol)


def test_gpt_neox_rotates_only_its_rope_dims():
    """RoPE on the first 4 of 16 channels: with the cos/sin of the whole head the output moves."""
    config = gpt_neox_config("eager")
    layer = randomize(GPTNeoXAttention(config, layer_idx=0), seed=2)
    x = hidden_states(config)
    cos, sin = GPTNeoXRotaryEmbedding(config)(x, positions())
    partial = from_gpt_neox(layer)
    whole = from_gpt_neox(layer)
    whole.rope_dims = None  # the same weights, RoPE over all 16 channels
    with torch.no_grad():
        a = partial(x, rope=(cos, sin), is_causal=True)
        b = whole(x, rope=rope_cos_sin(torch.arange(T), 16, base=config.rope_parameters["rope_theta"]), is_causal=True)
    assert (a - b).abs().max() > 1e-3


# --- Gemma 3: local (window, base 1e4) / global (base 1e6) layers, head_dim apart, query_pre_attn_scalar ---------


WINDOW = 4  # shorter than T: the window cuts every row past position 3


def gemma3_config() -> Gemma3TextConfig:
    config = Gemma3TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # H * D = 64 != E = 32
        query_pre_attn_scalar=24,  # scale 24 ** -0.5, not D ** -0.5
        sliding_window=WINDOW,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=61,
    )
    config._attn_implementation = "eager"
    return config


def gemma3_stack():
    """The two HF layers (local, global), attnlab's conversions, and each layer type's rotary embeddings."""
    config = gemma3_config()
    layers = [randomize(Gemma3Attention(config, layer_idx=i), seed=10 + i) for i in range(2)]
    x = hidden_states(config)
    rotary = Gemma3RotaryEmbedding(config)
    rope = {kind: rotary(x, positions(), kind) for kind in ("sliding_attention", "full_attention")}
    return config, layers, [from_gemma3(layer) for layer in layers], x, rope


def test_gemma3_conversion_reads_each_layer_type():
    config, _, ours, _, rope = gemma3_stack()
    assert (ours[0].window, ours[1].window) == (WINDOW, None)
    assert ours[0].head_dim == ours[1].head_dim == 16 and ours[0].scale == 24**-0.5
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert not torch.allclose(rope["sliding_attention"][0], rope["full_attention"][0])


def test_gemma3_local_global_stack_matches_hf():
    """x -> x + local(x) -> + global(...): each layer fed its own mask and rotary base, compared layer by layer."""
    config, layers, ours, x, rope = gemma3_stack()
    attention_mask, pad, real = padding()
    masks = [
        hf_mask(create_sliding_window_causal_mask, config, x, attention_mask),
        hf_mask(create_causal_mask, config, x, attention_mask),
    ]
    h_hf = h_ours = x
    with torch.no_grad():
        for layer, mha, mask, kind in zip(layers, ours, masks, config.layer_types, strict=True):
            theirs, _ = layer(h_hf, rope[kind], mask)
            mine = mha(h_ours, rope=rope[kind], is_causal=True, key_padding_mask=pad)
            assert_real_rows_close(mine, theirs, real, LAYER_ATOL)  # measured 3.6e-7 (local), 9.5e-7 (global)
            h_hf, h_ours = h_hf + theirs, h_ours + mine
    assert_real_rows_close(h_ours, h_hf, real, LAYER_ATOL)


@pytest.mark.parametrize("window", [WINDOW - 1, WINDOW + 1])
def test_gemma3_window_off_by_one_would_show(window):
    """attnlab's window W is HF's sliding_window W (HF keeps q - W < k <= q): W - 1 or W + 1 differs."""
    config, layers, ours, x, rope = gemma3_stack()
    attention_mask, pad, real = padding()
    mask = hf_mask(create_sliding_window_causal_mask, config, x, attention_mask)
    ours[0].window = window
    with torch.no_grad():
        theirs, _ = layers[0](x, rope["sliding_attention"], mask)
        mine = ours[0](x, rope=rope["sliding_attention"], is_causal=True, key_padding_mask=pad)
    assert (mine - theirs)[real].abs().max() > 1e-3


# --- Llama 4: chunked attention on RoPE layers (L2 qk-norm), a NoPE full-attention layer every 4th --------------


CHUNK = 4


def llama4_config() -> Llama4TextConfig:
    config = Llama4TextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=4,  # no_rope_layers [1, 1, 1, 0]: the 4th is NoPE
        attention_chunk_size=CHUNK,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_local_experts=2,
        vocab_size=61,
    )
    config._attn_implementation = "eager"
    return config


@pytest.mark.parametrize("layer_idx", [0, 3])
def test_llama4_layer_matches_hf(layer_idx):
    config = llama4_config()
    assert config.no_rope_layers == [1, 1, 1, 0] and config.use_qk_norm
    assert config.layer_types[layer_idx] == ("chunked_attention" if layer_idx < 3 else "full_attention")
    layer = randomize(Llama4TextAttention(config, layer_idx), seed=20 + layer_idx)
    mha = from_llama4_text(layer)
    rope_layer = layer_idx < 3
    assert mha.qk_norm == ("head" if rope_layer else None)  # L2 norm on RoPE layers only
    x = hidden_states(config)
    attention_mask, pad, real = padding()
    freqs_cis = Llama4TextRotaryEmbedding(config)(x, positions())  # (B, T, D/2) complex
    if rope_layer:  # chunks counted from each row's first real token, as HF's chunked mask does
        mask = hf_mask(create_chunked_causal_mask, config, x, attention_mask)
        document_ids = (torch.arange(T)[None] - torch.tensor([[PAD], [0]])) // CHUNK  # (B, T)
        kwargs = dict(rope=llama4_rope(freqs_cis), document_ids=document_ids)
    else:
        mask = hf_mask(create_causal_mask, config, x, attention_mask)
        kwargs = {}
    with torch.no_grad():
        theirs, _ = layer(x, freqs_cis, mask)
        ours = mha(x, is_causal=True, key_padding_mask=pad, **kwargs)
        assert_real_rows_close(ours, theirs, real, LAYER_ATOL)  # measured 4.8e-7 (chunked), 3.6e-7 (NoPE)
        if rope_layer:  # the chunks matter: over the whole causal prefix the output moves
            whole = mha(x, is_causal=True, key_padding_mask=pad, rope=kwargs["rope"])
            assert (whole - ours)[real].abs().max() > 1e-3


def test_llama4_rope_pairs_are_reordered_not_dropped():
    """Without the row reordering, attnlab's (c, c + D/2) pairs rotate other channels than HF's (2c, 2c + 1)."""
    config = llama4_config()
    layer = randomize(Llama4TextAttention(config, 0), seed=20)
    mha = from_llama4_text(layer)
    with torch.no_grad():
        mha.q_proj.weight.copy_(layer.q_proj.weight)
        mha.k_proj.weight.copy_(layer.k_proj.weight)
    x = hidden_states(config)
    freqs_cis = Llama4TextRotaryEmbedding(config)(x, positions())
    with torch.no_grad():
        theirs, _ = layer(x, freqs_cis, hf_mask(create_causal_mask, config, x, torch.ones(B, T, dtype=torch.long)))
        ours = mha(x, is_causal=True, rope=llama4_rope(freqs_cis))
    assert (ours - theirs).abs().max() > 1e-3


# --- Part 2: whole models through the plug-in ------------------------------------------------------------------


VOCAB = 61
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,  # as tests/test_hf_attention.py: a wrong mask moves the logits by far more than ATOL
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)


def model_config(family: str) -> PretrainedConfig:
    if family == "deepseek_v3":  # MLA: D = 8 + 4 (nope + rope), Dv = 6
        return DeepseekV3Config(
            **(COMMON | dict(num_key_value_heads=4)),
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=6,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        )
    if family == "qwen3_next":  # one linear-attention layer, one gated full-attention layer
        return Qwen3NextConfig(
            **COMMON,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        )
    if family == "gemma3":
        return Gemma3TextConfig(
            **COMMON,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
        )
    if family == "llama4":  # a chunked RoPE layer, then a NoPE full-attention layer
        return Llama4TextConfig(
            **COMMON,
            head_dim=16,
            attention_chunk_size=4,
            num_local_experts=2,
            intermediate_size_mlp=64,
            no_rope_layers=[1, 0],
        )
    raise AssertionError(family)


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert attnlab.hf.register() == ATTENTION_NAME


FAMILIES = ("deepseek_v3", "qwen3_next", "gemma3", "llama4")


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager_through_the_plugin(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(family), attn_implementation=ATTENTION_NAME).eval()
    ids, mask = left_padded_inputs(VOCAB, T, PAD)
    real = mask.bool()

    def logits(m):
        return m(ids).logits, m(ids, attention_mask=mask).logits

    ours = run_as(model, ATTENTION_NAME, logits)
    theirs = run_as(model, "eager", logits)
    # measured 4.8e-7 (Qwen3-Next), 7.2e-7 (DeepSeek-V3), 7.9e-7 (Gemma 3), 8.3e-7 (Llama 4)
    torch.testing.assert_close(ours[0], theirs[0], atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(ours[1][real], theirs[1][real], atol=LOGITS_ATOL, rtol=0)
    assert (ours[1][0, PAD:] - ours[0][0, PAD:]).abs().max() > 0.01  # the padding reached attnlab


def test_deepseek_v3_value_heads_reach_attnlab_narrower_than_the_keys(monkeypatch):
    """MLA hands attnlab q, k of D = 12 and v of Dv = 6: the context it returns is (B, T, H, 6)."""
    from attnlab.hf import attention as hf_attention

    seen = []
    real = hf_attention.attnlab_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        out = real(module, query, key, value, *args, **kwargs)
        seen.append((query.size(-1), key.size(-1), value.size(-1), tuple(out[0].shape)))
        return out

    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTENTION_NAME, spy)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config("deepseek_v3"), attn_implementation=ATTENTION_NAME).eval()
    ids, _ = left_padded_inputs(VOCAB, T, PAD)
    with torch.no_grad():
        model(ids)
    assert seen == [(12, 12, 6, (B, T, 4, 6))] * 2


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_with_the_cache_matches_eager(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(family), attn_implementation=ATTENTION_NAME).eval()
    ids, _ = left_padded_inputs(VOCAB, 6, 0)

    def generate(m):
        return m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)

    torch.testing.assert_close(run_as(model, ATTENTION_NAME, generate), run_as(model, "eager", generate))
