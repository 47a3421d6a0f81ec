"""Head scores logged at each evaluation (``--log-head-scores``): when do the heads that solve a task form?

Every evaluation record of ``metrics.jsonl`` then carries ``"head_scores": {name: [[score of
head h] for each layer]}`` (``L`` lists of ``H`` floats), measured on fixed inputs:

* ``prev_token``, ``induction``, ``duplicate``: :mod:`attnlab.heads.scores` on the induction
  probe (:func:`~attnlab.heads.scores.make_probe`: ``PROBE_BATCH`` sequences of ``n`` random ids
  of the task's vocabulary, repeated twice; ``n = block_size // 2``, seed ``PROBE_SEED``).
  ``prev_token`` is the weight on the previous token, ``induction`` the weight from a token of
  the second copy on the token that followed its first occurrence.
* ``recall_value``, ``recall_prev`` (recall only), on the first held-out batch: the weight from
  each query key on the value that follows the same key in the context, the position a correct
  lookup reads (:meth:`~attnlab.lab.data.RecallTask.answer_sources`); and the weight from each
  context value on its key, just before it. A two-layer lookup needs both: a layer that copies
  each key into its value's position (``recall_prev``), then one whose query matches that copy
  (``recall_value``), the induction circuit on the task's own data.

Two small forward passes in eval mode, no gradients, no global RNG drawn: a resumed run logs the
same scores as one never interrupted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..heads.capture import run_and_capture
from ..heads.scores import make_probe, probe_scores, text_scores
from .data import RecallTask

__all__ = ["HeadScorer", "MIN_BLOCK_SIZE", "PROBE_BATCH", "PROBE_SEED", "max_score", "probe_half"]

PROBE_BATCH = 8  # probe sequences: enough for a stable mean over (batch x n) query rows
PROBE_SEED = 0  # the same probe at every evaluation and in every run
# The shortest task sequence the probe fits: it needs n >= 2 (an induction step needs a token before the
# repeated one), its 2n tokens must fit the model's block_size + 1 positions, and n = max(2, T // 2): T >= 3.
# validation.validate_lengths refuses shorter ones by their flag (--data.copy-len 1 gave T = 2).
MIN_BLOCK_SIZE = 3


def probe_half(block_size: int) -> int:
    """``n``, the random tokens the probe repeats, for a task of ``block_size`` tokens (the probe is ``2n`` long)."""
    return max(2, block_size // 2)


RECALL_ROWS = 16  # held-out recall sequences scored for recall_value (x n_pairs queries each)
DIGITS = 4  # decimals kept in metrics.jsonl


class HeadScorer:
    """``scorer(model)`` -> ``{name: [[float] * H] * L}`` for a model of ``task`` (see the module docstring).

    Args:
        task: the run's data source (``vocab_size``, ``block_size``; a :class:`RecallTask` adds ``recall_value``).
        device: where the model lives; the fixed inputs are moved there once.
    """

    def __init__(self, task: Any, device: torch.device) -> None:
        if task.block_size < MIN_BLOCK_SIZE:  # validate_lengths refuses it first, naming the flag
            raise ValueError(f"the head-score probe needs block_size >= {MIN_BLOCK_SIZE}, got {task.block_size}")
        self.n = probe_half(task.block_size)
        self.probe = make_probe(task.vocab_size, self.n, PROBE_BATCH, seed=PROBE_SEED).to(device)  # (PB, 2n)
        self.recall: tuple[Tensor, Tensor, Tensor] | None = None
        if isinstance(task, RecallTask):
            x, _ = task.batch(0, split="eval")  # the first held-out batch, as evaluate() sees it
            x = x[:RECALL_ROWS]  # (R, 4n)
            queries, values = task.answer_sources(x)  # (n,), (R, n)
            self.recall = (x.to(device), queries, values)

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> dict[str, list[list[float]]]:
        _, weights = run_and_capture(model, self.probe)  # per layer (PB, H, 2n, 2n), on CPU
        per_layer: dict[str, list[Tensor]] = {"prev_token": [], "induction": [], "duplicate": []}
        for w in weights:
            probe = probe_scores(w, self.n)
            per_layer["prev_token"].append(text_scores(w)["prev_token"])  # (H,)
            per_layer["induction"].append(probe["induction"])
            per_layer["duplicate"].append(probe["duplicate"])
        if self.recall is not None:
            x, queries, values = self.recall
            _, weights = run_and_capture(model, x)  # per layer (R, H, 4n, 4n)
            per_layer["recall_value"] = [_lookup_weight(w, queries, values) for w in weights]
            ctx_values = torch.arange(1, 2 * queries.numel(), 2)  # (n,): v1 v2 ... of the context
            ctx_keys = (ctx_values - 1).expand(x.size(0), -1)  # (R, n): each value's key, one before it
            per_layer["recall_prev"] = [_lookup_weight(w, ctx_values, ctx_keys) for w in weights]
        return {name: [[round(float(v), DIGITS) for v in layer] for layer in rows] for name, rows in per_layer.items()}


def _lookup_weight(weights: Tensor, queries: Tensor, sources: Tensor) -> Tensor:
    """``(H,)``: mean weight from query row ``queries[j]`` on key ``sources[b, j]``; weights ``(B, H, T, T)``."""
    B, H, _, _ = weights.shape
    rows = weights[:, :, queries, :]  # (B, H, n, T)
    index = sources[:, None, :, None].expand(B, H, -1, 1)  # (B, H, n, 1)
    return rows.gather(-1, index).squeeze(-1).mean(dim=(0, 2))  # (B, H, n) -> (H,)


def max_score(record: dict[str, Any], name: str) -> float | None:
    """The largest ``name`` score over every layer and head of an evaluation record; None if it has none."""
    rows = record.get("head_scores", {}).get(name)
    return max(max(layer) for layer in rows) if rows else None
