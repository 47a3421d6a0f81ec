"""The verdict of ``attnlab check``: wrong attention fails, robustness it was not written for is a note.

A module that computes attention correctly passes (exit 0) even when NaN in padded values reaches its outputs;
that finding is a hardening note with its fix, and ``--strict`` fails on it. A real mistake is named before any
hardening cause. The mistakes of the six-style trial are recognised on small modules written here. A crash of
check's own code is exit 3 with one line, never the module's failure; every PASS agrees with its printed numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab.check import run_checks, suite
from attnlab.cli import main

# rows that show every mistake below, at the suite's small sizes
ROWS = ["parity_self", "padding_invariance", "padded_kv_nonfinite"]

MODULE = '''
import math

import torch
from torch import nn


class Attention(nn.Module):
    """Textbook attention; key_padding_mask True = pad; NaN in a padded value row reaches the outputs."""

    def __init__(self, embed_dim=32, num_heads=4, mistake=""):
        super().__init__()
        self.num_heads, self.mistake = num_heads, mistake
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def forward(self, query, key, value, key_padding_mask=None):
        B, T, E = query.shape
        H = self.num_heads
        q = self.q_proj(query).view(B, -1, H, E // H).transpose(1, 2)  # (B, H, T_q, D)
        k = self.k_proj(key).view(B, -1, H, E // H).transpose(1, 2)  # (B, H, T_k, D)
        v = self.v_proj(value).view(B, -1, H, E // H).transpose(1, 2)  # (B, H, T_k, D)
        scale = 1.0 if self.mistake == "scale_missing" else 1 / math.sqrt(E // H)
        scores = q @ k.transpose(-2, -1) * scale  # (B, H, T_q, T_k)
        if key_padding_mask is not None:
            if self.mistake == "padding_mask_added":
                scores = scores + key_padding_mask[:, None, None, :].float()  # +1, not -inf
            elif self.mistake == "rows_misassigned":
                rows = key_padding_mask.repeat(H, 1).view(B, H, 1, -1)  # repeat where repeat_interleave belongs
                scores = scores.masked_fill(rows, float("-inf"))
            else:
                scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        context = torch.softmax(scores, dim=-1) @ v  # (B, H, T_q, D)
        return self.out_proj(context.transpose(1, 2).reshape(B, T, E))
'''


@pytest.fixture(scope="module")
def module_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("verdict") / "textbook.py"
    path.write_text(MODULE)
    return path


def _module(path: Path, mistake: str = "") -> nn.Module:
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    torch.manual_seed(0)
    return scope["Attention"](mistake=mistake)


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["check", *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- hardening vs failure -------------------------------------------------------------------------
def test_a_correct_module_with_a_nan_padding_weakness_passes_with_a_note(module_file, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    target = f"{module_file}:Attention"
    code, out, _ = _check(capsys, "--target", target, "--checks", *ROWS)
    flat = " ".join(out.split())  # unwrapped
    assert code == 0
    assert (
        "OK: 2 passed, 0 failed, 0 skipped; computes attention correctly, with 1 hardening note (--strict fails on it)"
        in flat
    )
    notes = flat[flat.index("Hardening notes") :]
    assert "[padded_values_nan]" in notes and "fix: zero the padded rows of V" in notes
    assert "Likely cause" not in out
    assert next(line for line in out.splitlines() if "padded_kv_nonfinite" in line).split("│")[2].strip() == "NOTE"

    code, out, _ = _check(capsys, "--target", target, "--checks", *ROWS, "--strict")
    assert code == 1 and "FAILED: 2 passed, 1 failed, 0 skipped" in out and "Likely cause" in out

    code, out, _ = _check(capsys, "--target", target, "--checks", *ROWS, "--json")
    report = json.loads(out)["reports"][0]
    assert code == 0 and report["ok"] and report["notes"] == ["padded_kv_nonfinite"]
    (row,) = [r for r in report["results"] if r["name"] == "padded_kv_nonfinite"]
    assert row["status"] == "note" and row["hardening"]  # its own status: no row failed
    assert [(c["id"], c["hardening"]) for c in report["diagnosis"]] == [("padded_values_nan", True)]


def test_a_real_mistake_is_named_before_a_hardening_weakness(module_file):
    report = run_checks(_module(module_file, "scale_missing"), checks=ROWS)
    assert not report.ok
    ids = [(c.id, c.hardening) for c in report.diagnosis]
    assert ids[0] == ("scale_missing", False) and ("padded_values_nan", True) in ids, ids
    assert "parity_self" in {r.name for r in report.failures}


def test_a_note_has_its_own_status_and_raise_if_failed_follows_strict(module_file):
    """A hardening note is status "note", not "fail": raise_if_failed() passes it, raise_if_failed(strict=True)
    fails on it as ``attnlab check --strict`` does, and a strict run's rows are failures however it is asked."""
    report = run_checks(_module(module_file), checks=ROWS)
    assert [(r.name, r.status) for r in report.results if r.status != "pass"] == [("padded_kv_nonfinite", "note")]
    assert report.ok and [r.name for r in report.notes] == ["padded_kv_nonfinite"] and report.failures == []
    report.raise_if_failed()  # a note is no failure
    with pytest.raises(AssertionError) as err:
        report.raise_if_failed(strict=True)
    assert str(err.value).startswith(
        "Attention failed 1 attention check(s), hardening notes included (strict):\n  padded_kv_nonfinite: measured inf"
    )
    assert str(err.value).endswith("(a hardening note, failed because strict)")

    strict = run_checks(_module(module_file), checks=ROWS, strict=True)
    row = strict["padded_kv_nonfinite"]
    assert (row.status, row.hardening, strict.ok, strict.notes) == ("fail", True, False, [])
    with pytest.raises(AssertionError, match="padded_kv_nonfinite"):
        strict.raise_if_failed()
    strict.raise_if_failed(strict=False)  # the only failure is a note: not strict, it passes


