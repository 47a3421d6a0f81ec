"""``attnlab check``: attnlab passes, deliberately broken modules are caught, torch's MHA as found."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attnlab import MultiHeadAttention
from attnlab.check import CHECKS, ModuleAdapter, TorchMHAAdapter, run_checks
from attnlab.check.suite import SEQ_LEN
from attnlab.cli import main
from check_factories import TinyAttention


def attnlab_module(backend: str, **kw) -> MultiHeadAttention:
    m = MultiHeadAttention(16, 4, dropout=0.1, backend=backend, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return m


# `make test` keeps one diagonal of the grid (each backend once, each head layout once: about 10 s of CPU each);
# the other six pairs are slow (`make test-all`).
QUICK_PAIRS = {("math", 4), ("sdpa", 2), ("auto", 1)}


@pytest.mark.parametrize(
    ("backend", "num_kv_heads"),
    [
        pytest.param(
            backend, kv, id=f"{layout}-{backend}", marks=[] if (backend, kv) in QUICK_PAIRS else [pytest.mark.slow]
        )
        for layout, kv in (("mha", 4), ("gqa", 2), ("mqa", 1))
        for backend in ("math", "sdpa", "auto")
    ],
)
def test_attnlab_passes_every_check(backend, num_kv_heads, device_with_float64):
    report = run_checks(attnlab_module(backend, num_kv_heads=num_kv_heads).to(device_with_float64))
    statuses = {r.name: r.status for r in report.results}
    assert list(statuses) == list(CHECKS)
    if backend == "sdpa":  # its fused kernel returns no weights: the weights row has nothing to check
        assert statuses.pop("attention_weights") == "skip"
    assert all(s == "pass" for s in statuses.values()), report.results
    assert report["mask_semantics"].measured == "True = may attend"
    assert report.diagnosis == []


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_attnlab_cross_attention_with_kdim(backend, device_with_float64):
    """A context of another width: cross-attention parity runs, the self-attention checks skip with the reason."""
    report = run_checks(attnlab_module(backend, kdim=12, vdim=10).to(device_with_float64))
    assert report["parity_cross"].status == "pass"
    skipped = [r for r in report.results if r.status == "skip"]
    assert len(skipped) == len(CHECKS) - 1 and "cannot attend to its own input" in skipped[0].detail


def test_reference_check_is_not_circular_for_attnlab(device_with_float64):
    """The reference agrees with torch's independent implementation on the same weights."""
    ours = attnlab_module("math").to(device_with_float64)
    theirs = TorchMHAAdapter(ours.to_torch(), need_weights=False)
    report = run_checks(theirs, checks=["parity_self", "parity_cross", "parity_masked"])
    assert report.ok, report.failures


# -- deliberately broken modules, each a one-method change of a correct TinyAttention ----------
class NoScale(TinyAttention):
    def score_scale(self):
        return 1.0  # forgot 1/sqrt(d)


class MaskAfterSoftmax(TinyAttention):
    def softmax(self, scores, keep):
        return torch.softmax(scores, dim=-1).masked_fill(~keep, 0.0)  # blocked keys still shared the denominator


class CausalOffByOne(TinyAttention):
    def causal(self, T_q, T_k):
        return torch.ones(T_q, T_k, dtype=torch.bool, device=self.device).tril(T_k - T_q + 1)  # sees one token ahead


class PaddingIgnored(TinyAttention):
    def keep(self, attn_mask, key_padding_mask, is_causal, B, T_q, T_k):
        return super().keep(attn_mask, None, is_causal, B, T_q, T_k)


class MergeWithoutTranspose(TinyAttention):
    def merge(self, context):
        B, H, T, D = context.shape
        return context.reshape(B, T, H * D)  # (B, H, T, D) read as (B, T, H*D): heads and positions mixed


