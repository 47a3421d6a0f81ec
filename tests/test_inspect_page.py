"""The heads page (``attnlab.heads.page``) opened from disk in a real browser.

Headless Chromium is Debian's ``chromium`` package driven by Playwright's Python API (Playwright's own
browser download needs the network; the system executable does not). ``.ci/run`` installs chromium
when it is missing, so CI always runs these; elsewhere the browser tests skip with the install
command as the reason. One browser serves the whole module; each test opens its page in a fresh
context that refuses every request that is not ``file:`` or ``data:``.

Pages: a TinyGPT (2 layers x 4 heads, 24 tokens), a GQA Llama (4 query heads on 2 K/V heads, 3
left-padding tokens), a TinyGPT on 1,000 tokens under a 4 MiB budget (one full pattern fits) and
one on 5 tokens (every text score but entropy too short to tell).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.heads import HeadReport, inspect
from attnlab.heads.page import SHARP_SCORES, write_page
from attnlab.models.gpt import GPTConfig, TinyGPT
from attnlab.models.llama import Llama, LlamaConfig
from chromium import launch_chromium

LONG_T, LONG_BUDGET_MB = 1000, 4.0


def _report(model: torch.nn.Module, n_tokens: int, seed: int, **kwargs: Any) -> HeadReport:
    torch.manual_seed(seed)
    ids = torch.randint(1, 50, (n_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    return inspect(model, ids, probe_len=8, probe_batch=2, **kwargs)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[HeadReport, Path]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=4, n_embd=32))
    report = _report(model, 24, seed=1)
    return report, write_page(report, tmp_path_factory.mktemp("gpt") / "index.html")


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> tuple[HeadReport, Path]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64
    )
    report = _report(Llama(config), 17, seed=2, left_pad=3)
    return report, write_page(report, tmp_path_factory.mktemp("gqa") / "index.html")


@pytest.fixture(scope="module")
def long(tmp_path_factory: pytest.TempPathFactory) -> tuple[HeadReport, Path]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, block_size=1024, n_layer=2, n_head=4, n_embd=32))
    report = _report(model, LONG_T, seed=3)
    return report, write_page(report, tmp_path_factory.mktemp("long") / "index.html", budget_mb=LONG_BUDGET_MB)


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> tuple[HeadReport, Path]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=4, n_embd=32))
    report = _report(model, 5, seed=5)
    return report, write_page(report, tmp_path_factory.mktemp("short") / "index.html")


def _meta(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'id="attnlab-meta">(.*?)</script>', text).group(1))  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch_chromium()


@dataclass
class Opened:
    page: Any
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions
    external: list[str] = field(default_factory=list)  # requests to anything but file: and data:


@pytest.fixture
def open_page(browser: Any) -> Iterator[Any]:
    """``open_page(path)``: the page loaded from ``file://`` in a 1280x900 window, its script done."""
    contexts = []

    def opener(path: Path) -> Opened:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        contexts.append(context)
        page = context.new_page()
        opened = Opened(page)
        page.on("console", lambda msg: opened.errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda err: opened.errors.append(str(err)))

        def route(r: Any) -> None:
            if r.request.url.split(":", 1)[0] in ("file", "data"):
                r.continue_()
            else:
                opened.external.append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.goto(path.as_uri())
        page.wait_for_function("document.body.dataset.ready === 'true'")
        return opened

    yield opener
    for context in contexts:
        context.close()


def hover(page: Any, i: int, j: int) -> dict[str, str]:
    """Move the mouse over query row ``i``, key ``j`` of the open head; the hover box's weight attributes."""
    pos = page.evaluate("([i, j]) => window.attnlab.cellCenter(i, j)", [i, j])
    page.mouse.move(pos["x"], pos["y"])
    return page.eval_on_selector(
        "#hover-weight", "e => ({text: e.textContent, ...e.dataset, masked: e.dataset.masked || ''})"
    )


def open_head(page: Any, layer: int, head: int) -> None:
    page.click(f'.cell[data-layer="{layer}"][data-head="{head}"]')


# ---- without a browser ----


