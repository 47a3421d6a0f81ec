"""``torchrun --nproc-per-node N -m attnlab bench --context-parallel N``: context-parallel attention, measured per rank.

Every rank of the run holds one shard of the same sequence (same weights, same full input on every
rank, from the seed). For each length, each asked method (``ring``, ``alltoall``) and layout
(``zigzag``, ``contiguous``), it reports per rank: the forward+backward time of
:class:`~attnlab.core.attention.MultiHeadAttention` on its shard, the peak memory of one
forward+backward, the (query, key, head) triples it computed and the bytes it sent (``cp.stats``),
each beside the figure arithmetic predicts. The single-process module on the full sequence is
measured in the same run, on every rank at once (see :func:`_time_all`), as the baseline.

Derived: causal balance (max over mean of the ranks' pair counts), per-rank peak over the
single-process peak (the issue's goal: at most ``1/N + 0.1``), bytes measured vs formula. Rank 0
writes ``bench_context_parallel.json`` and ``.md`` into ``--out-dir``.
"""

from __future__ import annotations

import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.attention import MultiHeadAttention
from ..distributed import LAYOUTS, METHODS, ContextParallel
from ..distributed.failures import Job, RankLost, check_rank_timeout, diagnose, ended, join, mark_left
from ..runtime import (
    INTERRUPTS,
    UsageError,
    atomic_write_text,
    check_range,
    check_writable_dir,
    cpu_info,
    resolve_device,
    resolve_dtype,
)
from .memory import PeakMemory
from .partial import carried_by_interrupts, drop_partial, save_partial
from .table import aligned, terminal_width, wrap

__all__ = ["CP_LENGTHS", "CPResult", "CPRow", "bench_context_parallel", "byte_formula", "pair_formula", "plan_cp"]

CP_LENGTHS: tuple[int, ...] = (4096, 16384)  # the memory goal is stated at T = 16384
STEM = "bench_context_parallel"
SINGLE = "single"  # the method name of the single-process baseline's rows


# -- what to run -----------------------------------------------------------------------------
@dataclass(frozen=True)
class CPPlan:
    """The checked settings of one run: ranks, device, dtype, and the (method, layout) pairs to measure."""

    world: int
    device: torch.device
    dtype: torch.dtype
    combos: tuple[tuple[str, str], ...]
    skipped: dict[str, str]


def _launched_world(n: int) -> int:
    """``WORLD_SIZE`` of this process, which must be ``n``: torchrun started it as one of ``n`` ranks."""
    raw = os.environ.get("WORLD_SIZE")
    fix = f"launch it as `torchrun --nproc-per-node {n} -m attnlab bench --context-parallel {n} ...`"
    if raw is None:
        raise UsageError(
            f"--context-parallel {n} needs {n} processes, one per rank, and this one was started alone "
            f"(WORLD_SIZE is unset); {fix}."
        )
    if not raw.isdigit() or int(raw) != n:
        raise UsageError(
            f"--context-parallel got {n} but this run has WORLD_SIZE={raw} processes; expected the same number: "
            f"pass --context-parallel {raw} or {fix}."
        )
    return n


def _cp_device(name: str) -> torch.device:
    """The device: CPU (gloo) or CUDA (nccl), the two backends ContextParallel runs on."""
    try:
        kind = torch.device(name).type if name != "auto" else "auto"
    except (RuntimeError, TypeError):
        kind = name  # resolve_device below names the flag and what this build has
    if kind not in ("auto", "cpu", "cuda"):
        raise UsageError(
            f"--device {name!r} with --context-parallel: the ranks exchange tensors over gloo (cpu) or "
            f"nccl (cuda) only; pass --device cpu or --device cuda."
        )
    return resolve_device(name)


