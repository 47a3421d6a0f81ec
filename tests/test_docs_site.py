"""The documentation site (mkdocs.yml, docs/) builds strictly, offline, in both languages.

The session fixture ``built`` (tests/conftest.py, tests/docs_site.py) runs ``mkdocs build --strict``
once into a scratch directory, as ``make docs`` does; the tests then read what it wrote (and so do
the browser tests in tests/test_docs_browser.py). Every code block with ``exec="on"`` runs
during that build (markdown-exec), so a renamed function or a changed trace shows up here.
Skipped, with the command that installs them, when the ``docs`` extra is missing.
"""

from __future__ import annotations

import json
import re
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SOURCES = REPO / "docs"
# the Learn pages, in the nav's order; each has a Chinese twin, page.zh.md
LEARN_HTML = (
    "learn/shapes.html",
    "learn/why-each-line.html",
    "learn/errors.html",
    "learn/experiment.html",
    "learn/kv-cache.html",
    "learn/head-count.html",
    "learn/real-heads.html",
)
# every page with a Chinese twin, anywhere under docs/ (the Learn pages, the home page, guides)
TWINS = sorted(
    page.relative_to(SOURCES).with_suffix("").as_posix()
    for page in SOURCES.rglob("*.md")
    if not page.name.endswith(".zh.md") and page.with_suffix(".zh.md").is_file()
)
# the Learn pages among them, by name
LEARN_TWINS = [name.removeprefix("learn/") for name in TWINS if name.startswith("learn/")]

# the tags whose src/href the browser fetches by itself (an <a href> is only followed when clicked)
RESOURCE_ATTRS = {
    "script": ("src",),
    "link": ("href",),
    "img": ("src", "srcset"),
    "iframe": ("src",),
    "source": ("src", "srcset"),
    "video": ("src", "poster"),
    "audio": ("src",),
}
EXTERNAL = re.compile(r"^\s*(?:https?:)?//", re.IGNORECASE)
CSS_URL = re.compile(r"""(?:url\(\s*['"]?|@import\s+['"])\s*((?:https?:)?//[^'")\s]+)""", re.IGNORECASE)

pytestmark = pytest.mark.slow  # one strict build (shared with tests/test_docs_browser.py): about a minute of CPU


def test_strict_build_has_no_warnings(built: tuple[Path, str]) -> None:
    site, log = built
    warnings = [line for line in log.splitlines() if line.lstrip().startswith(("WARNING", "ERROR"))]
    assert not warnings, "the build logged:\n" + "\n".join(warnings)
    for page in ("index.html", *LEARN_HTML, "reference/api.html", "reference/cli.html"):
        assert (site / page).is_file(), f"the English site has no {page}"
    for page in ("index.html", *LEARN_HTML):
        assert (site / "zh" / page).is_file(), f"the Chinese site has no zh/{page}"
    for page in nav_pages():  # a page without a Chinese twin is shown in English on the Chinese site
        html = page.removesuffix(".md") + ".html"
        assert (site / html).is_file() and (site / "zh" / html).is_file(), f"{page} is in the nav but not built"


def nav_pages() -> list[str]:
    """Every page mkdocs.yml's nav lists, in order."""
    from test_readme_examples import _nav_pages

    return _nav_pages(yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)["nav"])


def test_a_newcomer_is_one_click_from_seed_000_and_from_checking_their_module(built: tuple[Path, str]) -> None:
    """The issue's goal: from the README and from the site's home page, one link to each."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start_here = readme[: readme.index("## Quick start")]
    for target in ("docs/learn/shapes.md", "docs/howto/check.md"):
        assert f"]({target})" in start_here, f"README's opening does not link {target}"
    site, _ = built
    for home in ("index.html", "zh/index.html"):
        html = (site / home).read_text(encoding="utf-8")
        for target in ("learn/shapes.html", "howto/check.html"):
            assert f'href="{target}"' in html, f"{home} does not link {target}"
    assert len(readme.splitlines()) <= 250, "the README is the front door: at most ~250 lines, the rest in docs/"


class _Resources(HTMLParser):
    """Collects (tag, attribute, value) of every resource reference in one page."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = RESOURCE_ATTRS.get(tag, ())
        for name, value in attrs:
            if name in wanted and value:
                self.found.append((tag, name, value))
        if tag != "a":
            self.found.extend(_css_urls(dict(attrs).get("style") or "", tag))

    def handle_data(self, data: str) -> None:
        if self.lasttag == "style":
            self.found.extend(_css_urls(data, "style"))


