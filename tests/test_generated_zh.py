"""A page that a script writes has its Chinese twin written by the same script, from the same run, so that
regenerating one page regenerates both (tests/test_docs_zh.py then keeps their sections, code and figures in
step).

Each generated twin on disk is compared with what its script writes now: the gallery of mistakes, the
quantized-kernels benchmark pages (from their JSON), the H200 numerics page and the check tutorial (each from
the figures and outputs of its English page, which tests/test_doc_blocks.py compares with fresh runs).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ENGLISH_NAMES = {p.name for p in DOCS.rglob("*.md") if not p.name.endswith(".zh.md")}


def _writes_a_page(source: str) -> list[str]:
    """The English page names (``check_gallery.md``) that a script's string constants name, when it writes files."""
    if "write_text(" not in source and 'open(a.out, "w")' not in source:
        return []
    names = {
        Path(node.value).name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".md")
    }
    return sorted(names & ENGLISH_NAMES)


def test_every_script_that_writes_a_docs_page_writes_its_chinese_twin():
    writers = {}
    for script in sorted((ROOT / "scripts").glob("*.py")):
        source = script.read_text(encoding="utf-8")
        pages = _writes_a_page(source)
        if pages:
            writers[script.name] = pages
            assert ".zh.md" in source, f"scripts/{script.name} writes {pages} but not their Chinese twins (.zh.md)"
    # the scan still finds the writers it was written for
    assert {"check_gallery.py", "check_tutorial.py", "bench_quant_kernels.py", "gpu_numerics.py"} <= set(writers)


def test_the_gallery_twin_is_the_scripts():
    gallery = load_script("check_gallery")
    shown = (DOCS / "check_gallery.zh.md").read_text(encoding="utf-8")
    assert shown == gallery.gallery_markdown_zh(gallery.corpus_examples(ROOT)), "run: python scripts/check_gallery.py"
    assert "种子" not in shown and "seed 0" not in shown  # the posts are 博文 000 / 002 on the Chinese pages


def test_what_has_no_chinese_stops_the_gallery_naming_it():
    gallery = load_script("check_gallery")
    with pytest.raises(SystemExit, match=r"mistake 'scale_missing' fails 'every row, said in a way nobody translated'"):
        gallery.symptom_zh("scale_missing", "every row, said in a way nobody translated")
    assert gallery.symptom_zh("x", "determinism, dropout_off_in_eval") == "determinism、dropout_off_in_eval"
    with pytest.raises(SystemExit, match=r"no Chinese for where 'a talk, slide 3' points"):
        gallery.seed_zh("a talk, slide 3")


@pytest.mark.parametrize("folder", ["bench", "bench/amd_epyc_zen3"])
def test_the_quantized_kernel_pages_are_both_from_their_json(folder):
    bench = load_script("bench_quant_kernels")
    result = json.loads((DOCS / folder / "quant_kernels.json").read_text())
    for lang, name in bench.PAGES.items():
        assert (DOCS / folder / name).read_text(encoding="utf-8") == bench.markdown(result, lang), (
            f"run: python scripts/bench_quant_kernels.py --out docs/{folder} --pages-only"
        )


def test_the_numerics_pages_are_both_the_scripts_rendering_of_one_run():
    """The English page's figures, rendered again by gpu_numerics.pages, give both pages as they are."""
    numerics = load_script("gpu_numerics")
    english = (DOCS / "numerics_h200.md").read_text(encoding="utf-8")
    where = re.match(r"device (.*)\n", english)[1]
    rows = [
        tuple(c.strip() for c in line.strip("|").split("|")) for line in english.splitlines()[4:] if line[:2] == "| "
    ]
    large = [
        (m[1], int(m[2]), int(m[3]), int(m[4]))
        for m in re.finditer(
            r"fp16 large scores, (\w+): (\d+) non-finite of (\d+) \(naive scores-then-scale: (\d+)\)", english
        )
    ]
    worst = float(re.search(r"worst ratio ([\d.]+)", english)[1])
    assert len(rows) == 24 and len(large) == 2
    assert numerics.pages(where, rows, large, worst) == (
        english,
        (DOCS / "numerics_h200.zh.md").read_text(encoding="utf-8"),
    )


def test_the_check_tutorials_twin_is_the_scripts_from_the_english_pages_runs(monkeypatch):
    """The Chinese tutorial is what the script writes from the runs the English page shows (tests/test_doc_blocks.py
    compares those with fresh runs): the same outputs and exit codes, its own prose."""
    tutorial = load_script("check_tutorial")
    english = (DOCS / "check_tutorial.md").read_text(encoding="utf-8")
    runs = {}
    for m in re.finditer(
        r"```\n\$ attnlab check --target tests/mistake_corpus/(\w+)\.py:\w+\n\.\.\.\n(.*?)\n```\n", english, re.S
    ):
        code = re.search(r"\nExit code (\d+)\.", english[m.end() :])
        runs[m[1]] = (int(code[1]) if code and m[1] != "seed002_correct" else 0, m[2])
    assert set(runs) == {"seed002_correct", *(stem for stem, _ in tutorial.BREAKS)}
    monkeypatch.setattr(tutorial, "_checks", lambda: runs)
    assert tutorial.page() == english  # the runs read back are the page's
    assert (DOCS / "check_tutorial.zh.md").read_text(encoding="utf-8") == tutorial.page_zh(), (
        "run: python scripts/check_tutorial.py"
    )
