"""SIGINT and SIGTERM sent to real ``attnlab train`` processes: the step under way finishes, the checkpoint
is written, one line says how to resume, the exit code is 130/143, no traceback, and the resumed run
ends with the weights of a run never interrupted (as ``test_lab_checkpoint.py`` checks after SIGKILL).
Under DDP (two ranks launched as torchrun would, signalled as Ctrl-C signals a terminal's process
group), every rank stops at the same step and the printed command resumes the job.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import tyro
from safetensors.torch import load_file

from attnlab.lab import TrainConfig, train, train_state
from attnlab.lab.train_state import CKPT_NAME

ROOT = Path(__file__).resolve().parents[1]
# dropout 0.1 so that the saved RNG state matters; a tiny model, so 400 steps take a second or two
ARGS = [
    "--data.batch-size",
    "8",
    "--data.copy-len",
    "4",
    "--model.num-layers",
    "1",
    "--model.embed-dim",
    "16",
    "--model.dropout",
    "0.1",
    "--steps",
    "400",
    "--eval-every",
    "100",
    "--ckpt-every",
    "150",
    "--no-progress",
]
LINE = re.compile(
    r"^attnlab: (SIGINT|SIGTERM) received: stopped after step (\d+) of (\d+), checkpoint saved to (\S+); "
    r"resume with `([^`]+)`$",
    re.M,
)


def _start(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "attnlab", "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def _wait_for_steps(run: Path, proc: subprocess.Popen, lines: int, timeout: float = 120) -> None:
    """Until ``metrics.jsonl`` has ``lines`` lines: the loop is running (and the signal handlers are in)."""
    deadline = time.monotonic() + timeout
    metrics = run / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= lines):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.01)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(run / CKPT_NAME)).items() if k.startswith("model.")}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # the in-process reference run computes as the OMP_NUM_THREADS=1 processes do
def test_sigint_and_sigterm_save_and_resume_to_the_uninterrupted_weights(tmp_path):
    runs = {signal.SIGINT: tmp_path / "int", signal.SIGTERM: tmp_path / "term"}
    procs = {sig: _start(*ARGS, "--out-dir", str(run)) for sig, run in runs.items()}
    for sig, proc in procs.items():
        _wait_for_steps(runs[sig], proc, 20)
        proc.send_signal(sig)
    # the uninterrupted run, in this process while those two stop
    reference = train(tyro.cli(TrainConfig, args=[*ARGS, "--out-dir", str(tmp_path / "full")]), quiet=True)
    resumes = {}
    for sig, proc in procs.items():
        log = proc.communicate(timeout=120)[0]
        assert proc.returncode == 128 + sig, log  # 130, 143
        assert "Traceback" not in log, log
        (match,) = LINE.findall(log)  # one line, and only one
        name, step, total, ckpt, resume = match
        assert name == sig.name and total == "400" and Path(ckpt) == runs[sig] / CKPT_NAME
        assert 20 <= int(step) < 400
        assert train_state.read_meta(runs[sig] / CKPT_NAME)["step"] == int(step)
        assert not (runs[sig] / "summary.json").exists()
        assert resume == f"attnlab train --out-dir {runs[sig]} --resume"
        resumes[sig] = (_start(*shlex.split(resume)[2:]), int(step))  # the printed command, as printed
    for sig, (proc, step) in resumes.items():
        log = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, log
        assert f"resumed {runs[sig] / CKPT_NAME} at step {step}" in log
        assert _same(_weights(runs[sig]), _weights(reference.run_dir)), f"{sig.name}: not the uninterrupted weights"
        steps = [int(m) for m in re.findall(r'"step": (\d+)', (runs[sig] / "metrics.jsonl").read_text())]
        assert steps == list(range(401))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(args: list[str], port: int, pgroup: int | None = None) -> list[subprocess.Popen]:
    """Two ranks of one DDP job, as ``torchrun --nproc_per_node 2`` starts them, in one process group."""
    procs: list[subprocess.Popen] = []
    for rank in range(2):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
        group = procs[0].pid if procs else (pgroup if pgroup is not None else 0)
        procs.append(_start(*args, "--device", "cpu", env=env, process_group=group))
    return procs


@pytest.mark.slow
def test_under_ddp_every_rank_stops_at_the_same_step_and_the_run_resumes(tmp_path):
    cut = tmp_path / "cut"
    args = [*ARGS[:-7], "--steps", "150", "--eval-every", "50", "--ckpt-every", "50", "--no-progress"]
    ranks = _ranks([*args, "--out-dir", str(cut)], _free_port())
    _wait_for_steps(cut, ranks[0], 20)
    os.killpg(ranks[0].pid, signal.SIGINT)  # Ctrl-C: the terminal signals every process of the group
    time.sleep(0.05)
    try:
        os.killpg(ranks[0].pid, signal.SIGINT)  # torchrun passes it on as well: a second one, ignored
    except ProcessLookupError:
        pass
    # A rank that stopped at another step would leave the other blocked in an all-reduce: a timeout here.
    logs = [p.communicate(timeout=120)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [130, 130], logs
    assert not any("Traceback" in log for log in logs), logs
    (match,) = LINE.findall(logs[0])  # rank 0 speaks for the job
    assert not LINE.findall(logs[1])
    step = int(match[1])
    assert match[4] == f"torchrun --nproc_per_node 2 -m attnlab train --out-dir {cut} --resume"
    assert train_state.read_meta(cut / CKPT_NAME)["step"] == step < 150
    resumed = _ranks(shlex.split(match[4])[6:], _free_port())  # the torchrun part is what _ranks does
    logs = [p.communicate(timeout=120)[0] for p in resumed]
    assert [p.returncode for p in resumed] == [0, 0], logs
    assert f"resumed {cut / CKPT_NAME} at step {step}" in logs[0]
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["steps"] == 150 and summary["ranks_identical"]
    steps = [int(m) for m in re.findall(r'"step": (\d+)', (cut / "metrics.jsonl").read_text())]
    assert steps == list(range(151))  # one writer, each step once