def _css_urls(css: str, where: str) -> list[tuple[str, str, str]]:
    return [(where, "url", url) for url in CSS_URL.findall(css)]


def test_no_resource_from_an_external_host(built: tuple[Path, str]) -> None:
    site, _ = built
    external = []
    pages = sorted(site.rglob("*.html"))
    assert pages
    for page in pages:
        parser = _Resources()
        parser.feed(page.read_text(encoding="utf-8"))
        for tag, attr, value in parser.found:
            urls = [part.strip().split(" ")[0] for part in value.split(",")] if attr == "srcset" else [value]
            external += [f"{page.relative_to(site)}: <{tag} {attr}={url!r}>" for url in urls if EXTERNAL.match(url)]
    for sheet in sorted(site.rglob("*.css")):
        external += [f"{sheet.relative_to(site)}: url({url})" for url in CSS_URL.findall(sheet.read_text("utf-8"))]
    assert not external, "the site fetches from other hosts (it must work offline):\n" + "\n".join(external)


def test_search_index_holds_the_api_words(built: tuple[Path, str]) -> None:
    site, _ = built
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    text = " ".join(doc["title"] + " " + doc["text"] for doc in index["docs"])
    assert "key_padding_mask" in text
    locations = {doc["location"].split("#")[0] for doc in index["docs"]}
    assert {"learn/shapes.html", "zh/learn/shapes.html"} <= locations, sorted(locations)
    # file:// pages read the index from the script the offline plugin writes beside it
    assert (site / "search" / "search_index.js").read_text(encoding="utf-8").startswith("var __index =")


FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.MULTILINE | re.DOTALL)


def _code_blocks(path: Path) -> list[tuple[str, str]]:
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(path.read_text(encoding="utf-8"))]


def test_every_learn_page_has_a_chinese_twin() -> None:
    english = {page.stem for page in (SOURCES / "learn").glob("*.md") if not page.name.endswith(".zh.md")}
    expected = english | {Path(page).stem for page in LEARN_HTML}
    assert expected <= set(LEARN_TWINS), f"Learn pages without a .zh.md twin: {sorted(expected - set(LEARN_TWINS))}"


# what markdown-exec printed: a result block has no language class (the source shown above it has one)
TIMED = "timed on the machine that built this page:"
RESULT = re.compile(r'<div class="highlight"><pre><span></span><code>(.*?)</code></pre>', re.DOTALL)


@pytest.mark.parametrize("name", TWINS)
def test_chinese_twin_shows_the_same_outputs(built: tuple[Path, str], name: str) -> None:
    """Same code is not enough: both builds of the page ran it, and each printed block must read the same."""
    site, _ = built

    def printed(page: str) -> list[str]:
        blocks = [unescape(re.sub(r"<[^>]+>", "", block)) for block in RESULT.findall((site / page).read_text("utf-8"))]
        # a block of timings says so on its first line: each build measures its own, so only its presence counts
        return [TIMED if block.startswith(TIMED) else block for block in blocks]

    english, chinese = printed(f"{name}.html"), printed(f"zh/{name}.html")
    assert english or not name.startswith("learn/"), f"{name}.html shows no printed output"
    assert chinese == english, f"{name}: the English and Chinese builds printed different outputs"


