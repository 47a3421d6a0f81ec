"""Per-head scores of captured attention weights, and the kinds of head they define.

Every score is a mean over query rows of a quantity of one row of weights ``a[i, :]`` (which sums
to 1 over the keys that row may see). Rows are the *scored rows*: not padding, and not the first
real token (it sees only itself, so every score would be trivially 0 or 1 there).

Text scores (computed on the text inspected):

* ``entropy``: ``-sum_j a_ij ln a_ij`` in nats.
* ``uniformity``: entropy over ``ln(keys row i may see)``: 1 = spread evenly, 0 = one key.
* ``distance``: mean attention distance ``sum_j a_ij (i - j)`` in tokens.
* ``sink``: weight on the first real token (attention sinks park unneeded attention there).
* ``prev_token``: weight on the token just before, ``a[i, i-1]``.
* ``diagonal``: weight on the query's own token, ``a[i, i]``.

Probe scores (on the built-in probe: random tokens ``s_0 .. s_{n-1}`` repeated twice, so that
every token of the second copy has occurred exactly ``n`` positions earlier):

* ``duplicate``: from ``s_k`` in the second copy to its first occurrence, ``a[n+k, k]``.
* ``induction``: from ``s_k`` in the second copy to the token *after* its first occurrence,
  ``a[n+k, k+1]``: the head that lets a model continue a sequence it has seen (Olsson et al.,
  2022, "In-context learning and induction heads").

Kinds (:func:`classify`, thresholds in :data:`THRESHOLDS`): the first rule that holds names the
head; a head matching none is ``mixed``.

**Too short to tell.** On a short text a score cannot tell a head apart from one with no
preference: on a 2-token text the one scored row sees two keys, and the previous token is also
the first token, so a head that spreads its weight evenly scores ``prev_token = sink = 0.5``, at
both thresholds. A score is therefore *decided* only from a minimum number of scored rows
(:data:`MIN_TEXT_ROWS`, derived from :data:`THRESHOLDS` by :func:`min_text_rows`; the probe's own
length is held to :data:`MIN_PROBE_LEN` the same way). The rule: the threshold must separate a
head with no preference (each row's weight spread evenly over the keys it sees) from a head with
a clear one:

* one-key scores (``prev_token``, ``sink``, and ``diagonal`` against the previous-token threshold;
  ``duplicate`` and ``induction`` on the probe): the head with no preference scores at most *half*
  the threshold, so a head at the threshold gives that key at least twice the weight chance does:
  7 scored rows (8 tokens); a probe of ``n >= 4``;
* ``distance`` (local ``<= 2``): the head with no preference is at least *twice* the threshold
  away, 4 tokens on average: 15 scored rows (16 tokens);
* ``uniformity`` (uniform ``>= 0.8``): a head with no preference scores 1 on any text, so the test
  turns around: a head with a clear preference, half of each row's weight on one key (the sharp
  rules' 0.5), must score under 0.8; it does from 19 scored rows (20 tokens); on fewer keys half
  on one key still looks even;
* ``entropy`` has no threshold: it is a measurement in nats, decided from one scored row.

A score the text (or the probe) is too short for is NaN in :class:`~attnlab.heads.report.HeadReport`
and ``null`` in ``heads.json`` (:func:`too_short` says why), and :func:`classify` names a head
``undecided`` when a rule it would have to be tested on first cannot be decided.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "TEXT_SCORES",
    "PROBE_SCORES",
    "SCORE_NAMES",
    "SCORE_DOCS",
    "THRESHOLDS",
    "KINDS",
    "UNDECIDED",
    "TOO_SHORT",
    "MIN_TEXT_ROWS",
    "MIN_PROBE_LEN",
    "min_text_rows",
    "min_probe_len",
    "too_short",
    "mark_too_short",
    "score_grid",
    "text_scores",
    "probe_scores",
    "classify",
    "make_probe",
]

TEXT_SCORES = ("entropy", "uniformity", "distance", "sink", "prev_token", "diagonal")
PROBE_SCORES = ("duplicate", "induction")
SCORE_NAMES = TEXT_SCORES + PROBE_SCORES
SCORE_DOCS = {
    "entropy": "entropy of a row's weights, nats",
    "uniformity": "entropy / ln(visible keys): 1 = even spread, 0 = one key",
    "distance": "mean distance from query to keys, tokens",
    "sink": "weight on the first token",
    "prev_token": "weight on the previous token",
    "diagonal": "weight on the query's own token",
    "duplicate": "probe: weight on the earlier copy of the same token",
    "induction": "probe: weight on the token after the earlier copy",
}

# (kind, score, comparison, threshold): the first rule a head meets names it.
THRESHOLDS: tuple[tuple[str, str, str, float], ...] = (
    ("induction", "induction", ">=", 0.4),
    ("duplicate", "duplicate", ">=", 0.4),
    ("previous-token", "prev_token", ">=", 0.5),
    ("sink", "sink", ">=", 0.5),
    ("local", "distance", "<=", 2.0),
    ("uniform", "uniformity", ">=", 0.8),
)
UNDECIDED = "undecided"  # the kind of a head whose deciding rule's score the text is too short for
TOO_SHORT = "too short to tell"  # how every output marks such a score or kind
KINDS = (*(rule[0] for rule in THRESHOLDS), "mixed", UNDECIDED)
_RULE = {score: (op, value) for _, score, op, value in THRESHOLDS}
_ONE_KEY = {"prev_token": "prev_token", "sink": "sink", "diagonal": "prev_token"}  # score -> the rule it answers to
MARGIN = 2.0  # a head with no preference scores at most threshold / MARGIN on a one-key score
_SEARCH = 100_000  # rows searched for a minimum; every threshold in (0, 1) is met long before


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _decided(score: str, rows: int) -> bool:
    """Whether ``rows`` scored rows (row ``i = 1 .. rows`` sees ``i + 1`` keys) tell ``score`` apart (module docstring)."""
    keys = [float(i + 1) for i in range(1, rows + 1)]
    if score in _ONE_KEY:
        return _mean([1 / k for k in keys]) <= _RULE[_ONE_KEY[score]][1] / MARGIN  # no preference: 1/k on each key
    if score == "distance":
        return _mean([(k - 1) / 2 for k in keys]) >= _RULE["distance"][1] * MARGIN  # no preference: i / 2 tokens back
    if score == "uniformity":  # half of each row on one key, the other half spread over the k - 1 others
        half = [(math.log(2) + 0.5 * math.log(k - 1)) / math.log(k) for k in keys]
        return _mean(half) < _RULE["uniformity"][1]
    return rows >= 1  # entropy: a measurement, no threshold


def min_text_rows(score: str) -> int:
    """The fewest scored rows (real tokens minus one) on which ``score`` is decided (module docstring)."""
    if score not in TEXT_SCORES:
        raise ValueError(f"{score!r} is not a text score; text scores are {', '.join(TEXT_SCORES)}")
    return next(rows for rows in range(1, _SEARCH) if _decided(score, rows))


def min_probe_len(threshold: float) -> int:
    """The shortest probe ``n`` on which a head with no preference scores at most ``threshold / MARGIN``.

    The probe's scored rows are the second copy's ``n + k`` for ``k = 0 .. n - 2``, each seeing
    ``n + k + 1`` keys; a head with no preference gives the earlier copy ``1 / (n + k + 1)``.
    """
    return next(n for n in range(2, _SEARCH) if _mean([1 / (n + k + 1) for k in range(n - 1)]) <= threshold / MARGIN)


MIN_TEXT_ROWS = {score: min_text_rows(score) for score in TEXT_SCORES}  # prev_token 7, distance 15, uniformity 19
MIN_PROBE_LEN = max(min_probe_len(_RULE[score][1]) for score in PROBE_SCORES)  # 4


def too_short(text_rows: int, probe_n: int) -> dict[str, str]:
    """``{score: why}`` for each score that ``text_rows`` scored rows (or a probe of ``probe_n``) cannot decide."""
    why = {
        score: (
            f"{score} needs a text of at least {need + 1} tokens ({need} scored rows, padding not counted) for its "
            f"threshold to tell a head from chance; this one has {text_rows + 1}"
        )
        for score, need in MIN_TEXT_ROWS.items()
        if text_rows < need
    }
    if probe_n < MIN_PROBE_LEN:
        for score in PROBE_SCORES:
            why[score] = (
                f"{score} needs a probe of at least {MIN_PROBE_LEN} repeated tokens for its threshold to tell a head "
                f"from chance; this one repeats {probe_n}"
            )
    return why


def score_grid(t: Tensor) -> list[list[float | None]]:
    """``(L, H)`` as JSON: rows of values rounded to 6 places, ``None`` (``null``) where NaN, too short to tell."""
    return [[None if math.isnan(v) else round(float(v), 6) for v in row] for row in t.tolist()]


def mark_too_short(scores: dict[str, Tensor], short: dict[str, str]) -> dict[str, Tensor]:
    """``scores`` with every score named in ``short`` (see :func:`too_short`) replaced by NaN of the same shape."""
    return {name: torch.full_like(t, math.nan) if name in short else t for name, t in scores.items()}


def _scored_rows(key_padding: Tensor | None, batch: int, t: int) -> tuple[Tensor, Tensor]:
    """``(rows (B, T) bool, first (B,) int64)``: the scored query rows and each sequence's first real token."""
    real = torch.ones(batch, t, dtype=torch.bool) if key_padding is None else ~key_padding.cpu().bool()
    first = real.int().argmax(dim=1)  # (B,): index of the first True
    rows = real.clone()
    rows[torch.arange(batch), first] = False
    return rows, first


