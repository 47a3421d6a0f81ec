"""Ground truth for tests/style_corpus_wild/: each correct module is attention, each mistake visibly is not.

The corpus holds modules written in 20 styles that no other corpus here covers (fairseq, Whisper, Stable Diffusion's
ldm, the Mistral reference, x-transformers, lucidrains' rotary-embedding-torch, OpenNMT-py, ESPnet, labml.ai,
Segment Anything, "LLMs from scratch", the UvA tutorials, Karpathy's "Let's build GPT",
``F.multi_head_attention_forward``, flash-attention's MHA, GPT-NeoX, CLIP, Swin, Falcon and a Chinese blog): per
style one correct module, one-mistake modules, and for each mistake its repaired twin (the same code with that
mistake fixed).

Every file is built at E=32, H=4 (G=2 K/V heads for Mistral, 1 for Falcon), D=8, float64, eval mode, dropout 0, and called by a
small driver per style that knows its call form and mask convention (time-first, keyword-only, key/value/query
order, additive, 0/1, HF extended, (B*H)-folded inside). The reference is written here as explicit loops over batch,
head and query: a softmax over the kept keys of q.k / sqrt(D), times v, with the module's own projection weights read
in its own layout, and rotary embeddings applied the way the style applies them (adjacent pairs or halves, on all or
the first features). Sequence lengths are T=7 (self), T_q=6 and S=5 (cross), none equal to D, so that no
length-dependent mistake hides behind T == D. A correct or repaired module must match to 1e-10 on every input; a
mistake module must miss by more than 1e-3 on at least one.

Notation: B batch, T/T_q query length, S key length, E width, H heads, G K/V heads, D = E // H head width.
"""

from __future__ import annotations

import ast
import importlib.util
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.check.catalogue import MISTAKES
from test_style_corpus_truth import declared  # the module-level string constants, read from the source

CORPUS = Path(__file__).parent / "style_corpus_wild"
FILES = sorted(CORPUS.glob("*.py"))
# ids the lead adds to the catalogue with this corpus (issue 50, point 8)
NEW_IDS = {
    "scale_k_only",
    "scale_by_length",
    "v_uses_q_proj",
    "masked_fill_zero",
    "rotary_on_values",
    "rotary_q_only",
    "rotary_wrong_axis",
}
B, E, H, G, D, T, T_Q, S = 2, 32, 4, 2, 8, 7, 6, 5
IN = 24  # an input width other than E, for the styles whose input and attention widths differ
LENGTHS, LENGTHS_S = (4, 7), (3, 5)  # real keys per sequence; every query keeps at least one key
EXACT, VISIBLE = 1e-10, 1e-3
F64 = torch.float64

# tiny tensors: one thread, so that OpenMP does not spin against other processes on a shared machine
pytestmark = pytest.mark.usefixtures("one_thread")

Lin = tuple[Tensor, Tensor | None]  # (weight, bias) of one projection
Rotary = Callable[[Tensor], Tensor]  # (B, heads, T, D) -> the same, rotated by position along dim 2
Case = tuple[str, Callable[[], object], Tensor]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"style_corpus_wild_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- the loop reference


