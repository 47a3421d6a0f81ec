"""Building the documentation site for the tests: one strict ``mkdocs build``, as ``make docs`` runs it.

``tests/conftest.py`` turns :func:`build_site` into the session fixture ``built``, so the file tests
(tests/test_docs_site.py) and the browser tests (tests/test_docs_browser.py) read the same build.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "mkdocs.yml"
DOCS_INSTALL = "pip install -c constraints.txt -e '.[docs]'"

# what mkdocs.yml loads: mkdocs, its theme and plugins
DOCS_MODULES = (
    "mkdocs",
    "material",
    "mkdocstrings",
    "mkdocstrings_handlers.python",
    "mkdocs_static_i18n",
    "markdown_exec",
)


def missing_docs_modules() -> list[str]:
    """The modules of :data:`DOCS_MODULES` this environment cannot import."""
    missing = []
    for name in DOCS_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # the parent package of a dotted name is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def build_site(site: Path) -> str:
    """``mkdocs build --strict`` into ``site``; the build's log (stdout and stderr together).

    Raises AssertionError with the end of the log when the build fails.
    """
    # Material's banner about its end of life is not a build problem
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(CONFIG), "-d", str(site)],
        capture_output=True,
        text=True,
        env=env,
        cwd=site.parent,  # not the repository: mkdocs.yml's paths must hold from anywhere
        # a hang guard, not a speed goal: about a minute of CPU time, but 5 min on 2 cores shared with other jobs
        timeout=1200,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{log[-6000:]}"
    return log
