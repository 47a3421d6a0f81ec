"""``attnlab check`` on the style corpus: modules in the six styles people learn from, checked as written.

tests/style_corpus/ holds modules written as the Annotated Transformer, d2l.ai, nanoGPT, HF BERT, a wrapper
of ``nn.MultiheadAttention`` and HF Llama (GQA) write them, each correct or with one mistake (``EXPECTED``),
confirmed against a float64 reference by tests/test_style_corpus_truth.py. Each is built as
``attnlab check --target FILE:TARGET`` builds it, with no option, and must be (a) called in its own style,
(b) judged right (exit 0, hardening notes allowed) or wrong, and (c) given its mistake as the first cause.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from attnlab.check import run_checks
from attnlab.check.catalogue import by_id
from attnlab.check.target import build_target
from test_check_diagnosis import FAST

CORPUS = Path(__file__).parent / "style_corpus"
FILES = sorted(p for p in CORPUS.glob("*.py"))

# What the describe_call line says of each style's call form: the words that show it was read as written.
CALL_WORDS = {
    "annotated": "forward(query, key, value, mask)",  # one (B, T_q, T_k) keep mask
    "d2l": "valid_lens",  # lengths, not a mask
    "nanogpt": "c_attn",  # one fused projection split in three
    "bert": "attention_mask",  # HF's extended additive mask
    "torchwrap": "nn.MultiheadAttention",  # torch's module, called through the wrapper's forward
    "llama": "attention_mask",  # an additive (B, 1, T_q, T_k) mask built by the caller
}


def _constants(path: Path) -> dict[str, str]:
    """EXPECTED, TARGET, STYLE, read without importing the file (as scripts/check_style_trial.py does)."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant):
                out[node.targets[0].id] = str(node.value.value)
    return out


def test_the_corpus_covers_every_style_with_a_correct_module_and_mistakes():
    styles: dict[str, list[str]] = {}
    for p in FILES:
        c = _constants(p)
        styles.setdefault(c["STYLE"], []).append(c["EXPECTED"])
    assert set(styles) == set(CALL_WORDS)
    for style, expected in styles.items():
        assert "pass" in expected and len([e for e in expected if e != "pass"]) >= 2, style


# Every file runs unmarked: with the fast rows (those of test_check_diagnosis.py) each takes about a second.
@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_a_style_module_is_read_as_written_and_judged_right(path):
    c = _constants(path)
    expected = c["EXPECTED"]
    # the CLI's defaults: --embed-dim 32 --num-heads 4 --dropout 0.1 --seed 0
    adapter = build_target(f"{path}:{c['TARGET']}", embed_dim=32, num_heads=4, num_kv_heads=None, dropout=0.1, seed=0)
    call = adapter.describe_call() or ""
    assert CALL_WORDS[c["STYLE"]] in call, call
    report = run_checks(adapter, checks=FAST)
    ids = [cause.id for cause in report.diagnosis]
    if expected == "pass":
        assert report.ok, ([(r.name, r.detail) for r in report.failures], ids)
        assert all(cause.hardening for cause in report.diagnosis), ids  # notes only
        return
    assert report.ok == by_id(expected).hardening, [(r.name, r.detail) for r in report.failing]
    assert ids[:1] == [expected], (ids, [r.name for r in report.failures])
    # and nothing that fails is left unaccounted for: every failing row is explained by some cause
    explained = {name for cause in report.diagnosis for name in cause.explains}
    assert {r.name for r in report.failing} <= explained, sorted({r.name for r in report.failing} - explained)