@pytest.mark.parametrize("name", TWINS)
def test_chinese_twin_shows_the_same_code(name: str) -> None:
    english = _code_blocks(SOURCES / f"{name}.md")
    chinese = _code_blocks(SOURCES / f"{name}.zh.md")
    # every page has a twin now, some with no code at all (tables, generated docstrings): a Learn page has code
    assert english or not name.startswith("learn/"), f"docs/{name}.md has no code block"
    assert len(chinese) == len(english), f"{len(english)} code blocks in English, {len(chinese)} in Chinese"
    for number, (en, zh) in enumerate(zip(english, chinese, strict=True), 1):
        assert zh == en, f"code block {number} differs between {name}.md and {name}.zh.md"
    if name.startswith("learn/"):
        assert all('exec="on"' in info for info, _ in english), f"every block on the {name} page runs at build time"


def test_chinese_pages_use_the_seeds_terms() -> None:
    pages = [SOURCES / "index.zh.md", *(SOURCES / "learn" / f"{name}.zh.md" for name in LEARN_TWINS)]
    text = "".join(page.read_text("utf-8") for page in pages)
    for term in ("多头注意力", "掩码", "头维度", "张量形状", "缩放点积注意力", "填充掩码", "因果掩码"):
        assert term in text, f"the Chinese pages never say {term}"


@pytest.mark.parametrize("page", ["learn/shapes.html", "zh/learn/shapes.html"])
def test_shapes_page_shows_the_real_trace(built: tuple[Path, str], page: str) -> None:
    site, _ = built
    html = (site / page).read_text(encoding="utf-8")
    # printed by trace while the site was built: the page's source has none of these strings
    for printed in (
        "MultiHeadAttention  (backend: math)",
        "[2, 8, 10, 8]",
        "[2, 8, 10, 10]",
        "scale by 1/sqrt(d) = 0.3536",
        "zero padded keys/values",
        "second sequence unchanged: True",
    ):
        assert printed in html, f"{page} lacks the trace output {printed!r}"
    source = (SOURCES / "learn" / "shapes.md").read_text(encoding="utf-8")
    assert "[2, 8, 10, 8]" not in source