def loop_attention(q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """q (B, H, T_q, D), k and v (B, H, S, D), keep bool broadcastable to (B, H, T_q, S), True = may attend.

    For each batch row, head and query: the scores q.k / sqrt(D) over the kept keys only, their softmax, and the
    weighted sum of those keys' values. Returns (B, H, T_q, D)."""
    b, h, t_q, d = q.shape
    s = k.shape[2]
    keep = torch.ones(b, h, t_q, s, dtype=torch.bool) if keep is None else keep.expand(b, h, t_q, s)
    out = torch.zeros(b, h, t_q, v.shape[-1], dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(t_q):
                cols = keep[bi, hi, i].nonzero().flatten()
                assert len(cols) > 0, "the reference is only asked about rows that keep a key"
                scores = k[bi, hi, cols] @ q[bi, hi, i] / math.sqrt(d)
                w = torch.exp(scores - scores.max())
                out[bi, hi, i] = (w / w.sum()) @ v[bi, hi, cols]
    return out


def split(x: Tensor, p: Lin, heads: int) -> Tensor:
    """(B, T, in) -> (B, heads, T, width // heads) through the projection p."""
    y = F.linear(x, *p)
    return y.view(y.shape[0], y.shape[1], heads, -1).transpose(1, 2)


def attend(
    xq: Tensor,
    xk: Tensor,
    xv: Tensor,
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    keep: Tensor | None = None,
    *,
    heads: int = H,
    kv_heads: int | None = None,
    rotary: Rotary | None = None,
) -> Tensor:
    """Multi-head attention on batch-first inputs with these projections, by the loop reference. Returns (B, T_q, E).

    K/V heads are each repeated in place (kv0 kv0 kv1 kv1) after the rotary map, which rotates q and k only."""
    g = kv_heads or heads
    qh, kh, vh = split(xq, q, heads), split(xk, k, g), split(xv, v, g)
    if rotary is not None:
        qh, kh = rotary(qh), rotary(kh)
    kh, vh = kh.repeat_interleave(heads // g, dim=1), vh.repeat_interleave(heads // g, dim=1)
    out = loop_attention(qh, kh, vh, keep)  # (B, H, T_q, D)
    return F.linear(out.transpose(1, 2).flatten(2), *o)


def rotary_pairs(inv_freq: Tensor, rot_dim: int) -> Rotary:
    """Rotary on adjacent feature pairs (2p, 2p+1) of the first rot_dim features, by angle position * inv_freq[p]."""

    def rotate(x: Tensor) -> Tensor:
        out = x.clone()
        for t in range(x.shape[2]):
            for p in range(rot_dim // 2):
                c, s = math.cos(t * inv_freq[p].item()), math.sin(t * inv_freq[p].item())
                a, b = x[:, :, t, 2 * p], x[:, :, t, 2 * p + 1]
                out[:, :, t, 2 * p], out[:, :, t, 2 * p + 1] = a * c - b * s, a * s + b * c
        return out

    return rotate


def rotary_halves(inv_freq: Tensor, rot_dim: int) -> Rotary:
    """Rotary on the first rot_dim features, feature i paired with i + rot_dim // 2 (GPT-NeoX's rotate_half)."""
    half = rot_dim // 2

    def rotate(x: Tensor) -> Tensor:
        out = x.clone()
        for t in range(x.shape[2]):
            for p in range(half):
                c, s = math.cos(t * inv_freq[p].item()), math.sin(t * inv_freq[p].item())
                a, b = x[:, :, t, p], x[:, :, t, p + half]
                out[:, :, t, p], out[:, :, t, p + half] = a * c - b * s, a * s + b * c
        return out

    return rotate


def lin(layer: nn.Linear) -> Lin:
    return layer.weight, layer.bias


def rows(weight: Tensor, bias: Tensor | None, index: int, parts: int = 3) -> Lin:
    """One of `parts` consecutive row blocks of a packed projection (q | k | v)."""
    n = weight.shape[0] // parts
    return weight[index * n : (index + 1) * n], None if bias is None else bias[index * n : (index + 1) * n]


def per_head_rows(weight: Tensor, bias: Tensor | None, index: int, heads: int = H) -> Lin:
    """Part `index` (0 q, 1 k, 2 v) of a projection laid out per head, (H, 3, D, in) (GPT-NeoX, the UvA notebook)."""
    w = weight.view(heads, 3, -1, weight.shape[-1])[:, index].flatten(0, 1)
    b = None if bias is None else bias.view(heads, 3, -1)[:, index].flatten()
    return w, b


# ----------------------------------------------------------------------------- inputs and masks


def inputs(seed: int = 0, width: int = E) -> SimpleNamespace:
    """x (B, T, width) for self-attention; q (B, T_q, width), k and v (B, S, width) for cross-attention."""
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        x=torch.randn(B, T, width, generator=g, dtype=F64),
        q=torch.randn(B, T_Q, width, generator=g, dtype=F64),
        k=torch.randn(B, S, width, generator=g, dtype=F64),
        v=torch.randn(B, S, width, generator=g, dtype=F64),
    )


def pad_keep(t: int = T, lengths: tuple[int, ...] = LENGTHS) -> Tensor:
    """(B, t) bool, True = a real key."""
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def causal_keep(t: int = T) -> Tensor:
    """(t, t) bool, True where key j <= query i."""
    return torch.ones(t, t, dtype=torch.bool).tril()


def additive(keep: Tensor, fill: float | None = None) -> Tensor:
    """A bool keep-mask as an additive float64 mask: 0 to keep, fill (default finfo.min) to block."""
    return torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, torch.finfo(F64).min if fill is None else fill)


def tf(x: Tensor) -> Tensor:
    """batch-first <-> time-first."""
    return x.transpose(0, 1)


def first(out: object) -> Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]


def with_attr(obj: object, name: str, value: object, call: Callable[[], object]) -> Callable[[], object]:
    """call() with obj.name set to value for its duration (e.g. a module's causal flag)."""

    def run() -> object:
        before = getattr(obj, name)
        setattr(obj, name, value)
        try:
            return call()
        finally:
            setattr(obj, name, before)

    return run


# ----------------------------------------------------------------------------- per-style drivers
# build(module) -> the target in float64 eval mode's constructor call; cases(m) -> [(label, call, want)].

INF = float("-inf")


def build_fairseq(mod: ModuleType) -> nn.Module:
    return mod.MultiheadAttention(E, H, dropout=0.0)


def cases_fairseq(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.out_proj))
    x, pad, causal = tf(i.x), pad_keep(), causal_keep()
    return [
        ("self, no mask", lambda: m(x, x, x)[0], tf(attend(i.x, i.x, i.x, *w))),
        ("self, key_padding_mask", lambda: m(x, x, x, key_padding_mask=~pad)[0],
         tf(attend(i.x, i.x, i.x, *w, pad[:, None, None]))),
        ("self, attn_mask -inf causal", lambda: m(x, x, x, attn_mask=additive(causal, INF))[0],
         tf(attend(i.x, i.x, i.x, *w, causal))),
        ("self, both", lambda: m(x, x, x, key_padding_mask=~pad, attn_mask=additive(causal, INF))[0],
         tf(attend(i.x, i.x, i.x, *w, causal & pad[:, None, None]))),
        ("cross, key_padding_mask", lambda: m(tf(i.q), tf(i.k), tf(i.v), key_padding_mask=~pad_keep(S, LENGTHS_S))[0],
         tf(attend(i.q, i.k, i.v, *w, pad_keep(S, LENGTHS_S)[:, None, None]))),
    ]  # fmt: skip


