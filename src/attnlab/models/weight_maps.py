"""Each family's weight map: names in Hugging Face / GGUF files -> attnlab names.

A map holds only names and the layout changes between two checkpoints of one model: a transpose,
a row order, a fused matrix split in three, and what a state dict's shapes say about its config.
It reads no file: opening, parsing and checking weight files is :mod:`attnlab.weight_files`' job,
one layer up, so that :meth:`attnlab.TinyGPT.from_hf_gpt2` works on tensors alone and adding a
family is one config plus one weight map.

- **GPT-2** (Hugging Face ``GPT2LMHeadModel`` <-> :class:`~attnlab.models.gpt.TinyGPT`): ``Conv1D``
  weights are ``(in, out)``, the transpose of ``nn.Linear``'s ``(out, in)``; ``c_attn``'s columns
  are Q, then K, then V: once transposed, its rows split into our ``q_proj``, ``k_proj``, ``v_proj``.
- **Llama, Hugging Face** (``LlamaForCausalLM`` -> :class:`~attnlab.models.llama.Llama`): both sides
  are ``nn.Linear`` ``(out, in)`` with ``rotate_half`` RoPE, so only names change.
- **Llama, GGUF** (llama.cpp's files -> :class:`~attnlab.models.llama.Llama`): names, and the Q/K
  rows that llama.cpp's converter permutes within each head (:func:`unpermute_qk`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .config import GPTConfig

__all__ = [
    "deepseek_name_from_hf",
    "GPT2_MASK_BUFFERS",
    "gpt2_config_from_hf",
    "gpt2_weights_from_hf",
    "gpt2_weights_to_hf",
    "llama_name_from_hf",
    "GGUF_BLOCK_NAMES",
    "llama_name_from_gguf",
    "unpermute_qk",
]

# -- GPT-2: Hugging Face GPT2LMHeadModel <-> TinyGPT ---------------------------------------------------

# Old checkpoints carry the causal mask as buffers; they hold no weights.
GPT2_MASK_BUFFERS = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Hugging Face name (after "h.{i}.") -> TinyGPT name (after "transformer.h.{i}.")
_GPT2_BLOCK_NAMES = {
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "attn.c_attn.weight": "attn.in_proj.weight",
    "attn.c_attn.bias": "attn.in_proj.bias",
    "attn.c_proj.weight": "attn.out_proj.weight",
    "attn.c_proj.bias": "attn.out_proj.bias",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
    "mlp.c_fc.weight": "mlp.c_fc.weight",
    "mlp.c_fc.bias": "mlp.c_fc.bias",
    "mlp.c_proj.weight": "mlp.c_proj.weight",
    "mlp.c_proj.bias": "mlp.c_proj.bias",
}
_GPT2_TOP_NAMES = {
    "wte.weight": "transformer.wte.weight",
    "wpe.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
}


def gpt2_config_from_hf(hf_config: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a ``transformers.GPT2Config``; refuses options TinyGPT does not have."""
    refusals = [
        (getattr(hf_config, "add_cross_attention", False), "add_cross_attention=True (TinyGPT is decoder-only)"),
        (
            not getattr(hf_config, "scale_attn_weights", True),
            "scale_attn_weights=False (TinyGPT always scales by 1/sqrt(head_dim))",
        ),
        (getattr(hf_config, "scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx=True"),
        (
            getattr(hf_config, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"),
            f"activation_function={getattr(hf_config, 'activation_function', None)!r} (TinyGPT uses GPT-2's tanh GELU)",
        ),
        (
            getattr(hf_config, "n_inner", None) not in (None, 4 * hf_config.n_embd),
            f"n_inner={getattr(hf_config, 'n_inner', None)} (TinyGPT's MLP is 4 * n_embd wide)",
        ),
        (
            getattr(hf_config, "layer_norm_epsilon", 1e-5) != 1e-5,
            f"layer_norm_epsilon={getattr(hf_config, 'layer_norm_epsilon', None)} (TinyGPT uses 1e-5)",
        ),
        (
            not getattr(hf_config, "tie_word_embeddings", True),
            "tie_word_embeddings=False (TinyGPT ties lm_head to wte)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ValueError(
                f"this GPT2Config has {what}, which TinyGPT cannot express; use a GPT-2 config with its defaults for that option."
            )
    return GPTConfig(
        vocab_size=hf_config.vocab_size,
        block_size=hf_config.n_positions,
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        dropout=0.0,
        bias=True,
    )


def _gpt2_strip(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys without the ``transformer.`` prefix; ``lm_head.weight`` (tied) and mask buffers dropped."""
    out = {}
    for key, value in state_dict.items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or GPT2_MASK_BUFFERS.search(key):
            continue
        out[key] = value
    return out


def _gpt2_config_from_state_dict(sd: Mapping[str, Tensor], n_head: int | None) -> GPTConfig:
    """The config a GPT-2 state dict's shapes imply: vocab and width from ``wte``, context from ``wpe``, depth from
    the highest ``h.N``; the heads, which no shape records, from ``n_head``."""
    if n_head is None:
        raise ValueError(
            "n_head=None with a state dict: GPT-2 weights do not record the number of heads; pass "
            "n_head=... (12 for gpt2, 16 for gpt2-medium, 20 for gpt2-large, 25 for gpt2-xl) or pass the model itself."
        )
    for needed in ("wte.weight", "wpe.weight"):
        if needed not in sd:
            raise KeyError(
                f"state dict has no {needed!r} (nor 'transformer.{needed}'); expected a GPT2LMHeadModel or GPT2Model state dict."
            )
    n_layer = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"h\.(\d+)\.", k))), default=-1)
    vocab_size, n_embd = sd["wte.weight"].shape
    return GPTConfig(
        vocab_size=vocab_size, block_size=sd["wpe.weight"].size(0), n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )


def gpt2_weights_from_hf(
    model_or_state_dict: nn.Module | Mapping[str, Tensor], *, n_head: int | None = None
) -> tuple[GPTConfig, dict[str, Tensor]]:
    """The config and state dict of a :class:`TinyGPT` computing what a ``GPT2LMHeadModel`` computes.

    ``TinyGPT.from_hf_gpt2`` builds the model from them.

    Args:
        model_or_state_dict: a ``GPT2LMHeadModel`` / ``GPT2Model``, or a state dict from one
            (keys with or without ``transformer.``, e.g. ``safetensors.torch.load_file(path)``).
        n_head: heads, required with a state dict (the weights do not record it).
    """
    if isinstance(model_or_state_dict, nn.Module):
        config = gpt2_config_from_hf(model_or_state_dict.config)
        sd = _gpt2_strip(model_or_state_dict.state_dict())
    elif isinstance(model_or_state_dict, Mapping):
        sd = _gpt2_strip(model_or_state_dict)
        config = _gpt2_config_from_state_dict(sd, n_head)
    else:
        raise TypeError(
            f"model_or_state_dict must be a GPT2LMHeadModel or a state dict (Mapping[str, Tensor]), "
            f"got {type(model_or_state_dict).__name__}."
        )
    ours: dict[str, Tensor] = {}
    for key, value in sd.items():
        if key in _GPT2_TOP_NAMES:
            ours[_GPT2_TOP_NAMES[key]] = value
            continue
        m = re.match(r"h\.(\d+)\.(.+)$", key)
        if m is None or m.group(2) not in _GPT2_BLOCK_NAMES:
            raise KeyError(
                f"unexpected key {key!r} in the GPT-2 state dict; TinyGPT has no such weight (expected wte, wpe, h.N.*, ln_f)."
            )
        i, name = m.group(1), m.group(2)
        ours[f"transformer.h.{i}.{_GPT2_BLOCK_NAMES[name]}"] = (
            value.t() if name in _GPT2_CONV1D else value
        )  # Conv1D (in, out) -> (out, in)
    for key in [k for k in ours if ".attn.in_proj." in k]:  # (3E, ...) rows Q, K, V -> three projections
        fused = ours.pop(key)
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), fused.chunk(3), strict=True):
            ours[key.replace("in_proj", proj)] = part
    return config, ours


def gpt2_weights_to_hf(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A :class:`TinyGPT`'s state dict under ``GPT2LMHeadModel``'s names and layouts (``lm_head`` tied to ``wte``).

    The inverse of :func:`gpt2_weights_from_hf`: Q, K, V rows fused back into ``c_attn``, ``nn.Linear``
    weights transposed back to ``Conv1D``'s ``(in, out)``.
    """
    to_hf = {ours: theirs for theirs, ours in _GPT2_TOP_NAMES.items()}
    block_to_hf = {ours: theirs for theirs, ours in _GPT2_BLOCK_NAMES.items()}
    ours = dict(state_dict)
    for key in [k for k in ours if ".attn.q_proj." in k]:  # three projections -> c_attn's rows Q, K, V
        parts = [ours.pop(key.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        ours[key.replace("q_proj", "in_proj")] = torch.cat(parts)  # (3E, ...)
    sd: dict[str, Tensor] = {}
    for key, value in ours.items():
        if key in to_hf:
            sd[f"transformer.{to_hf[key]}"] = value
            continue
        m = re.match(r"transformer\.h\.(\d+)\.(.+)$", key)
        if m is None or m.group(2) not in block_to_hf:
            raise KeyError(f"unexpected key {key!r} in a TinyGPT state dict; GPT-2 has no such weight.")
        name = block_to_hf[m.group(2)]
        sd[f"transformer.h.{m.group(1)}.{name}"] = (
            value.t().contiguous() if name in _GPT2_CONV1D else value
        )  # (out, in) -> Conv1D (in, out)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied
    return sd


# -- Llama: Hugging Face LlamaForCausalLM -> Llama ------------------------------------------------------

# Hugging Face name (after "model.layers.{i}.") -> attnlab name (after "layers.{i}.")
_LLAMA_HF_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.o_proj.weight": "attn.out_proj.weight",
    "self_attn.o_proj.bias": "attn.out_proj.bias",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.gate_proj.bias": "mlp.gate_proj.bias",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.up_proj.bias": "mlp.up_proj.bias",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.down_proj.bias": "mlp.down_proj.bias",
}
_LLAMA_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Old checkpoints carry RoPE's inverse frequencies as buffers; they hold no weights.
_LLAMA_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def llama_name_from_hf(hf_name: str) -> str | None:
    """The :class:`Llama` parameter that HF's ``hf_name`` loads into; None for a buffer that holds no weight.

    Raises ``ValueError`` for a name a Llama does not have.
    """
    if _LLAMA_HF_IGNORED.search(hf_name):
        return None
    if hf_name in _LLAMA_HF_TOP_NAMES:
        return _LLAMA_HF_TOP_NAMES[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m is None or m.group(2) not in _LLAMA_HF_BLOCK_NAMES:
        raise ValueError(
            f"unexpected tensor {hf_name!r} in the Llama checkpoint; attnlab's Llama has model.embed_tokens, "
            f"model.layers.N.{{self_attn, mlp, input_layernorm, post_attention_layernorm}}, model.norm and lm_head."
        )
    return f"layers.{m.group(1)}.{_LLAMA_HF_BLOCK_NAMES[m.group(2)]}"


# -- DeepSeek-V3: Hugging Face -> Decoder(DeepSeekV3Config) ------------------------------------------

# DEEPSEEK_NAMES keeps HF's names, so one part of a name changes: the attention is "attn" in attnlab's block.
_DEEPSEEK_HF_ATTENTION = re.compile(r"^(model\.layers\.\d+\.)self_attn\.")
_DEEPSEEK_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def deepseek_name_from_hf(hf_name: str) -> str | None:
    """The parameter of attnlab's DeepSeek-V3 model that HF's ``hf_name`` loads into (``self_attn`` -> ``attn``);
    None for a buffer that holds no weight."""
    if _DEEPSEEK_HF_IGNORED.search(hf_name):
        return None
    return _DEEPSEEK_HF_ATTENTION.sub(r"\1attn.", hf_name)


# -- Llama: GGUF (llama.cpp) -> Llama ----------------------------------------------------------------

# GGUF name after "blk.N." -> attnlab name after "layers.N."
GGUF_BLOCK_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.out_proj",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}


def llama_name_from_gguf(gguf_name: str) -> str | None:
    """The :class:`Llama` parameter that GGUF tensor ``gguf_name`` (``blk.3.attn_q.weight``) loads into; None for
    a name a Llama does not have (the caller names the file in its refusal)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[stem]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in GGUF_BLOCK_NAMES:
        return f"layers.{m.group(1)}.{GGUF_BLOCK_NAMES[m.group(2)]}.{kind}"
    return None


def unpermute_qk(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows ``(D/2, 2)`` -> ``(2, D/2)``.

    llama.cpp rotates channel pairs ``(2i, 2i + 1)`` of a head; Hugging Face and attnlab rotate
    ``(i, i + D/2)``. llama.cpp's converter therefore permutes the rows of ``attn_q`` and ``attn_k``
    within each head (``convert_hf_to_gguf.py``: ``w.reshape(n_head, 2, D/2, E).swapaxes(1, 2)``); this
    is the inverse, as transformers' GGUF loader applies it, so that RoPE pairs the channels the model
    was trained with.

    ``w`` is ``(heads * D, ...)`` (a weight ``(heads * D, E)`` or a bias ``(heads * D,)``). llama.cpp
    stored row ``2i + j`` of a head where Hugging Face has row ``j * D/2 + i``.
    """
    D = w.size(0) // heads
    return w.reshape(heads, D // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # (heads, 2, D/2, ...) -> rows
