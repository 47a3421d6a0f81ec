"""Training checkpoints: one ``checkpoint.safetensors`` holding everything a resumed run needs.

Tensors: model weights as ``model.{name}``, AdamW state as ``optim.{param index}.{key}``, torch's
RNG state as ``rng.cpu`` (and ``rng.cuda.{i}``), bytes in uint8 tensors. Everything else (step,
optimizer param_groups, the full config) is JSON in the file's string metadata. One file means
one rename (:func:`attnlab.runtime.atomic_write_bytes`): a run killed mid-save leaves the previous
checkpoint intact and at most a stray ``.checkpoint.safetensors.*.tmp``, which loading never reads.
Loading is ``safetensors.torch.load`` of the file read into memory (not mapped: :func:`load_train_state`) +
``json``: no pickle, no code.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..runtime import UsageError, atomic_write_bytes
from .config import FieldError, TrainConfig, dataclass_from_dict, shown
from .validation import checking_file, validate_fields

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


def _damaged(path: Path, what: str, fix: str) -> UsageError:
    return UsageError(f"checkpoint {str(path)!r} is damaged: {what}; {fix}.")


def read_meta(path: Path, fix: str = _RESUME_FIX, *, config: bool = True) -> dict[str, Any]:
    """The JSON metadata of a checkpoint (step, config, ...), without reading its tensors, checked field by field.

    ``fix``: the end of the error for a file that is not one, as the caller can mend it (resume: a new run).
    Every way the file can be damaged is a :class:`UsageError` naming the file, the field, what it holds and
    what it should (``tests/test_run_damage.py`` tries each); the returned dict's fields are then safe to use.
    ``config=False``: the ``config`` field is only required to be an object (for callers that check it themselves).
    """
    from safetensors import safe_open

    if not path.exists():
        raise UsageError(f"checkpoint {str(path)!r} does not exist; {fix}.")
    if path.is_dir():
        raise UsageError(f"checkpoint {str(path)!r} is a directory, expected a safetensors file; {fix}.")
    if not os.access(path, os.R_OK):
        raise UsageError(
            f"checkpoint {str(path)!r} cannot be read (no read permission); make it readable with "
            f"`chmod u+r {shlex.quote(str(path))}` and run the command again."
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get("attnlab")
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        why = "it is empty" if path.stat().st_size == 0 else str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"checkpoint {str(path)!r} is not a readable safetensors file ({why}); {fix}.") from None
    try:
        meta = json.loads(text) if text is not None else None
    except json.JSONDecodeError as e:
        raise _damaged(path, f"its {FORMAT!r} metadata is not valid JSON ({e.msg} at column {e.colno})", fix) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UsageError(
            f"checkpoint {str(path)!r} has no {FORMAT!r} metadata, so attnlab train did not write it; "
            f"{fix.removeprefix('it cannot be resumed: ')}."
        )
    _check_meta(path, meta, fix, config)
    return meta


def _check_meta(path: Path, meta: dict[str, Any], fix: str, config: bool) -> None:
    """Every metadata field a resume reads: step, config (as a saved config, :mod:`.validation`), optimizer groups."""
    for name, kind in (("step", int), ("config", dict), ("param_groups", list), ("optim_scalars", dict)):
        if name not in meta:
            raise _damaged(path, f"metadata field {name} is missing", fix)
        value = meta[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            expected = {int: "an integer", dict: "an object", list: "a list"}[kind]
            raise _damaged(path, f"metadata field {name} holds {shown(value)}, expected {expected}", fix)
    if meta["step"] < 0:
        raise _damaged(path, f"metadata field step holds {meta['step']}, expected an integer >= 0", fix)
    if config:
        try:
            cfg: TrainConfig = dataclass_from_dict(TrainConfig, meta["config"], "config.", strict=True)
        except FieldError as e:
            raise _damaged(path, f"metadata {e}", fix) from None
        with checking_file(f"checkpoint {str(path)!r}", fix):
            validate_fields(cfg, "--config.")
        if meta["step"] > cfg.steps:
            raise _damaged(
                path, f"metadata field step holds {meta['step']}, expected 0 to config.steps = {cfg.steps}", fix
            )
    for g, group in enumerate(meta["param_groups"]):
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in params):
            raise _damaged(
                path, f"metadata field param_groups[{g}] holds {shown(group)}, expected an object with params", fix
            )
        for key in ("lr", "eps", "weight_decay"):
            if key in group and (not isinstance(group[key], int | float) or isinstance(group[key], bool)):
                raise _damaged(
                    path, f"metadata field param_groups[{g}].{key} holds {shown(group[key])}, expected a number", fix
                )
        betas = group.get("betas", [0.0, 0.0])
        if not (isinstance(betas, list) and len(betas) == 2 and all(isinstance(b, int | float) for b in betas)):
            raise _damaged(
                path, f"metadata field param_groups[{g}].betas holds {shown(betas)}, expected a list of 2 numbers", fix
            )
    for i, scalars in meta["optim_scalars"].items():
        if not i.isdigit() or not isinstance(scalars, dict):
            raise _damaged(
                path, f"metadata field optim_scalars.{i} holds {shown(scalars)}, expected an object under an index", fix
            )


def _check_tensors(
    path: Path, meta: dict[str, Any], tensors: dict[str, Tensor], model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """The tensors a resume restores, each against what it will be loaded into: all are checked before any is."""
    fix = _RESUME_FIX

    def shape(t: Tensor) -> str:
        return f"({', '.join(map(str, t.shape))})"

    expected = model.state_dict()
    for name, want in expected.items():
        got = tensors.get(f"model.{name}")
        if got is None:
            raise _damaged(path, f"tensor model.{name} is missing (the model its config describes has it)", fix)
        if got.shape != want.shape or got.dtype != want.dtype:
            raise _damaged(
                path,
                f"tensor model.{name} is {shape(got)} {got.dtype}, expected {shape(want)} {want.dtype} "
                f"(the model its config describes)",
                fix,
            )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_groups = meta["param_groups"]
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(g["params"]) for g in optimizer.param_groups]:
        raise _damaged(
            path,
            f"metadata field param_groups holds groups of {sizes} parameters, expected "
            f"{[len(g['params']) for g in optimizer.param_groups]} (the model its config describes)",
            fix,
        )
    held: dict[int, set[str]] = {}
    for name, value in tensors.items():
        part = name.split(".", 2)
        if part[0] == "model":
            if name.removeprefix("model.") not in expected:
                raise _damaged(path, f"tensor {name} is not one of the model's (a file of another model?)", fix)
        elif part[0] == "optim":
            if len(part) != 3 or not part[1].isdigit() or int(part[1]) >= len(params):
                raise _damaged(path, f"tensor {name} names no parameter of the optimizer ({len(params)} of them)", fix)
            p = params[int(part[1])]
            want_shape = () if part[2] == "step" else tuple(p.shape)
            if tuple(value.shape) != want_shape or not value.is_floating_point():
                raise _damaged(
                    path,
                    f"tensor {name} is {shape(value)} {value.dtype}, expected ({', '.join(map(str, want_shape))}) "
                    f"floating point",
                    fix,
                )
            held.setdefault(int(part[1]), set()).add(part[2])
        elif name.startswith("rng.cuda.") and name[9:].isdigit():
            if value.dtype != torch.uint8 or value.dim() != 1:
                raise _damaged(path, f"tensor {name} is {shape(value)} {value.dtype}, expected a 1-d torch.uint8", fix)
        elif name != "rng.cpu":
            raise _damaged(path, f"tensor {name} is not one attnlab train writes", fix)
    for i in range(len(params)):  # after a first step every parameter has its moments; before, none has
        keys = held.get(i, set()) | set(meta["optim_scalars"].get(str(i), {}))
        missing = {"exp_avg", "exp_avg_sq", "step"} - keys
        if (held or meta["step"] > 0) and missing:
            raise _damaged(
                path,
                f"tensor optim.{i}.{sorted(missing)[0]} is missing (saved after step {meta['step']}, "
                f"every parameter has its AdamW state)",
                fix,
            )
    rng = tensors.get("rng.cpu")
    want_rng = torch.get_rng_state()
    if rng is None:
        raise _damaged(path, "tensor rng.cpu (torch's RNG state, which dropout draws from) is missing", fix)
    if rng.dtype != torch.uint8 or rng.shape != want_rng.shape:
        raise _damaged(path, f"tensor rng.cpu is {shape(rng)} {rng.dtype}, expected {shape(want_rng)} torch.uint8", fix)


def load_train_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Restore model, optimizer and RNG from ``path``; returns the number of steps already done.

    Everything is checked before anything is restored (:func:`read_meta`, then each tensor against what it
    goes into): a damaged file is one :class:`UsageError` naming it and the tensor or field, and leaves the
    model, the optimizer and the RNG as they were. The run config in it is the caller's to check (``train``
    reads it with :func:`read_meta` first).
    """
    from safetensors.torch import load

    meta = read_meta(path, config=False)
    try:
        # read into memory, not mapped (load_file): the optimizer keeps the tensors it is given, and a mapping
        # would hold the replaced file's blocks after the next save, so a resumed run needed 3x its size on disk
        tensors = load(path.read_bytes())
    except Exception as e:  # a file damaged after its header
        raise UsageError(
            f"checkpoint {str(path)!r} is damaged after its header ({str(e).splitlines()[0]}); it cannot be resumed: "
            f"start a new run in another --out-dir."
        ) from None
    _check_tensors(path, meta, tensors, model, optimizer)
    model.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}, strict=True)
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
