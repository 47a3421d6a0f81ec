"""The lab's data sources: seed 002's shift, the scored positions, determinism in (seed, step, rank)."""

from __future__ import annotations

import pytest
import torch

from attnlab.lab.config import DataConfig
from attnlab.lab.data import IGNORE, CharDataset, CopyTask, RandomTask, RecallTask, TextCharDataset, build_task


def test_char_dataset_is_the_seeds_shift():
    ds = CharDataset(seq_len=32, num_samples=10, vocab_size=16, seed=3)
    x, y = ds[4]
    assert len(ds) == 10 and x.shape == y.shape == (32,)
    assert torch.equal(x[1:], y[:-1])  # x = seq[:-1], y = seq[1:]
    assert torch.equal(torch.cat([x, y[-1:]]), ds.data[4])
    assert int(ds.data.max()) < 16 and int(ds.data.min()) >= 0
    assert torch.equal(CharDataset(32, 10, 16, seed=3).data, ds.data)


def test_recall_scores_exactly_the_value_after_each_query_key():
    task = RecallTask(DataConfig(task="recall", n_pairs=5, batch_size=8))
    x, y = task.batch(0)
    n = 5
    assert x.shape == y.shape == (8, 4 * n)
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        pairs = dict(zip(row_x[0 : 2 * n : 2], row_x[1 : 2 * n : 2], strict=True))
        assert len(pairs) == n  # distinct keys
        assert row_x[2 * n] == task.vocab_size - 1  # the separator
        scored = [t for t, v in enumerate(row_y) if v != IGNORE]
        assert scored == list(range(2 * n + 1, 4 * n, 2))  # positions holding a query key
        for t in scored:
            assert row_y[t] == pairs[row_x[t]]  # the value paired with that key earlier
        assert set(row_x[2 * n + 1 :: 2]) <= set(pairs)  # queries ask for keys of this sequence


def test_copy_scores_the_second_half():
    task = CopyTask(DataConfig(task="copy", copy_len=6, batch_size=4))
    x, y = task.batch(2)
    assert x.shape == (4, 12)
    assert (y[:, :6] == IGNORE).all()
    assert torch.equal(y[:, 6:], x[:, :6])  # after "|", position t predicts symbol t - 6
    assert (x[:, 6] == task.vocab_size - 1).all()


@pytest.mark.parametrize("task", ["recall", "copy", "random"])
def test_batches_are_pure_functions_of_seed_step_rank(task):
    cfg = DataConfig(task=task, batch_size=8, num_samples=50)
    a, b = build_task(cfg), build_task(cfg)
    assert all(torch.equal(u, v) for u, v in zip(a.batch(7), b.batch(7), strict=True))
    assert not torch.equal(a.batch(7)[0], a.batch(8)[0])
    assert not torch.equal(a.batch(7)[0], a.batch(7, split="eval")[0])  # held-out: another stream
    full_x, _ = a.batch(5)
    shards = [a.batch(5, rank=r, world=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(shards), full_x)  # ranks split the global batch, no overlap
    other = build_task(DataConfig(task=task, batch_size=8, num_samples=50, seed=1))
    assert not torch.equal(other.batch(7)[0], a.batch(7)[0])  # another seed, another stream


def test_random_task_walks_epochs_of_its_pool():
    task = RandomTask(DataConfig(task="random", batch_size=4, num_samples=8, vocab_size=5))
    rows = torch.cat([task.batch(s)[0] for s in range(2)])  # one epoch: 8 samples
    pool = task.train_pool.data[:, :-1]
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, pool.tolist()))
    assert task.tokenizer.vocab_size == 5


def test_text_dataset_reads_a_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld, attention is all you need. " * 20, encoding="utf-8")
    task = TextCharDataset(DataConfig(task="text", text_path=path, seq_len=16, batch_size=4))
    x, y = task.batch(0)
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert "ö" in task.tokenizer.chars
    assert task.tokenizer.decode(x[0].tolist()) in path.read_text()


def test_bad_data_arguments_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--data.text-path"):
        build_task(DataConfig(task="text"))
    with pytest.raises(ValueError, match="n_pairs"):
        build_task(DataConfig(task="recall", n_pairs=30))
    with pytest.raises(ValueError, match="divisible by world"):
        build_task(DataConfig(task="copy", batch_size=5)).batch(0, rank=0, world=2)
