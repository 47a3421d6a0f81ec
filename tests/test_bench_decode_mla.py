"""``attnlab bench-decode --mla`` at tiny sizes: the report's bytes follow from the shapes, the two MLA paths agree,
and every bad flag is refused in one sentence (nothing here is a timing)."""

from __future__ import annotations

import json

import pytest

import attnlab.bench.decode as decode
from attnlab.bench.decode_mla import MLABenchConfig, _crossing, gqa_kv_heads
from attnlab.cli import main

# E=32, H=4 (GQA head dim D=8), C=24, R=4, N=8, Dv=8, L=2
TINY = {
    "hidden-size": 32,
    "num-heads": 4,
    "kv-lora-rank": 24,
    "qk-rope-head-dim": 4,
    "qk-nope-head-dim": 8,
    "v-head-dim": 8,
    "num-layers": 2,
    "check-steps": 3,
}
COPY_RATE = 10e9  # bytes/s: copy_bandwidth() stood in for, so that its 256 MiB copies stay out of the test


def _tiny_args(out_dir) -> list[str]:
    args = ["bench-decode", "--mla", "--repeats", "1", "--threads", "1", "--out-dir", str(out_dir)]
    for name, value in TINY.items():
        args += [f"--mla-config.{name}", str(value)]
    args += ["--mla-config.cache-lens", "6", "20", "--mla-config.sweep-lens", "4", "20"]
    return [*args, "--mla-config.sweep-queries", "1", "8"]


def test_bench_decode_mla_report_follows_from_the_shapes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(decode, "copy_bandwidth", lambda device: COPY_RATE)
    assert main(_tiny_args(tmp_path / "out")) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    report = json.loads((tmp_path / "out" / "decode_mla.json").read_text())
    config = report["config"]
    L, H, E, s = 2, 4, 32, 4  # float32
    C, R, N, Dv = 24, 4, 8, 8
    G, D = config["kv_heads"], config["gqa_head_dim"]
    assert (G, D) == (2, 8)  # 2*G*D = 32 is the nearest to C + R = 28 (16 with G=1)
    assert report["runners"] == ["MLA naive", "MLA absorbed", "GQA G=2"] and report["copy_GB_per_s"] == 10.0
    assert [row["cache_len"] for row in report["results"]] == [6, 20]
    for row in report["results"]:
        S = row["cache_len"]
        naive, absorbed, gqa = (row[name] for name in report["runners"])
        assert naive["cache_bytes_per_token"] == absorbed["cache_bytes_per_token"] == (C + R) * s * L
        assert gqa["cache_bytes_per_token"] == 2 * G * D * s * L
        assert naive["cache_bytes_read"] == absorbed["cache_bytes_read"] == S * (C + R) * s * L
        assert naive["expanded_bytes_read"] == S * H * (N + R + Dv) * s * L and absorbed["expanded_bytes_read"] == 0
        assert gqa["cache_bytes_read"] == S * 2 * G * D * s * L
        mla_weights = L * (E * H * (N + R) + E * (C + R) + C + C * H * (N + Dv) + H * Dv * E + E) * s  # + RMSNorms
        assert naive["weight_bytes"] == absorbed["weight_bytes"] == mla_weights
        assert gqa["weight_bytes"] == L * (2 * E * H * D + 2 * E * G * D + E) * s
        for r in (naive, absorbed, gqa):
            parts = r["weight_bytes"] + r["cache_bytes_read"] + r["expanded_bytes_read"]
            assert r["bytes_read_per_token"] == parts
            assert r["bandwidth_fraction"] == pytest.approx(parts / COPY_RATE / (r["ms_per_token"] / 1e3))
        assert row["naive_absorbed_max_abs_diff"] < 1e-5  # the same outputs, to float32 rounding
    sweep = report["sweep"]
    assert [(p["queries"], p["cache_len"]) for p in sweep["lengths"]] == [(1, 4), (1, 20)]
    assert [(p["queries"], p["cache_len"]) for p in sweep["queries"]] == [(1, 20), (8, 20)]
    assert all(p["faster"] in ("naive", "absorbed") and p["naive_ms"] > 0 for p in sweep["lengths"] + sweep["queries"])
    assert len(report["crossover"]) == 2 and all(line in out.replace("\n  ", " ") for line in report["crossover"])
    assert "| S | model | ms/token |" in (tmp_path / "out" / "decode_mla.md").read_text()


@pytest.mark.parametrize(
    ("shape", "groups"),
    [
        ({}, 4),  # E=1024, H=16: D=64; C + R = 576 = 4.5 * 2D, and of 16's divisors 4 gives the nearest, 512
        ({"hidden_size": 2048}, 2),  # D=128 (DeepSeek-V2's head dim): 576 = 2.25 * 2D
        ({"kv_heads": 8}, 8),  # asked for
    ],
)
def test_gqa_groups_spend_about_mla_cache(shape, groups):
    assert gqa_kv_heads(MLABenchConfig(**shape)) == groups


def test_crossing_names_both_sides():
    points = [{"S": 64, "faster": "naive"}, {"S": 16, "faster": "naive"}, {"S": 256, "faster": "absorbed"}]
    assert _crossing(points, "S", "S") == "naive is faster up to S=64, absorbed from S=256"
    assert _crossing(points[:2], "S", "S") == "naive is faster at every S measured (16 to 64)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--mla", "--num-layers", "2"],
            "--num-layers shape(s) the GPT-2 sweep or --model runs, not --mla: drop --num-layers (the MLA model "
            "takes --mla-config.*, e.g. --mla-config.num-layers 2).",
        ),
        (
            ["--mla-config.num-layers", "2"],
            "--mla-config.* flags shape the MLA benchmark; pass --mla with them (attnlab bench-decode --mla ...).",
        ),
        (["--mla", "--mla-config.num-layers", "0"], "--mla-config.num-layers must be an integer >= 1, got 0."),
        (
            ["--mla", "--mla-config.kv-heads", "3"],
            "--mla-config.kv-heads 3 does not divide --mla-config.num-heads 16; pass one of [1, 2, 4, 8, 16].",
        ),
        (
            ["--mla", "--mla-config.qk-rope-head-dim", "63"],
            "--mla-config.qk-rope-head-dim 63 is odd; rotary embeddings turn channel pairs: pass 62 or 64.",
        ),
        (
            ["--mla", "--mla-config.hidden-size", "1000"],
            "--mla-config.hidden-size 1000 over --mla-config.num-heads 16 must give an even head dim for the GQA "
            "model (RoPE turns its channel pairs), got 62.5; pass e.g. --mla-config.hidden-size 992.",
        ),
        (
            ["--mla", "--mla-config.cache-lens"],
            "--mla-config.cache-lens got no length; pass e.g. --mla-config.cache-lens 256 4096.",
        ),
        (
            ["--mla", "--mla-config.sweep-queries", "8192"],
            "--mla-config.sweep-queries 8192 exceeds the longest --mla-config.cache-lens 4096; T_q queries are the "
            "last T_q of S cached tokens: pass at most 4096.",
        ),
        (
            ["--mla", "--repeats", "0"],
            "--repeats must be an integer >= 1, got 0; the median of the timed repeats is reported.",
        ),
    ],
)
def test_bad_flags_are_refused_in_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    assert main(["bench-decode", *args]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"attnlab: error: {message}\n")
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
