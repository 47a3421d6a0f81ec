"""Attention written out stage by stage in float64, with each classic mistake a switch.

Notation: B batch, T_q query positions, T_k key positions, E embed_dim, H query heads,
G key/value heads, D head dim.

:func:`recipe_attention` computes what a module *should* return (``Recipe()``, the textbook
formula, equal to :func:`attnlab.check.reference_attention`) or what it returns when it makes
one mistake: ``Recipe(scale="embed_dim")`` divides the scores by sqrt(E), ``Recipe(merge=
"no_transpose")`` merges the heads without the transpose back, and so on. The diagnosis
(:mod:`attnlab.check.diagnose`) recomputes the output with each catalogued mistake, on the
module's own weights and inputs, and keeps those that match. Every stage's tensor is returned
too, for ``attnlab trace`` and for locating the first stage where a module departs.

Masks arrive as in :func:`attnlab.check.reference_attention`: ``keep_mask`` bool (True = may
attend) ``(T_q, T_k)`` or ``(B, T_q, T_k)``, ``key_padding_mask`` bool ``(B, T_k)`` (True =
padding), ``is_causal`` bottom-right aligned. A query with no visible key gets a zero context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .adapters import AttentionAdapter, Projections

__all__ = ["Recipe", "STAGES", "mask_period", "recipe_attention", "stages_of"]

Source = Literal["query", "key", "value"]
Proj = Literal["q", "k", "v"]


@dataclass(frozen=True)
class Recipe:
    """How the attention is computed; the defaults are the textbook formula (seed 002, section 2.2)."""

    q_from: tuple[Proj, Source] = ("q", "query")  # Q = q_proj(query)
    k_from: tuple[Proj, Source] = ("k", "key")  # K = k_proj(key)
    v_from: tuple[Proj, Source] = ("v", "value")  # V = v_proj(value)
    # "time_first_memory": fairseq's view(B*H, T, D) taken straight from (T, B, E) memory: batch rows, heads and
    # positions mixed
    split: Literal["heads", "no_transpose", "interleaved", "time_first_memory"] = (
        "heads"  # view(B, T, H, D).transpose(1, 2)
    )
    kv_repeat: Literal["interleave", "tile"] = "interleave"  # GQA: K/V head g serves queries g*H/G ..
    # "length": the keys' length taken for the head dim; "query_length": the queries' (q.shape[1] of (B, T, H, D))
    scale: Literal["expected", "embed_dim", "none", "head_dim", "multiplied", "quarter", "length", "query_length"] = (
        "expected"
    )
    scale_after_softmax: bool = False  # the factor applied to the weights instead of the scores
    softmax_dim: int = -1  # over keys
    mask_stage: Literal["before", "after"] = "before"  # masked scores -inf before softmax
    # with mask_stage "after": the mask added to the weights as the numbers the module was handed, (kept pair's,
    # blocked pair's) (a bool keep mask: 1 and 0; an additive one: 0 and its fill), not blocked pairs zeroed
    mask_added_after: tuple[float, float] | None = None
    # "finite": masked scores at -1e9 (the Annotated Transformer's fill): a softmax slice with every entry
    # blocked is then uniform rather than zero (with softmax_dim=-2, a padded key's column)
    # "zero": masked scores set to 0, a score like any other (softmax still gives blocked keys exp(0) each)
    fill: Literal["-inf", "finite", "zero", "zero_dropped"] = "-inf"
    bool_mask_added: bool = False  # the keep mask added to the scores as 0/1 floats instead of masking
    mask_ignored: bool = False  # no mask of any kind reaches the scores ...
    # ... but these, which reach the module through arguments of their own: "key_padding_mask" (a separate
    # key_padding_mask argument, as nn.MultiheadAttention's), "is_causal" (an is_causal flag, or always causal)
    kept_apart: tuple[str, ...] = ()
    causal: Literal["right", "sees_next", "hides_self", "reversed"] = "right"
    # "added": the key padding mask added to the scores as 0/1 floats (padded keys +1, nothing blocked)
    padding: Literal["keys", "ignored", "inverted", "queries", "added"] = "keys"
    # with padding="inverted", the additive mask (0 = attend, this fill = padding) subtracted rather than added:
    # padded keys' scores move up by -fill, real keys keep theirs (a finfo.min fill swamps the padded scores)
    padding_fill: float | None = None
    # "tiled": (sequence b, head h) gets the masks of sequence (b*H + h) mod B (valid_lens.repeat(H) on (B*H, ..) rows)
    # "windows_major": a mask of one row per window (Swin's (nW, N, N) for a batch of nW * B windows, the window
    # index fastest) spread over the batch window-major (repeat_interleave(B)): row i gets window i // B's mask
    rows: Literal["right", "tiled", "windows_major"] = "right"
    # False: (B, T, E) read as (T, B, E) (nn.MultiheadAttention without batch_first): attention across the batch
    batch_first: bool = True
    # "no_transpose_time_first": a (T, B, E) module's (B, H, T, D) memory reread as its own (T, B, H*D) output
    merge: Literal["transpose", "no_transpose", "no_transpose_time_first", "interleaved"] = "transpose"
    out_proj: bool = True
    # which of Q, K, V the module's position map (rotary) turns: "qk" as it should, "q" alone, or V as well
    rotary: Literal["qk", "q", "qkv"] = "qk"
    # the module's bias by position on the scores (its score map, attnlab.check.scoremap) as the reference holds it,
    # or "negated": rising with the distance between query and key (ALiBi's slopes with the wrong sign)
    position_bias: Literal["right", "negated"] = "right"
    # the rotation built from tables of one pairing (adjacent / halves) and a rotate function of the other
    rotary_crossed: bool = False
    # q_from, k_from and v_from hold only when K and V come from another tensor than the queries: a mistake in the
    # cross-attention branch (Perceiver's ``if is_cross_attention:``), self-attention computed as it should be
    cross_only: bool = False

    def changes(self) -> dict[str, object]:
        """The fields that differ from the textbook recipe."""
        plain = Recipe()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(plain, f.name)}


# The stages :func:`recipe_attention` returns, in the order the data flows (seed 000's walk-through).
STAGES = (
    "q",  # (B, T_q, H*D): q_proj(query)
    "k",  # (B, T_k, G*D)
    "v",  # (B, T_k, G*D)
    "q_heads",  # (B, H, T_q, D)
    "k_heads",  # (B, G, T_k, D)
    "v_heads",  # (B, G, T_k, D)
    "scores",  # (B, H, T_q, T_k): Q K^T, before scaling
    "scaled",  # (B, H, T_q, T_k): times the scale
    "masked",  # (B, H, T_q, T_k): blocked pairs at -inf
    "weights",  # (B, H, T_q, T_k): softmax over keys
    "context",  # (B, H, T_q, D): weights V
    "merged",  # (B, T_q, H*D): heads back side by side
    "out",  # (B, T_q, E): out_proj(merged)
)


def mask_period(keep: Tensor) -> int:
    """The fewest rows ``p`` of ``keep`` ``(B, ...)`` that, repeated, make it (``keep[i] == keep[i % p]``): the
    number of windows in a batch of windows folded window-fastest, as Swin folds them (``B`` when no period)."""
    B = keep.size(0)
    for p in range(1, B):
        if B % p == 0 and bool((keep == keep[:p].repeat(B // p, *([1] * (keep.dim() - 1)))).all()):
            return p
    return B


def _scale(recipe: Recipe, expected: float, E: int, D: int, T_k: int, T_q: int) -> float:
    return {
        "expected": expected,
        "embed_dim": 1.0 / math.sqrt(E),
        "none": 1.0,
        "head_dim": 1.0 / D,
        "multiplied": math.sqrt(D),
        "quarter": D**-0.25,  # Whisper's d^-1/4 on K alone: half the scale
        "length": 1.0 / math.sqrt(T_k),  # the sequence length taken for the head dim
        "query_length": 1.0 / math.sqrt(T_q),  # the queries' length, read off q itself
    }[recipe.scale]


def _split(x: Tensor, n: int, how: str) -> Tensor:
    """``(B, T, n*D)`` -> ``(B, n, T, D)``, or what a mistaken split makes of it."""
    B, T, C = x.shape
    D = C // n
    if how == "no_transpose":
        return x.reshape(B, n, T, D)  # the memory of (B, T, n*D) reread as (B, n, T, D): positions and heads mixed
    if how == "interleaved":
        return x.view(B, T, D, n).permute(0, 3, 1, 2)  # head h takes every n-th feature
    if how == "time_first_memory":  # the (T, B, n*D) memory of a time-first module reread as (B*n, T, D)
        return x.transpose(0, 1).reshape(B * n, T, D).view(B, n, T, D)
    return x.view(B, T, n, D).transpose(1, 2)  # (B, n, T, D)


def _merge(context: Tensor, how: str) -> Tensor:
    """``(B, H, T, D)`` -> ``(B, T, H*D)``, or what a mistaken merge makes of it."""
    B, H, T, D = context.shape
    if how == "no_transpose":
        return context.reshape(B, T, H * D)  # (B, H, T, D) memory reread as (B, T, H*D)
    if how == "no_transpose_time_first":
        return context.reshape(T, B, H * D).transpose(0, 1)  # reread as (T, B, H*D), handed back batch-first
    if how == "interleaved":
        return context.permute(0, 2, 3, 1).reshape(B, T, H * D)  # feature d of head h at d*H + h
    return context.transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)


def _causal(recipe: Recipe, T_q: int, T_k: int, device: torch.device | None) -> Tensor:
    """``(T_q, T_k)`` bool, True = may attend; bottom-right aligned like ``attnlab``'s ``is_causal``."""
    ones = torch.ones(T_q, T_k, dtype=torch.bool, device=device)
    offset = T_k - T_q
    if recipe.causal == "sees_next":
        return ones.tril(offset + 1)
    if recipe.causal == "hides_self":
        return ones.tril(offset - 1)
    if recipe.causal == "reversed":
        return ones.triu(offset)  # each query sees itself and the future
    return ones.tril(offset)


