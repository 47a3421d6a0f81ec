"""``PeakMemory``: the peak memory of a block of work, on a GPU or a Linux CPU (shared by the benchmarks)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

import torch

from ..runtime import release_freed_heap
from .lengths_worker import proc_status, reset_peak_rss

__all__ = ["PeakMemory"]


class PeakMemory:
    """Peak bytes above the starting point during a block: CUDA allocator stats on a GPU;
    on Linux CPUs the process's peak resident set (VmHWM, reset through /proc/self/clear_refs),
    in :meth:`exact_mode`, after returning freed heap pages with malloc_trim."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.available = device.type == "cuda"
        self._libc = None
        if device.type == "cpu":
            try:
                self._libc = ctypes.CDLL("libc.so.6")
                with open("/proc/self/clear_refs", "w") as fh:
                    fh.write("5")
                self.available = True
            except OSError:
                self.available = False

    @staticmethod
    def _status(key: str) -> int:
        return proc_status(key)

    def exact_mode(self) -> None:
        """Make every allocation of 64 KiB or more its own mmap, returned to the OS when freed, so
        that the resident set follows live tensors (glibc otherwise caches freed heap memory)."""
        if self._libc is not None:
            M_MMAP_THRESHOLD = -3
            self._libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)

    def measure(self, fn: Callable[[], None]) -> float | None:
        if not self.available:
            return None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device) - base)
        release_freed_heap()
        base = self._status("VmRSS")
        reset_peak_rss()
        fn()
        return float(self._status("VmHWM") - base)
