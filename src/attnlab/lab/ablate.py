"""Seed 002 section 4.4's experiment: fix d_model, vary the number of heads, compare.

Every (heads, seed) run uses the same data stream, step budget and d_model, and ``seed`` seeds
both the model init and the data, so head counts are compared on identical batches. Runs are
in-process calls of :func:`attnlab.lab.train.train`, each in its own run directory
``out_dir/runs/heads-H-seed-S``; this module writes the table (``ablation.json``,
``ablation.md``) and one PNG of loss curves with a band per head count.

A study is never lost: ``out_dir/config.json`` is written first, each run keeps its checkpoint
and summary, a stop signal (SIGINT, SIGTERM, SIGHUP, ...) stops the run under way after its current step with
a checkpoint, and
``attnlab ablate-heads --out-dir D --resume`` keeps the finished runs, resumes the interrupted one
and runs the rest. A study already in ``out_dir`` is never replaced.

As a training run's folder (:mod:`.run_dir`), a study's belongs to one process: the study holds the
lock of ``out_dir`` (each run also locks its own folder), taken before the folder is looked at. A
study that fails before its first run's first step removes what it wrote. On ``--resume`` the
study's ``config.json`` and each kept run's ``summary.json`` and ``metrics.jsonl`` are read as files
attnlab wrote: damage is one error naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import statistics
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..runtime import DiskFullError, RunLock, UsageError, atomic_write_text, check_writable_dir, resolve_device
from .config import (
    DataConfig,
    FieldError,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    command_flags,
    config_to_dict,
    dataclass_from_dict,
    load_config,
    read_config_dict,
    read_json_file,
    save_config,
    shown,
)
from .footprint import check_study_room
from .run_dir import (
    free_sibling,
    launcher,
    listing,
    missing_dirs,
    read_metrics,
    read_resumed_config,
    read_run_config,
    remove_if_empty,
)
from .stopping import StopSignals, TrainingDiverged, TrainingInterrupted
from .train import retry_lr, train
from .train_state import CKPT_NAME
from .validation import (
    check_number,
    checked_range,
    refuse,
    validate_data,
    validate_lengths,
    validate_model,
    validate_optim,
)

__all__ = ["AblateConfig", "AblateTrain", "ablate", "ablate_command_line"]


@dataclass
class AblateTrain:
    """The run repeated for every head count and seed: --heads replaces its --train.model.num-heads, and --seeds
    its seeds (model init and --train.data.seed). The default is seed 002's block on recall: the task where heads
    could matter, solved by every head count within ~500 steps."""

    data: DataConfig = field(default_factory=lambda: DataConfig(task="recall"))
    model: ModelConfig = field(default_factory=lambda: ModelConfig(kind="minimal"))
    optim: OptimConfig = field(default_factory=OptimConfig)
    steps: int = 500  # optimiser steps per run; seed 002's block solves 8-pair recall within ~500 at every head count
    eval_every: int = 25  # steps between held-out evaluations (the resolution of "steps to 90%")
    eval_batches: int = 4  # held-out batches per evaluation, always the same ones
    ckpt_every: int = 100  # steps between each run's checkpoints (a stop signal always writes one); 0: only at the end
    log_head_scores: bool = True  # each evaluation also logs every head's previous-token and induction scores
    device: str = "auto"  # one of: auto (cuda if available, else cpu), cpu, cuda, cuda:N, mps


@dataclass
class AblateConfig:
    """The head-count study: one base run, repeated for each head count and seed."""

    train: AblateTrain = field(default_factory=AblateTrain)
    heads: list[int] = field(
        default_factory=lambda: [1, 2, 4, 8]
    )  # head counts; each must divide --train.model.embed-dim
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # at least 3 distinct, so a spread can be reported
    target_acc: float = 0.9  # "steps to reach" this held-out accuracy goes in the table
    out_dir: Path = Path("runs/ablate-heads")  # the table, loss_curves.png, config.json and runs/ (one per run) go here
    resume: bool = False  # continue the study in out_dir: finished runs are kept, an interrupted one resumes


STUDY_FILES = ("config.json", "runs", "ablation.json", "ablation.md", "loss_curves.png")


def ablate_train_from(cfg: TrainConfig) -> AblateTrain:
    """The part of a training run's config that a study repeats (``--config runs/train/config.json``)."""
    return AblateTrain(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(AblateTrain)})


