"""``attnlab check``: build or import the target, run the suite, print a table or JSON."""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import torch
from torch import nn

from ..core.attention import Backend, MultiHeadAttention
from ..runtime import UsageError, check_range
from .adapters import AttentionAdapter, TorchMHAAdapter, as_adapter, call_factory
from .report import print_tables, to_json
from .result import Report
from .suite import CHECKS, run_checks

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class TargetError(UsageError):
    """A ``--target`` that cannot be built; its message is the one line shown to the user."""


def _random_biases(module: ModuleT, seed: int) -> ModuleT:
    """Nonzero biases (both libraries init them to 0), so that a bias bug cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


def _factory_target(spec: str, kwargs: dict) -> AttentionAdapter:
    """``package.module:factory`` called with whichever of ``kwargs`` its signature names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TargetError(
            f"--target {spec!r} is not 'attnlab', 'torch' or 'package.module:factory'; pass e.g. --target mypkg.layers:make_attention."
        )
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's own package in the current folder imports
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(
            f"--target {spec!r}: module {module_name!r} cannot be imported ({e}); check that it is on PYTHONPATH."
        ) from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise TargetError(
            f"--target {spec!r}: {module_name} has no callable {attr!r}; name a function returning an nn.Module or an adapter."
        )
    try:
        built = call_factory(factory, **kwargs)
    except Exception as e:  # the user's code: show its complaint in one line, not a traceback
        raise TargetError(
            f"--target {spec!r}: calling {attr}() raised {type(e).__name__}: {e}; a factory takes no arguments "
            f"besides any of {sorted(kwargs)} and returns an nn.Module or an adapter."
        ) from None
    try:
        adapter = as_adapter(built)
    except TypeError as e:
        raise TargetError(f"--target {spec!r}: {e}") from None
    if isinstance(adapter, AttentionAdapter) and adapter.factory is None:
        adapter.factory = factory  # the head-dim and head-layout checks rebuild the target through it
    return adapter


def _targets(
    target: str,
    backend: Backend | Literal["both"],
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    dropout: float,
    need_weights: bool,
    seed: int,
) -> list[object]:
    torch.manual_seed(seed)
    if target == "attnlab":
        backends: tuple[Backend, ...] = ("math", "sdpa") if backend == "both" else (backend,)
        return [
            _random_biases(
                MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, dropout=dropout, backend=b), seed
            )
            for b in backends
        ]
    if target == "torch":
        if num_kv_heads not in (None, num_heads):
            raise TargetError(
                f"--num-kv-heads {num_kv_heads} with --target torch: torch.nn.MultiheadAttention has no GQA; drop the flag."
            )
        m = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True)
        return [TorchMHAAdapter(_random_biases(m, seed), need_weights=need_weights)]
    kwargs = {"embed_dim": embed_dim, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "dropout": dropout}
    return [_factory_target(target, kwargs)]


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


def _run_all(
    targets: Sequence[object],
    names: Sequence[str],
    *,
    seed: int,
    batch_size: int,
    seq_len: int,
    on_check: Callable[[str, str, int], None],
) -> list[Report]:
    """Every check on every target, one at a time so that progress can be shown: ``on_check(target, check,
    done)`` is called before each, ``done`` counting the checks finished. Each check seeds its own inputs
    (see :class:`attnlab.check.suite.Context`), so the figures equal those of one ``run_checks`` call."""
    reports, done = [], 0
    for t in targets:
        adapter = as_adapter(t)  # once: its name shows in the progress
        rows, first = [], None
        for name in names:
            on_check(adapter.name, name, done)
            report = run_checks(adapter, checks=[name], seed=seed, batch=batch_size, seq_len=seq_len)
            first = first or report
            rows += report.results
            done += 1
        assert first is not None  # names is never empty
        reports.append(Report(first.target, rows, first.config))
    return reports


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
    seq_len: int = 8,
    seed: int = 0,
    checks: tuple[str, ...] = (),
) -> int:
    """Audit an attention module against attnlab's float64 reference; exit code 1 if a check fails.

    Args:
        target: 'attnlab', 'torch' (torch.nn.MultiheadAttention) or 'package.module:factory'
            (returns an nn.Module following attnlab's convention, or an adapter; called with
            whichever of embed_dim, num_heads, num_kv_heads, dropout it accepts; one that takes
            embed_dim and num_heads is also called at other sizes, for the head-dim checks).
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
    """
    _validate(target, embed_dim, num_heads, num_kv_heads, dropout, batch_size, seq_len, checks)
    targets = _targets(target, backend, embed_dim, num_heads, num_kv_heads, dropout, need_weights, seed)
    names = list(checks) or list(CHECKS)
    reports = _with_progress(targets, names, json=json, seed=seed, batch_size=batch_size, seq_len=seq_len)
    if json:
        print(to_json(reports))
    else:
        print_tables(reports)
    return 0 if all(r.ok for r in reports) else 1


def _with_progress(
    targets: Sequence[object], names: Sequence[str], *, json: bool, seed: int, batch_size: int, seq_len: int
) -> list[Report]:
    """Run the checks showing what runs: a live bar on a terminal, one plain line per target otherwise.

    With --json, stdout carries the JSON alone: the bar goes to stderr when that is a terminal, else nothing shows.
    """
    stream = sys.stderr if json else sys.stdout
    run = lambda on_check: _run_all(
        targets, names, seed=seed, batch_size=batch_size, seq_len=seq_len, on_check=on_check
    )
    if not stream.isatty():
        if json:
            return run(lambda target, name, done: None)
        seen: list[str] = []

        def plain(target: str, name: str, done: int) -> None:
            if target not in seen:
                seen.append(target)
                print(f"checking {target}: {len(names)} checks ...", flush=True)

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
