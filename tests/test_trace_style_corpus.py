"""``attnlab trace --target`` on the style corpus: every style traced as written, the mistake shown where it is.

tests/style_corpus/ holds modules in the six styles people learn attention from (see
tests/test_check_style_corpus.py). Each is traced as ``attnlab trace --target FILE:TARGET`` traces it, on four
inputs: self-attention, cross-attention (where the module takes a separate context), key padding and causal.

* A correct module reproduces the reference on every input it takes: no departure, no error.
* A one-mistake module departs on at least one input, and every departure is at a stage its mistake
  changes first (``FIRST_STAGES``): a wrong scale at the scaled scores, a merge without transpose at the
  merged heads, V through the key projection at V. A module that raises is reported as raising.
* A mask the module reads with the reverse polarity is said so in the header line, and departs at the masked scores.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from attnlab.check.adapters import Unsupported
from attnlab.check.target import build_target
from attnlab.tools.trace import TargetTrace, trace_module

CORPUS = Path(__file__).parent / "style_corpus"
FILES = sorted(CORPUS.glob("*.py"))
# Styles nobody listed when trace's stages were placed (issue 50): traced the same way, the same rules. Their files
# are marked slow (about 2 s each); the QUICK ones, one per kind of stage, run in every test run.
FRESH = [
    p
    for name in ("style_corpus_fresh3", "style_corpus_fresh4", "style_corpus_fresh5", "style_corpus_fresh6")
    for p in sorted(CORPUS.parent.glob(f"{name}/*.py"))
]
QUICK = {
    "olmo2_k_uses_q_proj.py",  # k: K through the query projection
    "dbrx_rotary_q_only.py",  # k_heads: the keys left unturned
    "internlm2_scale_head_dim_not_sqrt.py",  # scaled
    "segformer_correct.py",  # no output projection: the merged heads are the output
}
# Known misses, kept visible (strict xfails: one that starts passing fails the test, to be moved out):
MISSES = {
    # a packed projection (p h d) cut with the head axis last; the projection is never held whole, so trace finds
    # no Q and departs at q, where the right stage is q_heads
    "audiocraft_heads_interleaved.py",
    # with a padding mask (and OPT's with causal masking too) the departure is read at the masked scores, before
    # the stage that is off (the weights' axis; the merge)
    "codegen_softmax_query_axis.py",
    "opt_merge_without_transpose.py",
    # Persimmon's (B, T, H, 3, D) rows are read by their use: a (key, query, value) unpacking computes attention
    # with other weights, and nothing departs (check passes it too: tests/test_check_fresh6_styles.py)
    "persimmon_qkv_split_order.py",
}

# The stage where each mistake first shows, as the reference names it. A mistake computed inside a fused kernel
# (SDPA: scores, mask, softmax and weights V in one call) shows at "weights", the first stage the kernel hides.
FIRST_STAGES: dict[str, set[str]] = {
    "scale_missing": {"scaled"},
    "scale_embed_dim": {"scaled"},
    "merge_without_transpose": {"merged"},
    "softmax_query_axis": {"weights"},
    "v_uses_k_proj": {"v"},
    "kv_proj_swapped": {"weights"},  # K through v_proj: the rows label it v; the scores change first
    # the thirds of a fused projection taken in the wrong order: where Q is cut from the wrong third before the
    # module holds it whole (DiT's (B, T, 3, H, D) view), the query heads are the first stage off
    "qkv_split_order": {"weights", "q_heads"},
    "split_without_transpose": {"q_heads"},
    "heads_interleaved": {"weights"},  # each head's slice holds the reference's values, mixed between heads
    "gqa_kv_heads_tiled": {"weights"},
    "mask_after_softmax": {"masked"},
    "mask_ignored": {"masked", "weights"},
    "padding_inverted": {"masked", "weights"},
    "padding_mask_added": {"weights"},
    "rows_misassigned": {"masked"},
    "causal_sees_next": {"masked"},
    "batch_seq_swapped": {"q_heads"},
    # masks handed in the convention of its form (True = may attend): the reversed reading shows where it masks
    "mask_polarity": {"masked", "weights"},
    "scale_head_dim_not_sqrt": {"scaled"},  # 1/D for 1/sqrt(D): the scores times another factor
    "k_uses_q_proj": {"k"},  # the keys are the query projection's output: K is the first stage off
    "kv_from_query": {"k"},  # K and V projected from the query instead of the context: K first (cross-attention)
    # pads blocked as queries (rows), not as keys: the pairs both keep agree, the mask itself differs
    "padding_on_queries": {"masked"},
    # rotary on the queries only: the keys meet Q K^T as the plain split of the K projection, unturned
    "rotary_q_only": {"k_heads"},
    "scale_multiplied": {"scaled"},  # the scale multiplied where it divides (Granite's attention_multiplier)
    "causal_hides_self": {"masked"},  # each query's own key masked too (Gemma 3's triu(diagonal=0))
}


def _constants(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                out[node.targets[0].id] = node.value.value
    return out


def _traces(path: Path) -> dict[str, TargetTrace | str]:
    """Each input's trace, or ``"unsupported"`` where the module cannot take it (no context argument)."""
    c = _constants(path)
    adapter = build_target(f"{path}:{c['TARGET']}", embed_dim=64, num_heads=8, num_kv_heads=None, dropout=0.0, seed=0)
    g = torch.Generator().manual_seed(0)
    x, context = torch.randn(2, 10, 64, generator=g), torch.randn(2, 12, 64, generator=g)  # (B, T, E), (B, T_k, E)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[0, -3:] = True  # the last three keys of the first sequence
    cases = {
        "self": {"query": x},
        "cross": {"query": x, "key": context},
        "padding": {"query": x, "key_padding_mask": pad},
        "causal": {"query": x, "is_causal": True},
    }
    out: dict[str, TargetTrace | str] = {}
    for name, kwargs in cases.items():
        try:
            out[name] = trace_module(adapter, **kwargs)  # type: ignore[arg-type]
        except Unsupported:
            out[name] = "unsupported"
    return out


