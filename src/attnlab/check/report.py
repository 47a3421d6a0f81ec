"""Reports for people (a rich table per target) and for CI (JSON)."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence

from .result import Cause, CheckResult, Report

__all__ = ["print_tables", "skip_line", "summary_line", "to_json"]

_STYLE = {"pass": "green", "fail": "bold red", "skip": "yellow", "note": "yellow"}


def _status(r: CheckResult, strict: bool) -> str:
    """The row's status as the verdict counts it: a note (a row only hardening causes explain) is ``fail`` when strict."""
    return "fail" if r.status == "note" and strict else r.status


def _figure(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return "0" if value == 0 else f"{value:.2e}"


def _row(r: CheckResult, *, detail: bool = True, strict: bool = False) -> tuple[str, ...]:
    from rich.markup import escape  # names like "low_precision[bf16]" would otherwise read as markup tags

    shown = _status(r, strict)
    status = f"[{_STYLE[shown]}]{shown.upper()}[/]"
    cells = (escape(r.name), status, escape(_figure(r.measured)), escape(_figure(r.tolerance)))
    return (*cells, escape(r.detail)) if detail else cells


_MIN_DETAIL = 40  # narrower than this, a detail column becomes a tall ribbon: details go below the table


def print_tables(reports: Sequence[Report], *, width: int | None = None) -> None:
    """One table per target on stdout, then a one-line verdict each.

    ``width``: the terminal's columns (``None``: as rich finds them, ``COLUMNS`` included). When the
    detail column would get fewer than 40 of them (and fewer than the longest detail needs), the table
    keeps check, status and figures, and each row's detail is listed under it, wrapped.
    """
    from rich.console import Console  # imported here: the library API must not need a terminal
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=width)
    for report in reports:
        cfg = report.config
        if cfg.get("call_form"):  # what the probe found: the call form and the mask convention, in one line
            for line in textwrap.wrap(cfg["call_form"], max(40, console.width), subsequent_indent="  "):
                console.print(line, markup=False, highlight=False, soft_wrap=True)
        shown = [r for r in report.results if r.status != "skip"] or report.results[:1]
        figures = [(r.name, r.status, _figure(r.measured), _figure(r.tolerance)) for r in shown]
        # each column's widest cell plus rich's borders and padding: 3 per column and 1 for the last border
        fixed = sum(max(len(head), *(len(f[c]) for f in figures)) + 3 for c, head in enumerate(_HEADS[:4])) + 4
        longest = max((len(r.detail) for r in shown), default=0)
        wide = console.width - fixed >= min(_MIN_DETAIL, longest)
        title = f"attnlab check: {report.target}"
        table = Table(
            title=escape(title),
            title_justify="left",
            min_width=min(len(title), console.width),  # the title on one line, however narrow the columns
            caption=(
                f"E={cfg['embed_dim']} H={cfg['num_heads']} C={cfg['mla']['C']} R={cfg['mla']['R']} "
                f"N={cfg['mla']['N']} Dv={cfg['mla']['Dv']} "
                if cfg.get("mla")
                else f"E={cfg['embed_dim']} H={cfg['num_heads']} G={cfg['num_kv_heads']} "
            )
            + f"B={cfg['batch']} T={cfg['seq_len']} seed={cfg['seed']}{_where(cfg)} torch {cfg['torch']}"
            + (f"\n{cfg['called_as']}" if cfg.get("called_as") and not cfg.get("call_form") else ""),
            caption_justify="left",
        )
        for col, kw in zip(_HEADS if wide else _HEADS[:4], _COLUMN_STYLE, strict=False):
            table.add_column(col, **kw)
        for r in shown:
            table.add_row(*_row(r, detail=wide, strict=report.strict))
        console.print(table)
        if not wide:
            _print_details(console, shown)
        console.print(summary_line(report))
        skipped = skip_line(report, console.width)
        if skipped:
            console.print(skipped, markup=False, highlight=False, soft_wrap=True)
        if report.diagnosis:
            _print_diagnosis(console, report)
        console.print()


def summary_line(report: Report) -> str:
    """The verdict in one line (rich markup): ``OK: 24 passed, 0 failed, 8 skipped``, with the hardening notes
    counted and said to pass: ``OK: 19 passed, 0 failed, 8 skipped; computes attention correctly, with 5
    hardening notes (--strict fails on them)``."""
    from rich.markup import escape

    notes = len(report.notes)
    counts = (
        f"{sum(r.status == 'pass' for r in report.results)} passed, {len(report.failures)} failed, "
        f"{sum(r.status == 'skip' for r in report.results)} skipped"
    )
    plural, them = ("s", "them") if notes != 1 else ("", "it")
    if report.partial:  # the rows that ran are real results; the ones that did not are no verdict
        verdict = f"[bold yellow]PARTIAL[/] ({escape(report.partial)}), so far"
    else:
        verdict = "[green]OK[/]" if report.ok else "[bold red]FAILED[/]"
    if not notes or report.partial:
        return f"{verdict}: {counts}" + (f"; {notes} hardening note{plural}" if notes else "")
    if report.ok:
        return f"{verdict}: {counts}; computes attention correctly, with {notes} hardening note{plural} (--strict fails on {them})"
    return f"{verdict}: {counts}; and {notes} hardening note{plural} (--strict fails on {them})"


