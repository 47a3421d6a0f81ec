"""The attention benchmark runs end to end on tiny sizes (a smoke test: nothing is timed here),
and its peers compute the same function as attnlab before anything is compared."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnlab.bench.attention import (
    RUNNERS,
    BenchConfig,
    BenchResult,
    Row,
    attention_flops,
    build_runners,
    compact_table,
)
from attnlab.bench.train import train_throughput
from attnlab.cli import main


def test_every_runner_computes_the_same_causal_attention():
    cfg = BenchConfig(embed_dim=32, num_heads=4)
    runners, skipped = build_runners(cfg, torch.device("cpu"), torch.float32)
    assert "flash-attn" in skipped and set(runners) == {
        "attnlab",
        "attnlab-math",
        "attnlab-compiled",
        "torch-mha",
        "floor",
        "seed-000",
    }
    x = torch.randn(2, 12, 32)
    ref = runners["attnlab-math"](x, 12)
    for name, fn in runners.items():
        if name != "attnlab-compiled":  # compiled: exercised by the CLI run below
            torch.testing.assert_close(fn(x, 12), ref, atol=1e-5, rtol=1e-5)


def test_flop_count_counts_the_causal_half():
    B, T, E = 2, 8, 16
    assert attention_flops(B, T, E) == 4 * (2 * B * T * E * E) + 2 * (B * T * T * E)


@pytest.mark.slow
def test_bench_cli_writes_table_json_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)  # a short --out-dir, so that the paths it prints fit too
    args = [
        "bench",
        "--lengths",
        "16",
        "32",
        "--tokens",
        "64",
        "--repeats",
        "1",
        "--embed-dim",
        "32",
        "--num-heads",
        "4",
        "--gemm-size",
        "128",
        "--no-train",
        "--out-dir",
        "out",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    tmp_path = tmp_path / "out"
    assert "T=32, B=2:" in out and re.search(r"^attnlab +[0-9.]+ +[0-9.]+ ", out, re.M)
    assert "| T | B | runner |" in (tmp_path / "bench_attention.md").read_text()  # the full table, every column
    data = json.loads((tmp_path / "bench_attention.json").read_text())
    rows = [r for r in data["rows"] if r["fwd_ms"] is not None]
    assert {r["runner"] for r in rows} >= {"attnlab", "torch-mha", "floor", "seed-000"}
    assert all(r["peak_mib"] is None or r["peak_mib"] >= 0 for r in rows)
    assert (tmp_path / "bench_attention.png").stat().st_size > 0


def test_train_throughput_compares_identical_models():
    r = train_throughput(steps=2, repeats=1)  # raises if the torch copy's logits differ from attnlab's
    assert r.attnlab_tok_s > 0 and r.torch_tok_s > 0 and "TinyGPT" in r.model


def test_printed_table_fits_80_columns_with_large_figures():
    """GPU-sized figures (GFLOP/s in the hundreds of thousands, GiB of memory) still fit 80 columns."""
    res = BenchResult({}, "cuda:0", "bfloat16", "2.13.0", 989_000.0)
    for T, B in ((4096, 2), (16384, 1)):
        for i, name in enumerate(RUNNERS[:-1]):
            res.rows.append(Row(T, B, name, 1234.5 + i, 9876.5 + i, 987_654.3, 65_432.0 + i))
    res.rows.append(
        Row(32768, 1, "attnlab-math", note="skipped: materialises (B, H, T, T) scores, T > math_max_len=16384")
    )
    res.skipped["flash-attn"] = "flash-attn not importable (ModuleNotFoundError: No module named 'flash_attn')"
    lines = compact_table(res).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert "attnlab-math: skipped, T > math_max_len=16384" in lines
    row = next(line for line in lines if line.startswith("attnlab-compiled"))
    assert row.split() == ["attnlab-compiled", "1236.5", "9878.5", "1.00", "1.00", "987654", "100%", "65434", "1.00"]


@pytest.mark.slow
def test_bench_window_writes_ratios_slopes_and_goals(tmp_path, capsys, monkeypatch, one_thread):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.chdir(tmp_path)
    args = ["bench", "--variant", "window", "--window", "32", "--lengths", "256", "512", "--repeats", "1"]
    args += ["--embed-dim", "32", "--num-heads", "4", "--out-dir", "out"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert re.search(r"^sdpa-dense +[0-9.]+ +1\.0x +[0-9.]+ +1\.0x", out, re.M)  # the reference of the kernels
    assert re.search(r"^flex +[0-9.]+ +[0-9.]+x +- ", out, re.M)  # no CPU backward: no fwd+bwd figure
    data = json.loads((tmp_path / "out" / "bench_window.json").read_text())
    rows = {(r["T"], r["runner"]): r for r in data["rows"]}
    assert {T for T, _ in rows} == {256, 512} and data["config"]["window"] == 32
    for runner in ("flex", "sdpa-dense", "sdpa-band", "attnlab-flex", "attnlab-auto", "attnlab-dense"):
        assert rows[(512, runner)]["fwd_ms"] > 0 and rows[(512, runner)]["fwd_peak_mib"] is not None
    assert rows[(512, "flex")]["fwd_bwd_ms"] is None and "no CPU backward" in rows[(512, "flex")]["note"]
    assert rows[(512, "sdpa-band")]["fwd_bwd_ms"] > 0
    assert set(data["slopes"]["sdpa-dense"]) == {"fwd", "fwd_bwd"}
    assert set(data["auto"]["T=512"]) == {"inference", "training"}
    assert "T=8192" in data["goals"][0]  # goals are stated at T=8192, not measured in this tiny run
    assert "| T | runner | fwd ms | x dense |" in (tmp_path / "out" / "bench_window.md").read_text()
    assert (tmp_path / "out" / "bench_window.png").stat().st_size > 0


def test_window_goals_print_the_module_ceiling_and_the_backward_memory_floor():
    """The two goals that depend on the machine come with their floors, computed from the run's own rows."""
    from attnlab.bench.window import WindowResult, WindowRow, window_goals

    T = 8192
    res = WindowResult(config={"embed_dim": 512, "num_heads": 8}, device="cpu", dtype="float32", torch="x", threads=2)
    res.rows += [
        WindowRow(T, "sdpa-dense", fwd_ms=600.0, fwd_bwd_ms=2000.0, fwd_peak_mib=270.0, fwd_bwd_peak_mib=320.0),
        WindowRow(T, "flex", fwd_ms=50.0, fwd_peak_mib=16.0),
        WindowRow(T, "attnlab-dense", fwd_ms=700.0, fwd_bwd_ms=2200.0),
        WindowRow(T, "attnlab-auto", fwd_ms=110.0, fwd_bwd_ms=400.0),
        WindowRow(T, "projections", fwd_ms=50.0),
    ]
    lines = window_goals(res).splitlines()
    # 8 * 8192 * 512^2 FLOP in 50 ms; 700 / 50 and 700 / (50 + 50)
    assert (
        "  the four projections alone take 50.0 ms of attnlab-auto's 110.0 ms (344 GFLOP/s); the module's "
        "ceiling over attnlab-dense is 14.0x with a free attention kernel, 7.0x with flex's kernel time added"
    ) in lines
    # five (1, 8, 8192, 64) float32 tensors = 80 MiB, of 320
    assert (
        "  any fwd+bwd holds the output, its gradient and dq, dk, dv ((1, 8, 8192, 64) each): 80.0 MiB = 0.250 of dense"
        in lines
    )


