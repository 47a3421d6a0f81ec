"""One process per output folder: an exclusive ``flock`` on ``DIR/.attnlab.lock``, held for the whole command.

Why a lock and not a check: ``attnlab train`` looked at its ``--out-dir``, built its model, then
wrote ``config.json``; two runs started at the same instant both found the folder free, both
trained, and their ``metrics.jsonl`` lines interleaved (issue 39). ``flock`` decides in one system
call, and the kernel releases it when the process ends, however it ends (kill -9 included).

* Taken non-blocking: a second process is refused at once, with the holder's PID, command, start
  time (and host, if another), which the holder writes into the file as JSON right after taking it.
* A file whose ``flock`` is free was left by a process that ended without releasing it (kill -9, a
  crash, power loss): the next process takes it over and says whose it was.
* On release the holder deletes the file while it still holds it, so a folder left alone holds no
  lock file. A process that opened the old file just before then holds a lock on a deleted file:
  :meth:`RunLock.acquire` checks, after ``flock`` succeeds, that the path still names the file it
  locked, and tries again if not.
* Once held, the temp files an earlier crash left (``.NAME.<hex>.tmp`` of an atomic write, a write
  probe ``.attnlab-write-probe-*``) are deleted, in the folder and in its subfolders that are not
  locked folders of their own, with one note saying how much was freed. Only the holder may: a
  running process's temp file is in a folder someone holds.

Cost, once per command (ext4, the loaded 2-core CPU machine of issue 39): acquire + release ~0.15 ms,
~0.3-0.4 ms with the leftover scan of a run folder (``tests/test_run_lock.py`` prints it). Truncating
the file to 0 bytes made it 3 ms: ext4 then flushes the file at close (see :meth:`RunLock._take`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from .errors import UsageError

__all__ = ["LOCK_NAME", "Holder", "RunLock", "command_line", "is_temp_leftover"]

LOCK_NAME = ".attnlab.lock"
# ``.checkpoint.safetensors.<uuid hex>.tmp`` (runtime/files.py's atomic writes; a file or, for a folder
# written aside, a directory) and ``.attnlab-write-probe-XXXXXXXX`` (check_writable_dir's probe)
_TEMP = re.compile(r"^\..+\.[0-9a-f]{8,}\.tmp$|^\.attnlab-write-probe-")
_HOLDER_WAIT_S = 0.5  # how long a refused process waits for the holder to finish writing its name


def command_line(argv: list[str] | None = None) -> str:
    """This process's command as a user would type it: ``attnlab train --steps 9``, ``python run.py``."""
    argv = list(sys.argv if argv is None else argv) or ["python"]
    head = argv[0].replace(os.sep, "/")
    if head.endswith("attnlab/__main__.py"):
        prog = "python -m attnlab"
    elif Path(head).name == "-c":
        prog = "python -c ..."
    else:
        prog = Path(head).name or "python"
    return " ".join([prog, *(shlex.quote(a) for a in argv[1:])])