def test_a_failing_report_does_not_call_its_attention_right(module_file, capsys, monkeypatch):
    """With a real failure above them, the hardening notes' heading does not say the attention is right."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = _check(capsys, "--target", f"{module_file}:Attention", "--checks", *ROWS)
    assert code == 0 and "Hardening notes (robustness a textbook module is not written for; the attention it" in out
    scope = {"MODULE": MODULE.replace('mistake=""', 'mistake="scale_missing"')}
    wrong = module_file.parent / "wrong.py"
    wrong.write_text(scope["MODULE"])
    code, out, _ = _check(capsys, "--target", f"{wrong}:Attention", "--checks", *ROWS)
    flat = " ".join(out.split())
    assert code == 1 and "FAILED: 1 passed, 1 failed, 0 skipped; and 1 hardening note (--strict fails on it)" in flat
    assert "Hardening notes (robustness a textbook module is not written for; --strict fails on them)" in flat
    assert "computes is right" not in flat and "computes attention correctly" not in flat


# -- the trial's mistakes, each recognised by recomputation --------------------------------------
@pytest.mark.parametrize("mistake", ["padding_mask_added", "rows_misassigned"])
def test_a_padding_mask_mistake_is_named(module_file, mistake):
    report = run_checks(_module(module_file, mistake), checks=ROWS)
    assert not report.ok and report.diagnosis[0].id == mistake, [c.id for c in report.diagnosis]
    assert "padding_invariance" in report.diagnosis[0].explains


class FusedKQV(nn.Module):
    """nanoGPT style, the fused projection split in the order k, q, v."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.n_head = num_heads
        self.c_attn, self.c_proj = nn.Linear(embed_dim, 3 * embed_dim), nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        B, T, E = x.shape
        k, q, v = self.c_attn(x).split(E, dim=2)  # the thirds in the wrong order
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, E))


def test_a_fused_projection_split_in_another_order_is_named():
    torch.manual_seed(0)
    report = run_checks(FusedKQV(), checks=["parity_self"])
    assert [c.id for c in report.diagnosis] == ["qkv_split_order"]
    assert "k, q, v" in report.diagnosis[0].found


