"""Hugging Face ``LlamaForCausalLM`` configs -> :class:`attnlab.models.llama.Llama`'s :class:`LlamaConfig`.

The layouts already agree: ``nn.Linear`` weights ``(out, in)`` on both sides, and HF's
``rotate_half`` RoPE is attnlab's (:mod:`attnlab.core.rope`), so every tensor is copied as it is
and only its name changes (:func:`attnlab.models.weight_maps.llama_name_from_hf`). Here: the
``config.json`` checked field by field, and the config translated. ``transformers`` is never
imported here: the config arrives as an object (``transformers.LlamaConfig``) or as the dict of its
``config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..models.llama_config import LlamaConfig
from ..runtime import ModelFileError
from .file_checks import field_error, json_field

__all__ = ["check_config_json", "config_from_hf"]


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
            f"through attnlab.weight_files.hf_gpt2); use a Llama-architecture checkpoint."
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
