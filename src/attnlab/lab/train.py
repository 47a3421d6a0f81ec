"""The training loop: one process, or one of N under ``torchrun`` (DistributedDataParallel).

Everything a step does is a function of (config, step, saved state): the batch comes from
``task.batch(step, rank, world)``, the learning rate from ``lr_at(step)``, dropout from torch's
global RNG (saved in checkpoints). So a run killed at any point and resumed from its last
checkpoint ends with the same weights as one never interrupted.

Run directory (rank 0 alone writes): ``config.json`` (at start), ``metrics.jsonl`` (one line per
step), ``checkpoint.safetensors`` (every ``ckpt_every`` steps and at the end), ``curve.png``,
``summary.json`` and, for TinyGPT, ``model/`` (loadable by ``attnlab.load_checkpoint`` and
``attnlab generate --checkpoint``).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .config import TrainConfig, config_from_dict, config_to_dict, save_config
from .data import IGNORE, build_task
from .models import build_model
from .progress import Reporter
from .train_state import CKPT_NAME, load_train_state, read_meta, save_train_state

__all__ = ["RunResult", "train", "lr_at"]


@dataclass
class RunResult:
    """What :func:`train` returns; ``model`` is the trained network (unwrapped, eval mode, on CPU)."""

    run_dir: Path | None  # None when nothing was written (``write=False``)
    model: nn.Module
    task: Any  # the data source: ``task.tokenizer`` turns its ids into text
    final: dict[str, Any]  # eval_loss, eval_acc, steps, wall_s, seconds_to_target, ...
    history: list[dict[str, Any]] = field(repr=False)  # one record per step (and step 0's evaluation)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of the update that follows ``step`` completed steps: linear warm-up, then cosine."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _masked_stats(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Summed cross-entropy, correct predictions and count over the scored (non-IGNORE) positions."""
    V = logits.size(-1)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, V), y.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )  # (B*T, V) vs (B*T,)
    scored = y != IGNORE  # (B, T)
    correct = (logits.argmax(-1) == y)[scored].sum()
    return loss_sum, correct, scored.sum()


@torch.no_grad()
def evaluate(model: nn.Module, task: Any, n_batches: int, device: torch.device) -> dict[str, float]:
    """Held-out loss and accuracy at the scored positions, on the same ``n_batches`` batches every time."""
    was_training = model.training
    model.eval()
    loss_sum = correct = count = 0.0
    for i in range(n_batches):
        x, y = (t.to(device) for t in task.batch(i, split="eval"))
        ls, c, n = _masked_stats(model(x), y)
        loss_sum, correct, count = loss_sum + float(ls), correct + float(c), count + float(n)
    model.train(was_training)
    return {"eval_loss": loss_sum / count, "eval_acc": correct / count}


