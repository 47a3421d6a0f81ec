"""README.zh-CN.md is README.md's Chinese twin: same code, same figures, same pages linked.

The English README's examples run in tests/test_readme_examples.py; the twin is held to them here
rather than run a second time. Its figures are checked against their JSON by tests/test_docs_figures.py
like every marked block.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_docs_figures import NUMBER, marked_blocks

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)")


def _read(name: str) -> str:
    return (REPO / name).read_text(encoding="utf-8")


def _targets(text: str) -> list[str]:
    """Where the links go, a Chinese twin page counted as its English page; the language link dropped."""
    links = [t.replace(".zh.md", ".md") for t in LINK.findall(text)]
    return sorted(t for t in links if not t.startswith("README"))


def _marked_figures(name: str) -> list[tuple[Path, list[str]]]:
    """``(JSON, the figures of its block)`` for each figures marker of README ``name``, in order."""
    return [
        (source, [n.group(0) for n in NUMBER.finditer("\n".join(block))])
        for _, source, block in marked_blocks([REPO / name])
    ]


def test_the_twins_show_the_same_code():
    en, zh = FENCE.findall(_read("README.md")), FENCE.findall(_read("README.zh-CN.md"))
    assert len(en) >= 3 and zh == en


def test_the_twins_link_the_same_pages_and_each_other():
    en, zh = _read("README.md"), _read("README.zh-CN.md")
    assert "(README.zh-CN.md)" in en and "(README.md)" in zh
    assert _targets(zh) == _targets(en)
    for target in set(_targets(en)):
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"
    for target in LINK.findall(zh):
        assert (REPO / target).exists(), f"README.zh-CN.md links to {target}, which does not exist"


def test_the_twins_quote_the_same_figures():
    en = _marked_figures("README.md")
    assert en and any("150.2" in figures for _, figures in en)
    assert _marked_figures("README.zh-CN.md") == en


def test_the_chinese_readme_says_how_to_get_a_cjk_font():
    """Without a CJK font every character is a box: the note comes first, and says it in English too."""
    zh = _read("README.zh-CN.md")
    note = zh[: zh.index("\n## ")]
    assert "fonts-noto-cjk" in note and "Chinese characters show as boxes" in note
