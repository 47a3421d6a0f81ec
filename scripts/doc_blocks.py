"""Every fenced code block of README.md, README.zh-CN.md and docs/**/*.md: what it is, and a trial of it.

    python scripts/doc_blocks.py                 # every block: its kind and what runs it
    python scripts/doc_blocks.py --run           # and run the Python blocks here (not the slow ones)
    python scripts/doc_blocks.py --run --slow docs/howto/real-models.md   # one page, slow blocks too

Each block is one of these kinds (:func:`kind`), so none is left untried:

* ``site``: a ``python exec="on"`` block; the site's strict build runs it and prints its output
  (``make docs``; tests/test_docs_site.py).
* ``python``: a plain ``python`` block, run here as written: the blocks of one page in order in one
  fresh namespace (like a doctest session), from a clean temporary folder (tests/test_doc_blocks.py).
* ``commands``: a ``bash`` block, or a block of ``$ command`` lines; tests/test_readme_examples.py runs
  each command (errors it quotes compared exactly) in a clean temporary folder.
* ``output``: a quoted output, after ``<!-- output: NAME -->``; scripts/doc_outputs.py regenerates it and
  tests/test_doc_blocks.py compares the page with a fresh run.
* ``excerpt``: after ``<!-- excerpt: full form in PATH -->``: a part of a file or page that PATH holds whole.
* ``gpu``: after ``<!-- gpu: REASON -->``: needs a CUDA GPU; skipped, with REASON, where there is none.
* ``not run``: after ``<!-- not run: REASON -->`` (a benchmark that takes an hour, a fragment of a
  diff): never run, for REASON.
* ``twin``: a block of a Chinese page (``*.zh.md``, README.zh-CN.md) that is its English twin's block
  at the same place: tried once, on the English page.

A marker is an HTML comment on one of the lines right above the block (a reader does not see it);
``<!-- slow: REASON -->`` beside it puts a Python block among the slow tests; ``varies: WHAT`` inside
an output marker (``<!-- output: readme_chat; varies: the answer's words and speed, by CPU -->``)
says that the output depends on the machine: it is compared for form (scripts/doc_outputs.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a fence opens with 3+ backticks, maybe indented (inside an admonition), and closes with the same
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
MARKER = re.compile(r"^\s*<!--\s*(?P<key>excerpt|gpu|not run|output|slow)\s*:\s*(?P<value>.*?)\s*-->\s*$")
KINDS = ("site", "python", "commands", "output", "excerpt", "gpu", "not run", "twin")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its info string, its text, the markers above it."""

    page: str  # relative to the repository, e.g. docs/howto/swap.md
    line: int  # 1-based line of the opening fence
    info: str  # what follows the backticks: 'python exec="on" session="x"', 'bash', ''
    body: str  # the text between the fences, its indent removed
    markers: tuple[tuple[str, str], ...] = ()  # (key, value) of each marker comment right above it

    @property
    def lang(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    def marker(self, key: str) -> str | None:
        return next((value for k, value in self.markers if k == key), None)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md, README.zh-CN.md, then every page under docs/, sorted."""
    return [ROOT / "README.md", ROOT / "README.zh-CN.md", *sorted((ROOT / "docs").rglob("*.md"))]


def is_chinese(page: str) -> bool:
    return page.endswith(".zh.md") or page.endswith(".zh-CN.md")


def english_twin(page: str) -> str:
    return page.replace(".zh-CN.md", ".md").replace(".zh.md", ".md")


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order, each with the marker comments right above it."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        markers = []
        above = line - 2  # 0-based index of the line above the fence
        while above >= 0 and (marker := MARKER.match(lines[above])):
            markers.insert(0, (marker["key"], marker["value"]))
            above -= 1
        indent = m["indent"]
        body = "".join(ln.removeprefix(indent) for ln in m["body"].splitlines(keepends=True))
        found.append(Block(name, line, m["info"].strip(), body, tuple(markers)))
    return found


def kind(block: Block, twin: list[Block] | None = None) -> str | None:
    """What tries the block (see the module docstring); None when nothing does (a block left untried).

    ``twin``: the blocks of a Chinese page's English twin.
    """
    for key in ("gpu", "excerpt", "not run", "output"):
        if block.marker(key) is not None:
            return key
    if is_chinese(block.page):
        same = twin is not None and any(b.body == block.body and b.info == block.info for b in twin)
        return "twin" if same else None
    if block.lang == "python":
        return "site" if re.search(r'\bexec="(on|true|1)"', block.info) else "python"
    if block.lang in ("bash", "sh", "shell", "console"):
        return "commands"
    first = next((ln for ln in block.body.splitlines() if ln.strip()), "")
    if block.lang in ("", "text") and first.startswith("$ "):
        return "commands"
    return None


def inventory() -> list[tuple[Block, str | None]]:
    """Every block of every page with its kind (None: untried)."""
    out = []
    for path in pages():
        page_blocks = blocks(path)
        name = page_blocks[0].page if page_blocks else ""
        twin = None
        if name and is_chinese(name) and (ROOT / english_twin(name)).is_file():
            twin = blocks(ROOT / english_twin(name))
        out += [(b, kind(b, twin)) for b in page_blocks]
    return out


def excerpt_target(block: Block) -> Path | None:
    """The file an excerpt marker names (``full form in PATH`` or ``... PATH#anchor``), relative to its page
    or to the repository; None when it names none that exists."""
    value = block.marker("excerpt") or ""
    m = re.search(r"full form in\s+`?([^\s`#]+)", value)
    if not m:
        return None
    for base in ((ROOT / block.page).parent, ROOT):
        if (base / m[1]).is_file():
            return base / m[1]
    return None


# ---- running a page's Python blocks ----------------------------------------------------------------


class PageSession:
    """A page's Python blocks, run in order in one namespace from one clean temporary folder."""

    def __init__(self, page: str, workdir: Path) -> None:
        self.page = page
        self.workdir = workdir
        self.namespace: dict[str, object] = {"__name__": "__main__"}
        self.done: dict[int, tuple[str, str | None]] = {}  # line -> (stdout, error or None)

    def run(self, block: Block) -> tuple[str, str | None]:
        """Runs ``block`` (once); ``(what it printed, the traceback if it raised)``."""
        if block.line in self.done:
            return self.done[block.line]
        printed = io.StringIO()
        cwd = os.getcwd()
        os.chdir(self.workdir)
        error = None
        try:
            code = compile(block.body, f"{block.page} (python block at line {block.line})", "exec")
            with contextlib.redirect_stdout(printed):
                exec(code, self.namespace)
        except Exception:  # a block's failure is reported, whatever it raised
            error = traceback.format_exc(limit=-3)
        finally:
            os.chdir(cwd)
        self.done[block.line] = (printed.getvalue(), error)
        return self.done[block.line]


def python_blocks(page: str | None = None) -> list[Block]:
    """The ``python`` blocks (not ``exec``) of the pages, in page order."""
    return [b for b, k in inventory() if k == "python" and (page is None or b.page == page)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="pages to list or run (default: all)")
    parser.add_argument("--run", action="store_true", help="run the Python blocks, page by page")
    parser.add_argument("--slow", action="store_true", help="with --run: the blocks marked slow too")
    args = parser.parse_args(argv)
    wanted = {Path(p).resolve().relative_to(ROOT).as_posix() for p in args.pages}
    rows = [(b, k) for b, k in inventory() if not wanted or b.page in wanted]
    untried = 0
    sessions: dict[str, PageSession] = {}
    failed = 0
    with tempfile.TemporaryDirectory(prefix="doc-blocks-") as scratch:
        for block, what in rows:
            status = ""
            if what is None:
                untried += 1
                status = "UNTRIED: mark it (see scripts/doc_blocks.py) or make it runnable"
            elif what == "excerpt" and excerpt_target(block) is None:
                untried += 1
                status = "EXCERPT OF NOTHING: its marker names no file that exists"
            elif what == "python" and args.run:
                if block.marker("slow") is not None and not args.slow:
                    status = f"skipped (slow: {block.marker('slow')}; --slow runs it)"
                else:
                    if block.page not in sessions:
                        folder = Path(scratch) / re.sub(r"\W", "_", block.page)
                        folder.mkdir()
                        sessions[block.page] = PageSession(block.page, folder)
                    start = time.perf_counter()
                    _, error = sessions[block.page].run(block)
                    took = time.perf_counter() - start
                    status = f"ok ({took:.1f} s)" if error is None else f"FAILED\n{error}"
                    failed += error is not None
            print(f"{block.id:45} {what or '-':9} {status}")
    print(f"{len(rows)} blocks; {untried} untried; {failed} failed")
    return 1 if untried or failed else 0


if __name__ == "__main__":
    sys.exit(main())