class FloatZeroOneMask(TinyAttention):
    def forward(self, query, key=None, value=None, *, attn_mask=None, **kw):
        # the user's bool mask turned into 0/1 floats and *added*: masks nothing
        self._bias = None if attn_mask is None else attn_mask.float()
        return super().forward(query, key, value, **kw)

    def softmax(self, scores, keep):
        if self._bias is not None:
            scores = scores + (self._bias if self._bias.dim() == 2 else self._bias[:, None])
        return super().softmax(scores, keep)


class NaNOnFullyMaskedRows(TinyAttention):
    def softmax(self, scores, keep):
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)  # all -inf row -> NaN


class DropoutInEval(TinyAttention):
    def softmax(self, scores, keep):
        return F.dropout(super().softmax(scores, keep), self.dropout, training=True)  # ignores eval()


class _IdentityGradSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.softmax(x, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad  # wrong: the Jacobian of softmax is not the identity


class WrongBackward(TinyAttention):
    def softmax(self, scores, keep):
        return _IdentityGradSoftmax.apply(scores.masked_fill(~keep, torch.finfo(scores.dtype).min))


class LossyLowPrecision(TinyAttention):
    def softmax(self, scores, keep):
        if scores.dtype in (torch.bfloat16, torch.float16):  # "fp8 is enough for scores"
            scores = scores.to(torch.float8_e4m3fn).to(scores.dtype)
        return super().softmax(scores, keep)


BROKEN = [
    (NoScale, "parity_self"),
    (MaskAfterSoftmax, "no_causal_leak"),
    (CausalOffByOne, "no_causal_leak"),
    (PaddingIgnored, "padding_invariance"),
    (MergeWithoutTranspose, "permutation_equivariance"),
    (FloatZeroOneMask, "mask_semantics"),
    (NaNOnFullyMaskedRows, "fully_masked_rows"),
    (DropoutInEval, "dropout_off_in_eval"),
    (WrongBackward, "gradcheck[plain]"),
    (WrongBackward, "grad_parity"),
    (LossyLowPrecision, "low_precision[bf16]"),
]


@pytest.mark.parametrize(("broken", "check"), BROKEN, ids=[f"{b.__name__}-{c}" for b, c in BROKEN])
def test_broken_module_is_caught_by_its_check(broken, check, device_with_float64):
    torch.manual_seed(0)
    good = run_checks(TinyAttention().to(device_with_float64), checks=[check])[check]
    torch.manual_seed(0)
    bad = run_checks(broken().to(device_with_float64), checks=[check])[check]
    assert good.status == "pass", good
    assert bad.status == "fail" or (bad.status == "note" and bad.hardening), bad  # NaN on fully masked rows: a note


def test_broken_modules_fail_parity_too(device_with_float64):
    """The bugs that change the output are also caught by plain parity against the reference."""
    # (FloatZeroOneMask is not among them: its additive float masks work, so check hands it those and only
    # mask_semantics, which passes it a bool mask as a user would, fails: see test_mask_semantics_reports_what_it_finds)
    for broken in (NoScale, MaskAfterSoftmax, CausalOffByOne, PaddingIgnored, MergeWithoutTranspose):
        torch.manual_seed(0)
        report = run_checks(broken().to(device_with_float64), checks=["parity_self", "parity_masked"])
        assert not report.ok, broken.__name__
    assert run_checks(TinyAttention().to(device_with_float64), checks=["parity_self", "parity_masked"]).ok


def test_mask_semantics_reports_what_it_finds(device_with_float64):
    """A module whose bool mask means 'blocked' is reported as such, and fails only if it declared otherwise."""
    torch.manual_seed(0)

    class Blocking(TinyAttention):
        def forward(self, query, key=None, value=None, *, attn_mask=None, **kw):
            return super().forward(query, key, value, attn_mask=None if attn_mask is None else ~attn_mask, **kw)

    adapter = ModuleAdapter(Blocking().to(device_with_float64))
    adapter.bool_mask_convention = None  # undeclared: only reported
    row = run_checks(adapter, checks=["mask_semantics"])["mask_semantics"]
    assert (row.status, row.measured) == ("pass", "True = blocked")
    adapter.bool_mask_convention = "keep"  # declared keep, found block: a failure
    assert run_checks(adapter, checks=["mask_semantics"])["mask_semantics"].status == "fail"


def test_a_crashing_target_fails_the_row_instead_of_the_suite(device_with_float64):
    class Crashes(TinyAttention):
        def forward(self, *a, is_causal=False, **kw):
            if is_causal:
                raise RuntimeError("causal not supported")
            return super().forward(*a, **kw)

    row = run_checks(Crashes().to(device_with_float64), checks=["no_causal_leak"])["no_causal_leak"]
    assert row.status == "fail" and "RuntimeError: causal not supported" in row.detail


# -- torch.nn.MultiheadAttention, as found with torch 2.13 on this machine ----------------------
@pytest.mark.parametrize("batch_first", [True, False])
def test_torch_mha_findings(batch_first):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=batch_first)
    report = run_checks(TorchMHAAdapter(m, need_weights=True))
    statuses = {r.name: r.status for r in report.results}
    # Found: with need_weights=True (torch's default) a fully masked query row is NaN, with or
    # without autograd (pytorch issues 41508, 152028). Everything else agrees with the reference.
    assert statuses.pop("fully_masked_rows") == "note"  # a hardening note: the attention is right
    # Found: NaN or inf in a padded key/value row makes every output NaN, padded or not: the padded
    # key's score is NaN before the -inf of key_padding_mask is added, and NaN + -inf = NaN.
    assert statuses.pop("padded_kv_nonfinite") == "note"
    assert (
        "nan self: 320 NaN/inf outputs" in report["padded_kv_nonfinite"].detail
    )  # all 10 real queries (T=7), E=16, 2 modes
    nan_row = 2 * 16  # query 2 of both sequences, all E=16 features: exactly the fully masked row
    assert (
        report["fully_masked_rows"].detail == f"autograd: {nan_row} NaN/inf outputs; no_grad: {nan_row} NaN/inf outputs"
    )
    assert statuses.pop("kv_cache") == "skip"
    assert statuses.pop("scale_attribute") == "skip"  # it states no scale
    for name in [n for n in statuses if n.startswith("variant[")]:  # nn.MultiheadAttention has none of them
        assert statuses.pop(name) == "skip" and "it does not implement this variant" in report[name].detail
    assert set(statuses.values()) == {"pass"}, statuses
    assert report["mask_semantics"].measured == "True = blocked"


