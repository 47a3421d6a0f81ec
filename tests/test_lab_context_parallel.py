"""``torchrun ... -m attnlab train --context-parallel C``: one sequence split over C processes (x D replicas).

The per-step losses (and gradient norms, which Adam's scale invariance would otherwise hide) must be the
single-process run's on the same data; the run's other duties (evaluation, checkpoints, resume, the
summary) keep working; and a --context-parallel the run cannot honour is refused before any work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from attnlab.cli import main
from attnlab.lab import DataConfig, ModelConfig, TrainConfig, train
from attnlab.lab.parallel import ProcessLayout, check_context_parallel
from attnlab.runtime import UsageError

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# copy-len 5: T = 10 tokens, which does not split into 2C = 4 whole chunks, so the padding path runs too;
# 4 steps stay inside the warm-up, where the rate does not depend on --steps (the resume test relies on it)
FLAGS = [
    "--data.copy-len",
    "5",
    "--data.batch-size",
    "8",
    "--model.embed-dim",
    "32",
    "--eval-every",
    "2",
    "--ckpt-every",
    "0",
    "--no-progress",
    "--device",
    "cpu",
]
LOSS_RTOL = 1e-5  # fp32: the shards sum the same token losses in another order
NORM_RTOL = 1e-4  # the gradient norm: partial gradients summed across ranks before the norm


def _single(run: Path, steps: int, monkeypatch: pytest.MonkeyPatch, *extra: str) -> list[dict[str, Any]]:
    """The reference: one process, no --context-parallel, in this process."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", *FLAGS, *extra, "--steps", str(steps), "--out-dir", str(run)]) == 0
    return _metrics(run)


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += ["-m", "attnlab", "train", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _assert_same_run(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Every step's loss, gradient norm and accuracy, and every evaluation, as the single process's."""
    assert [r["step"] for r in got] == [r["step"] for r in want]  # one writer: no duplicated lines
    for g, w in zip(got[1:], want[1:], strict=True):
        assert _rel(g["loss"], w["loss"]) <= LOSS_RTOL, (g["step"], g["loss"], w["loss"])
        assert _rel(g["grad_norm"], w["grad_norm"]) <= NORM_RTOL, (g["step"], g["grad_norm"], w["grad_norm"])
        assert g["acc"] == pytest.approx(w["acc"], abs=1e-9)  # same argmax at every scored position
        assert ("eval_loss" in g) == ("eval_loss" in w)
        if "eval_loss" in w:
            assert _rel(g["eval_loss"], w["eval_loss"]) <= LOSS_RTOL


def _assert_summary(run: Path, world: int, context: int) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == world and summary["context_parallel"] == context
    layout = summary["process_layout"]
    assert layout["data_parallel"] == world // context
    assert layout["context_parallel_groups"] == ProcessLayout(world, 0, context).context_groups()
    assert summary["ranks_identical"] and len(summary["rank_param_sha256"]) == world


def test_two_processes_split_one_sequence_and_match_one_process(tmp_path, monkeypatch):
    want = _single(tmp_path / "one", 4, monkeypatch, "--no-log-head-scores")
    run = tmp_path / "cp2"
    done = _torchrun(
        2, *FLAGS, "--no-log-head-scores", "--steps", "4", "--context-parallel", "2", "--out-dir", str(run)
    )
    assert done.stdout.count("done: 4 steps") == 1  # rank 0 alone reports
    _assert_same_run(_metrics(run), want)
    _assert_summary(run, world=2, context=2)
    assert json.loads((run / "config.json").read_text())["context_parallel"] == 2  # a resume reloads it


@pytest.mark.slow
def test_two_by_two_layout_matches_one_process(tmp_path, monkeypatch):
    """C = 2 ranks per sequence x D = 2 replicas, with head scores and a checkpoint mid-run."""
    want = _single(tmp_path / "one", 4, monkeypatch)
    run = tmp_path / "cp2x2"
    _torchrun(4, *FLAGS, "--steps", "4", "--ckpt-every", "2", "--context-parallel", "2", "--out-dir", str(run))
    got = _metrics(run)
    _assert_same_run(got, want)
    scores, ref = got[2]["head_scores"], want[2]["head_scores"]
    assert scores.keys() == ref.keys()
    for name in ref:  # (layers, heads) scores, rounded to 4 places when logged
        assert torch.tensor(scores[name]) == pytest.approx(torch.tensor(ref[name]), abs=2e-4), name
    _assert_summary(run, world=4, context=2)


@pytest.mark.slow
def test_resume_on_another_layout_continues_the_same_run(tmp_path, monkeypatch):
    """2 steps on C=2 x D=1, then resumed on C=2 x D=2 to step 4: still the single-process run."""
    want = _single(tmp_path / "one", 4, monkeypatch, "--no-log-head-scores")
    run = tmp_path / "cp"
    _torchrun(2, *FLAGS, "--no-log-head-scores", "--steps", "2", "--context-parallel", "2", "--out-dir", str(run))
    done = _torchrun(4, "--out-dir", str(run), "--resume", "--steps", "4")  # config.json brings the rest back
    assert "resumed" in done.stdout
    _assert_same_run(_metrics(run), want)
    _assert_summary(run, world=4, context=2)


# -- the layout ---------------------------------------------------------------------------------


def test_layout_puts_every_rank_in_one_group_of_each_kind():
    layout = ProcessLayout(world=8, rank=5, context=4)
    assert layout.data == 2 and layout.replica == 1
    assert layout.context_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for cp in layout.context_groups():
        for dp in layout.data_groups():
            assert len(set(cp) & set(dp)) == 1  # a grid: each replica holds each shard once


# -- refusals, before any process group exists ---------------------------------------------------


def _cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(steps=2, progress=False, device="cpu", out_dir=tmp_path / "run", context_parallel=2)
    return TrainConfig(**{**base, **kw})


def _refused(cfg: TrainConfig, monkeypatch: pytest.MonkeyPatch, world: int, *needles: str) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError) as err:
        train(cfg, quiet=True)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert not dist.is_initialized()  # refused before joining (or waiting for) a process group
    assert not cfg.out_dir.exists()  # nothing written


def test_context_parallel_without_torchrun_is_refused(tmp_path, monkeypatch):
    _refused(_cfg(tmp_path), monkeypatch, 1, "--context-parallel 2", "WORLD_SIZE 1", "torchrun --nproc-per-node 2")


def test_context_parallel_not_dividing_the_world_is_refused(tmp_path, monkeypatch):
    _refused(_cfg(tmp_path), monkeypatch, 3, "--context-parallel 2 must divide the 3 processes", "[1, 3]")


def test_minimal_model_is_refused(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, model=ModelConfig(kind="minimal"))
    _refused(cfg, monkeypatch, 2, "--model.kind gpt, got --model.kind minimal", "--context-parallel 1")


def test_dropout_is_refused(tmp_path, monkeypatch):
    _refused(_cfg(tmp_path, model=ModelConfig(dropout=0.1)), monkeypatch, 2, "--model.dropout 0, got 0.1")


def test_batch_not_splitting_over_the_replicas_is_refused(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, data=DataConfig(batch_size=3))
    _refused(cfg, monkeypatch, 4, "--data.batch-size 3", "2 data-parallel replicas", "--data.batch-size 2")


def test_context_parallel_below_one_is_refused(tmp_path, monkeypatch):
    _refused(_cfg(tmp_path, context_parallel=0), monkeypatch, 1, "--context-parallel")


def test_device_other_than_cpu_or_cuda_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--device mps with --context-parallel 2.*pass --device cpu"):
        check_context_parallel(_cfg(tmp_path), 2, torch.device("mps"))


def test_command_line_shows_the_flag_and_prints_the_refusal(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--context-parallel" in capsys.readouterr().out
    code = main(["train", "--context-parallel", "2", "--device", "cpu", "--out-dir", str(tmp_path / "run")])
    assert code == 2
    assert "attnlab: error: --context-parallel 2 splits each sequence" in capsys.readouterr().err