def recipe_attention(
    p: Projections,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    recipe: Recipe = Recipe(),
    keep_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
) -> dict[str, Tensor]:
    """Every stage of ``recipe``'s attention, in float64: a dict over :data:`STAGES` (``"out"`` is the output).

    Args:
        p: the module's weights.
        query, key, value: ``(B, T_q, E)``, ``(B, T_k, kdim)``, ``(B, T_k, vdim)``.
        num_heads, num_kv_heads: H and G.
        scale: the expected multiplier of the scores (``1/sqrt(D)`` unless the user said otherwise);
            ``recipe.scale`` may replace it with a mistaken one.
        recipe: the textbook formula by default.
        keep_mask, key_padding_mask, bias, is_causal: the masks (see the module docstring); ``bias``
            is a float ``(T_q, T_k)`` or ``(B, T_q, T_k)`` added to the scores.

    Raises:
        RuntimeError: a recipe whose shapes cannot work for these sizes (e.g. K through q_proj when
            G < H): that mistake cannot be what the module does.
    """
    if recipe.mask_ignored:
        keep_mask = bias = None
        key_padding_mask = key_padding_mask if "key_padding_mask" in recipe.kept_apart else None
        is_causal = is_causal and "is_causal" in recipe.kept_apart
    if not recipe.batch_first:
        if keep_mask is not None or key_padding_mask is not None or bias is not None or is_causal:
            raise RuntimeError("a (B, T) mask does not fit inputs read as (T, B, E)")  # the module raises too
        swapped = recipe_attention(
            p,
            query.transpose(0, 1),  # (T_q, B, E): B read as the sequence
            key.transpose(0, 1),
            value.transpose(0, 1),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            scale=scale,
            recipe=replace(recipe, batch_first=True),
        )
        swapped["out"] = swapped["out"].transpose(0, 1)  # (B, T_q, E), as the module returns it
        return swapped
    f64 = torch.float64
    w = p.to(f64)
    inputs = {"query": query.to(f64), "key": key.to(f64), "value": value.to(f64)}
    linear = {"q": (w.q_weight, w.q_bias), "k": (w.k_weight, w.k_bias), "v": (w.v_weight, w.v_bias)}
    H, G = num_heads, num_kv_heads
    s: dict[str, Tensor] = {}
    sources = (("q", recipe.q_from), ("k", recipe.k_from), ("v", recipe.v_from))
    if recipe.cross_only and all(
        t is query or (t.shape == query.shape and torch.equal(t, query)) for t in (key, value)
    ):
        sources = (("q", ("q", "query")), ("k", ("k", "key")), ("v", ("v", "value")))  # self-attention: textbook
    for name, (proj, src) in sources:
        s[name] = F.linear(inputs[src], *linear[proj])  # (B, T, n*D)
    B, T_q, T_k = query.size(0), query.size(1), s["k"].size(1)
    D = s["q"].size(-1) // H
    s["q_heads"] = _split(s["q"], H, recipe.split)  # (B, H, T_q, D)
    s["k_heads"] = _split(s["k"], G, recipe.split)  # (B, G, T_k, D)
    s["v_heads"] = _split(s["v"], G, recipe.split)  # (B, G, T_k, D)
    for name in ("q", "k"):  # the module's own per-vector maps of the Q and K heads (qk-norm), before any rotary
        s[f"{name}_heads"] = w.normed(name, s[f"{name}_heads"])
    if w.rotary is not None:  # the module's own position map on Q and K (rotary), or a mistaken use of it
        rotated = {"qk": ("q", "k"), "q": ("q",), "qkv": ("q", "k", "v")}[recipe.rotary]
        for name in rotated:
            s[f"{name}_heads"] = w.rotate(s[f"{name}_heads"], crossed=recipe.rotary_crossed)
    k, v = s["k_heads"], s["v_heads"]
    if G != H:  # GQA: each K/V head serves H/G query heads
        if recipe.kv_repeat == "tile":
            k, v = k.repeat(1, H // G, 1, 1), v.repeat(1, H // G, 1, 1)  # g0 g1 g0 g1 ...: (B, H, T_k, D)
        else:
            k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # g0 g0 g1 g1 ...
    s["scores"] = s["q_heads"] @ k.transpose(-2, -1)  # (B, H, T_q, T_k)
    factor = _scale(recipe, scale, p.out_weight.size(0), D, T_k, T_q)
    s["scaled"] = s["scores"] if recipe.scale_after_softmax else s["scores"] * factor
    s["scaled"] = w.mapped(s["scaled"], negated=recipe.position_bias == "negated")  # a bias by position, a soft-cap

    keep = torch.ones(B, 1, T_q, T_k, dtype=torch.bool, device=query.device)  # True = may attend
    added = torch.zeros(B, 1, T_q, T_k, dtype=f64, device=query.device)
    if keep_mask is not None:
        k4 = (keep_mask if keep_mask.dim() == 3 else keep_mask[None])[:, None]  # (B or 1, 1, T_q, T_k)
        if recipe.bool_mask_added:
            added = added + k4.to(f64)  # True adds 1.0 to the score: nothing is masked
        else:
            keep = keep & k4
    if bias is not None:
        b4 = bias.to(f64).reshape(-1, 1, T_q, T_k)  # (B or 1, 1, T_q, T_k)
        keep = keep & (b4 != float("-inf"))
        added = added + b4.masked_fill(b4 == float("-inf"), 0.0)
    if key_padding_mask is not None and recipe.padding == "added":
        added = added + key_padding_mask[:, None, None, :].to(f64)  # (B, 1, 1, T_k): a padded key's score +1
    elif key_padding_mask is not None and recipe.padding == "inverted" and recipe.padding_fill is not None:
        keep = keep & ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k): blocked, then subtracted below
    elif key_padding_mask is not None and recipe.padding != "ignored":
        pad = ~key_padding_mask if recipe.padding == "inverted" else key_padding_mask  # (B, T_k)
        if recipe.padding == "queries":  # the mask laid along the query axis: padded *queries* see nothing
            keep = keep & ~pad[:, None, :, None]  # (B, 1, T_q = T_k, 1)
        else:
            keep = keep & ~pad[:, None, None, :]  # (B, 1, 1, T_k)
    if is_causal:
        keep = keep & _causal(recipe, T_q, T_k, query.device)  # (T_q, T_k) broadcast
    if recipe.padding == "inverted" and recipe.padding_fill is not None:
        # one additive mask carries padding, causality and keep-masks alike (HF's extended mask), with one fill
        # per blocked pair: subtracted, each blocked pair's score moves up by -fill, and nothing is blocked
        added = added + (~keep).to(f64) * -recipe.padding_fill
        keep = torch.ones_like(keep)
    if recipe.rows == "tiled":  # (b, h) reads the masks of sequence (b*H + h) mod B
        rows = (torch.arange(B)[:, None] * H + torch.arange(H)[None, :]) % B  # (B, H)
        keep = keep.expand(B, 1, T_q, T_k)[rows.to(keep.device), 0]  # (B, H, T_q, T_k)
        added = added.expand(B, 1, T_q, T_k)[rows.to(added.device), 0]  # (B, H, T_q, T_k)
    if recipe.rows == "windows_major" and keep_mask is not None and keep_mask.dim() == 3:
        nW = mask_period(keep_mask)  # the windows: keep_mask's rows repeat with this period, windows fastest
        rows = torch.arange(B) // (B // nW)  # (B,): the window whose mask row i gets
        keep = keep.expand(B, *keep.shape[1:])[rows.to(keep.device)]
        added = added.expand(B, *added.shape[1:])[rows.to(added.device)]
    scores = s["scaled"] + added  # (B, H, T_q, T_k)
    unseen = ~keep.any(dim=2)[..., None]  # (B, 1 or H, T_k, 1): keys no query may see
    if recipe.mask_stage == "before" and recipe.fill in ("zero", "zero_dropped"):
        s["masked"] = scores.masked_fill(~keep, 0.0)
        weights = torch.softmax(s["masked"], dim=recipe.softmax_dim)
        if recipe.fill == "zero_dropped":  # ESPnet's second fill: the blocked weights zeroed after softmax
            weights = weights.masked_fill(~keep, 0.0)
        unseen = torch.zeros_like(unseen)  # blocked keys keep a share: their values reach the output
    elif recipe.mask_stage == "before" and recipe.fill == "finite":
        s["masked"] = scores.masked_fill(~keep, -1e9)
        weights = torch.softmax(s["masked"], dim=recipe.softmax_dim)  # a fully blocked slice: uniform
        unseen = torch.zeros_like(unseen)  # their values reach the output through those uniform weights
    elif recipe.mask_stage == "before":
        s["masked"] = scores.masked_fill(~keep, float("-inf"))
        weights = torch.softmax(s["masked"], dim=recipe.softmax_dim)
        empty = ~keep.any(dim=recipe.softmax_dim, keepdim=True)  # a softmax over nothing but -inf ...
        weights = weights.masked_fill(empty, 0.0)  # ... has no visible key: zero weights (a NaN input stays NaN)
    elif recipe.mask_added_after is not None:
        s["masked"] = scores
        kept, blocked = recipe.mask_added_after
        weights = torch.softmax(scores, dim=recipe.softmax_dim)
        if keep_mask is not None or key_padding_mask is not None or bias is not None or is_causal:  # one handed
            weights = weights + torch.where(keep, kept, blocked).to(f64)
        unseen = torch.zeros_like(unseen)  # no weight is zeroed: every key's value reaches the output
    else:
        s["masked"] = scores
        weights = torch.softmax(scores, dim=recipe.softmax_dim).masked_fill(~keep, 0.0)  # not renormalised
    if recipe.scale_after_softmax:
        weights = weights * factor
    s["weights"] = weights  # (B, H, T_q, T_k)
    s["context"] = weights @ v.masked_fill(unseen, 0.0)  # (B, H, T_q, D); unseen keys: 0
    s["merged"] = _merge(s["context"], recipe.merge)  # (B, T_q, H*D)
    merged = w.gated(s["merged"], query, key, value)  # the module's output gate, where it has one
    s["out"] = F.linear(merged, w.out_weight, w.out_bias) if recipe.out_proj else merged  # (B, T_q, E)
    return s


def stages_of(a: AttentionAdapter, query: Tensor, key: Tensor, value: Tensor, **kw: Any) -> dict[str, Tensor]:
    """:func:`recipe_attention` on adapter ``a``'s weights, heads and scale; ``kw``: ``recipe=`` and the masks."""
    return recipe_attention(
        a.projections(), query, key, value, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, scale=a.scale, **kw
    )
