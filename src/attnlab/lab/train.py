"""The training loop: one process, or one of N under ``torchrun`` (DistributedDataParallel).

Everything a step does is a function of (config, step, saved state): the batch comes from
``task.batch(step, rank, world)``, the learning rate from ``lr_at(step)``, dropout from torch's
global RNG (saved in checkpoints). So a run killed at any point and resumed from its last
checkpoint ends with the same weights as one never interrupted.

Before any work the whole config is checked (:mod:`.validation`), the device resolved, and the
run directory checked (:mod:`.run_dir`: a run there is never replaced) and proven writable.
Memory and disk space are estimated from the config before the model is built (:mod:`.footprint`);
a disk that fills up all the same stops the run at the write that found it, with one line naming the
checkpoint left intact, the steps lost since it and the resume command; ``metrics.jsonl`` gets whole
lines only, ``model/`` appears whole or not at all.
A stop signal (SIGINT, SIGTERM, SIGHUP, ...: :mod:`.stopping`) stops the run between steps with a
checkpoint; a NaN or infinite loss stops it before the weights take the bad update, keeping the last
good checkpoint. Under ``torchrun`` both decisions ride on the all-reduce each step already does, so
every rank stops at the same step; a rank that dies or stops answering for ``--rank-timeout`` seconds
ends every rank with one line naming it and the command that resumes
(:mod:`attnlab.distributed.failures`).

Run directory (rank 0 alone writes): ``config.json`` (at start), ``metrics.jsonl`` (one line per
step; each evaluation's line also holds every head's scores with ``log_head_scores``, see :mod:`.head_scores`), ``checkpoint.safetensors`` (every ``ckpt_every`` steps, on a stop signal and at the end),
``curve.png``, ``summary.json`` and, for TinyGPT, ``model/`` (loadable by
``attnlab.load_checkpoint`` and ``attnlab generate --checkpoint``).

``--context-parallel C`` (under ``torchrun``, ``WORLD_SIZE = C x D``) splits each sequence of a
data-parallel replica over ``C`` ranks (:mod:`.parallel` has the rank layout); the per-step losses
are the single-process run's on the same data.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed.failures import (
    DEFAULT_RANK_TIMEOUT,
    LOST_EXIT,
    Job,
    RankFailure,
    RankLost,
    diagnose,
    ended,
    join,
    local_job,
    mark_left,
    watch_joining,
)
from ..runtime import DiskFullError, LimitError, UsageError, append_whole, atomic_write_text, nbytes
from ..runtime.disk import is_disk_full
from ..runtime.streams import stdout_target
from .config import OptimConfig, TrainConfig, config_from_dict, config_to_dict, save_config
from .data import IGNORE, build_task
from .footprint import check_train_fits
from .head_scores import HeadScorer
from .models import build_model
from .parallel import ProcessLayout, check_context_parallel, cp_loss, make_context_parallel, shard_batch
from .progress import Reporter
from .run_dir import RunClaim, claim_out_dir, free_sibling, read_metrics, resume_metrics, train_command_line
from .stopping import StopSignals, TrainingDiverged, TrainingInterrupted, first_signal, print_line, signal_slots
from .train_state import CKPT_NAME, load_train_state, read_meta, save_train_state
from .validation import validate_train

__all__ = [
    "ReaderGone",
    "RunFolderGone",
    "RunResult",
    "RunStopped",
    "train",
    "lr_at",
    "read_metrics",
    "TrainingInterrupted",
    "TrainingDiverged",
]


@dataclass
class RunResult:
    """What :func:`train` returns; ``model`` is the trained network (unwrapped, eval mode, on CPU)."""

    run_dir: Path | None  # cfg.out_dir; None when nothing was written (``write=False``)
    model: nn.Module
    task: Any  # the data source: ``task.tokenizer`` turns its ids into text
    final: dict[str, Any]  # eval_loss, eval_acc, steps, wall_s, seconds_to_target, ...
    history: list[dict[str, Any]] = field(repr=False)  # one record per step (and step 0's evaluation)


class RunStopped(OSError):
    """The run's surroundings stopped it (its folder removed, its stdout's reader gone); ``str`` is the line to
    print (what was saved, and the command that resumes), ``exit_code`` the process's."""

    code = errno.EIO
    exit_code = 1

    def __init__(self, line: str) -> None:
        super().__init__(self.code, line)
        self.line = line

    def __str__(self) -> str:
        return self.line


