"""Every field of a lab config checked before any work: a :class:`~attnlab.runtime.UsageError` names the
flag as the user types it (``--data.batch-size``, or ``--train.data.batch-size`` under ablate-heads),
what it got, what it needs, and a value to pass instead.

Values can come from flags (tyro has checked their types) or from a ``--config`` file (nothing has),
so types are checked here too.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any

import torch

from ..runtime import UsageError, check_range, resolve_device
from .config import DataConfig, ModelConfig, OptimConfig, TrainConfig

__all__ = ["validate_data", "validate_model", "validate_optim", "validate_train", "check_number", "flag_name"]


def flag_name(prefix: str, name: str) -> str:
    """``("--data.", "batch_size")`` -> ``"--data.batch-size"``."""
    return prefix + name.replace("_", "-")


def check_number(obj: Any, prefix: str, name: str, **bounds: Any) -> None:
    """``check_range`` on ``obj.name`` with the field's default as the suggested value."""
    flag = flag_name(prefix, name)
    default = getattr(type(obj)(), name)
    check_range(flag, getattr(obj, name), hint=f"pass e.g. {flag} {default}", **bounds)


def _check_choice(obj: Any, prefix: str, name: str) -> None:
    value, choices = getattr(obj, name), typing.get_args(typing.get_type_hints(type(obj))[name])
    if value not in choices:
        flag = flag_name(prefix, name)
        raise UsageError(
            f"{flag} must be one of {', '.join(map(str, choices))}, got {value!r}; "
            f"pass e.g. {flag} {getattr(type(obj)(), name)}."
        )


