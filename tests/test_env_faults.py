"""What the user's environment does to a command (issue 53), one test per cause: each fault is one attnlab line
with its fix, and nothing is lost; where a run was stopped, the resumed run ends bit-equal to one never stopped.

Causes: stdout closed, stdout unable to encode the output, stdout on a full disk, a signal during the imports of
``python -m attnlab``, the run folder removed under a run, inodes exhausted, ``ulimit -f`` (checked up front, and
named when a write crosses it), ``ulimit -v`` (the late imports loaded before the memory check), a symlink loop
as ``--out-dir``, a read-only HOME (matplotlib's warnings), a ValueError from inside our code (our crash, not a
usage error), and a rank lost while torchrun's ranks are still joining. (The kernels' build: test_kernel_build_lock.py.)
"""

from __future__ import annotations

import errno
import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.cli import main
from attnlab.distributed import failures
from attnlab.lab.train_state import CKPT_NAME, read_meta
from attnlab.runtime import DiskFullError, LimitError, UsageError, check_writable_dir, disk, streams
from test_disk_full import TINY, TRAIN, _resume_command

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC, **extra}
    env.pop("ATTNLAB_DEBUG", None)
    return env


def _same_weights(a: Path, b: Path) -> None:
    one, two = load_file(str(a / "model" / "model.safetensors")), load_file(str(b / "model" / "model.safetensors"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


# -- stdout ----------------------------------------------------------------------------------------------------
def test_a_closed_stdout_is_one_note_and_the_command_runs() -> None:
    """`>&-`: Python's sys.stdout is None; the command runs, says once that its output goes nowhere, exits 0."""
    out = subprocess.run(
        [sys.executable, "-m", "attnlab", "train", "--help"],
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        preexec_fn=lambda: os.close(1),
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr == (
        "attnlab: note: stdout is closed (`>&-`), so this command's output goes nowhere; redirect it to a file "
        "(`> out.txt`) to keep it.\n"
    )


def test_an_encoding_that_cannot_show_the_output_escapes_it_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    monkeypatch.setattr(streams, "_noted", [])
    streams.prepare_streams()
    print("caf\u00e9 \u2014 \u4e2d")
    print("na\u00efve")
    sys.stdout.flush()
    assert raw.getvalue().decode("ascii") == "caf\\xe9 \\u2014 \\u4e2d\nna\\xefve\n"
    assert capsys.readouterr().err == (
        "attnlab: note: stdout's encoding (ascii) cannot show every character of the output; those are written as "
        "\\u escapes (set PYTHONIOENCODING=utf-8, or a UTF-8 locale, to see them).\n"
    )


class _RefusingStdout(io.TextIOBase):
    """stdout that refuses every write with ``error``: a full disk (`> /dev/full`), a pipe whose reader exited."""

    def __init__(self, error: OSError) -> None:
        self.error = error

    def write(self, s: str) -> int:
        raise self.error


LINES_AT_3 = ["--eval-every", "4", "--log-every", "3", "--ckpt-every", "100"]  # a line at step 3, no checkpoint yet


def _train_with_stdout(
    error: OSError, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """A straight run, then one whose stdout refuses its first line (step 3) with ``error``: (exit code, stderr)."""
    assert main(["train", *TINY, *LINES_AT_3, "--out-dir", str(tmp_path / "straight")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", _RefusingStdout(error))
    monkeypatch.setattr(TRAIN, "stdout_target", lambda: "'/dev/full'")
    monkeypatch.setattr("attnlab.cli._quiet_stdout", lambda: None)  # it would point this process's fd 1 elsewhere
    code = main(["train", *TINY, *LINES_AT_3, "--out-dir", str(tmp_path / "cut")])
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert read_meta(tmp_path / "cut" / CKPT_NAME)["step"] == 3  # the step under way
    return code, err


STDOUT_FAULTS = {  # the error stdout's writes get, the exit code, the line (CUT: the run folder)
    "full disk": (
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
        1,
        "attnlab: error: no space left on device while writing its progress lines to stdout ('/dev/full'); the "
        "checkpoint of step 3 of 4, CUT/checkpoint.safetensors, is intact and no step since it is lost; send stdout "
        "to a file on a disk with room (`> log.txt`), then resume with `attnlab train --out-dir CUT --resume`",
    ),
    "closed pipe": (
        BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)),
        141,
        "attnlab: stdout's reader went away (a closed pipe, `| head`): stopped after step 3 of 4, checkpoint saved "
        "to CUT/checkpoint.safetensors; resume with `attnlab train --out-dir CUT --resume`",
    ),
}


@pytest.mark.parametrize("fault", list(STDOUT_FAULTS))
def test_stdout_that_refuses_a_line_saves_the_step_under_way_and_the_resumed_run_is_bit_equal(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error, exit_code, line = STDOUT_FAULTS[fault]
    code, err = _train_with_stdout(error, tmp_path, monkeypatch, capsys)
    assert (code, err) == (exit_code, line.replace("CUT", str(tmp_path / "cut")) + "\n")
    assert main(_resume_command(err)) == 0
    _same_weights(tmp_path / "straight", tmp_path / "cut")


# -- a signal while python -m attnlab imports -------------------------------------------------------------------
def test_ctrl_c_during_the_imports_of_python_m_attnlab_is_one_line() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "attnlab", "train", "--help"],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # -X importtime: a line per module imported; the first of attnlab's is in its __init__
        if "| attnlab." in line or "|   attnlab." in line or re.search(r"\|\s+attnlab\.", line):
            proc.send_signal(signal.SIGINT)  # the package's imports (torch, the models) take seconds more
            break
    else:
        pytest.fail("attnlab was never imported")
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    lines = [line for line in rest.splitlines() if not line.startswith("import time:")]
    assert lines == ["attnlab: interrupted (Ctrl-C) while starting, before any work; nothing was written."]


def test_the_start_guard_is_ended_for_other_modules_run_with_m() -> None:
    """`python -m attnlab.quant` imports the package too: its own SIGINT handling is Python's again after it."""
    code = "import signal, attnlab; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    out = subprocess.run(
        [sys.executable, "-c", "import sys, runpy; sys.argv = ['-m']; exec(sys.stdin.read())"],
        input=code,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "True", out.stderr


# -- the run folder --------------------------------------------------------------------------------------------
def test_a_run_folder_removed_under_the_run_is_made_again_with_the_step_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    assert main(["train", *TINY, "--out-dir", str(tmp_path / "straight")]) == 0
    cut = tmp_path / "cut"
    real = TRAIN.append_whole

    def append(path: Path, data: bytes, what: str | None = None) -> None:
        if b'"step": 3,' in data:
            shutil.rmtree(cut)  # `rm -rf` of the run folder, from another shell
        real(path, data, what)

    monkeypatch.setattr(TRAIN, "append_whole", append)
    capsys.readouterr()
    assert main(["train", *TINY, "--out-dir", str(cut)]) == 1
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert err == (
        f"attnlab: the run folder {str(cut)!r} was removed while the run wrote to it (at step 3 of 4); attnlab made "
        f"it again and saved the checkpoint of step 3 there, {cut / CKPT_NAME} (the metrics of earlier steps went "
        f"with the folder); resume with `attnlab train --out-dir {cut} --resume`\n"
    )
    assert main(_resume_command(err)) == 0
    _same_weights(tmp_path / "straight", cut)


def test_a_symlink_loop_as_out_dir_is_named(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(UsageError) as info:
        check_writable_dir(tmp_path / "a", "--out-dir")
    assert str(info.value) == (
        f"--out-dir {str(tmp_path / 'a')!r} is a symbolic link loop (ELOOP: {tmp_path / 'a'} -> b -> a -> b -> a ...); "
        "point the link at a real directory, or pass another --out-dir."
    )


# -- limits ----------------------------------------------------------------------------------------------------
def test_inodes_run_out_is_named_as_inodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "inodes_free", lambda path: 0)
    err = DiskFullError(errno.ENOSPC, tmp_path / "metrics.jsonl", "metrics.jsonl", 120, disk.DEFAULT_FIX)
    assert str(err).startswith(
        f"no free inodes left on that file system (statvfs f_favail 0) while writing metrics.jsonl (120 B) to "
        f"{str(tmp_path)!r}: "
    )
    assert str(err).endswith("; delete files there, or write elsewhere")
    with pytest.raises(UsageError, match=r"cannot be written \(no free inodes left on that file system"):
        real_open = os.open

        def no_inode(path, flags, mode=0o777, **kw):  # type: ignore[no-untyped-def]
            if "write-probe" in str(path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real_open(path, flags, mode, **kw)

        monkeypatch.setattr(os, "open", no_inode)
        check_writable_dir(tmp_path / "run", "--out-dir")


def test_ulimit_f_below_the_checkpoint_is_refused_before_any_work(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "attnlab", "train", "--out-dir", str(tmp_path / "run"), "--steps", "2", "--no-progress"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: __import__("resource").setrlimit(__import__("resource").RLIMIT_FSIZE, (200 * 1024,) * 2),
    )
    assert out.returncode == 2
    assert re.fullmatch(
        r"attnlab: error: `ulimit -f` allows files of 200.0 KiB \(RLIMIT_FSIZE\) but this run writes "
        r"checkpoint.safetensors of about [\d.]+ MiB to '.+'; raise the limit \(`ulimit -f unlimited`\) in the "
        r"shell that runs attnlab, or shrink the model \(--model.embed-dim, --model.num-layers\).\n",
        out.stderr,
    ), out.stderr
    assert not (tmp_path / "run").exists()


def test_a_write_past_ulimit_f_names_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk, "file_size_limit", lambda: 2**20)
    err = DiskFullError(errno.EFBIG, tmp_path / CKPT_NAME, CKPT_NAME, 3 * 2**20, disk.DEFAULT_FIX)
    assert f"the file grew past `ulimit -f` (1.0 MiB) while writing {CKPT_NAME} (3.0 MiB)" in str(err)
    assert str(err).endswith("; raise the limit (`ulimit -f unlimited`) in the shell that runs attnlab")


def test_ulimit_v_too_low_for_the_late_imports_is_said_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # its import fails, as under a low `ulimit -v`
    monkeypatch.setattr(resource, "getrlimit", lambda which: (900 * 2**20, resource.RLIM_INFINITY))
    with pytest.raises(LimitError) as info:
        TRAIN.import_writers()
    assert str(info.value).startswith(
        "`ulimit -v` allows this process 900.0 MiB of address space (RLIMIT_AS), too little to load safetensors and "
        "matplotlib, which a run writes its checkpoints and curve with ("
    )
    assert str(info.value).endswith("raise the limit (`ulimit -v unlimited`) in the shell that runs attnlab.")


def test_the_memory_check_runs_after_the_late_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    monkeypatch.setattr(TRAIN, "import_writers", lambda: order.append("imports"))
    real = TRAIN.check_train_fits
    monkeypatch.setattr(TRAIN, "check_train_fits", lambda *a, **k: (order.append("check"), real(*a, **k))[1])
    assert main(["train", *TINY, "--steps", "1", "--out-dir", str(tmp_path / "run")]) == 0
    assert order == ["imports", "check"]


@pytest.mark.slow
def test_the_cpu_time_limit_saves_the_step_under_way_and_names_the_limit(tmp_path: Path) -> None:
    """`ulimit -t`: SIGXCPU at the soft limit (SIGKILL follows at the hard one): the run saves, as on SIGTERM."""
    import resource

    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "attnlab", "train", *TINY, "--steps", "1000000", "--out-dir", str(run)],
        env=_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CPU, (25, 120)),
    )
    # past the soft limit the kernel sends SIGXCPU again each CPU second: one landing after attnlab put the default
    # handler back ends the process by that signal, which a shell reports as the same 152
    assert out.returncode in (128 + signal.SIGXCPU, -signal.SIGXCPU), out.stderr
    (line,) = out.stderr.splitlines()
    step = read_meta(run / CKPT_NAME)["step"]
    assert line == (
        "attnlab: SIGXCPU received: stopped after step "
        f"{step} of 1000000, checkpoint saved to {run / CKPT_NAME}; resume with `attnlab train --out-dir {run} "
        "--resume`"
    )


# -- HOME ------------------------------------------------------------------------------------------------------
def test_a_read_only_home_shows_no_matplotlib_warning(tmp_path: Path) -> None:
    home = tmp_path / "home-is-a-file"  # root writes through chmod: a HOME where no folder can be made
    home.write_text("")
    env = _env(HOME=str(home))
    for name in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        env.pop(name, None)
    code = (
        "from pathlib import Path; from attnlab.lab.plots import plot_run; "
        "plot_run([{'step': 1, 'loss': 1.0, 'eval_loss': 1.0, 'eval_acc': 0.5}], "
        f"Path({str(tmp_path / 'c.png')!r}), chance_acc=0.25)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert (tmp_path / "c.png").stat().st_size > 0


# -- our own crash -----------------------------------------------------------------------------------------------
def test_a_value_error_from_inside_our_code_is_our_crash_not_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnlab.tools import doctor

    def broken(**kwargs: object):  # a conversion of ours fails: no check of the user's input said so
        yield int("not a number")

    monkeypatch.setattr(doctor, "iter_findings", broken)
    assert main(["doctor", "--no-compile"]) == 3
    err = capsys.readouterr().err
    assert err.startswith(
        "attnlab: internal error: ValueError: invalid literal for int() with base 10: 'not a number' (in broken, "
    )
    assert err.endswith(
        "this is attnlab's bug, not a mistake in your input: rerun with ATTNLAB_DEBUG=1 for the traceback, and "
        "report it with the command.\n"
    )


def test_a_check_of_ours_raising_value_error_is_still_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "0", "--out-dir", "/tmp/never-made"]) == 2
    assert capsys.readouterr().err.startswith("attnlab: error: --steps must be")


