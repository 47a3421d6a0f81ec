"""Nothing lost, nothing raw: ``attnlab train`` / ``ablate-heads`` under mistakes (in-process, through
``attnlab.cli.main``). Signals sent to real processes are in ``test_lab_interrupt.py``.

Every refusal is checked word for word, and every command it suggests is run as printed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import sys
from dataclasses import fields, is_dataclass

import pytest
import torch
import tyro
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.lab import train_state
from attnlab.lab.config import (
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    command_flags,
    config_to_dict,
    load_config,
)
from attnlab.lab.train_state import CKPT_NAME

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# a run of ~0.3 s: 4 steps of a 1-layer, 16-wide TinyGPT on 4-symbol copies
TINY = [
    "--data.batch-size",
    "8",
    "--data.copy-len",
    "4",
    "--model.num-layers",
    "1",
    "--model.embed-dim",
    "16",
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--ckpt-every",
    "0",
    "--no-progress",
]
TINY_FLAGS = " ".join(TINY)  # command_flags prints them in this (the dataclasses') order


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _suggested(err: str) -> list[list[str]]:
    """The commands an error suggests (between backticks), as argv for ``main``, ``attnlab`` removed."""
    commands = [shlex.split(c) for c in re.findall(r"`([^`]*)`", err)]
    assert commands and all(c[0] == "attnlab" for c in commands), err
    return [c[1:] for c in commands]


# --- a run is never replaced; --resume needs something to resume -----------------------------------------


def test_a_second_train_into_a_run_refuses_and_both_suggestions_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert _run(capsys, "train", *TINY, "--out-dir", str(run))[0] == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, out, err = _run(capsys, "train", *TINY, "--out-dir", str(run))
    assert code == 2 and out == ""
    assert err == (
        f"attnlab: error: --out-dir '{run}' already holds a run (config.json, metrics.jsonl, checkpoint.safetensors "
        f"at step 4 of 4, summary.json, curve.png, model/), and attnlab never replaces a run; continue it with "
        f"`attnlab train --out-dir {run} --resume`, or start a new run with "
        f"`attnlab train {TINY_FLAGS} --out-dir {run}-2`.\n"
    )
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # untouched
    resume, elsewhere = _suggested(err)
    assert _run(capsys, *resume)[0] == 0
    assert _run(capsys, *elsewhere)[0] == 0
    again = load_config(tmp_path / "run-2" / "config.json")
    assert again == TrainConfig(**{**load_config(run / "config.json").__dict__, "out_dir": tmp_path / "run-2"})


def test_the_default_out_dir_is_protected_too(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run(capsys, "train", *TINY)[0] == 0
    code, _, err = _run(capsys, "train", *TINY)
    assert code == 2 and "--out-dir 'runs/train' already holds a run" in err
    assert f"`attnlab train {TINY_FLAGS} --out-dir runs/train-2`" in err


def test_resume_of_a_misspelled_directory_refuses_and_names_the_real_one(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert _run(capsys, "train", *TINY, "--out-dir", str(runs / "train"))[0] == 0
    code, _, err = _run(capsys, "train", "--out-dir", str(runs / "trian"), "--resume")
    assert code == 2
    assert err == (
        f"attnlab: error: --resume: --out-dir '{runs / 'trian'}' does not exist, so there is no run to resume (runs "
        f"that can be resumed next to it: {runs / 'train'}); check the name, or start a new run there with "
        f"`attnlab train --out-dir {runs / 'trian'}`.\n"
    )
    assert not (runs / "trian").exists()


def test_resume_without_a_checkpoint_lists_what_is_there_and_the_fresh_start_runs(tmp_path, capsys):
    run = tmp_path / "run"
    # what a run killed before its first checkpoint leaves
    assert _run(capsys, "train", *TINY, "--out-dir", str(run))[0] == 0
    for name in ("checkpoint.safetensors", "summary.json", "curve.png"):
        (run / name).unlink()
    code, _, err = _run(capsys, "train", "--out-dir", str(run), "--resume")
    assert code == 2
    assert err == (
        f"attnlab: error: --resume: --out-dir '{run}' has no checkpoint.safetensors to resume from (it holds "
        f"config.json, metrics.jsonl, model/: the run stopped before its first checkpoint); start the run afresh "
        f"with `attnlab train {TINY_FLAGS} --out-dir {run}-2`.\n"
    )
    (fresh,) = _suggested(err)
    assert _run(capsys, *fresh)[0] == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(capsys, "train", *TINY, "--out-dir", str(empty), "--resume")
    assert (
        code == 2
        and f"(it holds nothing); start the run afresh with `attnlab train {TINY_FLAGS} --out-dir {empty}`" in err
    )


def test_resume_refuses_other_settings_and_fewer_steps_and_reads_the_checkpoints_config(tmp_path, capsys):
    run = tmp_path / "run"
    assert _run(capsys, "train", *TINY, "--out-dir", str(run))[0] == 0
    code, _, err = _run(capsys, "train", "--out-dir", str(run), "--resume", "--seed", "1")
    assert code == 2 and err.startswith(
        f"attnlab: error: --resume: seed differs from the checkpoint's in '{run / CKPT_NAME}'"
    )
    as_it_was, elsewhere = _suggested(err)
    assert as_it_was == ["train", "--out-dir", str(run), "--resume"]
    assert elsewhere == [
        "train",
        *shlex.split(TINY_FLAGS.replace("--steps 4", "--steps 4 --seed 1")),
        "--out-dir",
        f"{run}-2",
    ]
    code, _, err = _run(capsys, "train", "--out-dir", str(run), "--resume", "--steps", "2")
    assert (code, err) == (
        2,
        f"attnlab: error: --steps 2 is below the step of the checkpoint to resume (4 in '{run / CKPT_NAME}'); "
        f"pass --steps 4 or more.\n",
    )
    (run / "config.json").unlink()  # the checkpoint carries the config too
    code, out, _ = _run(capsys, *as_it_was, "--steps", "6")
    assert code == 0 and f"resumed {run / CKPT_NAME} at step 4" in out and "done: 6 steps" in out


def test_overwrite_is_for_callers_that_own_the_directory(tmp_path):
    from attnlab.lab import train

    cfg = TrainConfig(
        data=DataConfig(batch_size=8, copy_len=4),
        model=ModelConfig(num_layers=1, embed_dim=16),
        steps=2,
        eval_every=2,
        progress=False,
        out_dir=tmp_path / "demo",
    )
    train(cfg, quiet=True)
    (tmp_path / "demo" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds a run"):
        train(cfg, quiet=True)
    result = train(
        TrainConfig(**{**cfg.__dict__, "model": ModelConfig(kind="minimal", embed_dim=16)}), quiet=True, overwrite=True
    )
    assert result.final["steps"] == 2 and not (tmp_path / "demo" / "model").exists()  # the old run's files went
    assert (tmp_path / "demo" / "notes.txt").read_text() == "mine"  # nothing else did


# --- every value checked before any work --------------------------------------------------------------------

BAD_FLAGS = [
    (["--eval-every", "0"], "--eval-every must be an integer >= 1, got 0; pass e.g. --eval-every 25."),
    (["--data.batch-size", "0"], "--data.batch-size must be an integer >= 1, got 0; pass e.g. --data.batch-size 64."),
    (["--steps", "-5"], "--steps must be an integer >= 1, got -5; pass e.g. --steps 400."),
    (["--optim.lr", "0"], "--optim.lr must be a number > 0, got 0.0; pass e.g. --optim.lr 0.003."),
    (["--optim.lr", "inf"], "--optim.lr must be a number > 0, got inf; pass e.g. --optim.lr 0.003."),
    (["--optim.beta2", "1"], "--optim.beta2 must be a number >= 0 and < 1, got 1.0; pass e.g. --optim.beta2 0.99."),
    (
        ["--optim.warmup-steps", "-1"],
        "--optim.warmup-steps must be an integer >= 0, got -1; pass e.g. --optim.warmup-steps 50.",
    ),
    (
        ["--model.dropout", "1"],
        "--model.dropout must be a number >= 0 and < 1, got 1.0; pass e.g. --model.dropout 0.0.",
    ),
    (["--ckpt-every", "-1"], "--ckpt-every must be an integer >= 0, got -1; pass e.g. --ckpt-every 100."),
    (
        ["--stop-at-acc", "0"],
        "--stop-at-acc must be a number > 0 and <= 1, got 0.0; pass e.g. --stop-at-acc 0.95, or leave it out to run every step.",
    ),
    (
        ["--model.num-heads", "3"],
        "--model.num-heads 3 must divide --model.embed-dim 64 (heads split it evenly), expected one of "
        "[1, 2, 4, 8, 16, 32, 64]; pass e.g. --model.num-heads 2.",
    ),
    (
        ["--model.num-kv-heads", "3"],
        "--model.num-kv-heads 3 must divide --model.num-heads 4 (query heads share K/V heads in equal groups); "
        "pass e.g. --model.num-kv-heads 1.",
    ),
    (
        ["--model.position", "rotary", "--model.embed-dim", "12"],
        "--model.position rotary needs an even head dim, got --model.embed-dim 12 / --model.num-heads 4 = 3; "
        "pass e.g. --model.embed-dim 24.",
    ),
    (
        ["--data.task", "recall", "--data.n-pairs", "12", "--data.n-keys", "10"],
        "--data.n-pairs 12 exceeds --data.n-keys 10, but every pair needs its own key; pass --data.n-pairs 10 or fewer.",
    ),
    (
        ["--device", "gpu"],
        "--device 'gpu' is not a device name; use auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.",
    ),
    (
        ["--data.task", "text"],
        "--data.task text needs --data.text-path, got none; pass a UTF-8 text file, e.g. --data.text-path README.md.",
    ),
    (
        ["--data.task", "text", "--data.text-path", "missing.txt"],
        "--data.text-path 'missing.txt' does not exist; pass an existing UTF-8 text file, e.g. --data.text-path README.md.",
    ),
    (
        ["--data.task", "text", "--data.text-path", "."],
        "--data.text-path '.' is not a file; pass a UTF-8 text file, e.g. --data.text-path README.md.",
    ),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_values_are_refused_before_any_work(flags, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(capsys, "train", *flags, "--out-dir", "run")
    assert (code, out, err) == (2, "", f"attnlab: error: {message}\n")
    assert not (tmp_path / "run").exists()  # nothing written, not even the directory


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_cuda_on_a_machine_without_one(capsys):
    code, _, err = _run(capsys, "train", "--device", "cuda")
    assert code == 2 and err.startswith("attnlab: error: --device 'cuda', but this torch (")
    assert "sees no CUDA GPU; use --device cpu (or auto)" in err


def test_a_text_file_too_short_says_which_seq_len_fits(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("x" * 50)
    code, _, err = _run(
        capsys, "train", *TINY, "--data.task", "text", "--data.text-path", str(short), "--out-dir", str(tmp_path / "r")
    )
    assert code == 2
    assert err == (
        f"attnlab: error: --data.text-path '{short}' has 50 characters, too few for --data.seq-len 32 (it needs 340: "
        f"a tenth is held out); pass --data.seq-len 3 or less, or a longer file.\n"
    )


@pytest.mark.filterwarnings("ignore:The field `steps` is annotated")  # tyro's note on the same value
def test_a_config_file_is_checked_like_flags(tmp_path, capsys):
    data = config_to_dict(TrainConfig())
    data["steps"] = "12"  # a string where a number belongs: tyro never saw it
    (tmp_path / "c.json").write_text(json.dumps(data))
    code, _, err = _run(capsys, "train", "--config", str(tmp_path / "c.json"), "--out-dir", str(tmp_path / "r"))
    assert (code, err) == (2, "attnlab: error: --steps must be an integer >= 1, got '12'; pass e.g. --steps 400.\n")


def test_an_unwritable_out_dir_is_found_before_training(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # root can write anywhere, but nobody can make a directory inside a file

    def trained(*args, **kwargs):
        raise AssertionError("training started before the output directory was checked")

    monkeypatch.setattr(sys.modules["attnlab.lab.train"], "build_task", trained)
    monkeypatch.setattr("attnlab.lab.ablate.train", trained)
    code, _, err = _run(capsys, "train", "--out-dir", str(blocker / "run"))
    assert (code, err) == (
        2,
        f"attnlab: error: --out-dir '{blocker / 'run'}' cannot be written (Not a directory); pass a directory you can write to.\n",
    )
    code, _, err = _run(capsys, "ablate-heads", "--out-dir", str(blocker))
    assert (code, err) == (
        2,
        f"attnlab: error: --out-dir '{blocker}' is a file, expected a directory; pass a directory path.\n",
    )


# --- a diverging run stops at once, keeping its last good checkpoint -----------------------------------------


def test_nan_loss_stops_with_the_step_and_the_kept_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    flags = [*TINY, "--steps", "50", "--ckpt-every", "1", "--optim.lr", "1e9", "--optim.warmup-steps", "0"]
    code, _, err = _run(capsys, "train", *flags, "--out-dir", str(run))
    assert code == 1
    kept = f"{TINY_FLAGS.replace('--steps 4', '--steps 50').replace('--ckpt-every 0', '--ckpt-every 1')}"
    assert err == (
        f"attnlab: error: training diverged at step 2 of 50: the loss is nan (learning rate 9.99e+08), so the weights "
        f"were not updated with it and no model was written; the last good checkpoint, {run / CKPT_NAME} (step 1), "
        f"was kept as it was; lower the rate and start a new run with "
        f"`attnlab train {kept.replace('--steps 50', '--optim.warmup-steps 0 --steps 50')} --out-dir {run}-2`\n"
    )
    assert train_state.read_meta(run / CKPT_NAME)["step"] == 1
    weights = load_file(str(run / CKPT_NAME))
    assert all(torch.isfinite(v).all() for k, v in weights.items() if k.startswith("model."))
    assert not (run / "summary.json").exists() and not (run / "model").exists()
    (retry,) = _suggested(err)  # the default rate: it trains
    assert _run(capsys, *retry)[0] == 0
    assert math.isfinite(json.loads((tmp_path / "run-2" / "summary.json").read_text())["eval_loss"])


# --- old names still load; flags print back as they parse ---------------------------------------------------


def _old_names(cfg: dict) -> dict:
    cfg = json.loads(json.dumps(cfg))
    cfg["run_dir"] = cfg.pop("out_dir")
    m = cfg["model"]
    m["n_layer"], m["n_head"], m["n_embd"] = m.pop("num_layers"), m.pop("num_heads"), m.pop("embed_dim")
    return cfg


def test_a_run_saved_with_the_old_key_names_resumes(tmp_path, capsys):
    run = tmp_path / "old"
    assert _run(capsys, "train", *TINY, "--ckpt-every", "2", "--out-dir", str(run))[0] == 0
    (run / "config.json").write_text(json.dumps(_old_names(json.loads((run / "config.json").read_text()))))
    ckpt = str(run / CKPT_NAME)
    with safe_open(ckpt, framework="pt") as f:
        meta = json.loads(f.metadata()["attnlab"])
    meta["config"] = _old_names(meta["config"])
    save_file(load_file(ckpt), ckpt, metadata={"attnlab": json.dumps(meta)})
    assert load_config(run / "config.json").model == ModelConfig(num_layers=1, embed_dim=16)
    code, out, _ = _run(capsys, "train", "--out-dir", str(run), "--resume", "--steps", "6")
    assert code == 0 and f"resumed {run / CKPT_NAME} at step 4" in out and "done: 6 steps" in out


def test_command_flags_parse_back_to_the_same_config(tmp_path):
    cfg = TrainConfig(
        data=DataConfig(task="text", text_path=tmp_path / "my book.txt", batch_size=6),
        model=ModelConfig(kind="minimal", causal=False, num_kv_heads=2, dropout=0.1),
        optim=OptimConfig(lr=1e-8, schedule="constant"),
        stop_at_acc=0.95,
        progress=False,
        out_dir=tmp_path / "x",
    )
    flags = shlex.split(" ".join(command_flags(cfg, TrainConfig())))
    assert "--model.no-causal" in flags and "1e-08" in flags
    assert tyro.cli(TrainConfig, args=flags) == cfg


# --- help tells the truth -----------------------------------------------------------------------------------


def _flags(cls: type, prefix: str = "--") -> set[str]:
    """Every flag tyro derives from the dataclass ``cls`` (``--x`` and, for booleans, ``--no-x``)."""
    out = set()
    for f in fields(cls):
        flag = prefix + f.name.replace("_", "-")
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            out |= _flags(type(default), flag + ".")
        else:
            out.add(flag)
            if isinstance(default, bool):
                out.add(f"{prefix}no-{f.name.replace('_', '-')}")
    return out


@pytest.mark.parametrize("command", ["train", "ablate-heads"])
def test_help_mentions_only_flags_that_exist(command, capsys, monkeypatch):
    from attnlab.lab.ablate import AblateConfig

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    real = {"--help", "--config"} | _flags(TrainConfig if command == "train" else AblateConfig)
    mentioned = set(re.findall(r"(?<![\w-])(--[a-z][\w.-]*[\w])", text))
    assert mentioned <= real, mentioned - real
    assert mentioned >= real - {"--help"}  # and every flag is listed
    assert not re.search(r"n-embd|n-head|n-layer|run-dir", text)
    if command == "ablate-heads":
        assert "(default: recall)" in text and "(default: minimal)" in text
        for replaced in (
            "--train.seed",
            "--train.out-dir",
            "--train.resume",
            "--train.stop-at-acc",
            "--train.progress",
        ):
            assert replaced not in real  # the study sets these itself: no flag pretends otherwise


# --- ablate-heads: a study is never replaced, and resumes after an interrupt ---------------------------------

ABLATE = [
    "--heads",
    "1",
    "2",
    "--train.steps",
    "4",
    "--train.eval-every",
    "2",
    "--train.model.embed-dim",
    "8",
    "--train.model.num-layers",
    "1",
    "--train.data.batch-size",
    "8",
    "--train.data.n-pairs",
    "2",
]


@pytest.mark.slow  # two ablation studies; test_disk_full's study resume stays quick
def test_ablate_interrupted_then_resumed_matches_an_uninterrupted_study(tmp_path, capsys, monkeypatch):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _run(capsys, "ablate-heads", *ABLATE, "--out-dir", str(full))[0] == 0

    from attnlab.lab import ablate as ablate_mod

    real_train, calls = ablate_mod.train, []

    def signal_before_the_fifth_run(cfg, **kw):
        calls.append(cfg.out_dir.name)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: the study's handler takes it, no KeyboardInterrupt
        return real_train(cfg, **kw)

    monkeypatch.setattr(ablate_mod, "train", signal_before_the_fifth_run)
    code, _, err = _run(capsys, "ablate-heads", *ABLATE, "--out-dir", str(cut))
    assert code == 130
    ckpt = cut / "runs" / "heads-2-seed-1" / CKPT_NAME
    assert err == (
        f"attnlab: SIGINT received: stopped run heads=2 seed=1 after step 0 of 4 (4 of 6 runs finished), checkpoint "
        f"saved to {ckpt}; resume with `attnlab ablate-heads --out-dir {cut} --resume`\n"
    )
    assert train_state.read_meta(ckpt)["step"] == 0 and not (cut / "ablation.json").exists()

    code, _, err = _run(capsys, "ablate-heads", *ABLATE, "--out-dir", str(cut))  # not replaced either
    assert code == 2 and "already holds an ablate-heads study (config.json, runs; 4 runs finished)" in err

    monkeypatch.setattr(ablate_mod, "train", real_train)
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = _run(capsys, *_suggested(err)[0])  # `attnlab ablate-heads --out-dir CUT --resume`
    assert code == 0 and f"resuming {cut}: 4 of 6 runs finished before, kept as they are" in out
    assert out.count(", kept)\n") == 4
    assert max(len(line) for line in out.splitlines() if not line.startswith(("wrote", "resuming"))) <= 80
    rows = [json.loads((d / "ablation.json").read_text())["rows"] for d in (full, cut)]
    strip = lambda r: {h: [(x["seed"], x["eval_loss"], x["eval_acc"]) for x in v["runs"]] for h, v in r.items()}
    assert strip(rows[0]) == strip(rows[1])  # same runs, same numbers, to the last bit


def test_ablate_resume_needs_a_study(tmp_path, capsys):
    nope = tmp_path / "nope"
    code, _, err = _run(capsys, "ablate-heads", *ABLATE, "--out-dir", str(nope), "--resume")
    assert (code, err) == (
        2,
        f"attnlab: error: --resume: --out-dir '{nope}' does not exist, so there is no study to resume; check the name, "
        f"or start a new study there with `attnlab ablate-heads --train.data.batch-size 8 --train.data.n-pairs 2 "
        f"--train.model.num-layers 1 --train.model.embed-dim 8 --train.steps 4 --train.eval-every 2 --heads 1 2 "
        f"--out-dir {nope}`.\n",
    )
    assert not nope.exists()


def test_ctrl_c_before_training_starts_is_one_line_and_130(capsys, monkeypatch):
    from attnlab.lab import cli as lab_cli

    def interrupted_while_parsing(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(lab_cli.LAB_COMMANDS, "train", (interrupted_while_parsing, None))
    assert _run(capsys, "train") == (130, "", "attnlab: interrupted before train started; nothing was written.\n")
