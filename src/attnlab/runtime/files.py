"""Output directories checked before any work, and files that are either whole or absent."""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

from .errors import UsageError

__all__ = ["atomic_write_bytes", "atomic_write_text", "check_writable_dir"]


def check_writable_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """Create ``path`` if needed and prove it writable by writing a probe file there, so that a
    command fails in its first second rather than after minutes of work."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {str(p)!r} is a file, expected a directory; pass a directory path.")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".attnlab-write-probe-"):
            pass
    except OSError as err:
        raise UsageError(
            f"{flag} {str(p)!r} cannot be written ({err.strerror or err}); pass a directory you can write to."
        ) from None
    return p


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: a crash or an interrupt
    leaves the old file or the new one, never half of one."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode())
