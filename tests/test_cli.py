"""The command line, run in-process through its entry point."""

from __future__ import annotations

import pytest

from attnlab.cli import main


def test_demo_prints_seed_000_shapes(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "input  x: [2, 10, 64]" in out
    assert "output  : [2, 10, 64]" in out
    assert "backend : sdpa" in out
    assert "weights : [2, 8, 10, 10]" in out


def test_unknown_flag_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--no-such-flag", "1"])
    assert e.value.code == 2
