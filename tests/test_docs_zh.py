"""Every English page under docs/ has a Chinese twin, ``page.zh.md``, kept in step with it.

The site's readers are Chinese-speaking (the two blog posts attnlab grew from are in Chinese), so the
Chinese site is the whole site, not a sample. A twin is written as Chinese, not translated line by
line, but it must not drift from its English page. What "in step" means here:

* **sections**: the same headings, at the same levels, in the same order, with the same anchors (a
  Chinese heading carries the English one's id, ``## 安装 {#install}``, so a link to
  ``page.md#install`` works in both languages);
* **code**: the same fenced blocks, byte for byte, comments inside them included. A block is what the
  reader runs or compares with a terminal (several run at build time and print the page's outputs), so
  it stays as the English page has it; only the prose around it is Chinese;
* **figures**: every number with a unit or a percent sign in the English prose (``3.2 ms``, ``1.50x``,
  ``93%``, ``24 GiB``) appears in the twin, so a re-measured page cannot keep an old figure in Chinese.
  Chinese units count as their English ones (``3 秒`` is ``3 s``, ``1.5 倍`` is ``1.5x``);
* **no stray spaces**: a browser turns a line break inside a paragraph into a space, which between two
  Chinese characters (or next to Chinese punctuation) reads as a gap. A Chinese paragraph or list item
  is written on one line (mkdocs and pymdownx have no extension that joins CJK lines; a source rule is
  simpler and also holds on GitHub), and no literal space stands between two Chinese characters once
  the markup is gone (``见[注意力变体](...)``, ``**结论**。接着``);
* **the words of the posts**: the two blog posts are 博文 000 and 博文 002, never 种子 (a random seed).

Also checked: the Chinese navigation has a title for every section, the home page and README.zh-CN.md
say first how to get a CJK font (in English too: a reader who sees boxes cannot read the Chinese), and
the site's CSS names a CJK font after Material's Latin ones.

A twin that falls behind its English page after the English code changes can be brought back with
``python tests/test_docs_zh.py --sync-code``: it copies each English block over the twin's block of the
same number (only when both have the same number of blocks; the prose is for a person to update).
"""

from __future__ import annotations

import itertools
import re
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
ENGLISH = sorted(p for p in DOCS.rglob("*.md") if not p.name.endswith(".zh.md"))
TWINS = sorted(DOCS.rglob("*.zh.md"))

# a fenced block: its opening fence at a line's start (as tests/test_docs_site.py reads them)
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*$")
EXPLICIT_ID = re.compile(r"\s*\{[^}]*#([\w-]+)[^}]*\}\s*$")
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
CODE_SPAN = re.compile(r"`+[^`]*`+")  # a code span may run over a line break
LINK_TARGET = re.compile(r"\]\([^)]*\)")
# a number then a unit: the unit list is what the English pages measure in (s, min and h after a space:
# "0s and 1s" are zeros and ones)
FIGURE = re.compile(
    r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)(?:(x|%)|\s?(GiB|MiB|KiB|GB/s|GB|MB|tokens/s|tok/s|µs|us|ms|ns"
    r"|秒|毫秒|微秒|分钟|分|小时|倍)|\s(s|min|h))(?![\w/])"
)
CHINESE_UNITS = {"秒": "s", "毫秒": "ms", "微秒": "µs", "us": "µs", "分钟": "min", "分": "min", "小时": "h", "倍": "x"}
# a line that starts a new block rather than continuing the paragraph above it
BLOCK_START = re.compile(r"^\s*(?:[-*+]\s|\d+\.\s|\||#|>|<!--|!!!|\?\?\?|:::|`{3})")


def twin_of(page: Path) -> Path:
    return page.with_name(page.name.removesuffix(".md") + ".zh.md")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """``(1-based line, line)`` for every line outside fenced code blocks."""
    out, fence = [], ""
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence) and stripped.strip("`") == "":
                fence = ""
            continue
        m = re.match(r"(`{3,})", stripped)
        if m:
            fence = m.group(1)
            continue
        out.append((number, line))
    return out


def _slugify(text: str) -> str:
    """Python-Markdown's default toc slug (markdown.extensions.toc.slugify), for a heading's plain text."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _plain(heading: str) -> str:
    """A heading's text as the reader sees it: links and code marks dropped."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return heading.replace("`", "").replace("*", "")