def test_torch_mha_fully_masked_rows_without_weights():
    """Found: need_weights=False gives the zero context under autograd but NaN under no_grad,
    where torch takes its inference fast path."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(16, 4, batch_first=True)
    row = run_checks(TorchMHAAdapter(m, need_weights=False), checks=["fully_masked_rows"])["fully_masked_rows"]
    assert row.status == "note" and row.hardening  # missed its bound; a hardening note, not a failure
    assert row.detail.startswith("autograd: finite, err ")
    assert row.detail.endswith("no_grad: 32 NaN/inf outputs")  # query 2 of B=2 sequences, E=16


# -- library use -----------------------------------------------------------------------------------
def test_raise_if_failed_names_the_failing_check(device_with_float64):
    run_checks(TinyAttention().to(device_with_float64), checks=["parity_self"]).raise_if_failed()
    with pytest.raises(AssertionError, match="parity_self"):
        run_checks(NoScale().to(device_with_float64), checks=["parity_self"]).raise_if_failed()


def test_same_seed_same_figures_and_global_rng_untouched(device_with_float64):
    m = attnlab_module("math").to(device_with_float64)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    first = run_checks(m, checks=["parity_self", "dropout_off_in_eval"])
    after = torch.rand(3)
    assert torch.equal(before, after)
    assert [r.measured for r in first.results] == [
        r.measured for r in run_checks(m, checks=["parity_self", "dropout_off_in_eval"]).results
    ]


# -- the command line ------------------------------------------------------------------------------
def _json_run(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["check", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_cli_attnlab_both_backends_pass(capsys):
    code, data = _json_run(capsys, "--embed-dim", "16")
    assert code == 0 and data["ok"]
    assert [r["target"] for r in data["reports"]] == [
        "MultiHeadAttention(backend='math')",
        "MultiHeadAttention(backend='sdpa')",
    ]
    for report in data["reports"]:
        statuses = {row["name"]: row["status"] for row in report["results"]}
        if report["target"].endswith("'sdpa')"):  # the fused kernel returns no weights
            assert statuses.pop("attention_weights") == "skip"
        assert set(statuses.values()) == {"pass"}
        assert report["diagnosis"] == []


def test_cli_torch_exits_1_on_its_fully_masked_rows_when_strict(capsys):
    """torch's NaN on fully masked rows and from NaN padded values are hardening notes (exit 0 without
    --strict, tests/test_check_verdict.py); --strict fails on them."""
    code, data = _json_run(capsys, "--target", "torch", "--embed-dim", "16", "--strict")
    assert code == 1 and not data["ok"] and data["reports"][0]["strict"]
    failed = [row for row in data["reports"][0]["results"] if row["status"] == "fail"]
    assert [row["name"] for row in failed] == ["padded_kv_nonfinite", "fully_masked_rows"]
    assert all(row["hardening"] for row in failed)
    assert {row["measured"] for row in failed} == {"inf"}  # JSON has no inf: written as a string


@pytest.mark.parametrize("factory", ["check_factories:tiny", "check_factories:seq_first_adapter"])
def test_cli_user_factory(capsys, factory):
    code, data = _json_run(capsys, "--target", factory, "--embed-dim", "8")
    assert code == 0, data
    report = data["reports"][0]
    skipped = {row["name"]: row["detail"] for row in report["results"] if row["status"] == "skip"}
    variants = {name for name in skipped if name.startswith("variant[")}
    assert len(variants) == 6  # a user's module without attnlab's variant attributes: each skipped with the reason
    skipped = {name: detail for name, detail in skipped.items() if name not in variants}
    if factory.endswith(":tiny"):
        # the user's module has no cache, returns no weights and states no scale: skipped with a reason
        assert set(skipped) == {"kv_cache", "attention_weights", "scale_attribute"}
        assert report["config"]["embed_dim"] == 8  # --embed-dim reached the factory
        head_dims = next(row for row in report["results"] if row["name"] == "parity_head_dims")
        assert "rebuilt with H=4, G=4" in head_dims["detail"]  # through the factory, with --num-heads 4
    else:  # a factory that takes no sizes: the target cannot be rebuilt at other head dims
        assert set(skipped) == {"kv_cache", "parity_head_dims", "attention_weights", "scale_attribute"}
        assert "factory takes no embed_dim or num_heads" in skipped["parity_head_dims"]


def test_cli_table(capsys):
    assert main(["check", "--backend", "sdpa", "--checks", "parity_self", "low_precision[bf16]"]) == 0
    out = capsys.readouterr().out
    assert "low_precision[bf16]" in out and "PASS" in out and "OK: 2 passed, 0 failed, 0 skipped" in out


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("nonsense", "is not 'attnlab', 'torch', 'path/to/file.py:Name' or 'package.module:Name'"),
        ("no_such_module_xyz:make", "cannot be imported"),
        ("check_factories:missing", "defines no 'missing' (nn.Module classes: TinyAttention, SeqFirstTiny;"),
        ("check_factories:SeqFirstAdapter", "SeqFirstAdapter() needs 'module', which check cannot guess"),
    ],
)
def test_cli_bad_target_is_one_sentence(capsys, target, message):
    assert main(["check", "--target", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: --target")
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.splitlines()]


# --strict: torch's NaN from padded values (a hardening note otherwise) is a failure, shown as FAIL
TORCH_FINDINGS = [
    "--target", "torch", "--strict", "--checks", "low_precision[bf16]", "padded_kv_nonfinite", "mask_semantics"
]  # fmt: skip


def test_cli_table_fits_80_columns_with_details_below(capsys, monkeypatch):
    """At 80 columns a detail column would wrap into a tall ribbon: the details are listed under the table."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["check", *TORCH_FINDINGS]) == 1
    lines = _lines(capsys.readouterr().out)
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "check" in line and "status" in line)
    assert header.split() == ["┃", "check", "┃", "status", "┃", "measured", "┃", "tolerance", "┃"]
    assert any(line.startswith("│ padded_kv_nonfinite") and "FAIL" in line for line in lines)
    detail = next(i for i, line in enumerate(lines) if line.startswith("padded_kv_nonfinite "))
    assert lines[detail].split(maxsplit=1)[1].startswith("pad rows of the K/V inputs set to NaN, inf;")
    assert lines[detail + 1].startswith(" " * len("padded_kv_nonfinite  ")) and lines[detail + 1].strip()  # wrapped
    assert "FAILED: 2 passed, 1 failed, 0 skipped" in lines


