"""A run folder belongs to one process (issue 39): ``attnlab train``, ``ablate-heads``, ``inspect`` and ``bench``
hold ``--out-dir``'s lock for their whole run, taken before they look at the folder.

Two processes released at the same instant (each waits for a go-file, then calls ``attnlab.cli.main``): one
trains, the other is refused at once naming the first's PID and command. A lock left by a process that died
is taken over with a note, and the temp files of an earlier crash are removed. Under torchrun, rank 0's
refusal ends every rank.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.lab import DataConfig, ModelConfig, TrainConfig, train
from attnlab.lab.train_state import CKPT_NAME
from attnlab.runtime import LOCK_NAME, RunLock, UsageError
from attnlab.runtime.run_lock import Holder

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TINY = [
    "--data.batch-size",
    "8",
    "--data.copy-len",
    "4",
    "--model.num-layers",
    "1",
    "--model.embed-dim",
    "16",
    "--eval-every",
    "50",
    "--ckpt-every",
    "0",
    "--no-progress",
]
STARTED = r"started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d"

# A child waits, imported, until the go-file exists, then runs `attnlab ARGS` in-process (sys.argv as the
# console script sets it, so the command it records is the one a user typed).
CHILD = """
import os, sys, time, pathlib
go, ready, args = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
from attnlab.cli import main
sys.argv = ["attnlab", *args]
ready.write_text(str(os.getpid()))
while not go.exists():
    time.sleep(0.0002)
