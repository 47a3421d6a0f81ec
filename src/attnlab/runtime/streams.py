"""stdout and stderr as the user's environment hands them over, made safe for a command's first line.

* **Closed** (``>&-``, a daemon): Python sets ``sys.stdout`` to None, and the next file the process opens
  takes descriptor 1, so that a child's output (the compiler's) would land inside it. The descriptor is
  pointed at ``/dev/null`` and ``sys.stdout`` made a stream on it; a note says the output goes nowhere.
* **An encoding that cannot show the output** (``PYTHONIOENCODING=ascii``, a C locale): what it cannot
  encode is written as ``\\u`` escapes instead of ending the command with ``UnicodeEncodeError``, and a
  note says so, once, the first time it happens.
* **Full** (``> /dev/full``): :func:`stdout_target` names where stdout goes, for the line that says so.

Only the command line calls :func:`prepare_streams`; a library user's streams are theirs.
"""

from __future__ import annotations

import codecs
import io
import os
import stat
import sys

__all__ = ["ESCAPE", "prepare_streams", "stdout_is_full", "stdout_target"]

ESCAPE = "attnlab-escape"  # the error handler's name: backslashreplace, with a note the first time
_noted: list[str] = []


def _note(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


def _escape(err: UnicodeError) -> tuple[str | bytes, int]:
    if not _noted:
        encoding = getattr(err, "encoding", "?")
        _noted.append(encoding)
        _note(
            f"attnlab: note: stdout's encoding ({encoding}) cannot show every character of the output; those are "
            "written as \\u escapes (set PYTHONIOENCODING=utf-8, or a UTF-8 locale, to see them)."
        )
    return codecs.backslashreplace_errors(err)


codecs.register_error(ESCAPE, _escape)


def _reopen_closed(fd: int, name: str) -> bool:
    """``sys.<name>`` is None (``fd`` 1 or 2 was closed when Python started): give it a stream on /dev/null, put
    at ``fd`` when ``fd`` is still free (a child's output then goes nowhere, not into a file we open later);
    True if it was closed."""
    if getattr(sys, name) is not None:
        return False
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return False
    try:
        os.fstat(fd)  # taken since: an import opened a file there; leave it to its owner
    except OSError:
        os.dup2(devnull, fd)
        os.close(devnull)
        devnull = fd
    replacement = io.TextIOWrapper(
        io.FileIO(devnull, "w", closefd=devnull != fd), line_buffering=True, errors="backslashreplace"
    )
    setattr(sys, name, replacement)
    setattr(sys, f"__{name}__", replacement)
    return True


def prepare_streams() -> None:
    """Make closed streams and narrow encodings safe (see the module docstring); cheap, and idempotent."""
    out_closed = _reopen_closed(1, "stdout")
    _reopen_closed(2, "stderr")
    if out_closed:
        _note(
            "attnlab: note: stdout is closed (`>&-`), so this command's output goes nowhere; redirect it to a file "
            "(`> out.txt`) to keep it."
        )
    stream = sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        "\u2014\u00e9\u4e2d".encode(encoding)
        return
    except (UnicodeEncodeError, LookupError):
        pass
    if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
        stream.reconfigure(errors=ESCAPE)


def stdout_target() -> str:
    """Where stdout goes: ``'/dev/full'``, ``'/home/u/log.txt'``, or ``"stdout"`` where it cannot be told."""
    try:
        return repr(os.readlink("/proc/self/fd/1"))
    except OSError:
        return "stdout"


def stdout_is_full() -> bool:
    """stdout cannot take more: it is ``/dev/full``, or its file system has no free block or inode left."""
    try:
        st = os.fstat(1)
        if stat.S_ISCHR(st.st_mode):
            return os.path.realpath("/proc/self/fd/1") == "/dev/full"
        if not stat.S_ISREG(st.st_mode):
            return False  # a pipe or a terminal does not fill
        vfs = os.fstatvfs(1)
    except OSError:
        return False
    return vfs.f_bavail == 0 or (vfs.f_files > 0 and vfs.f_favail == 0)