def test_page_is_self_contained(gpt: tuple[HeadReport, Path]) -> None:
    text = gpt[1].read_text(encoding="utf-8")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", text, re.IGNORECASE)
    assert "http://" not in text and "https://" not in text
    assert all("src" not in tag for tag in re.findall(r"<script\b[^>]*>", text)), "an external script"
    assert re.findall(r"<link\b[^>]*>", text) == ['<link rel="icon" href="data:,">']
    assert "url(" not in text and "@import" not in text


def test_embedded_pattern_is_the_weights(gpt: tuple[HeadReport, Path]) -> None:
    """Every head is embedded (small T); a pattern decodes to the lower triangle of its float32 weights."""
    report, path = gpt
    text = path.read_text(encoding="utf-8")
    meta = json.loads(re.search(r'id="attnlab-meta">(.*?)</script>', text).group(1))  # type: ignore[union-attr]
    assert meta["patterns"]["embedded"] == [[layer, head] for layer in range(2) for head in range(4)]
    b64 = json.loads(re.search(r'id="pattern-1-2">(.*?)</script>', text).group(1))  # type: ignore[union-attr]
    tri = torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.float32)
    rows, cols = torch.tril_indices(24, 24)
    assert torch.equal(tri, report.weights[1][2][rows, cols])


def test_budget_picks_the_strongest_heads_and_heads_forces_them(gpt: tuple[HeadReport, Path], tmp_path: Path) -> None:
    report, _ = gpt
    none = write_page(report, tmp_path / "none.html", budget_mb=0).read_text(encoding="utf-8")
    assert 'id="pattern-' not in none
    one_size = len(write_page(report, tmp_path / "x.html", heads=[(0, 0)]).read_bytes()) - len(none.encode())
    two = write_page(report, tmp_path / "two.html", budget_mb=(len(none.encode()) + 2.5 * one_size) / 2**20)
    text = two.read_text(encoding="utf-8")
    stored = sorted(tuple(map(int, m)) for m in re.findall(r'id="pattern-(\d+)-(\d+)"', text))
    sharp = torch.stack([report.scores[n] for n in SHARP_SCORES]).amax(dim=0)  # (L, H)
    strongest = sorted(((layer, head) for layer in range(2) for head in range(4)), key=lambda lh: -float(sharp[lh]))
    assert stored == sorted(strongest[:2])
    assert two.stat().st_size <= (len(none.encode()) + 2.5 * one_size)
    forced = write_page(report, tmp_path / "forced.html", budget_mb=0, heads=[(1, 3), (0, 1)])
    assert sorted(re.findall(r'id="pattern-(\d+-\d+)"', forced.read_text(encoding="utf-8"))) == ["0-1", "1-3"]
    with pytest.raises(ValueError, match=r"heads holds \(2, 0\), outside the model's 2 layers x 4 heads"):
        write_page(report, tmp_path / "bad.html", heads=[(2, 0)])


def test_save_writes_the_page(gpt: tuple[HeadReport, Path], tmp_path: Path) -> None:
    report, _ = gpt
    paths = report.save(tmp_path, page_budget_mb=0)
    assert paths["html"] == tmp_path / "index.html"
    text = paths["html"].read_text(encoding="utf-8")
    assert 'id="attnlab-meta"' in text and 'id="pattern-' not in text  # the budget reached write_page
    assert report.save(tmp_path / "no-page", page=False).keys() == {"json", "png"}


def test_short_text_scores_are_null_with_their_reason(short: tuple[HeadReport, Path]) -> None:
    report, path = short
    meta = _meta(path)
    assert set(meta["too_short"]) == {"prev_token", "sink", "diagonal", "distance", "uniformity"}
    assert meta["too_short"] == report.too_short and "at least 8 tokens" in meta["too_short"]["sink"]
    assert meta["scores"]["prev_token"] == [[None] * 4] * 2 and None not in meta["scores"]["entropy"][0]
    assert "undecided" in {k for row in meta["kinds"] for k in row}


# ---- in the browser ----