sys.exit(main(args))
"""


def _children(tmp_path: Path, commands: list[list[str]]) -> list[subprocess.Popen]:
    """Start one process per command, wait until all are imported and waiting, then release them together."""
    go = tmp_path / "go"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    procs = []
    for i, args in enumerate(commands):
        ready = tmp_path / f"ready-{i}"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", CHILD, str(go), str(ready), *args],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready-{i}").exists() for i in range(len(commands))):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.monotonic() < deadline, "the children never got ready"
        time.sleep(0.01)
    go.touch()
    return procs


def _refusal(run: str, pid: int, command: str, fix: str) -> re.Pattern[str]:
    return re.compile(
        re.escape(f"attnlab: error: --out-dir {run!r} is in use by another attnlab process, PID {pid} (`{command}`, ")
        + STARTED
        + re.escape(f"), and one folder holds one run at a time; {fix}.\n")
        + r"\Z"
    )


def test_two_runs_released_together_one_trains_the_other_is_refused_at_once(tmp_path, monkeypatch):
    """The issue's case: two `attnlab train` into one folder (other seeds) started together both trained."""
    commands = [["train", *TINY, "--steps", "60", "--seed", str(seed), "--out-dir", "run"] for seed in (0, 1)]
    procs = _children(tmp_path, commands)
    t0 = time.monotonic()
    pids = [p.pid for p in procs]
    ended: dict[int, float] = {}
    while len(ended) < len(procs) and time.monotonic() - t0 < 300:  # small outputs: the pipes never fill
        ended.update({i: time.monotonic() - t0 for i, p in enumerate(procs) if i not in ended and p.poll() is not None})
        time.sleep(0.005)
    results = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=60)
        results.append((p.returncode, out, err, ended[i]))
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    win = next(i for i, r in enumerate(results) if r[0] == 0)
    lose = 1 - win
    _, out, err, took = results[lose]
    assert out == ""
    winner_command = "attnlab " + " ".join(commands[win])
    m = re.fullmatch(
        re.escape(f"attnlab: error: --out-dir 'run' is in use by another attnlab process, PID {pids[win]} (`")
        + re.escape(winner_command)
        + re.escape("`, ")
        + STARTED
        + re.escape("), and one folder holds one run at a time; wait for it to finish, or start this run in another ")
        + r"folder with `(attnlab train [^`]+ --out-dir run-2)`\.\n",
        err,
    )
    assert m, err
    assert took < results[win][3]  # refused while the other still trained
    # the folder holds the winner's run, whole: its config, one line per step, no lock file left
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["seed"] == (0, 1)[win]
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(61))
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    monkeypatch.chdir(tmp_path)
    assert main(m.group(1).split()[1:]) == 0  # the suggested command runs as printed: the refused run, elsewhere
    assert json.loads((tmp_path / "run-2" / "config.json").read_text())["seed"] == (0, 1)[lose]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_stale_lock_is_taken_over_and_the_crash_leftovers_removed(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--ckpt-every", "1", "--out-dir", str(run)]) == 0
    # what a kill -9 mid-save leaves: the lock file with its PID, a full-size temp checkpoint, a write probe
    pid = _dead_pid()
    record = {"pid": pid, "command": "attnlab train --out-dir run", "host": socket.gethostname()}
    (run / LOCK_NAME).write_text(json.dumps({**record, "started": "2025-01-31 14:02:07"}) + "\n")
    tmp = run / f".{CKPT_NAME}.0123456789abcdef0123456789abcdef.tmp"
    tmp.write_bytes((run / CKPT_NAME).read_bytes())
    (run / ".attnlab-write-probe-x1y2z3ab").write_bytes(b"")
    (run / "model" / ".model.safetensors.fedcba9876543210fedcba9876543210.tmp").write_bytes(b"x" * 1000)
    (run / "notes.tmp").write_text("mine")  # not attnlab's: stays
    size = tmp.stat().st_size + 1000
    capsys.readouterr()
    assert main(["train", "--out-dir", str(run), "--resume", "--steps", "4"]) == 0
    err = capsys.readouterr().err
    freed = f"{size / 1024:.1f} KiB"
    assert err == (
        f"attnlab: note: --out-dir {str(run)!r} was locked by PID {pid} (`attnlab train --out-dir run`, started "
        f"2025-01-31 14:02:07), which ended without releasing it; this process holds it now.\n"
        f"attnlab: note: removed 3 temp files an earlier crash left in {str(run)!r} ({tmp.name}, "
        f".attnlab-write-probe-x1y2z3ab, model/.model.safetensors.fedcba9876543210fedcba9876543210.tmp), "
        f"{freed} freed.\n"
    )
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []
    assert (run / "notes.tmp").read_text() == "mine"


@pytest.mark.slow  # training subprocesses; the race test keeps the lock in make test
def test_resume_while_the_run_still_trains_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    args = [*TINY, "--steps", "100000", "--out-dir", str(run)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "train", *args], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") > 5):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        capsys.readouterr()
        assert main(["train", "--out-dir", str(run), "--resume"]) == 2
        err = capsys.readouterr().err
        pattern = _refusal(
            str(run),
            proc.pid,
            "python -m attnlab train " + " ".join(args),
            "wait for it to finish: --resume continues a run that has stopped, and this one is still running",
        )
        assert pattern.match(err), err
        # the Python API is held to the same rule
        cfg = TrainConfig(
            data=DataConfig(batch_size=8, copy_len=4), model=ModelConfig(num_layers=1, embed_dim=16), out_dir=run
        )
        with pytest.raises(UsageError, match=rf"is in use by another attnlab process, PID {proc.pid} "):
            train(cfg, quiet=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 143  # it saved and stopped as SIGTERM says
    assert not (run / LOCK_NAME).exists()
    assert main(["train", "--out-dir", str(run), "--resume", "--steps", str(_saved_step(run) + 1)]) == 0


def _saved_step(run: Path) -> int:
    from attnlab.lab.train_state import read_meta

    return int(read_meta(run / CKPT_NAME)["step"])


def test_every_command_that_writes_a_folder_takes_its_lock(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out-dir", str(run)]) == 0
    held = tmp_path / "held"
    held.mkdir()
    commands = {
        "train": ["train", *TINY, "--steps", "2", "--out-dir", str(held)],
        "ablate-heads": ["ablate-heads", "--train.steps", "2", "--out-dir", str(held)],
        "inspect": ["inspect", "--checkpoint", str(run), "--out-dir", str(held)],
        "bench": ["bench", "--lengths", "8", "--out-dir", str(held)],
    }
    with RunLock(held, command="attnlab something --out-dir held"):
        for name, argv in commands.items():
            capsys.readouterr()
            assert main(argv) == 2, name
            err = capsys.readouterr().err
            assert err.startswith(
                f"attnlab: error: --out-dir {str(held)!r} is in use by another attnlab process, PID {os.getpid()} "
                f"(`attnlab something --out-dir held`, started "
            ), (name, err)
            assert err.count("\n") == 1
    assert sorted(p.name for p in held.iterdir()) == []  # nothing written, the lock file gone with its holder


def test_the_lock_survives_its_file_being_replaced_between_open_and_flock(tmp_path, monkeypatch):
    """A process that opened the lock file just before its holder released (and deleted) it must not hold a
    lock on the deleted file while a third process holds the new one."""
    first = RunLock(tmp_path, note=None).acquire()
    stale_fd = os.open(first.path, os.O_RDWR)  # the late process's open, before the release
    first.release()
    third = RunLock(tmp_path, command="attnlab third", note=None).acquire()  # a new file, locked
    late = RunLock(tmp_path, note=None)
    opens = iter([stale_fd])
    real_open = late._open
    monkeypatch.setattr(late, "_open", lambda: next(opens, None) or real_open())
    with pytest.raises(UsageError, match=rf"PID {os.getpid()} \(`attnlab third`"):
        late.acquire()  # flock on the deleted file succeeds, the path names another file: it tries again
    third.release()


def test_lock_file_is_no_run_file_and_a_damaged_one_is_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text("garbage")  # a torn or foreign lock file, its flock free
    notes: list[str] = []
    with RunLock(run, note=notes.append) as lock:
        assert Holder.parse(lock.path.read_text()).pid == os.getpid()
    assert notes == [
        f"attnlab: note: --out-dir {str(run)!r} was locked by a process whose PID it did not record, which ended "
        f"without releasing it; this process holds it now."
    ]
    (run / LOCK_NAME).write_text("")  # left empty by a kill between open and write: nobody to name
    code = main(["train", *TINY, "--steps", "2", "--out-dir", str(run), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "it holds nothing" in err and LOCK_NAME not in err


def test_the_time_the_lock_takes(tmp_path, capsys):
    """Acquire + release, the crash-leftover scan of a run folder included: a fraction of a millisecond, once
    per command (measured on issue 39's 2-core machine: ~0.15 ms without the scan, ~0.3 ms with it)."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out-dir", str(run)]) == 0
    times = []
    for _ in range(200):
        t = time.perf_counter()
        RunLock(run, note=None).acquire().release()
        times.append(time.perf_counter() - t)
    median = sorted(times)[len(times) // 2]
    with capsys.disabled():
        print(f"\nrun lock, acquire + release: median {median * 1e6:.0f} us over {len(times)}")
    assert median < 0.02  # generous: a loaded CI machine; the point is no cost on a run's scale


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # training subprocesses; the race test keeps the lock in make test
def test_under_torchrun_a_refusal_on_rank_0_ends_every_rank(tmp_path):
    """Rank 0 alone locks the folder; its refusal reaches the other rank through the process group."""
    held = tmp_path / "held"
    held.mkdir()
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out_dir = ["--out-dir", str(held)]
    with RunLock(held, command="attnlab holder", note=None):
        procs = []
        for rank in range(2):
            dist_env = {
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "attnlab", "train", *TINY, "--steps", "2", "--device", "cpu", *out_dir],
                    env={**env, **dist_env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=120)[0] for p in procs]  # a rank left waiting would time out here
    assert [p.returncode for p in procs] == [2, 2], logs
    for log in logs:
        assert log.startswith(
            f"attnlab: error: --out-dir {str(held)!r} is in use by another attnlab process, PID {os.getpid()} "
            f"(`attnlab holder`, started "
        ), logs
        assert "Traceback" not in log and log.count("\n") == 1, logs
    assert sorted(p.name for p in held.iterdir()) == []
