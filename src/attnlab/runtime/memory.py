"""How much memory this machine can give a command now, so that a request past it is refused up front;
and the one line for an allocation that fails all the same.

Every command estimates its largest allocations before making them and calls :func:`check_fits`,
which raises one :class:`~attnlab.runtime.LimitError` shape: what needs how much, what this machine
has and where that figure comes from, and the flag to shrink. The figure is the tightest of what
Linux reports (``MemAvailable``), the cgroup's limit (a container's ``memory.max``) and the address
space ``ulimit -v`` leaves: a process under ``ulimit -v 800000`` has 800 MB less what it already
maps, whatever the machine holds.

An estimate is a lower bound of what the work takes, never an exact figure; an allocation that
fails anyway (torch's ``DefaultCPUAllocator: can't allocate memory``, ``torch.OutOfMemoryError``,
``MemoryError``, ``mmap``'s ``ENOMEM``) is read by :func:`out_of_memory`, which ``attnlab.cli``
turns into one line with the size asked for.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import functools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .errors import LimitError

__all__ = [
    "available_bytes",
    "check_fits",
    "gib",
    "largest_fitting",
    "memory_limit",
    "out_of_memory",
    "out_of_memory_line",
    "OutOfMemory",
    "heap_trimmed_each_layer",
    "release_freed_heap",
    "trims_each_layer",
]


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_left() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup (v2), or None: no limit, or not readable."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            rel = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if rel is None:
            return None
        base = "/sys/fs/cgroup" + rel.rstrip("/")
        with open(f"{base}/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(f"{base}/memory.current", encoding="ascii") as f:
            used = int(f.read())
        return max(0, int(limit) - used)
    except (OSError, ValueError, IndexError):
        return None


def _address_space_left() -> int | None:
    """What ``ulimit -v`` (RLIMIT_AS) leaves this process: its soft limit less the virtual size it maps now."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status", encoding="ascii") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        return max(0, soft - size)
    except (ImportError, OSError, ValueError, StopIteration):
        return None


def memory_limit(device: torch.device | str = "cpu") -> tuple[int, str] | None:
    """``(bytes a new allocation can take on device, where that figure comes from)``, or None where it cannot be told.

    On a CPU, the tightest of ``MemAvailable`` (RAM the kernel can hand out, page cache included), the
    cgroup's ``memory.max`` less its use, and ``ulimit -v`` less this process's virtual size; free
    memory (``torch.cuda.mem_get_info``) on a GPU.
    """
    device = torch.device(device)
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free), "torch.cuda.mem_get_info"
        except (RuntimeError, AssertionError):
            return None
    found = [
        (n, where)
        for n, where in (
            (_meminfo_available(), "MemAvailable in /proc/meminfo"),
            (_cgroup_left(), "the cgroup's memory.max less its use"),
            (_address_space_left(), "ulimit -v less the address space in use"),
        )
        if n is not None
    ]
    if found:
        return min(found)
    try:  # other Unixes: free pages (an underestimate: page cache not counted)
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE")), "free physical pages"
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Bytes a new allocation can take on ``device`` without swapping (:func:`memory_limit`'s figure); None where
    it cannot be told."""
    limit = memory_limit(device)
    return None if limit is None else limit[0]


def gib(n: float) -> str:
    """``n`` bytes as ``"1.5 GiB"`` (or MiB below one GiB, TiB from 1024 GiB), for messages."""
    if n >= 2**40:
        return f"{n / 2**40:.1f} TiB"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def largest_fitting(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest ``x`` in ``low .. high`` with ``fits(x)``, ``fits`` being monotone (true up to some point, as
    "the run fits in memory" is of a size), or ``low - 1`` when not even ``low`` fits: a bisection, so that a
    suggested size costs ``log2(high - low)`` estimates."""
    if not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def check_fits(need: int, what: str, fix: str | Callable[[int], str], device: torch.device | str = "cpu") -> None:
    """A :class:`LimitError` when ``need`` bytes exceed what ``device`` can give now, before anything is allocated.

    ``what``: the work and its largest parts (``"--lengths 1000000 at --tokens 1000000 (activations, the (T, T)
    mask)"``); ``fix``: the flag to shrink, or a function of the bytes available that says how far. The
    message: ``<what> needs about 7.3 TiB but cpu has 21.4 GiB available (MemAvailable in /proc/meminfo); <fix>.``
    """
    limit = memory_limit(device)
    if limit is None or need <= limit[0]:
        return
    free, where = limit
    advice = fix(free) if callable(fix) else fix
    raise LimitError(
        f"{what} needs about {gib(need)} but {torch.device(device)} has {gib(free)} available ({where}); {advice}."
    )


@dataclass(frozen=True)
class OutOfMemory:
    """An allocation that failed: the bytes asked for (None when the error does not say) and who refused it."""

    asked: int | None
    by: str


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50, "EiB": 2**60}


