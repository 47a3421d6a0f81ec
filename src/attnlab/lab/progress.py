"""What a run shows while it trains: a rich progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["Reporter"]


def _fmt(rec: dict[str, Any]) -> str:
    parts = [f"loss {rec['loss']:.4f}", f"acc {rec['acc']:.3f}"]
    if "eval_acc" in rec:
        parts.append(f"eval loss {rec['eval_loss']:.4f} acc {rec['eval_acc']:.3f}")
    parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    return "  ".join(parts)


class Reporter:
    """``update(rec)`` after every step. ``enabled=False`` (other ranks, ablations) prints nothing."""

    def __init__(self, total: int, start: int, *, enabled: bool, log_every: int, use_bar: bool = True) -> None:
        self.enabled, self.log_every, self.total = enabled, max(1, log_every), total
        self.console = Console(file=sys.stdout)
        # A bar redrawn in place is noise in a log file or CI: there, plain lines every log_every steps.
        self.bar = enabled and use_bar and self.console.is_terminal
        self.last_eval = ""
        if self.bar:
            self.progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=total, completed=start, stats="")

    def update(self, rec: dict[str, Any]) -> None:
        if not self.enabled or "loss" not in rec:
            return
        if "eval_acc" in rec:
            self.last_eval = f"  eval acc {rec['eval_acc']:.3f}"
        if self.bar:
            stats = f"loss {rec['loss']:.3f} acc {rec['acc']:.3f}{self.last_eval} {rec['tokens_per_s']:,.0f} tok/s"
            self.progress.update(self.task, completed=rec["step"], stats=stats)
        elif rec["step"] % self.log_every == 0 or "eval_acc" in rec or rec["step"] == self.total:
            print(f"step {rec['step']:>6}/{self.total}  {_fmt(rec)}", flush=True)

    def print(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False, markup=False) if self.bar else print(text, flush=True)

    def close(self) -> None:
        if self.bar:
            self.progress.stop()
