"""The training loop learns: loss falls, accuracy beats chance, random data stops at ln(vocab)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from attnlab import load_checkpoint
from attnlab.lab import DataConfig, ModelConfig, OptimConfig, TrainConfig, demo_config, train
from attnlab.lab.train import lr_at

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(steps=60, eval_every=20, ckpt_every=0, progress=False, out_dir=tmp_path / "run")
    return TrainConfig(**{**base, **kw})


def test_default_task_learns_on_a_small_budget(tmp_path):
    result = train(_cfg(tmp_path, steps=80), quiet=True)
    evals = [r for r in result.history if "eval_acc" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 80
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 1.0  # ln(27) = 3.3 at init
    assert result.final["eval_acc"] > 5 * result.final["chance_acc"]


def test_run_directory_has_every_artifact(tmp_path):
    result = train(_cfg(tmp_path, steps=20, eval_every=10), quiet=True)
    run = result.run_dir
    for name in ("config.json", "metrics.jsonl", "checkpoint.safetensors", "curve.png", "summary.json"):
        assert (run / name).is_file(), name
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(21))
    assert {"loss", "acc", "lr", "tokens_per_s"} <= lines[5].keys() and "eval_acc" in lines[10]
    assert (run / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, tok = load_checkpoint(run / "model")  # the TinyGPT export that `attnlab generate` reads
    assert tok.decode(tok.encode("abc|")) == "abc|"
    for k, v in model.state_dict().items():
        assert torch.equal(v, result.model.state_dict()[k])


def test_minimal_former_learns_recall_above_chance(tmp_path):
    cfg = _cfg(
        tmp_path,
        steps=150,
        data=DataConfig(task="recall", n_pairs=4),
        model=ModelConfig(kind="minimal", num_layers=2, num_heads=4, embed_dim=64),
    )
    result = train(cfg, write=False, quiet=True)
    assert result.run_dir is None and not (tmp_path / "run").exists()
    assert result.final["eval_acc"] > 2 * result.final["chance_acc"]  # 1 / n_values = 0.1


def test_seed_random_data_loss_goes_to_ln_vocab(tmp_path):
    """Seed 002's setting (minimal block, AdamW 5e-4, dropout 0.1, random ids): nothing to learn."""
    cfg = _cfg(
        tmp_path,
        steps=100,
        data=DataConfig(task="random", vocab_size=8, seq_len=32, num_samples=20000),
        model=ModelConfig(kind="minimal", num_layers=1, num_heads=4, embed_dim=64, dropout=0.1),
        optim=OptimConfig(lr=5e-4, schedule="constant", warmup_steps=1),
    )
    result = train(cfg, write=False, quiet=True)
    floor = math.log(8)
    assert result.final["loss_floor"] == pytest.approx(floor)
    assert abs(result.final["eval_loss"] - floor) < 0.05
    assert result.final["eval_acc"] < 0.2  # chance is 1/8


def test_stop_at_acc_and_demo_config(tmp_path):
    cfg = demo_config(tmp_path / "demo")
    assert cfg.stop_at_acc == 0.95 and cfg.data.task == "copy"
    result = train(_cfg(tmp_path, steps=200, eval_every=10, stop_at_acc=0.5), quiet=True)
    assert result.final["eval_acc"] >= 0.5 and result.final["steps"] < 200
    assert result.final["seconds_to_target"] is not None


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(steps=100, optim=OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1))
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:])) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_heldout_samples_are_completed_with_the_kv_cache(tmp_path):
    from attnlab.lab.samples import heldout_samples

    result = train(_cfg(tmp_path, steps=100, stop_at_acc=0.99, eval_every=10), write=False, quiet=True)
    samples = heldout_samples(result, n=3)
    assert len(samples) == 3
    for s in samples:
        assert s.prompt.endswith("|") and len(s.prompt) == 13 and s.expected == s.prompt[:12]
    assert sum(s.correct for s in samples) >= 2