def load_ablate_config(path: str | Path, flag: str = "--config") -> AblateConfig:
    """A study's own ``config.json``, or a training run's (which becomes the base run).

    ``flag="--resume"``: the study's own file (``--out-dir D --resume``), read as a file attnlab wrote:
    damage is one error naming the file and the field, and a fix that does not change the study.
    """
    if flag == "--resume":
        return _read_study_config(Path(path))
    data = read_config_dict(path, flag)
    if "heads" in data or "seeds" in data:
        cfg: AblateConfig = dataclass_from_dict(AblateConfig, data)
        return cfg
    return AblateConfig(train=ablate_train_from(load_config(path, flag)))


def ablate_command_line(cfg: AblateConfig, out_dir: Path, *, resume: bool = False, keep: bool = True) -> str:
    """``attnlab ablate-heads`` with the flags that rebuild ``cfg`` (``keep=False``: none), in ``out_dir``."""
    flags = command_flags(cfg, AblateConfig(), skip=("out_dir", "resume")) if keep else []
    flags += ["--out-dir", shlex.quote(str(out_dir))] + (["--resume"] if resume else [])
    return " ".join([launcher(), "ablate-heads", *flags])


def _read_study_config(path: Path) -> AblateConfig:
    """The study's own ``config.json`` on ``--resume``: a file attnlab wrote, checked field by field."""

    def has_heads_and_seeds(data: Any) -> None:
        if isinstance(data, dict) and not ("heads" in data and "seeds" in data):
            missing = "heads" if "heads" not in data else "seeds"
            raise FieldError(f"field {missing} is missing (a study's config.json has heads and seeds)")

    fix = "restore it from a copy, or start a new study in another --out-dir"
    cfg, _ = read_resumed_config(
        AblateConfig, path, fix, partial(validate_ablate, resolve=False), check_data=has_heads_and_seeds
    )
    return cfg


