"""Every field of a lab config checked before any work: a :class:`~attnlab.runtime.UsageError` names the
flag as the user types it (``--data.batch-size``, or ``--train.data.batch-size`` under ablate-heads),
what it got, what it needs, and a value to pass instead.

Values can come from flags (tyro has checked their types) or from a ``--config`` file (nothing has),
so types are checked here too.

Flags are also checked together, against what each part of a run needs of the sequence length
(:func:`validate_lengths`): the head-score probe (``--log-head-scores``) and the shards of
``--context-parallel``. Options that apply to one ``--model.kind`` only are refused with the other.

A run's own saved config (``--resume`` reads ``config.json``, or the copy in its checkpoint) goes
through the same checks inside :func:`checking_file`: an error then names the file, the field, what
it holds and what it should, and the fix for the file, never a flag value (passing one would change
the run being resumed).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from ..runtime import UsageError, check_range, resolve_device
from ..runtime.errors import range_words
from .config import DataConfig, ModelConfig, OptimConfig, TrainConfig, shown
from .data import length_flag, sequence_length
from .head_scores import MIN_BLOCK_SIZE

__all__ = [
    "validate_data",
    "validate_model",
    "validate_optim",
    "validate_train",
    "validate_lengths",
    "validate_fields",
    "check_number",
    "checking_file",
    "flag_name",
    "refuse",
]

# (the file's name, the fix) while a saved config is checked (checking_file): errors name its fields, not flags
_FILE: ContextVar[tuple[str, str] | None] = ContextVar("attnlab_checking_file", default=None)


@contextmanager
def checking_file(where: str, fix: str) -> Iterator[None]:
    """Within: every check of this module reports a saved file's damage instead of a flag's mistake.

    ``where`` names the file (``"--resume: 'runs/x/config.json'"``), ``fix`` ends the message (what to do
    with a damaged file). Field names are the flags' with ``--`` dropped and ``_`` kept (``data.batch_size``).
    """
    token = _FILE.set((where, fix))
    try:
        yield
    finally:
        _FILE.reset(token)


def _field(flag: str) -> str:
    """``--data.batch-size`` -> ``data.batch_size``: a flag as the field of config.json it comes from."""
    return flag.removeprefix("--").replace("-", "_")


def refuse(message: str, expected: str, *found: tuple[str, Any]) -> UsageError:
    """The error of a bad value: ``message`` (a flag's) or, inside :func:`checking_file`, the file's.

    ``found``: ``(flag, value)`` of each field involved; ``expected``: what they must be, in words.
    """
    saved = _FILE.get()
    if saved is None:
        return UsageError(message)
    where, fix = saved
    if len(found) == 1:
        ((flag, value),) = found
        what = f"field {_field(flag)} holds {shown(value)}, expected {expected}"
    else:
        fields = " and ".join(f"{_field(flag)} = {shown(value)}" for flag, value in found)
        what = f"fields {fields} do not fit together, expected {expected}"
    return UsageError(f"{where} is damaged: {what}; {fix}.")


def _bounds(
    low: Any = None,
    high: Any = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
    **_: Any,
) -> str:
    """``check_range``'s bounds in words (:func:`~attnlab.runtime.errors.range_words`), from its keywords."""
    return range_words(low=low, high=high, low_inclusive=low_inclusive, high_inclusive=high_inclusive, integer=integer)


def checked_range(flag: str, value: Any, *, hint: str = "", **bounds: Any) -> None:
    """``check_range`` that, inside :func:`checking_file`, reports the file's field instead of the flag."""
    try:
        check_range(flag, value, hint=hint, **bounds)
    except UsageError as e:
        raise refuse(str(e), _bounds(**bounds), (flag, value)) from None


def flag_name(prefix: str, name: str) -> str:
    """``("--data.", "batch_size")`` -> ``"--data.batch-size"``."""
    return prefix + name.replace("_", "-")


def check_number(obj: Any, prefix: str, name: str, **bounds: Any) -> None:
    """``check_range`` on ``obj.name`` with the field's default as the suggested value."""
    flag = flag_name(prefix, name)
    default = getattr(type(obj)(), name)
    checked_range(flag, getattr(obj, name), hint=f"pass e.g. {flag} {default}", **bounds)


def _check_choice(obj: Any, prefix: str, name: str) -> None:
    value, choices = getattr(obj, name), typing.get_args(typing.get_type_hints(type(obj))[name])
    if value not in choices:
        flag = flag_name(prefix, name)
        raise refuse(
            f"{flag} must be one of {', '.join(map(str, choices))}, got {value!r}; "
            f"pass e.g. {flag} {getattr(type(obj)(), name)}.",
            f"one of {', '.join(map(str, choices))}",
            (flag, value),
        )


def _check_bool(obj: Any, prefix: str, name: str) -> None:
    if not isinstance(getattr(obj, name), bool):
        flag = flag_name(prefix, name)
        raise refuse(
            f"{flag} must be true or false, got {getattr(obj, name)!r}; pass {flag} or {flag_name(prefix, 'no_' + name)}.",
            "true or false",
            (flag, getattr(obj, name)),
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
        raise refuse(
            f"{prefix}n-pairs {d.n_pairs} exceeds {prefix}n-keys {d.n_keys}, but every pair needs its own key; "
            f"pass {prefix}n-pairs {d.n_keys} or fewer.",
            f"{_field(prefix)}n_pairs <= {_field(prefix)}n_keys (every pair needs its own key)",
            (prefix + "n-pairs", d.n_pairs),
            (prefix + "n-keys", d.n_keys),
        )
    if d.task == "text" and _FILE.get() is not None and d.text_path is not None:
        return  # the run's text file is the run's input, not part of the saved file: train checks it as a flag
    if d.task == "text":
        flag = flag_name(prefix, "text_path")
        if d.text_path is None:
            raise refuse(
                f"{prefix}task text needs {flag}, got none; pass a UTF-8 text file, e.g. {flag} README.md.",
                f'a path with {_field(prefix)}task "text"',
                (flag, None),
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
        raise refuse(
            f"{prefix}num-heads {m.num_heads} must divide {prefix}embed-dim {m.embed_dim} (heads split it evenly), "
            f"expected one of {divisors[:12]}{' ...' if len(divisors) > 12 else ''}; pass e.g. {prefix}num-heads {nearest}.",
            f"{_field(prefix)}num_heads to divide {_field(prefix)}embed_dim",
            (prefix + "num-heads", m.num_heads),
            (prefix + "embed-dim", m.embed_dim),
        )
    if m.num_kv_heads is not None:
        check_number(m, prefix, "num_kv_heads", low=1, integer=True)
        if m.num_heads % m.num_kv_heads:
            raise refuse(
                f"{prefix}num-kv-heads {m.num_kv_heads} must divide {prefix}num-heads {m.num_heads} (query heads share "
                f"K/V heads in equal groups); pass e.g. {prefix}num-kv-heads 1.",
                f"{_field(prefix)}num_kv_heads to divide {_field(prefix)}num_heads",
                (prefix + "num-kv-heads", m.num_kv_heads),
                (prefix + "num-heads", m.num_heads),
            )
    if m.kind == "gpt" and m.position == "rotary" and (m.embed_dim // m.num_heads) % 2:
        raise refuse(
            f"{prefix}position rotary needs an even head dim, got {prefix}embed-dim {m.embed_dim} / "
            f"{prefix}num-heads {m.num_heads} = {m.embed_dim // m.num_heads}; pass e.g. {prefix}embed-dim "
            f"{2 * m.embed_dim}.",
            f"an even {_field(prefix)}embed_dim / {_field(prefix)}num_heads with rotary positions",
            (prefix + "embed-dim", m.embed_dim),
            (prefix + "num-heads", m.num_heads),
        )
    _check_kind_options(m, prefix)


# options that one --model.kind reads and the other would silently ignore: (kind that reads it, field, why)
KIND_OPTIONS = (
    ("minimal", "ff_mult", "TinyGPT's MLP is always 4 x --model.embed-dim wide"),
    ("minimal", "causal", "TinyGPT is always causal"),
    ("gpt", "position", "seed 002's block has learned positions only"),
    ("gpt", "init", "seed 002's block keeps torch's initialisation"),
)


def _check_kind_options(m: ModelConfig, prefix: str) -> None:
    """A value set for an option of the other ``--model.kind`` would be ignored without a word: refused."""
    default = ModelConfig()
    for kind, name, why in KIND_OPTIONS:
        value = getattr(m, name)
        if m.kind == kind or value == getattr(default, name):
            continue
        flag = flag_name(prefix, name)
        given = (flag if value else flag_name(prefix, "no_" + name)) if isinstance(value, bool) else f"{flag} {value}"
        raise refuse(
            f"{given} applies to {prefix}kind {kind} only, and this run's is {prefix}kind {m.kind} ({why}); "
            f"leave {flag} out, or pass {prefix}kind {kind}.",
            f"{shown(getattr(default, name))} with {_field(prefix)}kind {_json_text(m.kind)} ({why})",
            (flag, value),
        )


def _json_text(value: Any) -> str:
    return shown(value).split(" (")[0]


def validate_optim(o: OptimConfig, prefix: str = "--optim.") -> None:
    _check_choice(o, prefix, "schedule")
    check_number(o, prefix, "lr", low=0, low_inclusive=False)
    check_number(o, prefix, "weight_decay", low=0)
    check_number(o, prefix, "beta1", low=0, high=1, high_inclusive=False)
    check_number(o, prefix, "beta2", low=0, high=1, high_inclusive=False)
    check_number(o, prefix, "warmup_steps", low=0, integer=True)
    check_number(o, prefix, "min_lr_ratio", low=0, high=1)
    check_number(o, prefix, "grad_clip", low=0)


def validate_lengths(data: DataConfig, *, log_head_scores: bool, context_parallel: int = 1, prefix: str = "--") -> None:
    """The sequence length (``--data.copy-len``, ``--data.n-pairs`` or ``--data.seq-len``) against what the run's
    parts need: the head-score probe (:mod:`.head_scores`) and the ``--context-parallel`` shards."""
    T = sequence_length(data)
    flag, value = length_flag(data, prefix + "data.")
    if log_head_scores and T < MIN_BLOCK_SIZE:
        fits = next(
            v
            for v in range(value, value + MIN_BLOCK_SIZE + 1)
            if sequence_length(_with(data, flag, v)) >= MIN_BLOCK_SIZE
        )
        raise refuse(
            f"{flag} {value} makes sequences of {T} token{'s' if T != 1 else ''}, but the head scores logged at "
            f"each evaluation ({prefix}log-head-scores, on by default) need at least {MIN_BLOCK_SIZE} (a probe of 2 "
            f"random tokens, repeated); pass {flag} {fits} or more, or {prefix}no-log-head-scores.",
            f"{_field(flag)} >= {fits} with {_field(prefix)}log_head_scores true",
            (flag, value),
        )
    C = context_parallel
    if C > 1:
        idle = idle_ranks(T, C)
        if idle:
            fits = max(c for c in range(1, C + 1) if not idle_ranks(T, c))
            # T >= 2C always fits (every chunk then holds a position), so this finds one
            longer = next(
                v for v in range(value, value + 2 * C + 1) if not idle_ranks(sequence_length(_with(data, flag, v)), C)
            )
            raise refuse(
                f"{prefix}context-parallel {C} splits each sequence of {T} tokens ({flag} {value}) into {2 * C} chunks of "
                f"{_chunk(T, C)}, so rank{'s' if len(idle) > 1 else ''} {_span(idle)} would hold padding only and "
                f"compute nothing; pass {prefix}context-parallel {fits} or less, or {flag} {longer} or more.",
                f"{_field(flag)} long enough for every one of context_parallel's ranks to hold a token",
                (flag, value),
                (prefix + "context-parallel", C),
            )


def _with(data: DataConfig, flag: str, value: int) -> DataConfig:
    changed = dataclasses.replace(data)
    setattr(changed, _field(flag).rsplit(".", 1)[-1], value)
    return changed


def _chunk(T: int, C: int) -> int:
    """Positions per chunk when ``T`` positions are cut into ``2C`` zigzag chunks (``distributed.layout``)."""
    return max(1, -(-T // (2 * C)))


def idle_ranks(T: int, C: int) -> list[int]:
    """The context-parallel ranks whose zigzag shard (chunks ``r`` and ``2C-1-r``) holds no real position."""
    return [r for r in range(C) if r * _chunk(T, C) >= T]


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def validate_fields(cfg: TrainConfig, prefix: str = "--") -> None:
    """Every check of :func:`validate_train` but the device's (which depends on the machine, not the config)."""
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
    check_number(cfg, prefix, "rank_timeout", low=1, high=86400)  # below a second, scheduling hiccups end runs
    if cfg.stop_at_acc is not None:
        checked_range(
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
        raise refuse(
            f"{prefix}device must be a name, got {cfg.device!r}; pass e.g. {prefix}device auto.",
            "a device name",
            (prefix + "device", cfg.device),
        )
    validate_lengths(
        cfg.data, log_head_scores=cfg.log_head_scores, context_parallel=cfg.context_parallel, prefix=prefix
    )


def validate_train(cfg: TrainConfig, prefix: str = "--") -> torch.device:
    """Check every field of ``cfg``, and the flags together; returns the device ``cfg.device`` names on this machine."""
    validate_fields(cfg, prefix)
    return resolve_device(cfg.device, flag_name(prefix, "device"))
