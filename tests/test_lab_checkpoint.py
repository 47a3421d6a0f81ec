"""Training checkpoints: resume after SIGKILL gives the uninterrupted weights; writes are atomic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.lab import TrainConfig, train, train_state
from attnlab.lab.train_state import CKPT_NAME, load_train_state, save_train_state

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


ROOT = Path(__file__).resolve().parents[1]
# dropout 0.1 so that the torch RNG state matters; 150 steps leave time to kill after the first checkpoint
ARGS = [
    "--steps",
    "150",
    "--ckpt-every",
    "20",
    "--eval-every",
    "50",
    "--model.dropout",
    "0.1",
    "--model.embed-dim",
    "32",
    "--no-progress",
]


def _attnlab(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "attnlab", "train", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(run / CKPT_NAME)).items() if k.startswith("model.")}


@pytest.mark.slow
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    p_full = _attnlab(*ARGS, "--out-dir", str(full))
    p_kill = _attnlab(*ARGS, "--out-dir", str(killed))
    deadline = time.monotonic() + 120
    while not (killed / CKPT_NAME).exists():
        assert p_kill.poll() is None and time.monotonic() < deadline, p_kill.communicate()[0]
        time.sleep(0.01)
    p_kill.send_signal(signal.SIGKILL)
    p_kill.wait()
    assert not (killed / "summary.json").exists()  # it really died mid-run
    step_at_kill = int(train_state.read_meta(killed / CKPT_NAME)["step"])
    assert 20 <= step_at_kill < 150
    out = _attnlab("--out-dir", str(killed), "--resume")  # no other flags: the run's config.json is reloaded
    log = out.communicate(timeout=120)[0]
    assert out.returncode == 0, log
    assert f"resumed {killed / CKPT_NAME} at step {step_at_kill}" in log
    assert p_full.wait(timeout=120) == 0
    a, b = _weights(full), _weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [
        int(ln.split('"step": ')[1].split(",")[0].rstrip("}"))
        for ln in (killed / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(151))  # the lines after the checkpoint were rewritten once, not duplicated


def _tiny(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(steps=10, eval_every=5, ckpt_every=5, progress=False, out_dir=tmp_path / "run"), **kw})


def test_checkpoint_round_trip_restores_model_optimizer_rng(tmp_path):
    result = train(_tiny(tmp_path), quiet=True)
    model = result.model
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    rng = torch.get_rng_state()
    path = save_train_state(tmp_path / "c.safetensors", model, opt, 7, {"any": "json"})
    torch.rand(3)
    expected = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    assert load_train_state(path, model, opt) == 7
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(opt.state_dict()["state"][0][k], v) for k, v in expected.items())


def test_a_killed_writer_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    result = train(_tiny(tmp_path), quiet=True)
    path = result.run_dir / CKPT_NAME
    before = path.read_bytes()

    def dies_halfway(fd):
        os.ftruncate(fd, 11)  # half a file in the temp file, then a signal before it is renamed
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", dies_halfway)
    opt = torch.optim.AdamW(result.model.parameters())
    with pytest.raises(KeyboardInterrupt):
        save_train_state(path, result.model, opt, 99, {})
    assert path.read_bytes() == before
    assert not list(path.parent.glob(".*.tmp"))


def test_resume_ignores_a_stray_temp_file_and_refuses_a_torn_checkpoint(tmp_path):
    cfg = _tiny(tmp_path)
    train(cfg, quiet=True)
    run = cfg.out_dir
    (run / f".{CKPT_NAME}.12345.tmp").write_bytes(b"\x00" * 100)  # what a SIGKILL mid-write leaves
    resumed = train(TrainConfig(**{**cfg.__dict__, "steps": 12, "resume": True}), quiet=True)
    assert resumed.final["steps"] == 12
    (run / CKPT_NAME).write_bytes((run / CKPT_NAME).read_bytes()[:200])  # torn: what a non-atomic writer could leave
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        train(TrainConfig(**{**cfg.__dict__, "steps": 14, "resume": True}), quiet=True)


def test_resume_refuses_a_different_run(tmp_path):
    cfg = _tiny(tmp_path)
    train(cfg, quiet=True)
    other = TrainConfig(**{**cfg.__dict__, "seed": 1, "resume": True})
    with pytest.raises(ValueError, match="--resume: seed differs"):
        train(other, quiet=True)


def test_resume_survives_a_metrics_line_torn_by_the_kill(tmp_path):
    cfg = _tiny(tmp_path, ckpt_every=5, steps=10)
    train(cfg, quiet=True)
    metrics = cfg.out_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 11, "lo')  # a kill mid-write
    resumed = train(TrainConfig(**{**cfg.__dict__, "steps": 12, "resume": True}), quiet=True)
    steps = [r["step"] for r in resumed.history]
    assert steps == list(range(13))
