"""``attnlab train`` / ``ablate-heads`` through ``attnlab.cli.main``: config files, unknown keys, artifacts."""

from __future__ import annotations

import json

import pytest

from attnlab.cli import main
from attnlab.lab.config import DataConfig, TrainConfig, config_from_dict, config_to_dict, load_config, save_config

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


TINY = ["--steps", "12", "--eval-every", "6", "--ckpt-every", "0", "--model.embed-dim", "32", "--no-progress"]


def test_config_round_trips_through_json(tmp_path):
    cfg = TrainConfig(data=DataConfig(task="text", text_path=tmp_path / "x.txt"), steps=7)
    save_config(cfg, tmp_path / "c.json")
    assert load_config(tmp_path / "c.json") == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_unknown_config_keys_are_rejected(tmp_path):
    data = config_to_dict(TrainConfig())
    data["model"]["num_head"] = 4  # typo of num_heads
    with pytest.raises(ValueError, match=r"config model\. has unknown key\(s\) \['num_head'\]"):
        config_from_dict(data)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    assert main(["train", "--config", str(tmp_path / "bad.json")]) == 2


def test_train_writes_a_reloadable_config_and_flags_override_it(tmp_path, capsys):
    run = tmp_path / "a"
    assert main(["train", *TINY, "--data.copy-len", "5", "--out-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "done: 12 steps" in out and f"artifacts: {run}" in out
    saved = load_config(run / "config.json")
    assert saved.data.copy_len == 5 and saved.steps == 12
    run_b = tmp_path / "b"
    assert main(["train", "--config", str(run / "config.json"), "--steps", "6", "--out-dir", str(run_b)]) == 0
    reloaded = load_config(run_b / "config.json")
    assert reloaded.data.copy_len == 5 and reloaded.steps == 6 and reloaded.model.embed_dim == 32


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--model.n-head", "4"])  # the name before the flag vocabulary was unified
    assert e.value.code == 2


def test_train_and_ablate_are_listed(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "train" in out and "ablate-heads" in out


def test_ablate_heads_prints_table_and_writes_png(tmp_path, capsys):
    out_dir = tmp_path / "abl"
    assert (
        main(
            [
                "ablate-heads",
                "--heads",
                "1",
                "4",
                "--seeds",
                "0",
                "1",
                "2",
                "--train.steps",
                "20",
                "--train.eval-every",
                "10",
                "--train.model.embed-dim",
                "32",
                "--target-acc",
                "0.2",
                "--out-dir",
                str(out_dir),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "final loss" in out and "steps to 20%" in out and "±" in out
    assert (out_dir / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    table = (out_dir / "ablation.md").read_text().splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("| 1 | 32 |") and table[3].startswith("| 4 | 8 |")
    rows = json.loads((out_dir / "ablation.json").read_text())["rows"]
    assert [r["seed"] for r in rows["4"]["runs"]] == [0, 1, 2]


def test_ablate_heads_needs_three_seeds_and_divisors(tmp_path):
    assert main(["ablate-heads", "--seeds", "0", "1", "--out-dir", str(tmp_path)]) == 2
    assert main(["ablate-heads", "--heads", "3", "--out-dir", str(tmp_path)]) == 2
