"""``attnlab check`` on tests/style_corpus_fresh2/: thirteen more styles, including maps of the scores before the softmax.

The corpus holds attention written the way Megatron-LM (sequence-first, per-head fused ``query_key_value``,
``baddbmm`` with alpha = 1/norm_factor), Hugging Face's GPT-J (``rotate_every_two`` on the first rotary_dim
features), BLOOM (ALiBi added through ``baddbmm``'s beta), Phi (partial rotary, ``dense``), Gemma-2 (grouped-query,
logit soft-capping ``tanh(s / 50) * 50``), GPTBigCode/StarCoder (multi-query: a fused ``c_attn`` of H query heads,
one key and one value head, the heads folded into the query axis) and jeonsworld's ViT-pytorch
(``transpose_for_scores``), Hugging Face's RoFormer (interleaved rotary on every feature from a fixed sinusoidal
table), Megatron-core (sequence-first grouped-query ``linear_qkv``, causal only without a mask), Hugging Face's
BART (a 2D ``attention_mask`` expanded inside by ``_expand_mask``), and three with score maps of their own:
MosaicML's llm-foundry MPT (ALiBi as a (1, H, 1, S) bias), lucidrains' x-transformers (T5's bucketed relative
bias, a learned table) and Grok-1 (a tanh cap of 30 on grouped logits): correct modules, one-mistake modules and
each mistake's repaired twin.

Two parts:

* **ground truth**: each module against a float64 loop reference written here (its own weights read in its own
  layout, its rotary tables, its ALiBi bias or soft-cap where it has one): a correct or repaired module matches to
  1e-10 on every call, a mistake misses by more than 1e-3 on at least one;
* **check**: each module built as ``attnlab check --target FILE:TARGET`` builds it and judged: a correct module or
  twin passes, a mistake fails with its mistake named first (a departure for those the catalogue lacks). A module
  whose scores pass through a map (``POSITIONS``: ALiBi, a relative bias, soft-capping) is judged against the
  reference with the map check read off it: it passes when right, and says which map it saw.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.check import run_checks
from attnlab.check.catalogue import MISTAKES
from attnlab.check.probe import as_adapter
from attnlab.check.target import build_target
from test_check_diagnosis import FAST
from test_style_corpus_truth import declared
from test_style_corpus_wild_truth import Lin, causal_keep, first, lin, load, pad_keep, per_head_rows, rows, split

CORPUS = Path(__file__).parent / "style_corpus_fresh2"
FILES = sorted(CORPUS.glob("*.py"))
STYLES = (
    "megatron", "gptj", "bloom", "phi", "gemma2", "bigcode", "vit", "mpt", "xtransformers", "grok", "roformer", "mcore",
    "bart",
)  # fmt: skip
# mistakes the catalogue does not name: check says where the module departs instead
UNNAMED: set[str] = set()
B, E, H, D, T = 2, 32, 4, 8, 7
LENGTHS = (4, 7)
EXACT, VISIBLE = 1e-10, 1e-3
F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")

Case = tuple[str, Callable[[], object], Tensor]
Tables = tuple[Tensor, Tensor]  # (cos, sin), each (T, pairs): the module's own rotary tables, per position and pair


# ----------------------------------------------------------------------------- the loop reference


def loop_attention(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor, *, bias: Tensor | None = None, cap: float | None = None
) -> Tensor:
    """q, k, v (B, H, T, D); keep bool broadcastable to (B, H, T, T), True = may attend; bias (H, T, T) added to
    the scaled scores; cap: the scores become cap * tanh(s / cap) (after the bias, before the mask).

    For each batch row, head and query, over the kept keys only: s = q.k / sqrt(D) (+ bias), soft-capped, then
    softmax, then the weighted sum of the values. Returns (B, H, T, D)."""
    b_, h_, t_, d_ = q.shape
    keep = keep.expand(b_, h_, t_, k.shape[2])
    out = torch.zeros(b_, h_, t_, v.shape[-1], dtype=q.dtype)
    for bi, hi, i in itertools.product(range(b_), range(h_), range(t_)):
        cols = keep[bi, hi, i].nonzero().flatten()
        s = k[bi, hi, cols] @ q[bi, hi, i] / math.sqrt(d_) + (0.0 if bias is None else bias[hi, i, cols])
        s = s if cap is None else cap * torch.tanh(s / cap)
        out[bi, hi, i] = torch.softmax(s, dim=0) @ v[bi, hi, cols]
    return out


def rotate(x: Tensor, tables: Tables, first_of: Callable[[int], int], second_of: Callable[[int], int]) -> Tensor:
    """x (B, heads, T, D) with pair p = (first_of(p), second_of(p)) turned at position t by the angle whose cosine
    and sine are tables[.][t, p]: (a, b) -> (a cos - b sin, a sin + b cos). Features in no pair pass through."""
    cos, sin = tables
    out = x.clone()
    for t in range(x.shape[2]):
        for p in range(cos.shape[1]):
            i, j = first_of(p), second_of(p)
            a, b = x[:, :, t, i], x[:, :, t, j]
            out[:, :, t, i] = a * cos[t, p] - b * sin[t, p]
            out[:, :, t, j] = a * sin[t, p] + b * cos[t, p]
    return out


def adjacent(tables: Tables) -> Callable[[Tensor], Tensor]:
    """Rotary on adjacent pairs (2p, 2p + 1) (GPT-J's rotate_every_two)."""
    return lambda x: rotate(x, tables, lambda p: 2 * p, lambda p: 2 * p + 1)


def halves(tables: Tables) -> Callable[[Tensor], Tensor]:
    """Rotary on pairs (p, p + P) of the first 2P features (rotate_half)."""
    n = tables[0].shape[1]
    return lambda x: rotate(x, tables, lambda p: p, lambda p: p + n)


def reference(
    x: Tensor,
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    keep: Tensor,
    *,
    kv_heads: int = H,
    rotary: Callable[[Tensor], Tensor] | None = None,
    bias: Tensor | None = None,
    cap: float | None = None,
) -> Tensor:
    """Self-attention of batch-first x by the loop reference; K/V heads each repeated in place to H."""
    qh, kh, vh = split(x, q, H), split(x, k, kv_heads), split(x, v, kv_heads)
    if rotary is not None:
        qh, kh = rotary(qh), rotary(kh)
    kh, vh = kh.repeat_interleave(H // kv_heads, dim=1), vh.repeat_interleave(H // kv_heads, dim=1)
    out = loop_attention(qh, kh, vh, keep, bias=bias, cap=cap)
    return F.linear(out.transpose(1, 2).flatten(2), *o)


def x_in(seed: int = 0) -> Tensor:
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed), dtype=F64)


