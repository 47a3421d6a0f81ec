"""Configuration of a training run: four dataclasses, saved as ``out_dir/config.json``.

The ``attnlab train`` flags are derived from :class:`TrainConfig` by tyro (``--data.task``,
``--model.num-heads``, ``--optim.lr``, ...), so this file is the single list of options. Field names
are the flag names with ``-`` written ``_``. Configs saved before the flag vocabulary was unified
(``n_layer``, ``n_head``, ``n_embd``, ``n_kv_head``, ``run_dir``) load under the new names.

A run's own ``config.json`` read back by ``--resume`` is a file attnlab wrote, not flags: its fields
are checked as JSON types here (``strict=True``: a :class:`FieldError` names the field, what it holds
and what it should), and its values and its agreement with the checkpoint by
:func:`attnlab.lab.run_dir.read_run_config`. A ``--config FILE`` is the user's base for flags, and is
checked as flags are (:mod:`.validation`), naming the flag to pass.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..runtime import UsageError, atomic_write_text

__all__ = [
    "DataConfig",
    "FieldError",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
    "dataclass_from_dict",
    "load_config",
    "save_config",
    "demo_config",
    "command_flags",
]

Task = Literal["recall", "copy", "random", "text"]


@dataclass
class DataConfig:
    """What the model is trained on; every batch is a pure function of (seed, step, rank)."""

    task: Task = "copy"  # copy and recall need attention (copy learns in ~50 steps); random: seed 002's; text: a file
    seed: int = 0  # seeds the data stream; the held-out split uses a disjoint stream derived from it
    batch_size: int = 64  # sequences per step over all ranks (each of N ranks gets batch_size // N)
    n_pairs: int = 8  # recall: key-value pairs shown before the queries (the memory to search)
    n_keys: int = 26  # recall: key alphabet size (letters a..z), so keys repeat across sequences
    n_values: int = 10  # recall: value alphabet size (digits 0..9); chance accuracy is 1 / n_values
    copy_len: int = 12  # copy: symbols to copy after the separator
    n_symbols: int = 26  # copy: symbol alphabet size; chance accuracy is 1 / n_symbols
    vocab_size: int = 16  # random: seed 002's vocab_size; the best possible loss is ln(vocab_size)
    seq_len: int = 32  # random/text: tokens per training sequence (seed 002 uses 32)
    num_samples: int = 20000  # random: size of the CharDataset pool (seed 002 pre-draws a fixed pool)
    text_path: Path | None = None  # text: a UTF-8 file; 90% trains, the last 10% is held out


@dataclass
class ModelConfig:
    """Which network learns: TinyGPT (GPT-2 shape) or seed 002's MinimalFormerBlock stack."""

    kind: Literal["gpt", "minimal"] = "gpt"  # gpt = attnlab.TinyGPT; minimal = seed 002's MinimalFormerBlock stack
    num_layers: int = 2  # blocks; recall needs two (one finds the key, one reads the value after it)
    num_heads: int = 4  # attention heads; must divide embed_dim (the quantity ablate-heads varies)
    num_kv_heads: int | None = None  # key/value heads (GQA; 1 = MQA); must divide num_heads; None: num_heads
    embed_dim: int = 64  # d_model, fixed while ablate-heads varies num_heads
    ff_mult: int = 2  # minimal only: ff_dim = ff_mult * embed_dim (seed 002: 64 -> 128); TinyGPT uses 4
    dropout: float = 0.0  # in [0, 1); tiny synthetic tasks do not overfit; seed 002 uses 0.1
    causal: bool = True  # minimal only: seed 002 passes no mask, so position t sees x[t+1] == y[t] and copies it
    position: Literal["learned", "rotary"] = "learned"  # gpt only: GPT-2's wpe table or RoPE
    init: Literal["torch", "gpt2"] = "torch"  # gpt only: GPT-2's N(0, 0.02) suits width 768; at 64 it stalls recall


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay; the rate is a pure function of the step."""

    lr: float = 3e-3  # peak rate; seed 002 uses 5e-4, which needs several times more steps here
    weight_decay: float = 0.01  # AdamW's default; applied to matrices only, not to biases/norms
    beta1: float = 0.9  # AdamW first-moment decay (PyTorch default)
    beta2: float = 0.99  # second-moment decay; 0.99 adapts faster than 0.999 in short runs
    warmup_steps: int = 50  # linear warm-up keeps the first large-rate steps from blowing up attention logits
    schedule: Literal["cosine", "constant"] = "cosine"  # decay after warm-up; constant is seed 002's plain AdamW
    min_lr_ratio: float = 0.1  # cosine ends at lr * min_lr_ratio rather than 0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass
class TrainConfig:
    """One training run: data, model, optimiser, budget and where it writes."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 400  # optimiser steps; the default copy run passes 95% held-out accuracy well before the end
    seed: int = 0  # seeds model init and dropout (torch's global RNG), saved in checkpoints
    eval_every: int = 25  # steps between held-out evaluations (the resolution of "steps to 90%")
    eval_batches: int = 4  # held-out batches per evaluation, always the same ones
    log_every: int = 50  # steps between plain log lines when stdout is not a terminal
    ckpt_every: int = 100  # steps between checkpoints (one more at the end, and on a stop signal); 0: only those
    stop_at_acc: float | None = None  # stop early once held-out accuracy reaches this (e.g. 0.95); None: run all steps
    log_head_scores: bool = True  # each eval also logs every head's previous-token/induction scores (lab.head_scores)
    out_dir: Path = Path("runs/train")  # the run directory; a run already there is never replaced (see --resume)
    resume: bool = False  # continue the run in out_dir from its checkpoint, with its saved config, RNG and step
    device: str = "auto"  # one of: auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps
    context_parallel: int = 1  # ranks that split each sequence along time (under torchrun; must divide WORLD_SIZE)
    rank_timeout: float = 50.0  # under torchrun: seconds every rank waits for one that died or froze, then all stop
    progress: bool = True  # rich progress bar on a terminal; plain log lines otherwise