class RunFolderGone(RunStopped):
    """The run folder was removed while the run wrote to it."""

    code = errno.ENOENT


class ReaderGone(RunStopped):
    """stdout is a pipe whose reader went away (``attnlab train | head``): exit 141, as a tool killed by SIGPIPE."""

    code = errno.EPIPE
    exit_code = 141


def import_writers() -> None:
    """Import what a run's writes need later (safetensors for its checkpoints, matplotlib for curve.png), before
    its memory is checked: under ``ulimit -v`` a failure then comes first, named, instead of at the first save.

    Raises:
        LimitError: an import ran out of the address space ``ulimit -v`` (RLIMIT_AS) allows.
    """
    try:
        import safetensors.torch  # noqa: F401

        from .plots import plot_run  # noqa: F401  (the module, not the package: no cycle with lab/__init__)
    except (ImportError, MemoryError, OSError) as err:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise LimitError(
            f"`ulimit -v` allows this process {nbytes(soft)} of address space (RLIMIT_AS), too little to load "
            f"safetensors and matplotlib, which a run writes its checkpoints and curve with ({first}); raise the "
            f"limit (`ulimit -v unlimited`) in the shell that runs attnlab."
        ) from None


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of the update that follows ``step`` completed steps: linear warm-up, then cosine."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.steps - o.warmup_steps))
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def retry_lr(lr: float) -> float:
    """The rate to suggest after a divergence at ``lr``: ten times lower, and no higher than the default."""
    return min(lr / 10, OptimConfig().lr)


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


def _setup_distributed(
    device: torch.device, world: int, refusal: UsageError | None = None, timeout_s: float = DEFAULT_RANK_TIMEOUT
) -> tuple[int, torch.device, Job | None]:
    """``(rank, device, job)``; under torchrun (WORLD_SIZE > 1) also joins the process group (``job``; None alone).

    ``refusal``: rank 0's verdict on the run folder (it alone locks and checks it, before the group
    exists); every rank hears it here and raises it, so none is left waiting on a collective.
    ``timeout_s`` (``--rank-timeout``): how long any collective of the run waits for a rank that stopped
    answering before it fails (:mod:`attnlab.distributed.failures`; gloo's own default is 30 minutes).
    """
    if world == 1:
        return 0, device, None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(
            f"--device {device.type} under torchrun: attnlab's DDP runs on cpu (gloo) or cuda (nccl); pass --device cpu."
        )
    job = join("nccl" if device.type == "cuda" else "gloo", timeout_s)
    rank = job.rank
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    verdict = [None if refusal is None else str(refusal)]  # rank 0's; also a barrier: no rank runs ahead of it
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        dist.destroy_process_group()
        raise refusal if refusal is not None else UsageError(verdict[0])
    return rank, device, job


def _check_resumable(saved: TrainConfig, cfg: TrainConfig, path: Path) -> None:
    for name in ("data", "model", "optim", "seed"):
        if getattr(saved, name) != getattr(cfg, name):
            out = Path(cfg.out_dir)
            raise UsageError(
                f"--resume: {name} differs from the checkpoint's in {str(path)!r} "
                f"(got {getattr(cfg, name)}, saved {getattr(saved, name)}); continue the run as it was with "
                f"`{train_command_line(cfg, out, resume=True, keep=False)}`, or start a new run with these settings "
                f"with `{train_command_line(cfg, free_sibling(out))}`."
            )


def _trim_metrics(path: Path, keep_through: int, quiet: bool) -> list[dict[str, Any]]:
    """Drop metric lines past the checkpoint (the resumed run writes those steps again); returns the rest.
    Each line is checked first (:func:`.run_dir.read_metrics`), and lost ones are said (:func:`.run_dir.resume_metrics`)."""
    kept = resume_metrics(path, keep_through, quiet=quiet)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _grad_norm(model: nn.Module, clip: float) -> Tensor:
    """The global gradient norm (after clipping to ``clip`` when ``clip > 0``), as a 0-d tensor."""
    if clip > 0:
        return nn.utils.clip_grad_norm_(model.parameters(), clip)
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))  # (n,) -> ()