def _where(cfg: dict) -> str:
    """`` on cuda:0 in bfloat16`` when the run was not on the CPU in float32 (the default says nothing)."""
    device, dtype = cfg.get("device", "cpu"), cfg.get("dtype", "float32")
    return "" if (device, dtype) == ("cpu", "float32") else f" on {device} in {dtype}"


def skip_line(report: Report, width: int = 80) -> str:
    """The skipped rows in one line of at most ``width`` characters; every reason is in ``--json``."""
    skipped = [r.name for r in report.results if r.status == "skip"]
    if not skipped:
        return ""
    variants = sum(n.startswith("variant[") for n in skipped)
    entries = [(n, 1) for n in skipped if not n.startswith("variant[")]  # (label, rows it stands for)
    if variants:
        entries.append((f"{variants} variant rows", variants))
    head = f"skipped {len(skipped)} (--json has each reason): "
    shown = entries
    line = head + ", ".join(label for label, _ in shown)
    while len(line) > width and len(shown) > 1:  # fold the tail into a count
        shown = shown[:-1]
        rest = len(skipped) - sum(n for _, n in shown)
        line = head + ", ".join(label for label, _ in shown) + f", {rest} more"
    return line


def _print_diagnosis(console: object, report: Report) -> None:
    """The ``Likely cause`` section: each cause with what was found, the evidence, the fix and the seed section,
    wrapped to the terminal with a hanging indent."""
    import textwrap

    from rich.console import Console

    assert isinstance(console, Console)
    width = max(40, console.width)

    def out(text: str, first: str, rest: str) -> None:
        for line in textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False):
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    sections = (
        ("Likely cause", [c for c in report.diagnosis if not report.is_note(c)]),
        ("Hardening notes", [c for c in report.diagnosis if report.is_note(c)]),
    )
    for title, causes in sections:
        if not causes:
            continue
        console.print()
        if title == "Hardening notes":
            # "the attention is right" only when it is: with a failure above, the notes say what they are and no more
            right = "the attention it computes is right, and " if report.ok else ""
            console.print(
                f"[bold]Hardening notes[/] (robustness a textbook module is not written for; {right}--strict fails on them)"
            )
        else:
            console.print(f"[bold]{title}[/]" + (" (most likely first)" if len(causes) > 1 else ""))
        for i, c in enumerate(causes, 1):
            out(f"{c.found} [{c.id}]", f"{i}. ", "   ")
            for label, text in (("evidence", c.evidence), ("fix", c.fix), ("see", c.seed)):
                out(text, f"   {label}: ", " " * (5 + len(label)))
            if c.explains:
                out(_rows(c), "   explains: ", " " * 13)
    explained = {n for c in report.diagnosis for n in c.explains}
    rest = [r.name for r in report.failures if r.name not in explained]
    if rest:
        out(", ".join(rest), "not explained by the above: ", "   ")


def _rows(c: Cause) -> str:
    names = list(c.explains)
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:5])} and {len(names) - 5} more rows"


_HEADS = ("check", "status", "measured", "tolerance", "detail")
_COLUMN_STYLE: tuple[dict, ...] = ({"no_wrap": True}, {}, {"justify": "right"}, {"justify": "right"}, {"ratio": 1})


def _print_details(console: object, rows: Sequence[CheckResult]) -> None:
    """Each row's detail under the table: the check's name, then its detail wrapped in a hanging indent."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    assert isinstance(console, Console)
    console.print()
    details = Table.grid(padding=(0, 2))
    details.add_column(no_wrap=True)
    details.add_column(ratio=1)
    for r in rows:
        if r.detail:
            details.add_row(escape(r.name), escape(r.detail))
    console.print(details)


def to_json(reports: Sequence[Report]) -> str:
    """``{"ok": ..., "partial": ..., "reports": [...]}``: every row with its figure, tolerance and detail.

    ``ok`` is false for a run stopped early (``partial`` says why): unchecked rows are no pass."""
    partial = next((r.partial for r in reports if r.partial), None)
    ok = all(r.ok for r in reports) and partial is None
    return json.dumps({"ok": ok, "partial": partial, "reports": [r.to_dict() for r in reports]}, indent=2)
