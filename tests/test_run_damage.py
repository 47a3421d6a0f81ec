"""A damaged run folder is named as such (issue 39): on ``--resume`` every file read back (``config.json``,
``metrics.jsonl``, the checkpoint's metadata, tensors and RNG) is read as a file attnlab wrote.

Each shape of damage is one line naming the file, the field (or line, or tensor), what it holds and what it
should; no message suggests a flag value (which would change the run being resumed), and each fix it gives
is run as printed. One repair is silent: a last metrics line torn by a kill mid-write.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from attnlab.cli import main
from attnlab.lab.train_state import CKPT_NAME

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
    "--steps",
    "4",
    "--eval-every",
    "2",
    "--ckpt-every",
    "2",
    "--no-progress",
]
RESUME_FIX = "it cannot be resumed: start a new run in another --out-dir"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", *TINY, "--out-dir", str(run)]) == 0
    return run


@pytest.fixture
def run(base, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base, copy)
    return copy


def _resume(capsys, run: Path, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["train", "--out-dir", str(run), "--resume", "--steps", "6", *extra])
    return code, capsys.readouterr().err


def _config_fix(run: Path) -> str:
    return (
        f"the run's checkpoint.safetensors holds its config too: remove the file (`rm {run}/config.json`) and run "
        f"`attnlab train --out-dir {run} --resume` again, which then reads it from there"
    )


def _edit_config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        data = json.loads((run / "config.json").read_text())
        edit(data)
        (run / "config.json").write_text(json.dumps(data, indent=2))

    return damage


def _as_dir(name: str) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        (run / name).unlink()
        (run / name).mkdir()

    return damage


CONFIG_DAMAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("empty", lambda r: (r / "config.json").write_text(""), "it is empty (0 bytes), expected a JSON object"),
    (
        "truncated",
        lambda r: (r / "config.json").write_text((r / "config.json").read_text()[:100]),
        "it is not valid JSON (cut short): Expecting ':' delimiter at line 7 column 13",
    ),
    (
        "not JSON",
        lambda r: (r / "config.json").write_text("hello"),
        "it is not valid JSON: Expecting value at line 1 column 1",
    ),
    ("not UTF-8", lambda r: (r / "config.json").write_bytes(b"\xff{}"), "it is not UTF-8 text (byte 0xff at offset 0)"),
    ("a list", lambda r: (r / "config.json").write_text("[1, 2]"), "it holds [1, 2] (a list), expected an object"),
    ("a directory", _as_dir("config.json"), "it is a directory, expected a JSON file"),
    (
        "num_heads four",
        _edit_config(lambda c: c["model"].update(num_heads="four")),
        'field model.num_heads holds "four" (a string), expected an integer',
    ),
    (
        "steps a string",
        _edit_config(lambda c: c.update(steps="300")),
        'field steps holds "300" (a string), expected an integer',
    ),
    ("model null", _edit_config(lambda c: c.update(model=None)), "field model holds null, expected an object"),
    (
        "task unknown",
        _edit_config(lambda c: c["data"].update(task="sort")),
        'field data.task holds "sort" (a string), expected one of "recall", "copy", "random", "text"',
    ),
    ("unknown field", _edit_config(lambda c: c.update(lr=1)), "field lr is not one attnlab writes there"),
    (
        "missing field",
        _edit_config(lambda c: c.pop("steps")),
        "field steps is missing (its checkpoint.safetensors has it)",
    ),
    (
        "out of range",
        _edit_config(lambda c: c["data"].update(batch_size=-3)),
        "field data.batch_size holds -3 (an integer), expected an integer >= 1",
    ),
    (
        "fields that do not fit",
        _edit_config(lambda c: c["model"].update(num_heads=3)),
        "fields model.num_heads = 3 (an integer) and model.embed_dim = 16 (an integer) do not fit together, expected "
        "model.num_heads to divide model.embed_dim",
    ),
    (
        "another run's value",
        _edit_config(lambda c: c.update(seed=5)),
        "field seed holds 5 (an integer), but the run's checkpoint.safetensors was saved with 0 (an integer)",
    ),
]


@pytest.mark.parametrize("damage, what", [c[1:] for c in CONFIG_DAMAGE], ids=[c[0] for c in CONFIG_DAMAGE])
def test_a_damaged_config_json_is_named_and_its_fix_resumes_the_run(damage, what, run, capsys):
    damage(run)
    code, err = _resume(capsys, run)
    rm = "rm -r" if (run / "config.json").is_dir() else "rm"
    fix = _config_fix(run).replace("`rm ", f"`{rm} ")
    assert (code, err) == (2, f"attnlab: error: --resume: '{run}/config.json' is damaged: {what}; {fix}.\n")
    assert "--steps" not in err and "--model" not in err  # no flag value that would change the run
    removal = re.search(r"`(rm[^`]*)`", err).group(1)
    subprocess.run(shlex.split(removal), check=True)  # the fix, as printed
    code, err = _resume(capsys, run)
    assert (code, err) == (0, "")


def _retensor(edit=None, edit_meta=None) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        path = run / CKPT_NAME
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["attnlab"])
        tensors = load_file(str(path))
        if edit:
            edit(tensors)
        if edit_meta:
            edit_meta(meta)
        path.write_bytes(save(tensors, metadata={"attnlab": json.dumps(meta)}))

    return damage


def _cut(n: int) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        data = (run / CKPT_NAME).read_bytes()
        (run / CKPT_NAME).write_bytes(data[:n])

    return damage


def _foreign(run: Path) -> None:
    save_file({"w": torch.zeros(3)}, str(run / CKPT_NAME))


W = "model.transformer.h.0.attn.k_proj.bias"  # the first weight the model's state_dict names
CHECKPOINT_DAMAGE: list[tuple[str, Callable[[Path], None], str]] = [
    ("empty", lambda r: (r / CKPT_NAME).write_bytes(b""), "is not a readable safetensors file (it is empty)"),
    (
        "truncated header",
        _cut(3000),
        "is not a readable safetensors file (Error while deserializing header: invalid header length)",
    ),
    (
        "truncated tensors",
        _cut(-100),
        "is not a readable safetensors file (Error while deserializing header: incomplete metadata, file not "
        "fully covered)",
    ),
    (
        "not safetensors",
        lambda r: (r / CKPT_NAME).write_text("not a checkpoint at all"),
        "is not a readable safetensors file (Error while deserializing header: header too large)",
    ),
    (
        "foreign safetensors",
        _foreign,
        "has no 'attnlab.lab.train_state' metadata, so attnlab train did not write it; start a new run in another "
        "--out-dir.",
    ),
    (
        "missing tensor",
        _retensor(lambda t: t.pop(W)),
        f"is damaged: tensor {W} is missing (the model its config describes has it)",
    ),
    (
        "wrong shape",
        _retensor(lambda t: t.update({W: torch.zeros(2, 2)})),
        f"is damaged: tensor {W} is (2, 2) torch.float32, expected (16) torch.float32 (the model its config describes)",
    ),
    (
        "wrong dtype",
        _retensor(lambda t: t.update({W: t[W].double()})),
        f"is damaged: tensor {W} is (16) torch.float64, expected (16) torch.float32 (the model its config describes)",
    ),
    (
        "no RNG",
        _retensor(lambda t: t.pop("rng.cpu")),
        "is damaged: tensor rng.cpu (torch's RNG state, which dropout draws from) is missing",
    ),
    (
        "short RNG",
        _retensor(lambda t: t.update({"rng.cpu": t["rng.cpu"][:10].clone()})),
        "is damaged: tensor rng.cpu is (10) torch.uint8, expected (5056) torch.uint8",
    ),
    (
        "missing optimizer moment",
        _retensor(lambda t: t.pop("optim.3.exp_avg")),
        "is damaged: tensor optim.3.exp_avg is missing (saved after step 4, every parameter has its AdamW state)",
    ),
    (
        "optimizer moment of another shape",
        _retensor(lambda t: t.update({"optim.0.exp_avg_sq": torch.zeros(3)})),
        "is damaged: tensor optim.0.exp_avg_sq is (3) torch.float32, expected (27, 16) floating point",
    ),
    (
        "a stranger tensor",
        _retensor(lambda t: t.update({"extra": torch.zeros(1)})),
        "is damaged: tensor extra is not one attnlab train writes",
    ),
    (
        "step a string",
        _retensor(edit_meta=lambda m: m.update(step="4")),
        'is damaged: metadata field step holds "4" (a string), expected an integer',
    ),
    (
        "step past the run",
        _retensor(edit_meta=lambda m: m.update(step=99)),
        "is damaged: metadata field step holds 99, expected 0 to config.steps = 4",
    ),
    ("no config", _retensor(edit_meta=lambda m: m.pop("config")), "is damaged: metadata field config is missing"),
    (
        "config field of the wrong type",
        _retensor(edit_meta=lambda m: m["config"]["optim"].update(lr="fast")),
        'is damaged: metadata field config.optim.lr holds "fast" (a string), expected a number',
    ),
    (
        "config out of range",
        _retensor(edit_meta=lambda m: m["config"].update(eval_every=0)),
        "is damaged: field config.eval_every holds 0 (an integer), expected an integer >= 1",
    ),
    (
        "optimizer groups",
        _retensor(edit_meta=lambda m: m.update(param_groups=[{"params": [0]}])),
        "is damaged: metadata field param_groups holds groups of [1] parameters, expected [8, 12] (the model its "
        "config describes)",
    ),
    (
        "betas",
        _retensor(edit_meta=lambda m: m["param_groups"][0].update(betas="x")),
        'is damaged: metadata field param_groups[0].betas holds "x" (a string), expected a list of 2 numbers',
    ),
    (
        "optimizer scalars",
        _retensor(edit_meta=lambda m: m.update(optim_scalars=[])),
        "is damaged: metadata field optim_scalars holds [] (a list), expected an object",
    ),
]


@pytest.mark.parametrize("damage, what", [c[1:] for c in CHECKPOINT_DAMAGE], ids=[c[0] for c in CHECKPOINT_DAMAGE])
def test_a_damaged_checkpoint_is_named_with_its_tensor_or_field(damage, what, run, capsys):
    damage(run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    code, err = _resume(capsys, run)
    end = "" if what.endswith(".") else f"; {RESUME_FIX}."
    assert (code, err) == (2, f"attnlab: error: checkpoint '{run}/{CKPT_NAME}' {what}{end}\n")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # nothing touched


def test_a_checkpoint_directory_and_an_empty_folder_say_there_is_nothing_to_resume(run, capsys):
    _as_dir(CKPT_NAME)(run)
    code, err = _resume(capsys, run)
    assert code == 2 and err.startswith(
        f"attnlab: error: --resume: '{run}/{CKPT_NAME}' is a directory, expected the run's checkpoint file, so there "
        f"is nothing to resume from; start the run afresh with `attnlab train "
    )


def _metrics_lines(run: Path) -> list[str]:
    return (run / "metrics.jsonl").read_text().splitlines()


def _metrics(edit: Callable[[list[str]], list[str]]) -> Callable[[Path], None]:
    def damage(run: Path) -> None:
        (run / "metrics.jsonl").write_text("\n".join(edit(_metrics_lines(run))) + "\n")

    return damage


METRICS_DAMAGE: list[tuple[str, Callable[[Path], None], int, str]] = [
    ("a null line", _metrics(lambda ls: [*ls, "null"]), 6, "it holds null, expected an object with a step"),
    (
        "garbage in the middle",
        _metrics(lambda ls: [ls[0], "xx", *ls[1:]]),
        2,
        '"xx" (a string) is not JSON (Expecting value)',
    ),
    ("no step", _metrics(lambda ls: [ls[0], '{"loss": 1.0}', *ls[2:]]), 2, "it has no step, expected an integer >= 0"),
    (
        "step a string",
        _metrics(lambda ls: [ls[0], ls[1].replace('"step": 1', '"step": "1"'), *ls[2:]]),
        2,
        'step holds "1" (a string), expected an integer >= 0',
    ),
    (
        "steps out of order",
        _metrics(lambda ls: [ls[0], ls[2], ls[1], *ls[3:]]),
        3,
        "step 1 follows step 2, expected steps in increasing order",
    ),
    (
        "a loss that is no number",
        _metrics(lambda ls: [ls[0], re.sub(r'"loss": [^,]+', '"loss": "low"', ls[1]), *ls[2:]]),
        2,
        'loss holds "low" (a string), expected a number',
    ),
    ("not UTF-8", lambda r: (r / "metrics.jsonl").write_bytes(b"\xff\n"), 1, "byte 0xff is not UTF-8 text"),
]


@pytest.mark.parametrize("damage, line, what", [c[1:] for c in METRICS_DAMAGE], ids=[c[0] for c in METRICS_DAMAGE])
def test_a_damaged_metrics_line_is_named_and_deleting_it_resumes(damage, line, what, run, capsys):
    damage(run)
    code, err = _resume(capsys, run)
    path = run / "metrics.jsonl"
    assert (code, err) == (
        2,
        f"attnlab: error: '{path}' line {line} is damaged: {what}; attnlab writes one JSON object per step there, so "
        f"the file was changed since: delete that line (`sed -i '{line}d' {path}`) or restore the file, then run the "
        f"command again.\n",
    )
    subprocess.run(shlex.split(re.search(r"`(sed[^`]*)`", err).group(1)), check=True)
    code, err = _resume(capsys, run)
    assert code == 0, err


def test_a_torn_last_metrics_line_is_dropped_without_a_word(run, capsys):
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 3.2')  # a kill mid-write: no newline
    code, err = _resume(capsys, run)
    assert (code, err) == (0, "")
    steps = [json.loads(line)["step"] for line in _metrics_lines(run)]
    assert steps == list(range(7))


@pytest.mark.parametrize(
    "damage, note",
    [
        (
            _metrics(lambda ls: ls[:3]),
            "'{m}' has no line for steps 3-4 (lost after the checkpoint at step 4 was written)",
        ),
        (
            lambda r: (r / "metrics.jsonl").write_text(""),
            "'{m}' has no line for steps 0-4 (lost after the checkpoint at step 4 was written)",
        ),
        (
            lambda r: (r / "metrics.jsonl").unlink(),
            "'{m}' is missing, so steps 0-4 have no line (lost after the checkpoint at step 4 was written)",
        ),
    ],
    ids=["cut short", "empty", "missing"],
)
def test_lost_metrics_lines_are_said_and_the_run_goes_on(damage, note, run, capsys):
    damage(run)
    code, err = _resume(capsys, run)
    m = run / "metrics.jsonl"
    assert (code, err) == (
        0,
        f"attnlab: note: {note.format(m=m)}; the resumed run appends from step 5.\n",
    )
    assert [json.loads(line)["step"] for line in _metrics_lines(run)][-2:] == [5, 6]


def test_a_metrics_directory_is_named(run, capsys):
    _as_dir("metrics.jsonl")(run)
    code, err = _resume(capsys, run)
    path = run / "metrics.jsonl"
    assert (code, err) == (
        2,
        f"attnlab: error: '{path}' is a directory, expected the run's metrics (a file of JSON lines); remove it "
        f"(`rm -r {path}`) and run the command again: the resumed run starts a new one.\n",
    )


def _chattr(path: Path, flag: str) -> bool:
    return (
        shutil.which("chattr") is not None
        and subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    )


def test_an_immutable_checkpoint_is_found_before_training(run, capsys):
    ckpt = run / CKPT_NAME
    if os.geteuid() != 0 or not _chattr(ckpt, "+i"):
        pytest.skip("needs root and a file system with chattr +i")
    try:
        before = (run / "metrics.jsonl").read_bytes()
        code, err = _resume(capsys, run)
        assert (code, err) == (
            2,
            f"attnlab: error: '{ckpt}' cannot be replaced (it is immutable or append-only: Operation not permitted), "
            f"so this run could not save into '{run}'; clear it with `chattr -i -a {ckpt}` (as root), then run the "
            f"command again.\n",
        )
        assert (run / "metrics.jsonl").read_bytes() == before  # refused before any work
        subprocess.run(shlex.split(re.search(r"`(chattr[^`]*)`", err).group(1)), check=True)
        assert _resume(capsys, run)[0] == 0
    finally:
        _chattr(ckpt, "-i")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes files whatever their permissions")
def test_files_without_permissions_are_named(run, capsys):
    (run / "summary.json").chmod(0o444)
    code, err = _resume(capsys, run)
    assert code == 2 and f"'{run}/summary.json' cannot be replaced (it is read-only" in err
    (run / "summary.json").chmod(0o644)
    (run / CKPT_NAME).chmod(0o000)
    code, err = _resume(capsys, run)
    assert code == 2 and f"checkpoint '{run}/{CKPT_NAME}' cannot be read (no read permission)" in err


# --- ablate-heads: the study's own files -----------------------------------------------------------------------

STUDY = [
    "--train.data.n-pairs",
    "2",
    "--train.model.embed-dim",
    "8",
    "--train.steps",
    "2",
    "--train.eval-every",
    "2",
    "--heads",
    "1",
    "2",
]


def test_a_damaged_study_config_is_named(tmp_path, capsys):
    from attnlab.lab.ablate import AblateConfig
    from attnlab.lab.config import save_config

    study = tmp_path / "study"
    config = study / "config.json"
    save_config(AblateConfig(heads=[1, 2], out_dir=study), config)  # what a study writes first
    good = config.read_text()
    for damage, what in [
        ("", "it is empty (0 bytes), expected a JSON object"),
        (
            good.replace('"heads": [', '"heads": ["one", '),
            'field heads holds ["one", 1, 2] (a list), expected a list of integers',
        ),
        (
            good.replace('"target_acc": 0.9', '"target_acc": 7'),
            "field target_acc holds 7.0 (a number), expected a number > 0 and <= 1",
        ),
        (json.dumps({"steps": 3}), "field heads is missing (a study's config.json has heads and seeds)"),
    ]:
        config.write_text(damage)
        capsys.readouterr()
        assert main(["ablate-heads", "--out-dir", str(study), "--resume"]) == 2
        assert capsys.readouterr().err == (
            f"attnlab: error: --resume: '{config}' is damaged: {what}; restore it from a copy, or start a new study "
            f"in another --out-dir.\n"
        )


@pytest.mark.slow
def test_a_damaged_summary_of_a_finished_run_is_named_and_its_fix_resumes(tmp_path, capsys):
    study = tmp_path / "study"
    assert main(["ablate-heads", *STUDY, "--out-dir", str(study)]) == 0
    summary = study / "runs" / "heads-1-seed-0" / "summary.json"
    summary.write_text('{"eval_loss": "low"}')
    capsys.readouterr()
    assert main(["ablate-heads", "--out-dir", str(study), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"attnlab: error: --resume: '{summary}' is damaged: field eval_loss holds \"low\" (a string), expected a "
        f"number; delete it (`rm {summary}`) and run the command again, which trains that run again.\n"
    )
    subprocess.run(shlex.split(re.search(r"`(rm[^`]*)`", err).group(1)), check=True)
    assert main(["ablate-heads", "--out-dir", str(study), "--resume"]) == 0