def train(
    cfg: TrainConfig,
    *,
    write: bool = True,
    quiet: bool = False,
    overwrite: bool = False,
    stop: StopSignals | None = None,
) -> RunResult:
    """Train as ``cfg`` says; returns the model, final metrics and history.

    Args:
        cfg: the run. With ``cfg.resume``, continues the run in ``cfg.out_dir`` from its checkpoint.
        write: write the run directory (False: nothing touches the disk).
        quiet: print nothing (no bar, no log lines).
        overwrite: replace a run already in ``cfg.out_dir`` (its run files are deleted first); for
            callers that own the directory, such as ``attnlab demo``. The command line never sets it.
        stop: the stop-signal flag to obey (the command line and ablate-heads share one across the
            command); None: train installs its own for the duration of the call.

    Raises:
        UsageError: a config value out of range, a device this torch cannot use, an ``out_dir`` that
            already holds a run, is held by another process (its PID named) or cannot be written,
            ``resume`` with no checkpoint to resume, a checkpoint of another run, a damaged run file
            (named with its field). Raised before any training; what a run failing before its first
            step wrote is removed (:class:`.run_dir.RunClaim`).
        TrainingInterrupted: a stop signal arrived (on any rank); the step under way finished and the
            checkpoint was written. ``str(err)`` is the line to print, with the resume command.
        RankLost: under torchrun, another rank died or stopped answering; ``str(err)`` is the line
            (on one rank: ``announce``), with the command that resumes from the last checkpoint.
        TrainingDiverged: the loss or gradient norm became NaN/inf; the bad update was not applied,
            no model was written and the last checkpoint was left as it was.
    """
    device = validate_train(cfg)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    check_context_parallel(cfg, world, device)
    _check_batch_split(cfg, world)
    # rank 0 locks the folder, then checks it (run_dir.claim_out_dir); a run failing before step 1 removes its files
    claim = claim_out_dir(cfg, overwrite=overwrite, quiet=quiet, defer=world > 1) if write and rank == 0 else RunClaim()
    with claim, stop or StopSignals() as signals:
        if world == 1:
            rank, device, _ = _setup_distributed(device, world)
            layout = ProcessLayout(world, rank, cfg.context_parallel)
            return _train(cfg, layout, device, write=write, quiet=quiet, stop=signals)
        job: Job | None = None
        lost = False
        try:
            with watch_joining(cfg.rank_timeout, partial(_lost_while_joining, cfg)):
                rank, device, job = _setup_distributed(device, world, claim.refusal, cfg.rank_timeout)
            layout = ProcessLayout(world, rank, cfg.context_parallel)
            try:
                result = _train(cfg, layout, device, write=write and rank == 0, quiet=quiet or rank != 0, stop=signals)
            except (TrainingInterrupted, TrainingDiverged):
                dist.barrier()  # every rank took the same decision at the same step: wait for rank 0's checkpoint
                raise
            # waits for rank 0's last writes, and shares a signal that came during them: every rank exits alike
            slots = torch.tensor(signal_slots(world, rank, signals.signum), device=device)  # (world,)
            dist.all_reduce(slots)
            signals.agree(*first_signal(slots.tolist()))
            return result
        except RuntimeError as err:  # a collective failed: a rank died or stopped answering, or a bug of ours
            if isinstance(err, (TrainingDiverged, RankLost)):
                raise
            job = job or local_job(cfg.rank_timeout)  # failed while joining: the peers this host can see
            failure = diagnose(job, err)
            if failure is None:
                raise
            lost = True
            mark_left(job)
            raise RankLost(_lost_line(cfg, job, failure), failure=failure, announce=rank == failure.reporter) from None
        finally:
            # The DDP wrapper sits in a reference cycle, so it (and the process group its reducer holds) would
            # otherwise die at some later garbage collection, or at interpreter exit, where gloo's still-running
            # threads abort the process ("terminate called without an active exception", 3 runs in 70
            # on a loaded 2-core machine). Free it now, then leave the group (rank 0's writes were waited for above).
            # A group with a lost rank is left as it is: the command line ends the process at once (cli.py).
            gc.collect()
            if dist.is_initialized() and not lost:
                dist.destroy_process_group()