def test_cli_table_keeps_its_detail_column_when_wide(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["check", *TORCH_FINDINGS]) == 1
    lines = _lines(capsys.readouterr().out)
    header = next(line for line in lines if "check" in line and "status" in line)
    assert header.split()[-2:] == ["detail", "┃"]
    assert not any(line.startswith("padded_kv_nonfinite ") for line in lines)


def test_cli_shows_progress_as_plain_lines_when_piped(capsys):
    assert main(["check", "--checks", "parity_self", "kv_cache"]) == 0
    lines = _lines(capsys.readouterr().out)
    assert lines[:2] == [
        "checking MultiHeadAttention(backend='math'): 2 checks ...",
        "checking MultiHeadAttention(backend='sdpa'): 2 checks ...",
    ]
    assert lines[2].startswith("done in ") and lines[2].endswith(" s")


def test_cli_shows_a_live_bar_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(["check", "--backend", "sdpa", "--checks", "parity_self", "parity_cross"]) == 0
    text = out.getvalue()
    bar = text[: text.index("attnlab check: ")]
    assert "MultiHeadAttention(backend='sdpa'): parity_cross" in bar and "2/2" in bar  # drawn, then erased
    assert "checking MultiHeadAttention" not in text  # no plain progress lines on a terminal


def test_one_check_at_a_time_gives_the_same_figures(device_with_float64):
    """The CLI runs the checks one by one to show progress; each seeds its own inputs, so nothing changes."""
    from attnlab.check.cli import _run_all

    names = ["parity_masked", "low_precision[fp16]", "gradcheck[padding]", "dropout_rate", "kv_cache"]
    module = attnlab_module("sdpa", num_kv_heads=2).to(device_with_float64)
    seen: list[tuple[str, str, int]] = []
    (one_by_one,) = _run_all([module], names, seed=3, batch_size=2, seq_len=SEQ_LEN, on_check=lambda *a: seen.append(a))
    assert seen == [("MultiHeadAttention(backend='sdpa')", n, i) for i, n in enumerate(names)]
    assert one_by_one.to_dict() == run_checks(module, checks=names, seed=3).to_dict()


def test_a_factory_rebuilt_target_follows_the_targets_device_and_dtype():
    """parity_head_dims rebuilds the target through its factory: the copy must live where the target does."""
    from attnlab.check.adapters import ModuleAdapter
    from check_factories import tiny

    adapter = ModuleAdapter(tiny(embed_dim=8, num_heads=2).double(), factory=tiny)
    rebuilt = adapter.resized(16, 4, 4)
    assert rebuilt.projections().q_weight.dtype == torch.float64
