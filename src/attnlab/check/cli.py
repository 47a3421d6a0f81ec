"""``attnlab check``: build or import the target, run the suite, print a table or JSON.

``--model smollm2 --layer N`` audits one layer of a real pretrained model instead: its
:class:`MultiHeadAttention`, with its own weights and widths (SmolLM2: 576 wide, 9 query heads,
3 key/value heads). :func:`model_layer` finds that layer; ``attnlab trace`` uses it too.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, cast

import torch
from torch import nn

from ..core.attention import Backend, MultiHeadAttention
from ..runtime import INTERRUPTS, UsageError, check_range, interrupt_exit, keep
from ..weight_files import pretrained
from ..weight_files.precision import is_gguf_source
from .adapters import TorchMHAAdapter
from .device import place, resolve_device, resolve_dtype
from .mla import MLAAdapter
from .mla_checks import MLA_CHECKS, run_mla
from .probe import as_adapter
from .projections import NotAttention
from .report import print_tables, to_json
from .result import CheckError, CheckResult, Report
from .runner import diagnosed, run_checks
from .suite import CHECKS, SEQ_LEN, raised_in_target
from .target import TargetError, build_target, random_biases

# Where to report a failure of check's own code (exit code 3).
REPORT_TO = "the attnlab maintainers (the project's issue tracker), with the command and the traceback"
SLOW_ON_MODELS = "gradcheck[plain]"  # one forward per input element: 2304 of them at SmolLM2's width, ~70 s on 2 cores


def model_layer(command: str, model: str, layer: int) -> tuple[nn.Module, str, MultiHeadAttention]:
    """``(the model, the layer's name, its attention)``: the ``layer``-th :class:`MultiHeadAttention` of
    ``from_pretrained(model)`` in float32 (see :func:`say_layer_weights`); a :class:`UsageError` naming the valid
    range when there is none."""
    lm, _ = pretrained.from_pretrained(model, dtype=torch.float32)  # UsageError naming what is wrong with it
    layers = [(name, m) for name, m in lm.named_modules() if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise UsageError(
            f"--model {model!r} holds no attnlab MultiHeadAttention to {command}; pass a model that "
            f"from_pretrained builds with attnlab attention, e.g. --model smollm2."
        )
    if not 0 <= layer < len(layers):
        raise UsageError(
            f"--layer {layer} is out of range: --model {model!r} has {len(layers)} attention layers, "
            f"0 .. {len(layers) - 1}; pass one of them, e.g. attnlab {command} --model {model} --layer {len(layers) - 1}"
        )
    name, attn = layers[layer]
    return lm, name, attn


def say_layer_weights(command: str, model: str) -> None:
    """One line on stderr, once the flags are accepted: the layer's weights are float32 (a GGUF file's blocks
    dequantized once at load), and why: check compares with a float64 reference and trace prints the float
    model's numbers, which the quantized kernels' int8 rounding would blur."""
    why = (
        "the float64 reference is compared with the float model, not with int8 rounding; --dtype sets the "
        "dtype the checks compute in"
        if command == "check"
        else "each stage's numbers as the float model computes them"
    )
    print(
        f"attnlab: weights float32: {command}'s default for a real model's layer: its exact float weights"
        f"{' (the GGUF blocks dequantized once at load)' if is_gguf_source(model) else ''}; {why}",
        file=sys.stderr,
        flush=True,
    )


def model_flag_conflicts(
    command: Callable[..., int], model: str, layer: int, given: Mapping[str, tuple[object, object]]
) -> None:
    """With ``--model``, the layer's own sizes are used: a flag set to something else is a mistake, not ignored.

    ``given`` maps a flag to ``(its value, the layer's)``; a flag at ``command``'s default or at the
    layer's value is fine.
    """
    defaults = {n: p.default for n, p in inspect.signature(command).parameters.items()}
    for flag, (value, own) in given.items():
        if value != defaults[flag.removeprefix("--").replace("-", "_")] and value != own:
            what = "the layer as the model calls it" if own is None else f"the layer's own ({own})"
            name = command.__name__.removesuffix("_command")
            raise UsageError(
                f"{flag} {value} does not apply with --model {model!r}, which runs {what}; drop {flag} "
                f"(attnlab {name} --model {model} --layer {layer})."
            )


def _targets(
    target: str,
    backend: Backend | Literal["both"],
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    dropout: float,
    need_weights: bool,
    seed: int,
    scale: float | None,
    mask_convention: Literal["keep", "block"] | None,
    device: torch.device,
    dtype: torch.dtype,
) -> list[object]:
    """The targets, built on the CPU as their seeds draw them, then moved to ``device`` in ``dtype``."""
    torch.manual_seed(seed)
    if target == "attnlab":
        backends: tuple[Backend, ...] = ("math", "sdpa") if backend == "both" else (backend,)
        built = [
            random_biases(
                MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, dropout=dropout, backend=b), seed
            )
            for b in backends
        ]
        return [place(m, device, dtype, copy_module=False) for m in built]
    if target == "torch":
        if num_kv_heads not in (None, num_heads):
            raise TargetError(
                f"--num-kv-heads {num_kv_heads} with --target torch: torch.nn.MultiheadAttention has no GQA; drop the flag."
            )
        m = random_biases(nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True), seed)
        moved = cast(nn.MultiheadAttention, place(m, device, dtype, copy_module=False))
        return [TorchMHAAdapter(moved, need_weights=need_weights)]
    return [
        build_target(
            target,
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            seed=seed,
            scale=scale,
            mask_convention=mask_convention,
            device=device,
            dtype=dtype,
        )
    ]


def _validate(
    target: str,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    dropout: float,
    batch_size: int,
    seq_len: int,
    checks: Sequence[str],
) -> None:
    """The flags, before any target is built; raises :class:`UsageError`."""
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise UsageError(
            f"--checks got unknown names {unknown}, expected names among {list(CHECKS)}; e.g. --checks parity_self."
        )
    check_range("--embed-dim", embed_dim, low=1, integer=True)
    check_range("--num-heads", num_heads, low=1, integer=True)
    if num_kv_heads is not None:
        check_range("--num-kv-heads", num_kv_heads, low=1, high=num_heads, integer=True, hint="leave it out for MHA")
    check_range("--dropout", dropout, low=0, high=1, high_inclusive=False)
    check_range("--batch-size", batch_size, low=1, integer=True)
    check_range("--seq-len", seq_len, low=4, integer=True, hint="the checks pad 3 tokens and split halves")
    if target in ("attnlab", "torch") and embed_dim % num_heads:
        heads = [h for h in range(1, embed_dim + 1) if embed_dim % h == 0]
        nearest = sorted(sorted(heads, key=lambda h: abs(h - num_heads))[:2])
        raise UsageError(
            f"--embed-dim {embed_dim} is not divisible by --num-heads {num_heads}; "
            f"pass --num-heads among its divisors (nearest: {nearest})."
        )
    if target == "attnlab" and num_kv_heads is not None and num_heads % num_kv_heads:
        groups = [g for g in range(1, num_heads + 1) if num_heads % g == 0]
        raise UsageError(
            f"--num-heads {num_heads} is not divisible by --num-kv-heads {num_kv_heads}; "
            f"pass --num-kv-heads among {groups}."
        )


def _model_targets(
    model: str,
    layer: int,
    target: str,
    backend: Backend | Literal["both"],
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    dropout: float,
    batch_size: int,
    seq_len: int,
    checks: Sequence[str],
    device: torch.device,
    dtype: torch.dtype,
) -> list[object]:
    """Copies of layer ``layer`` of ``model``'s attention, one per backend, on ``device`` in ``dtype`` (the
    checks may retrain or switch a module; the loaded model is left as it was)."""
    if target != "attnlab":
        raise UsageError(
            f"--target {target!r} and --model {model!r} both name what to check; pass one: "
            f"attnlab check --model {model} --layer {layer}"
        )
    _, _, attn = model_layer("check", model, layer)
    model_flag_conflicts(
        check,
        model,
        layer,
        {
            "--embed-dim": (embed_dim, attn.embed_dim),
            "--num-heads": (num_heads, attn.num_heads),
            "--num-kv-heads": (num_kv_heads, attn.num_kv_heads),
            "--dropout": (dropout, attn.dropout),
        },
    )
    _validate(target, attn.embed_dim, attn.num_heads, attn.num_kv_heads, attn.dropout, batch_size, seq_len, checks)
    say_layer_weights("check", model)
    backends: tuple[Backend, ...] = ("math", "sdpa") if backend == "both" else (backend,)
    copies: list[object] = []
    for b in backends:
        m = copy.deepcopy(attn).to(device=device, dtype=dtype)  # a checkpoint's bf16 is checked in --dtype
        m.backend = b
        copies.append(m.eval())
    return copies


def _run_all(
    targets: Sequence[object],
    names: Sequence[str],
    *,
    seed: int,
    batch_size: int,
    seq_len: int,
    on_check: Callable[[str, str, int], None],
    strict: bool = False,
) -> list[Report]:
    """Every check on every target, one at a time so that progress can be shown: ``on_check(target, check,
    done)`` is called before each, ``done`` counting the checks finished. Each check seeds its own inputs
    (see :class:`attnlab.check.suite.Context`), so the figures equal those of one ``run_checks`` call."""
    reports: list[Report] = []
    done = 0
    total = len(targets) * len(names)
    for t in targets:
        if isinstance(t, MLAAdapter):  # multi-head latent attention: its own rows (attnlab.check.mla_checks)
            reports.append(_run_mla(t, seed=seed, batch=batch_size, seq_len=seq_len, strict=strict, on_check=on_check))
            done += len(MLA_CHECKS)
            continue
        adapter = as_adapter(t)  # once: its name shows in the progress
        rows: list[CheckResult] = []
        first: Report | None = None
        try:
            for name in names:
                on_check(adapter.name, name, done)
                report = run_checks(
                    adapter, checks=[name], seed=seed, batch=batch_size, seq_len=seq_len, diagnose=False
                )
                first = first or report
                rows += report.results
                done += 1
            assert first is not None  # names is never empty
            whole = Report(first.target, rows, first.config, strict=strict)
            if whole.failing:
                on_check(adapter.name, "diagnosis", done)
                diagnosed(adapter, whole, seed=seed, batch=batch_size, seq_len=seq_len)
        except INTERRUPTS as err:  # the rows that finished are results: hand them up, marked partial
            how, _ = interrupt_exit(err)
            if first is not None:
                reports.append(Report(first.target, rows, first.config))
            for r in reports:
                r.partial = f"interrupted ({how}) after {done} of {total} checks"
            err.attnlab_reports = reports  # type: ignore[union-attr]
            raise
        reports.append(whole)
    return reports


def _run_mla(
    adapter: MLAAdapter,
    *,
    seed: int,
    batch: int,
    seq_len: int,
    strict: bool,
    on_check: Callable[[str, str, int], None],
) -> Report:
    """The MLA rows on ``adapter``; an exception outside the module's code is check's own (:class:`CheckError`)."""
    count = iter(range(len(MLA_CHECKS) + 1))
    try:
        return run_mla(
            adapter,
            seed=seed,
            batch=batch,
            seq_len=seq_len,
            strict=strict,
            on_check=lambda name: on_check(adapter.name, name, next(count, len(MLA_CHECKS))),
        )
    except INTERRUPTS:
        raise
    except Exception as err:
        if raised_in_target(err):
            raise
        raise CheckError("running the MLA checks", err) from err


def check(
    target: str = "attnlab",
    backend: Literal["both", "auto", "math", "sdpa"] = "both",
    json: bool = False,
    embed_dim: int = 32,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    dropout: float = 0.1,
    need_weights: bool = True,
    batch_size: int = 2,
    seq_len: int = SEQ_LEN,
    seed: int = 0,
    checks: tuple[str, ...] = (),
    model: str | None = None,
    layer: int | None = None,
    scale: float | None = None,
    mask_convention: Literal["keep", "block"] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    strict: bool = False,
    debug: bool = False,
) -> int:
    """Audit an attention module against attnlab's float64 reference, with a 'Likely cause' section naming the
    mistake when it fails. Exit codes: 0 the module computes attention correctly (parity under every mask form
    it takes, gradients, no causal leak; hardening notes allowed), 1 it does not (or, with --strict, a hardening
    note), 2 a usage error, 3 attnlab check's own failure (not the module's; --debug shows the traceback).

    Args:
        target: 'attnlab', 'torch' (torch.nn.MultiheadAttention), or your module: 'path/to/mine.py:Name'
            or 'package.module:Name', where Name is an nn.Module class, a factory or an instance. A class
            or factory gets whichever of the width (embed_dim, d_model, ...), heads (num_heads, n_heads,
            ...), K/V heads and dropout it takes, and is built again at other sizes for the head-dim
            checks. Any forward works: forward(query, key, value[, attn_mask][, key_padding_mask]
            [, is_causal][, need_weights]), forward(x_query, x_context, mask) or forward(x, mask).
        backend: attnlab backends to audit ('both' = math and sdpa).
        json: print JSON for CI instead of tables (every field; no progress on stdout).
        embed_dim: E.
        num_heads: H.
        num_kv_heads: G (GQA) for attnlab; default H.
        dropout: attention dropout of the built module, in [0, 1); > 0 so that 'dropout off in eval' is checked.
        need_weights: passed to torch.nn.MultiheadAttention on every call (its default is True).
        batch_size: B of the inputs.
        seq_len: T of the inputs (>= 4).
        seed: seeds weights and inputs.
        checks: run only these checks (default: all).
        model: check one layer of a pretrained model instead of a built module: 'smollm2', a .gguf file or a Hugging Face directory; its weights and widths (--embed-dim/--num-heads/--num-kv-heads come from it).
        layer: with --model, which attention layer (0 = the first; default 0).
        scale: the expected multiplier of the scores (default 1/sqrt(head_dim)); a module's own scale attribute is never the truth.
        mask_convention: what a bool mask should mean to your module: keep (True = may attend, the seeds' and SDPA's) or block (True = blocked, nn.MultiheadAttention's). Default: block if its forward looks like nn.MultiheadAttention's (key_padding_mask and need_weights), else keep.
        device: where to check it, as it runs: cpu, cuda, cuda:N, mps, xpu (a device this torch sees). The module, every input, the float64 reference and the diagnosis run there.
        dtype: what to check it in: float32, float64, bfloat16 or float16. In bfloat16/float16 each figure may be 2x plain PyTorch's error in that dtype (flash-attention's rule).
        strict: fail on hardening notes too: NaN/inf in padded key/value rows reaching outputs, fully masked rows, a mask fill float16 cannot hold, float32 softmax in a float64 run. Without it they are printed as notes, each with its fix, and exit 0.
        debug: on a failure of check's own (exit 3), print the traceback as well.
    """
    dev = resolve_device(device, "--device")  # before any work: a device this machine lacks is a usage error
    dt = resolve_dtype(dtype, dev, "--dtype")
    if model is None:
        if layer is not None:
            raise UsageError(
                f"--layer {layer} picks a layer of a pretrained model, and no --model was given; "
                f"pass one: attnlab check --model smollm2 --layer {layer}"
            )
        _validate(target, embed_dim, num_heads, num_kv_heads, dropout, batch_size, seq_len, checks)
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise UsageError(f"--scale {scale} must be a positive number, e.g. --scale 0.125 (1/sqrt(64)).")
        targets = _targets(
            target,
            backend,
            embed_dim,
            num_heads,
            num_kv_heads,
            dropout,
            need_weights,
            seed,
            scale,
            mask_convention,
            dev,
            dt,
        )
    else:
        targets = _model_targets(
            model,
            layer or 0,
            target,
            backend,
            embed_dim,
            num_heads,
            num_kv_heads,
            dropout,
            batch_size,
            seq_len,
            checks,
            dev,
            dt,
        )
    names = list(checks) or list(CHECKS)
    if model is not None and not checks:
        names.remove(SLOW_ON_MODELS)
        print(
            f"attnlab: note: {SLOW_ON_MODELS} (a full float64 Jacobian, about a minute per backend at width "
            f"{cast(MultiHeadAttention, targets[0]).embed_dim}) is left out with --model; ask for it with "
            f"--checks {SLOW_ON_MODELS}",
            file=sys.stderr,
        )
    try:
        reports = _with_progress(
            targets, names, json=json, seed=seed, batch_size=batch_size, seq_len=seq_len, strict=strict
        )
    except INTERRUPTS as err:  # an interrupt is never the target's failure: the rows done, marked partial
        partial: list[Report] = getattr(err, "attnlab_reports", [])
        done = sum(len(r.results) for r in partial)
        if partial and json:
            print(to_json(partial))
        elif partial:
            print_tables(partial)
        where = "printed above" if partial else "none had finished"
        raise keep(err, f"the {done} check(s) done ({where}), marked partial") from None
    except (UsageError, NotAttention):  # about the input: one line and exit 2, from attnlab's main
        raise
    except CheckError as err:
        return _own_failure(err.phase, err.error, debug)
    except Exception as err:  # outside the rows: the target's, or else check's own
        if raised_in_target(err):
            raise
        return _own_failure("running the checks", err, debug)
    try:
        if json:
            print(to_json(reports))
        else:
            print_tables(reports)
    except OSError:  # a closed pipe (attnlab | head): attnlab's main ends quietly
        raise
    except Exception as err:
        return _own_failure("printing the report", err, debug)
    return 0 if all(r.ok for r in reports) else 1


def _own_failure(phase: str, error: BaseException, debug: bool) -> int:
    """Exit code 3, and one line on stderr: check's own code failed (not the module), where, and how to report it;
    with ``debug``, the traceback before it."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    first = str(error).splitlines()[0] if str(error) else ""
    how = "report it" if debug else "rerun with --debug for the traceback and report it"
    print(
        f"attnlab check: internal error of attnlab check itself, not of your module, while {phase}: "
        f"{type(error).__name__}: {first}; {how} to {REPORT_TO}",
        file=sys.stderr,
    )
    return 3


