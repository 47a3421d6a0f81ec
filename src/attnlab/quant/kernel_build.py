"""The kernels' build, made safe against the faults of a first run: one builder at a time, a killed build
that wedges nothing, and a failure said by its real cause, with its figures and its one fix.

* **One builder, released by the OS.** The build holds ``.attnlab.lock`` in its folder with ``flock``
  (:class:`~attnlab.runtime.RunLock`, as a run folder does): the kernel releases it however its holder
  ends, kill -9 and the OOM killer included. A second process waits for a live holder, says whom it waits
  for and since when, and gives up after :data:`WAIT_ENV` seconds (default :data:`DEFAULT_WAIT_S`).
* **torch's own lock cannot wedge it.** ``cpp_extension.load`` guards its build with a plain file,
  ``<build dir>/lock``, that a killed build leaves behind and every later load waits on forever (issue 53:
  ``attnlab generate`` never returned). Whoever holds our lock is the only builder, so such a file is stale:
  it is removed; and a build that ended without releasing our lock (its record left in the lock file) has
  its outputs removed too, since a killed compiler or linker can leave half an object or library.
* **The cause, not a guess.** :func:`explain` reads an exception (or the compiler's output inside torch's
  ``RuntimeError``) as one of: a full disk or inode table, a folder that cannot be written, no compiler,
  no ninja, a compiler killed for memory, a failed link, a compile error, a library that does not load;
  :func:`preflight` checks the first four before a build starts, and ``attnlab doctor`` runs the same checks.

Where the kernels live: ``$ATTNLAB_KERNEL_DIR/kernels/<tag>``, else ``$XDG_CACHE_HOME/attnlab/kernels/<tag>``,
else ``~/.cache/attnlab/kernels/<tag>`` (:data:`CACHE_SETTING` names both settings in every fix).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..runtime import RunLock, UsageError, free_bytes, nbytes
from ..runtime.disk import inodes_free
from ..runtime.run_lock import Holder, command_line

__all__ = [
    "CACHE_SETTING",
    "DEFAULT_WAIT_S",
    "NEED_BYTES",
    "WAIT_ENV",
    "KernelBuildError",
    "build_lock",
    "checks",
    "explain",
    "preflight",
    "problems",
]

WAIT_ENV = "ATTNLAB_KERNEL_BUILD_WAIT"
DEFAULT_WAIT_S = 600.0  # a loaded 2-core machine builds in ~60 s; ten times that is a stuck builder
# What a build writes: ~1 MiB in its folder (qmatmul.o 0.5 MiB, the library 0.4 MiB) and the compiler's
# temporary assembly in TMPDIR; 32 MiB leaves room for both with a wide margin
NEED_BYTES = 32 * 2**20
CACHE_SETTING = "ATTNLAB_KERNEL_DIR (or XDG_CACHE_HOME, which moves all of attnlab's cache)"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton, in the build folder
_OUTPUTS = (".o", ".so", ".ninja_log", ".ninja_deps")  # what a killed build may have left half-written
_FULL = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}
_DENIED = {
    errno.EROFS: "Read-only file system",
    errno.EACCES: "Permission denied",
    errno.EPERM: "Operation not permitted",
}
_ABS_PATH = re.compile(r"(/[^\s:'\"`‘’()]+)")


class KernelBuildError(Exception):
    """Why the kernels could not be had: ``cause`` (with its figures) and ``fix``; ``str`` is ``"cause; fix"``."""

    def __init__(self, cause: str, fix: str) -> None:
        super().__init__(f"{cause}; {fix}")
        self.cause, self.fix = cause, fix


def _setting_fix(build_dir: Path) -> str:
    """How to move the kernels' folder: the setting that placed it there, or the two that can."""
    chosen = os.environ.get("ATTNLAB_KERNEL_DIR")
    if chosen:
        return f"point ATTNLAB_KERNEL_DIR (now {chosen!r}) at a folder you can write to"
    return f"set {CACHE_SETTING} to a folder you can write to"


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _full(folder: Path, build_dir: Path, code: int = errno.ENOSPC, *, ours: bool = True) -> KernelBuildError:
    """The disk (or inode table, or quota) holding ``folder`` is full: say which, with what is free there.
    ``ours``: ``folder`` is the kernels' folder or a parent it is created in (else the compiler's TMPDIR)."""
    free, inodes = free_bytes(folder), inodes_free(folder)
    if inodes == 0:
        what = f"the file system holding {str(folder)!r} has no free inodes (statvfs f_favail 0"
        what += "" if free is None else f", {nbytes(free)} free)"
        fix_what = "delete files there (many small ones free inodes)"
    else:
        cause = "its disk quota is used up" if code == errno.EDQUOT else "the disk holding it is full"
        what = f"{str(folder)!r} cannot hold the build: {cause} ({'?' if free is None else nbytes(free)} free there"
        what += f", shutil.disk_usage; the build needs about {nbytes(NEED_BYTES)})"
        fix_what = "free space there"
    move = _setting_fix(build_dir) if ours else "set TMPDIR to a folder on a disk with room"
    return KernelBuildError(f"building the kernels failed: {what}", f"{fix_what}, or {move}")


