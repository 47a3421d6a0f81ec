"""The documentation site in a real browser: pages render, search and the language switch work, offline.

The site is the one strict build the docs tests share (the session fixture ``built``, tests/conftest.py),
served from 127.0.0.1 by a ``http.server`` in a thread, as a reader of a hosted copy reads it. Headless Chromium is Debian's ``chromium`` driven by
Playwright's Python API, as in tests/test_inspect_page.py; without it, Playwright or the ``docs`` extra
the tests skip with the install command as the reason.

Every page opens in a fresh browser context that records each request it makes (``context.on
("request")``, which sees the search worker's too) and refuses any that is not for the local server, and
each console error or uncaught exception; a test fails naming the URL or the message.

``ATTNLAB_DOCS_SHOTS=DIR`` also copies the screenshots of the home page and of a Learn page (always
written to the test's tmp dir) into DIR, to look at them.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from chromium import launch_chromium

SHOTS_VARIABLE = "ATTNLAB_DOCS_SHOTS"
# the same switches as a CI browser: no sandbox (containers), no GPU, nothing fetched behind the page's back
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--no-first-run",
    "--metrics-recording-only",
]
TIMEOUT_MS = 20_000  # two busy cores: Material's search worker can take a few seconds to index
# the pages that must render; screenshot: the file name for the ones the lead looks at
PAGES = {
    "index.html": "home.png",
    "learn/shapes.html": "learn-shapes.png",
    "howto/check.html": None,
    "reference/api.html": None,
    "zh/learn/shapes.html": None,
}

pytestmark = pytest.mark.slow  # the shared strict build (about a minute of CPU) and a browser


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch_chromium(CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def server(built: tuple[Path, str], browser: Any) -> Iterator[str]:
    """The built site served on 127.0.0.1 (a free port) for the module: its root URL, ending in ``/``."""
    site, _ = built
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(site)))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@dataclass
class Opened:
    page: Any
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions
    requests: list[str] = field(default_factory=list)  # every URL the page or its workers asked for
    external: list[str] = field(default_factory=list)  # those not for the local server (refused)

    def on_console(self, msg: Any) -> None:
        if msg.type != "error":
            return
        url = (msg.location or {}).get("url", "")
        # a 404 is an error too: Material used to ask for a sitemap.xml beside each language link
        # (scripts/docs_hooks.py says why it no longer does)
        self.errors.append(f"{msg.text}: {url}" if msg.text.startswith("Failed to load resource") else msg.text)

    def assert_clean(self, what: str) -> None:
        assert not self.external, f"{what} asked for something outside 127.0.0.1: {self.external}"
        assert not self.errors, f"{what} logged errors in the console: {self.errors}"


@pytest.fixture
def open_page(browser: Any, server: str) -> Iterator[Callable[[str], Opened]]:
    """``open_page("learn/shapes.html")``: the page in a fresh 1280x900 context, loaded and its network quiet."""
    local = urlsplit(server).netloc
    contexts = []

    def opener(path: str) -> Opened:
        context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
        context.set_default_timeout(TIMEOUT_MS)
        contexts.append(context)
        page = context.new_page()
        opened = Opened(page)

        def local_only(url: str) -> bool:
            parts = urlsplit(url)
            return parts.scheme in ("data", "blob", "about") or (parts.scheme == "http" and parts.netloc == local)

        def on_request(request: Any) -> None:
            opened.requests.append(request.url)
            if not local_only(request.url):
                opened.external.append(request.url)

        def route(r: Any) -> None:
            if local_only(r.request.url):
                r.continue_()
            else:
                r.abort()

        context.on("request", on_request)
        context.route("**/*", route)
        page.on("console", opened.on_console)
        page.on("pageerror", lambda err: opened.errors.append(str(err)))
        page.goto(server + path, wait_until="networkidle")
        return opened

    yield opener
    for context in contexts:
        context.close()


def _save_shot(page: Any, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot in the test's tmp dir, copied into $ATTNLAB_DOCS_SHOTS when that is set."""
    shot = page.screenshot(path=str(tmp_path / name), full_page=True)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get(SHOTS_VARIABLE)
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy2(tmp_path / name, Path(target) / name)
    return tmp_path / name


