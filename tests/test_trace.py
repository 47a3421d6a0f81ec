"""The trace reports the shapes that really flowed, row by row, on odd sizes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention
from attnlab.check.recipe import STAGES
from attnlab.cli import main
from attnlab.tools.trace import trace, trace_module

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


# -- --target: any hand-written module, each op matched with the reference's stages ----------------------

CORPUS = "tests/mistake_corpus"
TINY = ["--batch-size", "2", "--seq-len", "3", "--embed-dim", "16", "--num-heads", "4"]  # D = 4


def _target(capsys, name: str, *flags: str) -> tuple[int, dict]:
    code = main(["trace", "--target", f"{CORPUS}/{name}.py:MultiHeadAttention", "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def _by_stage(rows: list[dict]) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for r in rows:
        if r["stage"]:
            out.setdefault(r["stage"], []).append((r["func"], r["shape"], r["memory"]))
    return out


@pytest.mark.parametrize("name", ["seed002_correct", "seed000_correct"])
def test_target_correct_module_reproduces_every_stage_with_seed_000_shapes(capsys, name):
    code, data = _target(capsys, name)
    assert code == 0 and data["departure"] is None and data["error"] is None
    assert data["matched"] == [s for s in STAGES if s != "masked"]  # no mask: masked equals scaled
    assert data["inputs"] == {"x": [2, 10, 64]}
    heads = [("view", [2, 10, 8, 8], "view"), ("transpose", [2, 8, 10, 8], "view")]
    assert _by_stage(data["rows"]) == {
        "q": [("linear", [2, 10, 64], "new")],
        "k": [("linear", [2, 10, 64], "new")],
        "v": [("linear", [2, 10, 64], "new")],
        "q_heads": heads,
        "k_heads": heads,
        "v_heads": heads,
        "scores": [("matmul", [2, 8, 10, 10], "new")],
        "scaled": [("div", [2, 8, 10, 10], "new")],
        "weights": [("softmax", [2, 8, 10, 10], "new")],
        "context": [
            ("matmul", [2, 8, 10, 8], "new"),
            ("transpose", [2, 10, 8, 8], "view"),
            ("contiguous", [2, 10, 8, 8], "new"),  # the copy that lets the merge be a view
        ],
        "merged": [("view", [2, 10, 64], "view")],
        "out": [("linear", [2, 10, 64], "new")],
    }
    split = next(r for r in data["rows"] if r["func"] == "view" and r["stage"] == "q_heads")
    assert split["operation"] == "q = view(q, 2, 10, 8, 8)" or split["operation"] == "q = view(q, 2, -1, 8, 8)"
    assert split["reference_shape"] == [2, 8, 10, 8]  # the same values, read (B, T, H, D) before the transpose
    kT = next(r for r in data["rows"] if r["stage"] is None)
    assert kT["operation"] == f"t{kT['index']} = transpose(k, -2, -1)"
    assert data["rows"][-1]["operation"] in (
        "out = linear(merged, out_proj.weight, out_proj.bias)",
        "out = linear(merged, w_o.weight, w_o.bias)",
    )


def test_target_seed000_is_called_in_its_own_form(capsys):
    _, data = _target(capsys, "seed000_correct")
    assert data["call"] == "forward(x_query, x_context, mask)"
    assert data["mask"].startswith("bool, True = may attend")


@pytest.mark.parametrize(
    ("name", "stage", "func"),
    [
        ("seed002_softmax_query_axis", "weights", "softmax"),
        ("seed000_softmax_query_axis", "weights", "softmax"),
        ("seed000_merge_without_transpose", "merged", "view"),
        ("seed002_scale_embed_dim", "scaled", "mul"),  # times 1/sqrt(E) where 1/sqrt(D) belongs
        ("seed002_split_without_transpose", "q_heads", "view"),
        ("seed000_split_without_transpose", "q_heads", "view"),
    ],
)
def test_target_first_departure_is_the_mistaken_stage(capsys, name, stage, func):
    code, data = _target(capsys, name)
    assert code == 0 and data["error"] is None
    dep = data["departure"]
    assert dep["stage"] == stage and dep["reference_shape"] == data["reference"][stage]
    assert stage not in data["matched"]
    before = [s for s in STAGES[: STAGES.index(stage)] if s != "masked"]  # no mask: masked equals scaled
    assert [s for s in data["matched"] if s in before] == before  # every stage up to it reproduced
    row = data["rows"][dep["op"] - 1]
    assert row["stage"] is None and row["shape"] == dep["op_shape"]
    if func is not None:
        assert row["func"] == dep["op_func"] == func


def test_target_softmax_query_axis_marks_the_departure_under_its_op(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["trace", "--target", f"{CORPUS}/seed002_softmax_query_axis.py:MultiHeadAttention"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(">> first departure"))
    assert lines[i - 1] == "    t13 = softmax(scores, dim=-2, dtype=torch.float32)"
    assert " ".join(ln.strip() for ln in lines[i : i + 3]) == (
        ">> first departure: the reference's weights [2, 8, 10, 10] is never produced; "
        "op #13 (softmax, shape [2, 8, 10, 10]) is where it should be; each column sums to 1, "
        "so softmax ran over the query axis"
    )
    assert lines[-1].startswith("reference stages reproduced") or lines[-2].startswith("reference stages reproduced")


def test_target_that_raises_prints_the_ops_before_it_then_the_error(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    spec = f"{CORPUS}/seed002_view_not_contiguous.py:MultiHeadAttention"
    assert main(["trace", "--target", spec]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    i = next(i for i, ln in enumerate(lines) if ln.startswith(">> raised RuntimeError: view size is not compatible"))
    assert lines[i - 1] == "    context = transpose(context, 1, 2)"  # the last op that ran: .view() failed on it
    assert lines[i - 2].split()[:3] == ["15", "[2,", "10,"] and "view" in lines[i - 2]
    rest = lines[i + 1 :]
    assert [ln for ln in rest if not ln.startswith("   ")] == []  # the error is the last row
    with open(spec.split(":")[0]) as f:
        line_no = next(n for n, src in enumerate(f, 1) if src.strip().startswith("out = out.transpose(1, 2).view("))
    assert f"   at seed002_view_not_contiguous.py:{line_no}:" in rest
    assert "      out = out.transpose(1, 2).view(B, T_q, self.embed_dim)" in rest
    assert main(["trace", "--target", spec, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["error"]["type"] == "RuntimeError" and data["departure"] is None
    assert len(data["rows"]) == 15 and data["matched"][-1] == "context"


def test_target_cross_attention_causal_padding_gqa(capsys):
    flags = [*TINY, "--context-len", "5", "--causal", "--pad", "1", "--num-kv-heads", "2"]
    code, data = _target(capsys, "gqa_correct", *flags)
    assert code == 0 and data["departure"] is None and data["error"] is None
    assert data["matched"] == list(STAGES)  # the masks apply: the masked scores are a stage of their own
    assert data["inputs"] == {"query": [2, 3, 16], "context": [2, 5, 16]}
    assert data["masks"] == ["key_padding_mask [2, 5]", "is_causal"]
    by = _by_stage(data["rows"])
    assert by["k"] == [("linear", [2, 5, 8], "new")]  # G = 2 K/V heads of D = 4
    assert by["k_heads"][-1] == ("transpose", [2, 2, 5, 4], "view")
    assert by["scores"] == [("matmul", [2, 4, 3, 5], "new")]
    assert by["masked"] == [("masked_fill", [2, 4, 3, 5], "new")]
    assert by["out"] == [("linear", [2, 3, 16], "new")]


def test_target_self_attention_masks_through_attn_mask(capsys):
    code, data = _target(capsys, "seed002_correct", *TINY, "--causal", "--pad", "1")
    assert code == 0 and data["departure"] is None and "masked" in data["matched"]


@pytest.mark.parametrize("name", ["gqa_padding_ignored", "gqa_causal_sees_next"])
def test_target_mask_mistakes_depart_at_the_masked_scores(capsys, name):
    code, data = _target(capsys, name, *TINY, "--context-len", "5", "--causal", "--pad", "1", "--num-kv-heads", "2")
    assert code == 0 and data["departure"]["stage"] == "masked"
    assert data["rows"][data["departure"]["op"] - 1]["func"] == "masked_fill"  # a value, not mask bookkeeping


def test_cli_trace_target_fits_80_columns_and_json_parses(capsys, monkeypatch):
    spec = f"{CORPUS}/seed002_correct.py:MultiHeadAttention"
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["trace", "--target", spec]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80
    assert lines[0] == spec
    h = lines.index("    operation")  # two lines per op: number, shape, memory, reference; then the operation
    assert lines[h - 1].split() == ["#", "shape", "memory", "reference"]
    i = lines.index("    q = view(q, 2, 10, 8, 8)")
    assert lines[i - 1].split() == ["2", "[2,", "10,", "8,", "8]", "view", "q_heads", "[2,", "8,", "10,", "8]"]
    verdict = " ".join(ln.strip() for ln in lines[lines.index(next(ln for ln in lines if ln.startswith("every "))) :])
    assert verdict.startswith("every reference stage was reproduced: q, k, v, q_heads"), verdict
    # traced again with the masks and the context its forward takes, where a mask or context mistake would show, and
    # with key and value apart, where V read from the key would show
    assert verdict.endswith(
        "traced again with key padding (the last 3 keys of the first sequence) and a separate context as key and "
        "value, and with the same masks in self-attention, and with the context as key and another tensor as value: "
        "every stage reproduced too"
    ), verdict
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["trace", "--target", spec]) == 0
    wide = capsys.readouterr().out.splitlines()
    assert wide[3].startswith("  weights: projections q_proj, k_proj, v_proj, out_proj"), wide[3]
    assert wide[5].split() == ["#", "operation", "shape", "memory", "reference"]
    assert len(wide) == 5 + 2 + 18 + 2  # title, header and rule, one line per op, the verdict (and the call added)
    assert main(["trace", "--target", spec, "--json", "--no-exercise"]) == 0
    assert json.loads(capsys.readouterr().out)["also"] == ""  # the one call only
    monkeypatch.setenv("COLUMNS", "40")
    assert main(["trace", "--target", spec, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"][0] == {
        "index": 1,
        "name": "q",
        "operation": "q = linear(x, q_proj.weight, q_proj.bias)",
        "func": "linear",
        "shape": [2, 10, 64],
        "dtype": "float32",
        "memory": "new",
        "stage": "q",
        "reference_shape": [2, 10, 64],
    }
    assert data["reference"]["weights"] == [2, 8, 10, 10]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--target", "missing.py:MultiHeadAttention"], "--target 'missing.py:MultiHeadAttention': there is no file"),
        (["--target", "torch"], "--target torch: trace shows attnlab's own MultiHeadAttention by default"),
        (["--target", f"{CORPUS}/seed002_correct.py:MultiHeadAttention", "--alibi"], "--alibi configures attnlab's"),
        (["--target", f"{CORPUS}/seed002_correct.py:MultiHeadAttention", "--num-kv-heads", "2"], "--num-kv-heads 2:"),
        (["--target", f"{CORPUS}/seed002_correct.py:MultiHeadAttention", "--model", "smollm2"], "--target '"),
    ],
)
def test_cli_trace_bad_target_is_one_line(capsys, flags, says):
    assert main(["trace", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"attnlab: error: {says}")


class _FusedSDPA(nn.Module):
    """nanoGPT's layout: one fused c_attn split in three, SDPA for scores..weighted sum."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.n_head = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def test_trace_module_fused_kernel_and_split_projection():
    torch.manual_seed(0)
    m = _FusedSDPA().eval()
    x = torch.randn(2, 3, 8)
    keep = torch.ones(3, 3, dtype=torch.bool).tril()
    t = trace_module(m, x, keep_mask=keep)
    assert [r.operation for r in t.rows[1:4]] == [f"{n} = split(t1, 8, dim=2)[{i}]" for i, n in enumerate("qkv")]
    assert [r.memory for r in t.rows[1:4]] == ["view"] * 3
    assert t.departure is None and t.error is None  # weights never leave SDPA, the context it returns is right
    assert "scaled_dot_product_attention" in {r.func for r in t.rows if r.stage == "context"}
    assert "not seen on their own: scores, scaled, masked, weights" in t.to_text()


