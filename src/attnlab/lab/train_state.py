"""Training checkpoints: one ``checkpoint.safetensors`` holding everything a resumed run needs.

Tensors: model weights as ``model.{name}``, AdamW state as ``optim.{param index}.{key}``, torch's
RNG state as ``rng.cpu`` (and ``rng.cuda.{i}``), bytes in uint8 tensors. Everything else (step,
optimizer param_groups, the full config) is JSON in the file's string metadata. One file means
one rename (:func:`attnlab.runtime.atomic_write_bytes`): a run killed mid-save leaves the previous
checkpoint intact and at most a stray ``.checkpoint.safetensors.*.tmp``, which loading never reads.
Loading is ``safetensors.torch.load_file`` + ``json``: no pickle, no code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..runtime import UsageError, atomic_write_bytes

__all__ = ["CKPT_NAME", "save_train_state", "load_train_state", "read_meta"]

CKPT_NAME = "checkpoint.safetensors"
FORMAT = "attnlab.lab.train_state"


def save_train_state(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, config: dict[str, Any]
) -> Path:
    """Write model, optimizer, RNG and ``step`` (the number of steps done) to ``path`` atomically."""
    from safetensors.torch import save  # imported when a run writes: ``attnlab --help`` stays fast

    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for i, state in opt["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"optim.{i}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(i), {})[key] = value
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = state
    meta = {
        "format": FORMAT,
        "step": step,
        "config": config,
        "param_groups": opt["param_groups"],
        "optim_scalars": scalars,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, save(tensors, metadata={"attnlab": json.dumps(meta)}))
    return path


_RESUME_FIX = "it cannot be resumed: start a new run in another --out-dir"


def read_meta(path: Path, fix: str = _RESUME_FIX) -> dict[str, Any]:
    """The JSON metadata of a checkpoint (step, config, ...), without reading its tensors.

    ``fix``: the end of the error for a file that is not one, as the caller can mend it (resume: a new run).
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("attnlab", "null"))
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise UsageError(f"checkpoint {str(path)!r} is not a readable safetensors file ({e}); {fix}.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(
            f"checkpoint {str(path)!r} has no {FORMAT!r} metadata, so attnlab train did not write it; "
            f"{fix.removeprefix('it cannot be resumed: ')}."
        )
    return meta


def load_train_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer and RNG from ``path``; returns the number of steps already done."""
    from safetensors.torch import load_file

    meta = read_meta(path)
    try:
        tensors = load_file(str(path))
        model.load_state_dict(
            {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True
        )
    except Exception as e:  # a file damaged after its header, or weights that do not fit the model
        raise UsageError(
            f"checkpoint {str(path)!r} does not load into the model its config describes "
            f"({str(e).splitlines()[0]}); it cannot be resumed: start a new run in another --out-dir."
        ) from None
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, i, key = name.split(".", 2)
            state.setdefault(int(i), {})[key] = value
    for i, scalars in meta["optim_scalars"].items():
        state.setdefault(int(i), {}).update(scalars)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(tensors["rng.cpu"])
    cuda_states = [tensors[f"rng.cuda.{i}"] for i in range(torch.cuda.device_count()) if f"rng.cuda.{i}" in tensors]
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    return int(meta["step"])
