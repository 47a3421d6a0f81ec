"""Weights between Hugging Face ``GPT2LMHeadModel`` and :class:`attnlab.TinyGPT`, both ways.

Hugging Face GPT-2 uses ``Conv1D``, whose weight is ``(in, out)``, the transpose of
``nn.Linear``'s ``(out, in)``; its ``c_attn`` columns are Q, then K, then V: once transposed,
its rows split into our ``q_proj``, ``k_proj`` and ``v_proj``. ``transformers`` is imported only by
:func:`to_hf_gpt2`: importing weights needs only tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..runtime import ModelFileError
from .config import GPTConfig
from .file_checks import field_error, json_field

if TYPE_CHECKING:  # annotations only: transformers is optional
    from transformers import GPT2LMHeadModel

__all__ = ["weights_from_hf", "to_hf_gpt2", "check_config_json", "config_from_hf"]

# Old checkpoints carry the causal mask as buffers; they hold no weights.
_IGNORED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Hugging Face name (after "h.{i}.") -> TinyGPT name (after "transformer.h.{i}.")
_BLOCK_NAMES = {
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
_TOP_NAMES = {
    "wte.weight": "transformer.wte.weight",
    "wpe.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
}


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


def config_from_hf(hf_config) -> GPTConfig:
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


def _strip(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Keys without the ``transformer.`` prefix; ``lm_head.weight`` (tied) and mask buffers dropped."""
    out = {}
    for key, value in state_dict.items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or _IGNORED.search(key):
            continue
        out[key] = value
    return out


def _config_from_state_dict(sd: Mapping[str, Tensor], n_head: int | None) -> GPTConfig:
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


def weights_from_hf(
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
        config = config_from_hf(model_or_state_dict.config)
        sd = _strip(model_or_state_dict.state_dict())
    elif isinstance(model_or_state_dict, Mapping):
        sd = _strip(model_or_state_dict)
        config = _config_from_state_dict(sd, n_head)
    else:
        raise TypeError(
            f"model_or_state_dict must be a GPT2LMHeadModel or a state dict (Mapping[str, Tensor]), "
            f"got {type(model_or_state_dict).__name__}."
        )
    ours: dict[str, Tensor] = {}
    for key, value in sd.items():
        if key in _TOP_NAMES:
            ours[_TOP_NAMES[key]] = value
            continue
        m = re.match(r"h\.(\d+)\.(.+)$", key)
        if m is None or m.group(2) not in _BLOCK_NAMES:
            raise KeyError(
                f"unexpected key {key!r} in the GPT-2 state dict; TinyGPT has no such weight (expected wte, wpe, h.N.*, ln_f)."
            )
        i, name = m.group(1), m.group(2)
        ours[f"transformer.h.{i}.{_BLOCK_NAMES[name]}"] = (
            value.t() if name in _CONV1D else value
        )  # Conv1D (in, out) -> (out, in)
    for key in [k for k in ours if ".attn.in_proj." in k]:  # (3E, ...) rows Q, K, V -> three projections
        fused = ours.pop(key)
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), fused.chunk(3), strict=True):
            ours[key.replace("in_proj", proj)] = part
    return config, ours


def to_hf_gpt2(model: nn.Module) -> GPT2LMHeadModel:
    """A ``transformers.GPT2LMHeadModel`` with a :class:`TinyGPT`'s weights (eval mode), for parity and benchmarks.

    ``model`` is typed loosely because this module sits below ``gpt.py`` (which imports it).
    """
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
    to_hf = {ours: theirs for theirs, ours in _TOP_NAMES.items()}
    sd: dict[str, Tensor] = {}
    ours = dict(model.state_dict())
    for key in [k for k in ours if ".attn.q_proj." in k]:  # three projections -> c_attn's rows Q, K, V
        parts = [ours.pop(key.replace("q_proj", p)) for p in ("q_proj", "k_proj", "v_proj")]
        ours[key.replace("q_proj", "in_proj")] = torch.cat(parts)  # (3E, ...)
    for key, value in ours.items():
        if key in to_hf:
            sd[f"transformer.{to_hf[key]}"] = value
            continue
        m = re.match(r"transformer\.h\.(\d+)\.(.+)$", key)
        assert m is not None  # every TinyGPT key outside _TOP_NAMES is transformer.h.N.*
        name = next(h for h, o in _BLOCK_NAMES.items() if o == m.group(2))
        sd[f"transformer.h.{m.group(1)}.{name}"] = (
            value.t().contiguous() if name in _CONV1D else value
        )  # (out, in) -> Conv1D (in, out)
    sd["lm_head.weight"] = sd["transformer.wte.weight"]  # tied
    with torch.no_grad():
        result = hf.load_state_dict(sd, strict=False)
    unexpected = [k for k in result.unexpected_keys]
    missing = [k for k in result.missing_keys if not _IGNORED.search(k.removeprefix("transformer."))]
    if unexpected or missing:
        raise RuntimeError(
            f"to_hf_gpt2: key mismatch with GPT2LMHeadModel, missing {missing}, unexpected {unexpected}."
        )
    return hf.eval()
