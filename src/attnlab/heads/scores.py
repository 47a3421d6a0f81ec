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
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "TEXT_SCORES",
    "PROBE_SCORES",
    "SCORE_NAMES",
    "SCORE_DOCS",
    "THRESHOLDS",
    "KINDS",
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
KINDS = (*(rule[0] for rule in THRESHOLDS), "mixed")


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
    """The kind of every head: ``scores[name]`` is ``(L, H)``; returns ``kinds[l][h]`` (see :data:`THRESHOLDS`)."""
    L, H = scores["sink"].shape
    kinds = [["mixed"] * H for _ in range(L)]
    for layer in range(L):
        for head in range(H):
            for kind, name, op, threshold in THRESHOLDS:
                value = float(scores[name][layer, head])
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
