"""Reports for people (a rich table per target) and for CI (JSON)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .result import CheckResult, Report

__all__ = ["print_tables", "to_json"]

_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow"}


def _figure(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return "0" if value == 0 else f"{value:.2e}"


def _row(r: CheckResult) -> tuple[str, ...]:
    from rich.markup import escape  # names like "low_precision[bf16]" would otherwise read as markup tags

    status = f"[{_STYLE[r.status]}]{r.status.upper()}[/]"
    return (escape(r.name), status, escape(_figure(r.measured)), escape(_figure(r.tolerance)), escape(r.detail))


def print_tables(reports: Sequence[Report], *, width: int | None = None) -> None:
    """One table per target on stdout, then a one-line verdict each."""
    from rich.console import Console  # imported here: the library API must not need a terminal
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=width)
    for report in reports:
        cfg = report.config
        table = Table(
            title=f"attnlab check: {escape(report.target)}",
            title_justify="left",
            caption=f"E={cfg['embed_dim']} H={cfg['num_heads']} G={cfg['num_kv_heads']} "
            f"B={cfg['batch']} T={cfg['seq_len']} seed={cfg['seed']} torch {cfg['torch']}",
            caption_justify="left",
        )
        for col, kw in (
            ("check", {"no_wrap": True}),
            ("status", {}),
            ("measured", {"justify": "right"}),
            ("tolerance", {"justify": "right"}),
            ("detail", {"ratio": 1}),
        ):
            table.add_column(col, **kw)
        for r in report.results:
            table.add_row(*_row(r))
        console.print(table)
        counts = {s: sum(r.status == s for r in report.results) for s in ("pass", "fail", "skip")}
        verdict = "[green]OK[/]" if report.ok else "[bold red]FAILED[/]"
        console.print(f"{verdict}: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped\n")


def to_json(reports: Sequence[Report]) -> str:
    """``{"ok": ..., "reports": [...]}``: every row with its figure, tolerance and detail."""
    return json.dumps({"ok": all(r.ok for r in reports), "reports": [r.to_dict() for r in reports]}, indent=2)
