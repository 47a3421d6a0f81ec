"""What a benchmark writes into ``--out-dir``: checked for room before the timing starts, and written whole.

Every file goes through :func:`attnlab.runtime.atomic_write_bytes` (PNGs too: matplotlib renders into
memory first), so a full disk or an interrupt leaves the previous file or the new one, and a full
disk is one :class:`attnlab.runtime.DiskFullError` line.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from ..runtime import atomic_write_bytes, check_free_space

__all__ = ["RESULT_BYTES", "check_room", "save_png"]

# JSON, Markdown and a PNG of one bench: 100-300 KiB measured; a partial pair besides. 1 MiB covers them.
RESULT_BYTES = 1 << 20


def check_room(out_dir: Path, command: str, files: str) -> None:
    """A :class:`attnlab.runtime.LimitError` now, before any timing, when ``out_dir`` lacks room for ``files``."""
    check_free_space(out_dir, {files: RESULT_BYTES}, who=command)


def save_png(fig: Any, path: Path) -> None:
    """Render ``fig`` (closing it) and write the PNG to ``path`` whole or not at all."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
