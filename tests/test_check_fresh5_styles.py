"""``attnlab check`` on tests/style_corpus_fresh5/: four more styles, written to measure the gap.

The corpus holds attention written the way CodeGen (one ``qkv_proj`` laid out in four model-parallel groups of
query, value and key rows, q and k cast to float32), Phi-3 (one ``qkv_proj`` of H query heads then G key and G value
heads, sliced by position) and mlx-lm's Llama ported to torch (a ``ModelArgs`` dataclass, ``repeat_interleave``)
write it, and Hugging Face's GPT-2 once more (style_corpus_more has its layout) as its source initialises it
(``Conv1D`` weights of std 0.02) with another mistake: a correct module per style, one mistake each and each
mistake's repaired twin.

Two parts:

* **ground truth**: each module against the float64 loop reference (``loop_attention`` of
  test_check_fresh2_styles.py: a softmax over the kept keys of q.k / sqrt(D), times v), fed with its own weights read
  in its own layout: a correct or repaired module matches on every call, a mistake misses by more than 1e-3 on at
  least one. Three styles run a step in float32 as their sources do (CodeGen's q and k, Phi-3's and mlx-lm's
  softmax), so in float64 they match to float32's rounding (1e-6), the others to 1e-10;
* **check**: each module built as ``attnlab check --target FILE:TARGET`` builds it and judged: a correct module or
  twin passes, a mistake fails with its mistake named first.

What they exposed in check, by cause: a float64 data-flow probe that the module's own casts down rounded (CodeGen's
fused rows were then not read, and the correct module was flagged); GPT-2's std-0.02 weights, which leave the scores
at ~0.01 on unit probes, so that a scale mistake moved the output by 6e-4 and fitted no recipe; and V sliced at K's
rows of a fused weight, which read as a correct module with V's rows unused.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor, nn

from attnlab.check import run_checks
from attnlab.check.target import build_target
from test_check_diagnosis import FAST
from test_check_fresh2_styles import run_cases as fresh2_cases
from test_check_fresh3_styles import check_cases, declares_its_ground_truth, twins_are_the_correct_code
from test_check_fresh4_styles import F64, B, Case, D, E, H, T, part, ready, reference, to_heads, whole, x_in
from test_style_corpus_truth import declared
from test_style_corpus_wild_truth import additive, causal_keep, pad_keep

CORPUS = Path(__file__).parent / "style_corpus_fresh5"
FILES = sorted(CORPUS.glob("*.py"))
STYLES = ("hfgpt2", "codegen", "phi3", "mlx")
G = 2  # K/V heads where the style groups them
EXACT, VISIBLE = 1e-10, 1e-3
IN_FLOAT32 = {"codegen", "phi3", "mlx"}  # a step in float32 as the source writes it: exact to its rounding
FLOAT32_EXACT = 1e-6

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- per-style drivers


def conv1d(weight: Tensor, bias: Tensor, start: int, stop: int) -> Callable[[Tensor], Tensor]:
    """GPT-2's Conv1D, weight (in, out): columns start..stop of x @ weight + bias, as heads."""
    return lambda x: to_heads(x @ weight[:, start:stop] + bias[start:stop])


def rows_of(weight: Tensor, rows: list[int]) -> Callable[[Tensor], Tensor]:
    """The heads of the given rows of a bias-free fused projection, in that order."""
    return lambda x: to_heads(x @ weight[rows].T)


def padded(mask_keep: Tensor) -> Tensor:
    """(B, T) keep -> additive (B, 1, 1, T)."""
    return additive(mask_keep[:, None, None])


