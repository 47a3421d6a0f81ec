"""The trace reports the shapes that really flowed, row by row, on odd sizes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention
from attnlab.cli import main
from attnlab.tools.trace import trace

B, T, E, H, TK = 3, 7, 48, 6, 5  # odd sizes, so that no two axes can be confused
D = E // H


def _rows(calls):
    return [(r.stage, r.shape, r.memory) for r in calls[0].rows]


def test_math_cross_attention_every_row():
    mha = MultiHeadAttention(E, H, backend="math")
    with trace(mha) as calls:
        mha(torch.randn(B, T, E), torch.randn(B, TK, E))
    assert _rows(calls) == [
        ("input", [B, T, E], "input"),
        ("input", [B, TK, E], "input"),
        ("Q projection", [B, T, E], "new"),
        ("K projection", [B, TK, E], "new"),
        ("V projection", [B, TK, E], "new"),
        ("split heads (view)", [B, T, H, D], "view"),
        ("heads to dim 1 (transpose)", [B, H, T, D], "view"),
        ("split heads (view)", [B, TK, H, D], "view"),
        ("heads to dim 1 (transpose)", [B, H, TK, D], "view"),
        ("split heads (view)", [B, TK, H, D], "view"),
        ("heads to dim 1 (transpose)", [B, H, TK, D], "view"),
        ("K^T (transpose)", [B, H, D, TK], "view"),
        ("scores = Q K^T", [B, H, T, TK], "new"),
        (f"scale by 1/sqrt(d) = {1 / D**0.5:.4g}", [B, H, T, TK], "new"),
        ("softmax over keys", [B, H, T, TK], "new"),
        ("weighted sum = weights V", [B, H, T, D], "new"),
        ("heads back (transpose)", [B, T, H, D], "view"),
        ("contiguous (copy for view)", [B, T, H, D], "new"),
        ("merge heads (view)", [B, T, E], "view"),
        ("output projection", [B, T, E], "new"),
    ]
    assert calls[0].backend == "math"


def test_self_attention_gqa_causal_padding_dropout():
    mha = MultiHeadAttention(E, H, num_kv_heads=2, dropout=0.2, backend="math").train()
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -2:] = True
    with trace(mha) as calls:
        mha(torch.randn(B, T, E), key_padding_mask=pad, is_causal=True)
    rows = _rows(calls)
    kv = 2 * D
    assert rows[1:4] == [
        ("Q projection", [B, T, E], "new"),
        ("K projection", [B, T, kv], "new"),
        ("V projection", [B, T, kv], "new"),
    ]  # seed 000's three Linears
    stages = [r[0] for r in rows]
    assert stages.count("zero padded keys/values (no NaN via 0 weights)") == 2
    assert stages.count("GQA: repeat K/V heads") == 2
    assert ("GQA: repeat K/V heads", [B, H, T, D], "new") in rows
    order = [
        "scores = Q K^T",
        "mask (before softmax)",
        "softmax over keys",
        "zero fully-masked rows",
        "dropout on weights",
        "weighted sum = weights V",
    ]
    assert [s for s in stages if s in order] == order  # masking happens before softmax


def test_sdpa_is_one_fused_row_and_merge_needs_no_copy():
    mha = MultiHeadAttention(E, H, backend="sdpa")
    with trace(mha) as calls:
        mha(torch.randn(B, T, E), is_causal=True)
    rows = _rows(calls)
    assert ("fused SDPA (scores..weighted sum)", [B, H, T, D], "new") in rows
    assert not any(r[0].startswith("scores") or r[0].startswith("softmax") for r in rows)
    assert calls[0].backend == "sdpa"


def test_trace_inside_a_user_model_records_each_call():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(E, H, backend="math")
            self.cross = MultiHeadAttention(E, H, backend="math")

        def forward(self, x, ctx):
            return self.cross(self.attn(x, is_causal=True), ctx)

    model = Block()
    with trace(model) as calls:
        model(torch.randn(B, T, E), torch.randn(B, TK, E))
    assert [c.module for c in calls] == ["attn", "cross"]
    assert calls[1].rows[-1].shape == [B, T, E]
    with pytest.raises(ValueError, match="trace\\(model\\) found no attnlab.MultiHeadAttention inside Linear"):
        with trace(nn.Linear(2, 2)):
            pass


def test_trace_leaves_nothing_installed_after_an_error():
    mha = MultiHeadAttention(E, H)
    with pytest.raises(ValueError):
        with trace(mha):
            mha(torch.randn(B, T, E + 1))
    assert not mha._forward_pre_hooks and not mha._forward_hooks
    assert torch.overrides._get_current_function_mode_stack() == []


def test_cli_trace_defaults_to_seed_000(capsys):
    assert main(["trace"]) == 0
    out = capsys.readouterr().out
    for shape in ("[2, 10, 64]", "[2, 10, 8, 8]", "[2, 8, 10, 8]", "[2, 8, 10, 10]", "[2, 10, 64]"):
        assert shape in out


def test_cli_trace_json_with_odd_sizes(capsys):
    args = [
        "trace",
        "--batch-size",
        "3",
        "--seq-len",
        "7",
        "--embed-dim",
        "48",
        "--num-heads",
        "6",
        "--context-len",
        "5",
        "--num-kv-heads",
        "3",
        "--pad",
        "1",
        "--json",
    ]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["stage"]: r for r in data[0]["rows"]}
    assert rows["scores = Q K^T"]["shape"] == [3, 6, 7, 5]
    assert rows["GQA: repeat K/V heads"]["shape"] == [3, 6, 5, 8]
    assert rows["mask (before softmax)"]["axes"].startswith("scores[b][h][i][j]")


def test_cli_trace_reports_bad_sizes_in_one_line(capsys):
    assert main(["trace", "--seq-len", "7", "--context-len", "5", "--causal"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: is_causal=True needs T_q <= T_k, got T_q=7 queries and T_k=5 keys")
    assert "Traceback" not in err


def test_low_precision_math_shows_the_float32_accumulation():
    mha = MultiHeadAttention(E, H, backend="math", dtype=torch.bfloat16)
    with trace(mha) as calls:
        mha(torch.randn(B, T, E, dtype=torch.bfloat16))
    stages = [r.stage for r in calls[0].rows]
    assert "to float32 (accumulate)" in stages and "back to bfloat16" in stages
    assert stages.index("to float32 (accumulate)") < stages.index("scores = Q K^T") < stages.index("back to bfloat16")


def _widths(text: str) -> list[int]:
    return [len(line) for line in text.splitlines()]


def test_cli_trace_fits_80_columns(capsys, monkeypatch):
    """At 80 columns each stage takes two lines: stage, shape, memory; then the operation with its axes."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["trace", "--num-kv-heads", "2", "--pad", "2", "--causal", "--dropout", "0.1"]) == 0
    out = capsys.readouterr().out
    assert max(_widths(out)) <= 80
    lines = out.splitlines()
    assert lines[1].split() == ["#", "stage", "shape", "memory"] and lines[2].strip() == "operation  # axes"
    i = next(i for i, ln in enumerate(lines) if ln.startswith("5   split heads (view)"))
    assert lines[i].split()[-1] == "view" and "[2, 10, 8, 8]" in lines[i]
    assert lines[i + 1] == "    q = view(q, 2, 10, 8, 8)  # (b, t, h, d): features cut into h heads of d"
    # an operation and its axes that do not fit one line: the axes comment goes on the next
    i = next(i for i, ln in enumerate(lines) if "GQA: repeat K/V heads" in ln)
    assert lines[i + 1 : i + 3] == [
        "    k = repeat_interleave(k, 4, dim=1)",
        "    # (b, h, t, d): K/V head g shared by its query group",
    ]


def test_cli_trace_wide_terminal_and_json_keep_every_column(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["trace"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["#", "stage", "operation", "shape", "axes", "memory"]
    assert len(lines) == 3 + 19  # title, header, rule, one line per stage
    monkeypatch.setenv("COLUMNS", "40")
    assert main(["trace", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)[0]["rows"]
    assert rows[4] == {
        "stage": "split heads (view)",
        "operation": "q = view(q, 2, 10, 8, 8)",
        "shape": [2, 10, 8, 8],
        "axes": "(b, t, h, d): features cut into h heads of d",
        "memory": "view",
    }