def _param_digest(model: nn.Module) -> bytes:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def _setup_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """``(rank, world, device)``; under torchrun (WORLD_SIZE > 1) also joins the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if world == 1:
        return 0, 1, torch.device("cuda" if use_cuda else "cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _check_resumable(saved: TrainConfig, cfg: TrainConfig, path: Path) -> None:
    for name in ("data", "model", "optim", "seed"):
        if getattr(saved, name) != getattr(cfg, name):
            raise ValueError(
                f"--resume: {name} differs from the checkpoint's in {str(path)!r} "
                f"(got {getattr(cfg, name)}, saved {getattr(saved, name)}); resume with the run's own "
                f"config (attnlab train --config RUN/config.json --resume) or use a new --run-dir."
            )


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl``; a line torn by a kill mid-write is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _trim_metrics(path: Path, keep_through: int) -> list[dict[str, Any]]:
    """Drop metric lines past the checkpoint (the resumed run writes those steps again); returns the rest."""
    kept = [r for r in _read_metrics(path) if r.get("step", keep_through + 1) <= keep_through]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def train(cfg: TrainConfig, *, write: bool = True, quiet: bool = False) -> RunResult:
    """Train as ``cfg`` says; returns the model, final metrics and history.

    Args:
        cfg: the run. With ``cfg.resume`` and a checkpoint in ``cfg.run_dir``, continues it.
        write: write the run directory (False: nothing touches the disk, as ablate-heads wants).
        quiet: print nothing (no bar, no log lines).
    """
    rank, world, device = _setup_distributed(cfg)
    if world == 1:
        return _train(cfg, rank, world, device, write=write, quiet=quiet)
    finished = False
    try:
        result = _train(cfg, rank, world, device, write=write and rank == 0, quiet=quiet or rank != 0)
        finished = True
        return result
    finally:
        # The DDP wrapper sits in a reference cycle, so it (and the process group its reducer holds) would
        # otherwise die at some later garbage collection, or at interpreter exit, where gloo's still-running
        # threads abort the process ("terminate called without an active exception", 3 runs in 70
        # on a loaded 2-core machine). Free it now, wait for rank 0's writes, then leave the group.
        gc.collect()
        if dist.is_initialized():
            if finished:
                dist.barrier()  # a rank that raised skips this: the others then fail on their own timeout
            dist.destroy_process_group()


def _train(cfg: TrainConfig, rank: int, world: int, device: torch.device, *, write: bool, quiet: bool) -> RunResult:
    if cfg.data.batch_size % world:
        raise ValueError(
            f"--data.batch-size {cfg.data.batch_size} must be divisible by the {world} processes; "
            f"use a multiple of {world}."
        )
    task = build_task(cfg.data)
    torch.manual_seed(cfg.seed)  # model init, then dropout: the one RNG a checkpoint must carry
    # +1 position: generation checks prompt + new tokens <= block_size, and a whole task sequence is one longer than x
    raw = build_model(cfg.model, task.vocab_size, task.block_size + 1).to(device)
    decay = [p for p in raw.parameters() if p.dim() >= 2]  # matrices and embeddings decay; biases and norms do not
    no_decay = [p for p in raw.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
    )
    run_dir = Path(cfg.run_dir)
    ckpt_path, metrics_path = run_dir / CKPT_NAME, run_dir / "metrics.jsonl"
    start = 0
    if cfg.resume and ckpt_path.exists():
        _check_resumable(config_from_dict(read_meta(ckpt_path)["config"]), cfg, ckpt_path)
        start = load_train_state(ckpt_path, raw, optimizer)  # every rank loads: same weights, same RNG
    model = nn.parallel.DistributedDataParallel(raw) if world > 1 else raw
    if write:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(dataclasses.replace(cfg, resume=False), run_dir / "config.json")  # reloading it starts a fresh run
    history: list[dict[str, Any]] = []
    if write and start:
        history = _trim_metrics(metrics_path, start)
    elif write:
        metrics_path.write_text("")

    def log(rec: dict[str, Any]) -> None:
        history.append(rec)
        if write:
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")

    def checkpoint(step: int) -> None:
        if write:
            save_train_state(ckpt_path, raw, optimizer, step, config_to_dict(cfg))

    reporter = Reporter(cfg.steps, start, enabled=not quiet, log_every=cfg.log_every, use_bar=cfg.progress)
    if start:
        reporter.print(f"resumed {ckpt_path} at step {start}")
    t0 = time.perf_counter()
    seconds_to_target: float | None = None
    target = cfg.stop_at_acc if cfg.stop_at_acc is not None else 0.95
    if start == 0:
        log({"step": 0, **evaluate(raw, task, cfg.eval_batches, device), "wall_s": 0.0})
    model.train()
    step = start
    try:
        while step < cfg.steps:
            t_step = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = (t.to(device) for t in task.batch(step, rank, world))
            loss_sum, correct, count = _masked_stats(model(x), y)
            loss = loss_sum / count.clamp(min=1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over ranks here
            if cfg.optim.grad_clip > 0:
                nn.utils.clip_grad_norm_(raw.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            step += 1
            stats = torch.stack([loss_sum.detach(), correct.float(), count.float()])  # (3,)
            if world > 1:
                dist.all_reduce(stats)  # loss and accuracy over the global batch, not rank 0's shard
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t_step
            rec: dict[str, Any] = {
                "step": step,
                "loss": float(stats[0] / stats[2].clamp(min=1)),
                "acc": float(stats[1] / stats[2].clamp(min=1)),
                "lr": lr,
                "tokens_per_s": cfg.data.batch_size * task.block_size / dt,
            }
            if step % cfg.eval_every == 0 or step == cfg.steps:
                rec.update(evaluate(raw, task, cfg.eval_batches, device))  # every rank: same weights, same answer
                rec["wall_s"] = time.perf_counter() - t0
                if seconds_to_target is None and rec["eval_acc"] >= target:
                    seconds_to_target = rec["wall_s"]
            log(rec)
            reporter.update(rec)
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < cfg.steps:
                checkpoint(step)
            if cfg.stop_at_acc is not None and rec.get("eval_acc", -1.0) >= cfg.stop_at_acc:
                break
    finally:
        reporter.close()
    wall = time.perf_counter() - t0
    if not history or "eval_acc" not in history[-1]:  # stopped between evaluations: final figures are held-out ones
        if not history:
            history.append({"step": step})
        history[-1].update(evaluate(raw, task, cfg.eval_batches, device))
        history[-1]["wall_s"] = wall
    checkpoint(step)

    digest = _param_digest(raw)
    digests = [digest]
    if world > 1:
        mine = torch.tensor(list(digest), dtype=torch.int64, device=device)  # (32,)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        digests = [bytes(t.cpu().tolist()) for t in gathered]
    identical = len(set(digests)) == 1
    last = history[-1]
    final = {
        "steps": step,
        "eval_loss": last["eval_loss"],
        "eval_acc": last["eval_acc"],
        "train_loss": last.get("loss"),
        "wall_s": wall,
        "target_acc": target,
        "seconds_to_target": seconds_to_target,
        "chance_acc": task.chance_acc,
        "loss_floor": getattr(task, "loss_floor", None),
        "world_size": world,
        "rank_param_sha256": [d.hex() for d in digests],
        "ranks_identical": identical,
        "params": sum(p.numel() for p in raw.parameters()),
    }
    raw = raw.cpu().eval()
    if write:
        from .plots import plot_run

        final["curve"] = str(
            plot_run(
                history,
                run_dir / "curve.png",
                chance_acc=task.chance_acc,
                loss_floor=final["loss_floor"],
                title=f"{cfg.model.kind} on {cfg.data.task}",
            )
        )
        if cfg.model.kind == "gpt":
            from ..models.gpt import TinyGPT
            from ..models.saved_model import save_checkpoint

            gpt = cast(TinyGPT, raw)  # kind "gpt" builds a TinyGPT
            final["model_dir"] = str(save_checkpoint(gpt, run_dir / "model", tokenizer=task.tokenizer))
        final["checkpoint"] = str(ckpt_path)
        tmp = run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(final, indent=2) + "\n")
        os.replace(tmp, run_dir / "summary.json")
    reporter.print(
        f"done: {step} steps in {wall:.1f}s, held-out loss {final['eval_loss']:.4f}, "
        f"acc {final['eval_acc']:.3f} (chance {task.chance_acc:.3f})"
        + (f", {target:.0%} reached after {seconds_to_target:.1f}s" if seconds_to_target is not None else "")
    )
    if not identical:
        raise RuntimeError(
            f"ranks ended with different weights (sha256 {[d.hex()[:12] for d in digests]}); "
            f"DDP lost sync, a bug: rerun with ATTNLAB_DEBUG=1 and report it."
        )
    return RunResult(run_dir if write else None, raw, task, final, history)


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """``dataclasses.replace`` that reaches into ``data``/``model``/``optim`` with ``"model.n_head"`` keys."""
    nested: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in changes.items():
        if "." in key:
            part, name = key.split(".", 1)
            nested.setdefault(part, {})[name] = value
        else:
            top[key] = value
    for part, sub in nested.items():
        top[part] = dataclasses.replace(getattr(cfg, part), **sub)
    return dataclasses.replace(cfg, **top)
