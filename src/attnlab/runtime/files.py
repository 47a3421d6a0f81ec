"""Output directories checked before any work, and files that are either whole or absent."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from .disk import DISK_ERRNOS, free_bytes, nbytes, refusal_cause, writing
from .errors import UsageError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "check_writable_dir",
    "missing_dirs",
    "remove_if_empty",
    "PROBE_BYTES",
]

# What the probe writes: real bytes, so that a disk with no room for a block (or a quota used up) fails
# here, in the command's first second; an empty file needs only an inode and passed on a full disk.
PROBE_BYTES = 4096


def check_writable_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """Create ``path`` if needed and prove it writable by writing :data:`PROBE_BYTES` there (then removing them),
    so that a command fails in its first second rather than after minutes of work."""
    p = Path(path)
    try:
        p.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:  # `mkdir` would say "File exists" of it
            raise UsageError(
                f"{flag} {str(p)!r} is a symbolic link loop (ELOOP: {_link_chain(p)}); point the link at a real "
                f"directory, or pass another {flag}."
            ) from None
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {str(p)!r} is a file, expected a directory; pass a directory path.")
    probe = p / f".attnlab-write-probe-{uuid.uuid4().hex}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, bytes(PROBE_BYTES))
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno in DISK_ERRNOS:
            free = free_bytes(p)
            cause, fix = refusal_cause(err.errno, p)  # the inodes or `ulimit -f`, when they are what ran out
            raise UsageError(
                f"{flag} {str(p)!r} cannot be written ({cause if fix else err.strerror}"
                + ("" if free is None else f", {nbytes(free)} free there")
                + f"); {fix or 'free space there'}, or pass another {flag}."
            ) from None
        raise UsageError(
            f"{flag} {str(p)!r} cannot be written ({err.strerror or err}); pass a directory you can write to."
        ) from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:  # a directory we could not write into cannot hold the probe either
            pass
    return p


def missing_dirs(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, deepest first: what :func:`check_writable_dir` creates,
    so that a command that stops before writing anything can take them away again (:func:`remove_if_empty`)."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            break
        missing.append(p)
    return missing


def remove_if_empty(created: list[Path]) -> None:
    """Remove the directories a command created (deepest first, as :func:`missing_dirs` lists them), as long as
    they are empty."""
    for p in created:
        try:
            p.rmdir()
        except OSError:
            return


def _link_chain(p: Path, hops: int = 4) -> str:
    """``'a' -> 'b' -> 'a' ...``: the first links of a loop, for the message."""
    chain, seen = [str(p)], p
    for _ in range(hops):
        try:
            target = os.readlink(seen)
        except OSError:
            break
        seen = seen.parent / target
        chain.append(target)
    return " -> ".join(chain) + " ..."


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, what: str | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename: a crash, an interrupt or a full disk
    leaves the old file or the new one, never half of one. A full disk is a
    :class:`~attnlab.runtime.disk.DiskFullError` about ``what`` (default: the file's name)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
    try:
        with writing(p, what, len(data)):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike[str], text: str, what: str | None = None) -> None:
    atomic_write_bytes(path, text.encode(), what)
