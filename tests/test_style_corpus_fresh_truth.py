"""Ground truth for tests/style_corpus_fresh/: each correct module is attention, each mistake visibly is not.

The corpus holds modules written in nine styles no other corpus here covers: Meta's gpt-fast (fused ``wqkv``, a
``kv_cache`` slot, SDPA with a bool mask), torchtune's MultiHeadAttention (projections handed in as modules,
``forward(x, y)``), DiT/PixArt's timm Attention with qk-norm, Hugging Face's Perceiver cross-attention (latents attend
to inputs), T5 (d_kv, the mask folded into position_bias), mmcv's wrapper of ``nn.MultiheadAttention`` (time-first,
an identity residual), Qwen2 (GQA with biased q/k/v, rotary inside, repeat_kv), Qwen3 (Qwen2's with RMSNorm qk-norm
before the rotary) and a JAX/Flax port (kernels as bare
Parameters, ``einsum('...qhd,...khd->...hqk')``). Per style one correct module, one or two one-mistake modules, and
each mistake's repaired twin (the correct code under the twin's docstring).

Every file is built small (E=32, H=4, G=2 K/V heads where the style groups them, D=8), in float64 and eval mode, and
called by a driver per style that knows its call form and mask convention. The reference is the float64 loop of
tests/test_style_corpus_wild_truth.py (a softmax over the kept keys of q.k / sqrt(D), times v), fed the module's own
weights read in its own layout and its own maps around the product (qk LayerNorms, rotary, the residual). A correct
or repaired module must match to 1e-10 on every input; a mistake must miss by more than 1e-3 on at least one.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.check.catalogue import MISTAKES
from test_style_corpus_truth import declared
from test_style_corpus_wild_truth import (
    F64,
    LENGTHS_S,
    B,
    Case,
    D,
    Drivers,
    E,
    G,
    H,
    Lin,
    S,
    T,
    additive,
    attend,
    causal_keep,
    inputs,
    judge,
    lin,
    loop_attention,
    pad_keep,
    rotary_halves,
    rotary_pairs,
    rows,
    run_cases,
    split,
    tf,
    with_attr,
)

CORPUS = Path(__file__).parent / "style_corpus_fresh"
FILES = sorted(CORPUS.glob("*.py"))
STYLES = ("gptfast", "torchtune", "dit", "perceiver", "t5", "mmcv", "qwen2", "qwen3", "jaxport")

pytestmark = pytest.mark.usefixtures("one_thread")


def _seeded_(*params: Tensor, seed: int = 5) -> None:
    """Overwrite parameters the usual init leaves constant (LayerNorm's 1 and 0, zero biases) with random values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (1.0 if p.ndim and p.abs().sum() else 0.0))


# ----------------------------------------------------------------------------- per-style drivers


def build_gptfast(mod: ModuleType) -> nn.Module:
    return mod.Attention(mod.ModelArgs(dim=E, n_head=H, n_local_heads=G))


def cases_gptfast(m: nn.Module) -> list[Case]:
    i = inputs()
    w = m.wqkv.weight  # q rows (E), then k rows (G*D), then v rows (G*D)
    proj = ((w[:E], None), (w[E : E + G * D], None), (w[E + G * D :], None), lin(m.wo))
    rope = rotary_pairs(1.0 / m.rope_base ** (torch.arange(0, D, 2, dtype=F64) / D), D)
    c7, c5 = causal_keep(), causal_keep(S)
    return [
        ("no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *proj, kv_heads=G, rotary=rope)),
        ("causal bool (1,1,T,T)", lambda: m(i.x, mask=c7[None, None]),
         attend(i.x, i.x, i.x, *proj, c7, kv_heads=G, rotary=rope)),
        ("T=5, causal", lambda: m(i.k, mask=c5[None, None]), attend(i.k, i.k, i.k, *proj, c5, kv_heads=G, rotary=rope)),
    ]  # fmt: skip


def build_torchtune(mod: ModuleType) -> nn.Module:
    return mod.MultiHeadAttention(
        embed_dim=E, num_heads=H, num_kv_heads=G, head_dim=D,
        q_proj=nn.Linear(E, H * D, bias=False), k_proj=nn.Linear(E, G * D, bias=False),
        v_proj=nn.Linear(E, G * D, bias=False), output_proj=nn.Linear(E, E, bias=False),
    )  # fmt: skip


def cases_torchtune(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.output_proj))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    both = causal[None] & pad[:, None, :]  # (B, T, T)
    cross = pad_s[:, None, :].expand(B, 5, S)  # (B, S_x, S_y), 5 queries
    return [
        ("self, no mask: causal", lambda: m(i.x, i.x), attend(i.x, i.x, i.x, *w, causal, kv_heads=G)),
        ("self, is_causal=False", with_attr(m, "is_causal", False, lambda: m(i.x, i.x)),
         attend(i.x, i.x, i.x, *w, kv_heads=G)),
        ("self, mask (B,T,T) causal + padding", lambda: m(i.x, i.x, mask=both),
         attend(i.x, i.x, i.x, *w, both[:, None], kv_heads=G)),
        ("cross, 5 queries, mask (B,5,S)", lambda: m(i.k, i.v, mask=cross),
         attend(i.k, i.v, i.v, *w, cross[:, None], kv_heads=G)),
    ]  # fmt: skip


def build_dit(mod: ModuleType) -> nn.Module:
    m = mod.Attention(E, num_heads=H)
    _seeded_(m.q_norm.weight, m.q_norm.bias, m.k_norm.weight, m.k_norm.bias)
    return m


def cases_dit(m: nn.Module) -> list[Case]:
    i = inputs()
    w, o = m.qkv.weight, lin(m.proj)

    def want(x: Tensor) -> Tensor:
        qh = F.layer_norm(split(x, rows(w, None, 0), H), (D,), m.q_norm.weight, m.q_norm.bias, m.q_norm.eps)
        kh = F.layer_norm(split(x, rows(w, None, 1), H), (D,), m.k_norm.weight, m.k_norm.bias, m.k_norm.eps)
        out = loop_attention(qh, kh, split(x, rows(w, None, 2), H))
        return F.linear(out.transpose(1, 2).flatten(2), *o)

    return [
        ("N=7", lambda: m(i.x), want(i.x)),
        ("N=5", lambda: m(i.k), want(i.k)),
        ("N=7, fused_attn", with_attr(m, "fused_attn", True, lambda: m(i.x)), want(i.x)),
    ]


def build_perceiver(mod: ModuleType) -> nn.Module:
    return mod.PerceiverAttention(E, num_heads=H)


def cases_perceiver(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.query), lin(m.key), lin(m.value), lin(m.dense))
    pad_s = pad_keep(S, LENGTHS_S)
    return [
        ("self", lambda: m(i.x), attend(i.x, i.x, i.x, *w)),
        ("latents attend to inputs", lambda: m(i.q, inputs=i.k), attend(i.q, i.k, i.k, *w)),
        ("latents, inputs_mask (B,M) 1/0", lambda: m(i.q, inputs=i.k, inputs_mask=pad_s.long()),
         attend(i.q, i.k, i.k, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_t5(mod: ModuleType) -> nn.Module:
    return mod.T5Attention(mod.T5Config(d_model=E, d_kv=D, num_heads=H, dropout_rate=0.0))


def cases_t5(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.q), lin(m.k), lin(m.v), lin(m.o))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    dec = causal[None, None] & pad[:, None, None]  # (B, 1, T, T)
    return [
        ("self, no mask", lambda: m(i.x)[0], attend(i.x, i.x, i.x, *w)),
        ("self, padding (B,1,1,T) additive", lambda: m(i.x, mask=additive(pad[:, None, None]))[0],
         attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("decoder (B,1,T,T) additive", lambda: m(i.x, mask=additive(dec))[0], attend(i.x, i.x, i.x, *w, dec)),
        ("cross, key_value_states + padding", lambda: m(i.q, mask=additive(pad_s[:, None, None]), key_value_states=i.k)[0],
         attend(i.q, i.k, i.k, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_mmcv(mod: ModuleType) -> nn.Module:
    return mod.MultiheadAttention(E, H)


def cases_mmcv(m: nn.Module) -> list[Case]:
    i = inputs()
    qkv_w, qkv_b = m.attn.in_proj_weight, m.attn.in_proj_bias
    _seeded_(qkv_b, m.attn.out_proj.bias)
    w = (rows(qkv_w, qkv_b, 0), rows(qkv_w, qkv_b, 1), rows(qkv_w, qkv_b, 2), lin(m.attn.out_proj))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    pos = inputs(seed=1).x
    return [
        ("self: x + attention", lambda: m(tf(i.x)), tf(i.x + attend(i.x, i.x, i.x, *w))),
        ("self, key_padding_mask True = pad", lambda: m(tf(i.x), key_padding_mask=~pad),
         tf(i.x + attend(i.x, i.x, i.x, *w, pad[:, None, None]))),
        ("self, attn_mask bool True = blocked", lambda: m(tf(i.x), attn_mask=~causal),
         tf(i.x + attend(i.x, i.x, i.x, *w, causal))),
        ("self, query_pos on q and k only", lambda: m(tf(i.x), query_pos=tf(pos)),
         tf(i.x + attend(i.x + pos, i.x + pos, i.x, *w))),
        ("cross, key_padding_mask", lambda: m(tf(i.q), tf(i.k), tf(i.v), key_padding_mask=~pad_s),
         tf(i.q + attend(i.q, i.k, i.v, *w, pad_s[:, None, None]))),
    ]  # fmt: skip


def build_qwen2(mod: ModuleType) -> nn.Module:
    return mod.Qwen2Attention(mod.Qwen2Config(hidden_size=E, num_attention_heads=H, num_key_value_heads=G))


def cases_qwen2(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.o_proj))
    rope = rotary_halves(m.rotary_emb.inv_freq, D)
    pad, causal = pad_keep(), causal_keep()
    both = causal[None, None] & pad[:, None, None]  # (B, 1, T, T)
    return [
        ("no mask", lambda: m(i.x)[0], attend(i.x, i.x, i.x, *w, kv_heads=G, rotary=rope)),
        ("causal (B,1,T,T) additive", lambda: m(i.x, attention_mask=additive(causal[None, None].expand(B, 1, T, T)))[0],
         attend(i.x, i.x, i.x, *w, causal, kv_heads=G, rotary=rope)),
        ("causal + padding", lambda: m(i.x, attention_mask=additive(both))[0],
         attend(i.x, i.x, i.x, *w, both, kv_heads=G, rotary=rope)),
    ]  # fmt: skip


def build_qwen3(mod: ModuleType) -> nn.Module:
    m = mod.Qwen3Attention(mod.Qwen3Config(hidden_size=E, num_attention_heads=H, num_key_value_heads=G))
    _seeded_(m.q_norm.weight, m.k_norm.weight)
    return m


def cases_qwen3(m: nn.Module) -> list[Case]:
    i = inputs()
    rope = rotary_halves(m.rotary_emb.inv_freq, D)
    causal = causal_keep()
    eps = m.q_norm.variance_epsilon

    def rms(x: Tensor, weight: Tensor) -> Tensor:  # over the head's D features
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def want(x: Tensor, keep: Tensor | None) -> Tensor:
        qh = rope(rms(split(x, lin(m.q_proj), H), m.q_norm.weight))
        kh = rope(rms(split(x, lin(m.k_proj), G), m.k_norm.weight)).repeat_interleave(H // G, dim=1)
        vh = split(x, lin(m.v_proj), G).repeat_interleave(H // G, dim=1)
        return F.linear(loop_attention(qh, kh, vh, keep).transpose(1, 2).flatten(2), *lin(m.o_proj))

    return [
        ("no mask", lambda: m(i.x)[0], want(i.x, None)),
        ("causal (B,1,T,T) additive", lambda: m(i.x, attention_mask=additive(causal[None, None].expand(B, 1, T, T)))[0],
         want(i.x, causal)),
        ("T=5, no mask", lambda: m(i.k)[0], want(i.k, None)),
    ]  # fmt: skip


def build_jaxport(mod: ModuleType) -> nn.Module:
    m = mod.MultiHeadDotProductAttention(H, E)
    _seeded_(m.query.bias, m.key.bias, m.value.bias, m.out.bias)
    return m


def cases_jaxport(m: nn.Module) -> list[Case]:
    i = inputs()

    def dense(layer: nn.Module) -> Lin:  # kernel (in, H, D) -> a Linear's (H*D, in) weight
        return layer.kernel.flatten(1).T, layer.bias.flatten()

    w = (dense(m.query), dense(m.key), dense(m.value), (m.out.kernel.flatten(0, 1).T, m.out.bias))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    return [
        ("self, no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w)),
        ("self, mask (B,1,1,T)", lambda: m(i.x, mask=pad[:, None, None]), attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("self, causal (1,1,T,T)", lambda: m(i.x, mask=causal[None, None]), attend(i.x, i.x, i.x, *w, causal)),
        ("cross, q k v + mask", lambda: m(i.q, i.k, i.v, mask=pad_s[:, None, None]),
         attend(i.q, i.k, i.v, *w, pad_s[:, None, None])),
    ]  # fmt: skip


DRIVERS: Drivers = {s: (globals()[f"build_{s}"], globals()[f"cases_{s}"]) for s in STYLES}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_declares_its_ground_truth(path: Path) -> None:
    consts = declared(path)
    assert {"EXPECTED", "TARGET", "STYLE", "CALL"} <= consts.keys(), path.name
    assert consts["STYLE"] in STYLES and path.stem.startswith(consts["STYLE"] + "_")
    expected = consts["EXPECTED"]
    assert expected == "pass" or expected in {m.id for m in MISTAKES}, f"{path.name}: unknown id {expected!r}"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert ("Mistake: none" in doc) == (expected == "pass"), path.name
    if expected != "pass":
        assert path.stem == f"{consts['STYLE']}_{expected}" and "Line:" in doc, path.name
    elif path.stem.endswith("_repaired"):
        twin = path.with_name(path.name.replace("_repaired", ""))
        assert twin.exists() and twin.name in doc, path.name


def test_repaired_twins_are_the_correct_code_and_differ_from_their_mistake_in_a_few_lines() -> None:
    def code(p: Path) -> str:
        return p.read_text().split('"""', 2)[2].replace('EXPECTED = "pass"', "")

    for path in FILES:
        if path.stem.endswith("_repaired"):
            assert code(path) == code(CORPUS / f"{declared(path)['STYLE']}_correct.py"), path.name
            mistake = path.with_name(path.name.replace("_repaired", ""))
            changed = set(code(mistake).splitlines()) ^ set(code(path).splitlines())
            assert 1 <= len(changed) <= 8, (mistake.name, changed)


def test_every_style_has_a_correct_module_and_twinned_mistakes() -> None:
    found = Counter(declared(p)["STYLE"] for p in FILES)
    assert set(found) == set(STYLES) and len(FILES) >= 20
    for style in STYLES:
        assert (CORPUS / f"{style}_correct.py").exists(), style
        mistakes = [p for p in FILES if p.stem.startswith(style + "_") and declared(p)["EXPECTED"] != "pass"]
        assert 1 <= len(mistakes) <= 3 and all(p.with_name(f"{p.stem}_repaired.py").exists() for p in mistakes)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_against_reference(path: Path) -> None:
    judge(path, run_cases(path, DRIVERS))
