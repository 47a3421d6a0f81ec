"""What a check run returns: one :class:`CheckResult` per check, gathered in a :class:`Report`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

Status = Literal["pass", "fail", "skip"]

__all__ = ["Cause", "CheckError", "CheckResult", "Report", "Status"]


class CheckError(RuntimeError):
    """attnlab check's own failure, not the module's: an exception in check's code, not in the target's
    constructor or forward. ``phase`` says what check was doing ("running check dropout_rate", "diagnosing")."""

    def __init__(self, phase: str, error: BaseException) -> None:
        super().__init__(f"{phase}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        self.phase, self.error = phase, error


@dataclass(frozen=True)
class CheckResult:
    """One row of the report."""

    name: str
    status: Status
    measured: float | str | None = None  # the figure compared with the tolerance (None when skipped)
    tolerance: float | str | None = None  # the bound the figure had to meet
    detail: str = ""  # how it was measured, or why it was skipped
    data: dict = field(default_factory=dict, compare=False)  # figures the diagnosis reads (JSON too)
    # A failing row that only hardening causes explain (NaN in padded values, fully masked rows, a fill
    # float16 cannot hold, float32 inside a float64 run): a note, not a failure, unless the run is strict.
    hardening: bool = False


@dataclass(frozen=True)
class Cause:
    """One entry of a report's diagnosis: a mistake that explains failing rows."""

    id: str  # the catalogue's id (attnlab.check.catalogue), or "stage" / "crash" when none matched
    found: str  # what was found, in one sentence
    evidence: str  # how it was established
    fix: str  # the one-line fix
    seed: str  # the seed section it relates to
    explains: tuple[str, ...] = ()  # the failing rows it accounts for
    # Robustness a textbook module is not written for (attnlab.check.catalogue.Mistake.hardening): the
    # attention it computes is right; its rows are notes unless the run is strict.
    hardening: bool = False


@dataclass
class Report:
    """All results for one target, in the order the checks ran."""

    target: str
    results: list[CheckResult] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # dims, seed, torch version: what reproduces the run
    diagnosis: list[Cause] = field(default_factory=list)  # most likely cause first; empty when nothing failed
    partial: str | None = None  # why the run stopped early ("interrupted (SIGTERM) after 5 of 32 checks"), or None
    strict: bool = False  # hardening notes count as failures (attnlab check --strict)

    @property
    def failing(self) -> list[CheckResult]:
        """Every row whose figure missed its bound, hardening notes included."""
        return [r for r in self.results if r.status == "fail"]

    @property
    def failures(self) -> list[CheckResult]:
        """The rows that fail the target: every failing row but the hardening notes (all of them when strict)."""
        return [r for r in self.failing if self.strict or not r.hardening]

    @property
    def notes(self) -> list[CheckResult]:
        """The hardening notes: failing rows that only hardening causes explain (none when strict)."""
        return [r for r in self.failing if r.hardening and not self.strict]

    @property
    def ok(self) -> bool:
        """True when the module computes attention correctly: no check failed but hardening notes (skips do not
        count against the target)."""
        return not self.failures

    def apply_diagnosis(self, causes: list[Cause]) -> None:
        """Record ``causes`` and mark as hardening each failing row that only hardening causes explain.

        A row no cause explains stays a failure: a note is a finding named and understood, never a guess."""
        self.diagnosis = causes
        hardening = {n for c in causes if c.hardening for n in c.explains}
        real = {n for c in causes if not c.hardening for n in c.explains}
        self.results = [
            replace(r, hardening=r.status == "fail" and r.name in hardening and r.name not in real)
            for r in self.results
        ]

    def is_note(self, cause: Cause) -> bool:
        """Whether ``cause`` is a hardening note: hardening, and every row it explains a note (strict: never)."""
        notes = {r.name for r in self.notes}
        return cause.hardening and not self.strict and set(cause.explains) <= notes

    @property
    def causes_then_notes(self) -> list[Cause]:
        """The diagnosis as it is printed: the likely causes, most likely first, then the hardening notes."""
        return [c for c in self.diagnosis if not self.is_note(c)] + [c for c in self.diagnosis if self.is_note(c)]

    def __getitem__(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(f"no check named {name!r} in this report; it has {[r.name for r in self.results]}.")

    def to_dict(self) -> dict:
        """Plain JSON-able data; a non-finite figure becomes a string ("inf"), which JSON lacks."""
        rows = [asdict(r) for r in self.results]
        for row in rows:
            for key in ("measured", "tolerance"):
                if isinstance(row[key], float) and not math.isfinite(row[key]):
                    row[key] = str(row[key])
        return {
            "target": self.target,
            "ok": self.ok,
            "strict": self.strict,
            "notes": [r.name for r in self.notes],
            "config": self.config,
            "results": rows,
            "diagnosis": [asdict(c) for c in self.causes_then_notes],  # the printed order: causes, then notes
            "partial": self.partial,
        }

    def raise_if_failed(self) -> None:
        """For a user's pytest suite: ``run_checks(my_module).raise_if_failed()``."""
        if self.failures:
            lines = [f"  {r.name}: measured {r.measured}, tolerance {r.tolerance}; {r.detail}" for r in self.failures]
            raise AssertionError(f"{self.target} failed {len(lines)} attention check(s):\n" + "\n".join(lines))
