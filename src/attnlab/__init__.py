"""attnlab: multi-head attention for PyTorch, readable, verified and fast."""

# ruff: noqa: E402  # the torch version is checked before the imports that need a recent torch

import inspect as _pyinspect
import sys
from typing import Any

from attnlab_launch import end_guard as _end_guard
from attnlab_launch import guard_start as _guard_start
from attnlab_launch import running_module as _running_module

# `python -m attnlab...` imports this first: a signal in its seconds of imports is one line, not a traceback;
# the guard is ended by attnlab/__main__.py, or at the end of this file for `python -m attnlab.<module>`
_start_guard = _guard_start() if sys.argv[:1] == ["-m"] else {}

from .runtime.torch_version import check_torch_version

check_torch_version()  # before anything that needs a recent torch: one sentence, not a traceback from deep inside

from torch import nn

from .compat.swap import SwapReport
from .compat.swap import swap as _swap_modules
from .core.attention import MultiHeadAttention
from .core.functional import math_attention, sdpa_attention
from .core.kv_cache import KVCache
from .core.mla import MultiHeadLatentAttention
from .core.mla_cache import MLACache
from .heads.report import HeadReport, inspect
from .hf.autoregister import install as _install_hf_register
from .models.config import DecoderConfig
from .models.decoder import Decoder
from .models.deepseek import DeepSeekV3, DeepSeekV3Config
from .models.generation import generate, generate_steps, left_pad
from .models.gpt import GPTConfig, TinyGPT
from .models.llama import Llama
from .models.llama_config import LlamaConfig
from .tools.stream import Stream, StreamEvent, stream
from .weight_files.pretrained import from_pretrained
from .weight_files.saved_model import load_checkpoint, save_checkpoint
from .weight_files.tokenizer import ByteTokenizer, CharTokenizer

__all__ = [
    "ByteTokenizer",
    "CharTokenizer",
    "GPTConfig",
    "TinyGPT",
    "Llama",
    "LlamaConfig",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "Decoder",
    "DecoderConfig",
    "from_pretrained",
    "inspect",
    "HeadReport",
    "generate",
    "generate_steps",
    "stream",
    "Stream",
    "StreamEvent",
    "left_pad",
    "load_checkpoint",
    "save_checkpoint",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "MLACache",
    "swap",
    "SwapReport",
    "math_attention",
    "sdpa_attention",
]
__version__ = "0.1.0"

_install_hf_register()  # attn_implementation="attnlab" works once transformers' models import; transformers not imported now


def swap(model: Any, **kwargs: Any) -> SwapReport:
    """:func:`attnlab.compat.swap`, after :func:`attnlab.hf.register` when ``model`` is (or holds) a
    Hugging Face model, so that one call also sets ``attn_implementation="attnlab"`` there.

    ``compat`` sits beside ``hf`` in the package's layers and does not import it; the package root,
    above both, joins them. Arguments and result as :func:`attnlab.compat.swap`."""
    if (
        isinstance(model, nn.Module)
        and "transformers" in sys.modules
        and any(type(m).__module__.startswith("transformers.") for m in model.modules())
    ):
        from .hf import register

        register()
    return _swap_modules(model, **kwargs)


swap.__signature__ = _pyinspect.signature(_swap_modules)  # type: ignore[attr-defined]

if _start_guard and _running_module() != "attnlab":  # `python -m attnlab.quant` and the like: their own handlers
    _end_guard(_start_guard)