def test_loads_offline_without_errors_and_grid_has_every_head(open_page: Any, gpt: tuple[HeadReport, Path]) -> None:
    opened = open_page(gpt[1])
    assert opened.errors == [] and opened.external == []
    cells = opened.page.eval_on_selector_all(".cell", "cs => cs.map(c => [+c.dataset.layer, +c.dataset.head])")
    assert sorted(cells) == [[layer, head] for layer in range(2) for head in range(4)]
    assert opened.page.is_hidden("#detail")


def test_gqa_heads_are_grouped_by_kv_head(open_page: Any, gqa: tuple[HeadReport, Path]) -> None:
    opened = open_page(gqa[1])
    structure = opened.page.eval_on_selector_all(
        ".layer-row",
        "rows => rows.map(r => [...r.querySelectorAll('.kv-group')].map("
        "g => [+g.dataset.kv, [...g.querySelectorAll('.cell')].map(c => +c.dataset.head)]))",
    )
    assert structure == [[[0, [0, 1]], [1, [2, 3]]]] * 2  # 2 layers; query heads 0, 1 read K/V head 0
    assert opened.errors == []


def test_click_opens_that_head(open_page: Any, gpt: tuple[HeadReport, Path]) -> None:
    page = open_page(gpt[1]).page
    for layer, head in ((1, 2), (0, 3)):
        open_head(page, layer, head)
        assert page.is_visible("#detail")
        assert page.eval_on_selector("#detail", "d => [+d.dataset.layer, +d.dataset.head]") == [layer, head]
        assert page.inner_text("#detail-title").startswith(f"Layer {layer}, head {head} ")
        assert page.get_attribute(f'.cell[data-layer="{layer}"][data-head="{head}"]', "class") == "cell selected"


def test_hover_shows_the_exact_weight(open_page: Any, gpt: tuple[HeadReport, Path]) -> None:
    report, path = gpt
    page = open_page(path).page
    open_head(page, 1, 3)
    for i, j in ((5, 2), (23, 23), (17, 0), (12, 11)):
        shown = hover(page, i, j)
        expected = float(report.weights[1][3, i, j])
        assert (int(shown["query"]), int(shown["key"]), shown["masked"]) == (i, j, "")
        assert float(shown["weight"]) == pytest.approx(expected, rel=1e-6)
        assert float(shown["text"]) == pytest.approx(expected, rel=1e-6)


def test_future_keys_are_masked(open_page: Any, gpt: tuple[HeadReport, Path]) -> None:
    page = open_page(gpt[1]).page
    open_head(page, 0, 0)
    shown = hover(page, 2, 10)
    assert shown["masked"] == "future" and shown["text"].startswith("masked")


def test_padding_keys_and_fully_masked_rows(open_page: Any, gqa: tuple[HeadReport, Path]) -> None:
    """3 left-padding tokens: a real query sees them masked; a padding query's row sees nothing at all."""
    report, path = gqa
    page = open_page(path).page
    open_head(page, 1, 2)
    assert hover(page, 10, 1)["masked"] == "pad"
    assert hover(page, 1, 0)["masked"] == "row"
    assert hover(page, 1, 4)["masked"] == "future"
    shown = hover(page, 10, 3)  # the first real token
    assert shown["masked"] == ""
    assert float(shown["weight"]) == pytest.approx(float(report.weights[1][2, 10, 3]), rel=1e-6)
    legend = page.eval_on_selector_all("#legend [data-mask]", "ls => ls.map(l => l.dataset.mask)")
    assert legend == ["future", "row", "pad"]


def test_sorting_the_table_by_a_score(open_page: Any, gpt: tuple[HeadReport, Path]) -> None:
    report, path = gpt
    page = open_page(path).page

    def order() -> list[tuple[int, int]]:
        rows = page.eval_on_selector_all("#scores tbody tr", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.head])")
        return [tuple(r) for r in rows]

    assert order() == [(layer, head) for layer in range(2) for head in range(4)]
    values = {(layer, head): round(float(report.scores["entropy"][layer, head]), 6) for layer, head in order()}
    page.click('#scores th[data-key="entropy"]')
    assert page.get_attribute('#scores th[data-key="entropy"]', "aria-sort") == "descending"
    assert order() == sorted(values, key=lambda lh: (-values[lh], lh))
    page.click('#scores th[data-key="entropy"]')
    assert order() == sorted(values, key=lambda lh: (values[lh], lh))


