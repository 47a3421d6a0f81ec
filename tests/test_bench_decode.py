"""``attnlab bench-decode`` runs end to end on a tiny model (a smoke test: nothing is timed here)."""

from __future__ import annotations

import json

from attnlab.cli import main


def test_bench_decode_writes_a_table_and_json(tmp_path, capsys):
    args = [
        "bench-decode",
        "--contexts",
        "8",
        "16",
        "--new-tokens",
        "3",
        "--recompute-new-tokens",
        "3",
        "--repeats",
        "1",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--vocab-size",
        "64",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| context |" in out and "greedy tokens identical across runners: yes" in out
    report = json.loads((tmp_path / "decode.json").read_text())
    assert [r["context"] for r in report["results"]] == [8, 16]
    for row in report["results"]:
        assert set(row["same_tokens"]) == {"attnlab cache", "attnlab recompute", "HF generate"}
        assert all(
            isinstance(row[name]["ms_per_token"], float) for name in row["same_tokens"]
        )  # noise may make a 1-repeat figure meaningless, never absent
