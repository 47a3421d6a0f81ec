"""``attnlab check`` on hand-written modules as they are written, and the diagnosis that names the mistake.

The corpus (tests/mistake_corpus/) holds modules written the way blog posts write them, in four call
forms, each with one classic mistake or none; it was written apart from the catalogue. Every
catchable one-mistake module must get its mistake named first; correct ones must pass with no
``Likely cause``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab.check import CHECKS, run_checks
from attnlab.check.catalogue import MISTAKES, by_id
from attnlab.check.dataflow import Rotary
from attnlab.check.probe import ProbedAdapter
from attnlab.check.recipe import Recipe, recipe_attention
from attnlab.check.reference import reference_attention
from attnlab.check.scoremap import ScoreMap
from attnlab.check.target import build_target, random_biases
from attnlab.cli import main

CORPUS = Path(__file__).parent / "mistake_corpus"
FILES = sorted(p for p in CORPUS.glob("*.py"))
# The rows that rebuild or lengthen the target, the full float64 Jacobian and the half-precision
# gradients cost most of a check's time and name no mistake that other rows do not also show (fast-mode
# gradcheck, half-precision outputs); the corpus runs without them (the seed modules below run every row).
SLOW_ROWS = (
    "odd_lengths",
    "parity_head_dims",
    "gradcheck[plain]",
    "low_precision_grad[bf16]",
    "low_precision_grad[fp16]",
)
FAST = [n for n in CHECKS if n not in SLOW_ROWS]


def _corpus_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"corpus_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _expected(path: Path) -> tuple[str, list[str]]:
    module = _corpus_module(path)
    return module.EXPECTED, list(getattr(module, "ALSO", []))


def _target(path: Path, **kw):
    kv = 2 if path.stem.startswith("gqa") else None
    return build_target(
        f"{path}:MultiHeadAttention", embed_dim=32, num_heads=4, num_kv_heads=kv, dropout=0.1, seed=0, **kw
    )


def _where_it_fails(path: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> object:
    """A ``DEVICE_ONLY`` corpus module (right on the CPU, wrong elsewhere) as its mistake shows.

    On an accelerator (``ATTNLAB_TEST_DEVICE=cuda``): the module, moved there for real; its tensors made
    without ``device=`` land on the CPU beside inputs on the GPU. On a CPU, a model of that: inside the
    module's forward the default device is ``meta``, so a tensor made without ``device=`` lands on meta
    beside inputs on the CPU, and torch raises the same kind of error ("Tensor on device meta is not on
    the expected device cpu!" where CUDA says "Expected all tensors to be on the same device"). What is
    modelled: where a factory call without device= puts its tensor (the default device, not the inputs').
    What is not: the GPU's own message and kernels, which only a run with --device cuda shows.
    """
    if device.type != "cpu":
        return _target(path, device=device)
    module = _corpus_module(path).MultiHeadAttention
    forward = module.forward

    @functools.wraps(forward)  # the same signature: the call form is read off it
    def elsewhere(self, *args, **kwargs):
        with torch.device("meta"):
            return forward(self, *args, **kwargs)

    monkeypatch.setattr(module, "forward", elsewhere)
    torch.manual_seed(0)
    return random_biases(module(embed_dim=32, num_heads=4, dropout=0.1), 0)


# The corpus names some mistakes twice, in two module styles. `make test` runs one file of each such pair, and
# these (their twins, a few seconds of CPU each) only in `make test-all`: the mistake is still named first in
# the quick set, and every style keeps its other files there (test_each_slow_corpus_file_has_a_quick_twin).
SLOW_TWINS = {
    "gqa_key_length_from_query",
    "gqa_padding_on_queries",
    "seed000_fully_masked_uniform",
    "seed000_scale_embed_dim",
    "seed000_scale_missing",
    "seed002_float64_downcast",
    "seed002_softmax_query_axis",
    "seed002_split_without_transpose",
    "torchlike_fully_masked_nan",
    "torchlike_padded_values_nan",
    "torchlike_padding_ignored",
}


@pytest.mark.parametrize(
    "path", [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in SLOW_TWINS else []) for p in FILES]
)
def test_the_corpus_mistake_is_named_first(path, device, monkeypatch):
    expected, also = _expected(path)
    if getattr(_corpus_module(path), "DEVICE_ONLY", False):
        assert run_checks(_target(path), checks=FAST).ok  # right on the CPU
        report = run_checks(_where_it_fails(path, device, monkeypatch), checks=FAST)
    else:
        report = run_checks(_target(path), checks=FAST)
    ids = [c.id for c in report.diagnosis]
    if expected == "pass":
        assert report.ok and ids == [], [(r.name, r.detail) for r in report.failures]
        return
    # A hardening mistake (NaN in padded values, fully masked rows, a -1e9 fill in float16, float32 in a float64
    # run) is robustness, not wrong attention: still named first, its rows are notes and the module passes.
    assert report.ok == by_id(expected).hardening, [(r.name, r.hardening) for r in report.failing]
    if also:  # several mistakes at once (the seeds' own modules): exactly those, in any order
        assert set(ids) == {expected, *also}, ids
    else:
        assert ids[:1] == [expected], (ids, [r.name for r in report.failures])
    explained = {n for c in report.diagnosis for n in c.explains}
    assert explained == {r.name for r in report.failing}  # every failing row sits under a cause


def test_each_slow_corpus_file_has_a_quick_twin():
    """Each file of SLOW_TWINS exists, and a file `make test` runs names the same single mistake first."""
    stems = {p.stem for p in FILES}
    assert SLOW_TWINS <= stems, sorted(SLOW_TWINS - stems)
    quick_ids = {_expected(p)[0] for p in FILES if p.stem not in SLOW_TWINS and not _expected(p)[1]}
    for stem in sorted(SLOW_TWINS):
        expected, also = _expected(CORPUS / f"{stem}.py")
        assert not also and expected != "pass", f"{stem}: only a single named mistake has a twin"
        assert expected in quick_ids, f"{stem}: no file in `make test` names {expected!r} first"


def test_every_catalogued_mistake_is_in_the_corpus():
    """The corpus is the catalogue's test set: a mistake nobody wrote a module for is untested."""
    written = {_expected(p)[0] for p in FILES} | {m for p in FILES for m in _expected(p)[1]}
    # the mistakes found in styles nobody listed have their modules in tests/style_corpus_wild/ (and _fresh2/)
    styles = [p for d in ("style_corpus_wild", "style_corpus_fresh2") for p in (Path(__file__).parent / d).glob("*.py")]
    written |= {m.group(1) for p in styles if (m := re.search(r'^EXPECTED = "(\w+)"', p.read_text(), re.M))}
    untested = {m.id for m in MISTAKES} - written
    # wrong_backward / low_precision_loss / mask_polarity / scale_attribute have modules of their own below; the
    # mistakes of the style trial have theirs in tests/test_check_verdict.py
    assert untested <= {
        "wrong_backward",
        "low_precision_loss",
        "mask_polarity",
        "scale_attribute",
        "rows_misassigned",
        "batch_seq_swapped",
        "qkv_split_order",
        "padding_mask_added",
    }, untested


def test_a_tensor_made_on_another_device_is_named_at_the_line_that_makes_it(device, monkeypatch):
    """``device_mismatch``: the rows' crash names the mistake, and the diagnosis points at the line that made
    the tensor (every factory call of the module's forward recorded), where the fix goes, beside the line
    that raised. On a CPU through the model of ``_where_it_fails``; with ATTNLAB_TEST_DEVICE=cuda, for real."""
    path = CORPUS / "torchlike_device_mismatch.py"
    report = run_checks(
        _where_it_fails(path, device, monkeypatch), checks=["parity_self", "parity_masked", "grad_parity"]
    )
    (cause,) = report.diagnosis
    assert cause.id == "device_mismatch" and cause.explains == ("parity_self", "parity_masked", "grad_parity")
    lines = path.read_text().splitlines()
    made = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("blocked = torch.zeros("))
    made_on, inputs_on = ("meta", "cpu") if device.type == "cpu" else ("cpu", str(torch.empty(0, device=device).device))
    assert cause.found == (
        "a tensor built inside forward (a mask, torch.tril(torch.ones(..))) is on another device than the inputs: "
        f"torch.zeros at torchlike_device_mismatch.py:{made} (`blocked = torch.zeros(B, H, T_q, T_k, dtype=torch.bool)`) "
        f"makes it on {made_on}, for inputs on {inputs_on}"
    )
    assert cause.evidence.startswith("3 row(s) raised RuntimeError: ")
    assert re.search(r"; raised at torchlike_device_mismatch\.py:\d+: ", cause.evidence)  # where it crashed
    assert "device=x.device" in cause.fix and "register_buffer" in cause.fix
    assert report["parity_self"].data["raised_at"].startswith("torchlike_device_mismatch.py:")


@pytest.mark.parametrize("name", ["seed002_as_published", "seed000_as_published"])
def test_the_seeds_modules_are_checked_unchanged(capsys, name):
    """Each seed's own module, called its own way, through a file path, with every row."""
    path = CORPUS / f"{name}.py"
    expected, also = _expected(path)
    code = main(["check", "--target", f"{path}:MultiHeadAttention", "--json"])
    data = json.loads(capsys.readouterr().out)
    # every mistake either seed's module makes is a hardening one (NaN in padded values, fully masked rows,
    # float32 in float64, a -1e9 fill in float16): each computes attention right, so it passes with notes
    assert code == 0 and data["ok"]
    report = data["reports"][0]
    assert report["notes"] and all(c["hardening"] for c in report["diagnosis"])
    assert {c["id"] for c in report["diagnosis"]} == {expected, *also}
    rows = {r["name"]: r["status"] for r in report["results"]}
    assert rows["parity_self"] == rows["parity_cross"] == rows["parity_masked"] == "pass"
    assert "TypeError" not in json.dumps(report)  # the seed's forward is called as it is written
    for cause in report["diagnosis"]:
        assert cause["found"] and cause["evidence"] and cause["fix"] and cause["seed"].startswith("seed 00")


def test_a_text_report_ends_with_the_likely_cause(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code = main(["check", "--target", f"{CORPUS / 'seed002_scale_embed_dim.py'}:MultiHeadAttention"])
    out = capsys.readouterr().out
    assert code == 1
    cause = " ".join(out[out.index("Likely cause") :].split())  # the section, unwrapped
    assert "1. scores are scaled by 1/sqrt(embed_dim) = 0.1768, not 1/sqrt(head_dim) = 0.3536" in cause
    assert "evidence: the output matches this mistake to" in cause and "see: seed 002, section 2.3" in cause
    assert "fix: divide the scores by math.sqrt(head_dim)" in cause
    assert "explains: parity_self, parity_cross, parity_masked" in cause
    assert all(len(line) <= 80 for line in out.splitlines())


def test_a_correct_module_has_no_cause_and_its_skips_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code = main(["check", "--target", f"{CORPUS / 'seed002_correct.py'}:MultiHeadAttention"])
    out = capsys.readouterr().out
    assert code == 0 and "Likely cause" not in out and "SKIP" not in out
    assert "OK: 24 passed, 0 failed, 8 skipped" in out
    (line,) = [line for line in out.splitlines() if line.startswith("skipped")]
    assert line == "skipped 8 (--json has each reason): scale_attribute, kv_cache, 6 variant rows"


# -- the scale comes from the head dim, not from the module --------------------------------------
class StatedScale(nn.Module):
    """Blog style; stores its scale the common wrong way and, with ``use``, computes with it."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4, use: bool = True) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.use = num_heads, embed_dim // num_heads, use
        self.scale = 1 / math.sqrt(embed_dim)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def forward(self, query, key, value, attn_mask=None):
        B, T, E = query.shape
        q, k, v = (p(x).view(B, -1, self.num_heads, self.head_dim).transpose(1, 2) for p, x in
                   ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value)))  # fmt: skip
        scores = q @ k.transpose(-2, -1) * (self.scale if self.use else 1 / math.sqrt(self.head_dim))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
        w = torch.softmax(scores, dim=-1)
        if attn_mask is not None:
            w = w.masked_fill(~attn_mask.any(-1, keepdim=True), 0.0)
            v = v.masked_fill(~attn_mask.any(-2)[..., None], 0.0)  # keys no query sees: NaN there stays out
        return self.out_proj((w @ v).transpose(1, 2).reshape(B, T, E))


def test_a_wrong_scale_attribute_never_passes():
    torch.manual_seed(0)
    used = run_checks(StatedScale(), checks=FAST)
    assert not used.ok and used.diagnosis[0].id == "scale_embed_dim"
    assert "scale_attribute" in used.diagnosis[0].explains  # the stated scale is the same mistake
    # follow-on rows grouped under the cause rather than drowning it
    assert {"parity_masked", "fully_masked_rows", "mask_semantics"} <= set(used.diagnosis[0].explains)
    stated = run_checks(StatedScale(use=False), checks=FAST)  # computes right, states wrong
    assert [r.name for r in stated.failures] == ["scale_attribute"]
    assert [c.id for c in stated.diagnosis] == ["scale_attribute"]
    assert stated["scale_attribute"].detail.startswith("the module's scale attribute is 1/sqrt(embed_dim) = 0.1768")
    intended = run_checks(StatedScale(), checks=FAST, scale=1 / math.sqrt(32))  # --scale: the user's truth
    assert intended.ok, intended.failures


# -- call forms ----------------------------------------------------------------------------------
class SelfOnly(nn.Module):
    """``forward(x)``: self-attention only, no mask argument at all."""

    def __init__(self, d_model: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, E = x.shape
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        out = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(B, T, E))


def test_a_module_without_masks_or_cross_attention_skips_what_it_lacks():
    torch.manual_seed(0)
    adapter = ProbedAdapter(SelfOnly())
    assert adapter.found.qkv == "qkv" and not adapter.supports_cross_attention
    report = run_checks(adapter, checks=[*FAST, "gradcheck[plain]"])
    assert report.ok, report.failures
    skipped = {r.name: r.detail for r in report.results if r.status == "skip"}
    assert "parity_masked" in skipped and "takes no attention mask" in skipped["parity_masked"]
    assert "parity_cross" in skipped
    assert report["parity_self"].status == "pass" and report["gradcheck[plain]"].status == "pass"


def test_torchs_call_form_is_read_as_true_means_blocked():
    adapter = _target(CORPUS / "torchlike_correct.py")
    assert adapter.form.torch_form and adapter.convention == "block" and adapter.masks.polarity == "block"
    assert adapter.masks.layout in ("b1qk", "bhqk")  # per-sequence masks it broadcasts right
    report = run_checks(adapter, checks=["mask_semantics", "parity_masked", "attention_weights"])
    assert report.ok and report["mask_semantics"].measured == "True = blocked"


def test_a_mask_read_the_other_way_is_named():
    """Told that its bool masks mean True = may attend, torch's convention is a finding, checked the module's own way."""
    adapter = _target(CORPUS / "torchlike_correct.py", mask_convention="keep")
    report = run_checks(adapter, checks=FAST)
    assert [r.name for r in report.failures] == ["mask_semantics"]  # every other row ran in its own reading
    assert [c.id for c in report.diagnosis] == ["mask_polarity"]
    assert "--mask-convention block" in report.diagnosis[0].fix


# -- where nothing catalogued fits: the first stage that diverges --------------------------------
class DoubledValues(nn.Module):
    """A mistake outside the catalogue: the weighted sum is taken over 2 V."""

    def __init__(self, embed_dim: int = 32, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(embed_dim, embed_dim) for _ in range(4))

    def forward(self, query, key, value, attn_mask=None):
        B, T, E = query.shape
        H = self.num_heads
        q = self.q_proj(query).view(B, -1, H, E // H).transpose(1, 2)
        k = self.k_proj(key).view(B, -1, H, E // H).transpose(1, 2)
        v = self.v_proj(value).view(B, -1, H, E // H).transpose(1, 2)
        w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(E // H), dim=-1)
        return self.out_proj((w @ (2 * v)).transpose(1, 2).reshape(B, T, E))


def test_an_uncatalogued_mistake_is_located_at_its_first_diverging_stage():
    torch.manual_seed(0)
    report = run_checks(DoubledValues(), checks=["parity_self"])
    (cause,) = report.diagnosis
    assert cause.id == "stage"
    assert cause.found.startswith("your q, k, v, q_heads, k_heads, v_heads, scores, scaled, weights match")
    assert "your context does not" in cause.found


# -- the reference these hypotheses stand on ------------------------------------------------------
@pytest.mark.parametrize("G", [4, 2, 1])
def test_the_textbook_recipe_is_the_reference(G):
    g = torch.Generator().manual_seed(1)
    m = ProbedAdapter(_gqa(G))
    x, kv = torch.randn(2, 7, 32, generator=g), torch.randn(2, 5, 32, generator=g)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, -2:] = True
    keep = torch.rand(2, 7, 7, generator=g) > 0.5
    cases = [((x, kv, kv), {}), ((x, x, x), {"is_causal": True, "key_padding_mask": pad, "keep_mask": keep})]
    heads = {"num_heads": 4, "num_kv_heads": G, "scale": m.scale}
    for inputs, masks in cases:
        want = reference_attention(m.projections(), *inputs, **heads, **masks)
        got = recipe_attention(m.projections(), *inputs, recipe=Recipe(), **heads, **masks)["out"]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _gqa(G: int) -> nn.Module:
    torch.manual_seed(0)
    spec = importlib.util.spec_from_file_location("gqa_correct", CORPUS / "gqa_correct.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MultiHeadAttention(32, 4, G)


def test_every_numerical_mistake_changes_the_output():
    """A catalogued mistake indistinguishable from the textbook formula on these probes could never be named."""
    m = ProbedAdapter(_gqa(2))
    g = torch.Generator().manual_seed(2)
    x, k, v = (torch.randn(2, t, 32, generator=g) for t in (7, 5, 5))
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, -2:] = True
    heads = {"num_heads": 4, "num_kv_heads": 2, "scale": m.scale}
    # a module that turns Q and K by position (rotary, as attnlab.check.dataflow reads it): the mistakes in that
    # map need one to show
    turned = replace(m.projections(), rotary=Rotary(((0, 4), (1, 5), (2, 6), (3, 7)), (1.0, 0.1, 0.01, 0.001)))
    # ... and one whose scores take a bias by position (ALiBi: -slope * distance, the slopes 1/2, 1/4, ...)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)[:, None, None]
    alibi = {(tq, tk): (-slopes * (torch.arange(tq)[:, None] + tk - tq - torch.arange(tk)).abs(), torch.zeros(1))
             for tq, tk in ((7, 5), (7, 7))}  # fmt: skip
    biased = replace(m.projections(), score_map=ScoreMap(lambda *_: None, None, biases=alibi))  # type: ignore[arg-type, return-value]
    for mistake in (mm for mm in MISTAKES if mm.recipe is not None):
        p = turned if mistake.recipe.rotary != "qk" or mistake.recipe.rotary_crossed else m.projections()
        p = biased if mistake.recipe.position_bias != "right" else p
        gaps = []
        keep = torch.rand(2, 7, 7, generator=g) > 0.5
        cases = [
            ((x, k, v), {}),
            ((x, x, x), {"is_causal": True}),
            ((x, x, x), {"key_padding_mask": pad}),
            ((x, x, x), {"keep_mask": keep}),
        ]
        for inputs, masks in cases:
            want = recipe_attention(p, *inputs, **heads, **masks)["out"]
            try:
                got = recipe_attention(p, *inputs, recipe=mistake.recipe, **heads, **masks)["out"]
            except RuntimeError:  # a shape it cannot make: K through q_proj with fewer K/V heads, say
                gaps.append(math.inf)
                continue
            gaps.append(float((got - want).abs().max()) if got.shape == want.shape else math.inf)
        assert max(gaps) > 1e-3, mistake.id


# -- bad targets ------------------------------------------------------------------------------------
def _error(capsys, target: str) -> str:
    assert main(["check", "--target", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: --target") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_targets_get_one_line_naming_the_path_and_the_fix(capsys, tmp_path):
    assert "there is no file 'nope.py'" in _error(capsys, "nope.py:MultiHeadAttention")
    assert "names a file but not what to build in it; add ':ClassName'" in _error(
        capsys, f"{CORPUS / 'seed002_correct.py'}"
    )
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\n\nx = 1\nraise RuntimeError('oops')\n")
    assert f"importing {broken} raised RuntimeError at line 4: oops" in _error(capsys, f"{broken}:M")
    err = _error(capsys, f"{CORPUS / 'seed002_correct.py'}:Attention")
    assert "defines no 'Attention' (nn.Module classes: MultiHeadAttention)" in err
    odd = tmp_path / "odd.py"
    odd.write_text(
        "from torch import nn\n\nclass M(nn.Module):\n    def __init__(self, embed_dim, num_heads, rotary_base):\n"
        "        super().__init__()\n"
    )
    assert "M() needs 'rotary_base', which check cannot guess" in _error(capsys, f"{odd}:M")
    mlp = tmp_path / "mlp.py"
    mlp.write_text(
        "from torch import nn\n\nclass MLP(nn.Module):\n    def __init__(self, dim=32):\n        super().__init__()\n"
        "        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)\n"
        "    def forward(self, x):\n        return self.down(self.up(x))\n"
    )
    assert "MLP has no recognisable q/k/v/out projections (nn.Linear children found: up (32->128), down (128->32))" in (
        _error(capsys, f"{mlp}:MLP")
    )
    wrong = tmp_path / "wrong.py"
    wrong.write_text(
        "import torch\nfrom torch import nn\n\nclass A(nn.Module):\n    def __init__(self, embed_dim, num_heads):\n"
        "        super().__init__()\n        self.num_heads = num_heads\n"
        "        self.q, self.k, self.v, self.o = (nn.Linear(embed_dim, embed_dim) for _ in range(4))\n"
        "    def forward(self, q, k, v):\n        return self.o(q).sum(-1)\n"
    )
    assert "is not attention as check reads it: called on query/key/value of shape [2, 7, 32] it returned [2, 7]" in (
        _error(capsys, f"{wrong}:A")
    )


def test_the_gallery_is_the_catalogue():
    import sys

    root = Path(__file__).parent.parent
    sys.path.insert(0, str(root / "scripts"))
    from check_gallery import corpus_examples

    from attnlab.check.catalogue import gallery_markdown

    gallery = root / "docs" / "check_gallery.md"
    assert gallery.read_text() == gallery_markdown(corpus_examples(root)), "run: python scripts/check_gallery.py"
    for m in MISTAKES:
        assert f"## `{m.id}`" in gallery.read_text()


@pytest.mark.parametrize(
    ("broken", "cause"),
    [
        ("NoScale", "scale_missing"),
        ("MaskAfterSoftmax", "mask_after_softmax"),
        ("CausalOffByOne", "causal_sees_next"),
        ("MergeWithoutTranspose", "merge_without_transpose"),
        ("NaNOnFullyMaskedRows", "fully_masked_nan"),
        ("DropoutInEval", "dropout_in_eval"),
        ("WrongBackward", "wrong_backward"),
        ("LossyLowPrecision", "low_precision_loss"),
        ("PaddingIgnored", "stage"),  # it zeroes the padded values, so no catalogued formula fits: located instead
    ],
)
def test_the_broken_tiny_modules_are_diagnosed(broken, cause):
    """test_check.py's one-method breaks of a correct TinyAttention, each diagnosed."""
    import test_check

    torch.manual_seed(0)
    report = run_checks(getattr(test_check, broken)(), checks=FAST)
    assert report.diagnosis[0].id == cause, [(c.id, c.found) for c in report.diagnosis]
    if cause == "stage":
        assert (
            "your masked does not: 42 of the 42 pairs the mask blocks keep a finite score" in report.diagnosis[0].found
        )


def test_the_check_guides_run_of_the_seed_module_is_its_real_output(capsys, monkeypatch, tmp_path):
    """docs/howto/check.md shows seed 002's module checked unchanged; its verdict and Likely cause are this run's."""
    page = (Path(__file__).parent.parent / "docs" / "howto" / "check.md").read_text()
    start = page.index("$ attnlab check --target mine.py:MultiHeadAttention\n")
    shown = page[start : page.index("```", start)]
    (tmp_path / "mine.py").write_text((CORPUS / "seed002_as_published.py").read_text())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    # it computes attention right: it passes, its three causes printed as hardening notes
    assert main(["check", "--target", "mine.py:MultiHeadAttention"]) == 0
    out = capsys.readouterr().out
    tail = shown[shown.index("OK:") :]
    assert out[out.index("OK:") :].split() == tail.split()


def test_the_tutorial_says_what_check_says():
    """docs/check_tutorial.md is generated by scripts/check_tutorial.py; each break it shows is still named so."""
    page = (Path(__file__).parent.parent / "docs" / "check_tutorial.md").read_text()
    shown = re.findall(
        r"--target tests/mistake_corpus/(\w+)\.py:MultiHeadAttention\n(?:(?!```).)*?\n1\. (.*?) \[(\w+)\]", page, re.S
    )
    assert len(shown) == 3
    for stem, found, cause in shown:
        report = run_checks(_target(CORPUS / f"{stem}.py"), checks=FAST)
        assert report.diagnosis[0].id == cause
        assert " ".join(report.diagnosis[0].found.split()) == " ".join(found.split())


def test_a_factory_in_a_file_gets_the_sizes_under_its_own_names(capsys, tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text(
        f"import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('base', {str(CORPUS / 'seed000_correct.py')!r})\n"
        "base = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(base)\n\n"
        "def make(d_model, n_heads, dropout_p=0.0):\n    return base.MultiHeadAttention(d_model, n_heads, dropout_p)\n"
    )
    code = main(["check", "--target", f"{mine}:make", "--embed-dim", "24", "--num-heads", "3", "--json",
                 "--checks", "parity_self", "parity_head_dims"])  # fmt: skip
    report = json.loads(capsys.readouterr().out)["reports"][0]
    assert code == 0 and report["config"]["embed_dim"] == 24 and report["config"]["num_heads"] == 3
    head_dims = next(r for r in report["results"] if r["name"] == "parity_head_dims")
    assert head_dims["status"] == "pass" and "rebuilt with H=3, G=3" in head_dims["detail"]  # rebuilt through make()