def validate_ablate(cfg: AblateConfig, *, resolve: bool = True) -> None:
    """Every field, named as typed (``--heads``, ``--train.optim.lr``); raises :class:`UsageError`.

    ``resolve``: also resolve ``--train.device`` on this machine (not when checking a saved file).
    """
    t = cfg.train
    e = t.model.embed_dim
    check_number(t.model, "--train.model.", "embed_dim", low=1, integer=True)
    if not isinstance(cfg.heads, list) or not cfg.heads:
        raise refuse(
            f"--heads needs at least one head count, got {cfg.heads!r}; pass e.g. --heads 1 2 4 8.",
            "a list of at least one head count",
            ("--heads", cfg.heads),
        )
    for h in cfg.heads:
        checked_range("--heads", h, low=1, integer=True, hint="pass e.g. --heads 1 2 4 8")
    bad = [h for h in cfg.heads if e % h]
    if bad:
        divisors = [h for h in range(1, e + 1) if e % h == 0][:8]
        raise refuse(
            f"--heads {' '.join(map(str, bad))} {'does' if len(bad) == 1 else 'do'} not divide d_model = "
            f"--train.model.embed-dim {e}; "
            f"pass divisors of {e}, e.g. --heads {' '.join(map(str, divisors[:4]))}.",
            "head counts that divide train.model.embed_dim",
            ("--heads", cfg.heads),
            ("--train.model.embed-dim", e),
        )
    kv = t.model.num_kv_heads
    if kv is not None and any(h % kv for h in cfg.heads):
        raise refuse(
            f"--heads {' '.join(map(str, cfg.heads))} must all be multiples of --train.model.num-kv-heads {kv}; "
            f"pass --train.model.num-kv-heads 1 or leave it out.",
            "head counts that are multiples of train.model.num_kv_heads",
            ("--heads", cfg.heads),
            ("--train.model.num-kv-heads", kv),
        )
    validate_data(t.data, "--train.data.")
    validate_model(dataclasses.replace(t.model, num_heads=cfg.heads[0]), "--train.model.")
    validate_optim(t.optim, "--train.optim.")
    check_number(t, "--train.", "steps", low=1, integer=True)
    check_number(t, "--train.", "eval_every", low=1, integer=True)
    check_number(t, "--train.", "eval_batches", low=1, integer=True)
    check_number(t, "--train.", "ckpt_every", low=0, integer=True)
    if not isinstance(t.log_head_scores, bool):
        raise refuse(
            f"--train.log-head-scores must be true or false, got {t.log_head_scores!r}; "
            f"pass --train.log-head-scores or --train.no-log-head-scores.",
            "true or false",
            ("--train.log-head-scores", t.log_head_scores),
        )
    validate_lengths(t.data, log_head_scores=t.log_head_scores, prefix="--train.")
    if not isinstance(t.device, str):
        raise refuse(
            f"--train.device must be a name, got {t.device!r}; pass e.g. --train.device auto.",
            "a device name",
            ("--train.device", t.device),
        )
    if resolve:
        resolve_device(t.device, "--train.device")
    if not isinstance(cfg.seeds, list):
        raise refuse(
            f"--seeds must be a list of integers, got {cfg.seeds!r}; pass e.g. --seeds 0 1 2.",
            "a list of integers",
            ("--seeds", cfg.seeds),
        )
    for s in cfg.seeds:
        checked_range("--seeds", s, low=0, integer=True, hint="pass e.g. --seeds 0 1 2")
    if len(set(cfg.seeds)) < 3:
        raise refuse(
            f"--seeds needs at least 3 distinct seeds for a mean ± std, got {cfg.seeds}; pass e.g. --seeds 0 1 2.",
            "at least 3 distinct seeds",
            ("--seeds", cfg.seeds),
        )
    checked_range("--target-acc", cfg.target_acc, low=0, low_inclusive=False, high=1, hint="pass e.g. --target-acc 0.9")
    if not isinstance(cfg.resume, bool):
        raise refuse(
            f"--resume must be true or false, got {cfg.resume!r}; pass --resume or --no-resume.",
            "true or false",
            ("--resume", cfg.resume),
        )


def _check_study_dir(cfg: AblateConfig) -> None:
    """A study already in ``out_dir`` is never replaced; ``--resume`` needs one there."""
    out = Path(cfg.out_dir)
    if cfg.resume:
        if (out / "config.json").is_file():
            return
        if not out.exists():
            raise UsageError(
                f"--resume: --out-dir {str(out)!r} does not exist, so there is no study to resume; check the name, "
                f"or start a new study there with `{ablate_command_line(cfg, out)}`."
            )
        raise UsageError(
            f"--resume: --out-dir {str(out)!r} holds no ablate-heads study (no config.json; it holds {listing(out)}); "
            f"start one with `{ablate_command_line(cfg, out if not (out / 'runs').exists() else free_sibling(out))}`."
        )
    present = [name for name in STUDY_FILES if (out / name).exists()]
    if present:
        finished = len(list(out.glob("runs/*/summary.json")))
        raise UsageError(
            f"--out-dir {str(out)!r} already holds an ablate-heads study ({', '.join(present)}; {finished} runs "
            f"finished), and attnlab never replaces one; continue it with "
            f"`{ablate_command_line(cfg, out, resume=True, keep=False)}`, or start a new study with "
            f"`{ablate_command_line(cfg, free_sibling(out))}`."
        )