def _with_progress(
    targets: Sequence[object],
    names: Sequence[str],
    *,
    json: bool,
    seed: int,
    batch_size: int,
    seq_len: int,
    strict: bool = False,
) -> list[Report]:
    """Run the checks showing what runs: a live bar on a terminal, one plain line per target otherwise.

    With --json, stdout carries the JSON alone: the bar goes to stderr when that is a terminal, else nothing shows.
    """
    stream = sys.stderr if json else sys.stdout
    run = lambda on_check: _run_all(
        targets, names, seed=seed, batch_size=batch_size, seq_len=seq_len, on_check=on_check, strict=strict
    )
    if not stream.isatty():
        if json:
            return run(lambda target, name, done: None)
        seen: list[str] = []
        mla_names = {t.name for t in targets if isinstance(t, MLAAdapter)}

        def plain(target: str, name: str, done: int) -> None:
            if target not in seen:
                seen.append(target)
                count = len(MLA_CHECKS) if target in mla_names else len(names)
                print(f"checking {target}: {count} checks ...", flush=True)

        start = time.perf_counter()
        reports = run(plain)
        print(f"done in {time.perf_counter() - start:.1f} s\n", flush=True)
        return reports

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=stream), transient=True) as bar:
        task = bar.add_task("checking", total=len(targets) * len(names))
        reports = run(
            lambda target, name, done: bar.update(task, completed=done, description=escape(f"{target}: {name}"))
        )
        bar.update(task, completed=len(targets) * len(names))
        return reports
