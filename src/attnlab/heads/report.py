"""``attnlab.inspect``: what every head of a model does, on a text and on the induction probe.

One call runs the model twice with :func:`~attnlab.heads.capture.capture_attention` (the text,
then the probe of :func:`~attnlab.heads.scores.make_probe`), scores each head
(:mod:`attnlab.heads.scores`) and names its kind. :meth:`HeadReport.save` writes ``heads.json``
(every score, layer x head), ``heads.png`` (one layer x head grid per score) and ``index.html``
(the interactive page, :mod:`attnlab.heads.page`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .capture import attention_layers, run_and_capture
from .scores import (
    KINDS,
    PROBE_SCORES,
    SCORE_DOCS,
    SCORE_NAMES,
    TEXT_SCORES,
    THRESHOLDS,
    classify,
    make_probe,
    probe_scores,
    text_scores,
)

__all__ = ["HeadReport", "inspect", "FORMAT"]

FORMAT = "attnlab.heads/1"


@dataclass
class HeadReport:
    """Scores, kinds and the text's weights of every head; see :func:`inspect`.

    Attributes:
        scores: ``{name: (L, H) float32}`` for every name in :data:`attnlab.heads.scores.SCORE_NAMES`.
        kinds: ``kinds[l][h]``, one of :data:`attnlab.heads.scores.KINDS`.
        weights: per layer, ``(H, T, T)`` float32: the text's attention weights (masked keys 0).
        token_ids, tokens: the text's ids and the string of each (``tokenizer.decode([id])``).
        key_padding: ``(T,)`` bool, True = a padding token (left padding), or None.
        n_kv_heads: K/V heads per layer (GQA groups: query head ``h`` reads K/V head ``h // (H // G)``).
        probe: ``n``, ``batch``, ``seed`` of the probe, and the model's loss on its first and second copy.
        windows: per layer, the sliding window of its attention (None: full causal); the page
            draws keys outside a window as masked.
    """

    model_name: str
    scores: dict[str, Tensor]
    kinds: list[list[str]]
    weights: list[Tensor]
    token_ids: list[int]
    tokens: list[str]
    key_padding: list[bool] | None
    n_kv_heads: int
    probe: dict[str, Any] = field(default_factory=dict)
    windows: list[int | None] = field(default_factory=list)  # per layer: its sliding window (None: full causal)

    @property
    def n_layers(self) -> int:
        return len(self.kinds)

    @property
    def n_heads(self) -> int:
        return len(self.kinds[0])

    def kind_counts(self) -> list[dict[str, int]]:
        """Per layer, how many heads of each kind."""
        return [{k: row.count(k) for k in KINDS if row.count(k)} for row in self.kinds]

    def top(self, score: str, k: int = 5) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the highest ``score``: ``(layer, head, value)``."""
        flat = self.scores[score].flatten()
        values, order = flat.topk(min(k, flat.numel()))
        return [(int(i) // self.n_heads, int(i) % self.n_heads, float(v)) for v, i in zip(values, order, strict=True)]

    def to_json(self) -> dict[str, Any]:
        """``heads.json``'s content: every score and kind, the tokens, thresholds and probe."""
        return {
            "format": FORMAT,
            "model": {
                "name": self.model_name,
                "n_layers": self.n_layers,
                "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads,
                "windows": self.windows,
            },
            "text": {"token_ids": self.token_ids, "tokens": self.tokens, "key_padding": self.key_padding},
            "scores": {
                name: [[round(float(v), 6) for v in row] for row in t.tolist()] for name, t in self.scores.items()
            },
            "score_docs": SCORE_DOCS,
            "kinds": self.kinds,
            "kind_counts": self.kind_counts(),
            "thresholds": [{"kind": k, "score": s, "op": op, "value": v} for k, s, op, v in THRESHOLDS],
            "probe": self.probe,
        }

    def save(
        self, out_dir: str | os.PathLike[str], *, page: bool = True, page_budget_mb: float = 64.0
    ) -> dict[str, Path]:
        """Write ``heads.json``, ``heads.png`` and (``page=True``) ``index.html`` into ``out_dir``; returns their paths."""
        from ..runtime import atomic_write_text, check_writable_dir

        out = check_writable_dir(Path(out_dir), "out_dir")
        paths = {"json": out / "heads.json", "png": out / "heads.png"}
        atomic_write_text(paths["json"], json.dumps(self.to_json(), indent=1) + "\n")
        plot_scores(self, paths["png"])
        if page:
            from .page import write_page

            paths["html"] = write_page(self, out / "index.html", budget_mb=page_budget_mb)
        return paths


def plot_scores(report: HeadReport, path: Path) -> Path:
    """One heat map per score, layers down and heads across, with each head's kind initial in its cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..runtime import atomic_write_bytes

    names = ("induction", "prev_token", "duplicate", "sink", "diagonal", "uniformity", "distance", "entropy")
    L, H = report.n_layers, report.n_heads
    fig, axes = plt.subplots(1, len(names), figsize=(2.0 + 1.1 * len(names) * max(H, 4) / 4, 1.2 + 0.22 * L))
    for ax, name in zip(axes, names, strict=True):
        values = report.scores[name].numpy()
        vmax = 1.0 if name not in ("distance", "entropy") else max(float(values.max()), 1e-6)
        image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.tick_params(labelsize=6)
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02).ax.tick_params(labelsize=6)
    fig.suptitle(f"{report.model_name}: head scores ({L} layers x {H} heads)", fontsize=9)
    fig.tight_layout()
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _ids(text: str | Sequence[int] | Tensor, tokenizer: Any, max_tokens: int) -> list[int]:
    if isinstance(text, str):
        if tokenizer is None:
            raise ValueError("text is a string but no tokenizer was given; pass tokenizer=... or token ids instead.")
        ids = list(tokenizer.encode(text))
    elif isinstance(text, Tensor):
        if text.dim() == 2 and text.size(0) == 1:
            text = text[0]
        if text.dim() != 1 or text.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"text as a tensor must be one sequence of int64 ids, (T,) or (1, T); got {text.dtype} {tuple(text.shape)}"
            )
        ids = [int(i) for i in text]
    else:
        ids = [int(i) for i in text]
    if len(ids) < 2:
        raise ValueError(f"text has {len(ids)} token(s); inspect needs at least 2 to score the heads.")
    if len(ids) > max_tokens:
        raise ValueError(
            f"text has {len(ids)} tokens, more than max_tokens={max_tokens}; shorten it or raise max_tokens "
            f"(weights take layers x heads x T^2 x 4 bytes)."
        )
    return ids


def _token_strings(ids: list[int], tokenizer: Any) -> list[str]:
    if tokenizer is None:
        return [str(i) for i in ids]
    return [tokenizer.decode([i]) for i in ids]


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "vocab_size"):
        return int(config.vocab_size)
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise TypeError(f"cannot tell the vocabulary size of {type(model).__name__}; pass probe_vocab=...")
    return emb.num_embeddings


def _block_size(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "block_size", None) or getattr(model, "block_size", None)
    return int(size) if size else None


@torch.no_grad()
def inspect(
    model: nn.Module,
    text: str | Sequence[int] | Tensor,
    *,
    tokenizer: Any = None,
    left_pad: int = 0,
    pad_id: int = 0,
    probe_len: int = 50,
    probe_batch: int = 4,
    probe_seed: int = 0,
    probe_vocab: int | None = None,
    max_tokens: int = 2048,
    model_name: str | None = None,
) -> HeadReport:
    """Score every head of ``model`` on ``text`` and on the induction probe.

    Args:
        model: an attnlab model (its attention is :class:`attnlab.MultiHeadAttention`), called as
            ``model(idx)`` -> logits ``(B, T, V)``; run in eval mode, its mode restored after.
        text: a string (with ``tokenizer``) or token ids.
        tokenizer: anything with ``encode(str) -> ids`` and ``decode(ids) -> str`` (attnlab's, HF's).
        left_pad: prepend this many ``pad_id`` tokens marked as padding (``key_padding_mask``), to see
            how the model's masks treat them; the model must accept ``key_padding_mask``.
        probe_len: ``n``, the length of the random sequence the probe repeats (capped by the model's
            block size); ``probe_batch`` sequences, drawn with ``probe_seed``.
        max_tokens: refuse longer texts (the weights of every head are kept in memory).

    Returns:
        A :class:`HeadReport`.
    """
    layers = attention_layers(model)
    ids = _ids(text, tokenizer, max_tokens)
    device = next(model.parameters()).device
    idx = torch.tensor([[pad_id] * left_pad + ids], device=device)  # (1, T)
    kwargs: dict[str, Any] = {}
    key_padding: list[bool] | None = None
    if left_pad:
        key_padding = [True] * left_pad + [False] * len(ids)
        kwargs["key_padding_mask"] = torch.tensor([key_padding], device=device)
    _, text_weights = run_and_capture(model, idx, **kwargs)  # per layer (1, H, T, T)
    pad_mask = None if key_padding is None else torch.tensor([key_padding])
    per_layer = [text_scores(w, pad_mask) for w in text_weights]

    block = _block_size(model)
    n = probe_len if block is None else max(2, min(probe_len, block // 2))
    probe = make_probe(probe_vocab or _vocab_size(model), n, probe_batch, seed=probe_seed).to(device)
    logits, probe_weights = run_and_capture(model, probe)
    for scores, w in zip(per_layer, probe_weights, strict=True):
        scores.update(probe_scores(w, n))
    loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), probe[:, 1:], reduction="none")  # (B, 2n-1)
    probe_info = {
        "n": n,
        "batch": probe_batch,
        "seed": probe_seed,
        "loss_first_copy": round(float(loss[:, : n - 1].mean()), 4),
        "loss_second_copy": round(float(loss[:, n:].mean()), 4),
    }

    scores = {name: torch.stack([s[name] for s in per_layer]) for name in SCORE_NAMES}  # (L, H) each
    assert set(scores) == set(TEXT_SCORES) | set(PROBE_SCORES)
    return HeadReport(
        model_name=model_name or type(model).__name__,
        scores=scores,
        kinds=classify(scores),
        weights=[w[0] for w in text_weights],
        token_ids=[pad_id] * left_pad + ids,
        tokens=["<pad>"] * left_pad + _token_strings(ids, tokenizer),
        key_padding=key_padding,
        n_kv_heads=layers[0].num_kv_heads,
        probe=probe_info,
        windows=[layer.window for layer in layers],
    )