def _unwritable(folder: Path, build_dir: Path, why: str) -> KernelBuildError:
    """``folder`` refused a write: the kernels' folder (or the parent it is created in), or the compiler's TMPDIR."""
    if not (folder == build_dir or build_dir.is_relative_to(folder) or folder.is_relative_to(build_dir)):
        return KernelBuildError(
            f"the compiler's temporary folder {str(folder)!r} cannot be written ({why})",
            "set TMPDIR to a folder you can write to",
        )
    at = "" if folder == build_dir else f" at {str(folder)!r}"
    return KernelBuildError(
        f"the kernels' folder {str(build_dir)!r} cannot be written ({why}{at})", _setting_fix(build_dir)
    )


def _compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension runs


def _no_compiler() -> KernelBuildError:
    cxx = _compiler()
    via = f"CXX={cxx!r}" if "CXX" in os.environ else f"`{cxx}`"
    return KernelBuildError(
        f"building the kernels needs a C++17 compiler, and {via} is not on PATH",
        "install one (`apt-get install g++`, `xcode-select --install`) or point CXX at one",
    )


def _no_ninja() -> KernelBuildError:
    return KernelBuildError(
        "building the kernels needs ninja, which is not installed in this environment",
        f"install it with `{sys.executable} -m pip install ninja`",
    )


def _writable(build_dir: Path) -> None:
    """Create ``build_dir`` and prove it writable (a file made and removed), or raise the cause."""
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        probe = build_dir / f".attnlab-write-probe-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        probe.unlink()
    except OSError as err:
        raise explain(err, build_dir) from None


def checks(build_dir: Path) -> list[tuple[str, str, KernelBuildError | None]]:
    """What a build needs, as ``(topic, what was found, problem or None)``: the kernels' folder writable with
    room (free space and inodes), a C++ compiler, ninja. ``attnlab doctor`` prints them."""
    try:
        _writable(build_dir)
        free, inodes = free_bytes(build_dir), inodes_free(build_dir)
        room = None if (free is None or free >= NEED_BYTES) and inodes != 0 else _full(build_dir, build_dir)
    except KernelBuildError as err:
        free, room = None, err
    space = "" if free is None else f", {nbytes(free)} free"
    found = [("kernels' folder", f"{build_dir} (writable{space})", room)]
    cxx = shutil.which(_compiler())
    found.append(("C++ compiler", f"{cxx} (CXX or c++)" if cxx else "none", None if cxx else _no_compiler()))
    from torch.utils import cpp_extension

    ninja = cpp_extension.is_ninja_available()
    found.append(("ninja", "installed" if ninja else "none", None if ninja else _no_ninja()))
    return found


def problems(build_dir: Path) -> list[KernelBuildError]:
    """What would stop a build here now: :func:`checks`' problems, in their order."""
    return [problem for _, _, problem in checks(build_dir) if problem is not None]


def preflight(build_dir: Path, *, building: bool) -> None:
    """Raise :class:`KernelBuildError` for a cause known before any work: the folder cannot be created or
    written; and when ``building``, too little free space or inodes, no compiler, no ninja."""
    _writable(build_dir)
    missing = problems(build_dir) if building else []
    if missing:
        raise missing[0]


def _text_errno(text: str) -> int | None:
    for table in (_FULL, _DENIED):
        for code, words in table.items():
            if words in text:
                return code
    return None


def _where(text: str, words: str, build_dir: Path) -> Path:
    """The folder of the first absolute path on the line of ``text`` that says ``words``; else ``build_dir``."""
    line = next((line for line in text.splitlines() if words in line), "")
    found = _ABS_PATH.search(line)
    return Path(found.group(1)).parent if found else build_dir


def _first(text: str, *marks: str) -> str:
    """The first line of ``text`` holding one of ``marks`` (the compiler's own words), trimmed for a message."""
    for line in text.splitlines():
        if any(mark in line for mark in marks):
            return line.strip()[:200]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:200] if lines else ""


