"""Configuration of a training run: four dataclasses, saved as ``run_dir/config.json``.

The ``attnlab train`` flags are derived from :class:`TrainConfig` by tyro (``--data.task``,
``--model.n-head``, ``--optim.lr``, ...), so this file is the single list of options.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "config_from_dict",
    "load_config",
    "save_config",
    "demo_config",
]

Task = Literal["recall", "copy", "random", "text"]


@dataclass
class DataConfig:
    """What the model is trained on; every batch is a pure function of (seed, step, rank)."""

    task: Task = (
        "copy"  # copy/recall need attention; copy is default as it passes 95% in ~100 steps, recall takes thousands
    )
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
    n_layer: int = 2  # blocks; recall needs two (one finds the key, one reads the value after it)
    n_head: int = 4  # attention heads; must divide n_embd (the quantity ablate-heads varies)
    n_embd: int = 64  # d_model, fixed while ablate-heads varies n_head
    ff_mult: int = 2  # minimal only: ff_dim = ff_mult * n_embd (seed 002: 64 -> 128); TinyGPT uses 4
    dropout: float = 0.0  # tiny synthetic tasks do not overfit; seed 002 uses 0.1 (pass --model.dropout 0.1)
    causal: bool = True  # minimal only: seed 002 passes no mask, so position t sees x[t+1] == y[t] and copies it
    position: Literal["learned", "rotary"] = "learned"  # gpt only: GPT-2's wpe table or RoPE
    init: Literal["torch", "gpt2"] = (
        "torch"  # gpt only: GPT-2's N(0, 0.02) is tuned for width 768; at 64 it stalls recall
    )


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
    steps: int = 400  # optimiser steps; the default (copy) run passes 95% held-out accuracy well before the end
    seed: int = 0  # seeds model init and dropout (torch's global RNG), saved in checkpoints
    eval_every: int = 25  # steps between held-out evaluations (the resolution of "steps to 90%")
    eval_batches: int = 4  # held-out batches per evaluation, always the same ones
    log_every: int = 50  # steps between plain log lines when stdout is not a terminal
    ckpt_every: int = 100  # steps between checkpoints (one more is written at the end); 0: only at the end
    stop_at_acc: float | None = None  # stop early once held-out accuracy reaches this (e.g. 0.95); None: run all steps
    run_dir: Path = Path("runs/train")  # config.json, metrics.jsonl, checkpoint, curve.png, model/ go here
    resume: bool = False  # continue from run_dir's checkpoint with its saved config, RNG and step
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda if available, else cpu
    progress: bool = True  # rich progress bar on a terminal; plain log lines otherwise


def demo_config(run_dir: str | os.PathLike = "runs/demo") -> TrainConfig:
    """The demo's run: the default copy task, stopped once held-out accuracy reaches 95% (~100 steps)."""
    return TrainConfig(steps=300, eval_every=10, ckpt_every=0, stop_at_acc=0.95, run_dir=Path(run_dir))


def _from_dict(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(
            f"config {where or 'root'} must be a JSON object, got {type(data).__name__}; "
            f'write it as {{"field": value, ...}} as run_dir/config.json does.'
        )
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known.keys())
    if unknown:
        raise ValueError(
            f"config {where or 'root'} has unknown key(s) {unknown}, expected only {sorted(known)}; "
            f"remove or rename them."
        )
    kwargs = {}
    for name, value in data.items():
        sub = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig}.get(name) if cls is TrainConfig else None
        if sub is not None:
            value = _from_dict(sub, value, f"{where}{name}.")
        elif name in ("run_dir", "text_path") and value is not None:
            value = Path(value)
        kwargs[name] = value
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """A :class:`TrainConfig` from its ``asdict`` form; unknown keys raise ``ValueError``."""
    return _from_dict(TrainConfig, data, "")


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """JSON-ready form: paths as strings."""

    def fix(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: fix(v) for k, v in obj.items()}
        return str(obj) if isinstance(obj, Path) else obj

    return fix(asdict(cfg))


def load_config(path: str | os.PathLike) -> TrainConfig:
    """Read a config written by :func:`save_config` (or by hand); JSON only."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config {str(path)!r} does not exist; pass a run's config.json.") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--config {str(path)!r} is not valid JSON ({e}); fix the file or pass a run's config.json."
        ) from None
    return config_from_dict(data)


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """Write ``cfg`` as indented JSON, atomically (temp file in the same directory, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config_to_dict(cfg), indent=2) + "\n")
    os.replace(tmp, path)
