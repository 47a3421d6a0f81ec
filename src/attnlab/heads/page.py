"""``index.html``: one self-contained page to browse every head of a :class:`~attnlab.heads.report.HeadReport`.

The page opens from disk with no network: its CSS and JS (``page.css``, ``page.js`` next to this
file) are inlined, and its data is embedded in ``<script type="application/json">`` tags:

* ``#attnlab-meta``: the model, tokens, masks, scores and kinds, and one thumbnail per head;
* ``#pattern-{l}-{h}``: the full float32 pattern of head ``h`` of layer ``l`` (lower triangle
  only, row after row, little-endian, base64), for the heads that fit the page budget.

Notation: L layers, H query heads, G K/V heads, T tokens; ``i`` is a query row, ``j`` a key column.

Thumbnails are ``S x S`` with ``S = min(T, 48)``, each pixel the max weight over its bin of rows and
keys (the bins of :func:`torch.nn.functional.adaptive_max_pool2d`), stored as one byte code:
``0..250`` is ``round(250 * sqrt(weight))`` and ``251..253`` a bin with no visible cell (all keys in
the future, every row fully masked, or the keys padding).

Scores the text is too short to tell (``report.too_short``, :mod:`attnlab.heads.scores`) are
``null`` in ``#attnlab-meta`` and named with the reason in its ``too_short``; the page shows them as
"too short to tell" (header note, grid tooltips, table cells) and the heads they leave undecided
with a ``?`` badge. ``written`` is the id and time the run stamped on every file of its result.

Which heads get their full pattern: all of them when they fit ``budget_mb``; otherwise the heads
with the strongest sharp score (the highest of induction, duplicate, previous-token, sink and
diagonal) first, as many as fit: those are the patterns worth reading cell by cell, while a diffuse
head looks the same in its thumbnail. ``heads=[(l, h), ...]`` stores exactly those instead.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from .scores import SCORE_DOCS, THRESHOLDS, TOO_SHORT, score_grid

__all__ = ["write_page", "THUMB_SIZE", "SHARP_SCORES"]

PAGE_FORMAT = "attnlab.page/1"
THUMB_SIZE = 48  # thumbnail side in pixels (fewer when T is smaller)
SHARP_SCORES = ("induction", "duplicate", "prev_token", "sink", "diagonal")  # rank heads for the budget
CODE_MAX = 250  # thumbnail codes 0..250 are weights; the three after it are masks
CODE_FUTURE, CODE_ROW, CODE_PAD = 251, 252, 253


class ReportLike(Protocol):
    """What the page reads of :class:`attnlab.heads.report.HeadReport` (which imports this module, so not imported here)."""

    model_name: str
    scores: dict[str, Tensor]  # {name: (L, H)}
    kinds: list[list[str]]  # [l][h]
    weights: list[Tensor]  # per layer (H, T, T)
    token_ids: list[int]
    tokens: list[str]
    key_padding: list[bool] | None
    n_kv_heads: int
    probe: dict[str, Any]

    @property
    def n_layers(self) -> int: ...

    @property
    def n_heads(self) -> int: ...


def write_page(
    report: ReportLike,
    path: str | os.PathLike[str],
    *,
    budget_mb: float = 64.0,
    heads: Sequence[tuple[int, int]] | None = None,
    stamp: dict[str, str] | None = None,
) -> Path:
    """Write the interactive page of ``report`` to ``path`` (atomically); returns ``path``.

    Args:
        report: what :func:`attnlab.heads.inspect` returned.
        path: the ``.html`` file to write.
        budget_mb: the page's size limit in MiB for the full patterns of the heads (each takes
            ``T (T + 1) / 2 * 4`` bytes, a third more in base64); thumbnails of all heads are always
            in. When not every head fits, the strongest heads are chosen (module docstring) and the
            page says which heads are thumbnails only.
        heads: ``[(layer, head), ...]``: store the full patterns of exactly these heads, whatever
            their size (the budget is then not applied).
        stamp: the run's ``{"id", "time"}`` (:func:`attnlab.heads.report.new_stamp`), the same on
            every file of one result.
    """
    if not budget_mb >= 0:
        raise ValueError(f"budget_mb must be >= 0 (MiB of full patterns in the page), got {budget_mb!r}.")
    L, H, T = report.n_layers, report.n_heads, len(report.tokens)
    meta = _meta(report)
    meta["written"] = dict(stamp or {})
    meta["patterns"]["budget_mb"] = budget_mb
    if heads is None:
        meta["patterns"]["embedded"] = [[layer, head] for layer in range(L) for head in range(H)]  # its longest form
        base = len(_html(report, meta, {}).encode())
        n_fit = max(0, int(budget_mb * 2**20) - base) // _pattern_tag_bytes(T, L, H)
        chosen = _ranked_heads(report)[:n_fit]
        meta["patterns"]["selection"] = (
            "all heads fit the budget"
            if n_fit >= L * H
            else "the strongest heads (highest of " + ", ".join(SHARP_SCORES) + ") that fit the budget"
        )
    else:
        chosen = _checked_heads(heads, L, H)
        meta["patterns"]["selection"] = "chosen by the caller (heads=...)"
    chosen = sorted(chosen)
    meta["patterns"]["embedded"] = [[layer, head] for layer, head in chosen]
    patterns = {(layer, head): _pattern_b64(report.weights[layer][head]) for layer, head in chosen}
    from ..runtime import atomic_write_text

    out = Path(path)
    atomic_write_text(out, _html(report, meta, patterns))
    return out


def _checked_heads(heads: Sequence[tuple[int, int]], L: int, H: int) -> list[tuple[int, int]]:
    chosen: list[tuple[int, int]] = []
    for item in heads:
        layer, head = (int(v) for v in item)
        if not (0 <= layer < L and 0 <= head < H):
            raise ValueError(
                f"heads holds {tuple(item)!r}, outside the model's {L} layers x {H} heads; pass (layer, head) pairs "
                f"with 0 <= layer < {L} and 0 <= head < {H}."
            )
        if (layer, head) not in chosen:
            chosen.append((layer, head))
    return chosen


def _ranked_heads(report: ReportLike) -> list[tuple[int, int]]:
    """Every ``(layer, head)``, strongest sharp score first (a score too short to tell, NaN, counts as
    none); ties in layer then head order."""
    stacked = torch.stack([report.scores[name].float() for name in SHARP_SCORES])  # (5, L, H)
    sharp = stacked.nan_to_num(nan=-math.inf).amax(dim=0)  # (L, H)
    heads = [(layer, head) for layer in range(report.n_layers) for head in range(report.n_heads)]
    return sorted(heads, key=lambda lh: (-float(sharp[lh]), lh))


def _pattern_tag_bytes(T: int, L: int, H: int) -> int:
    """The size of one pattern's ``<script>`` tag in the page: base64 of ``T (T + 1) / 2`` float32 and the tag."""
    tag = len(_pattern_tag(L - 1, H - 1, ""))
    return tag + 4 * math.ceil(T * (T + 1) // 2 * 4 / 3)


def _pattern_b64(weights: Tensor) -> str:
    """``(T, T)`` weights -> base64 of the lower triangle, row ``i`` holding keys ``0..i``, float32 little-endian."""
    T = weights.size(-1)
    rows, cols = torch.tril_indices(T, T)  # (2, T (T + 1) / 2), row-major
    tri = weights.float().cpu()[rows, cols].numpy().astype("<f4")
    return base64.b64encode(tri.tobytes()).decode("ascii")


def _masks(report: ReportLike) -> tuple[Tensor, Tensor, Tensor]:
    """``(causal (T, T), pad (T,), full_rows (T,))`` bool: key ``j <= i``, padding keys, rows that see no key."""
    T = len(report.tokens)
    pad = torch.tensor(report.key_padding or [False] * T, dtype=torch.bool)  # (T,)
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T): query i sees keys j <= i
    full_rows = ~(causal & ~pad[None, :]).any(dim=-1)  # (T,): no visible key
    zero = torch.stack([w.sum(dim=-1) == 0 for w in report.weights]).all(dim=0).all(dim=0)  # (T,): every head's row 0
    return causal, pad, full_rows | zero


