"""Debian's chromium driven by Playwright, for the browser tests (the heads page, the docs site).

Playwright's own browser download cannot work offline, so the tests use Debian's package; each test
module that needs a browser skips, naming the install command, when either piece is missing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

CHROMIUM_INSTALL = "apt-get install -y chromium"
PLAYWRIGHT_INSTALL = "pip install -c constraints.txt playwright"


def launch_chromium(args: Sequence[str] = ()) -> Iterator[Any]:
    """Yield a headless chromium (a Playwright ``Browser``) started with ``args``; closed after the yield."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(f"the playwright package is missing: {PLAYWRIGHT_INSTALL}")
    executable = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if executable is None:
        pytest.skip(f"Debian's chromium is missing: {CHROMIUM_INSTALL}")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=executable, headless=True, args=list(args))
        yield chromium
        chromium.close()