def test_thousand_tokens_windowed_and_over_budget(open_page: Any, long: tuple[HeadReport, Path]) -> None:
    report, path = long
    assert path.stat().st_size <= LONG_BUDGET_MB * 2**20
    opened = open_page(path)
    page = opened.page
    assert opened.errors == []
    embedded = page.eval_on_selector_all(
        '.cell[data-embedded="true"]', "cs => cs.map(c => [+c.dataset.layer, +c.dataset.head])"
    )
    assert len(embedded) == 1  # one 1,000-token pattern is 2.7 MB of base64
    assert "not embedded" in page.inner_text("#embed-note")

    page.click('.cell[data-embedded="false"]')
    assert "not embedded" in page.inner_text("#detail-message")
    assert page.get_attribute("#detail", "data-embedded") == "false"

    layer, head = embedded[0]
    open_head(page, layer, head)
    assert page.inner_text("#detail-message") == ""
    window = page.eval_on_selector("#detail-window", "w => [+w.dataset.row1, +w.dataset.col1]")
    assert max(window) < LONG_T - 1  # a window, not all 1,000 rows
    assert page.evaluate("document.getElementsByTagName('*').length") < 2000  # canvas, not a node per cell
    assert page.evaluate("window.attnlab.timings.lastOpenMs") < 5000
    shown = hover(page, 999, 998)  # scrolled there
    assert float(shown["weight"]) == pytest.approx(float(report.weights[layer][head, 999, 998]), rel=1e-6)
    assert hover(page, 500, 900)["masked"] == "future"


def test_too_short_scores_read_as_such(open_page: Any, short: tuple[HeadReport, Path]) -> None:
    report, path = short
    opened = open_page(path)
    page = opened.page
    assert opened.errors == []
    note = page.inner_text("#short-note")
    assert note.startswith("Too short to tell on this text: ") and "prev_token" in note and "at least 16 tokens" in note
    cell = '#scores tbody tr[data-layer="1"][data-head="2"] td[data-key="{}"]'
    assert page.inner_text(cell.format("prev_token")) == "too short to tell"
    assert float(page.inner_text(cell.format("entropy"))) == pytest.approx(
        float(report.scores["entropy"][1, 2]), abs=1e-3
    )
    undecided = [(layer, head) for layer in range(2) for head in range(4) if report.kinds[layer][head] == "undecided"]
    badges = page.eval_on_selector_all('.cell[data-kind="undecided"] .badge', "bs => bs.map(b => b.textContent)")
    assert undecided and badges == ["?"] * len(undecided)
    assert "undecided (too short to tell)" in page.inner_text("#kind-legend")
    page.click('#scores th[data-key="sink"]')  # every value null: sorting keeps layer-head order, no error
    rows = page.eval_on_selector_all("#scores tbody tr", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.head])")
    assert rows == [[layer, head] for layer in range(2) for head in range(4)] and opened.errors == []


def test_keys_outside_a_sliding_window_are_masked(open_page: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=50, block_size=64, n_layer=2, n_head=4, n_embd=32))
    model.transformer.h[1].attn.window = 4  # layer 1 only: a Gemma-2-like alternation
    report = _report(model, 20, seed=4)
    assert report.windows == [None, 4]
    page = open_page(write_page(report, tmp_path / "index.html")).page
    open_head(page, 1, 0)
    assert hover(page, 12, 8)["masked"] == "future"  # 12 - 8 = 4 >= window: outside it
    inside = hover(page, 12, 9)
    assert inside["masked"] == "" and float(inside["weight"]) == pytest.approx(
        float(report.weights[1][0, 12, 9]), rel=1e-6
    )
    open_head(page, 0, 0)
    assert hover(page, 12, 8)["masked"] == ""  # layer 0 has no window
