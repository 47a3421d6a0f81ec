"""``attnlab check --target file.py:fn`` on attention functions and kernels (attnlab.check.function_target).

tests/function_corpus/ holds functions as people who optimise attention write them: a hand-written SDPA, a
flash-attention style tiled online softmax in (B, T, H, D), a varlen function with cu_seqlens, a (B*H, T, D)
bmm function and a Triton kernel (run in Triton's interpreter, when triton is installed). Each is correct or
has one mistake (``EXPECTED``), and each must get its layout found by experiment (``LAYOUT``), its verdict,
and its mistake named first.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab.check.function_target import (
    SHORT,
    Formula,
    _bf16_dot_error,
    attend,
    attention_function,
    check_function,
    is_attention_function,
)
from attnlab.check.target import TargetError, build_target
from attnlab.cli import main
from test_check_style_corpus import _constants  # EXPECTED, TARGET, LAYOUT ... read without importing the file

CORPUS = Path(__file__).parent / "function_corpus"
FILES = sorted(CORPUS.glob("*.py"))
HAS_TRITON = importlib.util.find_spec("triton") is not None


def test_the_corpus_has_correct_functions_in_every_layout_and_one_mistake_each_of_thirteen_kinds():
    consts = [_constants(p) for p in FILES]
    assert {c["LAYOUT"] for c in consts if c["EXPECTED"] == "pass"} == {"BHTD", "BTHD", "flat", "varlen"}
    mistakes = [c["EXPECTED"] for c in consts if c["EXPECTED"] != "pass"]
    assert len(set(mistakes)) >= 13, mistakes


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_a_function_is_read_by_experiment_and_its_mistake_named_first(path):
    c = _constants(path)
    if c.get("NEEDS") == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton; it runs here under TRITON_INTERPRET=1)")
    t = attention_function(f"{path}:{c['TARGET']}", causal_alignment=c.get("CAUSAL_ALIGNMENT"))
    assert t is not None
    assert t.layout == c["LAYOUT"], t.describe()
    if "FOUND" in c:
        assert c["FOUND"] in t.describe(), t.describe()
    report = check_function(t)
    ids = [cause.id for cause in report.diagnosis]
    if c["EXPECTED"] == "pass":
        assert report.ok, ([(r.name, r.measured, r.detail) for r in report.failures], ids)
        assert not report.diagnosis
        return
    assert not report.ok
    assert ids[:1] == [c["EXPECTED"]], (ids, [(r.name, r.measured) for r in report.failures])
    explained = {n for cause in report.diagnosis for n in cause.explains}
    assert {r.name for r in report.failing} <= explained  # no failing row left without a cause


def test_torch_sdpa_itself_passes_with_every_form_found():
    t = attention_function("torch.nn.functional:scaled_dot_product_attention")
    assert t is not None
    assert (t.layout, t.mask_arg, t.causal_arg, t.scale_arg, t.gqa, t.dropout_arg) == (
        "BHTD", "attn_mask", "is_causal", "scale", "enable_gqa", "dropout_p",
    )  # fmt: skip
    assert set(t.mask_forms) == {"bool keep", "additive"} and len(t.mask_forms["bool keep"]) == 4
    assert t.causal_offset == 0  # SDPA's is_causal is top-left
    assert t.gqa_found == "interleave"
    report = check_function(t)
    assert report.ok, [(r.name, r.measured) for r in report.failures]
    assert report.config["call_form"].startswith("scaled_dot_product_attention: found layout (B, H, T, D)")
    # docs/howto/check.md quotes this line: it must be the tool's
    page = " ".join((Path(__file__).parents[1] / "docs" / "howto" / "check.md").read_text().split())
    assert f"`{report.config['call_form']}`" in page, report.config["call_form"]


def test_bottom_right_is_found_where_flash_attention_aligns_and_either_passes_unless_one_is_asked():
    path = CORPUS / "flash_tiled_correct.py"
    t = attention_function(f"{path}:flash_attn_func")
    assert t is not None and t.causal_offset == SHORT.T_k - SHORT.T_q
    strict = attention_function(f"{path}:flash_attn_func", causal_alignment="top-left")
    assert strict is not None
    report = check_function(strict)
    assert report["causal"].status == "fail" and report.diagnosis[0].id == "causal_alignment"
    assert "aligned bottom-right, not top-left" in report.diagnosis[0].found


def test_the_reference_formula_is_the_float64_loop():
    """attend() against an explicit per-(b, h, i) loop, causal bottom-right, GQA interleaved."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, 3, 5, generator=g),
        torch.randn(2, 2, 6, 5, generator=g),
        torch.randn(2, 2, 6, 5, generator=g),
    )
    q, k, v = q.double(), k.double(), v.double()
    got = attend(q, k, v, Formula(0.3, causal=3))
    want = torch.zeros_like(got)
    for b in range(2):
        for h in range(4):
            for i in range(3):
                s = [float(q[b, h, i] @ k[b, h // 2, j]) * 0.3 if j <= i + 3 else -math.inf for j in range(6)]
                w = torch.softmax(torch.tensor(s, dtype=torch.float64), 0)
                want[b, h, i] = sum(w[j] * v[b, h // 2, j] for j in range(6))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        attend(q[:, ::2], k, v, Formula(0.3)), F.scaled_dot_product_attention(q[:, ::2], k, v, scale=0.3)
    )


def test_a_factory_is_still_built_and_a_function_is_refused_where_a_module_is_needed():
    assert not is_attention_function(lambda embed_dim, num_heads: None)
    path = Path(__file__).parent / "check_factories.py"
    assert attention_function(f"{path}:tiny") is None  # built by build_target, as before
    with pytest.raises(TargetError, match=r"is an attention function f\(q, k, v, \.\.\.\), not a module to build"):
        build_target(
            f"{CORPUS / 'sdpa_correct.py'}:attention", embed_dim=32, num_heads=4, num_kv_heads=None, dropout=0.0, seed=0
        )


def test_cli_on_one_function_file_prints_what_it_found_and_exits_by_verdict(capsys):
    target = f"{CORPUS / 'mask_polarity.py'}:sdpa"
    assert main(["check", "--json", "--target", target]) == 1
    report = json.loads(capsys.readouterr().out)["reports"][0]
    assert report["config"]["call_form"].startswith("sdpa: found layout (B, H, T, D); mask: attn_mask = bool block")
    assert report["diagnosis"][0]["id"] == "mask_polarity"
    # True = blocked said to be the convention: it passes
    assert main(["check", "--target", target, "--mask-convention", "block"]) == 0
    out = capsys.readouterr().out
    assert "OK:" in out and "sdpa: found layout (B, H, T, D)" in out


def test_cli_refuses_module_sizes_and_causal_alignment_where_they_do_not_apply(capsys):
    target = f"{CORPUS / 'sdpa_correct.py'}:attention"
    assert main(["check", "--target", target, "--embed-dim", "64"]) == 2
    assert "--embed-dim 64 does not apply to --target" in capsys.readouterr().err
    assert main(["check", "--target", target, "--checks", "parity_self"]) == 2
    assert "--checks parity_self does not apply to --target" in capsys.readouterr().err
    assert main(["check", "--target", "torch", "--causal-alignment", "top-left", "--checks", "parity_self"]) == 2
    assert "--causal-alignment top-left applies to an attention function" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_the_triton_interpreter_bfloat16_self_test_measures_a_product():
    err = _bf16_dot_error()
    assert err is not None and err >= 0.0  # 2.5e10 with triton 3.9.0 on this CPU; a fixed interpreter gives ~0