def _check_lengths(cfg: Any, n: int) -> None:
    """Each T splits into ``2N`` whole chunks (zigzag's), so that no layout pads and the formulas are exact."""
    if not cfg.lengths:
        raise UsageError("--lengths got no length; pass sequence lengths, e.g. --lengths 4096 16384.")
    for T in cfg.lengths:
        check_range("--lengths", T, low=1, integer=True, hint="each is a sequence length T, e.g. --lengths 4096")
        if T % (2 * n):
            up = -(-T // (2 * n)) * 2 * n
            raise UsageError(
                f"--lengths got T={T}, which does not split into the {2 * n} whole chunks the zigzag layout of "
                f"--context-parallel {n} needs (a multiple of {2 * n}, at least {2 * n}); padding would skew the "
                f"balance and byte figures, so pass --lengths {up}."
            )


def _combos(cfg: Any, n: int) -> tuple[tuple[tuple[str, str], ...], dict[str, str]]:
    """The (method, layout) pairs to run, and why any asked method is skipped (alltoall: heads not divisible)."""
    for flag, asked, known in (("--cp-methods", cfg.cp_methods, METHODS), ("--cp-layouts", cfg.cp_layouts, LAYOUTS)):
        bad = [a for a in asked if a not in known]
        if bad or not asked:
            raise UsageError(
                f"{flag} got {list(asked)}, expected one or more of {', '.join(known)}; e.g. {flag} {known[0]}."
            )
    methods = list(dict.fromkeys(cfg.cp_methods))
    skipped: dict[str, str] = {}
    if "alltoall" in methods and cfg.num_heads % n:
        why = f"alltoall splits the heads over the {n} ranks and --num-heads {cfg.num_heads} is not divisible by {n}"
        if methods == ["alltoall"]:
            raise UsageError(f"--cp-methods alltoall: {why}; pass --num-heads a multiple of {n} or --cp-methods ring.")
        methods.remove("alltoall")
        skipped["alltoall"] = why + " (ring runs any head count)"
    layouts = list(dict.fromkeys(cfg.cp_layouts))
    return tuple((m, lay) for m in methods for lay in layouts), skipped


def plan_cp(cfg: Any) -> CPPlan:
    """Every flag checked, before the process group is joined (so a mistake is one line per rank, not a hang)."""
    n = cfg.context_parallel
    check_range(
        "--context-parallel", n, low=2, integer=True, hint="the ranks one sequence is split over; 1 is plain bench"
    )
    if cfg.variant != "none":
        raise UsageError(
            f"--variant {cfg.variant} with --context-parallel: the context-parallel benchmark runs plain "
            f"{'causal' if cfg.cp_causal else 'full'} attention; drop --variant, or drop --context-parallel."
        )
    world = _launched_world(n)
    _check_lengths(cfg, n)
    check_range("--embed-dim", cfg.embed_dim, low=1, integer=True)
    check_range("--num-heads", cfg.num_heads, low=1, integer=True)
    if cfg.embed_dim % cfg.num_heads:
        raise UsageError(
            f"--embed-dim {cfg.embed_dim} is not divisible by --num-heads {cfg.num_heads}; pass a head count "
            f"that divides it (e.g. --num-heads 8 for --embed-dim 512)."
        )
    check_range(
        "--tokens", cfg.tokens, low=max(cfg.lengths), integer=True, hint="B = tokens // T; pass at least the longest T"
    )
    check_range("--repeats", cfg.repeats, low=1, integer=True, hint="the median of the timed repeats is reported")
    check_range("--warmup", cfg.warmup, low=0, integer=True)
    check_rank_timeout(cfg.rank_timeout)
    combos, skipped = _combos(cfg, n)
    device = _cp_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    check_writable_dir(cfg.out_dir, "--out-dir")
    return CPPlan(world, device, dtype, combos, skipped)


# -- the figures arithmetic predicts ---------------------------------------------------------
def pair_formula(T: int, n: int, rank: int, layout: str, method: str, H: int, causal: bool) -> int:
    """(query, key, head) triples per batch row rank ``rank`` computes: from the positions it holds, not the ring's code.

    Ring: each of the rank's queries at position ``p`` sees ``p + 1`` keys (causal) or ``T``, for all ``H`` heads.
    Alltoall: the rank runs the whole sequence for its ``H / N`` heads.
    """
    if method == "alltoall":
        return (T * (T + 1) // 2 if causal else T * T) * (H // n)
    c = T // (2 * n) if layout == "zigzag" else T // n
    chunks = (rank, 2 * n - 1 - rank) if layout == "zigzag" else (rank,)
    positions = [p for i in chunks for p in range(i * c, (i + 1) * c)]
    return H * sum((p + 1) if causal else T for p in positions)


def byte_formula(method: str, n: int, B: int, H: int, G: int, L: int, D: int, itemsize: int) -> tuple[int, int]:
    """``(forward, backward)`` bytes one rank sends for one attention call.

    Ring, forward: the local K and V, ``(N-1)`` hops. Backward: K and V again ``(N-1)`` hops, plus the
    ``dK, dV`` accumulators (float32 at least) ``N`` hops, home again.
    Alltoall: Q, K, V and the context each cross once, ``(N-1)/N`` of the local tensor leaving the rank;
    backward sends their gradients the same way back.
    """
    kv = 2 * B * G * L * D
    if method == "ring":
        acc = max(itemsize, 4)
        return (n - 1) * kv * itemsize, (n - 1) * kv * itemsize + n * kv * acc
    elems = B * L * D * (2 * H + 2 * G)  # Q and the context (H heads), K and V (G heads)
    once = elems * itemsize * (n - 1) // n
    return once, once


def expected_balance(pairs: list[int]) -> float:
    """Max over mean of per-rank pair counts: 1.0 is perfectly balanced work."""
    return max(pairs) / (sum(pairs) / len(pairs))


# -- the result ------------------------------------------------------------------------------
@dataclass
class CPRow:
    """One (T, method, layout) on every rank; lists are indexed by rank. ``method == "single"``: the baseline."""

    T: int
    B: int
    method: str
    layout: str
    L: int
    fwd_bwd_ms: list[float] = field(default_factory=list)
    peak_mib: list[float | None] = field(default_factory=list)
    pairs: list[int] = field(default_factory=list)
    pairs_formula: list[int] = field(default_factory=list)
    bytes_fwd: list[int] = field(default_factory=list)
    bytes_bwd: list[int] = field(default_factory=list)
    bytes_fwd_formula: int = 0
    bytes_bwd_formula: int = 0
    balance: float | None = None
    balance_formula: float | None = None
    peak_over_single: list[float | None] = field(default_factory=list)
    max_abs_err: float | None = None  # of the gathered output against the single-process one


@dataclass
class CPResult:
    config: dict
    world: int
    device: str
    dtype: str
    torch: str
    cpu: str
    threads_per_rank: list[int]
    rows: list[CPRow] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    goals: list[str] = field(default_factory=list)
    partial: str | None = None


def cpu_model() -> str:
    """The CPU's model name (:func:`attnlab.runtime.cpu_info`)."""
    return str(cpu_info()["model"])


# -- measuring on one rank -------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(mha: MultiHeadAttention, x: Tensor, grad: Tensor, cp: ContextParallel | None, causal: bool) -> None:
    mha(x, is_causal=causal, context_parallel=cp).backward(grad)


@dataclass
class Case:
    """One thing to time on this rank: the module's forward+backward on ``x`` (the full input or the shard)."""

    method: str
    layout: str
    x: Tensor
    grad: Tensor
    cp: ContextParallel | None

    def run(self, mha: MultiHeadAttention, causal: bool) -> None:
        xg = self.x.detach().requires_grad_()
        _fwd_bwd(mha, xg, self.grad, self.cp, causal)


def _time_all(cases: list[Case], mha: MultiHeadAttention, cfg: Any, device: torch.device) -> dict[int, list[float]]:
    """Seconds per forward+backward of each case on this rank, interleaved (rotated order) after a warm-up.

    Every rank runs every case at once, the single-process one included: a barrier starts each, so the
    baseline runs under the same load as the ranks' shards (N processes busy, each its own threads),
    rather than alone on an idle machine, which would flatter it against the N concurrent ranks.
    The order is the same on every rank (the ring needs all of them in the same call).
    """
    times: dict[int, list[float]] = {i: [] for i in range(len(cases))}
    for rep in range(cfg.warmup + cfg.repeats):
        order = list(range(len(cases)))
        order = order[rep % len(order) :] + order[: rep % len(order)]
        for i in order:
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            cases[i].run(mha, cfg.cp_causal)
            _sync(device)
            if rep >= cfg.warmup:
                times[i].append(time.perf_counter() - t0)
    return times


def _counts(case: Case, mha: MultiHeadAttention, causal: bool) -> tuple[int, int, int]:
    """``(pairs, forward bytes, backward bytes)`` of one untimed call, from ``cp.stats``."""
    assert case.cp is not None
    cp = case.cp
    cp.reset_stats()
    xg = case.x.detach().requires_grad_()
    y = mha(xg, is_causal=causal, context_parallel=cp)
    pairs, fwd = cp.stats.pairs, cp.stats.bytes_sent
    y.backward(case.grad)
    return pairs, fwd, cp.stats.bytes_sent - fwd


def _peaks(cases: list[Case], mha: MultiHeadAttention, mem: PeakMemory, causal: bool) -> list[float | None]:
    """Peak bytes of one forward+backward per case on this rank, ranks in step (barrier before each).

    The parameter gradients exist already (as in any training step after the first), so the peak is
    the attention's activations, gradients and transfers, not four (E, E) gradient buffers.
    """
    peaks: list[float | None] = []
    for case in cases:
        mha.zero_grad(set_to_none=False)
        gc.collect()
        dist.barrier()
        peaks.append(mem.measure(partial(case.run, mha, causal)))
    return peaks


def _check_exact(cases: list[Case], mha: MultiHeadAttention, causal: bool) -> list[float]:
    """Max |gathered context-parallel output - single-process output| per case (the single one: 0)."""
    with torch.no_grad():
        ref = mha(cases[0].x, is_causal=causal)
        errs = [0.0]
        for case in cases[1:]:
            assert case.cp is not None
            y = case.cp.gather(mha(case.x, is_causal=causal, context_parallel=case.cp), dim=1)
            errs.append((y.float() - ref.float()).abs().max().item())
    return errs


def _build_cases(plan: CPPlan, x: Tensor, grad: Tensor) -> list[Case]:
    """The single-process case first, then one per (method, layout), each with its own ContextParallel and shard."""
    cases = [Case(SINGLE, "", x, grad, None)]
    for method, layout in plan.combos:
        cp = ContextParallel(layout=layout, method=method)
        cases.append(Case(method, layout, cp.shard(x, dim=1), cp.shard(grad, dim=1), cp))
    return cases


def measure_length(
    cfg: Any, plan: CPPlan, mha: MultiHeadAttention, mem: PeakMemory, T: int
) -> tuple[int, list[dict[str, Any]]]:
    """This rank's figures at length ``T``: ``(B, [one dict per case])``."""
    B = max(1, cfg.tokens // T)
    gen = torch.Generator().manual_seed(cfg.seed + T)  # the same full input on every rank
    x = torch.randn(B, T, cfg.embed_dim, generator=gen, dtype=plan.dtype).to(plan.device)
    grad = torch.randn(B, T, cfg.embed_dim, generator=gen, dtype=plan.dtype).to(plan.device)
    cases = _build_cases(plan, x, grad)
    errs = _check_exact(cases, mha, cfg.cp_causal)
    times = _time_all(cases, mha, cfg, plan.device)
    peaks = _peaks(cases, mha, mem, cfg.cp_causal) if cfg.memory and mem.available else [None] * len(cases)
    out = []
    for i, (case, peak) in enumerate(zip(cases, peaks, strict=True)):
        pairs, fwd, bwd = _counts(case, mha, cfg.cp_causal) if case.cp is not None else (0, 0, 0)
        out.append(
            {
                "ms": 1e3 * statistics.median(times[i]),
                "peak": None if peak is None else peak / 2**20,
                "pairs": pairs,
                "fwd": fwd,
                "bwd": bwd,
                "err": errs[i],
                "L": case.x.size(1),
            }
        )
    return B, out


# -- assembling the ranks' figures -----------------------------------------------------------
def assemble(cfg: Any, plan: CPPlan, T: int, B: int, per_rank: list[list[dict[str, Any]]]) -> list[CPRow]:
    """Rows at length ``T`` from every rank's dicts (``per_rank[rank][case]``), with the formulas beside them."""
    n, H = plan.world, cfg.num_heads
    G, D = H, cfg.embed_dim // H  # the benchmark's module has as many K/V heads as query heads
    itemsize = torch.empty((), dtype=plan.dtype).element_size()
    names = [(SINGLE, ""), *plan.combos]
    single_peaks = [r[0]["peak"] for r in per_rank]
    rows = []
    for i, (method, layout) in enumerate(names):
        cells = [r[i] for r in per_rank]
        row = CPRow(T, B, method, layout, cells[0]["L"])
        row.fwd_bwd_ms = [c["ms"] for c in cells]
        row.peak_mib = [c["peak"] for c in cells]
        row.peak_over_single = [
            None if p is None or s in (None, 0) else p / s for p, s in zip(row.peak_mib, single_peaks, strict=True)
        ]
        row.max_abs_err = max(c["err"] for c in cells)
        if method == SINGLE:
            full = (T * (T + 1) // 2 if cfg.cp_causal else T * T) * H
            row.pairs = row.pairs_formula = [full] * n  # every rank ran the whole problem: arithmetic, no stats
        else:
            row.pairs = [c["pairs"] for c in cells]
            row.pairs_formula = [pair_formula(T, n, r, layout, method, H, cfg.cp_causal) for r in range(n)]
            row.bytes_fwd = [c["fwd"] for c in cells]
            row.bytes_bwd = [c["bwd"] for c in cells]
            row.bytes_fwd_formula, row.bytes_bwd_formula = byte_formula(method, n, B, H, G, row.L, D, itemsize)
            row.balance = expected_balance(row.pairs) if sum(row.pairs) else None
            row.balance_formula = expected_balance(row.pairs_formula)
        rows.append(row)
    return rows


def goal_lines(res: CPResult) -> list[str]:
    """The issue's memory goal per (T, method, layout): every rank's peak <= (1/N + 0.1) x the single-process peak."""
    limit = 1 / res.world + 0.1
    out = ["memory goal (set by the issue at T=16384; at small T fixed costs and page rounding dominate):"]
    for r in res.rows:
        ratios = [x for x in r.peak_over_single if x is not None]
        if r.method == SINGLE or not ratios:
            continue
        worst = max(ratios)
        out.append(
            f"T={r.T} {r.method}/{r.layout}: worst rank's peak = {worst:.3f}x single-process "
            f"(goal <= 1/{res.world} + 0.1 = {limit:.3f}: {'met' if worst <= limit else 'MISSED'})"
        )
    return out if len(out) > 1 else []  # no peak measured (--no-memory): no goal line


# -- reporting -------------------------------------------------------------------------------
def _mib(x: float | None) -> str:
    return "" if x is None else f"{x:.1f}"


def _ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def _name(r: CPRow) -> str:
    return SINGLE if r.method == SINGLE else f"{r.method}/{r.layout}"


def markdown(res: CPResult) -> str:
    """Every figure: one line per (T, method, layout, rank), then the derived ones per (T, method, layout)."""
    lines = [
        f"Context parallelism over N={res.world} ranks; {res.device} {res.dtype}, torch {res.torch}, CPU {res.cpu}, "
        f"threads per rank {res.threads_per_rank}. E={res.config['embed_dim']}, H={res.config['num_heads']}, "
        f"{'causal' if res.config['cp_causal'] else 'full'} attention; single = the whole problem on one process "
        f"(run on every rank at once, same load). Bytes: measured / formula.",
        "",
        "| T | B | L | run | rank | fwd+bwd ms | peak MiB | peak / single | pairs | pairs formula "
        "| bytes fwd | formula fwd | bytes bwd | formula bwd |",
        "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res.rows:
        for k in range(res.world):
            sent = (
                [str(r.bytes_fwd[k]), str(r.bytes_fwd_formula), str(r.bytes_bwd[k]), str(r.bytes_bwd_formula)]
                if r.bytes_fwd
                else ["", "", "", ""]
            )
            lines.append(
                f"| {r.T} | {r.B} | {r.L} | {_name(r)} | {k} | {r.fwd_bwd_ms[k]:.2f} | {_mib(r.peak_mib[k])} | "
                f"{_ratio(r.peak_over_single[k])} | {r.pairs[k]} | {r.pairs_formula[k]} | " + " | ".join(sent) + " |"
            )
    lines += ["", "| T | run | balance | balance formula | max fwd+bwd ms | / single | max peak / single | max err |"]
    lines += ["| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in res.rows:
        single = next(s for s in res.rows if s.T == r.T and s.method == SINGLE)
        peaks = [x for x in r.peak_over_single if x is not None]
        lines.append(
            f"| {r.T} | {_name(r)} | {_ratio(r.balance)} | {_ratio(r.balance_formula)} | {max(r.fwd_bwd_ms):.2f} | "
            f"{max(r.fwd_bwd_ms) / max(single.fwd_bwd_ms):.3f} | {_ratio(max(peaks) if peaks else None)} | "
            f"{0.0 if r.max_abs_err is None else r.max_abs_err:.1e} |"
        )
    lines += [f"\n{name}: skipped, {why}." for name, why in res.skipped.items()]
    return "\n".join(lines)


def compact_table(res: CPResult) -> str:
    """The terminal's table: one line per (T, run), the worst rank's figures; the Markdown has every rank."""
    header = ("run", "f+b ms", "/single", "MiB", "/single", "balance", "fwd B ok", "bwd B ok")
    rows: list[tuple[str, ...]] = []
    for T in dict.fromkeys(r.T for r in res.rows):
        group = [r for r in res.rows if r.T == T]
        single = group[0]
        rows.append((f"T={T}, B={single.B}, L={group[-1].L} per rank:",))
        for r in group:
            peaks = [x for x in r.peak_mib if x is not None]
            ratios = [x for x in r.peak_over_single if x is not None]
            fwd_ok = "" if not r.bytes_fwd else str(all(b == r.bytes_fwd_formula for b in r.bytes_fwd))
            bwd_ok = "" if not r.bytes_bwd else str(all(b == r.bytes_bwd_formula for b in r.bytes_bwd))
            rows.append(
                (
                    _name(r),
                    f"{max(r.fwd_bwd_ms):.1f}",
                    f"{max(r.fwd_bwd_ms) / max(single.fwd_bwd_ms):.2f}",
                    f"{max(peaks):.0f}" if peaks else "",
                    f"{max(ratios):.3f}" if ratios else "",
                    "" if r.balance is None else f"{r.balance:.3f}",
                    fwd_ok,
                    bwd_ok,
                )
            )
    lines = [
        f"N={res.world} ranks, {res.device} {res.dtype}, torch {res.torch}, {res.cpu}",
        "worst rank's figures; /single: over the single-process run of the whole sequence;",
        "balance: max/mean pairs per rank; B ok: every rank's bytes sent == the formula",
        "",
        *aligned(header, rows, right=(False, *([True] * 7))),
    ]
    lines += [wrap(f"{name}: skipped, {why}.") for name, why in res.skipped.items()]
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------
def _join(plan: CPPlan, timeout_s: float) -> tuple[Job, torch.device]:
    """Join the process group (gloo on CPU, nccl on CUDA), whose collectives fail after ``timeout_s`` when a rank
    stops answering (:mod:`attnlab.distributed.failures`); ``(job, this rank's device)``."""
    device = plan.device
    job = join("nccl" if device.type == "cuda" else "gloo", timeout_s)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    return job, device


def _lost(job: Job, err: BaseException) -> RankLost | None:
    """The one line for a rank that died or stopped answering (the benchmark has no resume: it is run again).

    ``err`` is the failed collective's error, or an interrupt: torchrun, seeing a rank die, sends the others
    SIGTERM, which may arrive before any collective fails; the dead rank is then the news, not the signal.
    """
    failure = diagnose(job, err, grace_s=0.0 if isinstance(err, INTERRUPTS) else None)
    if failure is None:
        return None
    from ..lab.run_dir import launcher  # the torchrun command this job was started with

    mark_left(job)
    again = " ".join([launcher(), *map(shlex.quote, sys.argv[1:])])
    line = (
        f"attnlab: {failure.what}; so every rank stopped, and no result was written. Run it again"
        f"{ended(job, failure)} with `{again}`"
    )
    return RankLost(line, failure=failure, announce=job.rank == failure.reporter)


def _module(cfg: Any, plan: CPPlan) -> MultiHeadAttention:
    """The same weights on every rank (the seed), nonzero biases so that they must be used."""
    torch.manual_seed(cfg.seed)
    mha = MultiHeadAttention(cfg.embed_dim, cfg.num_heads, device=plan.device, dtype=plan.dtype)
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return mha


def run_cp_bench(cfg: Any, plan: CPPlan, log: Callable[[str], None]) -> CPResult:
    """Measure every length on every rank; rank 0's result holds every rank's figures (the others': theirs too)."""
    mha = _module(cfg, plan)
    mem = PeakMemory(plan.device)
    mem_ok = cfg.memory and mem.available
    if mem_ok:  # the resident set follows live tensors; slows allocation a little, equally for every case
        mem.exact_mode()
    threads: list[Any] = [None] * plan.world
    dist.all_gather_object(threads, torch.get_num_threads())
    result = CPResult(
        asdict(cfg) | {"out_dir": str(cfg.out_dir)},
        plan.world,
        str(plan.device.type),
        str(plan.dtype).removeprefix("torch."),
        torch.__version__,
        cpu_model() if plan.device.type == "cpu" else torch.cuda.get_device_name(plan.device),
        [int(t) for t in threads],
        skipped=dict(plan.skipped),
    )
    log(
        f"N={plan.world} ranks on {result.cpu}, {result.dtype}, torch {result.torch}, threads per rank {threads}; "
        f"runs: single, " + ", ".join(f"{m}/{lay}" for m, lay in plan.combos)
    )
    with carried_by_interrupts(result):  # an interrupt hands up the lengths measured so far
        for T in cfg.lengths:
            B, mine = measure_length(cfg, plan, mha, mem, T)
            every: list[Any] = [None] * plan.world
            dist.all_gather_object(every, mine)
            rows = assemble(cfg, plan, T, B, every)
            worst = max(r.max_abs_err or 0.0 for r in rows)
            tol = 1e-4 if plan.dtype in (torch.float32, torch.float64) else 5e-2
            if worst > tol:
                raise RuntimeError(
                    f"T={T}: a context-parallel run disagrees with the single-process module by {worst:.2e} "
                    f"(> {tol}); the benchmark would compare different functions."
                )
            result.rows.extend(rows)
            log(f"T={T} B={B}: worst rank fwd+bwd ms " + ", ".join(f"{_name(r)} {max(r.fwd_bwd_ms):.1f}" for r in rows))
    result.goals = goal_lines(result)
    return result


def cp_defaults(cfg: Any, defaults: Any) -> Any:
    """The issue's lengths when ``--lengths`` was not given, and one sequence at the longest when ``--tokens`` was not."""
    lengths = CP_LENGTHS if cfg.lengths == defaults.lengths else cfg.lengths
    tokens = max(lengths, default=1) if cfg.tokens == defaults.tokens else cfg.tokens
    return replace(cfg, lengths=lengths, tokens=tokens)


def bench_context_parallel(cfg: Any) -> int:
    """``bench --context-parallel N`` on one rank: checks, joins the group, measures; rank 0 prints and writes."""
    plan = plan_cp(cfg)
    job, device = _join(plan, cfg.rank_timeout)
    rank = job.rank
    plan = replace(plan, device=device)
    width = terminal_width()
    log = (lambda text: print(wrap(text, width), flush=True)) if rank == 0 else (lambda text: None)
    try:
        try:
            res = run_cp_bench(cfg, plan, log)
        except INTERRUPTS as err:  # rank 0 keeps the lengths measured so far, marked partial
            lost = _lost(job, err)
            if lost is not None:
                raise lost from None
            if rank == 0:
                raise save_partial(err, cfg.out_dir, STEM, markdown) from None
            raise
        if rank == 0:
            _write(res, cfg.out_dir, width)
        dist.barrier()  # nobody leaves (and tears down the group) while rank 0 still writes
    except RuntimeError as err:  # a collective failed: a rank died or stopped answering (else: ours, as it is)
        if isinstance(err, RankLost):
            raise
        lost = _lost(job, err)
        if lost is None:
            raise
        raise lost from None
    dist.destroy_process_group()
    return 0


def _write(res: CPResult, out: Path, width: int) -> None:
    paths = [out / f"{STEM}.json", out / f"{STEM}.md"]
    atomic_write_text(paths[0], json.dumps(asdict(res), indent=2) + "\n")
    atomic_write_text(paths[1], markdown(res) + "\n\n" + "\n".join(res.goals) + "\n")
    drop_partial(out, STEM)
    print("\n" + compact_table(res) + "\n\n" + wrap("\n".join(res.goals), width))
    print("\nwrote (the Markdown has every rank's figures):\n" + "\n".join(f"  {p}" for p in paths))