def alibi(slopes: list[float]) -> Tensor:
    """(H, T, T): slope_h * j, the key's position (softmax forgets the row's constant: -slope * (i - j) alike)."""
    j = torch.arange(T, dtype=F64)
    return torch.tensor(slopes, dtype=F64)[:, None, None] * j.expand(T, T)


# ----------------------------------------------------------------------------- per-style drivers


def cases_megatron(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.ParallelAttention(mod.TransformerConfig())
    m = m.double().eval()
    w = m.query_key_value.weight, m.query_key_value.bias
    p = (per_head_rows(*w, 0), per_head_rows(*w, 1), per_head_rows(*w, 2), lin(m.dense))
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    run = lambda mask=None: m(x.transpose(0, 1), mask)[0].transpose(0, 1)
    return m, [
        ("causal", run, reference(x, *p, causal)),
        ("causal + padding [b,1,sq,sk] True = masked", lambda: run(~pad[:, None, None, :].expand(B, 1, T, T)),
         reference(x, *p, causal & pad[:, None, None])),
    ]  # fmt: skip


def cases_gptj(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.GPTJAttention(mod.GPTJConfig()).double().eval()
    p = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.out_proj))
    table = m.embed_positions[:T].double()  # (T, rotary_dim): sin | cos, one per pair
    half = table.shape[1] // 2
    rope = adjacent((table[:, half:], table[:, :half]))
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    fill = torch.zeros(B, 1, 1, T, dtype=F64).masked_fill(~pad[:, None, None], torch.finfo(F64).min)
    return m, [
        ("causal", lambda: m(x), reference(x, *p, causal, rotary=rope)),
        ("causal + HF additive padding", lambda: m(x, fill), reference(x, *p, causal & pad[:, None, None], rotary=rope)),
    ]  # fmt: skip


