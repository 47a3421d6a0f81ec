"""Seed 002 section 4.4's experiment: fix d_model, vary the number of heads, compare.

Every (heads, seed) run uses the same data stream, step budget and d_model, and ``seed`` seeds
both the model init and the data, so head counts are compared on identical batches. Runs are
in-process calls of :func:`attnlab.lab.train.train` that write nothing; this module writes the
table (``ablation.json``, ``ablation.md``) and one PNG of loss curves with a band per head count.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .config import DataConfig, ModelConfig, TrainConfig, config_to_dict
from .train import replace, train

__all__ = ["AblateConfig", "ablate"]


def _default_train() -> TrainConfig:
    # Seed 002's block on recall: the task where heads could matter, solved by all counts within ~500 steps
    return TrainConfig(
        data=DataConfig(task="recall"),
        model=ModelConfig(kind="minimal"),
        steps=500,
        eval_every=25,
        ckpt_every=0,
        progress=False,
    )


@dataclass
class AblateConfig:
    """The head-count study: one base run, repeated for each head count and seed."""

    train: TrainConfig = field(default_factory=_default_train)  # the base run; its model.n_head and seed are replaced
    heads: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # head counts; each must divide train.model.n_embd
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # at least 3, so a spread can be reported
    target_acc: float = 0.9  # "steps to reach" this held-out accuracy goes in the table
    out_dir: Path = Path("runs/ablate-heads")  # ablation.json, ablation.md and loss_curves.png go here


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _fmt(xs: list[float], digits: int = 3) -> str:
    m, s = _mean_std(xs)
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def ablate(cfg: AblateConfig) -> dict[int, dict[str, Any]]:
    """Run the study, print the table, write its files; returns the per-head-count summary."""
    if len(cfg.seeds) < 3:
        raise ValueError(f"--seeds needs at least 3 seeds for a mean ± std, got {cfg.seeds}; pass e.g. --seeds 0 1 2.")
    bad = [h for h in cfg.heads if h < 1 or cfg.train.model.n_embd % h]
    if bad:
        raise ValueError(
            f"--heads {bad} do not divide d_model = --train.model.n-embd {cfg.train.model.n_embd}; "
            f"pick divisors of {cfg.train.model.n_embd}."
        )
    console = Console()
    rows: dict[int, dict[str, Any]] = {}
    curves: dict[int, list[list[float]]] = {}
    eval_steps: list[int] = []
    for heads in cfg.heads:
        runs = []
        for seed in cfg.seeds:
            run_cfg = replace(
                cfg.train,
                **{
                    "model.n_head": heads,
                    "seed": seed,
                    "data.seed": seed,
                    "progress": False,
                    "resume": False,
                    "stop_at_acc": None,
                },
            )
            result = train(run_cfg, write=False, quiet=True)
            evals = [r for r in result.history if "eval_acc" in r]
            reached = next((r["step"] for r in evals if r["eval_acc"] >= cfg.target_acc), None)
            runs.append(
                {
                    "seed": seed,
                    "eval_loss": result.final["eval_loss"],
                    "eval_acc": result.final["eval_acc"],
                    "steps_to_target": reached,
                    "wall_s": result.final["wall_s"],
                }
            )
            curves.setdefault(heads, []).append([r["eval_loss"] for r in evals])
            eval_steps = eval_steps if len(eval_steps) >= len(evals) else [r["step"] for r in evals]
            console.print(
                f"heads={heads} seed={seed}: loss {runs[-1]['eval_loss']:.4f} acc {runs[-1]['eval_acc']:.3f} "
                f"steps to {cfg.target_acc:.0%} {reached if reached is not None else 'never'} "
                f"({runs[-1]['wall_s']:.1f}s)",
                highlight=False,
            )
        rows[heads] = {"runs": runs}

    table = Table(
        title=f"heads at d_model={cfg.train.model.n_embd}, task {cfg.train.data.task}, "
        f"{cfg.train.steps} steps, seeds {cfg.seeds} (mean ± std)"
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
            str(cfg.train.model.n_embd // heads),
            _fmt([r["eval_loss"] for r in runs], 4),
            _fmt([r["eval_acc"] for r in runs]),
            steps_txt,
            _fmt([r["wall_s"] for r in runs], 1),
        ]
        table.add_row(*cells)
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

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_ablation(
        curves,
        eval_steps,
        out / "loss_curves.png",
        title=f"held-out loss, d_model={cfg.train.model.n_embd}, {cfg.train.data.task} (band: min-max over seeds)",
    )
    (out / "ablation.md").write_text("\n".join(md) + "\n")
    (out / "ablation.json").write_text(
        json.dumps(
            {
                "config": config_to_dict(cfg.train),
                "heads": cfg.heads,
                "seeds": cfg.seeds,
                "rows": {str(h): r for h, r in rows.items()},
            },
            indent=2,
        )
        + "\n"
    )
    console.print(f"wrote {out / 'ablation.md'}, {out / 'ablation.json'} and {png}", highlight=False)
    return rows
