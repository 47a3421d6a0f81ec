"""``attnlab bench-decode`` runs end to end on a tiny model (a smoke test: nothing is timed here)."""

from __future__ import annotations

import json

from attnlab.bench.decode import _compact
from attnlab.cli import main


def test_bench_decode_writes_a_table_and_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)  # a short --out-dir, so that the paths it prints fit too
    args = [
        "bench-decode",
        "--contexts",
        "8",
        "16",
        "--max-new-tokens",
        "3",
        "--recompute-max-new-tokens",
        "3",
        "--repeats",
        "1",
        "--num-layers",
        "1",
        "--num-heads",
        "2",
        "--embed-dim",
        "16",
        "--vocab-size",
        "64",
        "--out-dir",
        "out",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    tmp_path = tmp_path / "out"
    assert "context  cache  recompute" in out and "greedy tokens identical across runners: yes" in out
    assert "| context |" in (tmp_path / "decode.md").read_text()  # the full table, tokens/s too
    report = json.loads((tmp_path / "decode.json").read_text())
    assert [r["context"] for r in report["results"]] == [8, 16]
    for row in report["results"]:
        assert set(row["same_tokens"]) == {"attnlab cache", "attnlab recompute", "HF generate"}
        assert all(
            isinstance(row[name]["ms_per_token"], float) for name in row["same_tokens"]
        )  # noise may make a 1-repeat figure meaningless, never absent


def test_printed_table_fits_80_columns_with_every_runner():
    names = ["attnlab cache", "attnlab recompute", "attnlab cache+compile", "HF generate"]
    row = {"context": 16384, "cache_GB_per_s": 1234.5}
    for i, name in enumerate(names):
        ms = [6.54, 1111.5, 5.67, 11.17][i]
        row[name] = {"ms_per_token": ms, "tokens_per_s": 1e3 / ms}
    lines = _compact([row], names, hf=True).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert lines[-2].split() == ["context", "cache", "recompute", "compiled", "HF", "speedup", "GB/s", "vs", "HF"]
    assert lines[-1].split() == ["16384", "6.54", "1111.50", "5.67", "11.17", "170.0x", "1234.5", "1.71x"]
