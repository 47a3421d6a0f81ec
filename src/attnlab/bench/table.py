"""Plain text for a terminal: aligned tables and wrapped lines that fit its width (80 columns when unknown).

The benchmarks print a compact table here and write the full one, every column, as Markdown and JSON.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

__all__ = ["aligned", "terminal_width", "wrap"]


def terminal_width() -> int:
    """Columns of the terminal (``COLUMNS`` first, as the shell sets it); 80 when there is none.

    Never below 60: a narrower "terminal" is almost always a misreport, and 60 keeps tables legible.
    """
    return max(60, shutil.get_terminal_size((80, 24)).columns)


def wrap(text: str, width: int | None = None, indent: str = "  ") -> str:
    """Each line of ``text`` wrapped at ``width``; continuation lines start with ``indent``."""
    width = width or terminal_width()
    return "\n".join(
        textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False) if line else ""
        for line in text.splitlines()
    )


def aligned(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool], gap: str = "  ") -> list[str]:
    """``header`` and ``rows`` as aligned lines (right-aligned where ``right`` says); trailing blanks dropped.

    A row of one cell is a group title: printed as it is, not aligned.
    """
    widths = [max(len(r[c]) for r in [header, *rows] if len(r) == len(header)) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        if len(cells) == 1:
            return cells[0]
        return gap.join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)).rstrip()

    return [line(header), *(line(r) for r in rows)]