def cases_bloom(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.BloomAttention(mod.BloomConfig()).double().eval()
    w = m.query_key_value.weight, m.query_key_value.bias
    p = (per_head_rows(*w, 0), per_head_rows(*w, 1), per_head_rows(*w, 2), lin(m.dense))
    bias = alibi([2.0 ** (-8 * (h + 1) / H) for h in range(H)])  # BLOOM's slopes for a power-of-2 head count
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    return m, [
        ("causal", lambda: m(x), reference(x, *p, causal, bias=bias)),
        ("causal + 2D padding 1 keep", lambda: m(x, pad.long()), reference(x, *p, causal & pad[:, None, None], bias=bias)),
    ]  # fmt: skip


def _hf_tables(m: nn.Module) -> Tables:
    """The cos/sin a Hugging Face rotary module makes for positions 0..T-1, one column per pair."""
    cos, sin = m.rotary_emb(torch.zeros(1, dtype=F64), torch.arange(T)[None])
    n = cos.shape[-1] // 2
    return cos[0, :, :n].double(), sin[0, :, :n].double()


def cases_phi(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.PhiAttention(mod.PhiConfig(), layer_idx=0).double().eval()
    p = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.dense))
    rope = halves(_hf_tables(m))
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    return m, [
        ("causal", lambda: m(x), reference(x, *p, causal, rotary=rope)),
        ("causal + 2D padding", lambda: m(x, pad.long()), reference(x, *p, causal & pad[:, None, None], rotary=rope)),
    ]  # fmt: skip


def cases_gemma2(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    cfg = mod.Gemma2Config()
    m = mod.Gemma2Attention(cfg, layer_idx=0).double().eval()
    p = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.o_proj))
    rope = halves(_hf_tables(m))
    kw = {"kv_heads": cfg.num_key_value_heads, "rotary": rope, "cap": cfg.attn_logit_softcapping}
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    keep = causal & pad[:, None, None]
    fill = torch.zeros(B, 1, T, T, dtype=F64).masked_fill(~keep, torch.finfo(F64).min)
    loud = x_in(1) * 6.0  # scores large enough for the cap to bite
    return m, [
        ("causal", lambda: m(x), reference(x, *p, causal, **kw)),
        ("HF extended causal + padding", lambda: m(x, fill), reference(x, *p, keep, **kw)),
        ("causal, large scores", lambda: m(loud), reference(loud, *p, causal, **kw)),
    ]  # fmt: skip


