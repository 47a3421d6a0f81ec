"""Save and load a :class:`attnlab.TinyGPT` as a directory: ``model.safetensors`` + ``config.json``.

Loading reads tensors with safetensors and everything else as JSON: a checkpoint never runs
code (no pickle). Each file is written to a temporary name in the same directory and moved
into place with ``os.replace``, so a crash mid-save never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, fields
from pathlib import Path
from typing import cast

import torch
from torch import nn

from .gpt import GPTConfig, TinyGPT
from .tokenizer import Tokenizer, tokenizer_from_json

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError"]

FORMAT = "attnlab.TinyGPT"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint directory that is missing, incomplete or of another format."""


def _atomic_write(path: Path, write) -> None:
    # A fresh name that the writer creates itself (not mkstemp's 0600 file): permissions follow the umask.
    tmp = str(path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"))
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(model: TinyGPT, directory: str | os.PathLike, *, tokenizer: Tokenizer | None = None) -> Path:
    """Write ``model`` (and its tokenizer, if any) into ``directory``; returns the directory."""
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {model.config.vocab_size}; "
            f"build the model with GPTConfig(vocab_size >= {tokenizer.vocab_size})."
        )
    from safetensors.torch import save  # imported only when saving: ``import attnlab`` stays light

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "config": asdict(model.config),
        "dtype": str(cast(nn.Embedding, model.transformer.wte).weight.dtype).removeprefix("torch."),
        "tokenizer": None if tokenizer is None else tokenizer.to_json(),
    }
    blob = save(tensors, metadata={"format": FORMAT})  # bytes, written by us: safetensors' own file would be 0600
    _atomic_write(directory / "model.safetensors", lambda p: Path(p).write_bytes(blob))
    _atomic_write(directory / "config.json", lambda p: Path(p).write_text(json.dumps(meta, indent=2) + "\n"))
    return directory


def load_checkpoint(
    directory: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[TinyGPT, Tokenizer | None]:
    """``(model in eval mode, tokenizer or None)`` from a directory written by :func:`save_checkpoint`."""
    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint {str(directory)!r} does not exist or is not a directory; pass the directory that save_checkpoint wrote (holding config.json and model.safetensors)."
        )
    for p in (config_path, weights_path):
        if not p.is_file():
            raise CheckpointError(
                f"checkpoint {str(directory)!r} has no {p.name}; pass a directory written by attnlab's save_checkpoint."
            )
    try:
        meta = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{str(config_path)!r} is not valid JSON ({e}); the checkpoint is corrupt, save it again."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(config_path)!r} has format {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}; it was not written by attnlab's save_checkpoint."
        )
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(meta["config"]) - known)
    if unknown:
        raise CheckpointError(
            f"{str(config_path)!r} has config keys {unknown} that GPTConfig does not know; upgrade attnlab to the version that wrote it."
        )
    from safetensors.torch import load_file  # imported only when loading

    model = TinyGPT(GPTConfig(**meta["config"]))
    state = load_file(str(weights_path), device=str(device))
    model.load_state_dict(state, strict=True)
    model.to(device=device, dtype=getattr(torch, meta.get("dtype", "float32")))
    tokenizer = None if meta.get("tokenizer") is None else tokenizer_from_json(meta["tokenizer"])
    return model.eval(), tokenizer
