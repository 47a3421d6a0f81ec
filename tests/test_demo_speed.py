"""The demo's speed line (``attnlab demo``, step 5): attnlab's decode rate in this run beside llama.cpp's on the
same file, measured in the same run where ``llama_cpp`` imports, else the README's figures with the CPU they were
measured on, which must be the figures of the JSON files the README cites."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from attnlab.tools import demo
from attnlab.tools.generate_cli import StreamRate

ROOT = Path(__file__).resolve().parents[1]
# 37 prompt tokens, 84 new (the first from the prefill), 0.2 s then 0.83 s: 100 tokens/s after the first
RATE = StreamRate(prompt_tokens=37, new_tokens=84, prefill_s=0.2, decode_s=0.83, compile_s=None)


@pytest.mark.parametrize("vnni", [True, False])
def test_the_readme_speeds_are_the_batch_1_figures_of_the_json_they_name(vnni):
    cpu, ours, theirs, source = demo.README_SPEEDS[vnni]
    report = json.loads((ROOT / source).read_text())
    (row,) = [r for r in report["results"] if r["batch"] == 1 and "attnlab gguf" in r]
    assert round(row["attnlab gguf"]["tokens_per_s"], 1) == ours
    assert round(row["llama.cpp"]["tokens_per_s"], 1) == theirs
    assert ("avx512_vnni" in report["cpu"]["flags"]) is vnni
    assert cpu.split(" ")[0] in report["cpu"]["model"] and report["threads"] == 2
    readme = (ROOT / "README.md").read_text()
    assert f"{ours}" in readme and f"{theirs}" in readme


def test_the_rate_is_the_tokens_after_the_first_over_their_time():
    assert RATE.decode_tokens_per_s == pytest.approx(83 / 0.83)
    compiled = StreamRate(37, 84, 0.2, 10.82, compile_s=10.0)  # the compiling step apart: 82 tokens in 0.82 s
    assert compiled.decode_tokens_per_s == pytest.approx(100.0)


def _llama_cpp(monkeypatch, present: bool) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (real("json") if present else None) if name == "llama_cpp" else real(name, *a),
    )


def test_without_llama_cpp_the_line_quotes_the_readme_with_its_cpu(monkeypatch):
    _llama_cpp(monkeypatch, present=False)
    monkeypatch.setattr(demo, "_llama_cpp_rate", lambda *a: pytest.fail("llama.cpp is not there to measure"))
    line = demo._speed_line(RATE, Path("model.gguf"))
    from attnlab.runtime import cpu_info

    vnni = "avx512_vnni" in cpu_info()["flags"]
    cpu, ours, theirs, source = demo.README_SPEEDS[vnni]
    assert line.startswith(f"speed: attnlab decoded 83 tokens at 100.0 tokens/s on this CPU ({cpu_info()['model']}, ")
    assert f"llama.cpp is not installed here (`{demo.LLAMA_CPP_INSTALL}` to measure it in this run)" in line
    assert line.endswith(
        f"the README's figures on {cpu}, 2 threads: attnlab {ours} and llama.cpp {theirs} tokens/s ({source})."
    )


def test_with_llama_cpp_the_line_measures_it_on_the_same_file_and_length(monkeypatch):
    _llama_cpp(monkeypatch, present=True)
    asked = []
    monkeypatch.setattr(demo, "_llama_cpp_rate", lambda path, p, n: asked.append((path, p, n)) or 80.0)
    line = demo._speed_line(RATE, Path("model.gguf"))
    assert asked == [(Path("model.gguf"), 37, 84)]
    assert line == (
        "speed: attnlab decoded 83 tokens at 100.0 tokens/s; llama.cpp on the same file, same length, in this run: "
        "80.0 tokens/s (1.25x)."
    )


def test_a_llama_cpp_that_fails_is_reported_as_its_failure(monkeypatch):
    _llama_cpp(monkeypatch, present=True)

    def broken(*a):
        raise RuntimeError("llama_model_load: unknown model architecture")

    monkeypatch.setattr(demo, "_llama_cpp_rate", broken)
    assert demo._speed_line(RATE, Path("model.gguf")) == (
        "speed: attnlab decoded 83 tokens at 100.0 tokens/s; llama.cpp could not run here "
        "(RuntimeError: llama_model_load: unknown model architecture)."
    )
