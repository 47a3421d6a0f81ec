"""``attnlab check`` on tests/style_corpus_fresh6/: six more styles no other corpus covers, written to measure the gap.

The corpus holds attention written the way Meta's OPT (the query scaled right after ``q_proj``, heads folded into
the batch for ``bmm``, a ``key_value_states`` argument), IBM's Granite (a config's ``attention_multiplier`` as the
scale, grouped K/V, rotary the module owns), OpenFold / AlphaFold 2 (``Attention(c_q, c_k, c_v, c_hidden,
no_heads)``, the output gated by ``sigmoid(linear_g(q_x))`` before ``linear_o``, AlphaFold's zero "final" and
"gating" initialisers, additive ``biases``), Meta's ESM-2 (fairseq's time-first module with rotary on the folded
``(B * H, T, D)`` heads and ``q *= scaling``), Adept's Persimmon (a fused ``query_key_value`` laid out
``(B, T, H, 3, D)``, a LayerNorm per head on q and k, rotary on half of each head) and Google's Gemma 3 (its own
``head_dim`` and ``query_pre_attn_scalar``, ``1 + weight`` RMS norms on q and k, a causal mask the module builds
with a sliding window) write it: a correct module per style, one mistake each and each mistake's repaired twin.

Two parts:

* **ground truth**: each module against the float64 loop reference (``loop_attention`` of
  test_check_fresh2_styles.py: a softmax over the kept keys of q.k / sqrt(D) (+ a bias), times v), fed with its own
  weights read in its own layout, norms and gate, and rotary tables worked out here from the angles
  ``t * base ** (-2p / d)``: a correct or repaired module matches on every call (to 1e-10, or to float32's rounding
  where its source runs the softmax or the RMS norm in float32), a mistake misses by more than 1e-3 on at least one;
* **check**: each module built as ``attnlab check --target FILE:TARGET`` builds it and judged: a correct module or
  twin passes, a mistake fails with its mistake named first.

What they exposed in check, by cause: a module causal by itself only when handed no mask (Gemma 3's own mask) had
its causal rows run with check's mask, so a mistake in its own mask passed; a rotary table built at the keys' length
(ESM-2) raised on cross-attention of other lengths and was reported as a crash; a constructor of five sizes no list
names (OpenFold) was refused; all-zero output and gate weights (AlphaFold's inits) left the output a constant; and
a qk-norm after a per-head packed projection (Persimmon) was found neither as a map nor through it, so the rows were
cut in thirds. Not yet: OpenFold's output gate (NOT_YET below).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.check import run_checks
from attnlab.check.target import build_target
from test_check_diagnosis import FAST
from test_check_fresh2_styles import halves
from test_check_fresh2_styles import run_cases as fresh2_cases
from test_check_fresh3_styles import check_cases, declares_its_ground_truth, twins_are_the_correct_code
from test_check_fresh4_styles import F64, B, Case, D, E, H, Heads, T, ready, reference, to_heads, whole, x_in
from test_style_corpus_truth import declared
from test_style_corpus_wild_truth import additive, causal_keep, pad_keep, tf

CORPUS = Path(__file__).parent / "style_corpus_fresh6"
FILES = sorted(CORPUS.glob("*.py"))
STYLES = ("opt", "granite", "openfold", "esm", "persimmon", "gemma3")
G = 2  # K/V heads where the style groups them
S = 5  # keys of a cross-attention call
EXACT, VISIBLE = 1e-10, 1e-3
IN_FLOAT32 = {"granite", "esm", "persimmon", "gemma3"}  # a softmax or a norm in float32, as the source writes it
FLOAT32_EXACT = 1e-6

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- per-style drivers


def tables(d: int, base: float, t: int = T) -> tuple[Tensor, Tensor]:
    """Rotary (cos, sin), each (t, d / 2): pair p turned at position t by t * base ** (-2p / d)."""
    angle = torch.arange(t, dtype=F64)[:, None] * base ** (-2 * torch.arange(d // 2, dtype=F64)[None, :] / d)
    return angle.cos(), angle.sin()


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMS norm over the last axis: x / sqrt(mean(x^2) + eps) * (1 + weight)."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def cases_opt(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = ready(mod.OPTAttention(mod.OPTConfig(hidden_size=E, num_attention_heads=H)))
    p = (whole(m.q_proj), whole(m.k_proj), whole(m.v_proj), m.out_proj)
    x, ctx, pad, causal = x_in(), x_in(1, S), pad_keep(), causal_keep()
    keep = causal & pad[:, None, None]
    cross_pad = pad_keep(S, (3, 5))[:, None, None]
    return m, [
        ("no mask", lambda: m(x), reference(x, x, x, *p)),
        ("additive (B,1,T,T) causal + padding", lambda: m(x, attention_mask=additive(keep)), reference(x, x, x, *p, keep)),
        ("key_value_states, additive (B,1,1,S)", lambda: m(x, key_value_states=ctx, attention_mask=additive(cross_pad)),
         reference(x, ctx, ctx, *p, cross_pad)),
    ]  # fmt: skip


def cases_granite(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    cfg = mod.GraniteConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=G, rope_theta=10000.0)
    m = ready(mod.GraniteAttention(cfg))
    rope = halves(tables(D, 10000.0))
    p = (
        lambda x: rope(whole(m.q_proj)(x)),
        lambda x: rope(whole(m.k_proj)(x)),
        whole(m.v_proj),
        m.o_proj,
    )
    x, causal = x_in(), causal_keep()
    keep = causal & pad_keep()[:, None, None]
    return m, [
        ("no mask", lambda: m(x), reference(x, x, x, *p)),
        ("additive (B,1,T,T) causal + padding", lambda: m(x, attention_mask=additive(keep)), reference(x, x, x, *p, keep)),
    ]  # fmt: skip


def cases_openfold(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.Attention(E, E, E, D, H)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # AlphaFold's "final" and "gating" inits are zero matrices: drawn, so that both act
        m.linear_o.weight.copy_(torch.randn(m.linear_o.weight.shape, generator=g) / math.sqrt(E))
        m.linear_g.weight.copy_(torch.randn(m.linear_g.weight.shape, generator=g) / math.sqrt(E))
    m = ready(m)

    def gated(xq: Tensor):  # o (B, T, H * D) gated per channel by the query's sigmoid(linear_g), then linear_o
        return lambda y: m.linear_o(y * torch.sigmoid(m.linear_g(xq)))

    p = (whole(m.linear_q), whole(m.linear_k), whole(m.linear_v))
    x, ctx = x_in(), x_in(1, S)
    pad = pad_keep(S, (3, 5))[:, None, None]  # (B, 1, 1, S)
    pair = torch.randn(1, H, T, S, generator=g, dtype=F64)
    return m, [
        ("self, no biases", lambda: m(x, x), reference(x, x, x, *p, gated(x))),
        ("cross, a mask bias inf * (mask - 1)", lambda: m(x, ctx, [1e9 * (pad.double() - 1)]), reference(x, ctx, ctx, *p, gated(x), pad)),
        ("cross, mask and pair biases", lambda: m(x, ctx, [1e9 * (pad.double() - 1), pair]),
         reference(x, ctx, ctx, *p, gated(x), pad, bias=pair[0])),
    ]  # fmt: skip


def cases_esm(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = ready(mod.MultiheadAttention(E, H, self_attention=True))
    rope = halves(tables(D, 10000.0))
    p = (lambda x: rope(whole(m.q_proj)(x)), lambda x: rope(whole(m.k_proj)(x)), whole(m.v_proj), m.out_proj)
    x, pad, causal = x_in(), pad_keep(), causal_keep()
    return m, [
        ("time-first, no mask", lambda: tf(m(tf(x), tf(x), tf(x))[0]), reference(x, x, x, *p)),
        ("key_padding_mask (B,S) True = pad", lambda: tf(m(tf(x), tf(x), tf(x), key_padding_mask=~pad)[0]),
         reference(x, x, x, *p, pad[:, None, None])),
        ("attn_mask additive (T,S) causal", lambda: tf(m(tf(x), tf(x), tf(x), attn_mask=additive(causal))[0]),
         reference(x, x, x, *p, causal)),
    ]  # fmt: skip


def persimmon_rows(role: str) -> list[int]:
    """The query_key_value rows of one role: per head h, rows h * 3D + at * D ... + D (layout (H, 3, D))."""
    at = {"q": 0, "k": 1, "v": 2}[role]
    return [h * 3 * D + at * D + i for h in range(H) for i in range(D)]


def cases_persimmon(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = ready(mod.PersimmonAttention(mod.PersimmonConfig(hidden_size=E, num_attention_heads=H)))
    w, b = m.query_key_value.weight, m.query_key_value.bias
    rope = halves(tables(D // 2, 25000.0))  # the first D / 2 features only: pairs (p, p + D / 4)

    def role(name: str, norm: nn.LayerNorm | None) -> Heads:
        rows = persimmon_rows(name)

        def heads(x: Tensor) -> Tensor:
            y = to_heads(F.linear(x, w[rows], b[rows]))
            return y if norm is None else rope(F.layer_norm(y, (D,), norm.weight, norm.bias, norm.eps))

        return heads

    p = (role("q", m.q_layernorm), role("k", m.k_layernorm), role("v", None), m.dense)
    x, causal = x_in(), causal_keep()
    keep = causal & pad_keep()[:, None, None]
    return m, [
        ("no mask", lambda: m(x), reference(x, x, x, *p)),
        ("additive (B,1,T,T) causal + padding", lambda: m(x, attention_mask=additive(keep)), reference(x, x, x, *p, keep)),
    ]  # fmt: skip


def cases_gemma3(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    cfg = mod.Gemma3TextConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=G, head_dim=D)
    m = ready(mod.Gemma3Attention(cfg, layer_idx=0))
    short = ready(mod.Gemma3Attention(mod.Gemma3TextConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=G, head_dim=D, sliding_window=3)))  # fmt: skip
    rope = halves(tables(D, 10000.0))

    def normed(mm: nn.Module, layer: nn.Linear, norm: nn.Module) -> Heads:
        return lambda x: rope(rms(whole(layer)(x), norm.weight, norm.eps))

    def parts(mm: nn.Module):
        return (normed(mm, mm.q_proj, mm.q_norm), normed(mm, mm.k_proj, mm.k_norm), whole(mm.v_proj), mm.o_proj)

    x, causal = x_in(), causal_keep()
    window = causal & ~torch.ones(T, T, dtype=torch.bool).tril(-3)  # key j in (i - 3, i]
    keep = causal & pad_keep()[:, None, None]
    return m, [
        ("its own causal mask", lambda: m(x), reference(x, x, x, *parts(m), causal)),
        ("its own mask, a sliding window of 3", lambda: short(x), reference(x, x, x, *parts(short), window)),
        ("additive (B,1,T,T) causal + padding", lambda: m(x, attention_mask=additive(keep)), reference(x, x, x, *parts(m), keep)),
    ]  # fmt: skip


DRIVERS = {s: globals()[f"cases_{s}"] for s in STYLES}


# ----------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_declares_its_ground_truth(path: Path) -> None:
    declares_its_ground_truth(path, STYLES)


def test_repaired_twins_are_the_correct_code_and_differ_from_their_mistake_in_a_few_lines() -> None:
    twins_are_the_correct_code(FILES, CORPUS)


def test_the_corpus_covers_its_styles_and_no_other_corpus_does() -> None:
    assert {declared(p)["STYLE"] for p in FILES} == set(STYLES) and len(FILES) >= 18
    assert all((CORPUS / f"{s}_correct.py").exists() for s in STYLES)
    others = {declared(p).get("STYLE") for p in CORPUS.parent.glob("style_corpus*/*.py") if p.parent != CORPUS}
    assert not others & set(STYLES)


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


def test_the_reference_reads_persimmon_s_per_head_triples_as_the_module_splits_them() -> None:
    """Persimmon's rows: the module's own split of an index vector gives the rows the reference reads."""
    mod = __import__("test_style_corpus_wild_truth").load(CORPUS / "persimmon_correct.py")
    m = mod.PersimmonAttention(mod.PersimmonConfig(hidden_size=E, num_attention_heads=H))
    index = torch.arange(3 * E, dtype=F64)[None, None]  # (1, 1, 3E): the value of each output is its row
    for got, role in zip(m._split_heads(index), ("q", "k", "v"), strict=True):  # each (1, 1, H, D)
        assert got.reshape(-1).long().tolist() == persimmon_rows(role)
    assert B == 2 and T == 7 and S != T  # the sizes the drivers' masks are built for


# ----------------------------------------------------------------------------- check


# What check does not yet get right here, by cause; strict expected failures
NOT_YET: dict[str, str] = {
    # rows packed per head (B, T, H, 3, D) are read by data flow, each role by its use: Q and K taking each other's
    # rows is then a correct module with other rows, and no order within a head's triple is held to
    "persimmon_qkv_split_order": "per-head packed rows are read by use: a (key, query, value) unpacking passes",
}
QUICK = {"opt_merge_without_transpose", "esm_correct", "gemma3_causal_hides_self"}
CASES = check_cases(FILES, QUICK, NOT_YET)


@pytest.mark.parametrize("path", CASES)
def test_a_fresh6_style_is_judged_by_what_it_computes(path: Path) -> None:
    c = declared(path)
    adapter = build_target(f"{path}:{c['TARGET']}", embed_dim=E, num_heads=H, num_kv_heads=None, dropout=0.0, seed=0)
    report = run_checks(adapter, checks=FAST)
    ids = [cause.id for cause in report.diagnosis]
    want = c["EXPECTED"]
    failures = [(r.name, r.detail) for r in report.failures]
    assert report.ok == (want == "pass"), (failures, ids)
    if want != "pass":
        assert ids[:1] == [want], (ids, failures)


# What the call line says of each style read by experiment: the words that show it was read as written
CALL_WORDS = {
    # ESM-2's rotary tables are built at the keys' length and cut to the queries': other lengths raise
    "esm_correct": "keys of another length than the queries raise (one position table for both)",
    # Attention(c_q, c_k, c_v, c_hidden, no_heads): five sizes tried, the one with (E, E) matrices kept; AlphaFold's
    # zero "final" and "gating" weights redrawn, else the output is a constant any mistake matches
    "openfold_correct": "linear_o, linear_g all zero: redrawn, seeded",
    # the fused (B, T, H, 3, D) rows read through the LayerNorms on q and k (taken out, then read)
    "persimmon_correct": "q query_key_value.weight[32 rows from 0 to 79]; k query_key_value.weight[32 rows from 8 to 87]",
}


@pytest.mark.parametrize("stem", list(CALL_WORDS))
def test_the_call_form_is_read_by_experiment(stem: str) -> None:
    path = CORPUS / f"{stem}.py"
    adapter = build_target(f"{path}:{declared(path)['TARGET']}", embed_dim=E, num_heads=H, num_kv_heads=None, dropout=0.0, seed=0)  # fmt: skip
    said = " ".join((adapter.describe_call() or "").split())
    assert CALL_WORDS[stem] in said, said
    if stem == "esm_correct":
        assert not adapter.supports_cross_attention


def test_gemma3_s_own_causal_mask_is_the_one_checked() -> None:
    """Causal when handed no mask, the handed mask alone otherwise: check's causal rows call it with no mask, so
    that its own mask (the mistake's triu(diagonal=0)) is what they measure."""
    path = CORPUS / "gemma3_causal_hides_self.py"
    adapter = build_target(f"{path}:Gemma3Attention", embed_dim=E, num_heads=H, num_kv_heads=None, dropout=0.0, seed=0)
    assert adapter.causal_unless_masked and not adapter.always_causal
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(1)).to(adapter.projections().q_weight)
    own = adapter(x, x, x, is_causal=True)
    handed = adapter.module(x, attention_mask=None)[0]
    assert torch.equal(own, handed)
