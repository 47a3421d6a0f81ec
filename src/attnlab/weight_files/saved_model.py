"""Save and load a :class:`attnlab.TinyGPT` as a directory: ``model.safetensors`` + ``config.json``.

Loading reads tensors with safetensors and everything else as JSON: a checkpoint never runs
code (no pickle). A new directory is filled under a temporary name beside it and renamed into
place, so a crash or a full disk mid-save leaves it complete or absent, never empty or half
written; into an existing directory both files are written under temporary names first, then
renamed over the old ones. A full disk is one :class:`attnlab.runtime.DiskFullError` line.

Loading checks the two files against each other before building anything from them: a damaged
file, a config that disagrees with the weights, or a directory of another kind is a
:class:`CheckpointError` naming the file and the mismatch, never a raw safetensors or
``load_state_dict`` error.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, cast

import torch

from ..models.gpt import GPTConfig, TinyGPT
from ..runtime import ModelFileError, ModelFileNotFoundError, writing
from .file_checks import check_fits_in_memory, check_values, gpt_weight_count, read_json_object, safetensors_header
from .tokenizer import Tokenizer, tokenizer_from_json

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "CheckpointNotFoundError"]

FORMAT = "attnlab.TinyGPT"
VERSION = 1
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_FIX = "copy it again, or save the checkpoint again with save_checkpoint"


class CheckpointError(ModelFileError):
    """A checkpoint directory that is missing, damaged, inconsistent or of another format.

    A ``ValueError`` (through :class:`attnlab.runtime.ModelFileError`), so ``attnlab generate``
    prints it as one line with exit code 2.
    """


class CheckpointNotFoundError(CheckpointError, ModelFileNotFoundError):
    """A checkpoint directory, or one of its two files, that is not there (also a ``FileNotFoundError``)."""


def save_checkpoint(model: TinyGPT, directory: str | os.PathLike, *, tokenizer: Tokenizer | None = None) -> Path:
    """Write ``model`` (and its tokenizer, if any) into ``directory``; returns the directory."""
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {model.config.vocab_size}; "
            f"build the model with GPTConfig(vocab_size >= {tokenizer.vocab_size})."
        )
    from safetensors.torch import save  # imported only when saving: ``import attnlab`` stays light

    directory = Path(directory)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "config": asdict(model.config),
        "dtype": str(cast(torch.Tensor, model.token_embedding.weight).dtype).removeprefix("torch."),
        "tokenizer": None if tokenizer is None else tokenizer.to_json(),
    }
    blob = save(tensors, metadata={"format": FORMAT})  # bytes, written by us: safetensors' own file would be 0600
    text = (json.dumps(meta, indent=2) + "\n").encode()
    if directory.exists():  # it may hold the caller's other files: both ours are written first, then renamed in
        _replace_files(directory, {"model.safetensors": blob, "config.json": text})
        return directory
    # A new directory is filled beside it and renamed into place: it appears complete or not at all.
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.with_name(f".{directory.name}.{uuid.uuid4().hex}.tmp")
    try:
        with writing(directory, f"{directory.name}/", len(blob) + len(text)):
            staging.mkdir()  # the umask's mode, as the directory itself would get
            for name, data in (("model.safetensors", blob), ("config.json", text)):
                with open(staging / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            os.rename(staging, directory)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def _replace_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write every file of ``files`` into ``directory`` under a temp name, then rename each into place: a write
    that fails (a full disk) leaves the old files, all of them."""
    temps = {name: directory / f".{name}.{uuid.uuid4().hex}.tmp" for name in files}
    try:
        with writing(directory, f"{directory.name}/", sum(len(d) for d in files.values())):
            for name, data in files.items():
                with open(temps[name], "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
        for name, tmp in temps.items():
            os.replace(tmp, directory / name)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def _shape_reason(key: str, c: GPTConfig) -> str:
    """The config fields that fix the shape of ``key``, as ``name=value`` pairs."""
    names: tuple[str, ...] = ("n_embd",)
    if key.endswith("wte.weight"):
        names = ("vocab_size", "n_embd")
    elif key.endswith("wpe.weight"):
        names = ("block_size", "n_embd")
    elif re.search(r"attn\.(k|v|in)_proj\.", key):
        names = ("n_kv_head", "n_head", "n_embd")
    return ", ".join(f"{n}={getattr(c, n)}" for n in names)


def _key_mismatch(expected: set[str], found: set[str], c: GPTConfig) -> str:
    """Why the tensor names of the file and of the model built from config.json differ, in words."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    layers = {int(m.group(1)) for k in found if (m := re.match(r"transformer\.h\.(\d+)\.", k))}
    if not layers:
        return f"it holds no transformer blocks (transformer.h.*) but config.json says n_layer={c.n_layer}"
    if len(layers) != c.n_layer:
        return f"it holds {len(layers)} blocks (transformer.h.0 .. h.{max(layers)}) but config.json says n_layer={c.n_layer}"
    if "transformer.wpe.weight" in missing:
        return "it has no transformer.wpe.weight but config.json says position='learned' (a table of positions)"
    if "transformer.wpe.weight" in unexpected:
        return "it has transformer.wpe.weight but config.json says position='rotary' (no table of positions)"
    if c.bias and missing and all(k.endswith(".bias") for k in missing):
        return f"it has no biases (e.g. {missing[0]}) but config.json says bias=True"
    if not c.bias and unexpected and all(k.endswith(".bias") for k in unexpected):
        return f"it has biases (e.g. {unexpected[0]}) but config.json says bias=False"
    parts = []
    if missing:
        parts.append(f"it lacks {len(missing)} tensor(s) config.json implies, e.g. {missing[:3]}")
    if unexpected:
        parts.append(f"it has {len(unexpected)} tensor(s) TinyGPT does not, e.g. {unexpected[:3]}")
    return " and ".join(parts)


def _read_meta(directory: Path) -> dict[str, Any]:
    config_path = directory / "config.json"
    meta = read_json_object(
        config_path, "the checkpoint is damaged: save it again with save_checkpoint", CheckpointError
    )
    if meta.get("format") != FORMAT:
        got = meta.get("format")
        hint = "it was not written by attnlab's save_checkpoint"
        if (directory / "model" / "config.json").is_file():  # a training run directory: its model sits in model/
            hint = f"this is a training run's directory; its model is {str(directory / 'model')!r}: pass that"
        raise CheckpointError(f"{str(config_path)!r} has format {got!r}, expected {FORMAT!r}; {hint}.")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(
            f"{str(config_path)!r} has no 'config' object (got {meta.get('config')!r}); the file is damaged: save the checkpoint again."
        )
    return meta


def _config(meta: dict[str, Any], config_path: Path) -> GPTConfig:
    known = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(meta["config"]) - known)
    if unknown:
        raise CheckpointError(
            f"{str(config_path)!r} has config keys {unknown} that GPTConfig does not know; upgrade attnlab to the version that wrote it."
        )
    try:
        return GPTConfig(**meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{str(config_path)!r} holds a config TinyGPT cannot build: {e} Fix that value in the file or save the checkpoint again."
        ) from None


def _shapes(config: GPTConfig, config_path: Path) -> dict[str, torch.Size]:
    """The state dict's shapes of ``TinyGPT(config)``, from a model on the meta device (no memory taken)."""
    try:
        with torch.device("meta"):
            return {k: v.shape for k, v in TinyGPT(config).state_dict().items()}
    except ValueError as e:  # MultiHeadAttention's own checks: heads that do not split the width
        raise CheckpointError(
            f"{str(config_path)!r} holds a config TinyGPT cannot build: {e} Fix that value in the file or save the "
            f"checkpoint again."
        ) from None


def _check_weights(weights_path: Path, config: GPTConfig, expected: dict[str, torch.Size]) -> None:
    """Read only the header of ``model.safetensors`` (checked whole: :func:`~.file_checks.safetensors_header`)
    and compare names and shapes with ``expected``."""
    header = safetensors_header(weights_path, _FIX, CheckpointError)
    shapes = {k: entry.shape for k, entry in header.tensors.items()}
    for key in [k for k in shapes if ".attn.in_proj." in k]:  # the fused layout from before the projections were split
        head, kind = key.rsplit("in_proj.", 1)
        parts = [f"{head}{proj}.{kind}" for proj in ("q_proj", "k_proj", "v_proj")]
        if not all(part in expected for part in parts):
            continue
        fused = (sum(expected[part][0] for part in parts), *expected[parts[0]][1:])  # Q, K, V rows stacked
        if shapes[key] != fused:
            raise CheckpointError(
                f"{str(weights_path)!r}: {key} has shape {shapes[key]} but config.json says {_shape_reason(key, config)} "
                f"-> {fused}; the two files come from different models: restore the config.json saved with these "
                f"weights, or save both again."
            )
        del shapes[key]  # MultiHeadAttention's load hook splits it into the three projections
        shapes.update({part: tuple(expected[part]) for part in parts})
    if set(shapes) != set(expected):
        raise CheckpointError(
            f"{str(weights_path)!r} does not match config.json: {_key_mismatch(set(expected), set(shapes), config)}; "
            f"the two files come from different models: restore the config.json saved with these weights, or save both again."
        )
    for key, want in expected.items():
        if shapes[key] != tuple(want):
            raise CheckpointError(
                f"{str(weights_path)!r}: {key} has shape {shapes[key]} but config.json says {_shape_reason(key, config)} "
                f"-> {tuple(want)}; the two files come from different models: restore the config.json saved with these "
                f"weights, or save both again."
            )


def _missing_hint(directory: Path) -> str:
    """Advice for a checkpoint directory that is not there: a lab run of seed 002's block writes none."""
    run_config = directory.parent / "config.json"
    try:
        kind = json.loads(run_config.read_text(encoding="utf-8"))["model"]["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        kind = None
    if directory.name == "model" and kind == "minimal":
        return (
            f"the run in {str(directory.parent)!r} trained seed 002's block (model.kind 'minimal'), which is not a "
            f"TinyGPT and is saved only in its training checkpoint; train with --model.kind gpt to get a model/ directory"
        )
    return "pass the directory that save_checkpoint wrote (holding config.json and model.safetensors)"


def load_checkpoint(
    directory: str | os.PathLike, *, device: str | torch.device = "cpu"
) -> tuple[TinyGPT, Tokenizer | None]:
    """``(model in eval mode, tokenizer or None)`` from a directory written by :func:`save_checkpoint`.

    Raises :class:`CheckpointError` (a ``ValueError``) naming the file and what is wrong with it:
    missing, unreadable, not JSON, damaged safetensors, or weights whose names or shapes disagree
    with ``config.json``.
    """
    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    if directory.is_file() and directory.name in ("config.json", "model.safetensors"):
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is a file; pass the directory holding it, {str(directory.parent)!r}."
        )
    if not directory.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint {str(directory)!r} does not exist or is not a directory; {_missing_hint(directory)}."
        )
    if not weights_path.is_file() and (directory / "model" / "model.safetensors").is_file():
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is a training run's directory; its model is {str(directory / 'model')!r}: pass that."
        )
    for p in (config_path, weights_path):
        if not p.is_file():
            raise CheckpointNotFoundError(
                f"checkpoint {str(directory)!r} has no {p.name}; pass a directory written by attnlab's save_checkpoint."
            )
    meta = _read_meta(directory)
    config = _config(meta, config_path)
    dtype = _DTYPES.get(str(meta.get("dtype", "float32")))
    if dtype is None:
        raise CheckpointError(
            f"{str(config_path)!r} has dtype {meta.get('dtype')!r}, expected one of {sorted(_DTYPES)}; fix the file or save the checkpoint again."
        )
    try:
        tokenizer = None if meta.get("tokenizer") is None else tokenizer_from_json(meta["tokenizer"])
    except ValueError as e:
        raise CheckpointError(f"{str(config_path)!r}: {e}") from None
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{str(config_path)!r}: its tokenizer has {tokenizer.vocab_size} ids but config vocab_size={config.vocab_size}; "
            f"the tokenizer belongs to another model: save the checkpoint again with the model's own tokenizer."
        )

    sizes = f"n_embd={config.n_embd}, n_layer={config.n_layer}, vocab_size={config.vocab_size}"
    check_fits_in_memory(gpt_weight_count(config), torch.float32, torch.device("cpu"), repr(str(config_path)), sizes)
    _check_weights(weights_path, config, _shapes(config, config_path))
    from safetensors.torch import load_file

    model = TinyGPT(config)
    state = load_file(str(weights_path), device=str(device))
    for key, value in state.items():  # damage inside the data, which no header shows
        check_values(value, key, weights_path, _FIX, math.inf, CheckpointError)
    model.load_state_dict(state, strict=True)  # names and shapes already checked
    model.to(device=device, dtype=dtype)
    return model.eval(), tokenizer
