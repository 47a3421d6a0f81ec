"""How much memory this machine can give a command now, so that a request past it is refused up front."""

from __future__ import annotations

import os

import torch

__all__ = ["available_bytes", "gib"]


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Bytes a new allocation can take on ``device`` without swapping: Linux's ``MemAvailable`` (RAM the
    kernel can hand out, page cache included), free CUDA memory on a GPU; None where it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free)
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # other Unixes: free pages (an underestimate: page cache not counted)
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: float) -> str:
    """``n`` bytes as ``"1.5 GiB"`` (or MiB below one GiB), for messages."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