def _thumbnails(report: ReportLike, size: int, masks: tuple[Tensor, Tensor, Tensor]) -> bytes:
    """``(L, H, S, S)`` uint8 codes (module docstring), max-pooled from each head's ``(T, T)`` weights."""
    causal, pad, full_rows = masks
    visible = causal & ~pad[None, :] & ~full_rows[:, None]  # (T, T)

    def pooled(x: Tensor) -> Tensor:  # (..., T, T) -> (..., S, S)
        return F.adaptive_max_pool2d(x.float().unsqueeze(0) if x.dim() == 2 else x.float(), size)

    any_causal = pooled(causal)[0] > 0  # (S, S): a bin with a key j <= i
    any_row = pooled((~full_rows)[:, None].expand(-1, causal.size(0)))[0] > 0  # (S, S): a row that sees something
    any_visible = pooled(visible)[0] > 0
    mask_code = torch.where(
        ~any_causal, CODE_FUTURE, torch.where(~any_row, CODE_ROW, CODE_PAD)
    )  # (S, S), used where nothing in the bin is visible
    codes = []
    for w in report.weights:  # (H, T, T)
        value = (pooled(w).clamp(0, 1).sqrt() * CODE_MAX).round().to(torch.int64)  # (H, S, S)
        codes.append(torch.where(any_visible, value, mask_code).to(torch.uint8))
    return torch.stack(codes).numpy().tobytes()  # (L, H, S, S)


