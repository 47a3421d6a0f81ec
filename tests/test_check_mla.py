"""``attnlab check`` on hand-written multi-head latent attention (MLA): detection, sizes, verdict, first cause.

tests/style_corpus_mla/ holds MLA modules written as Hugging Face's DeepseekV3Attention (naive), DeepSeek's
inference code (absorbed) and the paper's symbols (separate W_DKV/W_UK/W_UV/W_KR, its own rotary angles), each
correct or with one mistake (``EXPECTED``). Each is built as ``attnlab check --target FILE:TARGET`` builds it and
must be read as MLA, called in its own style, judged right (exit 0) or wrong, and given its mistake first.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab.check.mla import MLARecipe, call_form, find_mla, mla_dims, mla_recipe, mla_weights
from attnlab.check.mla_checks import MLA_MISTAKES, _core_reference, by_id, run_mla
from attnlab.check.target import build_target
from attnlab.core.functional import causal_keep
from attnlab.core.mla import MultiHeadLatentAttention

CORPUS = Path(__file__).parent / "style_corpus_mla"
FILES = sorted(CORPUS.glob("*.py"))
CALL_WORDS = {  # what the header says of each style's call form
    "hf_mla": "position_embeddings=(cos, sin)",
    "deepseek_mla": "freqs_cis=complex",
    "scratch_mla": "its own angles (rope_theta=10000)",
}


def _constants(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Constant)
        ):
            out[node.targets[0].id] = str(node.value.value)
    return out


def _build(path: Path):
    c = _constants(path)
    return build_target(f"{path}:{c['TARGET']}", embed_dim=32, num_heads=4, num_kv_heads=None, dropout=0.1, seed=0)


def test_the_corpus_has_a_correct_module_per_style_and_every_mistake():
    consts = [_constants(p) for p in FILES]
    assert {c["STYLE"] for c in consts if c["EXPECTED"] == "pass"} == set(CALL_WORDS)
    assert {c["EXPECTED"] for c in consts} - {"pass"} == {m.id for m in MLA_MISTAKES}


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_an_mla_module_is_read_as_written_and_judged_right(path):
    c = _constants(path)
    adapter = _build(path)
    report = run_mla(adapter)
    call = report.config["call_form"]
    assert "read as multi-head latent attention (MLA)" in call and CALL_WORDS[c["STYLE"]] in call, call
    ids = [cause.id for cause in report.diagnosis]
    if c["EXPECTED"] == "pass":
        assert report.ok and not ids, [(r.name, r.measured) for r in report.failures]
        return
    assert not report.ok
    assert ids[:1] == [c["EXPECTED"]], (ids, [(r.name, r.measured) for r in report.failures])
    explained = {n for cause in report.diagnosis for n in cause.explains}
    assert {r.name for r in report.failures} <= explained


def test_sizes_are_read_from_the_weights_and_the_call_form_from_forward():
    hf = _build(CORPUS / "hf_naive_correct.py")
    d = hf.dims
    assert (d.E, d.H, d.C, d.R, d.N, d.Dv, d.Q) == (32, 4, 16, 4, 8, 8, 16) and d.heads_from == "num_heads"
    assert hf.form.rope_kind == "cos_sin" and hf.form.mask_kind == "batch"
    ds = _build(CORPUS / "deepseek_absorbed_correct.py")
    assert (ds.dims.C, ds.dims.N, ds.dims.R, ds.dims.Dv, ds.dims.Q) == (16, 16, 4, 8, None)
    assert ds.parts.q == "wq" and ds.parts.kv_a == "wkv_a" and ds.parts.kv_norm == "kv_norm"
    assert ds.form.rope_kind == "complex" and ds.form.mask_kind == "square" and ds.form.start == "start_pos"
    sc = _build(CORPUS / "scratch_separate_correct.py")
    assert sc.parts.dkv == "W_DKV" and sc.parts.kr == "W_KR" and sc.parts.uk == "W_UK"
    assert sc.form.rope_kind == "inside" and sc.form.mask is None and sc.theta_from == "rope_theta=10000"
    per_head = _build(CORPUS / "hf_naive_rope_key_per_head.py")
    assert per_head.dims.R == 4 and per_head.dims.key_rope_rows == 16 and not per_head.dims.shared_rope_key


def test_heads_are_derived_from_the_shapes_when_no_attribute_names_them():
    class Bare(nn.Module):  # H=2, C=6, R=2, N=3, Dv=5, E=10: no attribute says any of them
        def __init__(self):
            super().__init__()
            self.wq = nn.Linear(10, 2 * (3 + 2))
            self.wkv_a = nn.Linear(10, 6 + 2)
            self.kv_norm = nn.RMSNorm(6)
            self.wkv_b = nn.Linear(6, 2 * (3 + 5))
            self.wo = nn.Linear(2 * 5, 10)

    m = Bare()
    parts = find_mla(m)
    assert parts is not None
    d = mla_dims(m, parts)
    assert (d.E, d.H, d.C, d.R, d.N, d.Dv) == (10, 2, 6, 2, 3, 5) and d.heads_from == "the weights' shapes"
    assert find_mla(nn.Sequential(nn.Linear(4, 4))) is None


def test_attnlabs_own_mla_is_read_and_passes():
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(32, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    parts = find_mla(m)
    assert parts is not None and call_form(m).causal_flag == "is_causal"
    from attnlab.check.mla import MLAAdapter

    report = run_mla(MLAAdapter(m, parts, name="MultiHeadLatentAttention"))
    assert report.ok, [(r.name, r.measured) for r in report.failures]


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_the_recipe_without_a_mistake_is_attnlabs_reference(layout):
    adapter = _build(CORPUS / "hf_naive_correct.py")
    adapter.float64()
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    keep = causal_keep(8, 8, x.device)[None]  # (1, T, T)
    ours = adapter.reference(x, keep, layout=layout).detach()
    assert torch.allclose(ours, _core_reference(adapter, x, keep, layout), atol=1e-12, rtol=0)


def test_each_mistake_changes_the_output_visibly():
    adapter = _build(CORPUS / "deepseek_absorbed_correct.py")  # N == C: every recipe but the per-head key applies
    adapter.float64()
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    keep = causal_keep(8, 8, x.device)[None]  # (1, T, T)
    right = adapter.reference(x, keep, layout="interleaved").detach()
    for m in MLA_MISTAKES:
        if not m.recipe.applies(adapter.dims):
            continue
        wrong = adapter.reference(x, keep, layout="interleaved", recipe=m.recipe).detach()
        assert (wrong - right).abs().max() > 1e-3 * right.abs().max(), m.id
    w = mla_weights(adapter.module64, adapter.parts, adapter.dims)
    out = mla_recipe(w, adapter.dims, x, None, keep, layout="half", recipe=MLARecipe(scale="nope"))
    assert out.shape == x.shape and math.isfinite(float(out.detach().sum()))
    assert by_id("mla_scale_nope_only").recipe == MLARecipe(scale="nope")
