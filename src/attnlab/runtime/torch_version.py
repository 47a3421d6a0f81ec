"""The torch releases attnlab supports, checked when attnlab is imported.

attnlab relies on parts of torch that changed across releases (``enable_gqa`` in SDPA, flex attention's
``AuxRequest``, dynamo's recompile-limit switches, the graphs its compiled decode step traces). It is tested on
torch 2.13 (CPU, every commit) and 2.11 (CUDA 13.0 on an H200: the device suite and ``scripts/gpu_check.py``);
older releases are refused at import with one sentence rather than failing later inside a compiled graph. The
same floor is in ``pyproject.toml``, so pip upgrades an older torch at install.
"""

from __future__ import annotations

import re

__all__ = ["MIN_TORCH", "TESTED_TORCH", "check_torch_version", "torch_version_problem"]

MIN_TORCH = (2, 11)  # the oldest release tested (the H200 run); pyproject.toml says torch>=2.11
TESTED_TORCH = "2.11 (CUDA 13.0, H200) and 2.13 (CPU)"


def torch_version_problem(version: str) -> str | None:
    """Why ``version`` (a ``torch.__version__`` string) is not supported, or None when it is.

    Development builds of a supported release (``2.12.0a0+git...``, ``2.11.0+cu130``) are supported; a string
    that does not start with ``MAJOR.MINOR`` is let through (a custom build that attnlab cannot read)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        return None
    have = (int(found.group(1)), int(found.group(2)))
    if have >= MIN_TORCH:
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return (
        f"attnlab needs torch >= {floor} (tested on {TESTED_TORCH}), but this environment has torch {version}; "
        f"upgrade it with pip install -U 'torch>={floor}' (for a CUDA build, the command from pytorch.org for "
        f"your CUDA version)."
    )


def check_torch_version() -> None:
    """Raise ImportError naming the installed torch, the floor and the fix when this torch is too old."""
    import torch

    problem = torch_version_problem(str(torch.__version__))
    if problem is not None:
        raise ImportError(problem)