def explain(err: BaseException, build_dir: Path) -> KernelBuildError:
    """``err`` (from the lock, ``cpp_extension.load`` or loading the library) as its cause and one fix."""
    if isinstance(err, KernelBuildError):
        return err
    text = str(err)
    code = err.errno if isinstance(err, OSError) and err.errno else _text_errno(text)
    if code in _FULL:
        if isinstance(err, OSError) and err.filename:
            return _full(_existing(Path(err.filename).parent), build_dir, code)
        folder = _where(text, _FULL[code], build_dir)
        return _full(folder, build_dir, code, ours=folder.is_relative_to(build_dir))
    if code in _DENIED:
        if isinstance(err, OSError) and err.filename:
            folder = Path(err.filename)
            folder = folder if folder.is_dir() or folder == build_dir else folder.parent
        else:
            folder = _where(text, _DENIED[code], build_dir)
        return _unwritable(_existing(folder), build_dir, os.strerror(code))
    if "Ninja is required" in text:
        return _no_ninja()
    cxx = Path(_compiler()).name
    if re.search(rf"{re.escape(cxx)}: (command )?not found|{re.escape(cxx)}: No such file", text):
        return _no_compiler()
    if "Killed signal terminated program" in text or "internal compiler error: Killed" in text:
        return KernelBuildError(
            "building the kernels failed: the compiler was killed, most likely for want of memory",
            "free memory and run again (the build needs about 1 GiB)",
        )
    link = ("undefined reference", "collect2", "cannot find -l", "ld returned", "ld: ")
    if any(mark in text for mark in link):
        missing = re.search(r"cannot find -l([\w+.-]+)", text)
        fix = (
            f"install the library lib{missing.group(1)} (for -lgomp: the compiler's OpenMP runtime, part of g++)"
            if missing
            else "use the compiler torch was built with (g++ 9 or newer), or point CXX at it"
        )
        return KernelBuildError(f"linking the kernels failed ({_first(text, *link)})", fix)
    if "error:" in text:
        return KernelBuildError(
            f"the compiler rejected the kernels' source ({_first(text, 'error:')})",
            "they need C++17 (g++ 9 or clang++ 10 or newer): upgrade the compiler or point CXX at a newer one",
        )
    if isinstance(err, (ImportError, OSError)) or "undefined symbol" in text:
        return KernelBuildError(
            f"the built library in {str(build_dir)!r} does not load ({_first(text)})",
            f"delete that folder (`rm -r {build_dir}`) so that the next run builds it again",
        )
    return KernelBuildError(
        f"building the kernels failed ({type(err).__name__}: {_first(text)})",
        f"`ATTNLAB_DEBUG=1 {sys.executable} -m attnlab.quant build` shows the full error",
    )


def _since(holder: Holder | None) -> str:
    """``" for 42 s"``: how long ``holder`` has held the lock, from the start time it recorded."""
    try:
        started = time.mktime(time.strptime(holder.started, "%Y-%m-%d %H:%M:%S")) if holder else None
    except ValueError:
        started = None
    return "" if started is None else f" for {max(0, round(time.time() - started))} s"


def _wait_s() -> float:
    raw = os.environ.get(WAIT_ENV, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_WAIT_S
    except ValueError:
        raise UsageError(f"{WAIT_ENV}={raw!r} is not a number of seconds; set it to e.g. 600, or unset it.") from None


def _clear_killed_build(build_dir: Path, lock: RunLock, note: Callable[[str], None]) -> None:
    """Held: remove torch's baton (only a builder holding our lock takes it, so it is stale now); and when one of
    ours ended without releasing the lock (its record is still in the file), what it may have left half-written."""
    try:
        (build_dir / TORCH_LOCK).unlink()
    except FileNotFoundError:
        pass
    except OSError:
        pass  # left for torch to report: the folder's fault is explained by the build that follows
    if lock.previous is None:
        return
    removed = 0
    for path in build_dir.iterdir():
        if path.name.endswith(_OUTPUTS):
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
    note(
        f"attnlab: note: a kernel build in {str(build_dir)!r} by {lock.previous.describe()} ended without "
        f"finishing (killed?); removed its {removed} leftover file{'s' if removed != 1 else ''}, building again."
    )


@contextmanager
def build_lock(build_dir: Path, note: Callable[[str], None]) -> Iterator[None]:
    """Hold the kernels' build lock of ``build_dir`` for the block (waiting for a live holder, up to
    :data:`WAIT_ENV` seconds), with what a killed build left cleared first.

    Raises:
        KernelBuildError: the wait timed out (the holder named), or the lock file cannot be written.
    """
    lock = RunLock(
        build_dir, flag=CACHE_SETTING, note=None, clean=False, command=f"{command_line()} (building the kernels)"
    )
    wait_s, start, told = _wait_s(), time.monotonic(), False
    try:
        while not lock.try_acquire():
            holder = lock.holder()
            who = holder.describe() if holder is not None else "another process"
            waited = time.monotonic() - start
            if waited >= wait_s:
                raise KernelBuildError(
                    f"{who} has held the kernels' build lock in {str(build_dir)!r}{_since(holder)}, and this "
                    f"process gave up after {waited:.0f} s ({WAIT_ENV}={wait_s:g})",
                    "let it finish, or end it if it is stuck, then run again (a killed build frees the lock itself)",
                )
            if not told:
                note(
                    f"attnlab: waiting for {who} to finish building the quantized kernels in {str(build_dir)!r} "
                    f"(building{_since(holder)}; waiting up to {wait_s:g} s, {WAIT_ENV}) ..."
                )
                told = True
            time.sleep(0.2)
    except UsageError:  # the lock file cannot be created: say why by the file system's own error
        try:
            os.close(os.open(lock.path, os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as err:
            raise explain(err, build_dir) from None
        raise
    try:
        _clear_killed_build(build_dir, lock, note)
        yield
    finally:
        lock.release()
