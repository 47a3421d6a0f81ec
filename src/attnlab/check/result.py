"""What a check run returns: one :class:`CheckResult` per check, gathered in a :class:`Report`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

# "note": a row that missed its bound where only hardening causes explain it (Report.apply_diagnosis marks it so,
# unless the run is strict): the attention is right, and strict runs and raise_if_failed(strict=True) fail on it.
Status = Literal["pass", "fail", "skip", "note"]

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
    # A row that missed its bound where only hardening causes explain it (NaN in padded values, fully masked
    # rows, a fill float16 cannot hold, float32 inside a float64 run): its status is "note", not "fail", unless
    # the run is strict (then it stays "fail", and this flag still says why).
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
    strict: bool = False  # hardening notes count as failures (attnlab check --strict; run_checks(strict=True))

    @property
    def failing(self) -> list[CheckResult]:
        """Every row whose figure missed its bound: the failures and the hardening notes."""
        return [r for r in self.results if r.status in ("fail", "note")]

    @property
    def failures(self) -> list[CheckResult]:
        """The rows that fail the target: status ``"fail"``, and the notes too when the report is strict."""
        return [r for r in self.results if r.status == "fail" or (self.strict and r.status == "note")]

    @property
    def notes(self) -> list[CheckResult]:
        """The hardening notes: rows of status ``"note"``, failing only what only hardening causes explain
        (none when strict: they are failures then)."""
        return [] if self.strict else [r for r in self.results if r.status == "note"]

    @property
    def ok(self) -> bool:
        """True when the module computes attention correctly: no row failed; hardening notes do not count (unless
        the report is strict), nor do skips."""
        return not self.failures

    def apply_diagnosis(self, causes: list[Cause]) -> None:
        """Record ``causes`` and mark each failing row that only hardening causes explain: ``hardening=True``,
        and status ``"note"`` unless the report is strict.

        A row no cause explains stays a failure: a note is a finding named and understood, never a guess."""
        self.diagnosis = causes
        hardening = {n for c in causes if c.hardening for n in c.explains}
        real = {n for c in causes if not c.hardening for n in c.explains}
        rows = []
        for r in self.results:
            missed = r.status in ("fail", "note")
            only_hardening = missed and r.name in hardening and r.name not in real
            status = r.status if not missed else "note" if only_hardening and not self.strict else "fail"
            rows.append(replace(r, status=status, hardening=only_hardening))
        self.results = rows

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

    def raise_if_failed(self, strict: bool | None = None) -> None:
        """For a user's pytest suite: ``run_checks(my_module).raise_if_failed()`` raises ``AssertionError`` naming
        every failing row.

        Args:
            strict: whether hardening notes (rows of status ``"note"``: NaN in padded values, fully masked rows,
                a mask fill float16 cannot hold, float32 inside a float64 run) fail too, as ``attnlab check
                --strict`` fails on them. ``None`` (the default): as the report was run
                (``run_checks(..., strict=...)``, False unless asked); ``True`` raises on the notes of a report
                run without it; ``False`` ignores them even in a strict report.
        """
        strict = self.strict if strict is None else strict
        # a strict report's notes have status "fail" and hardening=True: strict=False leaves them out again
        failed = [r for r in self.results if r.status in ("fail", "note") and (strict or not r.hardening)]
        if failed:
            lines = [
                f"  {r.name}: measured {r.measured}, tolerance {r.tolerance}; {r.detail}"
                + (" (a hardening note, failed because strict)" if r.hardening else "")
                for r in failed
            ]
            raise AssertionError(
                f"{self.target} failed {len(lines)} attention check(s)"
                + (", hardening notes included (strict)" if strict and any(r.hardening for r in failed) else "")
                + ":\n"
                + "\n".join(lines)
            )
