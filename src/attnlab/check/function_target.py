"""Attention functions and kernels as ``--target``: ``f(q, k, v, ...)``, read by experiment.

Notation: B batch, H query heads, G key/value heads, T_q query positions, T_k key positions, D head dim.
Inside, every tensor is ``(B, H, T, D)``; the function gets its own layout.

What the function takes is found by calling it on probe tensors whose sizes all differ (B, H, T_q, T_k
and D distinct, T != D), so that a wrong reading either raises or cannot fit: the layout ``(B, H, T, D)``,
``(B, T, H, D)``, ``(B*H, T, D)`` or packed ``(total, H, D)`` with ``cu_seqlens`` is the one whose output
equals a float64 reference; a scale argument is the one that, set to 0.37, gives attention at scale 0.37; a
causal flag is the one whose ``True`` gives a causal output, and which of top-left (SDPA's ``is_causal``)
or bottom-right (flash-attention >= 2.1) it is shows when T_q != T_k; a mask argument is the one whose
bool or float tensor masks the scores as keep, block or an additive bias; GQA is K/V with fewer heads.
Argument names are hints (the order candidates are tried in, and what a mistake is called), never the test.

Then rows like the module checks' (:class:`attnlab.check.result.CheckResult`): forward parity in float64
and float32, keys spanning several tiles, the scale, causal, mask, GQA and varlen forms found, scores large
enough to overflow an unshifted exp, and forward and backward in float16/bfloat16 by flash-attention's rule
(the target's error against float64 at most 2x that of the same formula run plainly in that dtype, plus a
floor). A failing row is explained by the mistake whose formula reproduces it (the catalogue's where one
fits, :mod:`attnlab.check.catalogue`), or else in plain words by the quantity that departs.

A Triton kernel wrapped in a Python function runs on the CPU under ``TRITON_INTERPRET=1``. Measured
(triton 3.9.0, torch 2.13 CPU): float32, float16 and float64 kernels are right, but the interpreter's
``tl.dot`` on bfloat16 returns garbage (|err| 2.5e10 on a 16x16 product): a self-test decides, and the
bfloat16 rows are skipped with that reason when it fails.
"""

from __future__ import annotations

import inspect
import itertools
import math
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .catalogue import MISTAKES, S_MASK, S_SCALE, S_WALK, Mistake, by_id
from .result import Cause, CheckError, CheckResult, Report
from .suite import GRAD_TOL, LOW_PRECISION_FACTOR, LOW_PRECISION_FLOOR, PARITY_TOL, _rel
from .target import TargetError, is_attention_function, load_object

__all__ = [
    "FunctionTarget",
    "Sizes",
    "attention_function",
    "check_function",
    "interpret_triton",
    "is_attention_function",
    "read_function",
]

Layout = Literal["BHTD", "BTHD", "flat", "varlen"]
LAYOUT_TEXT = {
    "BHTD": "(B, H, T, D)",
    "BTHD": "(B, T, H, D)",
    "flat": "(B*H, T, D)",
    "varlen": "packed (total, H, D) with cu_seqlens",
}


@dataclass(frozen=True)
class Sizes:
    """One probe's sizes; ``G`` K/V heads (``G < H``: grouped-query)."""

    B: int
    H: int
    G: int
    T_q: int
    T_k: int
    D: int


# Every size distinct and T != D: a (B, T, H, D) tensor read as (B, H, T, D) cannot fit the other inputs.
SHORT = Sizes(2, 3, 3, 5, 11, 16)
GQA_SIZES = Sizes(3, 6, 2, 5, 11, 16)  # query head h reads K/V head h // 3 (repeat_interleave), not h % 2
LONG = Sizes(1, 2, 2, 17, 200, 16)  # T_k spans several key tiles of every usual size, 16 .. 128
LOW = Sizes(2, 3, 3, 17, 40, 16)  # the low-precision rule compares maxima: more elements than SHORT
SELF_T = 13  # the lengths when the function takes T_q == T_k only (T != D still)
VARLEN_Q, VARLEN_K = (3, 6, 2), (5, 9, 4)  # per-sequence lengths, q and k (equal when one cu_seqlens is shared)
TILES = (8, 16, 32, 64, 128)  # key-tile sizes an online softmax is tried at
MATCH_TOL = 1e-4  # an experiment's output "is" a formula's when their relative error is below this
# What the experiments run in: the first the function takes (a fused kernel may take float16/bfloat16 only).
WORK_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
PROBE_SCALE = 0.37  # what a scale argument is set to: no usual scale equals it
PROBE_DROPOUT = 0.37
# Parameter names tried when the function shows no signature (a builtin such as SDPA) or takes **kwargs.
COMMON_NAMES = ("attn_mask", "mask", "attn_bias", "is_causal", "causal", "scale", "softmax_scale", "sm_scale",
                "enable_gqa", "dropout_p", "p")  # fmt: skip
# The mask shapes tried, each cut from a (B, H, T_q, T_k) mask.
MASK_SHAPES: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] = {
    # shape: (cut it from a (B, H, T_q, T_k) mask, widen it back to broadcast over (B, H, T_q, T_k))
    "(B, H, T_q, T_k)": (lambda m: m, lambda m: m),
    "(B, 1, T_q, T_k)": (lambda m: m[:, :1], lambda m: m),
    "(T_q, T_k)": (lambda m: m[0, 0], lambda m: m),
    "(B, 1, 1, T_k)": (lambda m: m[:, :1, :1], lambda m: m),
    "(B, T_k)": (lambda m: m[:, 0, 0], lambda m: m[:, None, None, :]),  # a key padding mask
}


class TargetRaised(Exception):
    """The function under check raised; ``error`` is its exception (a finding about it, never check's own)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        self.error = error


# -- the formula, and the mistakes as variants of it ---------------------------------------------------------
@dataclass(frozen=True)
class Formula:
    """``softmax(q k^T * scale + bias, masked) v``, with knobs for the mistakes the diagnosis tries."""

    scale: float
    causal: int | None = None  # query i sees keys j <= i + causal (0: top-left; T_k - T_q: bottom-right)
    causal_reversed: bool = False  # ... or j >= i + causal
    keep: Tensor | None = None  # bool, True = may attend, broadcast to (B, H, T_q, T_k)
    bias: Tensor | None = None  # added to the scores
    mask_after_softmax: bool = False
    kv_repeat: Literal["interleave", "tile"] = "interleave"  # K/V head of query head h: h // (H/G), or h % G
    softmax_dim: int = -1
    scale_after_softmax: bool = False
    no_max: bool = False  # exp of the unshifted scores
    # exp(s - max) / sum written out, each step in the inputs' dtype (torch.softmax accumulates wider)
    by_hand: bool = False
    # an online softmax over key tiles that never rescales its sum: (tile size, l rescaled)
    tile: tuple[int, bool] | None = None
    # keys padded with zeros to a multiple of this tile, the padding not masked: phantom keys of score 0
    pad_tile: int | None = None


def _visible(f: Formula, T_q: int, T_k: int, device: torch.device) -> Tensor | None:
    """Bool, True = may attend, broadcastable to (B, H, T_q, T_k); None when nothing is masked."""
    keep = None if f.keep is None else f.keep.to(device)
    if f.bias is not None:
        finite = f.bias.to(device) != float("-inf")
        keep = finite if keep is None else keep & finite
    if f.causal is not None:
        i = torch.arange(T_q, device=device)[:, None]
        j = torch.arange(T_k, device=device)[None, :]
        tri = j >= i + f.causal if f.causal_reversed else j <= i + f.causal  # (T_q, T_k)
        keep = tri if keep is None else keep & tri
    return keep


def attend(q: Tensor, k: Tensor, v: Tensor, f: Formula) -> Tensor:
    """The formula ``f`` on ``q (B, H, T_q, D)``, ``k, v (B, G, T_k, D)``, in their dtype; ``(B, H, T_q, D)``.

    A query with no visible key gets a zero context (flash-attention's reference does the same)."""
    H, G = q.size(1), k.size(1)
    if G != H:
        if f.kv_repeat == "interleave":
            k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)  # (B, H, T_k, D)
        else:
            k, v = k.repeat(1, H // G, 1, 1), v.repeat(1, H // G, 1, 1)  # (B, H, T_k, D)
    if f.pad_tile is not None:  # zero keys and values up to a whole number of tiles
        pad = (-k.size(-2)) % f.pad_tile
        k = torch.cat([k, k.new_zeros(*k.shape[:-2], pad, k.size(-1))], -2)  # (B, H, T_k + pad, D)
        v = torch.cat([v, v.new_zeros(*v.shape[:-2], pad, v.size(-1))], -2)
        f = replace(f, pad_tile=None, keep=None if f.keep is None else F.pad(f.keep, (0, pad), value=True),
                    bias=None if f.bias is None else F.pad(f.bias, (0, pad)))  # fmt: skip
    T_q, T_k = q.size(-2), k.size(-2)
    s = q @ k.transpose(-2, -1)  # (B, H, T_q, T_k)
    if not f.scale_after_softmax:
        s = s * f.scale
    if f.bias is not None:
        s = s + f.bias.to(s)
    keep = _visible(f, T_q, T_k, s.device)
    if keep is not None and not f.mask_after_softmax:
        s = s.masked_fill(~keep, float("-inf"))
    if f.tile is not None:
        return _online_without_rescale(s, v, *f.tile)
    if f.no_max or f.by_hand:
        e = s.exp() if f.no_max else (s - s.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)).exp()
        w = e / e.sum(-1, keepdim=True)  # (B, H, T_q, T_k)
    else:
        w = torch.softmax(s, f.softmax_dim)  # (B, H, T_q, T_k)
    if keep is not None:
        if f.mask_after_softmax:
            w = w.masked_fill(~keep, 0.0)
        w = w.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # fully masked rows: zero context
    if f.scale_after_softmax:
        w = w * f.scale
    return w @ v  # (B, H, T_q, D)


