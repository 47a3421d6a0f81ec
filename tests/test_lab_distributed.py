"""``torchrun --nproc_per_node 2 -m attnlab train``: DDP on gloo, ranks end with identical weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_cpu_processes_end_with_identical_weights(tmp_path):
    run = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "attnlab",
        "train",
        "--steps",
        "20",
        "--eval-every",
        "10",
        "--ckpt-every",
        "10",
        "--model.embed-dim",
        "32",
        "--no-progress",
        "--device",
        "cpu",
        "--out-dir",
        str(run),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20
    assert len(summary["rank_param_sha256"]) == 2 and summary["ranks_identical"]
    assert summary["rank_param_sha256"][0] == summary["rank_param_sha256"][1]
    assert done.stdout.count("done: 20 steps") == 1  # rank 0 alone reports (and writes)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 21  # one writer: no interleaved duplicates