def is_temp_leftover(name: str) -> bool:
    """Whether ``name`` is one of the temp files attnlab writes aside and renames (see the module docstring)."""
    return bool(_TEMP.match(name))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock: what the holder wrote into the lock file."""

    pid: int | None
    command: str
    host: str
    started: str  # local time, "2025-01-31 14:02:07"

    @classmethod
    def of_this_process(cls, command: str | None) -> Holder:
        return cls(os.getpid(), command or command_line(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S"))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names; None for an empty or foreign file (a holder still writing, or damage)."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        pid = data.get("pid")
        return cls(
            pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            str(data.get("command", "")),
            str(data.get("host", "")),
            str(data.get("started", "")),
        )

    def describe(self) -> str:
        """``PID 4242 (`attnlab train --out-dir r`, started 2025-01-31 14:02:07)``."""
        here = socket.gethostname()
        parts = [f"`{self.command}`"] if self.command else []
        if self.started:
            parts.append(f"started {self.started}")
        if self.host and self.host != here:
            parts.append(f"on host {self.host}")
        who = f"PID {self.pid}" if self.pid is not None else "a process whose PID it did not record"
        return who + (f" ({', '.join(parts)})" if parts else "")


class RunLock:
    """An exclusive lock on ``directory`` for this process; a context manager (``with RunLock(d): ...``).

    Args:
        directory: the folder to own; it must exist (create it first, e.g. with ``check_writable_dir``).
        flag: how the user named the folder, for the messages (``--out-dir``).
        fix: what a refused user can do, ending the refusal (``wait for it to finish, or pass another --out-dir``).
        command: the holder's command to record; None: this process's ``sys.argv``.
        note: where one-line notes go (a stale lock taken over, temp files removed); None: nowhere.
        clean: delete the temp files an earlier crash left, once held.

    Raises (from :meth:`acquire`):
        UsageError: another process holds the folder (its PID and command named), or the lock file
            cannot be created (the folder is not writable).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        flag: str = "--out-dir",
        fix: str = "",
        command: str | None = None,
        note: Callable[[str], None] | None = _stderr,
        clean: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.flag = flag
        self.fix = fix or f"wait for it to finish, or pass another {flag}"
        self.command = command
        self.note = note
        self.clean = clean
        self.previous: Holder | None = None  # the holder of a stale lock taken over
        self.removed: list[tuple[Path, int]] = []  # temp files removed, with their sizes in bytes
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if not self.try_acquire():
            raise self._refusal()
        return self

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False (nothing taken) while another process holds it.

        Raises:
            UsageError: the lock file cannot be created (the folder is not writable).
        """
        if self._fd is not None:
            return True
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._unwritable(err) from None
                return False
            try:  # the file we locked may have been deleted by its holder's release in between: lock the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        try:
            self._take(fd)
        except BaseException:
            self.release()
            raise
        return True

    def holder(self) -> Holder | None:
        """Who holds the lock now, as its file names them (None: no file, or a holder still writing its name)."""
        deadline = time.monotonic() + _HOLDER_WAIT_S
        while True:  # the holder writes its name just after flock
            try:
                holder = Holder.parse(self.path.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                return None
            if holder is not None or time.monotonic() >= deadline:
                return holder
            time.sleep(0.01)

    def release(self) -> None:
        """Delete the lock file (while still holding it: see the module docstring), then unlock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass  # a folder made read-only meanwhile: the next process finds the file, its flock free, and takes it
        os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    # -- internals --------------------------------------------------------------------------------------------
    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except IsADirectoryError:
            raise UsageError(
                f"{self.flag} {str(self.directory)!r} has a directory named {LOCK_NAME}, where attnlab keeps its "
                f"lock file; remove it (`rm -r {shlex.quote(str(self.path))}`) and run the command again."
            ) from None
        except OSError as err:
            raise self._unwritable(err) from None

    def _unwritable(self, err: OSError) -> UsageError:
        return UsageError(
            f"{self.flag} {str(self.directory)!r} cannot be written ({err.strerror or err}: attnlab could not "
            f"create its lock file {LOCK_NAME} there); pass a directory you can write to."
        )

    def _refusal(self) -> UsageError:
        holder = self.holder()
        who = holder.describe() if holder is not None else "a process that has not written its name into it"
        return UsageError(
            f"{self.flag} {str(self.directory)!r} is in use by another attnlab process, {who}, and one folder "
            f"holds one run at a time; {self.fix}."
        )

    def _take(self, fd: int) -> None:
        old = os.pread(fd, 1 << 16, 0)
        if old.strip():
            self.previous = Holder.parse(old.decode("utf-8", errors="replace")) or Holder(None, "", "", "")
        me = Holder.of_this_process(self.command)
        record = json.dumps({"pid": me.pid, "command": me.command, "host": me.host, "started": me.started})
        data = (record + "\n").encode()
        os.pwrite(fd, data, 0)
        # cut what a longer stale record left after it; never to 0 bytes, which on ext4 (auto_da_alloc) makes
        # the close at release flush the file to disk: 3 ms instead of ~0.1 ms
        os.ftruncate(fd, len(data))
        if self.previous is not None and self.note is not None:
            self.note(
                f"attnlab: note: {self.flag} {str(self.directory)!r} was locked by {self.previous.describe()}, "
                f"which ended without releasing it; this process holds it now."
            )
        if self.clean:
            self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        folders = [self.directory]
        try:
            folders += [p for p in self.directory.iterdir() if p.is_dir() and not p.is_symlink()]
        except OSError:
            return
        for folder in folders:
            if folder != self.directory and ((folder / LOCK_NAME).exists() or is_temp_leftover(folder.name)):
                continue  # a folder of its own (another run's, locked or not), or a leftover removed whole
            try:
                names = [p for p in folder.iterdir() if is_temp_leftover(p.name)]
            except OSError:
                continue
            for path in names:
                size = _tree_size(path)
                try:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                except OSError:
                    continue  # not ours to remove after all (permissions): it stays, and is not counted
                self.removed.append((path, size))
        if self.removed and self.note is not None:
            total = sum(size for _, size in self.removed)
            shown = ", ".join(str(p.relative_to(self.directory)) for p, _ in self.removed[:3])
            more = f" and {len(self.removed) - 3} more" if len(self.removed) > 3 else ""
            files = "temp file" if len(self.removed) == 1 else "temp files"
            self.note(
                f"attnlab: note: removed {len(self.removed)} {files} an earlier crash left in "
                f"{str(self.directory)!r} ({shown}{more}), {_size(total)} freed."
            )


def _tree_size(path: Path) -> int:
    """Bytes held by ``path`` (a file, or a folder and everything in it)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
        return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())
    except OSError:
        return 0
