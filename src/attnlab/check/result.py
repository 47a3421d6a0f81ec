"""What a check run returns: one :class:`CheckResult` per check, gathered in a :class:`Report`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["pass", "fail", "skip"]

__all__ = ["Cause", "CheckResult", "Report", "Status"]


@dataclass(frozen=True)
class CheckResult:
    """One row of the report."""

    name: str
    status: Status
    measured: float | str | None = None  # the figure compared with the tolerance (None when skipped)
    tolerance: float | str | None = None  # the bound the figure had to meet
    detail: str = ""  # how it was measured, or why it was skipped
    data: dict = field(default_factory=dict, compare=False)  # figures the diagnosis reads (JSON too)


@dataclass(frozen=True)
class Cause:
    """One entry of a report's diagnosis: a mistake that explains failing rows."""

    id: str  # the catalogue's id (attnlab.check.catalogue), or "stage" / "crash" when none matched
    found: str  # what was found, in one sentence
    evidence: str  # how it was established
    fix: str  # the one-line fix
    seed: str  # the seed section it relates to
    explains: tuple[str, ...] = ()  # the failing rows it accounts for


@dataclass
class Report:
    """All results for one target, in the order the checks ran."""

    target: str
    results: list[CheckResult] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # dims, seed, torch version: what reproduces the run
    diagnosis: list[Cause] = field(default_factory=list)  # most likely cause first; empty when nothing failed
    partial: str | None = None  # why the run stopped early ("interrupted (SIGTERM) after 5 of 32 checks"), or None

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    @property
    def ok(self) -> bool:
        """True when no check failed (skips do not count against the target)."""
        return not self.failures

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
            "config": self.config,
            "results": rows,
            "diagnosis": [asdict(c) for c in self.diagnosis],
            "partial": self.partial,
        }

    def raise_if_failed(self) -> None:
        """For a user's pytest suite: ``run_checks(my_module).raise_if_failed()``."""
        if self.failures:
            lines = [f"  {r.name}: measured {r.measured}, tolerance {r.tolerance}; {r.detail}" for r in self.failures]
            raise AssertionError(f"{self.target} failed {len(lines)} attention check(s):\n" + "\n".join(lines))
