"""A full disk, said in one line: before the work, the free space checked against what the command will
write; during it, a write the file system refuses (ENOSPC, EDQUOT, EFBIG) named with what was being
written, where, how much is free, and the fix.

Every write of a run goes through one of three doors: :func:`attnlab.runtime.atomic_write_bytes`
(a temp file, then a rename: the old file stays whole), :func:`append_whole` (a line appended whole
or not at all: a failed append is cut back to the size before it) and :func:`writing` (a block
that writes files its own way, a directory of them for instance). Each turns the file system's
refusal into :class:`DiskFullError`, still an ``OSError`` (with its ``errno``) so that code that
catches ``OSError`` keeps working, and whose ``str`` is the line ``attnlab`` prints.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import LimitError

__all__ = [
    "DISK_ERRNOS",
    "DiskFullError",
    "append_whole",
    "check_free_space",
    "disk_full_line",
    "file_size_limit",
    "free_bytes",
    "inodes_free",
    "is_disk_full",
    "nbytes",
    "refusal_cause",
    "writing",
]

DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_CAUSE = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "the disk quota is used up",
    errno.EFBIG: "the file grew past what that file system or `ulimit -f` allows",
}
DEFAULT_FIX = "free space there, or write to another directory"


def nbytes(n: float) -> str:
    """``n`` bytes as ``"512 B"``, ``"12.0 KiB"``, ``"3.4 MiB"``, ``"1.5 GiB"`` or ``"2.0 TiB"``, for messages."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes free for this user on the file system that holds ``path`` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def inodes_free(path: str | os.PathLike[str]) -> int | None:
    """Inodes (files) this user can still create on the file system holding ``path``; None where it has no count."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_favail if st.f_files else None  # f_files 0: no fixed inode table (btrfs)


def file_size_limit() -> int | None:
    """``ulimit -f`` (RLIMIT_FSIZE) in bytes, or None when there is none."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def refusal_cause(code: int, folder: str | os.PathLike[str]) -> tuple[str, str | None]:
    """``(what ran out, the fix it needs or None for the usual one)`` for a write refused with ``code`` in
    ``folder``: the inodes rather than the blocks when none are left, ``ulimit -f`` when it is set."""
    if code == errno.ENOSPC and inodes_free(folder) == 0:
        return "no free inodes left on that file system (statvfs f_favail 0)", "delete files there, or write elsewhere"
    limit = file_size_limit()
    if code == errno.EFBIG and limit is not None:
        return (
            f"the file grew past `ulimit -f` ({nbytes(limit)})",
            "raise the limit (`ulimit -f unlimited`) in the shell that runs attnlab",
        )
    return _CAUSE.get(code, os.strerror(code)), None


class DiskFullError(OSError):
    """A write the file system refused for want of space (ENOSPC), quota (EDQUOT) or file size (EFBIG).

    An ``OSError`` with the original ``errno`` and ``filename``; ``str(err)`` is one line: the cause, what
    was being written and where, what is free there, and ``fix``. :meth:`refix` replaces the fix (a training
    run says which checkpoint is intact and how to resume).
    """

    def __init__(
        self, code: int, path: str | os.PathLike[str], what: str, size: int | None, fix: str, where: str | None = None
    ) -> None:
        self.free = free_bytes(Path(path).parent) if where is None else None
        free = "" if self.free is None else f", {nbytes(self.free)} free"
        super().__init__(code, f"{os.strerror(code)}{free}", str(path))
        self.path, self.what, self.size, self.fix, self.where = Path(path), what, size, fix, where

    def refix(self, fix: str) -> DiskFullError:
        """The same failure with another fix."""
        return DiskFullError(self.errno or errno.ENOSPC, self.path, self.what, self.size, fix, self.where)

    def __str__(self) -> str:
        size = "" if self.size is None else f" ({nbytes(self.size)})"
        free = "" if self.free is None else f": {nbytes(self.free)} free there (shutil.disk_usage)"
        cause, fix = refusal_cause(self.errno or errno.ENOSPC, self.path.parent)
        fix = self.fix if fix is None or self.fix != DEFAULT_FIX else fix
        where = self.where or repr(str(self.path.parent))
        return f"{cause} while writing {self.what}{size} to {where}{free}; {fix}"

    def __reduce__(self) -> tuple[Any, ...]:  # OSError's own pickles its args, not these
        return (DiskFullError, (self.errno or errno.ENOSPC, self.path, self.what, self.size, self.fix, self.where))


def is_disk_full(err: BaseException) -> bool:
    """``err`` is the file system refusing a write for space, quota or file size."""
    return isinstance(err, OSError) and err.errno in DISK_ERRNOS


@contextmanager
def writing(path: str | os.PathLike[str], what: str | None = None, size: int | None = None) -> Iterator[None]:
    """Inside the block, a disk-full ``OSError`` becomes :class:`DiskFullError` about ``what`` (default: the
    file's name) at ``path``; a :class:`DiskFullError` raised deeper passes as it is."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as err:
        if err.errno not in DISK_ERRNOS:
            raise
        raise DiskFullError(err.errno, path, what or Path(path).name, size, DEFAULT_FIX) from None


def append_whole(path: str | os.PathLike[str], data: bytes, what: str | None = None) -> None:
    """Append ``data`` to ``path`` whole or not at all: a write the file system refuses part-way (a full disk)
    is cut back to the file's size before it, and raised as :class:`DiskFullError`.

    One ``open``/``write``/``close`` of the unbuffered file, as a plain append costs (~10 us); nothing
    is synced, so a power cut can still lose the line's tail, which :func:`attnlab.lab.train.read_metrics`
    skips.
    """
    with writing(path, what, len(data)):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:  # a refused write, or an interrupt between two partial writes
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)


def check_free_space(
    directory: str | os.PathLike[str], parts: Mapping[str, int], *, who: str = "this run", flag: str = "--out-dir"
) -> None:
    """A :class:`LimitError` before any work when ``directory``'s file system has less free space than the sum
    of ``parts`` (what will be written, by name: ``{"checkpoint.safetensors x 2 ...": n, ...}``).

    One ``statvfs`` call (``shutil.disk_usage``), a few microseconds.
    """
    free = free_bytes(directory)
    need = sum(parts.values())
    if free is None or need <= free:
        return
    listed = ", ".join(f"{name} {nbytes(n)}" for name, n in parts.items() if n)
    raise LimitError(
        f"{flag} {str(directory)!r} has {nbytes(free)} free (shutil.disk_usage) but {who} writes about "
        f"{nbytes(need)} there ({listed}); free {nbytes(need - free)} or more there, or pass another {flag}."
    )


def disk_full_line(err: BaseException) -> str | None:
    """The one line for a write the file system refused for space, quota or size; None for any other error.

    A :class:`DiskFullError` says it already; a bare ``OSError`` (a library that writes its own files) is
    named with its file and what is free there.
    """
    if isinstance(err, DiskFullError):
        return str(err)
    if not is_disk_full(err):
        return None
    assert isinstance(err, OSError)
    where = "" if err.filename is None else f" {str(err.filename)!r}"
    folder = None if err.filename is None else Path(str(err.filename)).parent
    free = None if folder is None else free_bytes(folder)
    left = "" if free is None else f": {nbytes(free)} free there (shutil.disk_usage)"
    cause, fix = refusal_cause(err.errno or errno.ENOSPC, folder or ".")
    return f"{cause} while writing{where}{left}; {fix or DEFAULT_FIX}"
