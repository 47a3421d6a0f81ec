"""scripts/gguf_greedy_agreement.py: the table of first differing greedy tokens.

The table is quoted in docs/howto/real-models.md, "How exact it is".
"""

from __future__ import annotations

import json

import pytest

from conftest import load_script


def _script():
    return load_script("gguf_greedy_agreement")


def test_first_difference_counts_the_agreeing_prefix():
    script = _script()
    assert script.first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert script.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert script.first_difference([9, 2], [1, 2]) == 0


@pytest.mark.slow
def test_one_prompt_end_to_end(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from attnlab.weight_files.pretrained import smollm2_path

    try:
        smollm2_path()
    except Exception as err:
        pytest.skip(str(err))
    script = _script()
    monkeypatch.setattr(script, "PROMPTS", ("What is 12 times 7?",))
    monkeypatch.setattr(script, "NEW", 4)
    out = tmp_path / "agree.json"
    assert script.main(["--out", str(out), "--threads", "1"]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert 0 <= row["gguf_first_difference"] <= 4 and row["float32"]
    assert 0 < row["gguf_logit_mean"] < row["gguf_logit_max"] < 5  # int8 activations: close, never equal
    assert report["cpu"]["vendor"] and report["kernels"]