@pytest.mark.parametrize("path", list(PAGES))
def test_page_renders_offline_without_errors(open_page: Callable[[str], Opened], path: str, tmp_path: Path) -> None:
    opened = open_page(path)
    page = opened.page
    h1 = page.locator(".md-content h1").first
    assert h1.is_visible(), f"{path}: the page's h1 is not visible"
    assert h1.inner_text().strip(), f"{path}: the page's h1 is empty"
    if path == "reference/api.html":
        heading = page.locator('[id="attnlab.MultiHeadAttention"]')
        assert heading.count() == 1, "reference/api.html has no MultiHeadAttention heading"
        assert heading.evaluate("e => e.tagName") in {"H1", "H2", "H3", "H4", "H5", "H6"}
        assert "MultiHeadAttention" in heading.inner_text()
    expected_lang = "zh" if path.startswith("zh/") else "en"
    assert page.get_attribute("html", "lang") == expected_lang
    if PAGES[path]:
        _save_shot(page, tmp_path, PAGES[path])
    assert any(url.endswith("/" + path) for url in opened.requests)  # the recorder saw the page itself
    opened.assert_clean(path)


def _search(open_page: Callable[[str], Opened], path: str, text: str) -> tuple[Opened, list[str]]:
    """Type ``text`` into the search box of ``path``; the links of the results, once some are shown."""
    opened = open_page(path)
    page = opened.page
    query = page.locator('input[data-md-component="search-query"]')
    opener = page.locator('label.md-header__button[for="__search"]')
    if opener.is_visible():  # a narrow window hides the box behind the header's magnifier
        opener.click()
    query.click()
    query.press_sequentially(text, delay=20)
    query.press("End")  # Chinese characters arrive as text input with no keyup, and the box searches on keyup
    page.locator(".md-search-result__item").first.wait_for(state="visible")
    return opened, page.eval_on_selector_all(".md-search-result__item a", "as => as.map(a => a.href)")


def test_search_finds_the_learn_page_offline(open_page: Callable[[str], Opened]) -> None:
    opened, links = _search(open_page, "index.html", "key_padding_mask")
    assert any("/learn/shapes.html" in link and "/zh/" not in link for link in links), links
    opened.assert_clean("searching key_padding_mask on index.html")


def test_search_finds_a_chinese_word_in_the_chinese_pages(open_page: Callable[[str], Opened]) -> None:
    """掩码 (mask) inside a sentence: found only because the index cuts Chinese text into words (jieba)."""
    opened, links = _search(open_page, "zh/index.html", "掩码")
    assert any("/zh/learn/" in link for link in links), links
    opened.assert_clean("searching 掩码 on zh/index.html")


def _switch_language(page: Any, lang: str) -> None:
    """Open the header's language selector and click the link to ``lang`` (Material's ``md-select``)."""
    page.locator(".md-header .md-select > button").click()
    link = page.locator(f'.md-header .md-select a.md-select__link[hreflang="{lang}"]')
    link.wait_for(state="visible")
    link.click()


def test_language_switch_goes_to_the_twin_and_back(open_page: Callable[[str], Opened], server: str) -> None:
    opened = open_page("learn/shapes.html")
    page = opened.page
    _switch_language(page, "zh")
    page.wait_for_url(server + "zh/learn/shapes.html")
    page.wait_for_load_state("networkidle")
    assert page.get_attribute("html", "lang") == "zh"
    assert page.locator(".md-content h1").first.inner_text().strip()
    _switch_language(page, "en")
    page.wait_for_url(server + "learn/shapes.html")
    page.wait_for_load_state("networkidle")
    assert page.get_attribute("html", "lang") == "en"
    assert re.search("shapes", page.locator(".md-content h1").first.inner_text(), re.IGNORECASE)
    opened.assert_clean("the language switch on learn/shapes.html")
