"""Timing shared by the benchmarks: one call timed (the GPU synchronized around it) and this machine's copy rate,
the bandwidth limit a decode step's bytes are set against."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["copy_bandwidth", "timed"]


def timed(fn: Callable[[int], torch.Tensor], n: int, device: torch.device) -> tuple[float, torch.Tensor]:
    """``(seconds, fn(n))``, with ``device``'s queued work finished before and after on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn(n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def copy_bandwidth(device: torch.device, megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second of ``dst.copy_(src)`` on ``megabytes`` of float32, reads plus writes (best of ``repeats``).

    The bandwidth limit of a decode step is its bytes read over this rate: what this machine
    moves through memory in one plain streaming kernel, measured in the same run as the model.
    """
    n = megabytes * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy faults the pages in
        t, _ = timed(lambda _n: dst.copy_(src), 0, device)
        best = min(best, t)
    return 2 * n * 4 / best