def _fresh(path: Path) -> object:
    marks = [] if path.name in QUICK else [pytest.mark.slow]
    if path.name in MISSES:
        marks.append(pytest.mark.xfail(reason="a known miss (see MISSES)", strict=True))
    return pytest.param(path, marks=marks, id=f"{path.parent.name.removeprefix('style_corpus_')}/{path.name}")


@pytest.mark.parametrize("path", [*FILES, *(_fresh(p) for p in FRESH)], ids=lambda p: getattr(p, "name", None))
def test_trace_shows_the_mistake_where_it_is(path: Path) -> None:
    expected = _constants(path)["EXPECTED"]
    traces = {k: t for k, t in _traces(path).items() if isinstance(t, TargetTrace)}
    assert "self" in traces, f"{path.name}: self-attention could not be traced"
    for t in traces.values():
        assert t.to_text(80) and t.to_text(None)  # it prints, wrapped or not
    if expected == "pass":
        for name, t in traces.items():
            assert t.error is None, f"{path.name} [{name}]: {t.error.text()}"
            assert t.departure is None, f"{path.name} [{name}]: {t.departure.text()}"
        return
    if expected == "mask_polarity":  # the header line says the reading is reversed; the trace departs there
        assert "the reverse of the True = may attend" in traces["self"].mask
    departed = {name: t.departure.stage for name, t in traces.items() if t.departure is not None}
    raised = [name for name, t in traces.items() if t.error is not None]
    assert departed or raised, f"{path.name} ({expected}): every input reproduced the reference"
    wrong = {name: stage for name, stage in departed.items() if stage not in FIRST_STAGES[expected]}
    assert not wrong, f"{path.name} ({expected}): departed at {wrong}, expected one of {FIRST_STAGES[expected]}"


def test_every_corpus_mistake_has_its_first_stage() -> None:
    """A new corpus mistake must say where trace is to show it."""
    mistakes = {_constants(p)["EXPECTED"] for p in [*FILES, *FRESH]} - {"pass"}
    assert mistakes <= set(FIRST_STAGES), sorted(mistakes - set(FIRST_STAGES))


def test_cloned_projections_are_told_apart() -> None:
    """The Annotated Transformer's ``clones`` makes four equal Linears; traced as built, K and V would be
    indistinguishable from Q. They are redrawn (seeded) and the header says so; each row is named for its role."""
    t = _traces(CORPUS / "annotated_correct.py")["self"]
    assert isinstance(t, TargetTrace)
    assert "linears.1, linears.2, linears.3 were copies" in t.weights
    roles = [r.stage for r in t.rows if r.func == "linear"]
    assert roles == ["q", "k", "v", "out"], roles


def test_nn_multihead_attention_is_traced_inside() -> None:
    """A wrapper of ``nn.MultiheadAttention`` shows torch's own steps (in-projection, heads, SDPA, out-projection),
    not one opaque call: the trace reaches the reference's heads, context and output."""
    t = _traces(CORPUS / "torchwrap_correct.py")["self"]
    assert isinstance(t, TargetTrace)
    funcs = [r.func for r in t.rows]
    assert "linear" in funcs and "scaled_dot_product_attention" in funcs, funcs
    assert {"q_heads", "k_heads", "v_heads", "context", "out"} <= set(t.matched), t.matched
