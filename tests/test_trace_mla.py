"""``attnlab trace --mla``: every printed shape is a real tensor's, on both paths; the cache table is the caches'."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnlab.cli import main
from attnlab.core.kv_cache import KVCache
from attnlab.core.mla import MultiHeadLatentAttention
from attnlab.core.mla_cache import MLACache
from attnlab.tools.trace_mla import V3, cache_per_token, trace_mla

# odd sizes, so that no two axes can be confused: B, T, E, H, Q, C, R, N, Dv
B, T, E, H, Q, C, R, N, DV = 2, 3, 40, 5, 12, 14, 6, 4, 7
SIZES = ["--batch-size", "2", "--seq-len", "3", "--hidden-size", "40", "--num-heads", "5", "--kv-lora-rank", "14"]
SIZES += ["--qk-rope-head-dim", "6", "--qk-nope-head-dim", "4", "--v-head-dim", "7"]


def _mla(q_lora_rank: int | None) -> MultiHeadLatentAttention:
    torch.manual_seed(0)
    return MultiHeadLatentAttention(
        E, H, kv_lora_rank=C, qk_nope_head_dim=N, qk_rope_head_dim=R, v_head_dim=DV, q_lora_rank=q_lora_rank,
        backend="math",
    )  # fmt: skip


def _shapes(trace) -> dict[str, list]:
    return {r.stage: r.shape for r in trace.rows}


@pytest.mark.parametrize("q_lora_rank", [None, Q])
def test_each_stage_has_the_shape_of_the_module_s_own_tensor(q_lora_rank):
    mla = _mla(q_lora_rank)
    x = torch.randn(B, T, E)
    (naive, absorbed), outputs = trace_mla(mla, x)
    torch.testing.assert_close(outputs["naive"], outputs["absorbed"], rtol=1e-4, atol=1e-5)  # the same attention
    # the module's own pieces, called here one by one
    q_nope, q_rot = mla._queries(x)
    rows = mla.kv_a_proj_with_mqa(x)  # (B, T, C+R)
    kv_b = mla.kv_b_proj(rows[..., :C])  # (B, S, H*(N+Dv))
    w_uk = mla.kv_b_proj.weight.view(H, N + DV, C)[:, :N]  # (H, N, C)
    q_latent = q_nope @ w_uk  # (B, H, T, C)
    for trace in (naive, absorbed):
        got = _shapes(trace)
        assert got["q_C | q_R per head (split)"] == [list(q_nope.shape), list(q_rot.shape)]
        assert got["kv_a_proj_with_mqa"] == list(rows.shape) == [B, T, C + R]
        assert got["cache rows [c_KV | k_R]"] == list(rows.shape)
        assert got["output projection o_proj"] == [B, T, E]
        assert ("query latent: q_a_proj" in got) == (q_lora_rank is not None)
        if q_lora_rank is not None:
            assert got["query latent: q_a_proj"] == list(mla.q_a_proj(x).shape) == [B, T, Q]
    n = _shapes(naive)
    assert n["naive: kv_b_proj expands latents"] == list(kv_b.shape) == [B, T, H * (N + DV)]
    assert n["naive: k_C | v per head (split)"] == [[B, H, T, N], [B, H, T, DV]]
    assert n["naive: keys [k_C | k_R]"] == [B, H, T, N + R]
    assert n["scores = Q K^T"] == [B, H, T, T] and n["context = weights v"] == [B, H, T, DV]
    a = _shapes(absorbed)
    assert a["absorbed: q_C W_UK (W_UK folded)"] == list(q_latent.shape) == [B, H, T, C]
    assert a["query is C+R wide: [q_C W_UK | q_R]"] == [B, H, T, C + R]
    assert a["absorbed: H*T query rows (MQA)"] == [B, 1, H * T, C + R]
    assert a["scores = Q K^T"] == [B, 1, H * T, T]
    assert a["latent context = weights c_KV"] == [B, 1, H * T, C]
    assert a["absorbed: latent context per head"] == [B, H, T, C]
    assert a["absorbed: W_UV after attention"] == [B, H, T, DV]
    assert "kv_b_proj" not in " ".join(a)  # the absorbed path never expands a latent
    assert mla.path == "auto"  # put back


def _row(lines: list[str], stage: str) -> tuple[list[int], str]:
    """The shape printed on ``stage``'s line (80 columns: stage, shape, memory) and the two lines after it."""
    i = next(i for i, line in enumerate(lines) if re.match(rf"\d+\s+{re.escape(stage)}  ", line))
    shape = re.search(r"\[[\d, ]+\]", lines[i][len(stage) :])
    assert shape is not None, lines[i]
    return json.loads(shape.group()), " ".join(lines[i + 1 : i + 3])


@pytest.mark.parametrize("q_lora_rank", [["--q-lora-rank", "12"], ["--q-lora-rank", "None"]])
@pytest.mark.parametrize("path", ["naive", "absorbed", "both"])
def test_cli_prints_the_real_shapes_at_80_columns(capsys, monkeypatch, path, q_lora_rank):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["trace", "--mla", "--path", path, *SIZES, *q_lora_rank]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80
    assert out.count("MultiHeadLatentAttention, path=") == (2 if path == "both" else 1)
    assert _row(lines, "kv_a_proj_with_mqa")[0] == [B, T, C + R]
    assert ("query latent: q_a_proj" in out) == (q_lora_rank[1] == "12")
    if path != "naive":
        shape, op = _row(lines, "query is C+R wide: [q_C W_UK | q_R]")
        assert shape == [B, H, T, C + R]
        assert f"# (B, H, T, C+R): C+R = {C + R} here, 576 at V3's sizes" in op
        assert _row(lines, "absorbed: H*T query rows (MQA)")[0] == [B, 1, H * T, C + R]
    if path != "absorbed":
        assert _row(lines, "naive: keys [k_C | k_R]")[0] == [B, H, T, N + R]
    if path == "both":
        assert re.search(r"naive and absorbed give the same output: max \|difference\| = \S+", out)