def _check_bool(obj: Any, prefix: str, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        flag = flag_name(prefix, name)
        raise UsageError(
            f"{flag} must be true or false, got {getattr(obj, name)!r}; pass {flag} or {flag_name(prefix, 'no_' + name)}."
        )


def validate_data(d: DataConfig, prefix: str = "--data.") -> None:
    _check_choice(d, prefix, "task")
    check_number(d, prefix, "seed", low=0, integer=True)
    check_number(d, prefix, "batch_size", low=1, integer=True)
    check_number(d, prefix, "n_pairs", low=1, high=26, integer=True)
    check_number(d, prefix, "n_keys", low=1, high=26, integer=True)
    check_number(d, prefix, "n_values", low=2, high=36, integer=True)
    check_number(d, prefix, "copy_len", low=1, integer=True)
    check_number(d, prefix, "n_symbols", low=2, high=26, integer=True)
    check_number(d, prefix, "vocab_size", low=2, integer=True)
    check_number(d, prefix, "seq_len", low=1, integer=True)
    check_number(d, prefix, "num_samples", low=1, integer=True)
    if d.task == "recall" and d.n_pairs > d.n_keys:
        raise UsageError(
            f"{prefix}n-pairs {d.n_pairs} exceeds {prefix}n-keys {d.n_keys}, but every pair needs its own key; "
            f"pass {prefix}n-pairs {d.n_keys} or fewer."
        )
    if d.task == "text":
        flag = flag_name(prefix, "text_path")
        if d.text_path is None:
            raise UsageError(
                f"{prefix}task text needs {flag}, got none; pass a UTF-8 text file, e.g. {flag} README.md."
            )
        path = Path(d.text_path)
        if not path.exists():
            raise UsageError(
                f"{flag} {str(path)!r} does not exist; pass an existing UTF-8 text file, e.g. {flag} README.md."
            )
        if not path.is_file():
            raise UsageError(f"{flag} {str(path)!r} is not a file; pass a UTF-8 text file, e.g. {flag} README.md.")
        if not os.access(path, os.R_OK):
            raise UsageError(f"{flag} {str(path)!r} cannot be read (no read permission); pass a file you can read.")


def validate_model(m: ModelConfig, prefix: str = "--model.") -> None:
    _check_choice(m, prefix, "kind")
    _check_choice(m, prefix, "position")
    _check_choice(m, prefix, "init")
    _check_bool(m, prefix, "causal")
    check_number(m, prefix, "num_layers", low=1, integer=True)
    check_number(m, prefix, "num_heads", low=1, integer=True)
    check_number(m, prefix, "embed_dim", low=1, integer=True)
    check_number(m, prefix, "ff_mult", low=1, integer=True)
    check_number(m, prefix, "dropout", low=0, high=1, high_inclusive=False)
    if m.embed_dim % m.num_heads:
        divisors = [h for h in range(1, m.embed_dim + 1) if m.embed_dim % h == 0]
        nearest = max(h for h in divisors if h <= m.num_heads)
        raise UsageError(
            f"{prefix}num-heads {m.num_heads} must divide {prefix}embed-dim {m.embed_dim} (heads split it evenly), "
            f"expected one of {divisors[:12]}{' ...' if len(divisors) > 12 else ''}; pass e.g. {prefix}num-heads {nearest}."
        )
    if m.num_kv_heads is not None:
        check_number(m, prefix, "num_kv_heads", low=1, integer=True)
        if m.num_heads % m.num_kv_heads:
            raise UsageError(
                f"{prefix}num-kv-heads {m.num_kv_heads} must divide {prefix}num-heads {m.num_heads} (query heads share "
                f"K/V heads in equal groups); pass e.g. {prefix}num-kv-heads 1."
            )
    if m.kind == "gpt" and m.position == "rotary" and (m.embed_dim // m.num_heads) % 2:
        raise UsageError(
            f"{prefix}position rotary needs an even head dim, got {prefix}embed-dim {m.embed_dim} / "
            f"{prefix}num-heads {m.num_heads} = {m.embed_dim // m.num_heads}; pass e.g. {prefix}embed-dim "
            f"{2 * m.embed_dim}."
        )


def validate_optim(o: OptimConfig, prefix: str = "--optim.") -> None:
    _check_choice(o, prefix, "schedule")
    check_number(o, prefix, "lr", low=0, low_inclusive=False)
    check_number(o, prefix, "weight_decay", low=0)
    check_number(o, prefix, "beta1", low=0, high=1, high_inclusive=False)
    check_number(o, prefix, "beta2", low=0, high=1, high_inclusive=False)
    check_number(o, prefix, "warmup_steps", low=0, integer=True)
    check_number(o, prefix, "min_lr_ratio", low=0, high=1)
    check_number(o, prefix, "grad_clip", low=0)


def validate_train(cfg: TrainConfig, prefix: str = "--") -> torch.device:
    """Check every field of ``cfg``; returns the device ``cfg.device`` names on this machine."""
    validate_data(cfg.data, prefix + "data.")
    validate_model(cfg.model, prefix + "model.")
    validate_optim(cfg.optim, prefix + "optim.")
    check_number(cfg, prefix, "steps", low=1, integer=True)
    check_number(cfg, prefix, "seed", low=0, integer=True)
    check_number(cfg, prefix, "eval_every", low=1, integer=True)
    check_number(cfg, prefix, "eval_batches", low=1, integer=True)
    check_number(cfg, prefix, "log_every", low=1, integer=True)
    check_number(cfg, prefix, "ckpt_every", low=0, integer=True)
    check_number(cfg, prefix, "context_parallel", low=1, integer=True)
    if cfg.stop_at_acc is not None:
        check_range(
            flag_name(prefix, "stop_at_acc"),
            cfg.stop_at_acc,
            low=0,
            low_inclusive=False,
            high=1,
            hint=f"pass e.g. {flag_name(prefix, 'stop_at_acc')} 0.95, or leave it out to run every step",
        )
    for name in ("resume", "progress", "log_head_scores"):
        _check_bool(cfg, prefix, name)
    if not isinstance(cfg.device, str):
        raise UsageError(f"{prefix}device must be a name, got {cfg.device!r}; pass e.g. {prefix}device auto.")
    return resolve_device(cfg.device, flag_name(prefix, "device"))
