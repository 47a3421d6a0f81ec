"""Hugging Face GPT-2 files and models for :class:`attnlab.TinyGPT`: the ``config.json`` check, and the way back.

The weight map itself (names, ``Conv1D``'s transposes, ``c_attn`` split into Q, K, V, the config a
state dict's shapes imply) is :mod:`attnlab.models.weight_maps`, which ``TinyGPT.from_hf_gpt2`` uses
on tensors alone. Here: a GPT-2 ``config.json`` checked field by field before ``transformers`` reads
it, and :func:`to_hf_gpt2`, the only function that imports ``transformers``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..models.config import GPTConfig
from ..models.gpt import TinyGPT
from ..models.weight_maps import GPT2_MASK_BUFFERS, gpt2_weights_to_hf
from ..runtime import ModelFileError
from .file_checks import field_error, json_field

if TYPE_CHECKING:  # annotations only: transformers is optional
    from transformers import GPT2LMHeadModel

__all__ = ["check_config_json", "to_hf_gpt2"]


def check_config_json(config: Mapping[str, Any], file: str, fix: str) -> None:
    """Refuse a GPT-2 ``config.json`` whose sizes are absent, mistyped, not positive, or whose heads do not
    split the width, naming the file and the field (before ``AutoConfig`` fills absent ones with GPT-2's)."""
    sizes = {
        "vocab_size": "rows of the token embedding",
        "n_positions": "rows of the position table",
        "n_embd": "the residual width",
        "n_layer": "the transformer blocks",
        "n_head": "the attention heads",
    }
    for key, why in sizes.items():
        json_field(config, key, "positive int", file, fix, why)
    json_field(config, "n_inner", "positive int or null", file, fix, "the MLP's width, null for 4 * n_embd", None)
    json_field(config, "layer_norm_epsilon", "positive number", file, fix, "LayerNorm's epsilon", 1e-5)
    json_field(config, "activation_function", "string", file, fix, "gelu_new for GPT-2", "gelu_new")
    json_field(config, "tie_word_embeddings", "bool", file, fix, default=True)
    if config["n_embd"] % config["n_head"]:
        raise field_error(
            file, "n_head", str(config["n_head"]), f"a divisor of n_embd = {config['n_embd']}", fix, ModelFileError
        )


def to_hf_gpt2(model: TinyGPT) -> GPT2LMHeadModel:
    """A ``transformers.GPT2LMHeadModel`` with a :class:`TinyGPT`'s weights (eval mode), for parity and benchmarks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    if not isinstance(c, GPTConfig):
        raise TypeError(
            f"to_hf_gpt2 expects an attnlab.TinyGPT, got {type(model).__name__} (its .config is not a GPTConfig)."
        )
    if c.n_kv_head != c.n_head or c.position != "learned" or not c.bias:
        raise ValueError(
            f"GPT-2 cannot express this TinyGPT (n_kv_head={c.n_kv_head} vs n_head={c.n_head}, position={c.position!r}, "
            f"bias={c.bias}); only n_kv_head == n_head, position='learned' and bias=True convert."
        )
    hf_config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = GPT2LMHeadModel(hf_config)
    sd = gpt2_weights_to_hf(model.state_dict())
    with torch.no_grad():
        result = hf.load_state_dict(sd, strict=False)
    unexpected = [k for k in result.unexpected_keys]
    missing = [k for k in result.missing_keys if not GPT2_MASK_BUFFERS.search(k.removeprefix("transformer."))]
    if unexpected or missing:
        raise RuntimeError(
            f"to_hf_gpt2: key mismatch with GPT2LMHeadModel, missing {missing}, unexpected {unexpected}."
        )
    return hf.eval()
