"""Every figure the docs quote from a benchmark's JSON still matches that JSON.

A page marks a table or paragraph whose figures all come from one JSON file in ``docs/`` with a
comment on the line right after it::

    | batch | attnlab gguf | llama.cpp | gguf/llama.cpp |
    | --- | ---: | ---: | ---: |
    | 1 | 150.2 | 100.3 | 1.50x |
    <!-- figures: ../bench_decode_gguf_amd.json -->

(the path is relative to the page). Every number in the block must be one of the following: in a
table, every cell of the body rows but the first (the header names the columns, the first cell names
the row); in a paragraph, all of it; numbers inside code spans are commands and shapes, not figures.

* a value of the JSON as printed: rounded to the digits shown, possibly in another unit
  (:data:`UNITS`: ms for s, MB or MiB for bytes, per second for per millisecond);
* ``N.Nx``: the ratio of two of its values;
* ``N%``: one value as a percentage of another.

So a rerun of the benchmark that changes the JSON, or a figure edited by hand, fails here until the
page is brought in line. Figures with no JSON behind them are not marked, and their pages say where
they were measured.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([*REPO.glob("README*.md"), *(REPO / "docs").rglob("*.md")])
MARKER = re.compile(r"^\s*<!--\s*figures:\s*(\S+)\s*-->\s*$")
CODE_SPAN = re.compile(r"`[^`]*`")
# a figure: digits with optional thousands separators and decimals, then an optional x or %
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:e([-+]?\d+))?(x|%)?(?![\w])")
# the units a page may print a JSON value in: v * factor, and factor / v for rates (ms/token <-> tokens/s)
UNITS = (1.0, 1e3, 1e-3, 1e6, 1e-6, 1e9, 1e-9, 2.0**20, 2.0**-20, 2.0**30, 2.0**-30)


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


class Figures:
    """The values one JSON file can justify, sorted for lookup."""

    def __init__(self, path: Path) -> None:
        values = sorted({v for v in _numbers(json.loads(path.read_text())) if v == v and abs(v) != float("inf")})
        self.plain = sorted({v * u for v in values for u in UNITS} | {u / v for v in values if v for u in UNITS})
        self.ratios = sorted({a / b for a in values for b in values if b})

    @staticmethod
    def _near(table: list[float], target: float, tolerance: float) -> bool:
        i = bisect.bisect_left(table, target - tolerance)
        return i < len(table) and table[i] <= target + tolerance

    def justifies(self, figure: str) -> bool:
        m = NUMBER.fullmatch(figure)
        assert m, figure
        whole, decimals, exponent, kind = m.groups()
        value = float(whole.replace(",", "") + (decimals or ""))
        step = 10.0 ** -(len(decimals) - 1 if decimals else 0)
        if exponent:
            value, step = value * 10.0 ** int(exponent), step * 10.0 ** int(exponent)
        tolerance = step / 2 + 1e-9 * abs(value)
        if kind == "x":
            return self._near(self.ratios, value, tolerance)
        if kind == "%":
            return self._near(self.ratios, value / 100, tolerance / 100)
        return self._near(self.plain, value, tolerance)


def _block_before(lines: list[str], marker: int) -> list[str]:
    """The table or paragraph that ends just above line ``marker`` (a table without its header)."""
    end = marker
    while end > 0 and not lines[end - 1].strip():
        end -= 1
    start = end
    while start > 0 and lines[start - 1].strip() and not MARKER.match(lines[start - 1]):
        start -= 1
    block = lines[start:end]
    if block and block[0].lstrip().startswith("|"):
        # the header row and the |---| row name the columns, and each row's first cell names the row
        block = ["|" + row.strip().removeprefix("|").split("|", 1)[-1] for row in block[2:]]
    return block


def marked_blocks(pages: list[Path] = PAGES) -> list[tuple[str, Path, list[str]]]:
    """``(where, json path, block lines)`` for every marker in ``pages`` (the READMEs and docs/)."""
    found = []
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            m = MARKER.match(line)
            if m:
                where = f"{page.relative_to(REPO)}:{i + 1}"
                found.append((where, (page.parent / m.group(1)).resolve(), _block_before(lines, i)))
    return found


def unjustified(figures: Figures, block: list[str]) -> list[str]:
    text = CODE_SPAN.sub(" ", "\n".join(block))
    return [m.group(0) for m in NUMBER.finditer(text) if not figures.justifies(m.group(0))]


BLOCKS = marked_blocks()


@pytest.mark.parametrize("where, source, block", BLOCKS, ids=[w for w, _, _ in BLOCKS])
def test_marked_figures_come_from_their_json(where: str, source: Path, block: list[str]) -> None:
    assert source.is_file(), f"{where}: the figures marker names {source}, which does not exist"
    assert source.is_relative_to(REPO / "docs"), f"{where}: {source} is outside docs/"
    assert block, f"{where}: the marker follows no table or paragraph"
    bad = unjustified(Figures(source), block)
    assert not bad, f"{where}: figures not in {source.relative_to(REPO)} (as rounded, a ratio or a %): {bad}"


def test_the_pages_mark_their_benchmark_figures() -> None:
    """Guards against the test passing vacuously: the results pages do mark their tables."""
    sources = {s.name for _, s, _ in BLOCKS}
    assert len(BLOCKS) >= 3 and {"bench_window.json", "bench_decode_gguf_amd.json"} <= sources, sources


def test_a_changed_figure_is_caught(tmp_path: Path) -> None:
    data = {"results": [{"batch": 1, "ms_per_token": 6.657, "tokens_per_s": 150.2}, {"ms": 9.97}], "bytes": 104857600}
    (tmp_path / "r.json").write_text(json.dumps(data))
    figures = Figures(tmp_path / "r.json")
    good = ["| 1 | 150.2 | 6.66 ms | 1.50x | 100.0 MiB | 67% |"]
    assert unjustified(figures, good) == []
    assert unjustified(figures, ["| 1 | 150.3 | 6.66 ms | 1.50x |"]) == ["150.3"]  # a figure edited by hand
    code_is_ignored = ["| 1 | 150.2 | 6.66 ms | 1.60x | `--repeats 7` |"]
    assert unjustified(figures, code_is_ignored) == ["1.60x"]  # a ratio edited by hand
    assert unjustified(figures, ["took 86,713 ms"]) == ["86,713"]
