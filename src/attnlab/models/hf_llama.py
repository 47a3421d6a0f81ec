"""Hugging Face ``LlamaForCausalLM`` -> :class:`attnlab.models.llama.Llama`: config and weight names.

The layouts already agree: ``nn.Linear`` weights ``(out, in)`` on both sides, and HF's
``rotate_half`` RoPE is attnlab's (:mod:`attnlab.core.rope`), so every tensor is copied as it is
and only its name changes. ``transformers`` is never imported here: the config arrives as an
object (``transformers.LlamaConfig``) or as the dict of its ``config.json``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..runtime import ModelFileError
from .file_checks import field_error, json_field
from .llama_config import LlamaConfig

__all__ = ["check_config_json", "config_from_hf", "attnlab_name"]

# Hugging Face name (after "model.layers.{i}.") -> attnlab name (after "layers.{i}.")
_BLOCK_NAMES = {
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
_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Old checkpoints carry RoPE's inverse frequencies as buffers; they hold no weights.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    if isinstance(hf_config, Mapping):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def _rope(hf_config: Any) -> tuple[float, str]:
    """``(theta, rope_type)`` from transformers 5's ``rope_parameters`` or 4.x's ``rope_theta``/``rope_scaling``."""
    params = _get(hf_config, "rope_parameters") or {}
    scaling = _get(hf_config, "rope_scaling") or {}
    theta = params.get("rope_theta", _get(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


def check_config_json(config: Mapping[str, Any], file: str, fix: str) -> None:
    """Refuse a Llama ``config.json`` whose sizes are absent, mistyped, not positive, or whose heads do not
    split the width, naming the file and the field (transformers' own checks name neither).

    Read before ``AutoConfig``, which fills absent fields with Llama-7B's defaults: a config that
    lacks a size is damaged, and weights of another size would only disagree later.
    """
    sizes = {
        "vocab_size": "rows of the token embedding",
        "hidden_size": "the residual width",
        "intermediate_size": "the MLP's hidden width",
        "num_hidden_layers": "the decoder blocks",
        "num_attention_heads": "the query heads",
    }
    for key, why in sizes.items():
        json_field(config, key, "positive int", file, fix, why)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = json_field(config, "num_key_value_heads", "positive int or null", file, fix, "the key/value heads", None)
    json_field(config, "max_position_embeddings", "positive int", file, fix, "the longest sequence", 2048)
    json_field(config, "rms_norm_eps", "positive number", file, fix, "RMSNorm's epsilon", 1e-6)
    json_field(config, "rope_theta", "positive number", file, fix, "RoPE's base", 10000.0)
    rope = json_field(config, "rope_parameters", "object", file, fix, "rope_theta and rope_type", {})
    json_field(rope, "rope_theta", "positive number", file, fix, "RoPE's base", 10000.0, within="rope_parameters")
    json_field(config, "hidden_act", "string", file, fix, "silu for Llama", "silu")
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        json_field(config, key, "bool", file, fix, default=False)
    if hidden % heads or (hidden // heads) % 2:
        raise field_error(
            file,
            "num_attention_heads",
            str(heads),
            f"a divisor of hidden_size = {hidden} leaving an even head dim (got {hidden / heads:g}; RoPE rotates "
            f"channel pairs)",
            fix,
            ModelFileError,
        )
    if kv is not None and heads % kv:
        raise field_error(
            file, "num_key_value_heads", str(kv), f"a divisor of num_attention_heads = {heads}", fix, ModelFileError
        )


def config_from_hf(hf_config: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama config; refuses options attnlab's Llama does not have.

    Args:
        hf_config: a ``transformers.LlamaConfig`` or the dict of a ``config.json`` (model_type "llama").
    """
    model_type = _get(hf_config, "model_type")
    if model_type != "llama":
        raise ValueError(
            f"config has model_type={model_type!r}; attnlab's Llama converts model_type 'llama' (GPT-2 goes to TinyGPT "
            f"through attnlab.models.hf_gpt2); use a Llama-architecture checkpoint."
        )
    hidden, heads = int(_get(hf_config, "hidden_size")), int(_get(hf_config, "num_attention_heads"))
    head_dim = _get(hf_config, "head_dim") or hidden // heads
    theta, rope_type = _rope(hf_config)
    refusals = [
        (rope_type != "default", f"RoPE type {rope_type!r} (attnlab's Llama has plain RoPE, no scaling)"),
        (
            _get(hf_config, "hidden_act", "silu") != "silu",
            f"hidden_act={_get(hf_config, 'hidden_act')!r} (SwiGLU uses silu)",
        ),
        (
            head_dim != hidden // heads,
            f"head_dim={head_dim} != hidden_size // num_attention_heads = {hidden // heads} (attnlab's heads split the width)",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ValueError(
                f"this Llama config has {what}, which attnlab's Llama cannot express; use a checkpoint without that option."
            )
    return LlamaConfig(
        vocab_size=int(_get(hf_config, "vocab_size")),
        block_size=int(_get(hf_config, "max_position_embeddings", 2048)),
        n_layer=int(_get(hf_config, "num_hidden_layers")),
        n_head=heads,
        n_kv_head=int(_get(hf_config, "num_key_value_heads") or heads),
        n_embd=hidden,
        intermediate_size=int(_get(hf_config, "intermediate_size")),
        rope_base=theta,
        norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),  # HF LlamaConfig's default is untied
        attention_bias=bool(_get(hf_config, "attention_bias", False)),
        mlp_bias=bool(_get(hf_config, "mlp_bias", False)),
    )


def attnlab_name(hf_name: str) -> str | None:
    """The :class:`Llama` parameter that HF's ``hf_name`` loads into; None for a buffer that holds no weight.

    Raises ``ValueError`` for a name a Llama does not have.
    """
    if _IGNORED.search(hf_name):
        return None
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(
            f"unexpected tensor {hf_name!r} in the Llama checkpoint; attnlab's Llama has model.embed_tokens, "
            f"model.layers.N.{{self_attn, mlp, input_layernorm, post_attention_layernorm}}, model.norm and lm_head."
        )
    return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
