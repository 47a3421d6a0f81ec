"""``attnlab.inspect``: what every head of a model does, on a text and on the induction probe.

One call runs the model twice with :func:`~attnlab.heads.capture.capture_attention` (the text,
then the probe of :func:`~attnlab.heads.scores.make_probe`), scores each head
(:mod:`attnlab.heads.scores`) and names its kind. :meth:`HeadReport.save` writes ``heads.json``
(every score, layer x head), ``heads.png`` (one layer x head grid per score) and ``index.html``
(the interactive page, :mod:`attnlab.heads.page`).

Refused before the model runs, each with the number that fits (:class:`~attnlab.runtime.LimitError`):
a text (with its left padding) longer than ``max_tokens`` or than the model's context
(``config.block_size``), and a request whose kept weights (every head's ``T x T``, float32, for
the text and for the probe) would not fit this machine's available memory.

**The result is a set.** ``heads.json``, ``heads.png`` and ``index.html`` are written into a
hidden staging folder inside ``out_dir`` and moved into place together at the end, with Ctrl-C and
SIGTERM held back for those few renames; files of an earlier result that this one does not write
(``index.html`` under ``page=False``) are removed in the same step. So an interrupt or an error
leaves the earlier result as it was (or nothing), never a mix of two runs, and no staging folder.
Each file carries the same run id and time (``written`` in the JSON and the page, the PNG's
``Comment``). An earlier result is never replaced unless ``overwrite=True`` (``--overwrite``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import threading
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..runtime import (
    INTERRUPTS,
    LimitError,
    UsageError,
    available_bytes,
    check_range,
    check_writable_dir,
    keep,
)
from ..runtime.memory import largest_fitting
from ..runtime.signals import STOP_SIGNALS
from ..runtime.text import check_text
from .capture import attention_layers, run_and_capture
from .scores import (
    KINDS,
    MIN_PROBE_LEN,
    MIN_TEXT_ROWS,
    PROBE_SCORES,
    SCORE_DOCS,
    SCORE_NAMES,
    TEXT_SCORES,
    THRESHOLDS,
    TOO_SHORT,
    classify,
    make_probe,
    mark_too_short,
    probe_scores,
    score_grid,
    text_scores,
    too_short,
)

__all__ = [
    "FORMAT",
    "PY_NAMES",
    "RESULT_FILES",
    "HeadReport",
    "available_memory",
    "check_before_load",
    "check_request",
    "check_result_dir",
    "encode_text",
    "inspect",
    "memory_needed",
    "new_stamp",
    "save_result",
]

FORMAT = "attnlab.heads/1"
RESULT_FILES = ("heads.json", "heads.png", "index.html")  # one result: written, replaced and removed together
STAGING_PREFIX = ".inspect-staging-"
# The names an error message gives each argument: the Python keyword here, the flag in attnlab inspect.
PY_NAMES = {
    "text": "text",
    "left_pad": "left_pad",
    "max_tokens": "max_tokens",
    "probe_len": "probe_len",
    "probe_batch": "probe_batch",
    "out_dir": "out_dir",
    "overwrite": "overwrite=True",
}


@dataclass
class HeadReport:
    """Scores, kinds and the text's weights of every head; see :func:`inspect`.

    Attributes:
        scores: ``{name: (L, H) float32}`` for every name in :data:`attnlab.heads.scores.SCORE_NAMES`;
            NaN for a score the text (or the probe) is too short to tell (``too_short`` says why).
        kinds: ``kinds[l][h]``, one of :data:`attnlab.heads.scores.KINDS` (``undecided``: too short to tell).
        weights: per layer, ``(H, T, T)`` float32: the text's attention weights (masked keys 0).
        token_ids, tokens: the text's ids and the string of each (``tokenizer.decode([id])``).
        key_padding: ``(T,)`` bool, True = a padding token (left padding), or None.
        n_kv_heads: K/V heads per layer (GQA groups: query head ``h`` reads K/V head ``h // (H // G)``).
        probe: ``n``, ``batch``, ``seed`` of the probe, and the model's loss on its first and second copy.
        windows: per layer, the sliding window of its attention (None: full causal); the page
            draws keys outside a window as masked.
        too_short: ``{score: why}`` for each score too short to tell (:func:`attnlab.heads.scores.too_short`).
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
    too_short: dict[str, str] = field(default_factory=dict)

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
        """The ``k`` heads with the highest ``score``: ``(layer, head, value)``.

        A score the text is too short to tell has no strongest heads: :class:`UsageError` says why.
        """
        if score in self.too_short:
            raise UsageError(f"{score} is {TOO_SHORT} on this text: {self.too_short[score]}.")
        flat = self.scores[score].flatten()
        values, order = flat.topk(min(k, flat.numel()))
        return [(int(i) // self.n_heads, int(i) % self.n_heads, float(v)) for v, i in zip(values, order, strict=True)]

    def to_json(self, written: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``heads.json``'s content: every score (``null`` where too short to tell) and kind, the tokens,
        thresholds, minimum lengths and probe; ``written`` is the run's id and time (:func:`new_stamp`)."""
        return {
            "format": FORMAT,
            "written": dict(written or {}),
            "model": {
                "name": self.model_name,
                "n_layers": self.n_layers,
                "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads,
                "windows": self.windows,
            },
            "text": {"token_ids": self.token_ids, "tokens": self.tokens, "key_padding": self.key_padding},
            "scores": {name: score_grid(t) for name, t in self.scores.items()},
            "score_docs": SCORE_DOCS,
            "too_short": self.too_short,
            "min_text_rows": MIN_TEXT_ROWS,
            "min_probe_len": MIN_PROBE_LEN,
            "kinds": self.kinds,
            "kind_counts": self.kind_counts(),
            "thresholds": [{"kind": k, "score": s, "op": op, "value": v} for k, s, op, v in THRESHOLDS],
            "probe": self.probe,
        }

    def save(
        self,
        out_dir: str | os.PathLike[str],
        *,
        page: bool = True,
        page_budget_mb: float = 64.0,
        overwrite: bool = False,
    ) -> dict[str, Path]:
        """Write ``heads.json``, ``heads.png`` and (``page=True``) ``index.html`` into ``out_dir`` as one set
        (module docstring); returns their paths.

        An earlier result there is refused (:class:`UsageError` naming its files) unless ``overwrite``;
        with it, the earlier set is replaced whole (its ``index.html`` removed under ``page=False``).
        """
        out = check_writable_dir(Path(out_dir), "out_dir")
        return save_result(self, out, page=page, page_budget_mb=page_budget_mb, overwrite=overwrite).paths


# ---- writing the result as a set --------------------------------------------------------------


def new_stamp() -> dict[str, str]:
    """``{"id", "time"}`` of one write: every file of a result carries it, so a reader can tell runs apart."""
    return {"id": uuid.uuid4().hex[:12], "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _earlier_result(out: Path) -> str | None:
    """``"heads.json, heads.png, index.html of TinyGPT, written 2025-06-01T12:00:00+00:00"``, or None: no result there."""
    present = [name for name in RESULT_FILES if (out / name).exists() or (out / name).is_symlink()]
    if not present:
        return None
    model, when = None, None
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        data = json.loads((out / "heads.json").read_text(encoding="utf-8"))
        model, when = data["model"]["name"], data.get("written", {}).get("time")
    if when is None:
        with contextlib.suppress(OSError):
            mtime = max((out / name).stat().st_mtime for name in present)
            when = datetime.fromtimestamp(mtime, timezone.utc).isoformat(timespec="seconds")
    about = ", ".join(part for part in (f"of {model}" if model else "", f"written {when}" if when else "") if part)
    return ", ".join(present) + (f" {about}" if about else "")


def _sibling(out: Path) -> Path:
    """``runs/inspect-2`` (or -3, ...): the first name next to ``out`` that holds no result yet."""
    n = 2
    while _earlier_result(candidate := out.with_name(f"{out.name}-{n}")) is not None:
        n += 1
    return candidate


def check_result_dir(out: Path, *, overwrite: bool, names: Mapping[str, str] = PY_NAMES) -> None:
    """Refuse to replace an earlier result in ``out`` unless ``overwrite``; the message says which files,
    from which model and when, and the two fixes (as ``attnlab train`` refuses a run directory)."""
    earlier = _earlier_result(out)
    if earlier is None or overwrite:
        return
    raise UsageError(
        f"{names['out_dir']} {str(out)!r} already holds an inspect result ({earlier}), and attnlab never "
        f"replaces one unasked; replace it with {names['overwrite']}, or keep it and write to "
        f"{names['out_dir']} {str(_sibling(out))!r}."
    )


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """The stop signals (Ctrl-C, SIGTERM, SIGHUP, ...) held back inside the block and delivered as it ends, so that an interrupt
    cannot split the renames of a set.

    The Python handlers are swapped for one that notes the signal, rather than the signals blocked:
    a signal sent to the process reaches whichever thread does not block it (torch's, pytest's), and
    only the handlers, which always run in the main thread, are sure to hold it. On the way out the
    usual handlers come back and a held signal is raised again, to be handled by them. A no-op off
    the main thread, where the handlers cannot be changed (and signals do not interrupt).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        held.append(signum)

    usual = {sig: signal.signal(sig, hold) for sig in STOP_SIGNALS}  # SIGHUP, SIGQUIT, ... too: the same split
    try:
        yield
    finally:
        for sig, handler in usual.items():
            signal.signal(sig, handler)
        if held:
            signal.raise_signal(held[0])  # its usual handler runs here: KeyboardInterrupt, Terminated, or the default


@dataclass
class Saved:
    """What :func:`save_result` wrote: ``paths`` by kind, and the files of an earlier result it removed."""

    out: Path
    paths: dict[str, Path]
    removed: list[str]
    stamp: dict[str, str]

    def describe(self) -> str:
        """``"runs/x/heads.json, runs/x/heads.png (removed the earlier index.html)"``."""
        gone = f" (removed the earlier {', '.join(self.removed)})" if self.removed else ""
        return ", ".join(str(p) for p in self.paths.values()) + gone


def _stage(report: HeadReport, staging: Path, *, page: bool, page_budget_mb: float, stamp: dict[str, str]) -> None:
    """Write every file of the set into ``staging``: heads.json, heads.png, index.html (``page``)."""
    from ..runtime import atomic_write_text

    atomic_write_text(staging / "heads.json", json.dumps(report.to_json(stamp), indent=1) + "\n")
    plot_scores(report, staging / "heads.png", stamp=stamp)
    if page:
        from .page import write_page

        write_page(report, staging / "index.html", budget_mb=page_budget_mb, stamp=stamp)


def _commit(staging: Path, out: Path, written: Sequence[str]) -> list[str]:
    """Move the staged files into ``out`` and remove the earlier result's others; returns those removed."""
    removed = []
    for name in RESULT_FILES:
        target = out / name
        if name in written:
            os.replace(staging / name, target)
        elif target.exists() or target.is_symlink():
            target.unlink()
            removed.append(name)
    staging.rmdir()
    return removed


def save_result(
    report: HeadReport,
    out: Path,
    *,
    page: bool = True,
    page_budget_mb: float = 64.0,
    overwrite: bool = False,
    names: Mapping[str, str] = PY_NAMES,
    stamp: dict[str, str] | None = None,
) -> Saved:
    """Write the result of ``report`` into the existing directory ``out`` as one set (module docstring).

    An interrupt before the set is in place leaves ``out`` as it was; one that arrives while it is
    moved in is delivered after, and is marked (:func:`attnlab.runtime.keep`) as having kept the
    whole new result. A write that fails (a full disk) is a :class:`UsageError` saying nothing was replaced.
    """
    if not page_budget_mb >= 0:
        raise UsageError(f"page_budget_mb must be >= 0 (MiB of full patterns in the page), got {page_budget_mb!r}.")
    check_result_dir(out, overwrite=overwrite, names=names)
    stamp = stamp or new_stamp()
    staging = out / f"{STAGING_PREFIX}{stamp['id']}"
    written = ["heads.json", "heads.png", *(["index.html"] if page else [])]
    committing = committed = False
    try:
        staging.mkdir()
        _stage(report, staging, page=page, page_budget_mb=page_budget_mb, stamp=stamp)
        with _interrupts_held():
            committing = True
            removed = _commit(staging, out, written)
            committed = True
    except INTERRUPTS as err:
        if committed:
            keep(err, f"the whole new result in {out} ({', '.join(written)})")
        raise
    except OSError as err:
        state = (
            "it was only partly moved in, so rerun to replace it whole" if committing else "nothing there was replaced"
        )
        raise UsageError(
            f"the result could not be written into {str(out)!r} ({err.strerror or err}); {state}; free some "
            f"space, or pass another {names['out_dir']}."
        ) from None
    finally:
        if not committed and staging.exists():
            with _interrupts_held():
                shutil.rmtree(staging, ignore_errors=True)
    kinds = {"heads.json": "json", "heads.png": "png", "index.html": "html"}
    return Saved(out, {kinds[name]: out / name for name in written}, removed, stamp)


def plot_scores(report: HeadReport, path: Path, *, stamp: Mapping[str, str] | None = None) -> Path:
    """One heat map per score, layers down and heads across; a score too short to tell is a grey panel
    saying so. ``stamp`` (the run's id and time) goes into the PNG's ``Comment``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..runtime import atomic_write_bytes

    names = ("induction", "prev_token", "duplicate", "sink", "diagonal", "uniformity", "distance", "entropy")
    L, H = report.n_layers, report.n_heads
    fig, axes = plt.subplots(1, len(names), figsize=(2.0 + 1.1 * len(names) * max(H, 4) / 4, 1.2 + 0.22 * L))
    for ax, name in zip(axes, names, strict=True):
        ax.set_xlabel("head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.tick_params(labelsize=6)
        if name in report.too_short:
            ax.set_title(f"{name}: {TOO_SHORT}", fontsize=7)
            ax.set_xlim(-0.5, H - 0.5)
            ax.set_ylim(L - 0.5, -0.5)
            ax.set_facecolor("#e6e6e6")
            ax.text(0.5, 0.5, TOO_SHORT.replace(" to ", "\nto "), transform=ax.transAxes, ha="center", va="center")
            continue
        values = report.scores[name].numpy()
        vmax = 1.0 if name not in ("distance", "entropy") else max(float(values.max()), 1e-6)
        image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_title(name, fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02).ax.tick_params(labelsize=6)
    fig.suptitle(f"{report.model_name}: head scores ({L} layers x {H} heads)", fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    comment = f"attnlab.heads run {stamp['id']} written {stamp['time']}" if stamp else "attnlab.heads"
    fig.savefig(buf, format="png", dpi=110, metadata={"Comment": comment})
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path


# ---- limits, checked before any work ----------------------------------------------------------


def available_memory() -> int | None:
    """Bytes this machine can give now (:func:`attnlab.runtime.available_bytes` of the CPU), or None: unknown."""
    return available_bytes("cpu")


def memory_needed(heads: Sequence[int], vocab: int, t: int, n: int, batch: int) -> int:
    """Bytes inspect holds at its peak, about: ``heads`` is the query heads of each layer.

    Kept to the end: every head's float32 weights of the text (``T^2`` each) and of the probe
    (``batch x (2n)^2``), 4 bytes a weight: that is the ``layers x heads x T^2 x 4 bytes`` term.
    On top, while one pass runs: 8 copies of one layer's weights (the attention's own, the float32
    copy kept, the float64 copies scoring makes) and the logits (float32 and the loss's copy).
    """
    probe_t = 2 * n
    kept = 4 * sum(heads) * (t * t + batch * probe_t * probe_t)
    one_layer = 4 * 8 * max(heads) * max(t * t, batch * probe_t * probe_t)
    logits = 8 * vocab * max(t, batch * probe_t)
    return kept + one_layer + logits


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _check_memory(
    heads: Sequence[int], vocab: int, t: int, n: int, batch: int, names: Mapping[str, str], *, bound: bool = False
) -> None:
    """A :class:`LimitError` with the figures when :func:`memory_needed` exceeds :func:`available_memory`;
    ``bound``: the figures are a lower bound (one layer of one head, before the model is loaded)."""
    avail = available_memory()
    need = memory_needed(heads, vocab, t, n, batch)
    if avail is None or need <= avail:
        return
    t_fit = largest_fitting(lambda x: memory_needed(heads, vocab, x, n, batch) <= avail, 2, t)
    b_fit = largest_fitting(lambda x: memory_needed(heads, vocab, min(t, 2), n, x) <= avail, 1, batch)
    n_fit = largest_fitting(lambda x: memory_needed(heads, vocab, min(t, 2), x, batch) <= avail, 2, n)
    if b_fit >= 1:
        probe_fix = f"{names['probe_batch']} {b_fit} at most could"
    elif n_fit >= 2:
        probe_fix = f"{names['probe_len']} {n_fit} at most could (with {names['probe_batch']} {batch})"
    else:
        probe_fix = f"not even {names['probe_len']} 2 with {names['probe_batch']} 1 could: this machine is too full"
    fix = (
        f"at most {t_fit} tokens (text and {names['left_pad']} together) fit with this probe: shorten the text "
        f"or the padding"
        if t_fit >= 2
        else f"the probe alone does not fit: {probe_fix}"
    )
    what = (
        f"even a model of one layer and one head would keep about {_gb(need)} in memory ({t}^2 x 4 bytes of "
        f"weights for {t} tokens"
        if bound
        else f"inspecting {t} tokens keeps about {_gb(need)} in memory ({len(heads)} layers x {max(heads)} heads x "
        f"{t}^2 x 4 bytes of text weights"
    )
    raise LimitError(
        f"{what}, the probe's {batch} x {2 * n}^2 weights a head, and one pass's working copies), more than the "
        f"{_gb(avail)} this machine has available; {fix}."
    )


def check_before_load(*, left_pad: int, max_tokens: int, probe_batch: int, names: Mapping[str, str] = PY_NAMES) -> None:
    """The limits that need no model, checked first (cheap): the padding leaves room for a text of 2
    tokens under ``max_tokens``, and even a one-layer, one-head model would fit in memory."""
    if left_pad + 2 > max_tokens:
        raise LimitError(
            f"{names['left_pad']} {left_pad} leaves no room for the text under {names['max_tokens']} {max_tokens} "
            f"(the text, at least 2 tokens, and its padding count together); {names['left_pad']} can be at most "
            f"{max_tokens - 2}, or raise {names['max_tokens']}."
        )
    _check_memory([1], 1, left_pad + 2, 2, probe_batch, names, bound=True)  # the real model has more heads


def check_request(
    model: nn.Module,
    n_text: int,
    *,
    left_pad: int,
    max_tokens: int,
    probe_len: int,
    probe_batch: int,
    names: Mapping[str, str] = PY_NAMES,
) -> int:
    """Refuse, before the model runs, a text longer than ``max_tokens`` or the model's context, and a
    run that would not fit in memory; returns the probe's ``n`` (``probe_len``, capped at half the context)."""
    t = n_text + left_pad
    has = f"{names['text']} has {n_text} tokens" + (
        f" and {names['left_pad']} adds {left_pad}: {t} in all" if left_pad else ""
    )
    beside = f" beside {names['left_pad']} {left_pad}" if left_pad else ""
    shorten = "shorten the text or the padding" if left_pad else "shorten it"
    if t > max_tokens:
        raise LimitError(
            f"{has}, more than {names['max_tokens']} {max_tokens}; at most {max_tokens - left_pad} tokens of text fit"
            f"{beside}: {shorten}, or raise {names['max_tokens']} (every head's T x T weights are kept)."
        )
    block = _block_size(model)
    if block is not None and t > block:
        raise LimitError(
            f"{has}, past the model's context of {block} tokens (its config.block_size); at most "
            f"{max(block - left_pad, 0)} tokens of text fit{beside}: {shorten}."
        )
    if block is not None and block < 4:
        raise LimitError(f"the model's context ({block} tokens) is shorter than the probe's least, 4 (2 x 2 tokens).")
    n = probe_len if block is None else min(probe_len, block // 2)
    heads = [layer.num_heads for layer in attention_layers(model)]
    _check_memory(heads, _vocab_size(model), t, n, probe_batch, names)
    return n


def encode_text(text: str | Sequence[int] | Tensor, tokenizer: Any, names: Mapping[str, str] = PY_NAMES) -> list[int]:
    """The ids of ``text`` (a string through ``tokenizer``, or ids as they are); at least 2, or a :class:`UsageError`."""
    if isinstance(text, str):
        if tokenizer is None:
            raise UsageError(
                f"{names['text']} is a string but there is no tokenizer to encode it; pass tokenizer=... or token ids."
            )
        check_text(text, names["text"])  # a byte the shell could not decode, named, not a tokenizer's error
        try:
            ids = list(tokenizer.encode(text))
        except Exception as err:  # a tokenizer's own complaint, of whatever type: one line, not a traceback
            raise UsageError(f"the tokenizer cannot encode {names['text']}: {err}") from None
    elif isinstance(text, Tensor):
        if text.dim() == 2 and text.size(0) == 1:
            text = text[0]
        if text.dim() != 1 or text.dtype not in (torch.int64, torch.int32):
            raise UsageError(
                f"text as a tensor must be one sequence of int64 ids, (T,) or (1, T); got {text.dtype} {tuple(text.shape)}"
            )
        ids = [int(i) for i in text]
    else:
        ids = [int(i) for i in text]
    if len(ids) < 2:
        raise UsageError(
            f"{names['text']} has {len(ids)} token(s); inspect needs at least 2 to score the heads (and "
            f"{min(MIN_TEXT_ROWS[s] for s in ('prev_token', 'sink')) + 1} or more to tell most kinds apart)."
        )
    return ids


def _check_vocab(ids: Sequence[int], pad_id: int, vocab: int) -> None:
    bad = [i for i in [*ids, pad_id] if not 0 <= i < vocab]
    if bad:
        raise UsageError(
            f"token id {bad[0]} is outside the model's vocabulary (0 .. {vocab - 1}); pass ids below {vocab}."
        )


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


def _check_arguments(left_pad: int, probe_len: int, probe_batch: int, max_tokens: int, seed: int) -> None:
    check_range("left_pad", left_pad, low=0, integer=True)
    check_range("probe_len", probe_len, low=2, integer=True)
    check_range("probe_batch", probe_batch, low=1, integer=True)
    check_range("max_tokens", max_tokens, low=2, integer=True)
    check_range("probe_seed", seed, low=0, high=2**63 - 1, integer=True)


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
        text: a string (with ``tokenizer``) or token ids; at least 2 tokens. Scores that need more
            (:data:`attnlab.heads.scores.MIN_TEXT_ROWS`) are NaN and named in ``report.too_short``.
        tokenizer: anything with ``encode(str) -> ids`` and ``decode(ids) -> str`` (attnlab's, HF's).
        left_pad: prepend this many ``pad_id`` tokens marked as padding (``key_padding_mask``), to see
            how the model's masks treat them; the model must accept ``key_padding_mask``.
        probe_len: ``n``, the length of the random sequence the probe repeats (capped at half the
            model's block size); ``probe_batch`` sequences, drawn with ``probe_seed``.
        max_tokens: refuse a longer text, padding included (the weights of every head are kept in memory).

    Raises:
        UsageError: a bad argument (an empty text, an id outside the vocabulary, a negative ``left_pad``).
        LimitError: text and padding past ``max_tokens`` or the model's context, or more weights than
            this machine's available memory holds; raised before the model runs, with the number that fits.

    Returns:
        A :class:`HeadReport`.
    """
    _check_arguments(left_pad, probe_len, probe_batch, max_tokens, probe_seed)
    check_before_load(left_pad=left_pad, max_tokens=max_tokens, probe_batch=probe_batch)
    layers = attention_layers(model)
    ids = encode_text(text, tokenizer)
    vocab = probe_vocab or _vocab_size(model)
    _check_vocab(ids, pad_id, _vocab_size(model))
    n = check_request(
        model, len(ids), left_pad=left_pad, max_tokens=max_tokens, probe_len=probe_len, probe_batch=probe_batch
    )
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

    probe = make_probe(vocab, n, probe_batch, seed=probe_seed).to(device)
    logits, probe_weights = run_and_capture(model, probe)
    for scores, w in zip(per_layer, probe_weights, strict=True):
        scores.update(probe_scores(w, n))
    loss = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), probe[:, 1:], reduction="none")  # (B, 2n-1)
    probe_info: dict[str, Any] = {
        "n": n,
        "batch": probe_batch,
        "seed": probe_seed,
        "loss_first_copy": round(float(loss[:, : n - 1].mean()), 4),
        "loss_second_copy": round(float(loss[:, n:].mean()), 4),
    }
    if n < probe_len:
        probe_info["requested_n"] = probe_len  # capped at half the model's context

    short = too_short(len(ids) - 1, n)
    raw = {name: torch.stack([s[name] for s in per_layer]) for name in SCORE_NAMES}  # (L, H) each
    assert set(raw) == set(TEXT_SCORES) | set(PROBE_SCORES)
    scores = mark_too_short(raw, short)
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
        too_short=short,
    )
