"""Decode beside a busy core: ``python -m attnlab.bench.busy_threads [--tokens 64] [--repeats 3]``.

SmolLM2 (the GGUF as stored, batch 1, a 32-token prompt) decodes ``--tokens`` greedy tokens at 2 threads, at 1
thread and with ``threads="auto"`` (:class:`attnlab.runtime.threads.ThreadChooser`), taking turns, in three
settings: alone, beside a process that keeps one core busy (``while True: pass``) wherever the scheduler puts
it, and beside one pinned to the last CPU. Prints decode tokens/s (the median over the repeats) and each
count's ratio to the one-thread speed of the same setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from ..runtime.threads import Threads

__all__ = ["main"]

_BUSY = "while True: pass"


def _decode_rate(model: Any, idx: torch.Tensor, n: int, threads: Threads) -> tuple[float, list[int]]:
    """Decode tokens/s of ``n`` new tokens (timed from the first token on), and the count each step ran at."""
    from ..models.generation import generate_steps

    torch.set_num_threads(2)  # the prefill's count, as the machine's default
    steps = generate_steps(model, idx, n, temperature=0, threads=threads)
    next(steps)  # the prefill and the first token
    first = time.perf_counter()
    used = []
    for _ in steps:
        used.append(torch.get_num_threads())
    end = time.perf_counter()
    return (n - 1) / (end - first), used


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--alone-only", action="store_true", help="no competing process (the machine is busy already)")
    args = parser.parse_args(argv)
    from ..runtime import release_freed_heap
    from ..weight_files.pretrained import from_pretrained, smollm2_path

    model: Any
    model, _ = from_pretrained(smollm2_path(), dtype="gguf")
    release_freed_heap()
    idx = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    last_cpu = max(os.sched_getaffinity(0))
    settings: list[tuple[str, list[str] | None]] = [
        ("alone", None),
        ("beside a busy process", [sys.executable, "-c", _BUSY]),
        (
            f"beside a busy process pinned to CPU {last_cpu}",
            ["taskset", "-c", str(last_cpu), sys.executable, "-c", _BUSY],
        ),
    ]
    if args.alone_only:
        settings = settings[:1]
    runs: list[Threads] = [2, 1, "auto"]
    print(f"load average at start {os.getloadavg()}; {args.tokens} tokens, {args.repeats} repeats")
    print("| setting | 2 threads tok/s | 1 thread tok/s | auto tok/s | 2 / 1 | auto / 1 | auto's counts |")
    print("|---|---:|---:|---:|---:|---:|---|", flush=True)
    _decode_rate(model, idx, 4, 1)  # warm-up
    for name, command in settings:
        busy = subprocess.Popen(command) if command else None
        try:
            time.sleep(0.5 if busy else 0)
            rates: dict[Threads, list[float]] = {r: [] for r in runs}
            counts: list[int] = []
            for rep in range(args.repeats):
                for threads in runs[rep % 3 :] + runs[: rep % 3]:
                    rate, used = _decode_rate(model, idx, args.tokens, threads)
                    rates[threads].append(rate)
                    if threads == "auto":
                        counts += used
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        med = {r: statistics.median(v) for r, v in rates.items()}
        share = {c: counts.count(c) for c in sorted(set(counts))}
        print(
            f"| {name} | {med[2]:.1f} | {med[1]:.1f} | {med['auto']:.1f} | {med[2] / med[1]:.2f} | "
            f"{med['auto'] / med[1]:.2f} | " + ", ".join(f"{c}: {k} steps" for c, k in share.items()) + " |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
