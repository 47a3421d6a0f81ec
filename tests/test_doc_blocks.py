"""Every fenced block of README.md, README.zh-CN.md and docs/**/*.md is tried, as written.

What tries each kind of block is in scripts/doc_blocks.py's docstring. Here:

* no block is left untried: each is run (here, by the site's build or by tests/test_readme_examples.py),
  or marked as an excerpt of a file that exists, as needing a GPU, or as not run with a reason;
* each page's ``python`` blocks run in order in one fresh namespace, from a clean temporary folder,
  with no name supplied from outside (a block uses only what it or an earlier block of its page defines);
* each quoted output (``<!-- output: NAME -->``) matches a fresh run of the command that printed it
  (scripts/doc_outputs.py; for form where it varies by machine), and the check tutorial matches
  scripts/check_tutorial.py's fresh page.

A page changed by a tool's change fails here until it is regenerated:
``python scripts/doc_outputs.py`` and ``python scripts/check_tutorial.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # the two scripts import each other as modules
import doc_blocks  # noqa: E402
import doc_outputs  # noqa: E402

from test_readme_examples import one_smollm2  # noqa: E402, F401  (a fixture: from_pretrained("smollm2") loaded once)

INVENTORY = doc_blocks.inventory()
PYTHON = [b for b, kind in INVENTORY if kind == "python"]
OUTPUT_NAMES = sorted({(b.marker("output") or "").split(";")[0].strip() for b, kind in INVENTORY if kind == "output"})
GENERATED = [name for name in OUTPUT_NAMES if name in doc_outputs.OUTPUTS]

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def test_every_block_is_tried():
    untried = [b.id for b, kind in INVENTORY if kind is None]
    assert not untried, (
        f"{len(untried)} blocks are neither run nor marked (scripts/doc_blocks.py says how): " + ", ".join(untried)
    )
    kinds = {kind for _, kind in INVENTORY}
    assert {"site", "python", "commands", "output", "twin"} <= kinds, kinds  # the parser still finds each kind


def test_every_marker_points_at_something_real():
    for block, kind in INVENTORY:
        if kind == "excerpt":
            assert doc_blocks.excerpt_target(block) is not None, f"{block.id}: its excerpt marker names no file"
        for key in ("not run", "gpu", "slow"):
            value = block.marker(key)
            assert value is None or len(value) > 10, f"{block.id}: `{key}:` needs its reason"
    unknown = [n for n in OUTPUT_NAMES if n not in doc_outputs.OUTPUTS and not (ROOT / n).is_file()]
    assert not unknown, f"output markers naming no generator in scripts/doc_outputs.py nor a script: {unknown}"
    unused = sorted(set(doc_outputs.OUTPUTS) - set(OUTPUT_NAMES))
    assert not unused, f"scripts/doc_outputs.py generates outputs no page marks: {unused}"


def test_the_parser_reads_markers_indents_and_twins(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- excerpt: full form in elsewhere.py -->\n```python\nx = 1\n```\n\n"
        "!!! note\n    <!-- not run: a fragment of nothing in particular -->\n    ```bash\n    make nothing\n    ```\n\n"
        "```\n$ attnlab trace\n```\n\n```text\njust text\n```\n"
    )
    found = doc_blocks.blocks(page)
    assert [(b.line, b.lang, b.body, b.markers) for b in found] == [
        (4, "python", "x = 1\n", (("excerpt", "full form in elsewhere.py"),)),
        (10, "bash", "make nothing\n", (("not run", "a fragment of nothing in particular"),)),
        (14, "", "$ attnlab trace\n", ()),
        (18, "text", "just text\n", ()),
    ]
    assert [doc_blocks.kind(b) for b in found] == ["excerpt", "not run", "commands", None]
    english = doc_blocks.Block("docs/a.md", 1, "bash", "make demo\n")
    assert doc_blocks.kind(doc_blocks.Block("docs/a.zh.md", 1, "bash", "make demo\n"), [english]) == "twin"
    assert doc_blocks.kind(doc_blocks.Block("docs/a.zh.md", 1, "bash", "make test\n"), [english]) is None


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    """One :class:`PageSession` per page, created when its first block runs."""
    made: dict[str, object] = {}

    def session(page: str):
        if page not in made:
            made[page] = doc_blocks.PageSession(page, tmp_path_factory.mktemp("page"))
        return made[page]

    return session


def _param(block):
    marks = [pytest.mark.slow] if block.marker("slow") is not None else []
    return pytest.param(block, marks=marks, id=block.id)


@pytest.mark.usefixtures("one_smollm2")
@pytest.mark.parametrize("block", [_param(b) for b in PYTHON])
def test_python_block_runs_as_written(block, sessions):
    session = sessions(block.page)
    for earlier in PYTHON:  # the blocks above it on its page first, as a reader runs them
        if earlier.page == block.page and earlier.line < block.line:
            _, error = session.run(earlier)
            if error is not None:
                pytest.fail(f"{earlier.id}, above this block, failed:\n{error}")
    _, error = session.run(block)
    assert error is None, f"{block.id} failed as written:\n{error}"


def _output_param(name):
    slow = doc_outputs.OUTPUTS[name].slow
    return pytest.param(name, marks=[pytest.mark.slow] if slow else [], id=name)


@pytest.mark.parametrize("name", [_output_param(n) for n in GENERATED])
def test_quoted_output_is_a_fresh_runs(name):
    problems = doc_outputs.compare(name, doc_outputs.OUTPUTS[name].produce())
    assert not problems, "\n\n".join(problems) + f"\n\nregenerate: python scripts/doc_outputs.py {name}"


@pytest.mark.slow  # four runs of attnlab check's full suite, a minute on 2 cores
def test_check_tutorial_is_a_fresh_runs():
    tutorial = load_script("check_tutorial")
    fresh = tutorial.page()
    shown = (ROOT / "docs" / "check_tutorial.md").read_text(encoding="utf-8")
    pattern = doc_outputs.form(shown, doc_outputs.Output(tutorial.page))
    assert pattern.match(fresh), "docs/check_tutorial.md differs from a fresh run: python scripts/check_tutorial.py"


def test_form_allows_only_what_varies():
    exact = doc_outputs.Output(str)
    assert doc_outputs.form("matches to 2.7e-07 on 5 inputs", exact).match("matches to 3.1e-07 on 5 inputs\n")
    assert not doc_outputs.form("matches to 2.7e-07 on 5 inputs", exact).match("matches to 3.1e-07 on 6 inputs\n")
    varies = doc_outputs.Output(str, varies=True, free=(r"(?!attnlab: ).*",))
    shown = "attnlab: weights gguf (int8 tiles on AVX2): 5.6x\nAn answer.\nattnlab: decode 83 tokens in 0.73 s"
    run = "attnlab: weights gguf (int8 tiles on AVX-512 VNNI): 5.6x\nTwo\nlines.\nattnlab: decode 9 tokens in 1.2 s\n"
    assert doc_outputs.form(shown, varies).match(run)
    assert not doc_outputs.form(shown, varies).match(run.replace("decode", "prefill"))
    # a line break may move where a number grows: the words and their order are what count
    assert doc_outputs.form("a b\nc", exact).match("a\nb c\n") and not doc_outputs.form("a b c", exact).match("a c b\n")


def test_timings_on_the_pages_name_their_cpu():
    """A quoted output that varies by machine says, in the paragraph above it, which CPU printed it."""
    for block, kind in INVENTORY:
        if kind != "output" or "varies:" not in (block.marker("output") or "") or doc_blocks.is_chinese(block.page):
            continue
        lines = (ROOT / block.page).read_text(encoding="utf-8").splitlines()[: block.line - 1]
        above = " ".join(lines[-12:])
        assert re.search(r"\b(AMD EPYC|Intel Xeon|Apple M\d|H100|H200)\b", above), (
            f"{block.id}: the text above this output does not name the CPU it was run on"
        )