def cases_bigcode(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.GPTBigCodeAttention(mod.GPTBigCodeConfig()).double().eval()
    w, b = m.c_attn.weight, m.c_attn.bias
    q = w[:E], b[:E]
    k, v = ((w[E + i * D : E + (i + 1) * D], b[E + i * D : E + (i + 1) * D]) for i in (0, 1))
    p = (q, k, v, lin(m.c_proj))
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    return m, [
        ("causal", lambda: m(x), reference(x, *p, causal, kv_heads=1)),
        ("causal + 2D padding", lambda: m(x, pad.long()), reference(x, *p, causal & pad[:, None, None], kv_heads=1)),
    ]  # fmt: skip


def cases_vit(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.Attention(mod.get_b16_config(), vis=True).double().eval()
    p = (lin(m.query), lin(m.key), lin(m.value), lin(m.out))
    x = x_in()
    return m, [("no mask", lambda: m(x), reference(x, *p, torch.ones(T, T, dtype=torch.bool)))]


def cases_mpt(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.MultiheadAttention().double().eval()
    w = m.Wqkv.weight, m.Wqkv.bias
    p = (rows(*w, 0), rows(*w, 1), rows(*w, 2), lin(m.out_proj))
    bias = alibi([2.0 ** (-8 * (h + 1) / H) for h in range(H)])  # llm-foundry's slopes for a power-of-2 head count
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    return m, [
        ("causal", lambda: m(x), reference(x, *p, causal, bias=bias)),
        ("causal + 2D padding True keep", lambda: m(x, pad), reference(x, *p, causal & pad[:, None, None], bias=bias)),
    ]  # fmt: skip


def t5_bucket(rel: int, buckets: int, max_distance: int) -> int:
    """T5's bidirectional bucket of a key ``rel`` = j - i positions after its query: half the buckets for keys
    after it; exact below buckets / 4, then logarithmic up to max_distance, the last bucket beyond."""
    half = buckets // 2
    exact = half // 2
    n = abs(rel)
    if n < exact:
        return half * (rel > 0) + n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (half - exact))
    return half * (rel > 0) + min(far, half - 1)


def cases_xtransformers(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.Attention().double().eval()
    rp = m.rel_pos
    table = rp.relative_attention_bias.weight.double()  # (buckets, H)
    idx = [[t5_bucket(j - i, rp.num_buckets, rp.max_distance) for j in range(T)] for i in range(T)]
    bias = table[torch.tensor(idx)].permute(2, 0, 1)  # (H, T, T)
    p = (lin(m.to_q), lin(m.to_k), lin(m.to_v), lin(m.to_out))
    x, pad, every = x_in(), pad_keep(T, LENGTHS), torch.ones(T, T, dtype=torch.bool)
    return m, [
        ("no mask", lambda: m(x), reference(x, *p, every, bias=bias)),
        ("2D padding True keep", lambda: m(x, pad), reference(x, *p, every & pad[:, None, None], bias=bias)),
    ]  # fmt: skip


def cases_grok(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.MultiHeadAttention().double().eval()
    p = (lin(m.query), lin(m.key), lin(m.value), lin(m.linear))
    kw = {"kv_heads": m.num_kv_heads, "cap": 30.0}
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    loud = x_in(1) * 6.0  # scores large enough for the cap to bite
    return m, [
        ("causal", lambda: m(x), reference(x, *p, causal, **kw)),
        ("causal + 2D padding 1 keep", lambda: m(x, pad.long()), reference(x, *p, causal & pad[:, None, None], **kw)),
        ("causal, large scores", lambda: m(loud), reference(loud, *p, causal, **kw)),
    ]  # fmt: skip


def cases_roformer(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.RoFormerSelfAttention(mod.RoFormerConfig()).double().eval()
    p = (lin(m.query), lin(m.key), lin(m.value), lin(m.output_dense))
    table = m.embed_positions.weight[:T].double()  # (T, D): the sines of the D/2 pair angles, then their cosines
    rope = adjacent((table[:, D // 2 :], table[:, : D // 2]))
    x, pad = x_in(), pad_keep(T, LENGTHS)
    fill = torch.zeros(B, 1, 1, T, dtype=F64).masked_fill(~pad[:, None, None], torch.finfo(F64).min)
    return m, [
        ("no mask", lambda: m(x), reference(x, *p, torch.ones(T, T, dtype=torch.bool), rotary=rope)),
        ("HF additive padding", lambda: m(x, fill), reference(x, *p, pad[:, None, None], rotary=rope)),
    ]  # fmt: skip


def cases_mcore(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    cfg = mod.TransformerConfig()
    m = mod.SelfAttention(cfg).double().eval()
    G, per = cfg.num_query_groups, H // cfg.num_query_groups
    w = m.linear_qkv.weight.view(G, per + 2, D, E)  # per query group: its query heads, its key head, its value head
    b = m.linear_qkv.bias.view(G, per + 2, D)
    part = lambda rows: (w[:, rows].reshape(-1, E), b[:, rows].reshape(-1))
    p = (part(slice(0, per)), part(per), part(per + 1), lin(m.linear_proj))
    x, pad, causal = x_in(), pad_keep(T, LENGTHS), causal_keep(T)
    keep = causal & pad[:, None, None]  # (B, 1, T, T)
    run = lambda mask=None: m(x.transpose(0, 1), mask)[0].transpose(0, 1)
    return m, [
        ("causal (no mask)", run, reference(x, *p, causal, kv_heads=G)),
        ("its own [b,1,sq,sk] mask True = masked: causal + padding", lambda: run(~keep), reference(x, *p, keep, kv_heads=G)),
    ]  # fmt: skip


def cases_bart(mod: ModuleType) -> tuple[nn.Module, list[Case]]:
    m = mod.BartAttention().double().eval()
    p = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.out_proj))
    x, pad = x_in(), pad_keep(T, LENGTHS)
    return m, [
        ("no mask", lambda: m(x), reference(x, *p, torch.ones(T, T, dtype=torch.bool))),
        ("HF 2D padding 1 keep", lambda: m(x, attention_mask=pad.long()), reference(x, *p, pad[:, None, None])),
    ]  # fmt: skip


DRIVERS = {s: globals()[f"cases_{s}"] for s in STYLES}


def run_cases(
    path: Path, drivers: dict[str, Callable[[ModuleType], tuple[nn.Module, list[Case]]]] | None = None
) -> list[tuple[str, float | Exception]]:
    """Each case of the file's style driver (of ``drivers``, this corpus's by default): its gap to the reference."""
    mod = load(path)
    torch.manual_seed(0)
    m, cases = (drivers or DRIVERS)[mod.STYLE](mod)
    assert type(m).__name__ == mod.TARGET
    results: list[tuple[str, float | Exception]] = []
    with torch.no_grad():
        for label, call, want in cases:
            try:
                got = first(call())
            except Exception as err:  # a mistake may break one call; the others must still show it
                results.append((label, err))
                continue
            assert got.shape == want.shape, f"{path.name} [{label}]: {tuple(got.shape)}, want {tuple(want.shape)}"
            results.append((label, (got - want).abs().nan_to_num(nan=math.inf).max().item()))
    return results


# ----------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_declares_its_ground_truth(path: Path) -> None:
    c = declared(path)
    assert {"EXPECTED", "TARGET", "STYLE", "CALL"} <= c.keys(), path.name
    assert c["STYLE"] in STYLES and path.stem.startswith(c["STYLE"] + "_")
    expected = c["EXPECTED"]
    assert expected == "pass" or expected in {m.id for m in MISTAKES} | UNNAMED, expected
    doc = path.read_text().split('"""', 2)[1]
    assert ("Mistake: none" in doc) == (expected == "pass"), path.name
    if expected != "pass":
        assert path.stem == f"{c['STYLE']}_{expected}" and "Line:" in doc, path.name
        assert path.with_name(f"{path.stem}_repaired.py").exists(), path.name
    elif path.stem.endswith("_repaired"):
        assert path.name.replace("_repaired", "") in doc, path.name


def test_repaired_twins_are_the_correct_code_and_differ_from_their_mistake_in_a_few_lines() -> None:
    for path in FILES:
        if not path.stem.endswith("_repaired"):
            continue
        code = path.read_text().split('"""', 2)[2]
        correct = (CORPUS / f"{declared(path)['STYLE']}_correct.py").read_text().split('"""', 2)[2]
        assert code == correct, f"{path.name} is not the correct module's code"
        mistake = path.with_name(path.name.replace("_repaired", "")).read_text().split('"""', 2)[2]
        changed = set(mistake.splitlines()) ^ set(code.splitlines())
        assert 2 <= len(changed) <= 12, f"{path.name}: {len(changed)} lines differ from its mistake"  # + EXPECTED


def test_the_corpus_covers_its_styles() -> None:
    styles = Counter(declared(p)["STYLE"] for p in FILES)
    assert set(styles) == set(STYLES) and len(FILES) >= 16
    assert all((CORPUS / f"{s}_correct.py").exists() for s in STYLES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_against_the_loop_reference(path: Path) -> None:
    results = run_cases(path)
    table = "; ".join(f"{label}: {r if isinstance(r, Exception) else f'{r:.2e}'}" for label, r in results)
    if declared(path)["EXPECTED"] == "pass":
        assert all(not isinstance(r, Exception) and r <= EXACT for _, r in results), f"{path.name}: {table}"
    else:
        worst = max((r for _, r in results if not isinstance(r, Exception)), default=0.0)
        assert worst > VISIBLE, f"{path.name} matches the reference: {table}"


def test_the_loop_reference_is_sdpa_and_its_maps_are_what_they_say() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=F64) for _ in range(3))
    keep = causal_keep(T)
    assert (loop_attention(q, k, v, keep) - F.scaled_dot_product_attention(q, k, v, attn_mask=keep)).abs().max() < EXACT
    bias = alibi([0.5, 0.25, 0.125, 0.0625])  # ALiBi as the key's position: the same as -slope * distance
    dist = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).to(F64)
    shifted = -torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)[:, None, None] * dist
    assert (loop_attention(q, k, v, keep, bias=bias) - loop_attention(q, k, v, keep, bias=shifted)).abs().max() < EXACT
    big = 1e6  # a cap far above the scores changes nothing
    assert (loop_attention(q, k, v, keep, cap=big) - loop_attention(q, k, v, keep)).abs().max() < 1e-9
    angles = torch.rand(T, 2, generator=g, dtype=F64)
    tables = (angles.cos(), angles.sin())
    x = torch.randn(1, 1, T, 4, generator=g, dtype=F64)
    for rope in (adjacent(tables), halves(tables)):  # a rotation: norms kept
        assert torch.allclose(rope(x).norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(adjacent(tables)(x), halves(tables)(x))


# ----------------------------------------------------------------------------- check


# What check does not yet get right here, by cause; strict expected failures (none since the score maps and the
# sequence-first merge were read by data flow, 7 December 2026)
NOT_YET: dict[str, str] = {}


QUICK = {f"{s}_correct" for s in STYLES} | {"vit_merge_without_transpose", "phi_softmax_query_axis"}
CASES = [
    pytest.param(
        p,
        id=p.stem,
        marks=[
            *([] if p.stem in QUICK else [pytest.mark.slow]),
            *([pytest.mark.xfail(strict=True, reason=NOT_YET[p.stem])] if p.stem in NOT_YET else []),
        ],
    )
    for p in FILES
]


@pytest.mark.parametrize("path", CASES)
def test_a_fresh_style_is_judged_by_what_it_computes(path: Path) -> None:
    c = declared(path)
    adapter = build_target(f"{path}:{c['TARGET']}", embed_dim=E, num_heads=H, num_kv_heads=None, dropout=0.0, seed=0)
    if "(T,B,E)" in c["CALL"]:
        assert "(T, B, E) inputs" in (adapter.describe_call() or "")
    report = run_checks(adapter, checks=FAST)
    ids = [cause.id for cause in report.diagnosis]
    want = c["EXPECTED"]
    failures = [(r.name, r.detail) for r in report.failures]
    if "POSITIONS" in c:  # a map of the scores: read off the module, said, and applied by the reference
        said = {"alibi": "ALiBi-style bias", "relative": "a bias set by the positions", "softcap": "soft-cap"}
        assert said[c["POSITIONS"]] in (adapter.describe_call() or ""), adapter.describe_call()
    assert report.ok == (want == "pass"), (failures, ids)
    if want != "pass":
        assert ids[:1] in ((["stage"], []) if want in UNNAMED else ([want],)), (ids, failures)


class _Mapped(nn.Module):
    """Self-attention whose scaled scores pass through a learned bias by relative position (``where``: inside the
    scale, after it, inside a soft-cap of ``cap``) or through a bias set by the input's values (``content``), the
    cap before or after a -inf mask; ``forward(x, mask=None)``, mask (B, T) True = keep."""

    def __init__(self, where: str, cap: float | None = None, cap_after_mask: bool = False) -> None:
        super().__init__()
        self.num_heads, self.where, self.cap, self.cap_after_mask = H, where, cap, cap_after_mask
        self.qkv, self.proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.table = nn.Parameter(torch.randn(H, 2 * T + 1))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b_, t_, _ = x.shape
        q, k, v = self.qkv(x).view(b_, t_, 3, H, D).permute(2, 0, 3, 1, 4)
        rel = (torch.arange(t_)[None, :] - torch.arange(t_)[:, None]).clamp(-T, T) + T
        bias = self.table[:, rel] if self.where != "content" else x.mean(-1)[:, None, None, :]
        s = (q @ k.transpose(-1, -2) + bias) * D**-0.5 if self.where == "inside" else q @ k.transpose(-1, -2) * D**-0.5
        s = s + bias if self.where in ("after", "content") else s
        cap = (lambda s: s) if self.cap is None else (lambda s: self.cap * torch.tanh(s / self.cap))
        s = s if self.cap_after_mask else cap(s)
        s = s if mask is None else s.masked_fill(~mask[:, None, None, :], float("-inf"))
        s = cap(s) if self.cap_after_mask else s
        return self.proj((s.softmax(-1) @ v).transpose(1, 2).reshape(b_, t_, E))


@pytest.mark.parametrize(
    ("where", "cap", "after"),
    [("inside", None, False), ("inside", 5.0, False), ("after", 20.0, True), ("content", None, False)],
)
def test_a_bias_by_position_is_replayed_wherever_it_is_added_and_one_by_value_is_a_departure(
    where: str, cap: float | None, after: bool
) -> None:
    torch.manual_seed(0)
    adapter = as_adapter(_Mapped(where, cap, after))
    found = adapter.projections().score_map
    report = run_checks(adapter, checks=["parity_self", "parity_masked", "odd_lengths"])
    if where == "content":  # not set by the positions alone: not absorbed, the module departs at its scores
        assert found is None and not report.ok and report.diagnosis[0].id == "stage"
        return
    assert found is not None and found.positional and report.ok, [(r.name, r.detail) for r in report.failures]
    assert found.cap is None if cap is None else abs(found.cap - cap) < 1e-4 * cap
