"""MkDocs hooks for attnlab's site (mkdocs.yml `hooks:`): what an offline site needs changed.

* Material puts one ``<link rel="alternate" hreflang=...>`` per language in each page's head, and its
  script fetches ``sitemap.xml`` *beside* each of those links to map pages across languages. With
  mkdocs-static-i18n those links point at the page itself in each language (``learn/shapes.html``,
  ``zh/learn/shapes.html``), so the script asked for ``learn/sitemap.xml`` and ``zh/learn/sitemap.xml``,
  which do not exist: a 404 in the console of every page. The language switch in the header already
  links to the same page in the other language, so the head links are dropped.
* ``site_url`` is unset (the site is read from disk or any host), so MkDocs' sitemap would list
  ``None/index.html``-style addresses; a sitemap of wrong addresses is worse than none, so it is not
  written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

HEAD_ALTERNATE = re.compile(r'\s*<link rel="alternate" href="[^"]*" hreflang="[^"]*">')


def on_post_page(output: str, page: Any, config: Any) -> str:
    return HEAD_ALTERNATE.sub("", output)


def on_post_build(config: Any) -> None:
    for name in ("sitemap.xml", "sitemap.xml.gz"):
        Path(config["site_dir"], name).unlink(missing_ok=True)