class SequenceFirst(nn.Module):
    """A wrapper of nn.MultiheadAttention without batch_first=True, fed (B, T, E)."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.mha = nn.MultiheadAttention(embed_dim, num_heads)

    def forward(self, query, key, value, key_padding_mask=None):
        return self.mha(query, key, value, key_padding_mask=key_padding_mask)[0]


def test_batch_and_sequence_axes_swapped_are_named_with_the_crashes_they_cause():
    torch.manual_seed(0)
    report = run_checks(SequenceFirst(), checks=ROWS)
    (cause,) = report.diagnosis
    assert cause.id == "batch_seq_swapped" and "across the batch" in cause.found
    assert set(cause.explains) == {r.name for r in report.failing}  # masks that no longer fit raise: same cause


def test_no_stage_message_is_garbled():
    """Where no stage matches, the message says so in words (once printed as 'your nothing match')."""
    from attnlab.check import diagnose

    source = Path(diagnose.__file__).read_text()
    assert '"nothing"' not in source


# -- check's own failures -----------------------------------------------------------------------------
def test_a_crash_in_checks_own_code_is_exit_3_in_one_line(capsys, monkeypatch):
    # a function of torch's C code in place of check's readback: it raises (a TypeError on check's arguments)
    # with no frame of this file, where the user's code would be
    monkeypatch.setattr(suite, "_head_contexts", torch.linalg.lstsq)
    args = ("--target", "attnlab", "--backend", "math", "--checks", "dropout_rate")
    code, out, err = _check(capsys, *args)
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert "internal error of attnlab check itself, not of your module" in err
    assert "running check dropout_rate: TypeError" in err
    assert "rerun with --debug" in err and "attnlab maintainers" in err
    assert "FAILED" not in out and "Likely cause" not in out  # never blamed on the module

    code, _, err = _check(capsys, *args, "--debug")
    assert code == 3 and "Traceback" in err and "_head_contexts" not in err.splitlines()[-1]


def test_a_crash_of_the_module_stays_the_modules(capsys):
    class Raises(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 4
            self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(32, 32) for _ in range(4))
            self.calls = 0

        def forward(self, query, key, value):
            self.calls += 1
            if self.calls > 3:  # past the probe: the rows' calls raise
                raise RuntimeError("the module's own error")
            return self.out_proj(self.v_proj(value))

    report = run_checks(Raises(), checks=["parity_self"], diagnose=False)
    assert report["parity_self"].status == "fail"
    assert report["parity_self"].detail.startswith("raised RuntimeError: the module's own error")


# -- every PASS/FAIL agrees with its numbers -------------------------------------------------------
class Float32Softmax(nn.Module):
    """With ``downcast``, seed 002's float32 softmax: right in float32, coarse in a float64 run (gradcheck's)."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4, downcast: bool = True) -> None:
        super().__init__()
        self.num_heads, self.downcast = num_heads, downcast
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def forward(self, query, key, value, attn_mask=None):
        B, T, E = query.shape
        H = self.num_heads
        q, k, v = (p(x).view(B, -1, H, E // H).transpose(1, 2) for p, x in
                   ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value)))  # fmt: skip
        scores = q @ k.transpose(-2, -1) / math.sqrt(E // H)  # (B, H, T_q, T_k)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        w = torch.softmax(scores, dim=-1, dtype=torch.float32 if self.downcast else None).to(v.dtype)
        return self.out_proj((w @ v).transpose(1, 2).reshape(B, T, E))


@pytest.mark.parametrize("downcast", [False, True])
def test_every_status_agrees_with_its_printed_numbers(downcast):
    torch.manual_seed(0)
    report = run_checks(
        Float32Softmax(downcast=downcast), checks=["gradcheck[causal]", "gradcheck[padding]", "parity_self"]
    )
    for r in report.results:
        if isinstance(r.measured, float) and isinstance(r.tolerance, float):
            assert (r.status == "pass") == (r.measured <= r.tolerance), (r.name, r.status, r.measured, r.tolerance)
    grads = [report[n] for n in ("gradcheck[causal]", "gradcheck[padding]")]
    assert all(r.status == ("note" if downcast else "pass") for r in grads), grads  # missed, and a hardening note
    if downcast:  # float32 inside a float64 run: a hardening note, and the verdict still passes
        assert all(r.hardening for r in grads) and report.ok
        assert math.isfinite(grads[0].measured) and grads[0].measured > 1  # type: ignore[operator]