def cases_hfgpt2(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = ready(mod.GPT2Attention(mod.GPT2Config(n_embd=E, n_head=H, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0)))
    w, b = m.c_attn.weight, m.c_attn.bias
    p = (conv1d(w, b, 0, E), conv1d(w, b, E, 2 * E), conv1d(w, b, 2 * E, 3 * E))
    out = lambda y: y @ m.c_proj.weight + m.c_proj.bias
    # inputs of std 8: with GPT-2's std-0.02 weights, unit inputs leave every score near 0 and every weighting
    # near uniform, where a wrong scale moves the output by only 4e-4
    x, pad, causal = 8 * x_in(), pad_keep(), causal_keep()
    return m, [
        ("always causal", lambda: m(x), reference(x, x, x, *p, out, causal)),
        ("causal + additive padding (B,1,1,T)", lambda: m(x, attention_mask=padded(pad)),
         reference(x, x, x, *p, out, causal & pad[:, None, None])),
    ]  # fmt: skip


def codegen_rows(role: str) -> list[int]:
    """The qkv_proj rows of one role: four model-parallel groups of 3 * E / 4 rows, each [query | value | key]."""
    local, at = E // 4, {"q": 0, "v": 1, "k": 2}[role]
    return [g * 3 * local + at * local + i for g in range(4) for i in range(local)]


def cases_codegen(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = ready(mod.CodeGenAttention(E, H, max_positions=16))
    w = m.qkv_proj.weight
    p = (rows_of(w, codegen_rows("q")), rows_of(w, codegen_rows("k")), rows_of(w, codegen_rows("v")), m.out_proj)
    x, pad, causal = x_in(), pad_keep(), causal_keep()
    return m, [
        ("always causal", lambda: m(x), reference(x, x, x, *p, causal)),
        ("causal + additive padding", lambda: m(x, attention_mask=padded(pad)), reference(x, x, x, *p, causal & pad[:, None, None])),
    ]  # fmt: skip


def cases_phi3(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = ready(mod.Phi3Attention(E, H, G))
    w = m.qkv_proj.weight
    p = (part(w, None, 0, E), part(w, None, E, E + G * D), part(w, None, E + G * D, E + 2 * G * D), m.o_proj)
    x, keep = x_in(), causal_keep() & pad_keep()[:, None, None]  # (B, 1, T, T)
    return m, [
        ("no mask", lambda: m(x), reference(x, x, x, *p)),
        ("additive (B,1,T,T): causal and padding", lambda: m(x, attention_mask=additive(keep)), reference(x, x, x, *p, keep)),
    ]  # fmt: skip


def cases_mlx(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = ready(mod.Attention(mod.ModelArgs(dim=E, n_heads=H, n_kv_heads=G)))
    p = (whole(m.wq), whole(m.wk), whole(m.wv), m.wo)
    x, causal = x_in(), causal_keep()
    return m, [
        ("no mask", lambda: m(x), reference(x, x, x, *p)),
        ("additive causal (L,L)", lambda: m(x, mask=additive(causal)), reference(x, x, x, *p, causal)),
    ]  # fmt: skip


DRIVERS = {s: globals()[f"cases_{s}"] for s in STYLES}


# ----------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_declares_its_ground_truth(path: Path) -> None:
    declares_its_ground_truth(path, STYLES)


def test_repaired_twins_are_the_correct_code_and_differ_from_their_mistake_in_a_few_lines() -> None:
    twins_are_the_correct_code(FILES, CORPUS)


def test_the_corpus_covers_its_styles_and_no_other_corpus_does() -> None:
    assert {declared(p)["STYLE"] for p in FILES} == set(STYLES) and len(FILES) >= 12
    assert all((CORPUS / f"{s}_correct.py").exists() for s in STYLES)
    others = {declared(p).get("STYLE") for p in CORPUS.parent.glob("style_corpus*/*.py") if p.parent != CORPUS}
    assert not others & set(STYLES)
    assert not any(
        "codegen" in p.stem or "phi3" in p.stem or "mlx" in p.stem
        for p in CORPUS.parent.glob("style_corpus*/*.py")
        if p.parent != CORPUS
    )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_against_the_loop_reference(path: Path) -> None:
    c = declared(path)
    results = fresh2_cases(path, DRIVERS)
    table = "; ".join(f"{label}: {r if isinstance(r, Exception) else f'{r:.2e}'}" for label, r in results)
    if c["EXPECTED"] == "pass":
        exact = FLOAT32_EXACT if c["STYLE"] in IN_FLOAT32 else EXACT
        assert all(not isinstance(r, Exception) and r <= exact for _, r in results), f"{path.name}: {table}"
    else:
        worst = max((r for _, r in results if not isinstance(r, Exception)), default=0.0)
        assert worst > VISIBLE, f"{path.name} matches the reference: {table}"


def test_the_reference_reads_codegen_s_groups_as_the_module_splits_them() -> None:
    """CodeGen's rows: the module's own split of an index vector gives the query, value and key rows the reference
    reads, head by head."""
    mod = __import__("test_style_corpus_wild_truth").load(CORPUS / "codegen_correct.py")
    index = torch.arange(3 * E, dtype=F64)[None, None]  # (1, 1, 3E): the value of each qkv_proj output is its row
    split = index.reshape(1, 1, 4, -1)
    query, value, key = torch.split(split, E // 4, dim=-1)
    m = mod.CodeGenAttention(E, H, max_positions=16)
    for got, role in ((query, "q"), (key, "k"), (value, "v")):
        heads = m._split_heads(got, H, D, mp_num=4)  # (1, 1, H, D)
        assert heads.reshape(-1).long().tolist() == codegen_rows(role)
    assert B == 2 and T == 7  # the sizes the drivers' masks are built for


# ----------------------------------------------------------------------------- check


NOT_YET: dict[str, str] = {}
QUICK = {"phi3_v_uses_k_proj", "hfgpt2_scale_head_dim_not_sqrt", "codegen_correct"}
CASES = check_cases(FILES, QUICK, NOT_YET)


@pytest.mark.parametrize("path", CASES)
def test_a_fresh5_style_is_judged_by_what_it_computes(path: Path) -> None:
    c = declared(path)
    adapter = build_target(f"{path}:{c['TARGET']}", embed_dim=E, num_heads=H, num_kv_heads=None, dropout=0.0, seed=0)
    report = run_checks(adapter, checks=FAST)
    ids = [cause.id for cause in report.diagnosis]
    want = c["EXPECTED"]
    failures = [(r.name, r.detail) for r in report.failures]
    assert report.ok == (want == "pass"), (failures, ids)
    if want != "pass":
        assert ids[:1] == [want], (ids, failures)


def test_codegen_s_grouped_rows_are_read_by_data_flow_through_its_float32_casts() -> None:
    path = CORPUS / "codegen_correct.py"
    adapter = build_target(f"{path}:CodeGenAttention", embed_dim=E, num_heads=H, num_kv_heads=None, dropout=0.0, seed=0)
    said = adapter.describe_call() or ""
    assert "weights read by data flow: q qkv_proj.weight[32 rows from 0 to 79]" in " ".join(said.split()), said