def _run_config(cfg: AblateConfig, heads: int, seed: int) -> TrainConfig:
    t = cfg.train
    return TrainConfig(
        data=dataclasses.replace(t.data, seed=seed),
        model=dataclasses.replace(t.model, num_heads=heads),
        optim=t.optim,
        steps=t.steps,
        seed=seed,
        eval_every=t.eval_every,
        eval_batches=t.eval_batches,
        ckpt_every=t.ckpt_every,
        stop_at_acc=None,
        log_head_scores=t.log_head_scores,
        out_dir=Path(cfg.out_dir) / "runs" / f"heads-{heads}-seed-{seed}",
        device=t.device,
        progress=False,
    )


_SAME = ("data", "model", "optim", "seed", "steps", "eval_every", "eval_batches")  # what makes two runs one


def _check_same_run(cfg: AblateConfig, run: TrainConfig) -> None:
    """``--resume`` continues only runs made with the settings asked for now."""
    saved = read_run_config(Path(run.out_dir) / "config.json")  # a file attnlab wrote, checked as one
    differ = [name for name in _SAME if getattr(saved, name) != getattr(run, name)]
    if differ:
        raise UsageError(
            f"--resume: {run.out_dir} was trained with other settings ({', '.join(differ)} differ); continue the "
            f"study as it was with `{ablate_command_line(cfg, Path(cfg.out_dir), resume=True, keep=False)}`, or start "
            f"a new study with these settings with `{ablate_command_line(cfg, free_sibling(Path(cfg.out_dir)))}`."
        )


