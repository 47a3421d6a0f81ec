"""``--log-head-scores``: every evaluation record carries each head's scores, and they are the model's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnlab import load_checkpoint
from attnlab.lab import DataConfig, ModelConfig, TrainConfig, train
from attnlab.lab.data import RecallTask, build_task
from attnlab.lab.head_scores import HeadScorer, _lookup_weight, max_score
from attnlab.lab.train import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

PROBE_NAMES = {"prev_token", "induction", "duplicate"}


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(
        steps=20,
        eval_every=10,
        ckpt_every=0,
        progress=False,
        out_dir=tmp_path / "run",
        model=ModelConfig(num_layers=2, num_heads=2, embed_dim=16),
    )
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("task", ["copy", "recall"])
def test_every_evaluation_record_has_a_layer_by_head_grid_of_each_score(tmp_path, task):
    data = DataConfig(task=task, n_pairs=3, copy_len=5)
    result = train(_cfg(tmp_path, data=data), write=False, quiet=True)
    evals = [r for r in result.history if "eval_acc" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert all("head_scores" not in r for r in result.history if "eval_acc" not in r)
    names = PROBE_NAMES | ({"recall_value", "recall_prev"} if task == "recall" else set())
    for rec in evals:
        scores = rec["head_scores"]
        assert set(scores) == names
        for grid in scores.values():
            assert len(grid) == 2 and all(len(row) == 2 for row in grid)  # (L, H)
            assert all(0.0 <= v <= 1.0 for row in grid for v in row)


def test_logged_scores_are_those_of_the_saved_model(tmp_path):
    """A short copy run: its last record's scores equal a fresh computation on the model it wrote."""
    cfg = _cfg(tmp_path, steps=40, eval_every=20, data=DataConfig(copy_len=6))
    result = train(cfg, quiet=True)
    records = read_metrics(cfg.out_dir / "metrics.jsonl")
    logged = records[-1]["head_scores"]
    model, _ = load_checkpoint(cfg.out_dir / "model")
    fresh = HeadScorer(build_task(cfg.data), torch.device("cpu"))(model)
    assert fresh.keys() == logged.keys()
    for name in logged:
        assert torch.allclose(torch.tensor(fresh[name]), torch.tensor(logged[name]), atol=1e-4), name
    # the weights moved the scores: the record at init is another model's
    first = torch.tensor(records[0]["head_scores"]["prev_token"])
    assert not torch.allclose(first, torch.tensor(logged["prev_token"]), atol=1e-3)
    assert result.history[-1]["head_scores"] == logged


def test_recall_value_is_the_weight_on_the_value_after_the_queried_key():
    """A hand-made attention pattern that reads exactly the right value scores 1; one position off scores 0."""
    task = RecallTask(DataConfig(task="recall", n_pairs=3, batch_size=4))
    x, _ = task.batch(0, split="eval")  # (4, 12)
    queries, values = task.answer_sources(x)
    keys_at = x[torch.arange(4)[:, None], values - 1]  # (B, n): the token before each source
    assert torch.equal(keys_at, x[:, queries])  # the source follows the very key that is queried
    right = torch.zeros(4, 1, 12, 12)
    right[torch.arange(4)[:, None], 0, queries, values] = 1.0
    wrong = torch.zeros(4, 1, 12, 12)
    wrong[torch.arange(4)[:, None], 0, queries, values - 1] = 1.0
    assert _lookup_weight(right, queries, values).tolist() == [1.0]
    assert _lookup_weight(wrong, queries, values).tolist() == [0.0]


def test_flag_off_writes_no_scores_and_curve_still_drawn(tmp_path):
    cfg = _cfg(tmp_path, log_head_scores=False)
    train(cfg, quiet=True)
    records = read_metrics(cfg.out_dir / "metrics.jsonl")
    assert records and all("head_scores" not in r for r in records)
    assert json.loads((cfg.out_dir / "config.json").read_text())["log_head_scores"] is False
    assert (cfg.out_dir / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resumed_run_logs_the_scores_of_an_uninterrupted_one(tmp_path):
    # all 20 steps are warm-up (50), so the rate of a step does not depend on --steps 10 vs 20
    full = train(_cfg(tmp_path, out_dir=tmp_path / "full"), quiet=True)
    half = _cfg(tmp_path, steps=10, out_dir=tmp_path / "cut")
    train(half, quiet=True)
    train(dataclasses.replace(half, steps=20, resume=True), quiet=True)
    resumed = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    want = [r["head_scores"] for r in full.history if "head_scores" in r]
    assert [r["head_scores"] for r in resumed if "head_scores" in r] == want


def test_max_score_reads_any_layer_and_none_without_scores():
    rec = {"head_scores": {"induction": [[0.1, 0.7], [0.3, 0.2]]}}
    assert max_score(rec, "induction") == 0.7
    assert max_score(rec, "prev_token") is None and max_score({"step": 3}, "induction") is None