def _lost_while_joining(cfg: TrainConfig, job: Job, failure: RankFailure) -> None:
    """A rank died before the group formed (:func:`watch_joining`'s thread): the line (one rank prints it), then
    this process ends at once, as a lost rank does after the group formed (``cli.py``): no group exists to leave."""
    if job.rank == failure.reporter:
        print_line(_lost_line(cfg, job, failure))
    os._exit(LOST_EXIT)


def _lost_line(cfg: TrainConfig, job: Job, failure: RankFailure) -> str:
    """The one line a lost rank gets: which, how, and the command that resumes the run (or starts it again)."""
    out = Path(cfg.out_dir)
    ckpt = out / CKPT_NAME
    try:
        step: int | None = int(read_meta(ckpt)["step"]) if ckpt.is_file() else None
    except (UsageError, KeyError, TypeError, ValueError, OSError):
        step = None
    wait = ended(job, failure)
    if ckpt.is_file():
        at = f"step {step} of {cfg.steps}, " if step is not None else ""
        then = (
            f"resume from its last checkpoint ({at}{ckpt}){wait} with "
            f"`{train_command_line(cfg, out, resume=True, keep=False)}`"
        )
    else:  # rank 0's claim removes the files of a run that trained no step (run_dir.RunClaim): then the same folder
        try:
            trained = any(r.get("step", 0) >= 1 for r in read_metrics(out / "metrics.jsonl"))
        except (UsageError, OSError):
            trained = True
        again = out if not trained and 0 not in failure.lost else free_sibling(out)
        then = (
            f"no checkpoint had been written yet (--ckpt-every {cfg.ckpt_every}); start it again{wait} with "
            f"`{train_command_line(cfg, again)}`"
        )
    return f"attnlab: {failure.what}; so every rank stopped. {then[0].upper()}{then[1:]}"


