"""``attnlab check`` and ``trace`` on three more styles people learn from, beyond tests/style_corpus/'s six.

tests/style_corpus_more/ holds, each correct and with one mistake:

* Hugging Face's GPT-2: a fused ``c_attn`` ``Conv1D`` (weight stored ``(in, out)``, applied with ``addmm``), a
  causal mask built inside, an additive ``attention_mask``, a tuple returned;
* timm's Vision Transformer: ``qkv`` reshaped to ``(B, N, 3, H, D)`` and unbound, ``head_dim ** -0.5``, no mask;
* minGPT: ``key``/``query``/``value`` Linears, a ``tril`` buffer, sizes from a ``config``.

Each is built as ``attnlab check --target FILE:TARGET`` builds it, with no option: called as written (the words
of its call form below), correct ones pass (hardening notes allowed), each mistake is the first cause, and
``trace`` departs at the stage the mistake changes first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.check import run_checks
from attnlab.check.target import build_target
from attnlab.tools.trace import trace_module
from test_check_diagnosis import FAST
from test_trace_style_corpus import FIRST_STAGES, _constants

CORPUS = Path(__file__).parent / "style_corpus_more"
FILES = sorted(CORPUS.glob("*.py"))
# (said of every module of the style, said of the correct one): a mistake may hide what only the correct shows
CALL_WORDS = {
    "hf_gpt2": ("fused c_attn", "fused c_attn split as q, k, v"),  # Conv1D read as a transposed Linear
    "timm_vit": ("fused qkv", "fused qkv split as q, k, v"),  # its thirds' order found by experiment
    "mingpt": ("projections query, key, value, proj", "always causal"),  # causal by its own tril buffer
}


def _style(path: Path) -> str:
    return next(s for s in CALL_WORDS if path.stem.startswith(s))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_more_styles_are_read_as_written_and_judged_right(path: Path) -> None:
    c = _constants(path)
    adapter = build_target(f"{path}:{c['TARGET']}", embed_dim=32, num_heads=4, num_kv_heads=None, dropout=0.1, seed=0)
    call = adapter.describe_call() or ""
    always, correct = CALL_WORDS[_style(path)]
    assert always in call and (c["EXPECTED"] != "pass" or correct in call), call
    report = run_checks(adapter, checks=FAST)
    ids = [cause.id for cause in report.diagnosis]
    if c["EXPECTED"] == "pass":
        assert report.ok, ([(r.name, r.detail) for r in report.failures], ids)
        assert all(cause.hardening for cause in report.diagnosis), ids
    else:
        assert not report.ok and ids[:1] == [c["EXPECTED"]], (ids, [r.name for r in report.failures])
    # trace: the correct module reproduces every stage; a mistake departs where it first shows
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0))  # (B, T, E)
    t = trace_module(build_target(f"{path}:{c['TARGET']}", embed_dim=64, num_heads=8, num_kv_heads=None,
                                  dropout=0.0, seed=0), x)  # fmt: skip
    if c["EXPECTED"] == "pass":
        assert t.departure is None and t.error is None, t.to_text(None)
    else:
        assert t.departure is not None and t.departure.stage in FIRST_STAGES[c["EXPECTED"]], t.to_text(None)


def test_every_more_style_has_a_correct_module_and_a_mistake() -> None:
    found: dict[str, set[str]] = {}
    for p in FILES:
        found.setdefault(_style(p), set()).add(_constants(p)["EXPECTED"])
    assert set(found) == set(CALL_WORDS)
    assert all("pass" in e and len(e) >= 2 for e in found.values()), found