def _meta(report: ReportLike) -> dict[str, Any]:
    """The page's data apart from the full patterns."""
    T = len(report.tokens)
    size = min(T, THUMB_SIZE)
    masks = _masks(report)
    full_rows = masks[2]
    return {
        "format": PAGE_FORMAT,
        "model": {
            "name": report.model_name,
            "n_layers": report.n_layers,
            "n_heads": report.n_heads,
            "n_kv_heads": report.n_kv_heads,
            "windows": list(getattr(report, "windows", None) or []),  # per layer: a sliding window, or None
        },
        "text": {
            "tokens": report.tokens,
            "token_ids": report.token_ids,
            "key_padding": report.key_padding,
            "fully_masked_rows": [int(i) for i in full_rows.nonzero().flatten()],
        },
        "scores": {name: score_grid(t) for name, t in report.scores.items()},  # null: too short to tell
        "score_docs": SCORE_DOCS,
        "too_short": dict(getattr(report, "too_short", None) or {}),  # {score: why}
        "too_short_label": TOO_SHORT,
        "kinds": report.kinds,
        "thresholds": [{"kind": k, "score": s, "op": op, "value": v} for k, s, op, v in THRESHOLDS],
        "probe": report.probe,
        "thumb": {
            "size": size,
            "codes": {"max": CODE_MAX, "future": CODE_FUTURE, "row": CODE_ROW, "pad": CODE_PAD},
            "data": base64.b64encode(_thumbnails(report, size, masks)).decode("ascii"),
        },
        "patterns": {"embedded": [], "selection": "", "bytes_per_head": T * (T + 1) // 2 * 4},
    }


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _json_in_script(value: Any) -> str:
    """JSON safe inside ``<script>``: no ``<`` at all, so no ``</script>`` or ``<!--`` in a token ends it early."""
    return json.dumps(value, ensure_ascii=True, separators=(",", ":")).replace("<", "\\u003c")


def _pattern_tag(layer: int, head: int, b64: str) -> str:
    return f'<script type="application/json" id="pattern-{layer}-{head}">"{b64}"</script>\n'


def _html(report: ReportLike, meta: dict[str, Any], patterns: dict[tuple[int, int], str]) -> str:
    title = html.escape(f"{report.model_name}: attention heads")
    tags = "".join(_pattern_tag(layer, head, b64) for (layer, head), b64 in patterns.items())
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<link rel="icon" href="data:,">\n'  # no favicon request, not even from file://
        f"<title>{title}</title>\n<style>\n{_asset('page.css')}</style>\n</head>\n<body>\n"
        f"{_BODY}"
        f'<script type="application/json" id="attnlab-meta">{_json_in_script(meta)}</script>\n'
        f"<script>\n{_asset('page.js')}</script>\n"
        # the patterns last: the grid is drawn while the browser still parses them (a head opened
        # before its tag is parsed is opened again on DOMContentLoaded)
        f"{tags}"
        "</body>\n</html>\n"
    )


# The page's skeleton; page.js fills it from #attnlab-meta. Ids and classes are what the tests use.
_BODY = """\
<header id="top">
  <h1 id="title"></h1>
  <p id="summary"></p>
  <p id="embed-note"></p>
  <p id="short-note" hidden></p>
</header>
<main id="main">
  <section id="grid-panel" aria-label="layer by head grid">
    <h2>Heads <small>(layers down, query heads across, grouped by K/V head)</small></h2>
    <div id="kind-legend"></div>
    <div id="grid"></div>
  </section>
  <section id="detail" hidden aria-label="the pattern of one head">
    <h2 id="detail-title"></h2>
    <p id="detail-message"></p>
    <div id="detail-tools">
      <button type="button" id="zoom-out" title="smaller cells">&minus;</button>
      <button type="button" id="zoom-in" title="larger cells">+</button>
      <span id="detail-window"></span>
    </div>
    <div id="detail-scroller" tabindex="0">
      <div id="detail-spacer">
        <div id="detail-sticky">
          <canvas id="detail-canvas"></canvas>
          <canvas id="detail-cursor"></canvas>
        </div>
      </div>
    </div>
    <div id="hover" aria-live="polite">
      <div>query <span id="hover-query">&ndash;</span></div>
      <div>key <span id="hover-key">&ndash;</span></div>
      <div>weight <span id="hover-weight" data-weight="">&ndash;</span></div>
    </div>
    <div id="legend"></div>
  </section>
  <p id="detail-hint">Click a head to see its pattern.</p>
</main>
<section id="table-panel" aria-label="scores of every head">
  <h2>Scores <small>(click a column to sort; click a row to open the head)</small></h2>
  <table id="scores"><thead></thead><tbody></tbody></table>
</section>
"""
