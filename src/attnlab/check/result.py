"""What a check run returns: one :class:`CheckResult` per check, gathered in a :class:`Report`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

Status = Literal["pass", "fail", "skip"]

__all__ = ["CheckResult", "Report", "Status"]


@dataclass(frozen=True)
class CheckResult:
    """One row of the report."""

    name: str
    status: Status
    measured: float | str | None = None  # the figure compared with the tolerance (None when skipped)
    tolerance: float | str | None = None  # the bound the figure had to meet
    detail: str = ""  # how it was measured, or why it was skipped


@dataclass
class Report:
    """All results for one target, in the order the checks ran."""

    target: str
    results: list[CheckResult] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # dims, seed, torch version: what reproduces the run

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
        return {"target": self.target, "ok": self.ok, "config": self.config, "results": rows}

    def raise_if_failed(self) -> None:
        """For a user's pytest suite: ``run_checks(my_module).raise_if_failed()``."""
        if self.failures:
            lines = [f"  {r.name}: measured {r.measured}, tolerance {r.tolerance}; {r.detail}" for r in self.failures]
            raise AssertionError(f"{self.target} failed {len(lines)} attention check(s):\n" + "\n".join(lines))