def _check_batch_split(cfg: TrainConfig, world: int) -> None:
    """The batch splits into equal shares, one per data-parallel replica (``WORLD_SIZE / --context-parallel``)."""
    replicas = world // cfg.context_parallel
    if cfg.data.batch_size % replicas == 0:
        return
    fix = max(replicas, cfg.data.batch_size // replicas * replicas)
    if cfg.context_parallel == 1:
        raise UsageError(
            f"--data.batch-size {cfg.data.batch_size} must be divisible by the {world} processes, "
            f"so that each gets the same share; pass --data.batch-size {fix}."
        )
    raise UsageError(
        f"--data.batch-size {cfg.data.batch_size} must be divisible by the {replicas} data-parallel replicas "
        f"(WORLD_SIZE {world} / --context-parallel {cfg.context_parallel}), so that each gets the same share; "
        f"pass --data.batch-size {fix}."
    )


def _train(
    cfg: TrainConfig, layout: ProcessLayout, device: torch.device, *, write: bool, quiet: bool, stop: StopSignals
) -> RunResult:
    rank, world = layout.rank, layout.world
    cp = make_context_parallel(layout, cfg.rank_timeout)  # every rank, before any other collective of the run
    task = build_task(cfg.data)
    resuming = cfg.resume and (Path(cfg.out_dir) / CKPT_NAME).exists()
    vocab, block = task.vocab_size, task.block_size
    if write:
        import_writers()  # now, so that the memory check below counts them (issue 53: `ulimit -v` at the first save)
    check_train_fits(  # memory (every rank) and rank 0's disk, before the model exists
        cfg, vocab, block, device, replicas=layout.data, context=layout.context, resuming=resuming, write=write
    )
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
    out_dir = Path(cfg.out_dir)
    ckpt_path, metrics_path = out_dir / CKPT_NAME, out_dir / "metrics.jsonl"
    start = 0
    last_ckpt: int | None = None  # the step of the newest checkpoint on disk
    if cfg.resume and ckpt_path.exists():
        meta = read_meta(ckpt_path)
        _check_resumable(config_from_dict(meta["config"]), cfg, ckpt_path)
        if int(meta["step"]) > cfg.steps:
            raise UsageError(
                f"--steps {cfg.steps} is below the step of the checkpoint to resume ({meta['step']} in "
                f"{str(ckpt_path)!r}); pass --steps {meta['step']} or more."
            )
        start = last_ckpt = load_train_state(ckpt_path, raw, optimizer)  # every rank loads: same weights, same RNG
    model = nn.parallel.DistributedDataParallel(raw) if world > 1 else raw

    def out_of_space(err: DiskFullError, step: int, room: str = "free space there") -> DiskFullError:
        """``err`` saying what a run stopped by a full disk kept, what it lost, and how to go on."""
        if last_ckpt is None:
            lost = f", so its {step} step{'s are' if step != 1 else ' is'} lost" if step else ""
            again = free_sibling(out_dir) if step else out_dir  # a run that failed before step 1 leaves no files
            return err.refix(
                f"the run stopped at step {step} of {cfg.steps}, before its first checkpoint{lost}; {room}, "
                f"then start it again with `{train_command_line(cfg, again)}`"
            )
        since = {0: "no step since it is lost", 1: f"step {step} since it is lost"}.get(
            step - last_ckpt, f"steps {last_ckpt + 1}-{step} since it are lost"
        )
        if last_ckpt == step and step == cfg.steps:
            since = "training is complete (resuming writes the files still missing)"
        return err.refix(
            f"the checkpoint of step {last_ckpt} of {cfg.steps}, {ckpt_path}, is intact and {since}; {room}, "
            f"then resume with `{train_command_line(cfg, out_dir, resume=True, keep=False)}`"
        )

    history: list[dict[str, Any]] = []
    if write:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            save_config(dataclasses.replace(cfg, resume=False), out_dir / "config.json")  # reloading it starts afresh
            if start:
                history = _trim_metrics(metrics_path, start, quiet)
            else:
                metrics_path.write_text("")
        except DiskFullError as err:
            raise out_of_space(err, start) from None

    def folder_gone(step: int) -> RunFolderGone:
        """The run folder was removed under the run: made again, with the state of ``step`` saved there."""
        resume = f"resume with `{train_command_line(cfg, out_dir, resume=True, keep=False)}`"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            save_config(dataclasses.replace(cfg, resume=False), out_dir / "config.json")
            metrics_path.write_text("")
            checkpoint(step)
        except OSError as err:
            return RunFolderGone(
                f"attnlab: the run folder {str(out_dir)!r} was removed while the run wrote to it (at step {step} of "
                f"{cfg.steps}), and it could not be made again ({err.strerror or err}), so no checkpoint was kept; "
                f"start it again with `{train_command_line(cfg, free_sibling(out_dir))}`"
            )
        return RunFolderGone(
            f"attnlab: the run folder {str(out_dir)!r} was removed while the run wrote to it (at step {step} of "
            f"{cfg.steps}); attnlab made it again and saved the checkpoint of step {step} there, {ckpt_path} (the "
            f"metrics of earlier steps went with the folder); {resume}"
        )

    def log(rec: dict[str, Any]) -> None:
        history.append(rec)
        if write:
            try:  # whole lines only: a refused append is cut back, so metrics.jsonl never ends in half a record
                append_whole(metrics_path, (json.dumps(rec) + "\n").encode())
            except DiskFullError as err:
                raise out_of_space(err, rec["step"]) from None
            except FileNotFoundError:
                raise folder_gone(rec["step"]) from None

    def show(update: Callable[[], None], step: int) -> None:
        """A progress line; a stdout that refuses it (``> /dev/full``) stops the run with the step under way saved."""
        try:
            update()
        except BrokenPipeError:  # `| head`: the reader has what it wanted; the run's steps are kept all the same
            if last_ckpt != step:
                checkpoint(step)
            raise ReaderGone(
                f"attnlab: stdout's reader went away (a closed pipe, `| head`): stopped after step {step} of "
                f"{cfg.steps}, checkpoint saved to {ckpt_path}; resume with "
                f"`{train_command_line(cfg, out_dir, resume=True, keep=False)}`"
            ) from None
        except OSError as err:
            if not is_disk_full(err):
                raise
            if last_ckpt != step:
                checkpoint(step)
            refused = DiskFullError(
                err.errno or errno.ENOSPC, "stdout", "its progress lines", None, "", f"stdout ({stdout_target()})"
            )
            raise out_of_space(refused, step, "send stdout to a file on a disk with room (`> log.txt`)") from None

    def checkpoint(step: int) -> None:
        nonlocal last_ckpt
        if write:
            try:  # atomic: a refused save leaves the previous checkpoint as it was
                save_train_state(ckpt_path, raw, optimizer, step, config_to_dict(cfg))
            except DiskFullError as err:
                raise out_of_space(err, step) from None
        last_ckpt = step

    def interrupted(step: int) -> TrainingInterrupted:
        if last_ckpt != step:
            checkpoint(step)
        where = f"checkpoint saved to {ckpt_path}" if write or world > 1 else "nothing written (write=False)"
        line = (
            f"attnlab: {stop.name} received{stop.sender}: stopped after step {step} of {cfg.steps}, {where}; "
            f"resume with `{train_command_line(cfg, out_dir, resume=True, keep=False)}`"
        )
        return TrainingInterrupted(line, signum=stop.signum, step=step, announce=rank == 0)

    def diverged(step: int, what: str, value: float, lr: float) -> TrainingDiverged:
        if last_ckpt is None:
            kept = f"no checkpoint had been written yet (--ckpt-every {cfg.ckpt_every})"
        else:
            kept = f"the last good checkpoint, {ckpt_path} (step {last_ckpt}), was kept as it was"
        retry = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=retry_lr(cfg.optim.lr)))
        reason = f"the {what} is {value} (learning rate {lr:.3g})"
        return TrainingDiverged(
            f"training diverged at step {step} of {cfg.steps}: {reason}, so the weights were not updated with it "
            f"and no model was written; {kept}; lower the rate and start a new run with "
            f"`{train_command_line(retry, free_sibling(out_dir))}`",
            step=step,
            reason=reason,
            announce=rank == 0,
        )

    reporter = Reporter(cfg.steps, start, enabled=not quiet, log_every=cfg.log_every, use_bar=cfg.progress)
    if start:
        show(lambda: reporter.print(f"resumed {ckpt_path} at step {start}"), start)
    scorer = HeadScorer(task, device) if cfg.log_head_scores else None

    def evaluation() -> dict[str, Any]:
        """Held-out loss and accuracy, and with ``log_head_scores`` every head's scores (one record's fields)."""
        out: dict[str, Any] = dict(evaluate(raw, task, cfg.eval_batches, device))
        if scorer is not None:
            out["head_scores"] = scorer(raw)
        return out

    t0 = time.perf_counter()
    seconds_to_target: float | None = None
    target = cfg.stop_at_acc if cfg.stop_at_acc is not None else 0.95
    if start == 0:
        log({"step": 0, **evaluation(), "wall_s": 0.0})
    else:  # reached before the interruption: its time is the first process's (time since a resume restarts at 0)
        seconds_to_target = next((r["wall_s"] for r in history if r.get("eval_acc", -1.0) >= target), None)
    model.train()
    step = start
    try:
        # a signal during set-up stops the run before step 1; under torchrun each rank's signal has its own slot
        asked = torch.tensor(signal_slots(world, rank, stop.signum), device=device)  # (world,)
        agreed, by = stop.signum, -1
        if world > 1:
            dist.all_reduce(asked)
            agreed, by = first_signal(asked.tolist())
        if agreed and step < cfg.steps:
            stop.agree(agreed, by)
            raise interrupted(step)
        while step < cfg.steps:
            t_step = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # a replica's C ranks draw the same rows (DDP's share for D processes), then keep their shard of them
            x, y = (t.to(device) for t in task.batch(step, layout.replica, layout.data))  # (B/D, T) each
            if cp is None:
                loss_sum, correct, count = _masked_stats(model(x), y)
                loss = loss_sum / count.clamp(min=1)
            else:
                x, y, replica_count = shard_batch(cp, x, y)  # (B/D, L) each; count over the (B/D, T) batch
                loss_sum, correct, count = _masked_stats(model(x, context_parallel=cp), y)  # this shard's sums
                loss = cp_loss(loss_sum, replica_count, layout.context)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over ranks here
            grad_norm = _grad_norm(raw, cfg.optim.grad_clip)
            # One all-reduce carries the global loss/accuracy, the gradient norm (equal on every rank after DDP's
            # averaging) and each rank's signal, if one arrived: every rank then takes the same decisions at the
            # same step, and knows which signal, sent to which rank, stopped the run.
            stats = torch.cat(
                [
                    torch.stack([loss_sum.detach(), correct.float(), count.float(), grad_norm.float()]),
                    asked.new_tensor(signal_slots(world, rank, stop.signum)),
                ]
            )  # (4 + world,)
            if world > 1:
                dist.all_reduce(stats)
            loss_value = float(stats[0] / stats[2].clamp(min=1))
            if not math.isfinite(loss_value):
                raise diverged(step + 1, "loss", loss_value, lr)
            if not math.isfinite(float(stats[3])):
                raise diverged(step + 1, "gradient norm", float(stats[3]) / world, lr)
            optimizer.step()
            step += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t_step
            rec: dict[str, Any] = {
                "step": step,
                "loss": loss_value,
                "acc": float(stats[1] / stats[2].clamp(min=1)),
                "lr": lr,
                "grad_norm": float(stats[3]) / world,  # before clipping; every rank's is the same (summed above)
                "tokens_per_s": cfg.data.batch_size * task.block_size / dt,
            }
            if step % cfg.eval_every == 0 or step == cfg.steps:
                rec.update(evaluation())  # every rank: same weights, same answer
                rec["wall_s"] = time.perf_counter() - t0
                if seconds_to_target is None and rec["eval_acc"] >= target:
                    seconds_to_target = rec["wall_s"]
            log(rec)
            show(lambda: reporter.update(rec), step)  # noqa: B023  # called at once
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < cfg.steps:
                checkpoint(step)
            if cfg.stop_at_acc is not None and rec.get("eval_acc", -1.0) >= cfg.stop_at_acc:
                break  # the run is complete: a signal in this step changes nothing
            # one process reads its own flag (a signal during this step's evaluation counts); ranks read the agreed one
            # only, so that a signal arriving after the all-reduce on one rank cannot make it stop alone
            agreed, by = first_signal(stats[4:].tolist()) if world > 1 else (stop.signum, -1)
            if agreed and step < cfg.steps:  # a last step just finishes
                stop.agree(agreed, by)
                raise interrupted(step)
    finally:
        reporter.close()
    wall = time.perf_counter() - t0
    if not history or "eval_acc" not in history[-1]:  # stopped between evaluations: final figures are held-out ones
        if not history:
            history.append({"step": step})
        history[-1].update(evaluation())
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
        "context_parallel": layout.context,
        "process_layout": layout.describe(),  # which ranks split a sequence, which hold the same shard
        "rank_param_sha256": [d.hex() for d in digests],
        "ranks_identical": identical,
        "params": sum(p.numel() for p in raw.parameters()),
    }
    raw = raw.cpu().eval()
    if write:
        try:  # the checkpoint of the last step is on disk: a full disk now loses no training
            from .plots import plot_run

            final["curve"] = str(
                plot_run(
                    history,
                    out_dir / "curve.png",
                    chance_acc=task.chance_acc,
                    loss_floor=final["loss_floor"],
                    title=f"{cfg.model.kind} on {cfg.data.task}",
                )
            )
            if cfg.model.kind == "gpt":
                from ..models.gpt import TinyGPT
                from ..weight_files.saved_model import save_checkpoint

                gpt = cast(TinyGPT, raw)  # kind "gpt" builds a TinyGPT
                final["model_dir"] = str(save_checkpoint(gpt, out_dir / "model", tokenizer=task.tokenizer))
            final["checkpoint"] = str(ckpt_path)
            atomic_write_text(out_dir / "summary.json", json.dumps(final, indent=2) + "\n")
        except DiskFullError as err:
            raise out_of_space(err, step) from None
    done = (
        f"done: {step} steps in {wall:.1f}s, held-out loss {final['eval_loss']:.4f}, "
        f"acc {final['eval_acc']:.3f} (chance {task.chance_acc:.3f})"
        + (f", {target:.0%} reached after {seconds_to_target:.1f}s" if seconds_to_target is not None else "")
    )
    show(lambda: reporter.print(done), step)
    if not identical:
        raise RuntimeError(
            f"ranks ended with different weights (sha256 {[d.hex()[:12] for d in digests]}); "
            f"DDP lost sync, a bug: rerun with ATTNLAB_DEBUG=1 and report it."
        )
    return RunResult(out_dir if write else None, raw, task, final, history)


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """``dataclasses.replace`` that reaches into ``data``/``model``/``optim`` with ``"model.num_heads"`` keys."""
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