def demo_config(out_dir: str | os.PathLike[str] = "runs/demo") -> TrainConfig:
    """The demo's run: the default copy task, stopped once held-out accuracy reaches 95% (~100 steps)."""
    return TrainConfig(steps=300, eval_every=10, ckpt_every=0, stop_at_acc=0.95, out_dir=Path(out_dir))


# Keys of configs saved before the flag vocabulary was unified: old name -> new name, per class.
RENAMED_KEYS: dict[str, dict[str, str]] = {
    "TrainConfig": {"run_dir": "out_dir"},
    "ModelConfig": {"n_layer": "num_layers", "n_head": "num_heads", "n_embd": "embed_dim", "n_kv_head": "num_kv_heads"},
}


def _is_path(hint: Any) -> bool:
    return hint is Path or Path in typing.get_args(hint)


class FieldError(UsageError):
    """A field of a saved config whose JSON is not what its annotation says; ``str(err)`` is the detail
    (``field model.num_heads holds "four" (a string), expected an integer``), which the reader of the
    file puts after the file's name and before its fix."""


def shown(value: Any) -> str:
    """A JSON value as a message shows it: ``"four" (a string)``, ``3.5 (a number)``, ``null``."""
    text = json.dumps(value, default=str)
    text = text if len(text) <= 40 else text[:37] + "..."
    kinds = {
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    kind = kinds.get(type(value))  # type(True) is bool: true and false show as themselves
    return f"{text} ({kind})" if kind else text


def _expected(hint: Any) -> str:
    """What a JSON value of a field annotated ``hint`` must be, in words."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in args)
    if hint is Path or (args and Path in args):
        return "a path (a string)" + (" or null" if type(None) in args else "")
    if args and type(None) in args:
        return _expected(next(a for a in args if a is not type(None))) + " or null"
    if typing.get_origin(hint) is list:
        return f"a list of {_expected(args[0]).removeprefix('an ').removeprefix('a ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _typed(hint: Any, value: Any) -> tuple[bool, Any]:
    """``(ok, value)``: whether JSON ``value`` fits ``hint``, and the value as the field holds it (ints as floats)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return value in args and type(value) in {type(a) for a in args}, value
    if value is None:
        return type(None) in args, value
    if args and type(None) in args:
        return _typed(next(a for a in args if a is not type(None)), value)
    if _is_path(hint):
        return isinstance(value, str), Path(value) if isinstance(value, str) else value
    if typing.get_origin(hint) is list:
        items = [_typed(args[0], v) for v in value] if isinstance(value, list) else [(False, None)]
        return all(ok for ok, _ in items), [v for _, v in items]
    if hint is float:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number, float(value) if number else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, hint) if isinstance(hint, type) else True, value


