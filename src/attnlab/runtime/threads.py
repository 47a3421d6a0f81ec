"""How many CPU threads a decode runs on, and how that count is chosen when other work shares the CPU.

What the count does. ``torch.set_num_threads(n)`` sizes ATen's OpenMP pool, and through it everything a CPU
decode runs: torch's own parallel ops and MKL's matmuls (a float model), and attnlab's quantized kernels,
whose fused decode step (``attnlab_quant::llama_decode``) runs one OpenMP team of ``torch.get_num_threads()``
workers for the whole step, splitting each matmul's rows and the attention heads over them, with a barrier
after each piece of work (a few hundred a step). On an idle CPU two threads decode about 1.4x faster than one.

Why a count must be chosen by experiment. A barrier waits for the slowest worker. When another process keeps
one core busy, the worker that shares that core runs half the time, in slices of milliseconds, and every
barrier waits for it, while the other worker spins there (OpenMP spins before it sleeps): measured on the
2-core machine of issue 51, 2 threads decoded at 0.04-0.14x the speed of 1. Load averages lag by a minute;
timing a few decode steps at each count does not: :class:`ThreadChooser` times them, alternated, keeps the
fastest, and checks again later, sooner when a step suddenly slows down. The one instantaneous signal, the
count of tasks runnable now (:func:`free_cpus`), only spares it trying a count that cannot fit.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Literal, TypeVar

import torch

from .errors import UsageError

__all__ = ["ThreadChooser", "Threads", "candidate_threads", "check_threads", "free_cpus", "resolve_threads"]

T = TypeVar("T")
Threads = int | Literal["auto"] | None  # a fixed count, chosen by experiment, or torch's setting left alone


def check_threads(name: str, value: object) -> Threads:
    """``value`` as a thread setting: None, ``"auto"``, or an int >= 1 (``"2"`` is read as 2); else a
    :class:`UsageError` naming ``name``, what it got and what it takes."""
    if value is None or value == "auto":
        return value  # None or "auto", as checked
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise UsageError(
        f"{name} must be a thread count >= 1 or 'auto' (the fastest of the counts tried on the first decode "
        f"steps), got {value!r}; e.g. {name} 1 beside other work, {name} auto by default."
    )


def candidate_threads(available: int) -> tuple[int, ...]:
    """The counts :class:`ThreadChooser` tries when ``available`` threads are allowed: all of them, one fewer
    (a core taken by other work) and one; ``(1,)`` on one core."""
    return tuple(sorted({available, max(1, available - 1), 1}, reverse=True))


def free_cpus(loadavg: str = "/proc/loadavg") -> int | None:
    """CPUs not taken by other work right now: the CPUs the kernel schedules on, less the tasks runnable now
    (``/proc/loadavg``'s fourth field, an instantaneous count, not the lagging averages) that are not this
    process's threads. None where there is no such file (not Linux).

    A snapshot, so :class:`ThreadChooser` still times the counts it leaves in; it only spares the slow steps of
    a count that cannot fit (issue 51: one step at 2 threads beside a busy core cost 20 one-thread steps).
    """
    try:
        with open(loadavg) as fh:
            runnable = int(fh.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None
    others = max(0, runnable - torch.get_num_threads())  # ours may be running or spinning as it is read
    return (os.cpu_count() or 1) - others


def resolve_threads(threads: Threads) -> tuple[int, ...]:
    """The counts to try for ``threads``: ``(n,)`` for a fixed count, :func:`candidate_threads` of torch's
    current count for ``"auto"``, ``()`` for None (torch's setting left alone)."""
    if threads is None:
        return ()
    if threads == "auto":
        return candidate_threads(torch.get_num_threads())
    return (threads,)


class ThreadChooser:
    """Runs decode steps at the thread count that is fastest now, found by timing steps at each candidate.

    A *probe* runs ``probe`` steps at each candidate, alternated from the smallest count up (so that a change of
    load hits all alike, and a slow larger count costs one step),
    and keeps the count with the lowest median step time. A probe stops early for a candidate whose first
    step takes over ``abort`` times the best median so far: on a busy core 2 threads can be 10-25x slower,
    and one such step is evidence enough. After a probe the chosen count runs for ``first_recheck`` steps,
    then probes again; each probe that confirms the choice doubles that interval (up to ``max_recheck``),
    so that checking costs little once the load is steady. A step slower than ``slowdown`` times the chosen
    count's median (other work started) starts a probe at once.

    Args:
        candidates: the counts to try, each >= 1; one count is simply applied.
        apply: sets the count; default ``torch.set_num_threads`` (the quantized kernels read it each step).
        clock: seconds, monotonic (``time.perf_counter``); tests pass a fake one.
        free: CPUs free of other work now (:func:`free_cpus`), or None where unknown; read at the start of each
            probe, which then tries only the counts that fit (at least the smallest): on a machine whose other
            cores are busy, not even one slow step at a larger count. None (the default): every count is tried.
    """

    def __init__(
        self,
        candidates: Sequence[int],
        *,
        probe: int = 3,
        abort: float = 3.0,
        slowdown: float = 2.0,
        first_recheck: int = 32,
        max_recheck: int = 1024,
        apply: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        free: Callable[[], int | None] | None = None,
    ) -> None:
        if not candidates or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in candidates):
            raise ValueError(f"ThreadChooser candidates must be thread counts >= 1, got {list(candidates)!r}.")
        self.candidates = tuple(dict.fromkeys(candidates))  # distinct, in the order given
        self.probe, self.abort, self.slowdown = probe, abort, slowdown
        self.first_recheck, self.max_recheck = first_recheck, max_recheck
        self._apply = torch.set_num_threads if apply is None else apply
        self._clock = clock
        self._free = free
        self.chosen = self.candidates[0]
        self.current: int | None = None  # the count applied now
        self.history: list[tuple[int, float]] = []  # (threads, seconds) of every step run through run()
        self._queue: list[int] = []  # counts of the probe steps still to run
        self._samples: dict[int, list[float]] = {}
        self._baseline = float("inf")  # the chosen count's median step time at its probe
        self._interval = first_recheck
        self._left = 0  # steps until the next probe
        if len(self.candidates) > 1:
            self._start_probe()

    @property
    def probing(self) -> bool:
        return bool(self._queue)

    def _start_probe(self) -> None:
        free = None if self._free is None else self._free()
        fits = [c for c in self.candidates if free is None or c <= max(1, free)] or [min(self.candidates)]
        if len(fits) == 1:  # the other cores are busy now: no count to compare, nothing slow to try
            self.chosen, self._left = fits[0], self._interval
            self._queue = []
            return
        order = sorted(fits)  # the smallest first: a slow count is then dropped after its first step
        self._queue = [c for _ in range(self.probe) for c in order]
        self._samples = {c: [] for c in fits}

    def run(self, step: Callable[[], T]) -> T:
        """Run one decode ``step`` at the count chosen for it, timed; returns what ``step`` returns."""
        n = self._queue[0] if self._queue else self.chosen
        if n != self.current:
            self._apply(n)
            self.current = n
        start = self._clock()
        out = step()
        self._record(n, self._clock() - start)
        return out

    def _record(self, n: int, seconds: float) -> None:
        self.history.append((n, seconds))
        if len(self.candidates) == 1:
            return
        if not self._queue:
            self._left -= 1
            if seconds > self.slowdown * self._baseline:  # other work started: look again now
                self._interval = self.first_recheck
                self._start_probe()
            elif self._left <= 0:
                self._start_probe()
            return
        self._queue.pop(0)
        self._samples[n].append(seconds)
        medians = {c: statistics.median(s) for c, s in self._samples.items() if s and c != n}
        if medians and seconds > self.abort * min(medians.values()):
            self._queue = [c for c in self._queue if c != n]  # far slower: no more steps at this count
            if len(set(self._queue)) == 1:
                self._queue = []  # and nothing left to compare: the probe is over
        if not self._queue:
            self._decide()

    def _decide(self) -> None:
        medians = {c: statistics.median(s) for c, s in self._samples.items() if s}
        best = min(medians, key=lambda c: medians[c])
        self._interval = min(2 * self._interval, self.max_recheck) if best == self.chosen else self.first_recheck
        self.chosen, self._baseline, self._left = best, medians[best], self._interval