def text_scores(weights: Tensor, key_padding: Tensor | None = None) -> dict[str, Tensor]:
    """Text scores of one layer, each ``(H,)``: ``weights`` is ``(B, H, T, T)`` causal self-attention weights.

    ``key_padding``: ``(B, T)`` bool, True = padding (left or right); its rows are not scored.
    """
    if weights.dim() != 4 or weights.size(-1) != weights.size(-2):
        raise ValueError(f"weights must be (B, H, T, T) self-attention weights, got shape {tuple(weights.shape)}")
    w = weights.double()
    B, H, T, _ = w.shape
    rows, first = _scored_rows(key_padding, B, T)
    n_rows = rows.sum().clamp(min=1).double()
    i = torch.arange(T)
    entropy = -(w * w.clamp(min=1e-30).log()).sum(-1)  # (B, H, T)
    real = torch.ones(B, T, dtype=torch.bool) if key_padding is None else ~key_padding.cpu().bool()
    n_visible = torch.tril(real[:, None, :].expand(B, T, T)).sum(-1).clamp(min=2).double()  # (B, T): real keys <= i
    uniformity = entropy / n_visible.log()[:, None, :]
    distance = (w * (i[:, None] - i[None, :]).double()).sum(-1)  # (B, H, T)
    sink = w.gather(-1, first[:, None, None, None].expand(B, H, T, 1)).squeeze(-1)  # (B, H, T)
    prev = torch.diagonal(w, offset=-1, dim1=-2, dim2=-1)  # (B, H, T-1): a[i, i-1] for i >= 1
    prev = torch.cat([torch.zeros(B, H, 1, dtype=w.dtype), prev], dim=-1)  # (B, H, T), row 0 never scored
    diagonal = torch.diagonal(w, dim1=-2, dim2=-1)  # (B, H, T)

    def mean(x: Tensor) -> Tensor:  # (B, H, T) -> (H,) over the scored rows
        return (x * rows[:, None, :]).sum(dim=(0, 2)) / n_rows

    return {
        "entropy": mean(entropy).float(),
        "uniformity": mean(uniformity).float(),
        "distance": mean(distance).float(),
        "sink": mean(sink).float(),
        "prev_token": mean(prev).float(),
        "diagonal": mean(diagonal).float(),
    }