def dataclass_from_dict(cls: type, data: Any, where: str = "", *, strict: bool = False) -> Any:
    """An instance of the dataclass ``cls`` from its ``asdict`` form (nested dataclasses included).

    Unknown keys raise :class:`UsageError`; keys renamed since the file was written are mapped to
    their new names without a word, so old runs still load and resume. ``strict``: every value's
    JSON type is checked too (a :class:`FieldError`), as for a file attnlab wrote itself.
    """
    if not isinstance(data, dict):
        if strict:
            raise FieldError(
                f"{'field ' + where.rstrip('.') if where else 'it'} holds {shown(data)}, expected an object"
            )
        raise UsageError(
            f"config {where or 'root'} must be a JSON object, got {type(data).__name__}; "
            f'write it as {{"field": value, ...}} as out_dir/config.json does.'
        )
    renamed = RENAMED_KEYS.get(cls.__name__, {})
    data = {renamed.get(k, k) if renamed.get(k, k) not in data else k: v for k, v in data.items()}
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown and strict:
        raise FieldError(f"field {where}{unknown[0]} is not one attnlab writes there")
    if unknown:
        raise UsageError(
            f"config {where or 'root'} has unknown key(s) {unknown}, expected only {sorted(known)}; "
            f"remove or rename them."
        )
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            value = dataclass_from_dict(hint, value, f"{where}{name}.", strict=strict)
        elif strict:
            ok, value = _typed(hint, value)
            if not ok:
                raise FieldError(f"field {where}{name} holds {shown(data[name])}, expected {_expected(hint)}")
        elif _is_path(hint) and isinstance(value, str):
            value = Path(value)
        kwargs[name] = value
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any], *, strict: bool = False) -> TrainConfig:
    """A :class:`TrainConfig` from its ``asdict`` form; unknown keys raise :class:`UsageError` (``strict``: see
    :func:`dataclass_from_dict`)."""
    cfg: TrainConfig = dataclass_from_dict(TrainConfig, data, strict=strict)
    return cfg


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """JSON-ready form of any config dataclass: paths as strings."""

    def fix(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: fix(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [fix(v) for v in obj]
        return str(obj) if isinstance(obj, Path) else obj

    return fix(asdict(cfg))


def read_json_file(path: Path) -> Any:
    """The JSON value in ``path``; a :class:`FieldError` whose text says what is wrong with the file as a file
    (a directory, unreadable, empty, not UTF-8, not JSON). A missing file raises ``FileNotFoundError``."""
    if path.is_dir():
        raise FieldError("it is a directory, expected a JSON file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise FieldError(f"it cannot be read ({e.strerror or e})") from None
    if not raw.strip():
        raise FieldError(f"it is empty ({len(raw)} bytes), expected a JSON object")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise FieldError(f"it is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        cut = " (cut short)" if e.pos >= len(raw.decode("utf-8").rstrip()) else ""
        raise FieldError(f"it is not valid JSON{cut}: {e.msg} at line {e.lineno} column {e.colno}") from None


def read_config_dict(path: str | os.PathLike[str], flag: str = "--config") -> dict[str, Any]:
    """The JSON object in ``path``; a missing or broken file is a :class:`UsageError` naming ``flag``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{flag} {str(path)!r} does not exist; pass a run's config.json.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {str(path)!r} cannot be read ({e}); pass a readable config.json.") from None
    except json.JSONDecodeError as e:
        raise UsageError(
            f"{flag} {str(path)!r} is not valid JSON ({e}); fix the file or pass a run's config.json."
        ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{flag} {str(path)!r} holds a JSON {type(data).__name__}, expected an object.")
    return data


def load_config(path: str | os.PathLike[str], flag: str = "--config") -> TrainConfig:
    """Read a config written by :func:`save_config` (or by hand); JSON only. Errors name ``flag``.

    A run's own ``config.json``, read on ``--resume``, is read by :func:`attnlab.lab.run_dir.read_run_config`
    instead: as a file attnlab wrote, checked against the run's checkpoint, its errors naming file and field.
    """
    return config_from_dict(read_config_dict(path, flag))


def save_config(cfg: Any, path: str | os.PathLike[str]) -> None:
    """Write ``cfg`` as indented JSON, atomically (temp file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(config_to_dict(cfg), indent=2) + "\n")


def command_flags(cfg: Any, default: Any, prefix: str = "--", skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that turn ``default`` into ``cfg`` (both instances of one config dataclass), shell-quoted.

    Used to print commands the user can run as they are: ``attnlab train`` plus these flags
    rebuilds ``cfg``. Fields named in ``skip`` (top level only) are left out.
    """
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.name in skip:
            continue
        value, base = getattr(cfg, f.name), getattr(default, f.name)
        flag = prefix + f.name.replace("_", "-")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += command_flags(value, base, flag + ".")
        elif value == base:
            continue
        elif isinstance(value, bool):
            out.append(flag if value else f"{prefix}no-{f.name.replace('_', '-')}")
        elif isinstance(value, list):
            out += [flag, *(shlex.quote(_text(v)) for v in value)]
        else:
            out += [flag, shlex.quote(_text(value))]
    return out


def _text(value: Any) -> str:
    """A value as typed on a command line: floats in their shortest exact form (1e-08, not 1.0000000000000001e-08)."""
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)