def _online_without_rescale(s: Tensor, v: Tensor, tile: int, rescale_l: bool) -> Tensor:
    """An online softmax over key tiles of ``tile`` that keeps the running maximum but never rescales the
    accumulated ``sum p v`` by ``exp(m_old - m_new)`` when it changes (nor the sum ``l``, unless ``rescale_l``)."""
    m = torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype, device=s.device)  # (B, H, T_q)
    total = torch.zeros_like(m)  # the running sum l
    acc = torch.zeros(*s.shape[:-1], v.size(-1), dtype=s.dtype, device=s.device)  # (B, H, T_q, D)
    for a in range(0, s.size(-1), tile):
        st = s[..., a : a + tile]  # (B, H, T_q, tile)
        m_new = torch.maximum(m, st.amax(-1))
        shift = m_new.masked_fill(m_new.isinf(), 0.0)
        p = (st - shift[..., None]).exp()
        total = (total * (m - shift).exp() if rescale_l else total) + p.sum(-1)
        acc = acc + p @ v[..., a : a + tile, :]
        m = m_new
    return acc / total[..., None]


def _mistakes(f: Formula, s: Sizes) -> list[tuple[str, str, Formula]]:
    """``(catalogue id or own id, what exactly, formula)`` for each mistake tried against a departure from ``f``."""
    out = [
        ("scale_missing", "", replace(f, scale=1.0)),
        ("scale_head_dim_not_sqrt", "", replace(f, scale=1 / s.D)),
        ("scale_multiplied", "", replace(f, scale=math.sqrt(s.D))),
        ("scale_seq_len", f"1/sqrt(T_k) = 1/sqrt({s.T_k})", replace(f, scale=1 / math.sqrt(s.T_k))),
        ("scale_seq_len", f"1/sqrt(T_q) = 1/sqrt({s.T_q})", replace(f, scale=1 / math.sqrt(s.T_q))),
        ("scale_after_softmax", "", replace(f, scale_after_softmax=True)),
        ("softmax_query_axis", "", replace(f, softmax_dim=-2)),
        ("softmax_head_axis", "", replace(f, softmax_dim=1)),
    ]
    out += [("tile_padding_unmasked", str(t), replace(f, pad_tile=t)) for t in TILES if s.T_k % t]
    out += [
        (
            "online_softmax_no_rescale",
            f"{t}{'' if rescaled else ', the running sum l too'}",
            replace(f, tile=(t, rescaled)),
        )
        for t in TILES
        if t < s.T_k
        for rescaled in (True, False)
    ]
    if f.causal is not None:
        out += [
            ("causal_sees_next", "", replace(f, causal=f.causal + 1)),
            ("causal_hides_self", "", replace(f, causal=f.causal - 1)),
            ("causal_reversed", "", replace(f, causal_reversed=True)),
        ]
        if s.T_q != s.T_k:  # the other alignment
            other = 0 if f.causal == s.T_k - s.T_q else s.T_k - s.T_q
            out.append(("causal_alignment", _alignment(other, s), replace(f, causal=other)))
    if f.keep is not None:
        out += [
            ("mask_polarity", "", replace(f, keep=~f.keep)),
            ("mask_ignored", "", replace(f, keep=None)),
            ("bool_mask_added", "", replace(f, keep=None, bias=f.keep.to(torch.float64))),
            ("mask_after_softmax", "", replace(f, mask_after_softmax=True)),
        ]
    if f.bias is not None:
        out.append(("mask_ignored", "", replace(f, bias=None)))
    if s.G != s.H:
        out.append(("gqa_kv_heads_tiled", "", replace(f, kv_repeat="tile")))
    return out


def _alignment(offset: int | None, s: Sizes) -> str:
    if offset is None:
        return "none"
    if s.T_q == s.T_k:
        return "T_q = T_k only (alignment not shown)" if offset == 0 else f"offset {offset}"
    return {0: "top-left", s.T_k - s.T_q: "bottom-right"}.get(offset, f"offset {offset}")


# -- calling the function ------------------------------------------------------------------------------------
def _output(out: object, shape: tuple[int, ...]) -> Tensor | None:
    """The output tensor: the result, or the first tensor of a tuple of ``shape`` (flash-attention's
    ``(out, softmax_lse, ...)``, an ``(lse, out)`` pair), else its first tensor; None when there is none."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)):
        tensors = [o for o in out if isinstance(o, Tensor)]
        return next((o for o in tensors if tuple(o.shape) == shape), tensors[0] if tensors else None)
    return None


def _to_layout(x: Tensor, layout: Layout) -> Tensor:
    """``(B, H, T, D)`` to the function's layout, contiguous (kernels index raw memory)."""
    if layout == "BTHD":
        return x.transpose(1, 2).contiguous()  # (B, T, H, D)
    if layout == "flat":
        return x.reshape(-1, x.size(2), x.size(3)).contiguous()  # (B*H, T, D)
    return x.contiguous()


def _guarded(x: Tensor) -> Tensor:
    """``x`` in the first half of a buffer whose second half is NaN: a kernel that reads past its input (no
    bounds mask on a tile's load, K/V indexed by query head) gets NaN, not whatever memory lies there."""
    buf = torch.full((2 * x.numel(),), float("nan"), dtype=x.dtype, device=x.device)
    view = buf[: x.numel()].view(x.shape)
    view.copy_(x)  # differentiable: gradients reach x
    return view


def _from_layout(out: Tensor, layout: Layout, B: int, H: int, T_q: int, D: int) -> Tensor | None:
    """The function's output back to ``(B, H, T_q, D)``; None when its shape is not that layout's."""
    want = {"BHTD": (B, H, T_q, D), "BTHD": (B, T_q, H, D), "flat": (B * H, T_q, D)}[layout]
    if tuple(out.shape) != want:
        return None
    if layout == "BTHD":
        return out.transpose(1, 2)
    return out.reshape(B, H, T_q, D)


def _pack(x: Tensor, lens: Sequence[int]) -> Tensor:
    """``(B, H, T, D)`` with sequence b's first ``lens[b]`` positions real to packed ``(sum(lens), H, D)``."""
    return torch.cat([x[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)]).contiguous()


