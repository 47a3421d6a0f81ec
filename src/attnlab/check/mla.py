"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as ``attnlab check`` reads a hand-written one: where its
weights are (:func:`find_mla`), what its sizes are (:class:`MLADims`), how it is called (:class:`MLAAdapter`), and
the paper's equations with each known mistake a switch (:func:`mla_recipe`).

Notation, as :mod:`attnlab.core.mla`: B batch, T positions, E width, H heads, C ``kv_lora_rank`` (the latent),
R ``qk_rope_head_dim`` (one rotary key shared by all heads), N ``qk_nope_head_dim``, Dv ``v_head_dim``,
Q ``q_lora_rank``.

A module is read as MLA when it has, by DeepSeek's names or a common variant: a query projection (``q_proj``,
``wq``, ``W_Q``; or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``), the down-projection of keys and values
(``kv_a_proj_with_mqa`` or ``wkv_a``: E -> C + R; or ``W_DKV`` E -> C with ``W_KR`` E -> R), a norm on the latent
(``kv_a_layernorm``, ``kv_norm``), the up-projection (``kv_b_proj`` or ``wkv_b``: C -> H*(N + Dv), per head W_UK
over W_UV; or ``W_UK`` and ``W_UV``), and an output projection (``o_proj``, ``wo``, ``W_O``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from ..core.functional import causal_keep

__all__ = [
    "MLAAdapter",
    "MLADims",
    "MLAParts",
    "MLARecipe",
    "MLAWeights",
    "find_mla",
    "mla_dims",
    "mla_recipe",
    "mla_weights",
]

# The names each part goes by: Hugging Face's, DeepSeek's inference code's, and the paper's symbols.
PART_NAMES: dict[str, tuple[str, ...]] = {
    "q": ("q_proj", "wq", "W_Q", "w_q", "W_q"),
    "q_a": ("q_a_proj", "wq_a", "W_DQ", "w_dq"),
    "q_norm": ("q_a_layernorm", "q_norm", "q_a_norm"),
    "q_b": ("q_b_proj", "wq_b", "W_UQ", "w_uq"),
    "kv_a": ("kv_a_proj_with_mqa", "wkv_a", "kv_a_proj"),
    "dkv": ("W_DKV", "w_dkv", "kv_down_proj"),
    "kr": ("W_KR", "w_kr", "k_rope_proj"),
    "kv_norm": ("kv_a_layernorm", "kv_norm", "kv_a_norm", "latent_norm"),
    "kv_b": ("kv_b_proj", "wkv_b", "kv_up_proj"),
    "uk": ("W_UK", "w_uk"),
    "uv": ("W_UV", "w_uv"),
    "o": ("o_proj", "wo", "W_O", "w_o"),
}
# Attributes that may say a size (the weights' shapes are the truth; these only settle H when present).
HEAD_ATTRS = ("num_heads", "n_heads", "n_local_heads", "num_attention_heads", "n_head", "heads")
THETA_ATTRS = ("rope_theta", "theta", "rope_base", "base")
# forward arguments: the rotary angles, a mask, a cache start position, a causal flag
ROPE_ARGS = ("position_embeddings", "rope", "freqs_cis", "rotary_pos_emb", "pos_emb", "cos_sin")
MASK_ARGS = ("attention_mask", "mask", "attn_mask")
START_ARGS = ("start_pos", "position_offset", "offset")


@dataclass(frozen=True)
class MLAParts:
    """The qualified names of the module's parts (None: absent); one of each alternative is set."""

    q: str | None
    q_a: str | None
    q_norm: str | None
    q_b: str | None
    kv_a: str | None
    dkv: str | None
    kr: str | None
    kv_norm: str
    kv_b: str | None
    uk: str | None
    uv: str | None
    o: str

    def named(self) -> str:
        """The parts as found, in the order the data flows: ``q_a_proj -> q_a_layernorm -> q_b_proj, ...``."""
        q = self.q or f"{self.q_a} -> {self.q_norm} -> {self.q_b}"
        down = self.kv_a or f"{self.dkv} + {self.kr}"
        up = self.kv_b or f"{self.uk} + {self.uv}"
        return f"{q}; {down} -> {self.kv_norm} -> {up}; {self.o}"


def find_mla(module: nn.Module) -> MLAParts | None:
    """The parts of an MLA module by name (see the module docstring), or None when it is not one."""
    children = dict(module.named_modules())
    found: dict[str, str | None] = {}
    for part, names in PART_NAMES.items():
        hits = [q for q in children if q and q.rsplit(".", 1)[-1] in names]
        found[part] = min(hits, key=lambda q: q.count("."), default=None)  # the outermost, if nested twice
    has_q = found["q"] is not None or (found["q_a"] is not None and found["q_b"] is not None)
    has_down = found["kv_a"] is not None or (found["dkv"] is not None and found["kr"] is not None)
    has_up = found["kv_b"] is not None or (found["uk"] is not None and found["uv"] is not None)
    if not (has_q and has_down and has_up and found["kv_norm"] and found["o"]):
        return None
    if found["q_a"] is not None and found["q_b"] is not None:
        found["q"] = None  # q_a/q_b first: DeepSeek's code names both wq and wq_a in the same class
    else:
        found["q_a"] = found["q_norm"] = found["q_b"] = None
    if found["kv_a"] is not None:
        found["dkv"] = found["kr"] = None
    if found["kv_b"] is not None:
        found["uk"] = found["uv"] = None
    return MLAParts(**found)  # type: ignore[arg-type]


def _weight(module: nn.Module, name: str | None) -> Tensor:
    w = getattr(module.get_submodule(name or ""), "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ValueError(f"{name} has no 2-D weight; check reads MLA projections as nn.Linear layers.")
    return w


@dataclass(frozen=True)
class MLADims:
    """The sizes of an MLA module, with where each came from."""

    E: int
    H: int
    C: int
    R: int  # the rotary width per head of the queries (and of the shared key, when it is shared)
    N: int
    Dv: int
    Q: int | None
    key_rope_rows: int  # rows of the rotary key in the down-projection: R when shared, H*R when per head
    heads_from: str  # "num_heads" (the attribute read) or "the weights' shapes"

    @property
    def shared_rope_key(self) -> bool:
        return self.key_rope_rows == self.R

    def describe(self) -> str:
        q = f", q_lora_rank={self.Q}" if self.Q is not None else ", q_lora_rank=None (one query projection)"
        return (
            f"H={self.H}, C={self.C}, R={self.R}, N={self.N}, Dv={self.Dv}{q}, E={self.E} "
            f"(from the weights' shapes; H from {self.heads_from})"
        )


def mla_dims(module: nn.Module, parts: MLAParts) -> MLADims:
    """The sizes, read off the weights' shapes; H from an attribute when the module has one, else derived.

    With ``q_out = H*(N+R)``, ``up = H*(N+Dv)``, ``o_in = H*Dv`` and a shared rotary key of ``R = down - C`` rows:
    ``H = (q_out - up + o_in) / R``. With H known, a down-projection of ``C + H*R`` rows is a rotary key per head.
    """
    E, o_in = _weight(module, parts.o).shape
    q_out, q_in = _weight(module, parts.q or parts.q_b).shape
    Q = None if parts.q is not None else q_in
    if parts.kv_b is not None:
        up, C = _weight(module, parts.kv_b).shape
        nope_rows = None
    else:
        nope_rows, C = _weight(module, parts.uk).shape
        up = nope_rows + _weight(module, parts.uv).shape[0]
    down = _weight(module, parts.kv_a).shape[0] if parts.kv_a else C + _weight(module, parts.kr).shape[0]
    key_rope_rows = down - C
    named = [a for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)]
    if named:
        H, heads_from = int(getattr(module, named[0])), named[0]
    else:
        if key_rope_rows <= 0 or (q_out - up + o_in) % key_rope_rows:
            raise ValueError(
                f"cannot tell the head count: q {q_out}, up {up}, o {o_in}, rotary key {key_rope_rows} rows; "
                f"give the module a num_heads attribute."
            )
        H, heads_from = (q_out - up + o_in) // key_rope_rows, "the weights' shapes"
    if H <= 0 or o_in % H or up % H or q_out % H:
        raise ValueError(f"{heads_from}={H} does not divide the projections ({q_out}, {up}, {o_in} rows).")
    Dv = o_in // H
    N = up // H - Dv if nope_rows is None else nope_rows // H
    R = q_out // H - N
    if R <= 0 or N <= 0 or R % 2:
        raise ValueError(f"the shapes give N={N}, R={R} per head, which is no MLA query (R even, both > 0).")
    return MLADims(E, H, C, R, N, Dv, Q, key_rope_rows, heads_from)


def _norm_eps(norm: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        eps = getattr(norm, attr, None)
        if isinstance(eps, float) and eps > 0:
            return eps
    return 1e-6


def _norm_weight(norm: nn.Module, width: int, like: Tensor) -> Tensor:
    w = getattr(norm, "weight", None)
    return w.to(like.dtype) if isinstance(w, Tensor) else torch.ones(width, dtype=like.dtype, device=like.device)


def _bias(layer: nn.Module, width: int, like: Tensor) -> Tensor:
    b = getattr(layer, "bias", None)
    return b.to(like.dtype) if isinstance(b, Tensor) else torch.zeros(width, dtype=like.dtype, device=like.device)


@dataclass(frozen=True)
class MLAWeights:
    """The module's parameters as the equations read them; each a differentiable view of the module's own."""

    W_q: Tensor | None  # (H*(N+R), E), or None with the query latent:
    W_qa: Tensor | None  # (Q, E)
    b_qa: Tensor | None  # (Q,)
    qnorm: tuple[Tensor, float] | None  # (weight (Q,), eps)
    W_qb: Tensor | None  # (H*(N+R), Q)
    W_a: Tensor  # (C + R, E) (C + H*R with a rotary key per head): W_DKV over W_KR
    b_a: Tensor  # (C + R,)
    kvnorm: tuple[Tensor, float]  # (weight (C,), eps)
    W_kvb: Tensor  # (H, N+Dv, C): per head W_UK over W_UV
    W_o: Tensor  # (E, H*Dv)
    b_o: Tensor  # (E,)


def mla_weights(module: nn.Module, parts: MLAParts, dims: MLADims) -> MLAWeights:
    """:class:`MLAWeights` of ``module``: separate W_DKV/W_KR and W_UK/W_UV are joined as the fused ones are laid."""
    H, C, N, Dv = dims.H, dims.C, dims.N, dims.Dv
    ref = _weight(module, parts.o)
    sub = module.get_submodule
    if parts.kv_a is not None:
        W_a, b_a = _weight(module, parts.kv_a), _bias(sub(parts.kv_a), C + dims.key_rope_rows, ref)
    else:
        W_a = torch.cat((_weight(module, parts.dkv), _weight(module, parts.kr)))  # (C + R, E)
        b_a = torch.cat((_bias(sub(parts.dkv or ""), C, ref), _bias(sub(parts.kr or ""), dims.key_rope_rows, ref)))
    if parts.kv_b is not None:
        W_kvb = _weight(module, parts.kv_b).view(H, N + Dv, C)
    else:
        W_kvb = torch.cat(
            (_weight(module, parts.uk).view(H, N, C), _weight(module, parts.uv).view(H, Dv, C)), dim=1
        )  # (H, N+Dv, C)
    kv_norm = sub(parts.kv_norm)
    q_norm = sub(parts.q_norm) if parts.q_norm else None
    return MLAWeights(
        W_q=_weight(module, parts.q) if parts.q else None,
        W_qa=_weight(module, parts.q_a) if parts.q_a else None,
        b_qa=_bias(sub(parts.q_a), dims.Q or 0, ref) if parts.q_a else None,
        qnorm=None if q_norm is None else (_norm_weight(q_norm, dims.Q or 0, ref), _norm_eps(q_norm)),
        W_qb=_weight(module, parts.q_b) if parts.q_b else None,
        W_a=W_a,
        b_a=b_a,
        kvnorm=(_norm_weight(kv_norm, C, ref), _norm_eps(kv_norm)),
        W_kvb=W_kvb,
        W_o=_weight(module, parts.o),
        b_o=_bias(sub(parts.o), dims.E, ref),
    )


Layout = Literal["interleaved", "half"]


@dataclass(frozen=True)
class MLARecipe:
    """How MLA is computed; the defaults are DeepSeek-V2's equations (section 2.1)."""

    rope_key: Literal["shared", "per_head"] = "shared"  # k_R one for all heads, or projected per head
    scale: Literal["qk", "nope", "latent"] = "qk"  # 1/sqrt(N + R), 1/sqrt(N), or 1/sqrt(C + R) (the absorbed width)
    w_uk: Literal["right", "transposed"] = "right"  # W_UK (N, C), or its transpose read as one (needs N == C)
    latent_norm: bool = True  # RMSNorm on c_KV
    rope_on_latent: bool = False  # the first R channels of c_KV rotated as well
    kv_b_order: Literal["key_first", "value_first"] = "key_first"  # kv_b_proj's rows per head: W_UK then W_UV
    query_norm: bool = True  # RMSNorm on the query latent c_Q (with q_lora_rank)

    def applies(self, dims: MLADims) -> bool:
        """Whether this computation can run on weights of ``dims``."""
        if (self.rope_key == "per_head") == dims.shared_rope_key:
            return False
        if self.w_uk == "transposed" and dims.N != dims.C:
            return False
        if self.scale == "latent" and dims.C == dims.N:
            return False  # 1/sqrt(C + R) is then the right scale: nothing tells the two apart
        if not self.query_norm and dims.Q is None:
            return False  # no query latent to normalise
        return not (self.rope_on_latent and dims.R > dims.C)


def _rotate(x: Tensor, angles: Tensor | None, layout: Layout) -> Tensor:
    """``x (..., T, R)`` with each channel pair turned by its angle; ``angles (T, R/2)``; pairs adjacent
    (``interleaved``) or channel c with c + R/2 (``half``). The result is laid out half-split either way."""
    if angles is None:
        return x
    R = x.size(-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (T, R/2)
    a, b = (x[..., 0::2], x[..., 1::2]) if layout == "interleaved" else (x[..., : R // 2], x[..., R // 2 :])
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., T, R)


def _rms(x: Tensor, norm: tuple[Tensor, float]) -> Tensor:
    w, eps = norm
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mla_recipe(
    w: MLAWeights,
    dims: MLADims,
    x: Tensor,
    angles: Tensor | None,
    keep: Tensor,
    *,
    layout: Layout,
    recipe: MLARecipe = MLARecipe(),
) -> Tensor:
    """The output ``(B, T, E)`` of MLA on ``x (B, T, E)`` with ``recipe``'s mistakes (none: the paper's equations),
    in ``x``'s dtype. ``angles (T, R/2)``: the rotary angle of each position and pair (None: no rotation);
    ``keep (B|1, T, T)`` bool, True = may attend (causal included); a query with no key gets zeros."""
    H, C, N, R, Dv = dims.H, dims.C, dims.N, dims.R, dims.Dv
    B, T, _ = x.shape
    if w.W_q is not None:
        q = x @ w.W_q.T  # (B, T, H*(N+R))
    else:
        assert w.W_qa is not None and w.W_qb is not None and w.qnorm is not None and w.b_qa is not None
        c_Q = x @ w.W_qa.T + w.b_qa  # (B, T, Q)
        q = (_rms(c_Q, w.qnorm) if recipe.query_norm else c_Q) @ w.W_qb.T  # (B, T, Q) -> (B, T, H*(N+R))
    q = q.view(B, T, H, N + R).transpose(1, 2)  # (B, H, T, N+R)
    q_C, q_R = q[..., :N], _rotate(q[..., N:], angles, layout)  # (B, H, T, N), (B, H, T, R)

    a = x @ w.W_a.T + w.b_a  # (B, T, C + R) (C + H*R with a rotary key per head)
    c_KV = _rms(a[..., :C], w.kvnorm) if recipe.latent_norm else a[..., :C]  # (B, T, C)
    if recipe.rope_on_latent:
        c_KV = torch.cat((_rotate(c_KV[..., :R], angles, layout), c_KV[..., R:]), dim=-1)  # (B, T, C)
    if recipe.rope_key == "per_head":
        k_R = _rotate(a[..., C:].view(B, T, H, R).transpose(1, 2), angles, layout)  # (B, H, T, R)
    else:
        k_R = _rotate(a[..., C:], angles, layout)[:, None]  # (B, 1, T, R): one for all heads
    if recipe.kv_b_order == "key_first":
        W_UK, W_UV = w.W_kvb[:, :N], w.W_kvb[:, N:]  # (H, N, C), (H, Dv, C)
    else:  # each head's value rows read from the front, its key rows from the back
        W_UV, W_UK = w.W_kvb[:, :Dv], w.W_kvb[:, Dv:]  # (H, Dv, C), (H, N, C)
    if recipe.w_uk == "transposed":
        W_UK = W_UK.transpose(1, 2)  # (H, C, N) read as (H, N, C): only when N == C
    k_C = torch.einsum("bsc,hnc->bhsn", c_KV, W_UK)  # (B, H, T, N)
    v = torch.einsum("bsc,hdc->bhsd", c_KV, W_UV)  # (B, H, T, Dv)

    scale = 1 / math.sqrt({"qk": N + R, "nope": N, "latent": C + R}[recipe.scale])
    scores = (q_C @ k_C.transpose(-1, -2) + q_R @ k_R.transpose(-1, -2)) * scale  # (B, H, T, T)
    allowed = keep.expand(B, T, T)[:, None]  # (B, 1, T, T)
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    p = torch.where(allowed.any(-1, keepdim=True), p, 0.0)  # a query with no key: zeros, not NaN
    o = (p @ v).transpose(1, 2).reshape(B, T, H * Dv)  # (B, H, T, Dv) -> (B, T, H*Dv)
    return o @ w.W_o.T + w.b_o  # (B, T, E)


# -- how the module is called ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CallForm:
    """How the module's forward is called: ``forward(x, <rope>, <mask>, <start>, <is_causal>)`` by keyword."""

    x: str  # the input's argument
    rope: str | None  # the argument taking the rotary angles, or None: the module makes its own
    rope_kind: Literal["cos_sin", "complex", "inside"]
    mask: str | None  # an additive mask's argument, or None: the module is causal by itself
    mask_kind: Literal["batch", "square", "none"]  # (B, 1, T, T) or (T, T)
    start: str | None  # a cache start position's argument (given 0)
    causal_flag: str | None  # an is_causal argument (given True)

    def describe(self, R: int) -> str:
        args = [self.x]
        if self.rope is not None:
            what = f"(cos, sin) each (B, T, {R})" if self.rope_kind == "cos_sin" else f"complex (T, {R // 2})"
            args.append(f"{self.rope}={what}")
        if self.start is not None:
            args.append(f"{self.start}=0")
        if self.mask is not None:
            shape = "(B, 1, T, T)" if self.mask_kind == "batch" else "(T, T)"
            args.append(f"{self.mask}=additive {shape}")
        if self.causal_flag is not None:
            args.append(f"{self.causal_flag}=True")
        how = (
            "causal through the mask"
            if self.mask is not None
            else "causal by its own flag"
            if self.causal_flag
            else "no mask argument: expected causal by itself, as DeepSeek's"
        )
        return f"forward({', '.join(args)}), {how}"


def call_form(module: nn.Module) -> CallForm:
    """The call form of ``module.forward``; a ``ValueError`` naming an argument check cannot fill."""
    params = [
        p
        for p in inspect.signature(module.forward).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not params:
        raise ValueError("its forward takes no input argument")
    x, rest = params[0].name, params[1:]
    names = [p.name for p in rest]
    rope = next((n for n in names if n in ROPE_ARGS), None)
    mask = next((n for n in names if n in MASK_ARGS), None)
    start = next((n for n in names if n in START_ARGS), None)
    flag = next((n for n in names if n in ("is_causal", "causal")), None)
    filled = {rope, mask, start, flag}
    unknown = [p.name for p in rest if p.default is inspect.Parameter.empty and p.name not in filled]
    if unknown:
        raise ValueError(
            f"its forward needs {', '.join(map(repr, unknown))}, which check cannot fill (it passes the input, "
            f"rotary angles as {'/'.join(ROPE_ARGS[:3])}, an additive mask as {'/'.join(MASK_ARGS)}, "
            f"start_pos=0 and is_causal=True)"
        )
    kind: Literal["cos_sin", "complex", "inside"] = (
        "inside" if rope is None else "complex" if rope == "freqs_cis" else "cos_sin"
    )
    mask_kind: Literal["batch", "square", "none"] = (
        "none" if mask is None else "square" if kind == "complex" else "batch"
    )
    return CallForm(x, rope, kind, mask, mask_kind, start, flag)


def _theta(module: nn.Module) -> tuple[Tensor | None, str]:
    """The inverse frequencies ``(R/2,)`` of a module that makes its own angles, and where they came from:
    an ``inv_freq`` buffer, else a ``rope_theta``-like attribute, else None (10000 assumed by the caller)."""
    for name, buf in module.named_buffers():
        if name.rsplit(".", 1)[-1] == "inv_freq":
            return buf.detach().to(torch.float64), f"its {name} buffer"
    for m in module.modules():
        for attr in THETA_ATTRS:
            v = getattr(m, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1:
                return torch.tensor(float(v), dtype=torch.float64), f"{attr}={v:g}"
    return None, "no rope_theta attribute: 10000 assumed"


@torch.no_grad()
def _perturb_norms(module: nn.Module, parts: MLAParts, seed: int) -> None:
    """Norm weights that are all ones (the usual init) get ``1 + 0.1 * N(0, 1)`` values, seeded: a norm that
    forgets its weight then shows, as :func:`attnlab.check.target.random_biases` does for biases."""
    g = torch.Generator().manual_seed(seed + 2)
    for name in (parts.kv_norm, parts.q_norm):
        w = getattr(module.get_submodule(name), "weight", None) if name else None
        if isinstance(w, Tensor) and w.is_floating_point() and bool((w == 1).all()):
            w.copy_(1 + 0.1 * torch.randn(w.shape, generator=g))


class MLAAdapter:
    """A hand-written MLA module as check calls it: its parts, sizes, call form, and the rotary angles it is
    given (or makes itself). Calls run in float64 on a copy of the module (:attr:`module64`)."""

    def __init__(self, module: nn.Module, parts: MLAParts, *, name: str, seed: int = 0) -> None:
        self.module, self.parts, self.name = module, parts, name
        _perturb_norms(module, parts, seed)
        self.dims = mla_dims(module, parts)
        self.form = call_form(module)
        inv_freq, self.theta_from = _theta(module) if self.form.rope_kind == "inside" else (None, "")
        R = self.dims.R
        if inv_freq is None or inv_freq.dim() == 0:
            base = 10000.0 if inv_freq is None else float(inv_freq)
            inv_freq = base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)  # (R/2,)
        self.inv_freq = inv_freq
        self.module64 = module  # replaced by float64() before any call
        self.layout: Layout = "interleaved"  # settled by the parity check (the closer of the two)

    def float64(self) -> None:
        """A float64 copy of the module, in eval mode, for every call of the checks (the caller's stays as it is)."""
        import copy

        self.module64 = copy.deepcopy(self.module).to(torch.float64).eval()

    def angles(self, T: int, device: torch.device) -> Tensor:
        """``(T, R/2)``: the angle of position t and pair i, t * inv_freq[i]."""
        pos = torch.arange(T, dtype=torch.float64, device=device)
        return pos[:, None] * self.inv_freq.to(device)[None, :]

    def __call__(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        """The module's output ``(B, T, E)`` on ``x``, causal, with keys where ``pad (B, T)`` is True hidden
        (only for a module that takes a per-sequence mask)."""
        B, T, _ = x.shape
        f = self.form
        kwargs: dict[str, object] = {}
        angles = self.angles(T, x.device)  # (T, R/2)
        if f.rope_kind == "cos_sin":
            both = torch.cat((angles, angles), dim=-1).to(x.dtype)  # (T, R): pair i's angle in i and i + R/2
            assert f.rope is not None
            kwargs[f.rope] = (both.cos().expand(B, T, -1), both.sin().expand(B, T, -1))
        elif f.rope_kind == "complex":
            assert f.rope is not None
            kwargs[f.rope] = torch.polar(torch.ones_like(angles), angles)  # (T, R/2) complex128
        if f.start is not None:
            kwargs[f.start] = 0
        if f.causal_flag is not None:
            kwargs[f.causal_flag] = True
        if f.mask is not None:
            blocked = ~causal_keep(T, T, x.device)  # (T, T)
            if f.mask_kind == "square":
                kwargs[f.mask] = torch.zeros(T, T, dtype=x.dtype, device=x.device).masked_fill(blocked, float("-inf"))
            else:
                hide = blocked[None] | (pad[:, None, :] if pad is not None else blocked[None] & False)  # (B|1, T, T)
                fill = torch.finfo(x.dtype).min
                kwargs[f.mask] = torch.zeros(hide.shape, dtype=x.dtype, device=x.device).masked_fill(hide, fill)[
                    :, None
                ]
        elif pad is not None:
            raise ValueError("this module takes no per-sequence mask")
        out = self.module64(x, **kwargs) if f.x in kwargs else self.module64(**{f.x: x}, **kwargs)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, Tensor) or out.shape != x.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"it returned {got} for an input of {tuple(x.shape)}, not (B, T, E)")
        return out

    def takes_padding(self) -> bool:
        return self.form.mask_kind == "batch"

    def weights(self) -> MLAWeights:
        return mla_weights(self.module64, self.parts, self.dims)

    def reference(self, x: Tensor, keep: Tensor, *, layout: Layout, recipe: MLARecipe = MLARecipe()) -> Tensor:
        """:func:`mla_recipe` on the float64 copy's weights, with the angles the module is given."""
        return mla_recipe(
            self.weights(), self.dims, x, self.angles(x.size(1), x.device), keep, layout=layout, recipe=recipe
        )

    def describe_call(self) -> str:
        rope = {
            "cos_sin": "angles passed in (theta 10000)",
            "complex": "angles passed in (theta 10000)",
            "inside": f"its own angles ({self.theta_from})",
        }[self.form.rope_kind]
        return (
            f"{self.name}: read as multi-head latent attention (MLA): {self.parts.named()}; {self.dims.describe()}; "
            f"called as {self.form.describe(self.dims.R)}; rotary: {rope}, pairs {self.layout} (probed)"
        )