def headings(path: Path) -> list[tuple[int, str]]:
    """``(level, id)`` of every heading of ``path`` outside code, in order; ids made unique as toc does."""
    found, seen = [], set()
    for _, line in _prose_lines(path.read_text("utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        text = m.group(2)
        explicit = EXPLICIT_ID.search(text)
        if explicit:
            anchor = explicit.group(1)
        else:
            base = anchor = _slugify(_plain(text))
            n = 0
            while anchor in seen:
                n += 1
                anchor = f"{base}_{n}"
        seen.add(anchor)
        found.append((len(m.group(1)), anchor))
    return found


def code_blocks(path: Path) -> list[tuple[str, str]]:
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(path.read_text("utf-8"))]


# a mkdocstrings entry (reference/api.md): the `::: dotted.name` line and its indented options
API_ENTRY = re.compile(r"^::: .*\n(?:[ \t]+.*\n)*", re.MULTILINE)


def api_entries(path: Path) -> list[str]:
    """The page's ``::: name`` entries with their options, in order: each is code the build runs."""
    return API_ENTRY.findall(path.read_text("utf-8"))


def figures(text: str) -> set[str]:
    """Every number-with-unit of a page's prose (tables and headings included, code and comments not)."""
    prose = "\n".join(line for _, line in _prose_lines(COMMENT.sub("", text)))
    prose = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", prose))
    out = set()
    for m in FIGURE.finditer(prose):
        unit = m.group(2) or m.group(3) or m.group(4)
        out.add(m.group(1) + CHINESE_UNITS.get(unit, unit))
    return out


CJK = "[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]"
CJK_PUNCTUATION = "[\u3000-\u303f\uff00-\uffef]"


def _is_cjk(char: str) -> bool:
    return bool(re.match(r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]", char))


def _is_cjk_punctuation(char: str) -> bool:
    return bool(re.match(r"[\u3000-\u303f\uff00-\uffef]", char))


def stray_spaces(text: str) -> list[int]:
    """Lines whose break inside a paragraph the browser would show as a stray space in Chinese text.

    A break between two Chinese characters, or next to Chinese punctuation, is one; a break between
    Chinese and Latin text is the space the pages put there anyway.
    """
    lines = _prose_lines(text)
    bad = []
    for (number, line), (next_number, following) in itertools.pairwise(lines):
        if next_number != number + 1 or not line.strip() or not following.strip() or BLOCK_START.match(following):
            continue
        if HEADING.match(line) or line.lstrip().startswith(("|", "<!--")):
            continue
        before, after = line.rstrip()[-1], following.lstrip()[0]
        if (_is_cjk(before) and _is_cjk(after)) or _is_cjk_punctuation(before) or _is_cjk_punctuation(after):
            bad.append(number)
    return bad


@pytest.mark.parametrize("page", ENGLISH, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_english_page_has_a_chinese_twin(page: Path) -> None:
    assert twin_of(page).is_file(), f"{page.relative_to(REPO)} has no Chinese twin {twin_of(page).name}"


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_twin_is_in_step_with_its_english_page(twin: Path) -> None:
    english = twin.with_name(twin.name.removesuffix(".zh.md") + ".md")
    where = twin.relative_to(REPO)
    assert english.is_file(), f"{where} is the twin of {english.name}, which does not exist"
    assert headings(twin) == headings(english), f"{where}: sections (level, id) differ from {english.name}"
    en_code, zh_code = code_blocks(english), code_blocks(twin)
    assert len(zh_code) == len(en_code), f"{where}: {len(zh_code)} code blocks, {english.name} has {len(en_code)}"
    for number, (en, zh) in enumerate(zip(en_code, zh_code, strict=True), 1):
        assert zh == en, f"{where}: code block {number} differs from {english.name}'s (run --sync-code)"
    assert api_entries(twin) == api_entries(english), (
        f"{where}: its `::: name` API entries differ from {english.name}'s"
    )
    missing = figures(english.read_text("utf-8")) - figures(twin.read_text("utf-8"))
    assert not missing, f"{where}: figures of {english.name} missing: {sorted(missing)}"


@pytest.mark.parametrize("page", [*TWINS, REPO / "README.zh-CN.md"], ids=lambda p: p.name)
def test_chinese_paragraphs_have_no_hard_line_breaks(page: Path) -> None:
    bad = stray_spaces(page.read_text("utf-8"))
    assert not bad, f"{page.relative_to(REPO)}: a line break inside Chinese text (a stray space) after lines {bad}"


def stray_literal_spaces(text: str) -> list[str]:
    """Spaces the reader sees inside Chinese text, and bold that CommonMark would not close.

    Markup is what the reader does not see: a space between ``见`` and ``[注意力变体](...)`` still shows
    between two characters. After Chinese punctuation no space is wanted at all, and ``**结论。**接着``
    is not bold on GitHub (a closing ``**`` after punctuation needs a space or punctuation after it), so
    the pages write ``**结论**。接着``.
    """
    found = []
    for _, line in _prose_lines(text):
        if HEADING.match(line):
            continue
        shown = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", CODE_SPAN.sub("`x`", line))
        found += re.findall(f"{CJK}(?:\\*\\*?)? +(?:\\*\\*?)?{CJK}", shown)
        found += re.findall(f"{CJK_PUNCTUATION}(?:\\*\\*?)? +\\S", shown)
        closers = [m for k, m in enumerate(re.finditer(r"\*\*", shown)) if k % 2]
        found += [shown[m.start() - 1 : m.end() + 1] for m in closers if _closes_after_punctuation(shown, m)]
    return found


def _closes_after_punctuation(shown: str, closer: re.Match[str]) -> bool:
    before, after = shown[closer.start() - 1 : closer.start()], shown[closer.end() : closer.end() + 1]
    return _is_cjk_punctuation(before) and bool(after) and not after.isspace() and not _is_cjk_punctuation(after)


@pytest.mark.parametrize("page", [*TWINS, REPO / "README.zh-CN.md"], ids=lambda p: p.name)
def test_chinese_text_has_no_stray_spaces(page: Path) -> None:
    bad = stray_literal_spaces(page.read_text("utf-8"))
    assert not bad, (
        f"{page.relative_to(REPO)}: spaces inside Chinese text (or bold closed after punctuation): {bad[:5]}"
    )


@pytest.mark.parametrize("page", [*TWINS, REPO / "README.zh-CN.md"], ids=lambda p: p.name)
def test_the_posts_are_called_posts_not_seeds(page: Path) -> None:
    """``seed 000`` is the first blog post; 种子 reads as a random seed, so the Chinese pages say 博文."""
    prose = CODE_SPAN.sub(" ", "\n".join(line for _, line in _prose_lines(page.read_text("utf-8"))))
    wrong = re.findall(r"(?:种子|[Ss]eeds?)\s*00[02]", prose)
    assert not wrong, f"{page.relative_to(REPO)} calls a blog post {wrong[0]!r}: write 博文 000 / 博文 002"


def test_the_chinese_navigation_is_chinese() -> None:
    config = yaml.load((REPO / "mkdocs.yml").read_text("utf-8"), Loader=yaml.BaseLoader)
    zh = next(lang for lang in _i18n(config)["languages"] if lang["locale"] == "zh")
    translations = zh["nav_translations"]
    titles = _nav_titles(config["nav"])
    untranslated = [t for t in titles if t not in translations and re.search(r"[A-Za-z]{4}", t)]
    assert not untranslated, f"nav titles without a Chinese translation: {untranslated}"
    english_marked = [v for v in translations.values() if "英文" in v]
    assert not english_marked, f"the Chinese nav still marks sections as English: {english_marked}"


def test_no_chinese_page_calls_a_linked_page_english() -> None:
    """Every page has a twin now, so a link the site resolves to the Chinese page is never marked (英文)."""
    marked = [p.relative_to(REPO).as_posix() for p in TWINS if "（英文" in p.read_text("utf-8")]
    assert not marked, f"pages that still mark a link as English: {marked}"


def test_the_chinese_home_page_says_how_to_get_a_cjk_font() -> None:
    home = (DOCS / "index.zh.md").read_text("utf-8")
    note = home[: home.index("\n## ")]  # before the first section: a reader who sees boxes reads no further
    assert "fonts-noto-cjk" in note and "Chinese characters show as boxes" in note


def test_the_site_names_a_cjk_font_after_the_latin_ones() -> None:
    """Material's font stack (theme.font: false) is Latin only; docs/stylesheets/cjk.css extends it."""
    config = yaml.load((REPO / "mkdocs.yml").read_text("utf-8"), Loader=yaml.BaseLoader)
    assert "stylesheets/cjk.css" in config.get("extra_css", []), "mkdocs.yml does not load stylesheets/cjk.css"
    css = (DOCS / "stylesheets" / "cjk.css").read_text("utf-8")
    stack = re.search(r"--md-text-font-family:([^;]+);", css)
    assert stack, "docs/stylesheets/cjk.css sets no --md-text-font-family"
    fonts = [f.strip().strip('"') for f in stack.group(1).split(",")]
    assert fonts.index("Arial") < fonts.index("PingFang SC") < fonts.index("sans-serif")
    assert {"Microsoft YaHei", "Noto Sans CJK SC"} <= set(fonts)


def test_the_stray_space_rule_finds_breaks() -> None:
    text = "第一行在这里\n接着写。\n\n中文 `code`\nand English\n\n```\n中\n文\n```\n- 列表\n- 第二项，\n  接着"
    assert stray_spaces(text) == [1, 12]


def test_the_literal_space_rule_finds_spaces() -> None:
    text = "见 [注意力变体](variants.md)。\n\n**结论。**接着，\n\n**结论**。接着 `code` 中文\n\n句号。 Ctrl-C"
    assert stray_literal_spaces(text) == ["见 注", "。**接", "。 C"]


def test_the_figures_rule_reads_units() -> None:
    assert figures("took 3.2 ms, 1.50x faster, 93% of 24 GiB in 2 s, `12 ms` in code, 0s and 1s") == {
        "3.2ms",
        "1.50x",
        "93%",
        "24GiB",
        "2s",
    }
    assert figures("用了 3.2 毫秒，快 1.50 倍") == {"3.2ms", "1.50x"}


def _i18n(config: dict) -> dict:
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "i18n" in plugin:
            return plugin["i18n"]
    raise AssertionError("mkdocs.yml has no i18n plugin")


def _nav_titles(nav: object) -> list[str]:
    if isinstance(nav, dict):
        return [t for k, v in nav.items() for t in [k, *_nav_titles(v)]]
    if isinstance(nav, list):
        return [t for v in nav for t in _nav_titles(v)]
    return []


def sync_code(pages: list[Path] = ENGLISH) -> list[str]:
    """Copy each English page's code blocks over its twin's, block by block; what was done, one line a page.

    Only where both have the same number of blocks: a block added or removed needs its prose too.
    """
    done = []
    for page in pages:
        twin = twin_of(page)
        if not twin.is_file():
            continue
        en = list(FENCE.finditer(page.read_text("utf-8")))
        text = old = twin.read_text("utf-8")
        zh = list(FENCE.finditer(text))
        if len(en) != len(zh):
            done.append(f"{twin.name}: {len(zh)} code blocks, {page.name} has {len(en)}: update it by hand")
            continue
        for en_block, zh_block in reversed(list(zip(en, zh, strict=True))):
            text = text[: zh_block.start()] + en_block.group(0) + text[zh_block.end() :]
        if text != old:
            twin.write_text(text, "utf-8")
            done.append(f"{twin.name}: code blocks copied from {page.name}")
    return done


def test_sync_code_copies_the_english_blocks_and_leaves_the_prose(tmp_path: Path) -> None:
    english, twin = tmp_path / "page.md", tmp_path / "page.zh.md"
    english.write_text("Run it:\n\n```bash\nattnlab demo --new\n```\n\nThen:\n\n```\nout 2\n```\n", "utf-8")
    twin.write_text("运行：\n\n```bash\nattnlab demo\n```\n\n然后：\n\n```\nout 1\n```\n", "utf-8")
    assert sync_code([english]) == ["page.zh.md: code blocks copied from page.md"]
    assert twin.read_text("utf-8") == "运行：\n\n```bash\nattnlab demo --new\n```\n\n然后：\n\n```\nout 2\n```\n"
    assert code_blocks(twin) == code_blocks(english) and sync_code([english]) == []
    english.write_text("```\none block\n```\n", "utf-8")
    assert sync_code([english]) == ["page.zh.md: 2 code blocks, page.md has 1: update it by hand"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--sync-code"]:
        sys.exit("usage: python tests/test_docs_zh.py --sync-code")
    print("\n".join(sync_code()) or "every twin's code blocks already match")