def build_whisper(mod: ModuleType) -> nn.Module:
    return mod.MultiHeadAttention(E, H)


def cases_whisper(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.query), lin(m.key), lin(m.value), lin(m.out))
    n_ctx_mask = torch.empty(16, 16, dtype=F64).fill_(INF).triu_(1)  # Whisper's decoder buffer
    return [
        ("self, no mask", lambda: m(i.x)[0], attend(i.x, i.x, i.x, *w)),
        ("self, causal buffer", lambda: m(i.x, mask=n_ctx_mask)[0], attend(i.x, i.x, i.x, *w, causal_keep())),
        ("cross to xa", lambda: m(i.q, xa=i.k)[0], attend(i.q, i.k, i.k, *w)),
    ]


def build_ldm(mod: ModuleType) -> nn.Module:
    return mod.CrossAttention(query_dim=E, heads=H, dim_head=D)


def cases_ldm(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.to_q), lin(m.to_k), lin(m.to_v), lin(m.to_out[0]))
    pad, pad_s = pad_keep(), pad_keep(S, LENGTHS_S)
    return [
        ("self, no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w)),
        ("self, mask (B,T)", lambda: m(i.x, mask=pad), attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("cross, context", lambda: m(i.q, context=i.k), attend(i.q, i.k, i.k, *w)),
        ("cross, context + mask", lambda: m(i.q, context=i.k, mask=pad_s), attend(i.q, i.k, i.k, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_mistral(mod: ModuleType) -> nn.Module:
    return mod.Attention(mod.ModelArgs(dim=E, n_heads=H, n_kv_heads=G, head_dim=D))


def cases_mistral(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.wq), lin(m.wk), lin(m.wv), lin(m.wo))
    theta = m.args.rope_theta
    rope = rotary_pairs(1.0 / theta ** (torch.arange(0, D, 2, dtype=F64) / D), D)
    causal = causal_keep()
    window = causal & ~causal_keep().tril(-3)  # causal, and at most 3 keys back (a sliding window of 3)
    return [
        ("no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w, kv_heads=G, rotary=rope)),
        ("causal -inf", lambda: m(i.x, mask=additive(causal, INF)), attend(i.x, i.x, i.x, *w, causal, kv_heads=G, rotary=rope)),
        ("sliding window 3", lambda: m(i.x, mask=additive(window, INF)), attend(i.x, i.x, i.x, *w, window, kv_heads=G, rotary=rope)),
    ]  # fmt: skip


def build_xtransformers(mod: ModuleType) -> nn.Module:
    return mod.Attention(E, dim_head=D, heads=H)


def cases_xtransformers(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.to_q), lin(m.to_k), lin(m.to_v), lin(m.to_out))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    return [
        ("self, no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w)),
        ("self, mask (B,T)", lambda: m(i.x, mask=pad), attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("self, attn_mask causal", lambda: m(i.x, attn_mask=causal), attend(i.x, i.x, i.x, *w, causal)),
        ("self, causal=True + mask", with_attr(m, "causal", True, lambda: m(i.x, mask=pad)),
         attend(i.x, i.x, i.x, *w, causal & pad[:, None, None])),
        ("cross, context_mask", lambda: m(i.q, context=i.k, context_mask=pad_s),
         attend(i.q, i.k, i.k, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_lucidrotary(mod: ModuleType) -> nn.Module:
    return mod.Attention(E, heads=H, dim_head=D)


def cases_lucidrotary(m: nn.Module) -> list[Case]:
    i = inputs()
    qkv = m.to_qkv.weight
    w = (rows(qkv, None, 0), rows(qkv, None, 1), rows(qkv, None, 2), lin(m.to_out))
    rope = rotary_pairs(m.rotary_emb.inv_freq, D // 2)
    pad, causal = pad_keep(), causal_keep()
    return [
        ("no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w, rotary=rope)),
        ("mask (B,T)", lambda: m(i.x, mask=pad), attend(i.x, i.x, i.x, *w, pad[:, None, None], rotary=rope)),
        ("causal=True", with_attr(m, "causal", True, lambda: m(i.x)), attend(i.x, i.x, i.x, *w, causal, rotary=rope)),
        ("causal=True + mask", with_attr(m, "causal", True, lambda: m(i.x, mask=pad)),
         attend(i.x, i.x, i.x, *w, causal & pad[:, None, None], rotary=rope)),
    ]  # fmt: skip


def build_opennmt(mod: ModuleType) -> nn.Module:
    return mod.MultiHeadedAttention(H, E, dropout=0.0)


def cases_opennmt(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.linear_query), lin(m.linear_keys), lin(m.linear_values), lin(m.final_linear))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    dec = causal[None] & pad[:, None, :]  # (B, T, T) keep
    return [
        ("self, no mask", lambda: m(i.x, i.x, i.x)[0], attend(i.x, i.x, i.x, *w)),
        ("self, padding (B,1,T) True = pad", lambda: m(i.x, i.x, i.x, mask=~pad[:, None, :])[0],
         attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("decoder (B,T,T) True = masked", lambda: m(i.x, i.x, i.x, mask=~dec)[0], attend(i.x, i.x, i.x, *w, dec[:, None])),
        ("cross: key, value, query order", lambda: m(i.k, i.v, i.q, mask=~pad_s[:, None, :])[0],
         attend(i.q, i.k, i.v, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_espnet(mod: ModuleType) -> nn.Module:
    return mod.MultiHeadedAttention(H, E, 0.0)


def cases_espnet(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.linear_q), lin(m.linear_k), lin(m.linear_v), lin(m.linear_out))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    dec = causal[None] & pad[:, None, :]  # (B, T, T) keep
    return [
        ("self, mask None", lambda: m(i.x, i.x, i.x, None), attend(i.x, i.x, i.x, *w)),
        ("self, (B,1,T) bool", lambda: m(i.x, i.x, i.x, pad[:, None, :]), attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("self, (B,1,T) 0/1 float", lambda: m(i.x, i.x, i.x, pad[:, None, :].double()),
         attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("decoder, (B,T,T) bool", lambda: m(i.x, i.x, i.x, dec), attend(i.x, i.x, i.x, *w, dec[:, None])),
        ("cross, (B,1,S)", lambda: m(i.q, i.k, i.v, pad_s[:, None, :]), attend(i.q, i.k, i.v, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_labml(mod: ModuleType) -> nn.Module:
    return mod.MultiHeadAttention(H, E, dropout_prob=0.0)


def cases_labml(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.query.linear), lin(m.key.linear), lin(m.value.linear), lin(m.output))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    x = tf(i.x)
    return [
        ("self, no mask", lambda: m(query=x, key=x, value=x), tf(attend(i.x, i.x, i.x, *w))),
        ("self, padding [1,T,B]", lambda: m(query=x, key=x, value=x, mask=pad.T[None]),
         tf(attend(i.x, i.x, i.x, *w, pad[:, None, None]))),
        ("self, causal [T,T,1]", lambda: m(query=x, key=x, value=x, mask=causal[:, :, None]),
         tf(attend(i.x, i.x, i.x, *w, causal))),
        ("cross, padding [1,S,B]", lambda: m(query=tf(i.q), key=tf(i.k), value=tf(i.v), mask=pad_s.T[None]),
         tf(attend(i.q, i.k, i.v, *w, pad_s[:, None, None]))),
    ]  # fmt: skip


def build_sam(mod: ModuleType) -> nn.Module:
    return mod.Attention(E, H, downsample_rate=2)  # the mask decoder's cross-attention: head width 16 // 4 = 4


def cases_sam(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.out_proj))
    pe = inputs(seed=1).k  # a positional encoding added to q and k but not v, as SAM's two-way blocks do
    return [
        ("self", lambda: m(i.x, i.x, i.x), attend(i.x, i.x, i.x, *w)),
        ("cross, separate q, k, v", lambda: m(i.q, i.k, i.v), attend(i.q, i.k, i.v, *w)),
        ("cross, k = keys + pe, v = keys", lambda: m(i.q, i.k + pe, i.k), attend(i.q, i.k + pe, i.k, *w)),
    ]


def build_rasbt(mod: ModuleType) -> nn.Module:
    return mod.MultiHeadAttention(d_in=IN, d_out=E, context_length=16, dropout=0.0, num_heads=H)


def cases_rasbt(m: nn.Module) -> list[Case]:
    i = inputs(width=IN)
    w = (lin(m.W_query), lin(m.W_key), lin(m.W_value), lin(m.out_proj))
    return [
        ("T=7, causal", lambda: m(i.x), attend(i.x, i.x, i.x, *w, causal_keep())),
        ("T=5, causal", lambda: m(i.k), attend(i.k, i.k, i.k, *w, causal_keep(S))),
    ]


def build_uva(mod: ModuleType) -> nn.Module:
    return mod.MultiheadAttention(IN, E, H)


def cases_uva(m: nn.Module) -> list[Case]:
    i = inputs(width=IN)
    qkv_w, qkv_b = lin(m.qkv_proj)
    w = (per_head_rows(qkv_w, qkv_b, 0), per_head_rows(qkv_w, qkv_b, 1), per_head_rows(qkv_w, qkv_b, 2), lin(m.o_proj))
    pad, causal = pad_keep(), causal_keep()
    both = causal[None] & pad[:, None, :]  # (B, T, T)
    return [
        ("no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w)),
        ("causal (T,T) 0/1 long", lambda: m(i.x, mask=causal.long()), attend(i.x, i.x, i.x, *w, causal)),
        ("causal+padding (B,T,T) 0/1 float", lambda: m(i.x, mask=both.double()), attend(i.x, i.x, i.x, *w, both[:, None])),
        ("padding (B,1,1,T) bool", lambda: m(i.x, mask=pad[:, None, None]), attend(i.x, i.x, i.x, *w, pad[:, None, None])),
    ]  # fmt: skip


def build_karpathy(mod: ModuleType) -> nn.Module:
    assert mod.n_embd == E
    return mod.MultiHeadAttention(H, E // H)


def cases_karpathy(m: nn.Module) -> list[Case]:
    i = inputs()

    def stacked(name: str) -> Lin:  # the heads' own Linears, in head order, as one (E, E) projection
        return torch.cat([getattr(h, name).weight for h in m.heads]), None

    w = (stacked("query"), stacked("key"), stacked("value"), lin(m.proj))
    return [
        ("T=7, causal", lambda: m(i.x), attend(i.x, i.x, i.x, *w, causal_keep())),
        ("T=5, causal", lambda: m(i.k), attend(i.k, i.k, i.k, *w, causal_keep(S))),
    ]


def build_torchfunc(mod: ModuleType) -> nn.Module:
    return mod.FunctionalMultiheadAttention(E, H, dropout=0.0)


def cases_torchfunc(m: nn.Module) -> list[Case]:
    i = inputs()
    qkv_w, qkv_b = m.in_proj_weight, m.in_proj_bias
    w = (rows(qkv_w, qkv_b, 0), rows(qkv_w, qkv_b, 1), rows(qkv_w, qkv_b, 2), lin(m.out_proj))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    return [
        ("self, no mask", lambda: m(i.x, i.x, i.x), attend(i.x, i.x, i.x, *w)),
        ("self, key_padding_mask keep bool", lambda: m(i.x, i.x, i.x, key_padding_mask=pad),
         attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("self, key_padding_mask keep 0/1", lambda: m(i.x, i.x, i.x, key_padding_mask=pad.long()),
         attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("self, attn_mask bool True = blocked", lambda: m(i.x, i.x, i.x, attn_mask=~causal),
         attend(i.x, i.x, i.x, *w, causal)),
        ("cross, key_padding_mask", lambda: m(i.q, i.k, i.v, key_padding_mask=pad_s),
         attend(i.q, i.k, i.v, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_flashattn(mod: ModuleType) -> nn.Module:
    return mod.MHA(E, H)


def cases_flashattn(m: nn.Module) -> list[Case]:
    i = inputs()
    qkv_w, qkv_b = lin(m.Wqkv)  # '(three h d)': the q rows first, then k, then v
    w = (rows(qkv_w, qkv_b, 0), rows(qkv_w, qkv_b, 1), rows(qkv_w, qkv_b, 2), lin(m.out_proj))
    pad, causal = pad_keep(), causal_keep()
    return [
        ("no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w)),
        ("key_padding_mask keep", lambda: m(i.x, key_padding_mask=pad), attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("causal", with_attr(m.inner_attn, "causal", True, lambda: m(i.x)), attend(i.x, i.x, i.x, *w, causal)),
        ("causal + padding", with_attr(m.inner_attn, "causal", True, lambda: m(i.x, key_padding_mask=pad)),
         attend(i.x, i.x, i.x, *w, causal & pad[:, None, None])),
    ]  # fmt: skip


def build_neox(mod: ModuleType) -> nn.Module:
    return mod.GPTNeoXAttention(mod.GPTNeoXConfig(hidden_size=E, num_attention_heads=H))


def cases_neox(m: nn.Module) -> list[Case]:
    i = inputs()
    qkv_w, qkv_b = lin(m.query_key_value)
    w = (per_head_rows(qkv_w, qkv_b, 0), per_head_rows(qkv_w, qkv_b, 1), per_head_rows(qkv_w, qkv_b, 2), lin(m.dense))
    rope = rotary_halves(m.rotary_emb.inv_freq, m.rotary_ndims)
    assert m.rotary_ndims == D // 2
    pad, causal = pad_keep(), causal_keep()
    return [
        ("causal", lambda: m(i.x)[0], attend(i.x, i.x, i.x, *w, causal, rotary=rope)),
        ("causal + extended padding (B,1,1,T)", lambda: m(i.x, attention_mask=additive(pad[:, None, None]))[0],
         attend(i.x, i.x, i.x, *w, causal & pad[:, None, None], rotary=rope)),
        ("T=5, causal", lambda: m(i.k)[0], attend(i.k, i.k, i.k, *w, causal_keep(S), rotary=rope)),
    ]  # fmt: skip


def build_clip(mod: ModuleType) -> nn.Module:
    return mod.CLIPAttention(SimpleNamespace(hidden_size=E, num_attention_heads=H, attention_dropout=0.0))


def cases_clip(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.q_proj), lin(m.k_proj), lin(m.v_proj), lin(m.out_proj))
    pad, causal = pad_keep(), causal_keep()
    causal4 = additive(causal[None, None].expand(B, 1, T, T))  # (B, 1, T, T)
    pad4 = additive(pad[:, None, None].expand(B, 1, T, T))
    return [
        ("no mask", lambda: m(i.x)[0], attend(i.x, i.x, i.x, *w)),
        ("causal_attention_mask", lambda: m(i.x, causal_attention_mask=causal4)[0], attend(i.x, i.x, i.x, *w, causal)),
        ("attention_mask padding", lambda: m(i.x, attention_mask=pad4)[0], attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("both", lambda: m(i.x, attention_mask=pad4, causal_attention_mask=causal4)[0],
         attend(i.x, i.x, i.x, *w, causal & pad[:, None, None])),
    ]  # fmt: skip


def build_zhblog(mod: ModuleType) -> nn.Module:
    return mod.MultiHeadAttention(E, H)


def cases_zhblog(m: nn.Module) -> list[Case]:
    i = inputs()
    w = (lin(m.w_q), lin(m.w_k), lin(m.w_v), lin(m.w_combine))
    pad, pad_s, causal = pad_keep(), pad_keep(S, LENGTHS_S), causal_keep()
    return [
        ("self, no mask", lambda: m(i.x, i.x, i.x), attend(i.x, i.x, i.x, *w)),
        ("self, causal (T,T) 0/1", lambda: m(i.x, i.x, i.x, mask=causal.long()), attend(i.x, i.x, i.x, *w, causal)),
        ("self, padding (B,1,1,T) 0/1", lambda: m(i.x, i.x, i.x, mask=pad[:, None, None].long()),
         attend(i.x, i.x, i.x, *w, pad[:, None, None])),
        ("cross, padding (B,1,1,S)", lambda: m(i.q, i.k, i.v, mask=pad_s[:, None, None].long()),
         attend(i.q, i.k, i.v, *w, pad_s[:, None, None])),
    ]  # fmt: skip


def build_swin(mod: ModuleType) -> nn.Module:
    return mod.WindowAttention(E, (2, 3), H)


def cases_swin(m: nn.Module) -> list[Case]:
    """2 images of 2 windows of N = 2 * 3 tokens, folded (image, window) into 4 rows, window index fastest."""
    n_win, n = 2, 6
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * n_win, n, E, generator=g, dtype=F64)  # (nW*B, N, C)
    qkv_w, qkv_b = lin(m.qkv)
    w = (rows(qkv_w, qkv_b, 0), rows(qkv_w, qkv_b, 1), rows(qkv_w, qkv_b, 2), lin(m.proj))
    region = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 2]])  # window 1 straddles three shifted regions
    keep = region[:, :, None] == region[:, None, :]  # (nW, N, N)
    mask = additive(keep, -100.0)  # Swin's fill
    per_row = keep.repeat(2, 1, 1)[:, None]  # (nW*B, 1, N, N): row b * nW + w gets window w's
    return [
        ("no mask", lambda: m(x), attend(x, x, x, *w)),
        ("shifted-window mask (nW,N,N)", lambda: m(x, mask=mask), attend(x, x, x, *w, per_row)),
        ("one image", lambda: m(x[:n_win], mask=mask), attend(x[:n_win], x[:n_win], x[:n_win], *w, keep[:, None])),
    ]


def build_falcon(mod: ModuleType) -> nn.Module:
    return mod.FalconAttention(mod.FalconConfig(hidden_size=E, num_attention_heads=H))


def cases_falcon(m: nn.Module) -> list[Case]:
    i = inputs()
    qkv_w = m.query_key_value.weight  # (H + 2) * D rows: H query heads, then one key head, then one value head
    w = ((qkv_w[:E], None), (qkv_w[E : E + D], None), (qkv_w[E + D :], None), lin(m.dense))
    rope = rotary_halves(m.maybe_rotary.inv_freq, D)
    pad, causal = pad_keep(), causal_keep()
    both = causal & pad[:, None, None]  # (B, 1, T, T)
    return [
        ("no mask", lambda: m(i.x), attend(i.x, i.x, i.x, *w, kv_heads=1, rotary=rope)),
        ("causal bool True = masked", lambda: m(i.x, attention_mask=~causal[None, None].expand(B, 1, T, T)),
         attend(i.x, i.x, i.x, *w, causal, kv_heads=1, rotary=rope)),
        ("causal + padding", lambda: m(i.x, attention_mask=~both), attend(i.x, i.x, i.x, *w, both, kv_heads=1, rotary=rope)),
    ]  # fmt: skip


STYLES = (
    "fairseq", "whisper", "ldm", "mistral", "xtransformers", "lucidrotary", "opennmt", "espnet", "labml", "sam",
    "rasbt", "uva", "karpathy", "torchfunc", "flashattn", "neox", "clip", "zhblog", "swin", "falcon",
)  # fmt: skip
DRIVERS = {s: (globals()[f"build_{s}"], globals()[f"cases_{s}"]) for s in STYLES}


Drivers = dict[str, tuple[Callable[[ModuleType], nn.Module], Callable[[nn.Module], list[Case]]]]


def run_cases(path: Path, drivers: Drivers | None = None) -> list[tuple[str, float | Exception]]:
    """[(label, max abs diff from the reference, or the exception the module raised)] for one corpus file, by its
    style's driver in ``drivers`` (default: this corpus's)."""
    mod = load(path)
    build, cases = (DRIVERS if drivers is None else drivers)[mod.STYLE]
    torch.manual_seed(0)
    m = build(mod).double().eval()
    assert type(m).__name__ == mod.TARGET
    results: list[tuple[str, float | Exception]] = []
    with torch.no_grad():
        for label, call, want in cases(m):
            try:
                got = first(call())
            except Exception as err:  # a mistake may break one call form; the others must still show it
                results.append((label, err))
                continue
            assert got.shape == want.shape, (
                f"{path.name} [{label}]: output {tuple(got.shape)}, want {tuple(want.shape)}"
            )
            diff = (got - want).abs().nan_to_num(nan=math.inf)  # a NaN output is as wrong as can be
            results.append((label, diff.max().item()))
    return results


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_declares_its_ground_truth(path: Path) -> None:
    consts = declared(path)
    missing = {"EXPECTED", "TARGET", "STYLE", "CALL"} - consts.keys()
    assert not missing, f"{path.name} lacks {sorted(missing)}"
    assert consts["STYLE"] in STYLES and path.stem.startswith(consts["STYLE"] + "_")
    known = {m.id for m in MISTAKES} | NEW_IDS
    expected = consts["EXPECTED"]
    assert expected == "pass" or expected in known, f"{path.name}: unknown id {expected!r}"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert ("Mistake: none" in doc) == (expected == "pass"), f"{path.name}: the docstring must say 'Mistake: none.'"
    if expected != "pass":
        assert path.stem == f"{consts['STYLE']}_{expected}" and "Line:" in doc, path.name
    elif path.stem.endswith("_repaired"):  # the twin of an existing mistake file, naming it
        twin = path.with_name(path.name.replace("_repaired", ""))
        assert twin.exists() and twin.name in doc, path.name


def test_repaired_twins_differ_from_their_mistake_only_in_the_mistake() -> None:
    """A repaired twin has the correct module's code; its mistake file differs from that code in a few lines."""
    for path in FILES:
        if not path.stem.endswith("_repaired"):
            continue
        style = declared(path)["STYLE"]
        code = path.read_text().split('"""', 2)[2].replace('EXPECTED = "pass"', "")
        correct = (CORPUS / f"{style}_correct.py").read_text().split('"""', 2)[2].replace('EXPECTED = "pass"', "")
        assert code == correct, f"{path.name} is not the correct module's code"
        mistake = path.with_name(path.name.replace("_repaired", ""))
        changed = set(mistake.read_text().split('"""', 2)[2].splitlines()) ^ set(code.splitlines())
        assert 1 <= len(changed) <= 12, f"{mistake.name}: {len(changed)} lines differ from its repaired twin"


def test_the_corpus_is_wide() -> None:
    """At least 60 modules in at least 15 styles; each style has a correct module and 2-4 mistakes, each twinned."""
    found = [declared(p) for p in FILES]
    assert len(found) >= 60
    styles = Counter(c["STYLE"] for c in found)
    assert set(styles) == set(STYLES) and len(styles) >= 15
    for style in STYLES:
        mine = [(p, c) for p, c in zip(FILES, found, strict=True) if c["STYLE"] == style]
        mistakes = [p for p, c in mine if c["EXPECTED"] != "pass"]
        assert (CORPUS / f"{style}_correct.py").exists(), style
        assert 2 <= len(mistakes) <= 4, (style, mistakes)
        assert all(p.with_name(f"{p.stem}_repaired.py").exists() for p in mistakes), style
    used = {c["EXPECTED"] for c in found}
    assert NEW_IDS <= used, f"new ids without a module: {sorted(NEW_IDS - used)}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_against_reference(path: Path) -> None:
    judge(path, run_cases(path))


def judge(path: Path, results: list[tuple[str, float | Exception]]) -> None:
    """A module declared correct matches the reference on every case; a mistake misses it visibly on one."""
    table = "; ".join(f"{label}: {r if isinstance(r, Exception) else f'{r:.2e}'}" for label, r in results)
    if declared(path)["EXPECTED"] == "pass":
        bad = [(label, r) for label, r in results if isinstance(r, Exception) or r > EXACT]
        assert not bad, f"{path.name} is declared correct but misses the reference: {table}"
    else:
        worst = max((r for _, r in results if not isinstance(r, Exception)), default=0.0)
        assert worst > VISIBLE, f"{path.name} ({declared(path)['EXPECTED']}) matches the reference: {table}"


def test_loop_reference_is_sdpa() -> None:
    """The loop reference agrees with torch's SDPA (masked and not), so that 'matches the reference' means attention."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, t, D, generator=g, dtype=F64) for t in (T_Q, S, S))
    for keep in (None, pad_keep(S, LENGTHS_S)[:, None, None], torch.ones(T_Q, S, dtype=torch.bool).tril()):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        assert (loop_attention(q, k, v, keep) - want).abs().max().item() < EXACT


def test_rotary_references_rotate_by_relative_position() -> None:
    """Both rotary references keep norms, leave position 0 alone, and make q.k depend on j - i only."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=F64) / D)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, D, generator=g, dtype=F64)
    for rope in (rotary_pairs(inv_freq, D), rotary_halves(inv_freq, D)):
        qs, ks = (rope(t.expand(1, 1, T, D).clone()) for t in (a, b))  # one vector at every position
        assert torch.allclose(qs[0, 0, 0], a) and torch.allclose(qs.norm(dim=-1), a.norm().expand(1, 1, T))
        dots = qs[0, 0] @ ks[0, 0].T  # (T, T): [i, j] = rot_i(a) . rot_j(b)
        assert torch.allclose(dots[1:, 1:], dots[:-1, :-1])  # a function of j - i only
        assert (dots[0, 1] - dots[0, 0]).abs() > 1e-3  # and not constant
