"""PNG figures of the lab: one run's loss/accuracy (and head-score) curves, and the head-count overlay."""

from __future__ import annotations

import atexit
import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def _quiet_config_dir() -> None:
    """Give matplotlib a private config folder when HOME's cannot be written (a read-only HOME): it would make
    one itself, but with a warning on the user's screen at every run."""
    if os.environ.get("MPLCONFIGDIR"):
        return
    home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "matplotlib"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "matplotlib"
    try:
        for folder in (home, cache):
            folder.mkdir(parents=True, exist_ok=True)
            if not os.access(folder, os.W_OK):
                raise PermissionError(folder)
        return
    except OSError:
        pass
    private = tempfile.mkdtemp(prefix="attnlab-matplotlib-")
    atexit.register(shutil.rmtree, private, True)
    os.environ["MPLCONFIGDIR"] = private


_quiet_config_dir()

import matplotlib  # noqa: E402

matplotlib.use("Agg")  # files only: no display on a server or in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..runtime import atomic_write_bytes  # noqa: E402

__all__ = ["plot_run", "plot_ablation", "plot_head_scores"]

# score name in metrics.jsonl -> (legend label, colour); the largest over every layer and head is drawn
HEAD_CURVES = {
    "prev_token": ("max previous-token (probe)", "C2"),
    "induction": ("max induction (probe)", "C3"),
    "recall_prev": ("max value -> its key (recall)", "C5"),
    "recall_value": ("max query -> its value (recall)", "C4"),
}


def _save(fig: plt.Figure, path: Path) -> Path:
    """Write the PNG whole or not at all: an interrupt mid-save leaves the previous file."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def plot_run(
    history: list[dict[str, Any]], path: Path, *, chance_acc: float, loss_floor: float | None = None, title: str = ""
) -> Path:
    """Training loss per step and held-out loss/accuracy per evaluation, side by side; a third panel of
    head scores when the evaluations carry them (``--log-head-scores``)."""
    train = [r for r in history if "loss" in r]
    evals = [r for r in history if "eval_acc" in r]
    with_heads = any("head_scores" in r for r in evals)
    fig, axes = plt.subplots(1, 3 if with_heads else 2, figsize=(15 if with_heads else 10, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.6, label="train")
    ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=3, label="held-out")
    if loss_floor is not None:
        ax_loss.axhline(loss_floor, color="gray", ls="--", lw=1, label=f"ln(vocab) = {loss_floor:.3f}")
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="loss")
    ax_loss.legend()
    ax_acc.plot([r["step"] for r in evals], [r["eval_acc"] for r in evals], "o-", ms=3, color="C1", label="held-out")
    ax_acc.axhline(chance_acc, color="gray", ls="--", lw=1, label=f"chance = {chance_acc:.3f}")
    ax_acc.set(xlabel="step", ylabel="accuracy (scored positions)", title="accuracy", ylim=(0, 1.02))
    ax_acc.legend()
    if with_heads:
        plot_head_scores(axes[2], evals)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)


def plot_head_scores(ax: Any, evals: list[dict[str, Any]]) -> None:
    """On ``ax``: the largest score of each kind over all heads per evaluation, with held-out accuracy dashed."""
    from .head_scores import max_score

    scored = [r for r in evals if "head_scores" in r]
    steps = [r["step"] for r in scored]
    for name, (label, color) in HEAD_CURVES.items():
        values = [max_score(r, name) for r in scored]
        if any(v is not None for v in values):
            ax.plot(steps, [np.nan if v is None else v for v in values], "o-", ms=3, color=color, label=label)
    ax.plot(steps, [r["eval_acc"] for r in scored], "--", color="C1", lw=1, label="held-out accuracy")
    ax.set(xlabel="step", ylabel="attention weight / accuracy", title="heads", ylim=(0, 1.02))
    ax.legend(fontsize=8)


def plot_ablation(curves: dict[int, list[list[float]]], steps: list[int], path: Path, *, title: str) -> Path:
    """Mean held-out loss per head count, with a min-max band over the seeds."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (heads, runs) in enumerate(sorted(curves.items())):
        n = min(len(r) for r in runs)  # runs stopped at different steps are compared on their common prefix
        arr = np.array([r[:n] for r in runs])  # (seeds, evals)
        x = steps[:n]
        ax.plot(x, arr.mean(0), color=f"C{i}", label=f"{heads} head{'s' if heads > 1 else ''}")
        ax.fill_between(x, arr.min(0), arr.max(0), color=f"C{i}", alpha=0.2)
    ax.set(xlabel="step", ylabel="held-out cross-entropy", title=title)
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)