def out_of_memory(err: BaseException) -> OutOfMemory | None:
    """What ``err`` says about a failed allocation, or None when it is not one.

    torch's CPU allocator says ``you tried to allocate N bytes``; CUDA's ``Tried to allocate 2.00 GiB``;
    numpy's ``MemoryError`` ``Unable to allocate 7.28 TiB``; a failed ``mmap`` is an ``OSError`` ENOMEM
    (and torch's own mmap loader a ``RuntimeError`` naming ``Cannot allocate memory``), without a size.
    """
    text = str(err)
    if isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in text.lower() and "CUDA" in text
    ):
        m = re.search(r"Tried to allocate ([\d.]+) (\w+)", text)
        asked = int(float(m.group(1)) * _UNITS.get(m.group(2), 1)) if m else None
        return OutOfMemory(asked, "the CUDA allocator")
    if isinstance(err, RuntimeError):
        m = re.search(r"you tried to allocate (\d+) bytes", text)
        if m:
            return OutOfMemory(int(m.group(1)), "torch's CPU allocator")
        if "Cannot allocate memory" in text or "can't allocate memory" in text:
            return OutOfMemory(None, "torch")
        return None
    if isinstance(err, MemoryError):
        m = re.search(r"Unable to allocate ([\d.]+) (\w+)", text)
        asked = int(float(m.group(1)) * _UNITS.get(m.group(2), 1)) if m else None
        return OutOfMemory(asked, "Python" if m is None else "numpy")
    if isinstance(err, OSError) and err.errno == errno.ENOMEM:
        return OutOfMemory(None, "the kernel (mmap)")
    return None


def out_of_memory_line(err: BaseException, command: str, shrink: str) -> str | None:
    """The one line for an allocation that failed in ``command`` (None when ``err`` is not one): the size asked
    for, what this machine has, and ``shrink``, the flags that make the work smaller."""
    oom = out_of_memory(err)
    if oom is None:
        return None
    asked = f"was asked for {gib(oom.asked)} at once" if oom.asked is not None else "could not allocate what it needed"
    limit = memory_limit("cuda" if oom.by == "the CUDA allocator" else "cpu")
    has = "" if limit is None else f" (this machine has {gib(limit[0])} available now: {limit[1]})"
    return f"{command} ran out of memory: {oom.by} {asked}{has}; pass a smaller {shrink}."


def release_freed_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``); False where there is no glibc.

    glibc keeps freed heap memory resident for reuse. Loading a model frees a lot of it (file bytes read,
    converted, copied into place): after loading SmolLM2 from its GGUF, ``malloc_trim(0)`` took the resident
    set from 773 to 467 MB (issue 51). Costs a few milliseconds; call it after such a phase, not per step.
    """
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


_EACH_LAYER: contextvars.ContextVar[bool] = contextvars.ContextVar("attnlab_trim_each_layer", default=False)


@contextlib.contextmanager
def heap_trimmed_each_layer() -> Iterator[None]:
    """Within it, a decoder on the CPU gives each layer's freed work memory back (:func:`trims_each_layer`).

    For a long prompt's last prefill calls, where the cache is fullest and the process peaks: glibc otherwise
    keeps the holes a layer frees resident while the next layer allocates more. SmolLM2 at 8184 tokens with the
    int8 cache (2 threads, AMD EPYC Zen 4, quiet, one prefill a process): untrimmed, 520-525 MB
    at the peak and 25.6-28.5 s to the first token; every layer of every call trimmed, 508-510 MB and 30.6-34.2 s
    (the freed pages are faulted in again in each layer); the last three calls' layers trimmed (what
    :func:`attnlab.models.generation.prefill` does), 508-511 MB and 26.8-31.6 s. The earlier calls are trimmed
    once each, after the call.
    """
    token = _EACH_LAYER.set(True)
    try:
        yield
    finally:
        _EACH_LAYER.reset(token)


def trims_each_layer() -> bool:
    """Whether the caller is inside :func:`heap_trimmed_each_layer`."""
    return _EACH_LAYER.get()


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (a prefill's last call calls it after every layer), or None without
    glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim
