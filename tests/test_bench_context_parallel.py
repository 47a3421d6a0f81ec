"""``torchrun --nproc_per_node N -m attnlab bench --context-parallel N``: per-rank figures against arithmetic.

The expected pair counts, balances and byte counts below are written out from the layouts' and the
methods' definitions, not taken from ``bench/context_parallel.py``'s own formulas, so that a wrong
formula there (or a wrong count in ``attnlab.distributed``) fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from attnlab.bench.attention import BenchConfig
from attnlab.bench.context_parallel import plan_cp
from attnlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
E, H = 32, 4  # tiny: the point is the counts, not the speed
D = E // H
FP32 = 4


def _launch(tmp_path: Path, n: int, *flags: str) -> tuple[dict[str, Any], str]:
    """Run the benchmark over ``n`` CPU processes; its JSON and stdout."""
    out = tmp_path / f"cp{n}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n)]
    cmd += ["-m", "attnlab", "bench", "--context-parallel", str(n), "--embed-dim", str(E), "--num-heads", str(H)]
    cmd += ["--repeats", "2", "--warmup", "0", "--device", "cpu", "--out-dir", str(out), *flags]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "bench_context_parallel.json").read_text()), done.stdout


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return _launch(tmp_path_factory.mktemp("bench"), 2, "--lengths", "16", "32")


def _row(res: dict[str, Any], T: int, method: str, layout: str = "") -> dict[str, Any]:
    [row] = [r for r in res["rows"] if r["T"] == T and r["method"] == method and r["layout"] == layout]
    return row


def _balance(pairs: list[int]) -> Fraction:
    """Max over mean, exactly."""
    return Fraction(max(pairs) * len(pairs), sum(pairs))


def _causal_pairs(positions: range | list[int]) -> int:
    """Per head: a query at position p sees keys 0..p."""
    return sum(p + 1 for p in positions)


def test_zigzag_is_exactly_balanced_and_contiguous_is_not(two):
    res, _ = two
    n = res["world"]
    for T in (16, 32):
        zig = _row(res, T, "ring", "zigzag")["pairs"]
        c = T // (2 * n)  # zigzag: rank r holds chunks r and 2N-1-r
        assert zig == [
            H * _causal_pairs([*range(r * c, (r + 1) * c), *range((2 * n - 1 - r) * c, (2 * n - r) * c)])
            for r in range(n)
        ]
        assert _balance(zig) == 1
        con = _row(res, T, "ring", "contiguous")["pairs"]
        c = T // n
        assert con == [H * _causal_pairs(range(r * c, (r + 1) * c)) for r in range(n)]
        # the last rank's queries see every key: (2N-1)/N = 3/2 less the diagonals' share, 1/(2(T+1)) at N=2
        assert _balance(con) == Fraction(3, 2) - Fraction(1, 2 * (T + 1))
        assert _row(res, T, "ring", "contiguous")["balance"] == pytest.approx(float(_balance(con)), rel=1e-12)
        for layout in ("zigzag", "contiguous"):  # alltoall: every rank runs the whole sequence for H/N heads
            a2a = _row(res, T, "alltoall", layout)["pairs"]
            assert a2a == [T * (T + 1) // 2 * H // n] * n and _balance(a2a) == 1
        assert sum(zig) == sum(con) == T * (T + 1) // 2 * H == _row(res, T, "single")["pairs"][0]


def test_ring_bytes_equal_the_hops(two):
    res, _ = two
    n = res["world"]
    for T in (16, 32):
        row = _row(res, T, "ring", "zigzag")
        B, L = row["B"], T // n
        kv = 2 * B * H * L * D * FP32  # this rank's K and V
        assert row["bytes_fwd"] == [(n - 1) * kv] * n  # N-1 hops
        assert row["bytes_bwd"] == [(n - 1) * kv + n * kv] * n  # K/V again, and the fp32 dK/dV home: N hops
        assert (row["bytes_fwd_formula"], row["bytes_bwd_formula"]) == ((n - 1) * kv, (2 * n - 1) * kv)
        assert _row(res, T, "ring", "contiguous")["bytes_fwd"] == row["bytes_fwd"]


def test_alltoall_forward_bytes_equal_the_shares(two):
    res, _ = two
    n = res["world"]
    for T in (16, 32):
        row = _row(res, T, "alltoall", "zigzag")
        B, L = row["B"], T // n
        share = B * L * D * (H + H + H + H) * FP32 * (n - 1) // n  # Q, K, V, context: (N-1)/N leaves the rank
        assert row["bytes_fwd"] == [share] * n and row["bytes_fwd_formula"] == share
        assert row["bytes_bwd_formula"] == share


def test_alltoall_backward_bytes_equal_the_shares(two):
    res, _ = two
    n = res["world"]
    for T in (16, 32):
        row = _row(res, T, "alltoall", "contiguous")
        share = row["B"] * (T // n) * D * 4 * H * FP32 * (n - 1) // n  # the four gradients, the same way back
        assert row["bytes_bwd"] == [share] * n


def test_single_process_row_and_the_report(two):
    res, stdout = two
    assert res["world"] == 2 and res["torch"] and res["cpu"] and res["threads_per_rank"] == [1, 1]
    assert res["config"]["embed_dim"] == E and res["config"]["lengths"] == [16, 32]
    runs = {(r["method"], r["layout"]) for r in res["rows"]}
    assert runs == {("single", ""), *((m, lay) for m in ("ring", "alltoall") for lay in ("zigzag", "contiguous"))}
    for r in res["rows"]:
        assert len(r["fwd_bwd_ms"]) == 2 and all(t > 0 for t in r["fwd_bwd_ms"])
        assert all(p is not None and p >= 0 for p in r["peak_mib"])
        assert r["max_abs_err"] < 1e-5  # the gathered output is the single-process one
    assert _row(res, 32, "single")["L"] == 32 and _row(res, 32, "ring", "zigzag")["L"] == 16
    assert stdout.count("wrote (") == 1  # rank 0 alone reports and writes
    md = (Path(res["config"]["out_dir"]) / "bench_context_parallel.md").read_text()
    assert "| 32 | 1 | 32 | single | 0 |" in md and "| 32 | 1 | 16 | ring/zigzag | 1 |" in md


@pytest.mark.slow
def test_four_ranks(tmp_path):
    res, _ = _launch(tmp_path, 4, "--lengths", "32", "--cp-methods", "ring", "--no-memory")
    n, T = 4, 32
    zig, con = _row(res, T, "ring", "zigzag"), _row(res, T, "ring", "contiguous")
    assert _balance(zig["pairs"]) == 1
    c = T // n
    # rank r: r full (c, c) blocks below the diagonal and one causal diagonal block
    assert _balance(con["pairs"]) == _balance([H * (r * c * c + c * (c + 1) // 2) for r in range(n)])
    kv = 2 * zig["B"] * H * (T // n) * D * FP32
    assert zig["bytes_fwd"] == [3 * kv] * n and zig["bytes_bwd"] == [(3 + 4) * kv] * n
    assert all(p is None for p in zig["peak_mib"])


# -- refused before any work: no torchrun needed -----------------------------------------------
def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and captured.err.count("\n") == 1, captured
    return captured.err.removeprefix("attnlab: error: ")


@pytest.mark.parametrize(
    ("world", "flags", "message"),
    [
        (None, [], "--context-parallel 2 needs 2 processes, one per rank, and this one was started alone"),
        ("3", [], "--context-parallel got 2 but this run has WORLD_SIZE=3 processes"),
        ("2", ["--device", "mps"], "--device 'mps' with --context-parallel"),
        ("2", ["--lengths", "6"], "--lengths got T=6, which does not split into the 4 whole chunks"),
        (
            "2",
            ["--embed-dim", "48", "--num-heads", "3", "--cp-methods", "alltoall"],
            "pass --num-heads a multiple of 2",
        ),
        ("2", ["--cp-layouts", "striped"], "--cp-layouts got ['striped'], expected one or more of zigzag"),
        ("2", ["--variant", "window"], "--variant window with --context-parallel"),
    ],
)
def test_flag_errors(capsys, monkeypatch, tmp_path, world, flags, message):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    argv = ["bench", "--context-parallel", "2", "--lengths", "16", "--out-dir", str(tmp_path), *flags]
    assert message in _error(capsys, argv)


def test_too_few_ranks_and_the_fix(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    err = _error(capsys, ["bench", "--context-parallel", "2", "--out-dir", str(tmp_path)])
    assert "torchrun --nproc-per-node 2 -m attnlab bench --context-parallel 2" in err
    assert "--context-parallel" in _error(capsys, ["bench", "--context-parallel", "0", "--out-dir", str(tmp_path)])


def test_alltoall_is_skipped_with_the_reason_when_ring_runs_too(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = BenchConfig(embed_dim=48, num_heads=3, lengths=(16,), tokens=16, out_dir=tmp_path, context_parallel=2)
    plan = plan_cp(cfg)
    assert plan.combos == (("ring", "zigzag"), ("ring", "contiguous"))
    assert "--num-heads 3 is not divisible by 2" in plan.skipped["alltoall"]
