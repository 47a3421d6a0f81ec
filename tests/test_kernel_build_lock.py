"""The kernels' build on a first run: a killed build wedges nothing, a waiter says for whom it waits, and a
build that fails says its cause (full disk, read-only folder, no compiler, no ninja, a failed link, a
compile error, a compiler killed for memory) with its figures and its one fix (issue 53).

Fast tests stand ``cpp_extension.load`` in with a fake that keeps torch's own file baton (``lock``: a
killed torch build leaves it, and a plain load then waits on it for ever), or run torch's real build
with a fake compiler on ``CXX`` that fails as a real one does; the slow one kills a real build.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.utils import cpp_extension
from torch.utils.file_baton import FileBaton

from attnlab.quant import kernel_build, kernels
from attnlab.quant.kernel_build import KernelBuildError, explain, preflight

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")


def _fake_load(stuck_after_s: float = 10.0):
    """``cpp_extension.load`` as torch runs it, baton included, writing an empty library instead of compiling:
    a stale ``lock`` file makes it wait, as torch's does, but fail after ``stuck_after_s`` instead of hanging."""

    def load(name, sources, *, build_directory, **kwargs):
        baton = FileBaton(os.path.join(build_directory, "lock"))
        if baton.try_acquire():
            try:
                Path(build_directory, "attnlab_quant.so").write_bytes(b"\x7fELF")
            finally:
                baton.release()
            return
        deadline = time.monotonic() + stuck_after_s
        while os.path.exists(baton.lock_file_path):
            assert time.monotonic() < deadline, "torch's stale build lock was left in place: the load hangs"
            time.sleep(0.05)

    return load


