"""The table ``attnlab trace`` prints: one row per stage of one attention call, its real shape, view or new.

Shared by the trace of :class:`attnlab.MultiHeadAttention` (:mod:`attnlab.tools.trace`) and of
:class:`attnlab.MultiHeadLatentAttention` (:mod:`attnlab.tools.trace_mla`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["TraceRow", "AttentionTrace", "aligned"]


@dataclass
class TraceRow:
    stage: str  # the seed's name for the step
    operation: str  # the call, with the names of the tensors it used
    shape: list[int] | list[list[int]]  # shape of what it produced (several for a split)
    axes: str  # what the dims mean
    memory: str  # "view" (shares storage with its input), "new" (fresh memory) or "input"


@dataclass
class AttentionTrace:
    """One call of one attention module."""

    module: str
    backend: str | None = None
    rows: list[TraceRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self, width: int | None = None) -> str:
        """An aligned table (what ``attnlab trace`` prints), one line per stage.

        Args:
            width: the columns the table may use (``None``: no limit). When one line per stage does not
                fit, each stage takes two: stage, shape and memory; then, indented, the operation with
                its axes as a trailing comment (on a line of its own when that does not fit either).
        """
        head = ("#", "stage", "operation", "shape", "axes", "memory")
        body = [
            (str(i), r.stage, r.operation, _fmt_shape(r.shape), r.axes, r.memory) for i, r in enumerate(self.rows, 1)
        ]
        title = f"{self.module}  (backend: {self.backend})"
        wide = aligned(head, body)
        if width is None or max(len(line) for line in wide) <= width:
            return "\n".join([title, *wide])
        short = aligned(("#", "stage", "shape", "memory"), [(b[0], b[1], b[3], b[5]) for b in body])
        out = [title, short[0], "    operation  # axes", short[1]]
        for line, (_, _, op, _, axes, _) in zip(short[2:], body, strict=True):
            out.append(line)
            detail = f"    {op}  # {axes}" if axes else f"    {op}"
            if len(detail) <= width:
                out.append(detail)
            else:  # the comment on a line of its own, each piece wrapped if it still does not fit
                out += textwrap.wrap(op, width, initial_indent="    ", subsequent_indent="      ")
                out += textwrap.wrap(f"# {axes}", width, initial_indent="    ", subsequent_indent="      # ")
        return "\n".join(out)


def aligned(head: tuple[str, ...], body: Sequence[tuple[str, ...]]) -> list[str]:
    """Header, a rule of dashes, then the rows; columns padded to their widest cell, two spaces apart."""
    widths = [max(len(row[c]) for row in [head, *body]) for c in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [line(head), line(tuple("-" * w for w in widths)), *(line(r) for r in body)]


def _fmt_shape(shape: list) -> str:
    if shape and isinstance(shape[0], list):
        return " + ".join(str(s) for s in shape)
    return str(shape)