def _finished_run(run: TrainConfig) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summary and history of a run that finished before the study was interrupted, each checked."""
    out = Path(run.out_dir)
    path = out / "summary.json"
    fix = f"delete it (`rm {shlex.quote(str(path))}`) and run the command again, which trains that run again"
    try:
        final = read_json_file(path)
    except FieldError as e:
        raise UsageError(f"--resume: {str(path)!r} is damaged: {e}; {fix}.") from None
    if not isinstance(final, dict):
        raise UsageError(f"--resume: {str(path)!r} is damaged: it holds {shown(final)}, expected an object; {fix}.")
    for key in ("eval_loss", "eval_acc", "wall_s"):
        value = final.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            what = f"field {key} is missing" if key not in final else f"field {key} holds {shown(value)}"
            raise UsageError(f"--resume: {str(path)!r} is damaged: {what}, expected a number; {fix}.")
    return final, read_metrics(out / "metrics.jsonl")


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(xs: list[float], digits: int = 3) -> str:
    m, s = _mean_std(xs)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def ablate(cfg: AblateConfig, *, stop: StopSignals | None = None) -> dict[int, dict[str, Any]]:
    """Run the study, print the table, write its files; returns the per-head-count summary.

    Raises:
        UsageError: a bad setting, an ``out_dir`` that holds a study (without ``resume``) or cannot be
            written, or ``resume`` with no study there. Raised before any training.
        TrainingInterrupted: a stop signal; the run under way saved its checkpoint after its current step.
        TrainingDiverged: a run's loss became NaN/inf.
    """
    validate_ablate(cfg)
    out = Path(cfg.out_dir)
    if cfg.resume and not out.exists():
        _check_study_dir(cfg)  # refuses: nothing to resume, and nothing to create
    created = missing_dirs(out)
    out = check_writable_dir(cfg.out_dir, "--out-dir")
    fix = (
        "wait for it to finish: --resume continues a study that has stopped, and this one is still running"
        if cfg.resume
        else f"wait for it to finish, or start this study in another folder with "
        f"`{ablate_command_line(cfg, free_sibling(out))}`"
    )
    lock = RunLock(out, fix=fix)
    try:
        lock.acquire()
        _check_study_dir(cfg)  # after the lock: a study started at the same instant cannot pass it too
        try:
            return _study(cfg, out, stop)
        except BaseException as err:
            if not cfg.resume and not isinstance(err, TrainingInterrupted):
                _abandon_study(out)
            raise
    finally:
        lock.release()
        remove_if_empty(created)  # only what is empty: a refused or abandoned study's folders


def _abandon_study(out: Path) -> None:
    """A new study that failed before any run trained a step: remove what it wrote, so it can run again as it was."""
    runs = out / "runs"
    for run in runs.iterdir() if runs.is_dir() else []:
        if (run / CKPT_NAME).exists():
            return
        try:
            if any(r["step"] >= 1 for r in read_metrics(run / "metrics.jsonl")):
                return
        except UsageError:
            return
    for run in runs.iterdir() if runs.is_dir() else []:
        remove_if_empty([run])
    remove_if_empty([runs])
    (out / "config.json").unlink(missing_ok=True)


def _study(cfg: AblateConfig, out: Path, stop: StopSignals | None) -> dict[int, dict[str, Any]]:
    """The study itself, in ``out`` (locked, checked): every run, the table and the figure."""
    pairs = [(h, s) for h in cfg.heads for s in cfg.seeds]
    runs_of = {(h, s): _run_config(cfg, h, s) for h, s in pairs}
    if cfg.resume:
        for run in runs_of.values():
            if (Path(run.out_dir) / "config.json").is_file():
                _check_same_run(cfg, run)
    check_study_room(runs_of.values(), out)  # every run still to do, before the first writes
    save_config(dataclasses.replace(cfg, resume=False), out / "config.json")
    resume_line = ablate_command_line(cfg, out, resume=True, keep=False)

    console = Console()
    if cfg.resume:
        finished = sum((Path(r.out_dir) / "summary.json").is_file() for r in runs_of.values())
        console.print(
            f"resuming {out}: {finished} of {len(pairs)} runs finished before, kept as they are",
            highlight=False,
            soft_wrap=True,
        )
    rows: dict[int, dict[str, Any]] = {}
    curves: dict[int, list[list[float]]] = {}
    eval_steps: list[int] = []
    with stop or StopSignals() as signals:
        for done, (heads, seed) in enumerate(pairs):
            if signals.requested:
                raise TrainingInterrupted(
                    f"attnlab: {signals.name} received: stopped before run heads={heads} seed={seed} ({done} of "
                    f"{len(pairs)} runs finished and saved); resume with `{resume_line}`",
                    signum=signals.signum,
                    step=0,
                )
            run = runs_of[heads, seed]
            run_dir = Path(run.out_dir)
            kept = cfg.resume and (run_dir / "summary.json").is_file()
            if kept:
                final, history = _finished_run(run)
            else:
                resume_run = cfg.resume and (run_dir / CKPT_NAME).is_file()
                try:
                    result = train(
                        dataclasses.replace(run, resume=resume_run),
                        quiet=True,
                        overwrite=not resume_run,  # a run directory without a checkpoint holds nothing to keep
                        stop=signals,
                    )
                except DiskFullError as e:  # what the run kept, as train says it; the study's own resume command
                    kept_by_run = e.fix.split("; free space there")[0]
                    raise e.refix(
                        f"run heads={heads} seed={seed} ({done} of {len(pairs)} runs finished): {kept_by_run}; free "
                        f"space there, then resume the study with `{resume_line}`"
                    ) from None
                except TrainingInterrupted as e:
                    raise TrainingInterrupted(
                        f"attnlab: {signals.name} received: stopped run heads={heads} seed={seed} after step {e.step} "
                        f"of {run.steps} ({done} of {len(pairs)} runs finished), checkpoint saved to "
                        f"{run_dir / CKPT_NAME}; resume with `{resume_line}`",
                        signum=e.signum,
                        step=e.step,
                    ) from None
                except TrainingDiverged as e:
                    retry = dataclasses.replace(
                        cfg,
                        train=dataclasses.replace(
                            cfg.train, optim=dataclasses.replace(cfg.train.optim, lr=retry_lr(cfg.train.optim.lr))
                        ),
                    )
                    raise TrainingDiverged(
                        f"run heads={heads} seed={seed} diverged at step {e.step} of {run.steps}: {e.reason}, so it "
                        f"has no result and the study stops; lower the rate and start a new study with "
                        f"`{ablate_command_line(retry, free_sibling(out))}`",
                        step=e.step,
                        reason=e.reason,
                    ) from None
                final, history = result.final, result.history
            evals = [r for r in history if "eval_acc" in r]
            reached = next((r["step"] for r in evals if r["eval_acc"] >= cfg.target_acc), None)
            rows.setdefault(heads, {"runs": []})["runs"].append(
                {
                    "seed": seed,
                    "eval_loss": final["eval_loss"],
                    "eval_acc": final["eval_acc"],
                    "steps_to_target": reached,
                    "wall_s": final["wall_s"],
                }
            )
            curves.setdefault(heads, []).append([r["eval_loss"] for r in evals])
            eval_steps = eval_steps if len(eval_steps) >= len(evals) else [r["step"] for r in evals]
            last = rows[heads]["runs"][-1]
            console.print(
                f"heads={heads} seed={seed}: loss {last['eval_loss']:.4f} acc {last['eval_acc']:.3f} "
                f"steps to {cfg.target_acc:.0%} {reached if reached is not None else 'never'} "
                f"({last['wall_s']:.1f}s{', kept' if kept else ''})",
                highlight=False,
                soft_wrap=True,  # one line per run, whatever the width: logs are grepped
            )

    d_model = cfg.train.model.embed_dim
    table = Table(
        title=f"heads at d_model={d_model}, task {cfg.train.data.task}, {cfg.train.steps} steps, seeds {cfg.seeds} (mean ± std)"
    )
    for col in ("heads", "head_dim", "final loss", "accuracy", f"steps to {cfg.target_acc:.0%}", "wall s"):
        table.add_column(col, justify="right")
    md = [
        f"| heads | head_dim | final loss | accuracy | steps to {cfg.target_acc:.0%} | wall s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for heads, row in rows.items():
        runs = row["runs"]
        reached = [r["steps_to_target"] for r in runs if r["steps_to_target"] is not None]
        # A seed that never reached the target has no step count: show how many did, and their mean.
        steps_txt = (
            "never"
            if not reached
            else (
                _fmt([float(s) for s in reached], 0)
                if len(reached) == len(runs)
                else f"{_fmt([float(s) for s in reached], 0)} ({len(reached)}/{len(runs)} seeds)"
            )
        )
        cells = [
            str(heads),
            str(d_model // heads),
            _fmt([r["eval_loss"] for r in runs], 4),
            _fmt([r["eval_acc"] for r in runs]),
            steps_txt,
            _fmt([r["wall_s"] for r in runs], 1),
        ]
        table.add_row(*(c.replace(" ± ", "±").replace(" seeds)", ")") for c in cells))  # 80 columns wide
        md.append("| " + " | ".join(cells) + " |")
        row.update(
            zip(
                ("final_loss", "accuracy", "wall_s"),
                (_mean_std([r[k] for r in runs]) for k in ("eval_loss", "eval_acc", "wall_s")),
                strict=True,
            )
        )
        row["steps_to_target"] = steps_txt
    console.print(table)

    from .plots import plot_ablation  # matplotlib only when a figure is drawn

    png = plot_ablation(
        curves,
        eval_steps,
        out / "loss_curves.png",
        title=f"held-out loss, d_model={d_model}, {cfg.train.data.task} (band: min-max over seeds)",
    )
    atomic_write_text(out / "ablation.md", "\n".join(md) + "\n")
    atomic_write_text(
        out / "ablation.json",
        json.dumps(
            {
                "config": config_to_dict(cfg.train),
                "heads": cfg.heads,
                "seeds": cfg.seeds,
                "rows": {str(h): r for h, r in rows.items()},
            },
            indent=2,
        )
        + "\n",
    )
    console.print(f"wrote {out / 'ablation.md'}, {out / 'ablation.json'} and {png}", highlight=False, soft_wrap=True)
    return rows
