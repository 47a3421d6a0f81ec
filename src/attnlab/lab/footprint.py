"""What a training run will take, from its config alone, checked before the model exists.

Memory (per process): the weights, their gradients and AdamW's two moments (16 bytes a float32
weight); the activations autograd keeps for the backward pass; the logits; and, where SDPA cannot
use its fused kernel (attention dropout > 0 falls back to the math path), the ``(B, H, T, T)``
scores of every layer. Disk (rank 0): the checkpoint twice (the atomic save holds the old and the
new until the rename), ``model/``, ``metrics.jsonl`` and the small files; its largest file against
``ulimit -f``. Memory is checked after importing what the run's last writes need
(:func:`attnlab.lab.train.import_writers`), so that ``ulimit -v`` is measured against it too. Both are estimates,
counted from formulas rather than by building the model: a model built on the meta device
took 45 ms (2.4 s on first use) on a 2-core CPU, the formulas about 30 us.

Measured, to set the constants (CPU, float32, TinyGPT E=64, B=4, T=2048, 2 layers): forward and
backward took 101 MB above the weights, ~24 ``B x T x E`` float32 tensors a layer plus 3 of
the logits; with dropout 0.1, 1.9 GB, ~3.7 copies of each layer's scores more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models.gpt import GPTConfig
from ..runtime import LimitError, check_fits, check_free_space, nbytes
from ..runtime.disk import file_size_limit
from ..runtime.memory import largest_fitting
from ..weight_files.file_checks import gpt_weight_count
from .config import ModelConfig, TrainConfig
from .data import length_flag

__all__ = ["TrainFootprint", "train_footprint", "check_train_fits", "check_study_room", "model_weights"]

ACTIVATIONS_PER_LAYER = 24  # float32 (B, T, E) tensors a layer keeps for backward (measured, module docstring)
SCORE_COPIES = 4  # (B, H, T, T) float32 tensors a layer holds on the math path (weights, dropout mask, grads)
LOGIT_COPIES = 3  # logits, cross-entropy's log-softmax, its gradient
METRICS_LINE = 256  # bytes of one step's line in metrics.jsonl (a training line is ~190)
HEAD_SCORE = 24  # bytes a head's score takes in an evaluation's line (name, value, punctuation)
SMALL_FILES = 512 * 1024  # curve.png (~60-150 KiB), summary.json, config.json, the safetensors headers
SEQUENCE_FLAG = {
    "copy": "--data.copy-len",
    "recall": "--data.n-pairs",
    "random": "--data.seq-len",
    "text": "--data.seq-len",
}


def model_weights(m: ModelConfig, vocab_size: int, block_size: int) -> int:
    """The weights of ``build_model(m, vocab_size, block_size)``, counted from the config."""
    E, H, L = m.embed_dim, m.num_heads, m.num_layers
    kv = (m.num_kv_heads or H) * (E // H)
    if m.kind == "gpt":
        return gpt_weight_count(
            GPTConfig(
                vocab_size=vocab_size,
                block_size=block_size,
                n_layer=L,
                n_head=H,
                n_embd=E,
                n_kv_head=m.num_kv_heads,
                position=m.position,
            )
        )
    F = m.ff_mult * E
    attention = 2 * (E * E + E) + 2 * (E * kv + kv)  # q, out; k, v (with biases)
    block = attention + 4 * E + (E * F + F) + (F * E + E)  # + two LayerNorms + the feed-forward
    return vocab_size * E + block_size * E + L * block + (E * vocab_size + vocab_size)


@dataclass(frozen=True)
class TrainFootprint:
    """What one process of the run holds (``memory``) and what rank 0 writes (``disk``), each by part, in bytes."""

    weights: int
    memory: dict[str, int]
    disk: dict[str, int]
    largest_file: tuple[str, int] = ("", 0)  # the biggest single file written, by name: what `ulimit -f` must allow


def train_footprint(
    cfg: TrainConfig, vocab_size: int, block_size: int, *, replicas: int = 1, context: int = 1, resuming: bool = False
) -> TrainFootprint:
    """The footprint of ``cfg`` on a task of ``vocab_size`` ids and ``block_size`` tokens, for one of ``replicas``
    data-parallel replicas holding ``1 / context`` of each sequence; ``resuming``: its checkpoint is on disk."""
    m = cfg.model
    P = model_weights(m, vocab_size, block_size + 1)  # + 1 position, as train builds it
    B, T = max(1, cfg.data.batch_size // replicas), max(1, block_size // context)
    memory = {
        "weights, gradients and AdamW state": 16 * P,
        "activations": 4 * m.num_layers * ACTIVATIONS_PER_LAYER * B * T * m.embed_dim,
        "logits": 4 * LOGIT_COPIES * B * T * vocab_size,
    }
    if m.dropout > 0:
        memory["attention scores (dropout > 0: no fused kernel)"] = (
            4 * SCORE_COPIES * m.num_layers * B * m.num_heads * T * T
        )
    checkpoint = 12 * P + SMALL_FILES // 8  # weights and AdamW's two moments, float32
    evals = cfg.steps // max(1, cfg.eval_every) + 2
    heads = m.num_layers * m.num_heads * 4 * HEAD_SCORE if cfg.log_head_scores else 0
    disk = {
        "checkpoint.safetensors" + (" (the new beside the old)" if resuming else " x 2 (old and new while saving)"): (
            1 if resuming else 2
        )
        * checkpoint,
        "model/": 4 * P if m.kind == "gpt" else 0,
        "metrics.jsonl": cfg.steps * METRICS_LINE + evals * heads,
        "curve.png and the small files": SMALL_FILES,
    }
    files = {"checkpoint.safetensors": checkpoint, "model/model.safetensors": 4 * P if m.kind == "gpt" else 0}
    files["metrics.jsonl"] = disk["metrics.jsonl"]
    return TrainFootprint(P, memory, disk, max(files.items(), key=lambda item: item[1]))


def _memory_fix(
    cfg: TrainConfig, fp: TrainFootprint, vocab_size: int, block_size: int, replicas: int, context: int
) -> Any:
    """The flag to shrink, as a function of the bytes available: the one behind the largest part, and how far."""

    def need(c: TrainConfig) -> int:
        return sum(train_footprint(c, vocab_size, block_size, replicas=replicas, context=context).memory.values())

    def fix(free: int) -> str:
        largest = max(fp.memory, key=lambda k: fp.memory[k])
        if largest.startswith("weights"):
            E = largest_fitting(
                lambda e: need(_with(cfg, model={"embed_dim": e * cfg.model.num_heads})) <= free,
                1,
                max(1, cfg.model.embed_dim // cfg.model.num_heads),
            )
            if E >= 1:
                return (
                    f"pass --model.embed-dim {E * cfg.model.num_heads} or less (a multiple of --model.num-heads "
                    f"{cfg.model.num_heads}), or fewer --model.num-layers"
                )
            return "this machine cannot hold even the smallest model of this vocabulary: use one with more memory"
        if largest.startswith("attention scores"):
            return (
                f"pass --model.dropout 0 (SDPA's fused kernel then keeps no (T, T) scores), or a smaller "
                f"--data.batch-size or {length_flag(cfg.data)[0]}"
            )
        batch = largest_fitting(lambda b: need(_with(cfg, data={"batch_size": b})) <= free, 1, cfg.data.batch_size)
        sequence = length_flag(cfg.data)[0]
        if batch >= 1:
            return f"pass --data.batch-size {batch} or less, or a smaller {sequence}"
        return f"pass a smaller {sequence} (at --data.batch-size 1 the sequences alone do not fit)"

    return fix


def _with(cfg: TrainConfig, **parts: dict[str, Any]) -> TrainConfig:
    import dataclasses

    return dataclasses.replace(
        cfg, **{name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in parts.items()}
    )


def check_train_fits(
    cfg: TrainConfig,
    vocab_size: int,
    block_size: int,
    device: torch.device,
    *,
    replicas: int = 1,
    context: int = 1,
    resuming: bool = False,
    write: bool = True,
) -> TrainFootprint:
    """Refuse, before the model is built, a run past this machine's memory (every rank) or its disk's free space
    (``write``: the rank that writes); :class:`attnlab.runtime.LimitError` with the figures and the flag."""
    fp = train_footprint(cfg, vocab_size, block_size, replicas=replicas, context=context, resuming=resuming)
    parts = ", ".join(f"{name} {nbytes(n)}" for name, n in fp.memory.items() if n)
    check_fits(
        sum(fp.memory.values()),
        f"training {fp.weights:,} weights at --data.batch-size {cfg.data.batch_size} x {block_size} tokens ({parts})",
        _memory_fix(cfg, fp, vocab_size, block_size, replicas, context),
        device,
    )
    if write:
        check_free_space(cfg.out_dir, fp.disk)
        limit = file_size_limit()
        name, size = fp.largest_file
        if limit is not None and size > limit:
            raise LimitError(
                f"`ulimit -f` allows files of {nbytes(limit)} (RLIMIT_FSIZE) but this run writes {name} of about "
                f"{nbytes(size)} to {str(cfg.out_dir)!r}; raise the limit (`ulimit -f unlimited`) in the shell that "
                f"runs attnlab, or shrink the model (--model.embed-dim, --model.num-layers)."
            )
    return fp


def check_study_room(runs: Iterable[TrainConfig], out: Path) -> None:
    """Refuse, before its first run, an ablate-heads study whose runs still to do will not fit on ``out``'s disk:
    each keeps its checkpoint, model/, metrics and figure, and the one being saved needs a second checkpoint."""
    from .data import build_task

    todo = [run for run in runs if not (Path(run.out_dir) / "summary.json").is_file()]
    if not todo:
        return
    sizes: dict[str, tuple[int, int]] = {}  # the task's (vocab, block) by its data config: the seeds share them
    kept = {"checkpoints": 0, "model/ directories": 0, "metrics.jsonl files": 0, "figures and small files": 0}
    spare = 0
    for run in todo:
        key = repr(dataclasses.replace(run.data, seed=0))
        if key not in sizes:
            task = build_task(run.data)
            sizes[key] = (task.vocab_size, task.block_size)
        disk = train_footprint(run, *sizes[key]).disk
        checkpoint = next(n for name, n in disk.items() if name.startswith("checkpoint")) // 2
        for part, n in zip(kept, (checkpoint, disk["model/"], disk["metrics.jsonl"], SMALL_FILES), strict=True):
            kept[part] += n
        spare = max(spare, checkpoint)
    kept["a checkpoint's new copy while saved"] = spare
    check_free_space(out, kept, who=f"this study ({len(todo)} runs to do)")