def test_trace_module_keeps_the_ops_before_an_exception():
    class Broken(_FusedSDPA):
        def forward(self, x, mask=None):
            q = self.c_attn(x)
            raise ValueError(f"no heads for {list(q.shape)}")

    t = trace_module(Broken().eval(), torch.randn(1, 2, 8))
    assert [r.func for r in t.rows] == ["linear"] and t.error is not None
    assert (t.error.type, t.error.message) == ("ValueError", "no heads for [1, 2, 24]")
    assert "raise ValueError" in t.error.source
    assert t.to_text().splitlines()[-3] == ">> raised ValueError: no heads for [1, 2, 24]"


# -- the data flow places the stages: a scale folded into Q or K, masks the trace adds, a context it adds ---------


class _Whisper(nn.Module):
    """Whisper's layout: the scale split as d^-1/4 on Q and on K (``k_only``: on K alone, half the scale); masks
    filled with 0 where ``fill_zero`` (the blocked keys keep a share); K and V from x even when a context is
    given where ``kv_from_x``."""

    def __init__(self, dim: int = 16, heads: int = 4, k_only=False, fill_zero=False, kv_from_x=False) -> None:
        super().__init__()
        self.n_head, self.k_only, self.fill_zero, self.kv_from_x = heads, k_only, fill_zero, kv_from_x
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, context=None, mask=None):  # mask (B, 1, T, S) bool, True = may attend
        B, T, C = x.shape
        src = x if context is None or self.kv_from_x else context
        q, k, v = self.q_proj(x), self.k_proj(src), self.v_proj(src)
        q, k, v = (t.view(B, -1, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        scale = (C // self.n_head) ** -0.25
        qk = (q if self.k_only else q * scale) @ (k * scale).transpose(-2, -1)  # (B, H, T, S)
        if mask is not None:
            qk = qk.masked_fill(~mask, 0.0 if self.fill_zero else float("-inf"))
        w = qk.softmax(-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize(
    ("mistake", "stage", "func"),
    [
        ({}, None, None),
        ({"k_only": True}, "scaled", "matmul"),
        ({"fill_zero": True}, "masked", "masked_fill"),
        ({"kv_from_x": True}, "k", "linear"),
    ],
)
def test_trace_departs_where_the_data_flow_shows_the_mistake(mistake, stage, func):
    """The scale is judged by what reaches the softmax, wherever it was applied (no scores or scaled tensor of the
    reference's exists in Whisper's layout); the call is traced again with the masks and the context forward
    takes, so a fill of 0 departs at the masked scores and K from the wrong input at K."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    t = trace_module(_Whisper(**mistake).eval(), x)
    assert t.error is None
    if stage is None:
        assert t.departure is None, t.to_text()
        assert t.also.startswith("traced again with key padding (the last 2 keys of the first sequence)"), t.also
        return
    assert t.departure is not None and t.departure.stage == stage, t.to_text()
    assert t.rows[t.departure.op - 1].func == func
    if stage == "scaled":
        assert t.masks == [] and t.departure.hint == "your scores are 0.7071 x Q K^T; expected 0.5 x Q K^T"
    else:  # only the fuller call shows it
        assert t.masks == ["key_padding_mask [2, 6] (added)"] and t.inputs == {
            "query": [2, 6, 16],
            "context": [2, 6, 16],
        }
        assert "the trace adds key padding (the last 2 keys of the first sequence)" in t.mask
        assert trace_module(_Whisper(**mistake).eval(), x, exercise=False).departure is None


class _TimeFirstEinsum(nn.Module):
    """labml's layout: (T, B, E) in, heads (T, B, H, D), scores einsum'd to (T_q, T_k, B, H), softmax over
    ``dim`` (1: the keys; 0: the queries, the mistake)."""

    def __init__(self, dim: int = 16, heads: int = 4, dim_softmax: int = 1) -> None:
        super().__init__()
        self.heads, self.dim_softmax = heads, dim_softmax
        self.query, self.key, self.value, self.output = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):  # (T, B, E)
        T, B, C = x.shape
        q, k, v = (p(x).view(T, B, self.heads, -1) for p in (self.query, self.key, self.value))  # (T, B, H, D)
        scores = torch.einsum("ibhd,jbhd->ijbh", q, k) * (C // self.heads) ** -0.5  # (T_q, T_k, B, H)
        attn = scores.softmax(dim=self.dim_softmax)
        return self.output(torch.einsum("ijbh,jbhd->ibhd", attn, v).reshape(T, B, C))


@pytest.mark.parametrize(("dim_softmax", "departs"), [(1, False), (0, True)])
def test_trace_reads_an_einsum_layout_of_its_own(dim_softmax, departs):
    """(T_q, T_k, B, H) scores and weights are placed by the einsum that makes them: a correct module reproduces
    every stage, and a softmax over the queries departs at the weights, under the softmax, with the hint read in
    the reference's layout."""
    torch.manual_seed(0)
    t = trace_module(_TimeFirstEinsum(dim_softmax=dim_softmax).eval(), torch.randn(2, 6, 16))
    assert "(T, B, E) inputs" in t.call
    if not departs:
        assert t.departure is None and {"q_heads", "scaled", "weights", "context", "out"} <= set(t.matched), t.matched
        return
    assert t.departure is not None and t.departure.stage == "weights", t.to_text()
    assert t.rows[t.departure.op - 1].func == "softmax"
    assert t.departure.hint == "each column sums to 1, so softmax ran over the query axis"