def test_window_goals_add_the_gpu_goals_when_the_run_measured_t_32768():
    from attnlab.bench.window import WindowResult, WindowRow, window_goals

    res = WindowResult(
        config={"embed_dim": 1024, "num_heads": 16}, device="cuda", dtype="bfloat16", torch="x", threads=1
    )
    for T, k in ((8192, 1.0), (32768, 4.0)):
        res.rows += [
            WindowRow(
                T, "sdpa-dense", fwd_ms=18.4 * k, fwd_bwd_ms=60.0 * k, fwd_peak_mib=2400.0, fwd_bwd_peak_mib=2400.0
            ),
            WindowRow(T, "flex", fwd_ms=0.3 * k, fwd_bwd_ms=1.6 * k, fwd_peak_mib=100.0, fwd_bwd_peak_mib=260.0),
            WindowRow(T, "attnlab-dense", fwd_ms=19.0 * k, fwd_bwd_ms=64.0 * k),
            WindowRow(T, "attnlab-auto", fwd_ms=0.75 * k, fwd_bwd_ms=3.2 * k),
            WindowRow(T, "projections", fwd_ms=0.4 * k),
        ]
    lines = window_goals(res).splitlines()
    assert (
        "T=32768 (cuda) the module within 1.3x of the bare flex kernel: attnlab-auto / flex 2.50x, NOT MET; "
        "without its projections 1.17x, met"
    ) in lines
    assert (
        "T=32768 (cuda) fwd+bwd >= 30x dense-mask SDPA: module (attnlab-auto vs attnlab-dense) 20.0x, NOT MET; "
        "kernel (flex vs sdpa-dense) 37.5x, met"
    ) in lines
    cpu = WindowResult(config=res.config, device="cpu", dtype="float32", torch="x", threads=2, rows=res.rows[:5])
    assert "T=32768" not in window_goals(cpu)  # a run without that length states no GPU goal