def _page_text(site: Path, page: str) -> str:
    """The built page with its HTML entities decoded: printed quotes and '<=' read as printed."""
    return unescape((site / page).read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", ["learn/why-each-line.html", "zh/learn/why-each-line.html"])
def test_why_each_line_page_shows_what_each_line_prevents(built: tuple[Path, str], page: str) -> None:
    site, _ = built
    text = _page_text(site, page)
    for printed in (
        "RuntimeError: view size is not compatible with input tensor's size and stride",
        ".transpose(1, 2).contiguous().view(B, T_q, H * Dv)",  # read from attnlab's forward at build time
        "largest weight on the padded key: 0.0",
        "-inf fill: [nan, nan, nan, nan]",  # naive softmax over a fully masked row
        "-1e9 fill: [0.25, 0.25, 0.25, 0.25]",
        "first outputs of the padded sequence: tensor([0., 0., 0., 0.])",
    ):
        assert printed in text, f"{page} lacks the output {printed!r}"
    # attnlab's fully masked row, on both backends: zeros, no NaN, finite gradients
    for backend in ("math", "sdpa"):
        line = f"{backend}: padded sequence all zeros: True, any NaN: False, gradient finite: True"
        assert line in text, f"{page} lacks {line!r}"
    # without the scale the softmax saturates: the largest weight of a row grows
    scaled, unscaled = (float(w) for w in re.findall(r"mean largest weight (\d\.\d+)", text)[:2])
    assert unscaled > scaled + 0.3, (scaled, unscaled)
    sums = [float(x) for x in re.findall(r"then (?:softmax|mask): \[[^]]*\]  sum (\d\.\d+)", text)]
    assert sums[0] == 1.0 and sums[1] < 1.0, sums  # mask, then softmax vs softmax, then mask
    assert "tensor([0., 0., 0., 0.])" not in (SOURCES / "learn" / "why-each-line.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", ["learn/errors.html", "zh/learn/errors.html"])
def test_errors_page_prints_attnlabs_messages(built: tuple[Path, str], page: str) -> None:
    site, _ = built
    text = _page_text(site, page)
    # the start of each message attnlab raised while the site was built
    for printed in (
        "RuntimeError: view size is not compatible",  # PyTorch's own, for comparison
        "ValueError: query is on meta but the module's weights are on cpu; move one of them",
        "ValueError: key_padding_mask is on meta but the query is on cpu",
        "TypeError: query has dtype torch.float64 but the module's weights are torch.float32",
        "ValueError: query has shape (5, 16), an unbatched (T, embed_dim) input",
        "ValueError: embed_dim=64 is not divisible by num_heads=6",
        "(nearest: [4, 8])",
        "TypeError: attn_mask has dtype torch.int64; expected torch.bool",
        "ValueError: attn_mask is a float tensor holding only 0s and 1s",
        "TypeError: key_padding_mask has dtype torch.float32; expected torch.bool",
        "ValueError: attn_mask has shape (5, 6), which does not broadcast",
        "ValueError: key_padding_mask has shape (5, 2); expected (B, T_k) = (2, 5)",
        "ValueError: is_causal=True needs T_q <= T_k, got T_q=6 queries and T_k=5 keys",
        "first sequence all zeros: True  any NaN: False",
        "gradient finite: True",
    ):
        assert printed in text, f"{page} lacks the output {printed!r}"
    assert "nearest: [4, 8]" not in (SOURCES / "learn" / "errors.md").read_text(encoding="utf-8")


def test_cli_page_shows_each_commands_help(built: tuple[Path, str]) -> None:
    import contextlib
    import io

    from attnlab.cli import main

    listing = io.StringIO()
    with contextlib.redirect_stdout(listing), contextlib.suppress(SystemExit):
        main(["--help"])
    commands = re.search(r"usage: attnlab \[-h\] \{([a-z,-]+)\}", listing.getvalue())[1].split(",")
    assert {"trace", "check", "bench-decode", "train", "inspect"} <= set(commands), listing.getvalue()
    site, _ = built
    html = _page_text(site, "reference/cli.html")
    for command in commands:
        assert f"usage: attnlab {command} [-h]" in html, f"reference/cli.html lacks `attnlab {command} --help`"


def test_api_page_documents_the_classes(built: tuple[Path, str]) -> None:
    site, _ = built
    html = (site / "reference" / "api.html").read_text(encoding="utf-8")
    for anchor in (
        'id="attnlab.MultiHeadAttention"',
        'id="attnlab.MultiHeadAttention.forward"',
        'id="attnlab.quant.QuantLinear"',
    ):
        assert anchor in html, f"reference/api.html has no {anchor}"
    roles = re.findall(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>", html)
    assert not roles, f"reference/api.html shows {len(roles)} Sphinx roles as text (scripts/docs_sphinx_roles.py)"


def test_sphinx_roles_become_code_spans() -> None:
    from conftest import load_script

    plain = load_script("docs_sphinx_roles").plain_roles
    assert plain("an :class:`attnlab.TinyGPT` or :func:`~attnlab.core.masks.causal`") == (
        "an `attnlab.TinyGPT` or `causal`"
    )
    assert plain("``x`` and :py:meth:`Module.forward`") == "``x`` and `Module.forward`"


@pytest.mark.parametrize("page", ["learn/experiment.html", "zh/learn/experiment.html"])
def test_experiment_page_shows_the_loss_falling_and_gradcheck_passing(built: tuple[Path, str], page: str) -> None:
    site, _ = built
    text = _page_text(site, page)
    assert "vocabulary: 13 characters; samples: (199, 16)" in text, f"{page} lacks the dataset's size"
    # the training loop's lines, printed while the site was built: step 0, 10, ..., 50 and the last
    logged = [(int(step), float(loss)) for step, loss in re.findall(r"step +(\d+)  loss (\d+\.\d+)", text)]
    assert [step for step, _ in logged] == [0, 10, 20, 30, 40, 50, 59], logged
    losses = [loss for _, loss in logged]
    assert losses[-1] < losses[0] / 2, f"{page}: the loss did not fall: {losses}"
    assert losses[0] > 2.0, f"{page}: the first loss should be near or above ln(13) = 2.565: {losses}"
    for case in ("no mask", "causal", "key_padding_mask"):
        line = f"gradcheck, {case}: True"
        assert line in text, f"{page} lacks {line!r}"
    assert "step 59  loss" not in (SOURCES / "learn" / "experiment.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", ["learn/kv-cache.html", "zh/learn/kv-cache.html"])
def test_kv_cache_page_shows_cached_equals_recomputed(built: tuple[Path, str], page: str) -> None:
    site, _ = built
    text = _page_text(site, page)
    # the cache's (B, H_kv, S, D) as it fills: a prefill of 3 positions, then one per step
    assert "cache buffers: (1, 2, 8, 8) = (B, H_kv, max_len, D)" in text, f"{page} lacks the cache's shape"
    for filled in (3, 4, 5, 6):
        assert f"filled {filled}  keys attended (1, 2, {filled}, 8)" in text, f"{page} lacks the fill {filled}"
    assert "caches: 2 layers, each k and v (1, 4, 14, 8)" in text
    for label in ("cached - full", "cached logits - recomputed logits"):
        found = re.findall(rf"max \|{re.escape(label)}\|: (\d\.\de[-+]\d+)", text)
        assert len(found) == 1, f"{page} lacks the printed value of max |{label}|"
        assert float(found[0]) < 1e-5, f"{page}: cached and recomputed differ by {found[0]}"
    # the work saved, counted in positions: prefill T = 8, then 1 per step instead of the whole sequence
    assert "step 0  sequence  8  positions run: cached 8, recomputed 8" in text
    assert "step 5  sequence 13  positions run: cached 1, recomputed 13" in text
    assert "positions run in all: cached 13, recomputed 63" in text
    assert "recomputed 63" not in (SOURCES / "learn" / "kv-cache.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("name", ["experiment", "kv-cache"])
def test_new_chinese_learn_pages_each_use_the_seeds_terms(name: str) -> None:
    text = (SOURCES / "learn" / f"{name}.zh.md").read_text("utf-8")
    for term in ("多头注意力", "掩码", "头维度", "张量形状", "缩放点积注意力", "填充掩码", "因果掩码"):
        assert term in text, f"docs/learn/{name}.zh.md never says {term}"


@pytest.mark.parametrize("page", ["learn/head-count.html", "zh/learn/head-count.html"])
def test_head_count_page_shows_the_same_parameters_and_flops_at_every_head_count(
    built: tuple[Path, str], page: str
) -> None:
    site, _ = built
    text = _page_text(site, page)
    # heads, head_dim, parameters, ..., matmul FLOPs: one row per head count, printed by the build
    rows = re.findall(r"^ +(\d) +(\d+) +([\d,]+) +\[.*\] +\[.*\] +[\d.]+ +([\d,]+)$", text, re.MULTILINE)
    assert [(int(h), int(d)) for h, d, _, _ in rows] == [(1, 64), (2, 32), (4, 16), (8, 8)], rows
    assert len({params for _, _, params, _ in rows}) == 1 and len({flops for *_, flops in rows}) == 1, rows
    assert "attnlab: error: --heads 3 does not divide" in text and "exit code: 2" in text
    assert "1,310,720" not in (SOURCES / "learn" / "head-count.md").read_text(encoding="utf-8")  # printed, not pasted


@pytest.mark.parametrize("page", ["learn/real-heads.html", "zh/learn/real-heads.html"])
def test_real_heads_page_shows_heads_learning_to_copy(built: tuple[Path, str], page: str) -> None:
    site, _ = built
    text = re.sub(r"<[^>]+>", "", _page_text(site, page))  # the printed lines, without the highlighting's spans
    before, after = text.split("\nuntrained: ", 1)[1].split("\nafter 60 steps", 1)

    def kinds(printed: str) -> list[str]:
        return re.findall(r"^  L0\.H\d  (\w+) ", printed, re.MULTILINE)

    assert kinds(before) == ["uniform", "uniform"], before[:400]
    assert kinds(after.split("\n\n")[0]) == ["duplicate", "duplicate"], after[:400]
