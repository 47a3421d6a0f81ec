"""The command line, run in-process through its entry point."""

from __future__ import annotations

import pytest

from attnlab.cli import main


def test_demo_prints_seed_000_shapes(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["demo", "--no-train"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80  # the trace and the check table included
    assert "    q = view(q, 2, 10, 8, 8)  # (b, t, h, d): features cut into h heads of d" in out
    assert "input  x: [2, 10, 64]" in out
    assert "output  : [2, 10, 64]" in out
    assert "backend : sdpa" in out
    assert "weights : [2, 8, 10, 10]" in out


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--no-such-flag", "1"])
    assert e.value.code == 2


@pytest.mark.slow
def test_full_demo_trains_and_generates(tmp_path, capsys):
    assert main(["demo", "--out-dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out
    samples = [ln for ln in out.splitlines() if " -> " in ln]
    assert len(samples) == 4 and sum("(correct)" in ln for ln in samples) >= 3  # the trained model copies
    for name in ("metrics.jsonl", "curve.png", "checkpoint.safetensors", "model"):
        assert (tmp_path / "demo" / name).exists()
    assert out.rstrip().endswith(f"artifacts written to {tmp_path / 'demo'}/")