def _cu(lens: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


@dataclass
class Call:
    """One probe call: inputs in ``(B, H, T, D)`` (k, v padded to T_k in varlen), the knobs set, the output."""

    sizes: Sizes
    q: Tensor
    k: Tensor
    v: Tensor
    want: Formula  # what it should compute
    knobs: dict[str, object] = field(default_factory=dict)  # semantic: scale, causal, mask, gqa
    out: Tensor | None = None  # (B, H, T_q, D), in the call's dtype


class FunctionTarget:
    """An attention function, its call form found by experiment (:meth:`find_form`)."""

    def __init__(
        self,
        fn: Callable,
        name: str,
        *,
        scale: float | None = None,
        mask_convention: Literal["keep", "block"] | None = None,
        causal_alignment: Literal["top-left", "bottom-right"] | None = None,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ) -> None:
        self.fn, self.name, self.seed = fn, name, seed
        self.device = torch.device(device)
        self.user_scale = scale
        self.given_convention = mask_convention
        self.convention = mask_convention or "keep"  # block for an argument named a padding mask (_find_mask)
        self.causal_alignment = causal_alignment
        try:
            self.params: dict[str, inspect.Parameter] | None = dict(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            self.params = None
        self.layout: Layout = "BHTD"
        self.equal_lengths = False
        self.fixed: dict[str, object] = {}  # required arguments after q, k, v, and the values that run
        self.varlen_args: dict[str, str] = {}  # parameter name -> cu_q, cu_k, max_q, max_k
        self.base = Formula(self.scale_for(SHORT))  # what its plain call computes (a mistake's formula, or right)
        self.base_mistake: tuple[str, str] | None = None
        self.scale_arg: str | None = None
        self.scale_ignored: str | None = None  # an argument named as a scale that changes nothing
        self.dropout_arg: str | None = None
        self.causal_arg: str | None = None
        self.causal_offset: int | None = None  # what its causal flag computes; None: no causal formula fits
        self.causal_mistake: tuple[str, str] | None = None
        self.causal_mistake_offset: int | None = None  # the alignment that mistake departs from
        self.mask_arg: str | None = None
        self.mask_forms: dict[str, list[str]] = {}  # "bool keep" / "bool block" / "additive" -> shapes that work
        self.mask_mistake: tuple[str, str] | None = None
        self.gqa: str | None = None  # None: no GQA; "native"; or the flag's name
        self.gqa_found: str | None = None  # "interleave", "tile", or None (runs, matches neither)
        self.gqa_unread = ""  # why GQA is not taken, when the call ran
        self.triton_bf16: str | None = None  # why bfloat16 rows are skipped under the Triton interpreter
        self.work_dtype = torch.float64  # the experiments': the first of WORK_DTYPES it takes
        self.varlen_sizes: Sizes | None = None  # varlen: the padded (B, H, max T_q, max T_k, D) of the lengths

    # -- sizes and inputs ----------------------------------------------------------------------------------
    @property
    def tol_match(self) -> float:
        """How near an experiment's output must come to a formula to be read as it: a half dtype's rounding
        is ~1e-3 relative, a mistake's departure 1e-1 and more."""
        return MATCH_TOL if self.work_dtype in (torch.float64, torch.float32) else 3e-2

    def scale_for(self, s: Sizes) -> float:
        return self.user_scale if self.user_scale is not None else 1 / math.sqrt(s.D)

    def sizes(self, s: Sizes) -> Sizes:
        """``s`` as the function can take it: T_q = T_k when it takes only equal lengths."""
        if self.equal_lengths:
            T = SELF_T if s.T_k < 100 else 150
            return replace(s, T_q=T, T_k=T)
        return s

    def inputs(self, tag: str, s: Sizes, dtype: torch.dtype, magnitude: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
        """Seeded ``q (B, H, T_q, D)``, ``k, v (B, G, T_k, D)``, drawn in float64 on the CPU, rounded to ``dtype``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(tag.encode()))
        q = torch.randn(s.B, s.H, s.T_q, s.D, generator=g, dtype=torch.float64) * magnitude
        k = torch.randn(s.B, s.G, s.T_k, s.D, generator=g, dtype=torch.float64) * magnitude
        v = torch.randn(s.B, s.G, s.T_k, s.D, generator=g, dtype=torch.float64)
        return tuple(t.to(self.device, dtype) for t in (q, k, v))  # type: ignore[return-value]

    # -- one call ------------------------------------------------------------------------------------------
    def invoke(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> Tensor:
        """``fn(q, k, v, **kwargs)``'s output tensor (of q's shape, when it returns several); anything it
        raises is :class:`TargetRaised`."""
        try:
            out = self.fn(q, k, v, **kwargs)
        except Exception as e:
            raise TargetRaised(e) from e
        t = _output(out, (*q.shape[:-1], v.size(-1)))
        if t is None:
            raise TargetRaised(TypeError(f"it returned {type(out).__name__}, not a tensor"))
        return t

    def run(self, c: Call, *, layout: Layout | None = None, extra: dict[str, object] | None = None) -> Tensor:
        """Call the function on ``c``'s inputs with its knobs; the output as ``(B, H, T_q, D)``."""
        layout = layout or self.layout
        s = c.sizes
        kw: dict[str, object] = dict(self.fixed)
        if self.dropout_arg:
            kw[self.dropout_arg] = 0.0
        for knob, value in c.knobs.items():
            name = {"scale": self.scale_arg, "causal": self.causal_arg, "mask": self.mask_arg}.get(knob)
            if knob == "gqa" and self.gqa not in (None, "native"):
                name, value = self.gqa, True
            if name is not None:
                kw[name] = value
        kw.update(extra or {})
        if layout == "varlen":
            return self._run_varlen(c, kw)
        q, k, v = (_guarded(_to_layout(t, layout)) for t in (c.q, c.k, c.v))
        out = self.invoke(q, k, v, **kw)
        got = _from_layout(out, layout, s.B, s.H, s.T_q, s.D)
        if got is None:
            raise TargetRaised(ValueError(f"it returned shape {list(out.shape)} for q of shape {list(q.shape)}"))
        return got

    def _run_varlen(self, c: Call, kw: dict[str, object]) -> Tensor:
        lens_q, lens_k = self.varlen_lens(c.sizes)
        values = {
            "cu_q": _cu(lens_q, self.device),
            "cu_k": _cu(lens_k, self.device),
            "max_q": max(lens_q),
            "max_k": max(lens_k),
        }
        for name, what in self.varlen_args.items():
            kw[name] = values[what]
        q, k, v = (_guarded(_pack(x, n)) for x, n in ((c.q, lens_q), (c.k, lens_k), (c.v, lens_k)))  # (total, H, D)
        out = self.invoke(q, k, v, **kw)
        if tuple(out.shape) != tuple(q.shape):
            raise TargetRaised(ValueError(f"it returned shape {list(out.shape)} for packed q of shape {list(q.shape)}"))
        full = torch.zeros(c.sizes.B, c.sizes.H, c.sizes.T_q, c.sizes.D, dtype=out.dtype, device=out.device)
        for b, (a, n) in enumerate(zip(itertools.accumulate([0, *lens_q]), lens_q, strict=False)):
            full[b, :, :n] = out[a : a + n].transpose(0, 1)
        return full

    def varlen_lens(self, s: Sizes) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shared = "cu_k" not in self.varlen_args.values()
        lens_k = VARLEN_Q if shared else VARLEN_K
        return VARLEN_Q, lens_k

    def expected(self, c: Call, f: Formula | None = None, *, plain: bool = False) -> Tensor:
        """``f`` (default ``c.want``) on ``c``'s inputs, ``(B, H, T_q, D)``, in float64 (``plain``: in their own
        dtype, the yardstick of the low-precision rule); varlen per sequence."""
        f = f or c.want
        q, k, v = (c.q, c.k, c.v) if plain else (c.q.double(), c.k.double(), c.v.double())
        if self.layout != "varlen":
            return attend(q, k, v, f)
        lens_q, lens_k = self.varlen_lens(c.sizes)
        out = torch.zeros_like(q)
        for b, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
            fb = replace(f, causal=None if f.causal is None else f.causal + (nk - nq) - (c.sizes.T_k - c.sizes.T_q))
            out[b, :, :nq] = attend(q[b : b + 1, :, :nq], k[b : b + 1, :, :nk], v[b : b + 1, :, :nk], fb)[0]
        return out

    def error(self, c: Call, f: Formula | None = None) -> float:
        """Relative error of ``c.out`` against ``f`` (varlen: on real positions only)."""
        assert c.out is not None
        return _rel(c.out, self.expected(c, f))

    # -- finding the form ----------------------------------------------------------------------------------
    def extras(self) -> list[inspect.Parameter]:
        if self.params is None:
            return []
        plain = [p for p in self.params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        return plain[3:]

    def candidates(self) -> list[str]:
        """Argument names an experiment may set: those after q, k, v, plus :data:`COMMON_NAMES` when the
        signature is hidden or takes ``**kwargs``."""
        names = [p.name for p in self.extras() if p.kind != p.POSITIONAL_ONLY and p.name not in self.varlen_args]
        if self.params is None or any(p.kind == p.VAR_KEYWORD for p in self.params.values()):
            names += [n for n in COMMON_NAMES if n not in names]
        return names

    def find_form(self) -> None:
        """Layout, required arguments, the base formula, then each knob (see the module docstring).

        Raises :class:`TargetRaised` (its last exception) when no reading runs."""
        self._find_layout()
        taken = set(self.varlen_args) | {n for n in self.fixed if n not in self.candidates()}
        names = [n for n in self.candidates() if n not in taken]
        self._find_scale(names)
        self._find_dropout([n for n in names if n != self.scale_arg])
        rest = [n for n in names if n not in (self.scale_arg, self.dropout_arg)]
        self._find_causal(rest)
        rest = [n for n in rest if n != self.causal_arg]
        self._find_mask(rest)
        if self.layout in ("BHTD", "BTHD"):
            self._find_gqa([n for n in rest if n != self.mask_arg])
        self._triton_self_test()

    def _required(self) -> list[inspect.Parameter]:
        return [p for p in self.extras() if p.default is p.empty]

    def _best(self, c: Call, formulas: Sequence[tuple[str, str, Formula]]) -> tuple[str, str, float]:
        """The formula nearest ``c.out``: ``(id, what, error)``."""
        errs = [(i, what, self.error(c, f)) for i, what, f in formulas]
        return min(errs, key=lambda e: e[2])

    def _find_layout(self) -> None:
        required = self._required()
        varlen = {p.name: p for p in required if "cu_seq" in p.name or "cu_len" in p.name}
        if varlen or any("max_seqlen" in p.name for p in required):
            self._find_varlen(required)
            return
        if len(required) > 3:
            raise TargetRaised(
                TypeError(f"it needs {', '.join(p.name for p in required)} after q, k, v; check fills at most three")
            )
        # the required arguments after q, k, v: each tried as None, False and the expected scale
        choices = list(itertools.product((None, False, self.scale_for(SHORT)), repeat=len(required)))
        errors: list[str] = []
        best: tuple[tuple[bool, bool, float], Layout, dict[str, object], bool, tuple[str, str]] | None = None
        for self.work_dtype, equal in itertools.product(WORK_DTYPES, (False, True)):
            s = replace(SHORT, T_q=SELF_T, T_k=SELF_T) if equal else SHORT
            f = Formula(self.scale_for(s))
            for layout in ("BHTD", "BTHD", "flat"):
                for values in choices:
                    fixed: dict[str, object] = {p.name: v for p, v in zip(required, values, strict=True)}
                    c = Call(s, *self.inputs("layout", s, self.work_dtype), want=f)
                    try:
                        self.fixed = fixed
                        c.out = self.run(c, layout=layout)
                    except TargetRaised as e:
                        errors.append(f"{LAYOUT_TEXT[layout]}: {e}")
                        continue
                    self.layout = layout
                    i, what, err = self._best(c, [("pass", "", f), *_mistakes(f, s)])
                    right = self.error(c, f) < self.tol_match
                    # a 4-D reading before (B*H, T, D): a (B, H, T, D) function runs on 3-D tensors too, where its
                    # softmax over heads reads as one over queries and its q.size(2) as D; then the one where the
                    # right formula fits; then the nearest
                    rank = (layout == "flat", not right, err)
                    if best is None or rank < best[0]:
                        best = (rank, layout, fixed, equal, (i, what))
            if best is not None:
                break
        if best is None:
            raise TargetRaised(RuntimeError("; ".join(dict.fromkeys(errors)) or "no call ran"))
        (_, _, err), self.layout, self.fixed, self.equal_lengths, (i, what) = best
        self._set_base(i, what, err, self.sizes(SHORT))

    def _set_base(self, i: str, what: str, err: float, s: Sizes) -> None:
        """The base formula: the mistake ``(i, what)`` when it fits the plain call, else the right one."""
        right = Formula(self.scale_for(s))
        fits = err < self.tol_match and i != "pass"
        self.base = next((f for j, w, f in _mistakes(right, s) if (j, w) == (i, what)), right) if fits else right
        self.base_mistake = (i, what) if fits else None

    def _find_varlen(self, required: list[inspect.Parameter]) -> None:
        """Packed ``(total, H, D)`` with cumulative lengths: which argument is which, by its name's hint
        (``cu_seqlens_q``/``_k``, ``max_seqlen_q``/``_k``), else by position as flash-attention orders them."""
        self.layout = "varlen"
        cu = [p.name for p in required if "cu_" in p.name]
        mx = [p.name for p in required if "max" in p.name]
        if not cu:  # by position: (cu_q, cu_k, max_q, max_k) or (cu, max)
            names = [p.name for p in required]
            cu, mx = (names[:2], names[2:4]) if len(names) >= 4 else (names[:1], names[1:2])
        self.varlen_args = {n: w for n, w in zip(cu, ("cu_q", "cu_k"), strict=False)}
        self.varlen_args |= {n: w for n, w in zip(mx, ("max_q", "max_k"), strict=False)}
        left = [p.name for p in required if p.name not in self.varlen_args]
        if left:
            raise TargetRaised(TypeError(f"it needs {', '.join(left)} besides q, k, v and the cumulative lengths"))
        s = self.sizes(SHORT)
        s = replace(s, B=len(VARLEN_Q), T_q=max(VARLEN_Q), T_k=max(self.varlen_lens(s)[1]))
        f = Formula(self.scale_for(s))
        self.varlen_sizes = s
        for self.work_dtype in WORK_DTYPES:
            c = Call(s, *self.inputs("layout", s, self.work_dtype), want=f)
            try:
                c.out = self.run(c)
                break
            except TargetRaised:
                if self.work_dtype == WORK_DTYPES[-1]:
                    raise
        i, what, err = self._best(c, [("pass", "", f), *_mistakes(f, s)])
        self._set_base(i, what, err, s)

    def short(self) -> Sizes:
        """The sizes of the probes and of most rows (:data:`SHORT`, as the function can take them)."""
        return self.varlen_sizes or self.sizes(SHORT)

    def _probe(self, tag: str, s: Sizes | None = None, *, want: Formula | None = None, **knobs: object) -> Call:
        s = s or self.short()
        c = Call(s, *self.inputs(tag, s, self.work_dtype), want=want or replace(self.base, scale=self.scale_for(s)))
        c.knobs = dict(knobs)
        return c

    def _try(self, c: Call, **extra: object) -> Tensor | None:
        try:
            return self.run(c, extra=extra)
        except TargetRaised:
            return None

    def _find_scale(self, names: list[str]) -> None:
        for n in sorted(names, key=lambda n: "scale" not in n):
            c = self._probe("scale")
            c.out = self._try(c, **{n: PROBE_SCALE})
            if c.out is None:
                continue
            if self.error(c, replace(c.want, scale=PROBE_SCALE)) < self.tol_match:
                self.scale_arg = n
                return
            if "scale" in n and self.error(c) < self.tol_match:  # named a scale, and it changes nothing
                self.scale_ignored = n

    def _find_dropout(self, names: list[str]) -> None:
        for n in sorted(names, key=lambda n: "drop" not in n and n != "p"):
            c = self._probe("dropout")
            first, second = self._try(c, **{n: PROBE_DROPOUT}), self._try(c, **{n: PROBE_DROPOUT})
            if first is not None and second is not None and not torch.equal(first, second):
                self.dropout_arg = n  # random at p > 0: called with 0.0 from now on
                return

    def _find_causal(self, names: list[str]) -> None:
        s = self.short()
        plain = self._probe("causal")
        plain.out = self._try(plain)
        for n in sorted(names, key=lambda n: "causal" not in n):
            c = self._probe("causal")
            c.out = self._try(c, **{n: True})
            if c.out is None or plain.out is None or _rel(c.out, plain.out) < self.tol_match:
                continue
            aligned = [0] if s.T_q == s.T_k or self.layout == "varlen" else [0, s.T_k - s.T_q]
            if self.layout == "varlen":
                aligned = [s.T_k - s.T_q]  # per sequence; expected() re-aligns each
            tried = [(_alignment(o, s), str(o), replace(c.want, causal=o)) for o in aligned]
            for o in aligned:  # each mistake's "what" carries the alignment it departs from
                tried += [(i, str(o), f) for i, _, f in _mistakes(replace(c.want, causal=o), s)
                          if i.startswith("causal_") and i != "causal_alignment"]  # fmt: skip
            i, what, err = self._best(c, tried)
            if err >= self.tol_match and "causal" not in n:
                continue  # it changes the output, and no causal formula fits: not a causal flag
            self.causal_arg = n
            if err < self.tol_match and not i.startswith("causal_"):
                self.causal_offset = int(what)
            elif err < self.tol_match:
                self.causal_mistake = (i, _alignment(int(what), s))
                self.causal_mistake_offset = int(what)
            return

    def _mask_tensors(self, s: Sizes) -> tuple[Tensor, Tensor]:
        """A bool mask ``(B, H, T_q, T_k)`` whose every row keeps some key and blocks another, and an additive
        float mask of finite values and -inf, no row all -inf."""
        g = torch.Generator().manual_seed(self.seed + 17)
        keep = torch.rand(s.B, s.H, s.T_q, s.T_k, generator=g) > 0.5
        cols = torch.randperm(s.T_k, generator=g)[:2]
        keep[..., cols[0]], keep[..., cols[1]] = True, False
        bias = (torch.randn(s.B, s.H, s.T_q, s.T_k, generator=g, dtype=torch.float64) * 0.5).masked_fill(
            ~keep, float("-inf")
        )
        return keep.to(self.device), bias.to(self.device)

    def _find_mask(self, names: list[str]) -> None:
        if self.layout == "varlen":
            return  # packed sequences: masks are per sequence, by cu_seqlens
        s = self.short()
        keep, bias = self._mask_tensors(s)
        for n in sorted(names, key=lambda n: "mask" not in n and "bias" not in n):
            forms: dict[str, list[str]] = {}
            mistake: tuple[str, str] | None = None
            for kind, tensor in (("bool", keep), ("additive", bias)):
                for shape, (cut, widen) in MASK_SHAPES.items():
                    m = cut(tensor)
                    c = self._probe("mask")
                    c.out = self._try(c, **{n: m if kind == "bool" else m.to(self.work_dtype)})
                    if c.out is None:
                        continue
                    want = replace(c.want, keep=widen(m)) if kind == "bool" else replace(c.want, bias=widen(m))
                    tried = [("bool keep" if kind == "bool" else "additive", "", want), *_mistakes(want, s)]
                    tried = [t for t in tried if t[0] in ("bool keep", "additive") or "mask" in t[0]]
                    i, what, err = self._best(c, tried)
                    if err >= self.tol_match:
                        continue
                    if i == "mask_polarity":
                        i = "bool block"
                    if i in ("bool keep", "bool block", "additive"):
                        forms.setdefault(i, []).append(shape)
                    elif mistake is None:
                        mistake = (i, what)
            only_ignored = mistake is not None and mistake[0] == "mask_ignored" and not forms
            if forms or (mistake and (not only_ignored or "mask" in n or "bias" in n)):
                self.mask_arg, self.mask_forms, self.mask_mistake = n, forms, mistake
                if self.given_convention is None and "padding" in n:
                    self.convention = "block"  # a key padding mask: True = padding (nn.MultiheadAttention's, HF's)
                return

    def _find_gqa(self, names: list[str]) -> None:
        """K/V with fewer heads than q: taken as they are, or under a flag. A call that runs but fits no head
        mapping counts only when its output is finite (a kernel without GQA reads past K/V: NaN, garbage)."""
        s = GQA_SIZES if not self.equal_lengths else replace(GQA_SIZES, T_q=SELF_T, T_k=SELF_T)
        c = self._probe("gqa", s, gqa=True)
        for n in [None, *sorted(names, key=lambda n: "gqa" not in n)]:
            self.gqa = "native" if n is None else n
            c.out = self._try(c)
            if c.out is None:
                continue
            i, _, err = self._best(c, [("interleave", "", c.want), ("tile", "", replace(c.want, kv_repeat="tile"))])
            finite = bool(torch.isfinite(c.out).all())  # not: it read past K/V (see _guarded)
            if err < self.tol_match or (n is None and finite) or (n is not None and "gqa" in n):
                self.gqa_found = i if err < self.tol_match else None
                return
            if n is None:
                self.gqa_unread = (
                    "with K/V of fewer heads it runs, but reads past them (NaN placed after K/V reaches its output)"
                )
        self.gqa = None

    def _triton_self_test(self) -> None:
        """Under the Triton interpreter, whether its bfloat16 ``tl.dot`` is right here (see the module docstring)."""
        if os.environ.get("TRITON_INTERPRET") != "1" or "triton" not in sys.modules:
            return
        err = _bf16_dot_error()
        if err is not None and not err < 1e-1:
            self.triton_bf16 = (
                f"the Triton interpreter's bfloat16 tl.dot is wrong on this CPU (a 16x16 product off by {err:.1e}): "
                f"check bfloat16 on a GPU"
            )

    # -- what was found, in one line -----------------------------------------------------------------------
    def describe(self) -> str:
        parts = [f"layout {LAYOUT_TEXT[self.layout]}"]
        if self.equal_lengths:
            parts.append("T_q = T_k only")
        if self.work_dtype != torch.float64:
            parts.append(f"no float64: read in {str(self.work_dtype).removeprefix('torch.')}")
        if self.fixed:
            parts.append("called with " + ", ".join(f"{k}={v!r}" for k, v in self.fixed.items()))
        if self.mask_arg:
            shapes = {tuple(v) for v in self.mask_forms.values()}
            if len(shapes) == 1:  # every form in the same shapes: said once
                shown = f"{' or '.join(self.mask_forms)}, shapes {', '.join(shapes.pop())}"
            else:
                shown = " or ".join(f"{k} ({', '.join(v)})" for k, v in self.mask_forms.items())
            if not self.mask_forms:
                shown = f"no form fits ({self.mask_mistake[0]})" if self.mask_mistake else "no form fits"
            parts.append(f"mask: {self.mask_arg} = {shown}")
        else:
            parts.append("mask: none")
        if self.causal_arg:
            how = (
                _alignment(self.causal_offset, self.short())
                if self.causal_offset is not None
                else "fits neither alignment"
            )
            parts.append(f"causal: {self.causal_arg}=True, {how}")
        else:
            parts.append("causal: none")
        if self.gqa:
            maps = {"interleave": "query head h reads K/V head h // (H/G)", "tile": "query head h reads K/V head h % G"}
            flag = "k/v with fewer heads" if self.gqa == "native" else f"{self.gqa}=True"
            parts.append(f"GQA: {flag}, {maps.get(self.gqa_found or '', 'fits neither mapping')}")
        else:
            parts.append("GQA: none")
        if self.scale_arg:
            parts.append(f"scale: {self.scale_arg}")
        if self.dropout_arg:
            parts.append(f"dropout: {self.dropout_arg} (called with 0)")
        return f"{self.name}: found " + "; ".join(parts)

    # -- the rows ------------------------------------------------------------------------------------------
    def right(self, s: Sizes, **changes: object) -> Formula:
        """The right formula at sizes ``s``: attention at the expected scale, with ``changes``."""
        return replace(Formula(self.scale_for(s)), **changes)  # type: ignore[arg-type]

    def expected_causal(self, s: Sizes) -> int:
        """The offset the causal flag should have: ``--causal-alignment``'s, else the one found (either
        alignment is right), else the one its mistake was measured against, else bottom-right."""
        offsets = {"top-left": 0, "bottom-right": s.T_k - s.T_q}
        if self.layout == "varlen":
            return s.T_k - s.T_q  # flash-attention's varlen: bottom-right per sequence (expected() re-aligns)
        if self.causal_alignment is not None:
            return offsets[self.causal_alignment]
        for found in (self.causal_offset, self.causal_mistake_offset):
            if found is not None and found in offsets.values():
                return found
        return offsets["bottom-right"]


@dataclass
class Row:
    """A row being built: its result, the calls it made (the diagnosis recomputes them under each mistake),
    the tolerance those calls were held to, and the dtype they ran in."""

    result: CheckResult
    calls: list[Call] = field(default_factory=list)
    tol: float = PARITY_TOL


def _row(name: str, ok: bool, measured: float | str, tol: float | str, detail: str, **data: object) -> CheckResult:
    return CheckResult(name, "pass" if ok else "fail", measured, tol, detail, data=dict(data))


def _skip(name: str, reason: str) -> CheckResult:
    return CheckResult(name, "skip", None, None, reason)


def _plain_error(t: FunctionTarget, c: Call) -> float:
    """The worse error of the two plain formulas (torch.softmax, and exp / sum by hand) run in ``c``'s dtype."""
    want = t.expected(c)
    return max(_rel(t.expected(c, f, plain=True), want) for f in (c.want, replace(c.want, by_hand=True)))


def _raised(t: FunctionTarget, name: str, dtype: torch.dtype, e: TargetRaised) -> CheckResult:
    """A row whose call raised: a skip when the function does not take ``dtype`` at all (a kernel for half
    precision only), unless the message is a catalogued crash (a mask fill float16 cannot hold); else a failure."""
    crash = any(m.kind == "crash" and re.search(m.pattern, str(e)) for m in MISTAKES)
    if dtype != t.work_dtype and not crash:
        return _skip(name, f"it does not take {str(dtype).removeprefix('torch.')} inputs: it raised {e}")
    return _crash(name, e)


def _crash(name: str, e: TargetRaised) -> CheckResult:
    return CheckResult(name, "fail", "raised", "-", f"the function raised {e}", data={"raised": str(e)})


class Rows:
    """The rows of one function target, in the order they run."""

    def __init__(self, t: FunctionTarget) -> None:
        self.t = t
        self.rows: list[Row] = []

    def parity(self, name: str, s: Sizes, dtype: torch.dtype, detail: str, **knobs: object) -> Row:
        """Output parity of one call against the right formula (``knobs`` set as the ``want`` says)."""
        t = self.t
        want = t.right(s)
        if "causal" in knobs:
            want = replace(want, causal=t.expected_causal(s))
        if "mask" in knobs:
            want = replace(want, **knobs.pop("_want"))  # type: ignore[arg-type]
        if "scale" in knobs:
            want = replace(want, scale=knobs["scale"])  # type: ignore[arg-type]
        c = Call(s, *t.inputs(name, s, dtype), want=want, knobs=dict(knobs))
        try:
            c.out = t.run(c)
        except TargetRaised as e:
            return Row(_raised(t, name, dtype, e))
        err, tol = t.error(c), PARITY_TOL
        if dtype in (torch.float16, torch.bfloat16):  # a kernel that takes half only: flash-attention's rule
            tol = LOW_PRECISION_FACTOR * _plain_error(t, c) + LOW_PRECISION_FLOOR
            detail += (
                f"; in {str(dtype).removeprefix('torch.')} (it takes no float32): 2x plain + {LOW_PRECISION_FLOOR:g}"
            )
        return Row(_row(name, err <= tol, err, tol, detail), [c], tol)

    @property
    def feature_dtype(self) -> torch.dtype:
        """What the feature rows (long keys, scale, causal, mask, GQA, varlen) run in: float32, or the half dtype
        a kernel that takes no float32 runs in."""
        return torch.float32 if self.t.work_dtype in (torch.float64, torch.float32) else self.t.work_dtype

    def add(self, row: Row) -> None:
        self.rows.append(row)

    def all(self) -> list[Row]:
        t = self.t
        s = t.short()
        dims = f"B={s.B} H={s.H} T_q={s.T_q} T_k={s.T_k} D={s.D}"
        self.add(self.parity("parity[float64]", s, torch.float64, f"{dims}, float64 in and out"))
        self.add(self.parity("parity[float32]", s, torch.float32, f"{dims}, float32"))
        if t.layout != "varlen":
            long = t.sizes(LONG)
            self.add(self.parity("parity[long keys]", long, self.feature_dtype,
                                 f"T_q={long.T_q}, T_k={long.T_k}: keys span several tiles of 16 .. 128"))  # fmt: skip
        self.add(self.scale_row(s))
        self.add(self.causal_row(s))
        for kind in ("bool", "additive"):
            self.add(self.mask_row(s, kind))
        self.add(self.gqa_row())
        if t.layout == "varlen":
            self.add(self.varlen_leak_row(s))
        for dtype in (torch.float32, torch.float16):
            self.add(self.large_scores_row(s, dtype))
        for dtype in (torch.float16, torch.bfloat16):
            self.add(self.low_precision_row(dtype, grads=False))
        self.add(self.grad_row(s))
        for dtype in (torch.float16, torch.bfloat16):
            self.add(self.low_precision_row(dtype, grads=True))
        return self.rows

    def scale_row(self, s: Sizes) -> Row:
        t = self.t
        if t.scale_ignored:
            return Row(_row("scale_argument", False, "ignored", f"scale {PROBE_SCALE}",
                            f"{t.scale_ignored}={PROBE_SCALE} gives the output of the default scale",
                            ignored=t.scale_ignored))  # fmt: skip
        if t.scale_arg is None:
            return Row(_skip("scale_argument", "takes no scale argument (none of its arguments set to 0.37 scales the scores by 0.37)"))  # fmt: skip
        return self.parity("scale_argument", s, self.feature_dtype, f"{t.scale_arg}={PROBE_SCALE}", scale=PROBE_SCALE)

    def causal_row(self, s: Sizes) -> Row:
        t = self.t
        if t.causal_arg is None:
            return Row(_skip("causal", "takes no causal flag (no argument set to True masks the future)"))
        row = self.parity("causal", s, self.feature_dtype, "", causal=True)
        found = _alignment(t.causal_offset, s) if t.causal_offset is not None else "neither alignment"
        want = _alignment(t.expected_causal(s), s)
        r = row.result
        detail = f"{t.causal_arg}=True at T_q={s.T_q}, T_k={s.T_k}: found {found}, expected {want}"
        if t.causal_alignment is None and t.causal_offset is not None:
            detail += " (either alignment passes; --causal-alignment picks one)"
        row.result = replace(r, detail=detail if r.measured != "raised" else r.detail)
        return row

    def mask_row(self, s: Sizes, kind: str) -> Row:
        t = self.t
        name = f"mask[{kind}]"
        if t.mask_arg is None:
            return Row(_skip(name, "takes no mask (no argument masks the scores as a bool or float tensor)"))
        keep, bias = t._mask_tensors(s)
        block = t.convention == "block"
        if kind == "bool":
            if "additive" in t.mask_forms and not any(k.startswith("bool") for k in t.mask_forms):
                return Row(_skip(name, "takes additive float masks only (a bool mask is added as 0/1 or refused)"))
            shapes = next((v for k, v in t.mask_forms.items() if k.startswith("bool")), [])
        else:
            if not t.mask_forms.get("additive") and any(k.startswith("bool") for k in t.mask_forms):
                return Row(_skip(name, "takes bool masks only (an additive float mask raises or does not fit)"))
            shapes = t.mask_forms.get("additive", [])
        shape = shapes[0] if shapes else "(B, H, T_q, T_k)"  # the first shape it takes: a key padding mask's
        cut, widen = MASK_SHAPES[shape]
        if kind == "bool":
            mask = cut(keep)
            want: dict[str, object] = {"keep": ~widen(mask) if block else widen(mask)}
        else:
            mask = cut(bias).to(self.feature_dtype)
            want = {"bias": widen(cut(bias))}
        conv = "True = blocked" if block else "True = may attend"
        detail = f"{t.mask_arg} {shape}" + (f", {conv}" if kind == "bool" else ", added to the scores")
        if len(shapes) > 1:
            detail += f"; shapes that work: {', '.join(shapes)}"
        return self.parity(name, s, self.feature_dtype, detail, mask=mask, _want=want)

    def gqa_row(self) -> Row:
        t = self.t
        if t.layout not in ("BHTD", "BTHD"):
            return Row(_skip("gqa", f"layout {LAYOUT_TEXT[t.layout]}: K/V heads cannot differ from query heads"))
        if t.gqa is None:
            why = t.gqa_unread or "it raises with K/V of fewer heads than q"
            return Row(_skip("gqa", f"{why}, and no flag makes it take them: no GQA"))
        s = GQA_SIZES if not t.equal_lengths else replace(GQA_SIZES, T_q=SELF_T, T_k=SELF_T)
        flag = "" if t.gqa == "native" else f", {t.gqa}=True"
        return self.parity("gqa", s, self.feature_dtype, f"H={s.H}, G={s.G}{flag}: query head h reads K/V head h // {s.H // s.G}",
                           gqa=True)  # fmt: skip

    def varlen_leak_row(self, s: Sizes) -> Row:
        """Sequence 0's output may not change when only the other sequences' keys and values do."""
        t = self.t
        c = Call(s, *t.inputs("varlen_leak", s, self.feature_dtype), want=t.right(s))
        other = Call(s, c.q, c.k.clone(), c.v.clone(), want=c.want)
        _, k2, v2 = t.inputs("varlen_leak other", s, self.feature_dtype)
        other.k[1:], other.v[1:] = k2[1:], v2[1:]
        try:
            c.out, other.out = t.run(c), t.run(other)
        except TargetRaised as e:
            return Row(_crash("varlen_no_leak", e))
        n = VARLEN_Q[0]
        change = _rel(other.out[0, :, :n], c.out[0, :, :n])
        return Row(_row("varlen_no_leak", change <= 1e-6, change, 1e-6,
                        "sequence 0's output, when sequences 1.. get other keys and values", change=change), [c])  # fmt: skip

    def large_scores_row(self, s: Sizes, dtype: torch.dtype) -> Row:
        """q and k 6x larger: scores near 100, past float32's exp limit (88.7) and far past float16's (11.1)."""
        t = self.t
        name = f"large_scores[{str(dtype).removeprefix('torch.')}]"
        q, k, v = t.inputs(name, s, dtype, magnitude=6.0)
        c = Call(s, q, k, v, want=t.right(s))
        try:
            c.out = t.run(c)
        except TargetRaised as e:
            return Row(_raised(t, name, dtype, e))
        want = t.expected(c)
        tol = LOW_PRECISION_FACTOR * _plain_error(t, c) + LOW_PRECISION_FLOOR
        err = _rel(c.out, want)
        detail = f"q, k ~ 6 N(0, 1): largest score {float((q.double() @ k.double().transpose(-2, -1)).abs().max()) * c.want.scale:.0f}; 2x plain + {LOW_PRECISION_FLOOR:g}"
        return Row(_row(name, err <= tol, err, tol, detail), [c], tol)

    def low_precision_row(self, dtype: torch.dtype, *, grads: bool) -> Row:
        """Flash-attention's rule: the target's error against float64 at most 2x plain's in ``dtype`` + a floor;
        unmasked and (when it takes one) causal, three draws each, the worst of each side."""
        t = self.t
        short = str(dtype).removeprefix("torch.")
        name = f"{'grads' if grads else 'low_precision'}[{short}]"
        if dtype == torch.bfloat16 and t.triton_bf16:
            return Row(_skip(name, t.triton_bf16))
        s = t.sizes(LOW) if t.layout != "varlen" else t.short()
        cases: list[dict[str, object]] = [{}] + ([{"causal": True}] if t.causal_arg else [])
        worst_target = worst_plain = 0.0
        calls = []
        for draw, knobs in itertools.product(range(3), cases):
            want = t.right(s, causal=t.expected_causal(s)) if knobs else t.right(s)
            q, k, v = t.inputs(f"{name} {draw} {knobs}", s, dtype)
            c = Call(s, q, k, v, want=want, knobs=dict(knobs))
            try:
                got = self._errors(c, grads)
            except TargetRaised as e:
                return Row(_raised(t, name, dtype, e))
            except _NoGrad as e:
                return Row(_skip(name, str(e)))
            worst_target, worst_plain = max(worst_target, got[0]), max(worst_plain, got[1])
            calls.append(c)
        tol = LOW_PRECISION_FACTOR * worst_plain + LOW_PRECISION_FLOOR
        what = "dq, dk, dv" if grads else "outputs"
        detail = (f"{what}, unmasked{' and causal' if t.causal_arg else ''}, 3 draws: the plain formula in {short} "
                  f"loses {worst_plain:.1e}; 2x that + {LOW_PRECISION_FLOOR:g}")  # fmt: skip
        return Row(_row(name, worst_target <= tol, worst_target, tol, detail, plain=worst_plain), calls, tol)

    def _errors(self, c: Call, grads: bool) -> tuple[float, float]:
        """``(the target's error, plain's error)`` against float64, of outputs or of input gradients."""
        t = self.t
        by_hand = replace(c, want=replace(c.want, by_hand=True))
        if not grads:
            c.out = t.run(c)
            return t.error(c), _plain_error(t, c)
        up = torch.randn(c.q.shape, generator=torch.Generator().manual_seed(t.seed + 5), dtype=torch.float64)
        got = _grads(t, c, up.to(c.q))
        exact = _grads(t, replace(c, q=c.q.double(), k=c.k.double(), v=c.v.double()), up, formula=True)
        plain = max(max(map(_rel, _grads(t, p, up.to(c.q), formula=True), exact)) for p in (c, by_hand))
        return max(map(_rel, got, exact)), plain

    def grad_row(self, s: Sizes) -> Row:
        t = self.t
        c = Call(s, *t.inputs("grads[float64]", s, torch.float64), want=t.right(s))
        up = torch.randn(c.q.shape, generator=torch.Generator().manual_seed(t.seed + 3), dtype=torch.float64)
        try:
            got = _grads(t, c, up)
        except TargetRaised as e:
            return Row(_raised(t, "grads[float64]", torch.float64, e))
        except _NoGrad as e:
            return Row(_skip("grads[float64]", str(e)))
        want = _grads(t, c, up, formula=True)
        errs = dict(zip(("dq", "dk", "dv"), map(_rel, got, want), strict=True))
        worst = max(errs, key=errs.__getitem__)
        return Row(_row("grads[float64]", errs[worst] <= GRAD_TOL, errs[worst], GRAD_TOL,
                        f"dq, dk, dv against the float64 formula's; worst: {worst}", **errs), [c], GRAD_TOL)  # fmt: skip


class _NoGrad(Exception):
    """The function's output carries no gradient: it defines no backward (a kernel called as it is)."""


def _grads(t: FunctionTarget, c: Call, up: Tensor, *, formula: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``sum(out * up)``: through the function, or (``formula``) through ``c.want``."""
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (c.q, c.k, c.v))
    leaf = replace(c, q=q, k=k, v=v)
    if formula:
        out = t.expected(leaf, plain=True)
    else:
        out = t.run(leaf)
        if not out.requires_grad:
            raise _NoGrad("its output carries no gradient (no grad_fn): it defines no backward, so none is checked")
    try:
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), up.to(out), allow_unused=True)
    except RuntimeError as e:
        if formula:
            raise
        raise TargetRaised(e) from e
    return tuple(torch.zeros_like(x) if d is None else d for d, x in zip((dq, dk, dv), (q, k, v), strict=True))  # type: ignore[return-value]


def _bf16_dot_error() -> float | None:
    """``max |tl.dot(a, b) - a @ b|`` of one 16x16 bfloat16 product under the Triton interpreter (None: it
    cannot run). Triton 3.9.0's interpreter on a CPU gave 2.5e10 (its float16 product is right)."""
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _dot(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
            i = tl.arange(0, N)
            a = tl.load(a_ptr + i[:, None] * N + i[None, :])
            b = tl.load(b_ptr + i[:, None] * N + i[None, :])
            tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))

        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(16, 16, generator=g).to(torch.bfloat16) for _ in range(2))
        c = torch.empty(16, 16)
        _dot[(1,)](a, b, c, N=16)
        return float((c - a.float() @ b.float()).abs().max())
    except Exception:
        return None


def _whole_pack(t: FunctionTarget, c: Call) -> Tensor:
    """Varlen ``c`` computed as if cu_seqlens were ignored: every packed query attends to every packed key
    (float64, ``(B, H, T_q, D)`` with the padding left zero)."""
    lens_q, lens_k = t.varlen_lens(c.sizes)
    q, k, v = (_pack(x.double(), n)[None].transpose(1, 2) for x, n in ((c.q, lens_q), (c.k, lens_k), (c.v, lens_k)))
    out = attend(q, k, v, replace(c.want, causal=None))[0].transpose(0, 1)  # (total_q, H, D)
    full = torch.zeros_like(c.q, dtype=torch.float64)
    for b, (a, n) in enumerate(zip(itertools.accumulate([0, *lens_q]), lens_q, strict=False)):
        full[b, :, :n] = out[a : a + n].transpose(0, 1)
    return full


# -- the diagnosis -------------------------------------------------------------------------------------------
# Mistakes only a function shows; the catalogue's entries (attnlab.check.catalogue) are used where one fits.
_OWN = {
    m.id: m
    for m in (
        Mistake("scale_seq_len", "recipe",
                "scores are scaled by {what}, a sequence length, not 1/sqrt(head_dim) = {rD:.4g}",
                "scale by 1/math.sqrt(q.size(-1)): the head dim is the last axis of q in every layout",
                S_SCALE, "every output row"),
        Mistake("online_softmax_no_rescale", "recipe",
                "the online softmax over key tiles of {what} does not rescale what it has summed when the running "
                "maximum grows: earlier tiles keep their weights exp(s - m_old)",
                "when a tile raises the maximum from m to m_new: acc = acc * exp(m - m_new) and "
                "l = l * exp(m - m_new) before adding the tile",
                S_SCALE, "rows whose keys span several tiles"),
        Mistake("tile_padding_unmasked", "recipe",
                "keys are padded with zeros to a whole number of tiles of {what} and the padding is not masked: "
                "each padded key scores 0 and takes a share of every query's weights",
                "mask the keys past T_k before the softmax: s = tl.where(offs_n[None, :] < T_k, s, float('-inf')) "
                "(zero-filled loads, other=0.0, do not mask)",
                S_MASK, "every output row whose keys end inside a tile"),
        Mistake("softmax_overflow", "behaviour",
                "softmax takes exp of the scores without subtracting their maximum: exp overflows to inf (NaN after "
                "the division) once a score passes {limit:.3g}, the exp limit of {dtype}",
                "subtract the row maximum first: p = torch.exp(s - s.amax(-1, keepdim=True)) (torch.softmax does it)",
                S_SCALE, "large_scores rows"),
        Mistake("causal_alignment", "recipe",
                "the causal mask is aligned {what}, not {want}: with T_q != T_k query i sees keys j <= i{offset}",
                "{causal_fix}",
                S_MASK, "causal"),
        Mistake("varlen_leak", "behaviour",
                "packed sequences attend across their boundaries: sequence 0's output changes when only other "
                "sequences' keys and values do",
                "mask by cu_seqlens: a query of sequence b sees keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 only",
                S_MASK, "varlen_no_leak"),
        Mistake("scale_argument_ignored", "behaviour",
                "the {what} argument is ignored: {what}={probe} gives the output of the default scale",
                "use it: scale = {what} if {what} is not None else 1 / math.sqrt(q.size(-1))",
                S_SCALE, "scale_argument"),
    )
}  # fmt: skip


def _mistake(i: str) -> Mistake:
    return _OWN[i] if i in _OWN else by_id(i)


class Diagnosis:
    """Causes for the failing rows, most rows explained first (see the module docstring)."""

    def __init__(self, t: FunctionTarget, rows: list[Row]) -> None:
        self.t, self.rows = t, rows
        self.by_name = {r.result.name: r for r in rows}
        s = t.short()
        self.dims: dict[str, object] = {
            "E": s.H * s.D, "H": s.H, "G": s.G, "D": s.D, "scale": t.scale_for(s), "rE": 1 / math.sqrt(s.H * s.D),
            "rD": 1 / math.sqrt(s.D), "declared": t.scale_for(s), "probe": PROBE_SCALE, "qkv_order": "",
            "convention": ("True = blocked" + (" (a padding mask's)" if t.given_convention is None else "")
                           if t.convention == "block" else "True = may attend (SDPA's convention)"),
            "polarity_fix": (
                f"mask with scores.masked_fill({t.mask_arg}, float('-inf')) (True = blocked); or, if True = may "
                f"attend is your convention, say so: --mask-convention keep"
                if t.convention == "block" else
                f"mask with scores.masked_fill(~{t.mask_arg}, float('-inf')) (True = may attend, as SDPA); "
                f"or, if True = blocked is your convention, say so: --mask-convention block"
            ),
            "pad_fix": "", "limit": 88.72, "dtype": "float32", "what": "", "want": "", "offset": "", "causal_fix": "",
        }  # fmt: skip

    def causes(self) -> list[Cause]:
        failing = [r for r in self.rows if r.result.status == "fail"]
        found: dict[tuple[str, str], list[str]] = {}
        evidence: dict[tuple[str, str], str] = {}
        for row in failing:
            for key, ev in self.explain(row):
                key = next((k for k in found if k[0] == key[0]), key)  # one cause per mistake: its first sizes
                found.setdefault(key, []).append(row.result.name)
                evidence.setdefault(key, ev)
        for row in failing:  # a wrong forward has a wrong backward: a grads row follows its forward row's cause
            name = row.result.name
            twin = "parity[float64]" if name == "grads[float64]" else name.replace("grads", "low_precision")
            if name.startswith("grads") and not any(name in v for v in found.values()):
                follows = next((k for k, v in found.items() if twin in v), None)
                if follows is not None:
                    found[follows].append(name)
        order = sorted(found, key=lambda k: -len(found[k]))
        causes = [self.cause(k, found[k], evidence[k]) for k in order]
        rest = [r for r in failing if not any(r.result.name in v for v in found.values())]
        if rest:
            causes.append(self.stage(rest))
        return causes

    def cause(self, key: tuple[str, str], rows: list[str], evidence: str) -> Cause:
        i, what = key
        m = _mistake(i)
        dims = {**self.dims, "what": what}
        if i == "causal_alignment":
            s = self.t.short()
            want = self.t.expected_causal(s)
            is_offset = s.T_k - s.T_q if want == 0 else 0
            dims |= {"want": _alignment(want, s), "offset": f" + {is_offset}" if is_offset else "",
                     "causal_fix": f"query i sees keys j <= i + {want} ({_alignment(want, s)}): "
                     f"torch.ones(T_q, T_k, dtype=torch.bool).tril({'T_k - T_q' if want else 0})"}  # fmt: skip
        if i == "softmax_overflow":
            dims |= {"limit": 11.09 if "float16" in evidence else 88.72,
                     "dtype": "float16" if "float16" in evidence else "float32"}  # fmt: skip
        return Cause(i, m.text("found", dims), evidence, m.text("fix", dims), m.seed, tuple(dict.fromkeys(rows)))

    def explain(self, row: Row) -> list[tuple[tuple[str, str], str]]:
        """``((mistake id, what), evidence)`` for each mistake that accounts for ``row``."""
        t, r = self.t, row.result
        name = r.name
        if r.measured == "raised":
            m = next(
                (m for m in MISTAKES if m.kind == "crash" and re.search(m.pattern, str(r.data.get("raised")))), None
            )
            return [((m.id, ""), r.detail)] if m else []
        if name == "scale_argument" and r.measured == "ignored":
            return [(("scale_argument_ignored", str(r.data["ignored"])), r.detail)]
        if name == "varlen_no_leak":
            return [(("varlen_leak", ""), f"sequence 0's output changed by {r.measured:.2e} (relative)")]
        if name.startswith("grads"):
            twin = "parity[float64]" if name == "grads[float64]" else name.replace("grads", "low_precision")
            if self.passed(twin) and self.passed("parity[float32]"):
                return [(("wrong_backward", ""), f"{name}: {r.detail}; the forward rows ({twin}) pass")]
            return []
        out = []
        got = row.calls[0].out if row.calls else None
        if name.startswith("large_scores") and got is not None and not torch.isfinite(got).all():
            c = row.calls[0]
            unshifted = t.expected(c, replace(c.want, no_max=True), plain=True)
            if not torch.isfinite(unshifted).all():
                bad = int((~torch.isfinite(got)).any(-1).sum())
                out.append((("softmax_overflow", ""), f"{name}: {bad} of {got[..., 0].numel()} output rows NaN/inf "
                            f"at {r.detail.split(';')[0].split(': ')[-1]}, finite at ordinary scores; exp of the "
                            f"unshifted scores overflows the same way"))  # fmt: skip
                return out
        for c in row.calls:
            if c.out is None:
                return out
        if self.t.layout == "varlen" and not self.passed("varlen_no_leak") and row.calls:
            errs = [_rel(c.out, _whole_pack(t, c)) for c in row.calls]  # type: ignore[arg-type]
            if max(errs) <= self.match_tol(row):
                return [(("varlen_leak", ""), f"{name}: the output equals attention over all packed tokens as one "
                         f"sequence (off by {max(errs):.1e}), cu_seqlens_k ignored")]  # fmt: skip
        ids = dict.fromkeys(i for c in row.calls for i, _, _ in _mistakes(c.want, c.sizes))
        for i in ids:
            errs, what = [], ""
            for c in row.calls:  # a call the mistake does not touch (no causal mask in it) is held to the formula
                forms = [(t.error(c, f), w) for j, w, f in _mistakes(c.want, c.sizes) if j == i] or [(t.error(c), "")]
                err, w = min(forms)
                errs.append(err)
                what = what or w
            if errs and max(errs) <= self.match_tol(row):
                out.append(((i, what), f"{name}: off by {r.measured:.2e} from the formula, {max(errs):.1e} from "
                            f"the formula with this mistake"))  # fmt: skip
                break  # the first that fits: at these sizes no two mistakes give the same output
        causal_ok = (
            self.passed("causal") or "causal" not in self.by_name or self.by_name["causal"].result.status == "skip"
        )
        if not out and name.startswith("low_precision") and self.passed("parity[float32]") and causal_ok:
            out.append(
                (("low_precision_loss", ""), f"{name}: {r.detail}; error {r.measured:.2e}, float32 parity passes")
            )
        return out

    @staticmethod
    def match_tol(row: Row) -> float:
        """How near a mistake's formula must come to ``row``'s outputs to explain it: the row's own bound, and in
        a half dtype the rounding of scores near 100 too (5e-2; a mistake moves outputs by 0.3 and more here)."""
        half = any(c.q.dtype in (torch.float16, torch.bfloat16) for c in row.calls)
        return max(row.tol, MATCH_TOL, 5e-2 if half else 0.0)

    def passed(self, name: str) -> bool:
        row = self.by_name.get(name)
        return row is not None and row.result.status == "pass"

    def stage(self, rows: list[Row]) -> Cause:
        """Rows no mistake explains: the quantity that departs, in plain words."""
        first = rows[0].result
        names = tuple(r.result.name for r in rows)
        s, long = self.t.short(), self.t.sizes(LONG)
        if set(names) <= {"parity[long keys]", "low_precision[float16]", "low_precision[bfloat16]", "grads[float16]",
                          "grads[bfloat16]", "large_scores[float32]", "large_scores[float16]"} and "parity[long keys]" in names and self.passed("parity[float32]"):  # fmt: skip
            found = (f"the output is right with T_k = {s.T_k} keys and off by {self.by_name['parity[long keys]'].result.measured:.2e} "
                     f"with T_k = {long.T_k}: the departure appears only when the keys span several tiles; look at how the "
                     f"partial results of key blocks are combined (running maximum, sum, accumulator) and at the last, partial tile")  # fmt: skip
        elif first.measured == "raised":
            found = f"the function raises on the {first.name} row's inputs: {first.data.get('raised')}"
        else:
            found = (f"{first.name}: the output departs from softmax(q k^T * scale) v by {_shown(first.measured)} "
                     f"(relative), and no catalogued mistake reproduces it")  # fmt: skip
        return Cause("stage", found, f"{first.name}: {first.detail}; off by: " + ", ".join(
                     f"{r.result.name} {_shown(r.result.measured)}" for r in rows),
                     "compare the function with the formula step by step on that row's inputs: scores, softmax, weighted sum",
                     S_WALK, names)  # fmt: skip


def _shown(x: float | str | None) -> str:
    return f"{x:.2e}" if isinstance(x, float) else str(x)


# -- entry points ----------------------------------------------------------------------------------------------
def interpret_triton(device: torch.device | str) -> None:
    """On the CPU, ``TRITON_INTERPRET=1`` when it is unset, before a target file is imported: a Triton kernel
    is then run by Triton's interpreter, as ``@triton.jit`` reads the variable when the file defines the kernel."""
    if torch.device(device).type == "cpu" and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"


def attention_function(
    spec: str,
    *,
    seed: int = 0,
    scale: float | None = None,
    mask_convention: Literal["keep", "block"] | None = None,
    causal_alignment: Literal["top-left", "bottom-right"] | None = None,
    device: torch.device | str = "cpu",
    loaded: tuple[object, str] | None = None,
) -> FunctionTarget | None:
    """The :class:`FunctionTarget` for ``--target spec`` when it names an attention function whose call form
    the experiments find; None for a class, module or factory (``build_target`` builds those).

    ``loaded``: ``load_object(spec)``'s answer, when the caller has it (the file is then not imported again).
    On the CPU, ``TRITON_INTERPRET=1`` is set before the file is imported (see :func:`interpret_triton`).
    Raises :class:`TargetError` when it looks like one and no call runs."""
    if loaded is None:
        interpret_triton(device)
    obj, attr = loaded or load_object(spec)
    if not is_attention_function(obj):
        return None
    return read_function(cast(Callable, obj), attr, spec=spec, scale=scale, mask_convention=mask_convention,
                         causal_alignment=causal_alignment, device=device, seed=seed)  # fmt: skip


def read_function(
    fn: Callable,
    name: str,
    *,
    spec: str | None = None,
    scale: float | None = None,
    mask_convention: Literal["keep", "block"] | None = None,
    causal_alignment: Literal["top-left", "bottom-right"] | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> FunctionTarget:
    """``fn`` as a :class:`FunctionTarget`, its call form found by experiment (:meth:`FunctionTarget.find_form`);
    :class:`TargetError` when no probe call runs. ``check_function(read_function(f, "f"))`` checks it."""
    t = FunctionTarget(fn, name, scale=scale, mask_convention=mask_convention, causal_alignment=causal_alignment,
                       device=device, seed=seed)  # fmt: skip
    try:
        with one_thread():
            t.find_form()
    except TargetRaised as e:
        raise TargetError(
            f"--target {spec or name!r}: {name} takes three positional arguments but no probe call ran: {e}; check calls "
            f"f(q, k, v) with q (B, H, T_q, D) or (B, T, H, D) and k, v of T_k != T_q positions (B={SHORT.B}, "
            f"H={SHORT.H}, T_q={SHORT.T_q}, T_k={SHORT.T_k}, D={SHORT.D}), then T_q = T_k = {SELF_T}."
        ) from None
    return t


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread: the probes are tiny, and two threads on a loaded 2-core machine wait on each other
    (measured: a (2, 3, 17, 40) softmax took 29 ms on 2 threads, 6 us on 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_function(t: FunctionTarget, *, strict: bool = False) -> Report:
    """Every row on the function target ``t`` (its form found), then the diagnosis of the failing ones.

    Raises :class:`CheckError` when check's own code fails (never for what the function raises: a row)."""
    with torch.random.fork_rng(devices=[]), one_thread():
        torch.manual_seed(t.seed)
        try:
            rows = Rows(t).all()
            s = t.short()
            report = Report(
                t.name,
                [r.result for r in rows],
                config={
                    "call_form": t.describe(), "embed_dim": s.H * s.D, "num_heads": s.H, "num_kv_heads": s.G,
                    "batch": s.B, "seq_len": s.T_q, "seed": t.seed, "torch": torch.__version__,
                    "device": str(t.device), "dtype": "float64, float32, float16, bfloat16",
                    "function": {"layout": t.layout, "mask": t.mask_forms, "mask_arg": t.mask_arg,
                                 "causal_arg": t.causal_arg, "causal": _alignment(t.causal_offset, s),
                                 "gqa": t.gqa, "gqa_mapping": t.gqa_found, "scale_arg": t.scale_arg,
                                 "dropout_arg": t.dropout_arg, "equal_lengths": t.equal_lengths,
                                 "work_dtype": str(t.work_dtype).removeprefix("torch.")},
                },
                strict=strict,
            )  # fmt: skip
            if report.failing:
                report.apply_diagnosis(Diagnosis(t, rows).causes())
        except TargetRaised as e:  # a call outside a row's own guard: still the function's
            raise TargetError(f"--target {t.name}: the function raised {e} where check did not expect it") from None
        except (CheckError, TargetError):
            raise
        except Exception as e:
            raise CheckError("running the function checks", e) from e
    return report