# -- torchrun: a rank lost before the group forms ----------------------------------------------------------------
def test_a_rank_gone_while_joining_is_named() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    found = failures._joining_failure(0, 3, {1: gone.pid}, {2: time.monotonic() - 5})
    assert found is not None and found.lost == [1, 2] and found.reporter == 0
    assert found.what == (
        f"rank 1 (pid {gone.pid}) died while the ranks were still joining, before the process group formed (kill -9, "
        "a crash or the out-of-memory killer); also lost: rank 2"
    )
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert failures._joining_failure(0, 2, {1: alive.pid}, {}) is None
        assert failures._joining_failure(0, 2, {}, {1: time.monotonic()}) is None  # not seen yet: started just now
    finally:
        alive.kill()
        alive.wait()


TORCHRUN_KILL = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    out, phase = sys.argv[1], sys.argv[2]
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "attnlab",
         "train", "--out-dir", out, "--steps", "30", "--no-progress", "--device", "cpu", "--data.batch-size", "8"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)

    def ranks():
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == str(job.pid):
                    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
                    found.update({int(v[5:]): int(pid) for v in env if v.startswith(b"RANK=")})
            except OSError:
                pass
        return found

    def ready(pids):
        if len(pids) < 2:
            return False
        if phase == "joining":  # rank 0 has locked the run folder: it joins the group next
            return os.path.exists(os.path.join(out, ".attnlab.lock"))
        try:  # importing: rank 0 has loaded torch's library, inside attnlab's guarded imports
            return "libtorch_cpu" in open(f"/proc/{pids[0]}/maps").read()
        except OSError:
            return False

    pids = ranks()
    while not ready(pids):
        time.sleep(0.05)
        pids = ranks()
    os.kill(pids[1], signal.SIGKILL)
    print(job.communicate(timeout=120)[1])
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["importing", "joining"])
def test_a_rank_killed_before_the_group_forms_ends_every_rank_with_one_line(tmp_path: Path, phase: str) -> None:
    """Killed while rank 0 imports (the start guard speaks) or joins the group (the /proc watcher, or the failed
    rendezvous, speaks). Not covered: the first instant of the interpreter, before attnlab's first line runs."""
    out = subprocess.run(
        [sys.executable, "-c", TORCHRUN_KILL, str(tmp_path / "run"), phase],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("attnlab:")]
    assert len(lines) == 1, out.stdout + out.stderr
    assert re.match(
        r"attnlab: rank 1 .*died.*; so every rank stopped.*(with|again with) `torchrun --nproc_per_node 2 -m attnlab "
        r"train .*--out-dir",
        lines[0],
    ), lines[0]