def probe_scores(weights: Tensor, n: int, offset: int = 0) -> dict[str, Tensor]:
    """``duplicate`` and ``induction`` of one layer, each ``(H,)``, from the probe's ``(B, H, T, T)`` weights.

    The probe's repeated part starts at ``offset`` (a BOS token before it, say): tokens
    ``offset .. offset+n-1`` are repeated at ``offset+n .. offset+2n-1``.
    """
    if weights.size(-1) < offset + 2 * n:
        raise ValueError(f"probe weights cover {weights.size(-1)} tokens, fewer than offset + 2n = {offset + 2 * n}")
    w = weights.double()
    k = torch.arange(n - 1)  # the last token's successor would be past the second copy's start
    q = offset + n + k  # (n-1,) query rows in the second copy
    duplicate = w[:, :, q, offset + k]  # (B, H, n-1)
    induction = w[:, :, q, offset + k + 1]
    return {"duplicate": duplicate.mean(dim=(0, 2)).float(), "induction": induction.mean(dim=(0, 2)).float()}


def classify(scores: dict[str, Tensor]) -> list[list[str]]:
    """The kind of every head: ``scores[name]`` is ``(L, H)``; returns ``kinds[l][h]`` (see :data:`THRESHOLDS`).

    A NaN score (too short to tell, :func:`mark_too_short`) stops the rules where it is reached: the
    head is :data:`UNDECIDED`, since whether that rule holds, and so its kind, is unknown. A rule
    met before it still names the head.
    """
    L, H = scores["sink"].shape
    kinds = [["mixed"] * H for _ in range(L)]
    for layer in range(L):
        for head in range(H):
            for kind, name, op, threshold in THRESHOLDS:
                value = float(scores[name][layer, head])
                if math.isnan(value):
                    kinds[layer][head] = UNDECIDED
                    break
                if (value >= threshold) if op == ">=" else (value <= threshold):
                    kinds[layer][head] = kind
                    break
    return kinds


def make_probe(vocab_size: int, n: int, batch: int, *, seed: int = 0, low: int | None = None) -> Tensor:
    """``(batch, 2n)`` int64: random ids repeated twice, from a seeded generator (the same probe every run).

    Ids are drawn from ``low .. vocab_size-1``; ``low`` defaults to 0 for small vocabularies and to
    ``vocab_size // 50`` (past the special and byte tokens BPE vocabularies put first) for large ones.
    """
    if n < 2 or batch < 1:
        raise ValueError(f"the probe needs n >= 2 tokens and batch >= 1, got n={n}, batch={batch}")
    if low is None:
        low = 0 if vocab_size < 1000 else vocab_size // 50
    gen = torch.Generator().manual_seed(seed)
    seq = torch.randint(low, vocab_size, (batch, n), generator=gen)
    return torch.cat([seq, seq], dim=1)