@pytest.fixture
def build_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(cpp_extension, "load", _fake_load())
    monkeypatch.delenv(kernel_build.WAIT_ENV, raising=False)
    return tmp_path / "kernels" / "tag"


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from attnlab.quant.kernel_build import build_lock

    build_dir = Path(sys.argv[1])
    build_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(build_dir, print):
        (build_dir / "lock").write_text("")  # torch's baton, as a build under way holds it
        (build_dir / "qmatmul.o").write_bytes(b"half an object")
        print("held", flush=True)
        time.sleep(120)
    """
)


def _holder(build_dir: Path) -> subprocess.Popen[str]:
    """A process holding the build lock mid-build (torch's baton taken, half an object written)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(build_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_stale_torch_lock_is_cleared_by_the_next_build(build_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")  # what a build killed by an older attnlab (or torch alone) leaves
    kernels._compile(build_dir, quiet=True)
    assert (build_dir / "attnlab_quant.so").read_bytes() == b"\x7fELF"
    assert not (build_dir / "lock").exists() and not (build_dir / ".attnlab.lock").exists()
    assert capsys.readouterr().err == ""


def test_a_build_killed_with_sigkill_frees_its_lock(build_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _holder(build_dir)
    proc.kill()  # kill -9: no finally runs, torch's baton and our record stay on disk
    proc.wait()
    assert (build_dir / "lock").exists()
    start = time.monotonic()
    kernels._compile(build_dir, quiet=True)
    assert time.monotonic() - start < 5
    assert (build_dir / "attnlab_quant.so").exists() and not (build_dir / "qmatmul.o").exists()
    err = capsys.readouterr().err
    assert f"by PID {proc.pid} (" in err and "ended without finishing (killed?)" in err


STOPPED_BUILD = textwrap.dedent(
    """
    import errno, os, signal, sys, time
    from pathlib import Path
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton
    from attnlab.quant import kernels
    from attnlab.runtime import Terminated

    def raise_terminated(signum, frame):  # what attnlab's command line installs for SIGTERM
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, raise_terminated)
    build_dir, fault = Path(sys.argv[1]), sys.argv[2]

    def load(name, sources, *, build_directory, **kwargs):  # torch's baton, then a compile that takes a while
        baton = FileBaton(os.path.join(build_directory, "lock"))
        assert baton.try_acquire()
        try:
            Path(build_directory, "qmatmul.o").write_bytes(b"half an object")
            if fault == "ENOSPC":
                raise RuntimeError("Error building extension: qmatmul.o: fatal error: No space left on device")
            print("building", flush=True)
            time.sleep(60)
        finally:
            baton.release()

    cpp_extension.load = load
    print(kernels.build_kernels(quiet=True).reason, flush=True)
    """
)


# make test keeps SIGKILL (the hardest stop: no handler runs); the other three run in `make test-all` (CI)
@pytest.mark.parametrize(
    "fault", ["SIGKILL", *(pytest.param(f, marks=pytest.mark.slow) for f in ("SIGINT", "SIGTERM", "ENOSPC"))]
)
def test_a_build_stopped_any_way_is_followed_by_one_that_works(
    fault: str, build_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first run's build killed, interrupted, terminated or failed by a full disk: the next one just works."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STOPPED_BUILD, str(build_dir), fault],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if fault == "ENOSPC":
        assert first.startswith("building the kernels failed: ") and "the disk holding it is full" in first
    else:
        assert first == "building\n"
        proc.send_signal(getattr(signal, fault))
    proc.communicate(timeout=60)
    start = time.monotonic()
    kernels._compile(build_dir, quiet=True)  # the fake load of this process: a stale baton would make it fail
    assert time.monotonic() - start < 5
    assert (build_dir / "attnlab_quant.so").exists()
    assert not (build_dir / "lock").exists() and not (build_dir / ".attnlab.lock").exists()


def test_a_waiter_names_the_live_builder_and_gives_up_after_its_timeout(
    build_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = _holder(build_dir)
    try:
        monkeypatch.setenv(kernel_build.WAIT_ENV, "0.6")
        with pytest.raises(KernelBuildError) as info:
            kernels._compile(build_dir, quiet=True)
        err = capsys.readouterr().err
        assert (
            f"attnlab: waiting for PID {proc.pid} (" in err and "waiting up to 0.6 s, ATTNLAB_KERNEL_BUILD_WAIT" in err
        )
        assert f"PID {proc.pid} (" in info.value.cause and "(ATTNLAB_KERNEL_BUILD_WAIT=0.6)" in info.value.cause
        assert info.value.fix.startswith("let it finish, or end it if it is stuck")
        assert (build_dir / "lock").exists()  # a live builder's baton is left alone
    finally:
        proc.terminate()  # SIGTERM: its `with` releases, as a finished build does
        proc.wait()
    monkeypatch.setenv(kernel_build.WAIT_ENV, "30")
    kernels._compile(build_dir, quiet=True)
    assert (build_dir / "attnlab_quant.so").exists()


def test_build_kernels_reports_the_cause_and_never_raises(build_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setattr(kernels, "_build_dir", lambda: build_dir)
    monkeypatch.setenv("CXX", "attnlab-no-such-compiler")
    status = kernels.build_kernels(quiet=True)
    assert not status.available
    assert status.reason == (
        "building the kernels needs a C++17 compiler, and CXX='attnlab-no-such-compiler' is not on PATH; "
        "install one (`apt-get install g++`, `xcode-select --install`) or point CXX at one"
    )
    assert status.fix == "install one (`apt-get install g++`, `xcode-select --install`) or point CXX at one"


# -- each cause of a lost fast path, named --------------------------------------------------------------
def test_a_read_only_cache_folder_is_named_with_the_setting_that_moves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ATTNLAB_KERNEL_DIR", raising=False)
    target = tmp_path / "ro" / "kernels" / "tag"

    def refuse(self: Path, *args: object, **kwargs: object) -> None:  # root writes through chmod 555
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(KernelBuildError) as info:
        preflight(target, building=True)
    assert info.value.cause == (
        f"the kernels' folder {str(target)!r} cannot be written (Read-only file system at {str(tmp_path)!r})"
    )
    assert info.value.fix == (
        "set ATTNLAB_KERNEL_DIR (or XDG_CACHE_HOME, which moves all of attnlab's cache) to a folder you can write to"
    )
    monkeypatch.setenv("ATTNLAB_KERNEL_DIR", str(tmp_path / "ro"))
    with pytest.raises(KernelBuildError) as info:
        preflight(target, building=True)
    assert info.value.fix == f"point ATTNLAB_KERNEL_DIR (now {str(tmp_path / 'ro')!r}) at a folder you can write to"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 555 folder")
def test_an_unwritable_cache_folder_is_named(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    with pytest.raises(KernelBuildError, match=r"cannot be written \(Permission denied\)"):
        preflight(locked / "kernels" / "tag", building=True)


def test_too_little_room_or_no_inodes_is_said_before_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_build, "free_bytes", lambda path: 3 * 2**20)
    with pytest.raises(KernelBuildError) as info:
        preflight(tmp_path, building=True)
    assert info.value.cause == (
        f"building the kernels failed: {str(tmp_path)!r} cannot hold the build: the disk holding it is full "
        "(3.0 MiB free there, shutil.disk_usage; the build needs about 32.0 MiB)"
    )
    assert info.value.fix.startswith("free space there, or set ATTNLAB_KERNEL_DIR")
    monkeypatch.setattr(kernel_build, "free_bytes", lambda path: 50 * 2**30)
    monkeypatch.setattr(kernel_build, "inodes_free", lambda path: 0)
    with pytest.raises(KernelBuildError, match=r"has no free inodes \(statvfs f_favail 0, 50.0 GiB free\)"):
        preflight(tmp_path, building=True)


def test_a_disk_full_during_the_lock_or_a_write_names_the_free_space(tmp_path: Path) -> None:
    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / ".attnlab.lock"))
    why = explain(err, tmp_path)
    assert why.cause.startswith(f"building the kernels failed: {str(tmp_path)!r} cannot hold the build: the disk")
    assert "free there, shutil.disk_usage" in why.cause


def test_no_ninja_is_said_with_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(KernelBuildError) as info:
        preflight(tmp_path, building=True)
    assert str(info.value) == (
        "building the kernels needs ninja, which is not installed in this environment; "
        f"install it with `{sys.executable} -m pip install ninja`"
    )
    preflight(tmp_path, building=False)  # a built library needs no ninja: nothing to say


FAKE_CXX = textwrap.dedent(
    """\
    #!/bin/sh
    # A compiler that fails as a real one does: its version questions go to g++, then the canned failure.
    case "$*" in *-dumpfullversion*|*--version*|*-dumpversion*|*-v) exec g++ "$@";; esac
    case "$*" in
      *-shared*) [ -n "$LINK_ERROR" ] && { printf '%s\\n' "$LINK_ERROR" >&2; exit 1; } ;;
      *) [ -n "$COMPILE_ERROR" ] && { printf '%s\\n' "$COMPILE_ERROR" >&2; exit 1; } ;;
    esac
    out=""; prev=""
    for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
    : > "$out"
    """
)

CAUSES = {
    "disk full in TMPDIR": (
        {"COMPILE_ERROR": "/tmp/ccXq1.s: fatal error: error writing to /tmp/ccXq1.s: No space left on device"},
        r"building the kernels failed: '/tmp' cannot hold the build: the disk holding it is full \([\d.]+ \w+ free "
        r"there, shutil.disk_usage; the build needs about 32.0 MiB\); free space there, or set TMPDIR to a folder "
        r"on a disk with room",
    ),
    "compiler killed": (
        {"COMPILE_ERROR": "g++: fatal error: Killed signal terminated program cc1plus"},
        r"building the kernels failed: the compiler was killed, most likely for want of memory; free memory and run again",
    ),
    "compile error": (
        {"COMPILE_ERROR": "qmatmul.cpp:12:3: error: 'if constexpr' only available with -std=c++17"},
        r"the compiler rejected the kernels' source \(qmatmul.cpp:12:3: error: 'if constexpr' only available with "
        r"-std=c\+\+17\); they need C\+\+17",
    ),
    "link error": (
        {"LINK_ERROR": "/usr/bin/ld: cannot find -lgomp: No such file or directory"},
        r"linking the kernels failed \(/usr/bin/ld: cannot find -lgomp: No such file or directory\); install the "
        r"library libgomp \(for -lgomp: the compiler's OpenMP runtime, part of g\+\+\)",
    ),
}


# make test keeps the compile error; each other cause runs in `make test-all` (CI)
@pytest.mark.parametrize(
    "cause", [c if c == "compile error" else pytest.param(c, marks=pytest.mark.slow) for c in CAUSES]
)
def test_a_failed_build_says_its_cause(cause: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's real build (ninja and all) with a compiler that fails as a real one does; one line, the cause."""
    env, expected = CAUSES[cause]
    cxx = tmp_path / "fake-c++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from attnlab.quant import kernels
        kernels._build_dir = lambda: Path({str(tmp_path / "kernels")!r})
        print(kernels.build_kernels(quiet=True).reason)
        """
    )
    run_env = {**os.environ, "PYTHONPATH": SRC, "CXX": str(cxx), **env}
    run_env.pop("ATTNLAB_DEBUG", None)
    out = subprocess.run([sys.executable, "-c", script], env=run_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert "\n" not in line
    assert __import__("re").fullmatch(expected + ".*", line), line


def test_doctor_reports_the_same_problems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "attnlab-no-such-compiler")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    found = kernel_build.problems(tmp_path / "k")
    assert [p.cause.split(",")[0] for p in found] == [
        "building the kernels needs a C++17 compiler",
        "building the kernels needs ninja",
    ]


# -- a real build, killed -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_build_killed_mid_way_is_followed_by_one_that_works(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC, "ATTNLAB_KERNEL_DIR": str(tmp_path)}
    build = [sys.executable, "-m", "attnlab.quant", "build"]
    first = subprocess.Popen(build, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert first.stderr is not None
    assert "compiling its quantized-matmul kernels" in first.stderr.readline()
    time.sleep(2)  # the compiler is running
    os.killpg(first.pid, signal.SIGKILL)  # the OOM killer takes the whole build
    first.wait()
    (folder,) = (tmp_path / "kernels").iterdir()
    assert (folder / "lock").exists()  # torch's baton, which wedged every later run
    second = subprocess.run(build, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr
    assert second.stdout.startswith("attnlab's quantized kernels: int8 tiles on")
    assert f"by PID {first.pid} (" in second.stderr and "building again." in second.stderr