def test_cache_rows_are_the_cache_objects_bytes_per_token():
    for sizes, g, dtype in (((H, DV, C, R), 1, torch.float32), ((128, 128, 512, 64), 8, torch.bfloat16)):
        heads, d, c, r = sizes
        rows = {row.kind: row for row in cache_per_token(num_heads=heads, num_kv_heads=g, head_dim=d, kv_lora_rank=c, qk_rope_head_dim=r, dtype=dtype)}  # fmt: skip
        size = torch.tensor([], dtype=dtype).element_size()
        assert rows["MHA"].bytes == KVCache(1, 4, heads, d, dtype=dtype).bytes_per_token == 2 * heads * d * size
        assert rows["GQA"].bytes == KVCache(1, 4, g, d, dtype=dtype).bytes_per_token
        assert rows["MQA"].bytes == KVCache(1, 4, 1, d, dtype=dtype).bytes_per_token
        assert rows["MLA"].bytes == MLACache(1, 4, c, r, dtype=dtype).bytes_per_token
        for row in rows.values():  # the formula printed beside each agrees with the object
            assert row.values * size == row.bytes
    v3 = {row.kind: row.values for row in cache_per_token(num_heads=128, num_kv_heads=8, head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)}  # fmt: skip
    assert v3 == {"MHA": 32768, "GQA": 2048, "MQA": 256, "MLA": 576}  # DeepSeek-V2's table 1 at V3's sizes
    assert V3["kv_lora_rank"] + V3["qk_rope_head_dim"] == 576


def test_cli_cache_table_and_auto_paths(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["trace", "--mla", *SIZES, "--num-kv-heads", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = {
        line.split()[0]: line.split() for line in lines if line.split()[:1] in (["MHA"], ["GQA"], ["MQA"], ["MLA"])
    }
    mla = MLACache.for_module(_mla(Q), 1, 1)
    assert table["MLA"][1:4] == ["C+R", str(C + R), str(mla.bytes_per_token)]
    assert table["MLA"][5:7] == ["576", str(MLACache(1, 1, 512, 64, dtype=torch.bfloat16).bytes_per_token)]
    assert table["MHA"][2:4] == [str(2 * H * DV), str(KVCache(1, 1, H, DV).bytes_per_token)]
    assert table["GQA"][2] == str(2 * 5 * DV)  # --num-kv-heads is the GQA row's G
    auto = " ".join(lines[lines.index("path='auto' at these sizes (MultiHeadLatentAttention.choose_path):") :])
    mla_auto = _mla(Q)
    assert " ".join(mla_auto.choose_path(1, T)[1].split()) in " ".join(auto.split())
    assert " ".join(mla_auto.choose_path(T, T)[1].split()) in " ".join(auto.split())


def test_cli_json_has_both_traces_and_the_cache(capsys):
    assert main(["trace", "--mla", *SIZES, "--causal", "--pad", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [t["module"] for t in data["traces"]] == ["MultiHeadLatentAttention, path='naive'", "MultiHeadLatentAttention, path='absorbed'"]  # fmt: skip
    stages = [r["stage"] for r in data["traces"][1]["rows"]]
    assert stages.index("mask (before softmax)") < stages.index("softmax over keys")
    assert "zero padded rows (no NaN)" in stages
    assert data["max_abs_difference"] < 1e-5
    assert [r["values"] for r in data["cache_per_token"]["deepseek_v3"]] == [32768, 2048, 256, 576]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--mla", "--qk-rope-head-dim", "7"],
            "--qk-rope-head-dim 7 is odd; rotary embeddings rotate channel pairs, so it must be even "
            "(DeepSeek-V3 uses 64): choose 6 or 8.",
        ),
        (
            ["--kv-lora-rank", "32"],
            "--kv-lora-rank 32 sizes multi-head latent attention, and no --mla was given; add --mla.",
        ),
        (["--path", "naive"], "--path naive sizes multi-head latent attention, and no --mla was given; add --mla."),
        (["--mla", "--kv-lora-rank", "0"], "--kv-lora-rank must be an integer >= 1, got 0; DeepSeek-V3 uses 512."),
        (
            ["--mla", "--embed-dim", "32"],
            "--embed-dim 32 is MultiHeadAttention's width; with --mla pass --hidden-size 32 (DeepSeek's name for it).",
        ),
        (
            ["--mla", "--window", "4"],
            "--window 4 configures attnlab's MultiHeadAttention, and --mla traces MultiHeadLatentAttention, "
            "which has no such option; drop it.",
        ),
        (
            ["--mla", "--num-kv-heads", "3"],
            "--num-kv-heads 3 does not divide --num-heads 8; with --mla it is G of the cache table's GQA row, each "
            "of G key/value heads serving H/G query heads: pass a divisor of 8.",
        ),
    ],
)
def test_cli_bad_mla_flags_are_one_usage_line(capsys, flags, says):
    assert main(["trace", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"attnlab: error: {says}\n"
