"""Flags checked together before any work (issue 39): the sequence length each part of a run needs (the
head-score probe, the ``--context-parallel`` shards), options of the other ``--model.kind``, named by flag;
and a run that fails before its first step leaves nothing that blocks running it again.
"""

from __future__ import annotations

import re
import shlex
import sys

import pytest

from attnlab.cli import main
from attnlab.lab.validation import idle_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TINY = [
    "--data.batch-size",
    "8",
    "--model.num-layers",
    "1",
    "--model.embed-dim",
    "16",
    "--steps",
    "2",
    "--eval-every",
    "2",
    "--ckpt-every",
    "0",
    "--no-progress",
]
PROBE = "the head scores logged at each evaluation (--log-head-scores, on by default) need at least 3 (a probe of 2 random tokens, repeated)"

REFUSED = [
    (
        ["--data.copy-len", "1"],
        f"--data.copy-len 1 makes sequences of 2 tokens, but {PROBE}; pass --data.copy-len 2 or more, or "
        f"--no-log-head-scores.",
    ),
    (
        ["--data.task", "random", "--data.seq-len", "1"],
        f"--data.seq-len 1 makes sequences of 1 token, but {PROBE}; pass --data.seq-len 3 or more, or "
        f"--no-log-head-scores.",
    ),
    (
        ["--data.task", "random", "--data.seq-len", "2"],
        f"--data.seq-len 2 makes sequences of 2 tokens, but {PROBE}; pass --data.seq-len 3 or more, or "
        f"--no-log-head-scores.",
    ),
    (
        ["--data.copy-len", "1", "--no-log-head-scores", "--context-parallel", "4"],
        "--context-parallel 4 splits each sequence of 2 tokens (--data.copy-len 1) into 8 chunks of 1, so ranks 2-3 "
        "would hold padding only and compute nothing; pass --context-parallel 2 or less, or --data.copy-len 2 or more.",
    ),
    (
        ["--data.copy-len", "2", "--context-parallel", "8"],
        "--context-parallel 8 splits each sequence of 4 tokens (--data.copy-len 2) into 16 chunks of 1, so ranks 4-7 "
        "would hold padding only and compute nothing; pass --context-parallel 4 or less, or --data.copy-len 4 or more.",
    ),
    (
        ["--model.kind", "minimal", "--model.position", "rotary"],
        "--model.position rotary applies to --model.kind gpt only, and this run's is --model.kind minimal (seed 002's "
        "block has learned positions only); leave --model.position out, or pass --model.kind gpt.",
    ),
    (
        ["--model.no-causal"],
        "--model.no-causal applies to --model.kind minimal only, and this run's is --model.kind gpt (TinyGPT is "
        "always causal); leave --model.causal out, or pass --model.kind minimal.",
    ),
    (
        ["--model.ff-mult", "4"],
        "--model.ff-mult 4 applies to --model.kind minimal only, and this run's is --model.kind gpt (TinyGPT's MLP "
        "is always 4 x --model.embed-dim wide); leave --model.ff-mult out, or pass --model.kind minimal.",
    ),
]


@pytest.mark.parametrize("flags, message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_flags_that_do_not_fit_together_are_refused_by_name_before_any_work(flags, message, tmp_path, capsys):
    capsys.readouterr()
    code = main(["train", *TINY, *flags, "--out-dir", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", f"attnlab: error: {message}\n")
    assert not (tmp_path / "run").exists()  # nothing written, not even the directory


def test_each_suggested_length_runs(tmp_path, capsys):
    """--data.copy-len 1 was a crash in the probe ("idx has T=4 tokens but block_size=3"); both fixes run."""
    assert main(["train", *TINY, "--data.copy-len", "2", "--out-dir", str(tmp_path / "a")]) == 0
    assert main(["train", *TINY, "--data.copy-len", "1", "--no-log-head-scores", "--out-dir", str(tmp_path / "b")]) == 0
    assert main(["train", *TINY, "--data.task", "random", "--data.seq-len", "3", "--out-dir", str(tmp_path / "c")]) == 0


def test_ablate_heads_names_its_own_flags(tmp_path, capsys):
    capsys.readouterr()
    flags = ["--train.data.task", "copy", "--train.data.copy-len", "1", "--out-dir", str(tmp_path / "s")]
    assert main(["ablate-heads", *flags]) == 2
    assert capsys.readouterr().err == (
        "attnlab: error: --train.data.copy-len 1 makes sequences of 2 tokens, but the head scores logged at each "
        "evaluation (--train.log-head-scores, on by default) need at least 3 (a probe of 2 random tokens, repeated); "
        "pass --train.data.copy-len 2 or more, or --train.no-log-head-scores.\n"
    )


def test_idle_ranks_follow_the_zigzag_layout():
    """Rank r holds chunks r and 2C-1-r of ceil(T / 2C) positions: it holds a real one iff r * chunk < T."""
    assert idle_ranks(10, 2) == [] and idle_ranks(2, 2) == [] and idle_ranks(2, 4) == [2, 3]
    assert idle_ranks(3, 4) == [3] and idle_ranks(8, 4) == [] and idle_ranks(1, 2) == [1]


def test_a_run_failing_before_its_first_step_can_run_again_as_it_was(tmp_path, capsys, monkeypatch):
    """The failure comes after config.json and metrics.jsonl were written (the step-0 evaluation): what the run
    wrote goes, the folders it made too, and the same command then runs."""
    run = tmp_path / "new" / "run"
    argv = ["train", *TINY, "--data.copy-len", "4", "--out-dir", str(run)]
    train_module = sys.modules["attnlab.lab.train"]  # attnlab.lab.train is also the function
    real = train_module.evaluate

    def fails(*args, **kwargs):
        assert (run / "config.json").exists() or (tmp_path / "mine" / "config.json").exists()  # what blocked reruns
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(train_module, "evaluate", fails)
    capsys.readouterr()
    assert main(argv) == 3  # a crash of ours: one line saying so (cli.py), not a traceback
    assert capsys.readouterr().err.startswith("attnlab: internal error: RuntimeError: out of memory (simulated)")
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"  # a folder the user made: it stays, empty
    mine.mkdir()
    assert main([*argv[:-1], str(mine)]) == 3
    assert list(mine.iterdir()) == []
    monkeypatch.setattr(train_module, "evaluate", real)
    assert main(argv) == 0
    assert main([*argv[:-1], str(mine)]) == 0


def test_a_run_without_a_checkpoint_is_not_offered_a_resume(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data.copy-len", "4", "--out-dir", str(run)]) == 0
    for name in ("checkpoint.safetensors", "summary.json", "curve.png"):
        (run / name).unlink()
    capsys.readouterr()
    assert main(["train", *TINY, "--data.copy-len", "4", "--out-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"attnlab: error: --out-dir '{run}' already holds a run that stopped before its first checkpoint "
        f"(config.json, metrics.jsonl, model/), and attnlab never replaces a run; start a new run with "
        f"`attnlab train {_flags()} --out-dir {run}-2`, or delete those files to run in this folder again.\n"
    )
    (suggested,) = re.findall(r"`([^`]*)`", err)
    assert main(shlex.split(suggested)[1:]) == 0


def _flags() -> str:
    """TINY with --data.copy-len 4, in command_flags' (the dataclasses') order."""
    return "--data.batch-size 8 --data.copy-len 4 " + " ".join(TINY[2:])
