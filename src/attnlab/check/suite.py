"""The checks: each a small function of a :class:`Context`, each returning one row.

Notation: B batch, T positions (query length; self-attention keys too), T_k cross-attention
key length, E embed_dim. Every figure is a *relative* error, ``max |got - want| / max |want|``,
unless a row says otherwise, so tolerances hold for any width of output.
"""

from __future__ import annotations

import math
import re
import sysconfig
import traceback
import weakref
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypedDict, TypeVar, cast

import torch
from torch import Tensor
from torch.autograd import gradcheck

from .adapters import AttentionAdapter, Projections, Unsupported
from .device import place, resolve_device, resolve_dtype, where
from .probe import as_adapter
from .recipe import Recipe, recipe_attention, stages_of
from .reference import plain_attention, reference_attention
from .result import CheckError, CheckResult, Report
from .variants import VARIANT_CHECKS

__all__ = ["CHECKS", "Context", "run_rows"]

# float32 against float64, tiny dims: observed errors are ~1e-7 relative; 2e-5 leaves room for
# longer rows and fused kernels yet stays far below any real bug (a wrong scale or mask is > 1e-2).
PARITY_TOL = 2e-5
# Backward sums over more terms than forward, in float32.
GRAD_TOL = 1e-4
# T at the defaults: 7 differs from every other size there (B=2, G=2, H=4, D=8, E=32), so a formula that takes one
# size for another (1/sqrt(T) for 1/sqrt(D)) cannot coincide with the right one.
SEQ_LEN = 7
# Changing tokens a query cannot see must change nothing beyond rounding noise.
INVARIANCE_TOL = 1e-6
# gradcheck in float64 (seed 002): eps 1e-6 central differences agree to ~1e-9 when right.
GRADCHECK_ATOL, GRADCHECK_RTOL = 1e-5, 1e-3
# The gradcheck rows' figure: random unit directions, each judged by gradcheck's own atol + rtol rule.
GRADCHECK_DIRECTIONS = 3
# Low precision: the module may lose at most 2x what plain PyTorch loses (flash-attention's rule),
# plus this absolute floor so that two near-zero errors do not fail on noise.
LOW_PRECISION_FACTOR, LOW_PRECISION_FLOOR = 2.0, 1e-6
# The rule compares two maximum errors, noisy over few elements (at T=8, attnlab's bf16 output
# error went past 2x plain's for 1 seed in 15 while averaging 0.9x): longer inputs than the other
# checks, and each tensor's maximum taken over both mask cases.
LOW_PRECISION_SEQ_LEN = 32
# A half dtype's budget (Context.tol) is measured at the longest input of any row too (odd_lengths' 1024)
# for that row: plain attention's rounding error grows with the number of keys it sums over.
BUDGET_LONG_LEN = 1024
# What a target may run in besides float32: float64 is held to float32's bounds (it has room to spare);
# a half dtype to flash-attention's rule (Context.tol), measured on the target's own weights.
HALF = (torch.bfloat16, torch.float16)
# Head dims of flash-attention's test_flash_attn.py that are not powers of two, and its largest.
HEAD_DIMS = (40, 59, 111, 256)
# Dropout: one Bernoulli draw per (sequence, head); the dropped fraction must lie within
# DROPOUT_Z binomial standard errors sqrt(p(1-p)/n) of p (a correct module fails with
# probability 6e-7 at 5 SE; at p=0.1 and n=4096, 5 SE = 0.023), and the kept weights must carry
# 1/(1-p) to within DROPOUT_SCALE_TOL of the rescale's own size, p/(1-p).
DROPOUT_SAMPLES, DROPOUT_Z, DROPOUT_SCALE_TOL = 4096, 5.0, 0.1


class _HeadKwargs(TypedDict):
    """The head layout the reference needs: keyword arguments of :func:`reference_attention`."""

    num_heads: int
    num_kv_heads: int
    scale: float


class _MaskKwargs(TypedDict, total=False):
    """Mask keyword arguments, valid for an adapter call and for :meth:`Context.reference` alike."""

    is_causal: bool
    key_padding_mask: Tensor
    keep_mask: Tensor


_Masks = TypeVar("_Masks", bound=Mapping[str, Any])  # mask keyword arguments, typed or not


@dataclass
class Context:
    """The target and the input sizes every check uses.

    The target runs where its weights are and in their dtype (see :mod:`attnlab.check.device`):
    every input is drawn on the CPU from the check's own generator and moved there, so a run on a GPU
    or in float64 sees the numbers a CPU float32 run sees, rounded to the dtype.
    """

    adapter: AttentionAdapter
    batch: int = 2  # B
    seq_len: int = SEQ_LEN  # T
    cross_len: int = 6  # T_k of cross-attention: unequal to T so a swapped axis cannot hide
    seed: int = 0
    # What the reference computes: None, the textbook formula; a catalogued mistake when the
    # diagnosis asks which failing rows that mistake explains (they pass against it).
    recipe: Recipe | None = None
    # odd_lengths' long sequences: 1023 (no block size divides it) and 1024 (all do). The diagnosis, asking only
    # whether a mistake's formula accounts for that row, reruns it at 63 and 64: a formula shows at any length.
    long_lens: tuple[int, int] = (1023, 1024)
    # Flash-attention's rule in a half dtype, per kind of figure (outputs, input grads): measured once.
    _budgets: dict[tuple[bool, bool], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def generator(self, name: str) -> torch.Generator:
        """Seeded per check, so that a row's inputs do not depend on which other checks ran."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    @property
    def device(self) -> torch.device:
        return self.adapter.projections().q_weight.device

    @property
    def dtype(self) -> torch.dtype:
        """What the target computes in, and the inputs are drawn in: its weights' dtype."""
        return self.adapter.projections().q_weight.dtype

    def inputs(self, g: torch.Generator, *shape: int, dtype: torch.dtype | None = None) -> Tensor:
        """``randn(*shape)`` from ``g``, on the target's device, in ``dtype`` (default: the target's)."""
        return torch.randn(*shape, generator=g).to(self.device, self.dtype if dtype is None else dtype)

    def self_input(self, name: str) -> tuple[torch.Generator, Tensor]:
        """Check ``name``'s generator and its first draw: the self-attention input ``(B, T, E)``."""
        g = self.generator(name)
        return g, self.inputs(g, self.batch, self.seq_len, self.adapter.embed_dim)

    def padding(self, B: int, T: int, n: int = 3) -> Tensor:
        """A key padding mask ``(B, T)`` on the target's device: the last ``n`` tokens of sequence 0 are padding."""
        pad = torch.zeros(B, T, dtype=torch.bool, device=self.device)
        pad[0, -n:] = True
        return pad

    def length(self, T: int) -> int:
        """``T``, or the target's maximum length where it has a shorter one (``max_len``: a causal buffer of fixed
        size, found by experiment): no row runs it past what it can take."""
        longest = getattr(self.adapter, "max_len", None)
        return T if longest is None else min(T, int(longest))

    def tol(self, base: float, *, grads: bool = False, long: bool = False) -> float:
        """The tolerance of a figure whose float32 bound is ``base`` (a relative error against the float64
        reference, or of the target against itself).

        float32 and float64: ``base``. bfloat16 and float16, where rounding alone is ~1e-2 and ~1e-3: at
        least flash-attention's rule, ``LOW_PRECISION_FACTOR`` x the worst relative error of plain PyTorch
        attention in that dtype + ``LOW_PRECISION_FLOOR``, measured once on the target's own weights
        (see :meth:`plain_error`); ``grads``: of its input gradients; ``long``: the row runs
        ``BUDGET_LONG_LEN`` tokens too, over which rounding grows.
        """
        if self.dtype not in HALF:
            return base
        if (grads, long) not in self._budgets:
            self._budgets[grads, long] = LOW_PRECISION_FACTOR * self.plain_error(grads, long) + LOW_PRECISION_FLOOR
        return max(base, self._budgets[grads, long])

    def plain_error(self, grads: bool = False, long: bool = False) -> float:
        """The worst relative error of plain attention (:func:`plain_attention`) in the target's dtype against
        the float64 reference, or of its input gradients: over the rows' own length, ``LOW_PRECISION_SEQ_LEN``
        and (``long``) ``BUDGET_LONG_LEN``, unmasked, causal and padding+bool.

        A worst case over many samples, because a row's figure is a worst case too: against one sample of
        plain's error, a correct module's maximum lands past 2x of it for some inputs (at T=8, 1 seed in 15).
        """
        a = self.adapter
        p = a.projections()
        heads: _HeadKwargs = {"num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads, "scale": a.scale}
        g = self.generator(f"budget[{'grads' if grads else 'outputs'}]")
        E = a.embed_dim
        sizes = [(self.batch, self.seq_len), (self.batch, self.length(LOW_PRECISION_SEQ_LEN))]
        sizes += [(1, self.length(BUDGET_LONG_LEN))] * long
        worst = 0.0
        for B, T in sizes:
            cases: list[_MaskKwargs] = [{}, *_low_precision_cases(self, g, T, B).values()]
            for kw in cases:
                x, up = self.inputs(g, B, T, E), self.inputs(g, B, T, E)  # (B, T, E) each, in the target's dtype
                (plain,) = _low_precision_run(partial(plain_attention, p, **heads), [x], up, kw, grads)
                (want,) = _low_precision_run(partial(reference_attention, p, **heads), [x.double()], up, kw, grads)
                worst = max(worst, _rel(plain, want))
        return worst

    def resized(
        self, name: str, *, num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None
    ) -> AttentionAdapter:
        """The target rebuilt at another head layout or head dim (weights seeded by ``name``), in eval mode.

        Raises :class:`Unsupported` with the reason when the adapter cannot build it.
        """
        a = self.adapter
        resize = getattr(a, "resized", None)
        if resize is None:
            raise Unsupported(f"{a.name} has no resized() (see attnlab.check.adapters)")
        H = a.num_heads if num_heads is None else num_heads
        G = a.num_kv_heads if num_kv_heads is None else num_kv_heads
        D = a.embed_dim // a.num_heads if head_dim is None else head_dim
        # the same rebuild for the same sizes and seed: the diagnosis reruns a row that rebuilds it
        rebuilt = _REBUILT.setdefault(a, {})
        key = (H, G, D, self.generator(name).initial_seed())
        if key not in rebuilt:
            with torch.random.fork_rng(devices=[]):  # the new weights: the same for the same seed and name
                torch.manual_seed(key[-1])
                rebuilt[key] = resize(H * D, H, G)
        built = rebuilt[key]
        built.set_training(False)
        return built

    def own_masks(self, masks: _Masks) -> _Masks:
        """``masks`` as the target applies them: an always-causal target (``always_causal``, nanoGPT's
        ``forward(x)``) masks the future on every call, so its reference does too."""
        if not getattr(self.adapter, "always_causal", False):
            return masks
        return cast(_Masks, {**masks, "is_causal": True})

    def stages(self, query: Tensor, key: Tensor, value: Tensor, **masks) -> dict[str, Tensor]:
        """Every stage of the reference (or of ``recipe``), float64: see :func:`attnlab.check.recipe.recipe_attention`."""
        return stages_of(self.adapter, query, key, value, recipe=self.recipe or Recipe(), **self.own_masks(masks))

    def reference(self, query: Tensor, key: Tensor, value: Tensor, **masks) -> Tensor:
        masks = self.own_masks(masks)
        a = self.adapter
        if self.recipe is not None:
            return stages_of(a, query, key, value, recipe=self.recipe, **masks)["out"]
        return reference_attention(
            a.projections(),
            query,
            key,
            value,
            num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads,
            scale=a.scale,
            **masks,
        )


# Each adapter's rebuilds at other sizes (Context.resized), kept while the adapter lives.
_REBUILT: weakref.WeakKeyDictionary[AttentionAdapter, dict[tuple[int, int, int, int], AttentionAdapter]] = (
    weakref.WeakKeyDictionary()
)


def _rel(got: Tensor, want: Tensor) -> float:
    """``max |got - want| / max |want|`` in float64; inf when ``got`` has a NaN or inf."""
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


# PyTorch runs other code (its inference fast path) when autograd is off: outputs are checked both ways.
MODES = ("autograd", "no_grad")


def _call(adapter: AttentionAdapter, mode: str, *args: Tensor, **kw) -> Tensor:
    with torch.set_grad_enabled(mode == "autograd"):
        return adapter(*args, **kw)


def _row(ok: bool, measured: float | str, tolerance: float | str, detail: str) -> CheckResult:
    return CheckResult("", "pass" if ok else "fail", measured, tolerance, detail)


def _skip(reason: str) -> CheckResult:
    return CheckResult("", "skip", None, None, reason)


def _worst_row(items: dict[str, tuple[float, float]], detail: str) -> CheckResult:
    """One row for many ``name: (error, tolerance)`` items: the one nearest (or furthest past) its bound."""
    worst = max(items, key=lambda n: items[n][0] / items[n][1])
    err, tol = items[worst]
    ok = all(e <= t for e, t in items.values())
    return _row(ok, err, tol, f"{detail}; worst: {worst}")


def _max_abs(got: Tensor, want: Tensor) -> float:
    """``max |got - want|`` in float64; inf when ``got`` has a NaN or inf."""
    got = got.detach().double()
    return float((got - want.detach().double()).abs().max()) if torch.isfinite(got).all() else math.inf


def _kind(num_heads: int, num_kv_heads: int) -> str:
    return "MHA" if num_kv_heads == num_heads else "MQA" if num_kv_heads == 1 else "GQA"


# -- 1. output parity in float32 -------------------------------------------------------------
def check_parity_self(ctx: Context) -> CheckResult:
    _, x = ctx.self_input("parity_self")  # (B, T, E)
    ref = ctx.reference(x, x, x)
    errs = {mode: _rel(_call(ctx.adapter, mode, x, x, x), ref) for mode in MODES}
    worst = max(errs, key=errs.__getitem__)
    tol = ctx.tol(PARITY_TOL)
    return _row(
        errs[worst] <= tol,
        errs[worst],
        tol,
        f"unmasked, autograd and no_grad; max abs err {errs[worst] * float(ref.abs().max()):.1e}",
    )


def check_parity_cross(ctx: Context) -> CheckResult:
    a = ctx.adapter
    if not getattr(a, "supports_cross_attention", True):
        return _skip("target declares supports_cross_attention=False")
    g = ctx.generator("parity_cross")
    q = ctx.inputs(g, ctx.batch, ctx.seq_len, a.embed_dim)  # (B, T, E)
    k = ctx.inputs(g, ctx.batch, ctx.cross_len, a.kdim)  # (B, T_k, kdim)
    v = ctx.inputs(g, ctx.batch, ctx.cross_len, a.vdim)  # (B, T_k, vdim)
    if a.shared_kv:
        v = k  # forward(x_query, x_context): K and V come from one context
    out, ref = a(q, k, v), ctx.reference(q, k, v)
    err, tol = _rel(out, ref), ctx.tol(PARITY_TOL)
    return _row(
        err <= tol,
        err,
        tol,
        f"T_q={ctx.seq_len}, T_k={ctx.cross_len}; max abs err {(out.double() - ref).abs().max():.1e}",
    )


_MASK_NAMES = ("causal", "padding", "bool (B,T,T)", "bool (T,T)", "all")


def _mask_cases(ctx: Context, g: torch.Generator) -> dict[str, dict]:
    """Every mask kind, no query fully masked (those have their own check)."""
    B, T = ctx.batch, ctx.seq_len
    keep = torch.rand(B, T, T, generator=g) > 0.4  # (B, T, T)
    keep[..., 0] = True  # key 0 stays visible: causal row 0 sees only it
    keep, pad = keep.to(ctx.device), ctx.padding(B, T)  # sequence 0 ends in 3 pad tokens
    return {
        "causal": {"is_causal": True},
        "padding": {"key_padding_mask": pad},
        "bool (B,T,T)": {"keep_mask": keep},
        "bool (T,T)": {"keep_mask": keep[0]},
        "all": {"keep_mask": keep, "key_padding_mask": pad, "is_causal": True},
    }


def window_masks(ctx: Context, g: torch.Generator, windows: int = 2, images: int = 2) -> tuple[Tensor, Tensor]:
    """For a target that takes one mask per window (Swin's): ``(x (nW*B, T, E), keep (nW*B, T, T))``, a distinct
    mask per window repeated over the images, windows fastest (as Swin folds them into the batch)."""
    T = ctx.seq_len
    x = ctx.inputs(g, windows * images, T, ctx.adapter.embed_dim)  # (nW * B, T, E)
    keep = torch.rand(windows, T, T, generator=g) > 0.4  # (nW, T, T)
    keep[..., 0] = True
    return x, keep.repeat(images, 1, 1).to(ctx.device)  # row i: window i % nW


def check_parity_masked(ctx: Context) -> CheckResult:
    g, x = ctx.self_input("parity_masked")  # (B, T, E)
    errs = {}
    cases = [(name, x, kw) for name, kw in _mask_cases(ctx, g).items()]
    if getattr(ctx.adapter, "window_masks", False):  # one mask per window: distinct windows, two images
        xw, keep = window_masks(ctx, g)
        cases.append(("windows (nW=2, B=2)", xw, {"keep_mask": keep}))
    for name, xx, kw in cases:
        ref = ctx.reference(xx, xx, xx, **kw)
        for mode in MODES:
            errs[f"{name}, {mode}"] = _rel(_call(ctx.adapter, mode, xx, xx, xx, **kw), ref)
    worst = max(errs, key=errs.__getitem__)
    tol = ctx.tol(PARITY_TOL)
    what = "causal, padding, bool, all" + (", per-window masks" if len(cases) > len(_MASK_NAMES) else "")
    return _row(errs[worst] <= tol, errs[worst], tol, f"{what}; worst: {worst}")


def _grad_names(a: AttentionAdapter) -> tuple[str, ...]:
    """The inputs whose gradients are compared: separate query, key and value where the target takes them."""
    if not getattr(a, "supports_cross_attention", True):
        return ("dX",)
    return ("dQ", "dKV") if getattr(a, "shared_kv", False) else ("dQ", "dK", "dV")


def _as_qkv(leaves: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(query, key, value) from 1, 2 (query, context) or 3 leaves."""
    if len(leaves) == 3:
        return leaves[0], leaves[1], leaves[2]
    if len(leaves) == 2:
        return leaves[0], leaves[1], leaves[1]
    return leaves[0], leaves[0], leaves[0]


def _input_grad_err(ctx: Context, x: Tensor, up: Tensor, kw: _MaskKwargs) -> float:
    """Self-attention input gradient of ``(f(x) * up).sum()``, the target (in its dtype) vs the float64 reference."""
    xt, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    (got,) = torch.autograd.grad((ctx.adapter(xt, xt, xt, **kw) * up).sum(), xt)
    (want,) = torch.autograd.grad((ctx.reference(x64, x64, x64, **kw) * up.double()).sum(), x64)
    return _rel(got, want)


def _head_dim_layout(H: int, G: int) -> tuple[int, int]:
    """At most 4 query heads, so that E = H * 256 stays 1024; MHA, GQA or MQA kept as it is."""
    if H <= 4:
        return H, G
    return 4, 4 if G == H else 1 if G == 1 else 2


def check_parity_head_dims(ctx: Context) -> CheckResult:
    """Outputs and input grads at head dims that are not powers of two, and at 256."""
    a = ctx.adapter
    H, G = _head_dim_layout(a.num_heads, a.num_kv_heads)
    B, T = 2, 9  # odd T: no block size divides it
    items: dict[str, tuple[float, float]] = {}
    # a rotary map turns feature pairs: a head dim must be even for it (an odd one is no mistake of the module's)
    dims_run = tuple(D for D in HEAD_DIMS if D % 2 == 0) if a.projections().rotary is not None else HEAD_DIMS
    for D in dims_run:
        try:
            target = ctx.resized(f"parity_head_dims[{D}]", num_heads=H, num_kv_heads=G, head_dim=D)
        except Unsupported as e:
            return _skip(f"needs the target rebuilt at head dims {HEAD_DIMS}: {e}")
        sub = replace(ctx, adapter=target)
        g = ctx.generator(f"parity_head_dims[{D}]")
        x = sub.inputs(g, B, T, H * D)  # (B, T, E)
        up = sub.inputs(g, B, T, H * D)  # (B, T, E): upstream gradient
        pad = sub.padding(B, T)
        masked: _MaskKwargs = {"is_causal": True, "key_padding_mask": pad}
        tol = sub.tol(PARITY_TOL)  # a half dtype's rule, measured on this rebuild's own weights
        for mode in MODES:
            items[f"D={D}, unmasked, {mode}"] = (_rel(_call(target, mode, x, x, x), sub.reference(x, x, x)), tol)
        items[f"D={D}, causal+padding"] = (_rel(target(x, x, x, **masked), sub.reference(x, x, x, **masked)), tol)
        items[f"D={D}, causal+padding, input grad"] = (
            _input_grad_err(sub, x, up, masked),
            sub.tol(GRAD_TOL, grads=True),
        )
    dims = ", ".join(map(str, dims_run)) + (" (even only: rotary)" if dims_run != HEAD_DIMS else "")
    bounds = (
        f"outputs <= {PARITY_TOL:g}, grads <= {GRAD_TOL:g}"
        if ctx.dtype not in HALF
        else "2x plain PyTorch's error in the same dtype"
    )
    return _worst_row(items, f"target rebuilt with H={H}, G={G} at D={dims}; {bounds}")


def check_odd_lengths(ctx: Context) -> CheckResult:
    """T = 1, T = 1023 and 1024, and cross-attention with T_q = 1, T_k = 1 and T_q > T_k."""
    a = ctx.adapter
    g = ctx.generator("odd_lengths")
    cross = getattr(a, "supports_cross_attention", True)
    cases: list[tuple[str, int, int | None, _MaskKwargs]] = []  # (name, T_q, T_k or None: self-attention, masks)
    longs = tuple(dict.fromkeys(ctx.length(T) for T in ctx.long_lens))  # within the target's maximum length
    for T in (1, *longs):  # 1023: a length no block size divides, next to one they all do
        cases += [(f"T={T}", T, None, {}), (f"T={T} causal", T, None, {"is_causal": True})]
    if cross:
        pad = ctx.padding(ctx.batch, 5, 2)
        T_q = ctx.length(13)
        cases += [("T_q=1, T_k=7", 1, 7, {}), ("T_q=7, T_k=1", 7, 1, {}), (f"T_q={T_q}, T_k=5", T_q, 5, {})]
        cases += [(f"T_q={T_q}, T_k=5, padding", T_q, 5, {"key_padding_mask": pad})]
    errs: dict[str, tuple[float, float]] = {}
    for name, T_q, T_k, kw in cases:
        B = 1 if T_q > 64 else ctx.batch  # a long sequence: one, at the target's own width
        q = ctx.inputs(g, B, T_q, a.embed_dim)  # (B, T_q, E)
        kv = q if T_k is None else ctx.inputs(g, B, T_k, a.embed_dim)  # (B, T_k, E)
        ref = ctx.reference(q, kv, kv, **kw)
        for mode in MODES:
            errs[f"{name}, {mode}"] = (_rel(_call(a, mode, q, kv, kv, **kw), ref), ctx.tol(PARITY_TOL, long=True))
    detail = f"T=1, {', '.join(map(str, longs))} (plain, causal); " + (
        f"cross T_q/T_k = 1/7, 7/1, {ctx.length(13)}/5 (plain, padding)"
        if cross
        else "cross-attention not run (unsupported)"
    )
    if longs != tuple(ctx.long_lens):
        detail += f"; at most {longs[-1]} tokens, the target's maximum length"
    return _worst_row(errs, detail)


# -- 2. low precision ----------------------------------------------------------------------------
def _low_precision_targets(ctx: Context, dtype: torch.dtype, check: str) -> tuple[dict[str, AttentionAdapter], str]:
    """The target in ``dtype`` at its own head layout, plus MHA/GQA/MQA rebuilds where it can be resized.

    Raises :class:`Unsupported` when the target cannot be cast; a layout it cannot be rebuilt
    at is named in the returned note instead.
    """
    a = ctx.adapter
    H = a.num_heads
    own = a.cast(dtype)
    own.set_training(False)
    targets = {f"{_kind(H, a.num_kv_heads)} G={a.num_kv_heads}": own}
    others = {H, 1} | ({H // 2} if H % 2 == 0 and H >= 4 else set())  # MHA, MQA, GQA with 2 queries per K/V head
    not_run: dict[str, list[str]] = {}  # reason -> layouts
    for G in sorted(others - {a.num_kv_heads}, reverse=True):
        try:
            targets[f"{_kind(H, G)} G={G}"] = ctx.resized(f"{check}[G={G}]", num_kv_heads=G).cast(dtype)
        except Unsupported as e:
            not_run.setdefault(str(e), []).append(_kind(H, G))
    return targets, "; ".join(f"{', '.join(kinds)} not run ({reason})" for reason, kinds in not_run.items())


def _low_precision_cases(ctx: Context, g: torch.Generator, T: int, B: int | None = None) -> dict[str, _MaskKwargs]:
    """Causal, and padding with a bool mask, at B (default the context's) x T; no query fully masked (plain
    attention gives NaN there)."""
    B = ctx.batch if B is None else B
    keep = torch.rand(B, T, T, generator=g) > 0.4  # (B, T, T)
    keep[..., 0] = True
    return {
        "causal": {"is_causal": True},
        "padding+bool": ctx.own_masks(_MaskKwargs(key_padding_mask=ctx.padding(B, T), keep_mask=keep.to(ctx.device))),
    }


def check_low_precision(ctx: Context, dtype: torch.dtype, grads: bool = False) -> CheckResult:
    """Outputs (or, with ``grads``, input gradients) in ``dtype``: error vs float64 <= 2x plain PyTorch's."""
    a = ctx.adapter
    check = f"low_precision{'_grad' if grads else ''}[{dtype}]"
    try:
        targets, note = _low_precision_targets(ctx, dtype, check)
    except Unsupported as e:
        return _skip(str(e))
    g = ctx.generator(check)
    B, T, E = ctx.batch, ctx.length(LOW_PRECISION_SEQ_LEN), a.embed_dim
    names = _grad_names(a)
    errs: dict[str, float] = {}  # per layout and tensor, the max over the mask cases (one larger sample)
    plain_errs: dict[str, float] = {}
    residual_slack = 0.0  # a module that returns query + attention: the rounding of that sum, taken off again
    for layout, low in targets.items():
        p = low.projections()
        heads: _HeadKwargs = {"num_heads": low.num_heads, "num_kv_heads": low.num_kv_heads, "scale": low.scale}
        for kw in _low_precision_cases(ctx, g, T).values():
            xs = [ctx.inputs(g, B, T, E, dtype=dtype) for _ in names]  # (B, T, E) each, already rounded
            up = ctx.inputs(g, B, T, E, dtype=dtype)  # (B, T, E): upstream gradient
            try:
                got = _low_precision_run(low, xs, up, kw, grads)
            except (RuntimeError, NotImplementedError) as e:
                if "not implemented" not in str(e).lower():
                    raise  # a real error: the runner reports it as a failed row
                return _skip(f"this device has no {dtype} kernel for the target: {str(e).splitlines()[0]}")
            # The reference sees the low-precision weights and inputs: only arithmetic error is measured.
            ref_fn = (
                partial(reference_attention, p, **heads)
                if ctx.recipe is None
                else partial(_recipe_out, p, recipe=ctx.recipe, **heads)
            )
            want = _low_precision_run(ref_fn, [x.double() for x in xs], up, kw, grads)
            plain = _low_precision_run(partial(plain_attention, p, **heads), xs, up, kw, grads)
            if getattr(low, "adds_query", False):  # it rounds query + attention (or their gradients' sum) once more
                added = 2 * torch.finfo(dtype).eps * max(float(t.abs().max()) for t in (*xs, up))
                residual_slack = max(residual_slack, added)
            for name, got_t, want_t, plain_t in zip(names if grads else ("out",), got, want, plain, strict=True):
                key = f"{layout}, {name}"
                errs[key] = max(errs.get(key, 0.0), _max_abs(got_t, want_t))
                plain_errs[key] = max(plain_errs.get(key, 0.0), _max_abs(plain_t, want_t))
    items = {k: (errs[k], LOW_PRECISION_FACTOR * plain_errs[k] + LOW_PRECISION_FLOOR + residual_slack) for k in errs}
    worst = max(items, key=lambda n: items[n][0] / items[n][1])
    what = f"input grads {', '.join(names)}" if grads else "outputs"
    detail = (
        f"max abs err of {what} ({', '.join(targets)}; causal, padding+bool); tolerance 2x plain PyTorch's + "
        f"{LOW_PRECISION_FLOOR:g}; plain PyTorch at the worst: {plain_errs[worst]:.2e}"
    )
    return _worst_row(items, detail + (f"; {note}" if note else ""))


def _recipe_out(p: Projections, *tensors: Tensor, **kw) -> Tensor:
    return recipe_attention(p, *tensors, **kw)["out"]


def _low_precision_run(
    fn: Callable[..., Tensor], xs: list[Tensor], up: Tensor, kw: _MaskKwargs, grads: bool
) -> tuple[Tensor, ...]:
    """``fn(query, key, value, **kw)`` on ``xs`` (one tensor: self-attention), as ``(output,)`` or,
    with ``grads``, the gradients of ``(output * up).sum()`` with respect to each of ``xs``."""
    leaves = [x.detach().requires_grad_(grads) for x in xs]
    q, k, v = _as_qkv(leaves)
    with torch.set_grad_enabled(grads):
        out = fn(q, k, v, **kw)  # (B, T, E)
    if not grads:
        return (out.detach(),)
    return torch.autograd.grad(out, leaves, up.to(out.dtype))


# -- 3. gradients --------------------------------------------------------------------------------
def check_gradcheck(ctx: Context, case: str) -> CheckResult:
    a = ctx.adapter
    if not getattr(a, "supports_float64", True):
        return _skip("target declares supports_float64=False; see grad_parity")
    try:
        a64 = a.cast(torch.float64)
    except Unsupported as e:
        return _skip(f"{e}; see grad_parity")
    a64.set_training(False)
    g = ctx.generator(f"gradcheck[{case}]")
    T = 4  # gradcheck costs one forward per input element: keep it small
    x = ctx.inputs(g, 1, T, a.embed_dim, dtype=torch.float64).requires_grad_()  # (1, T, E)
    kw: dict = {}
    if case == "causal":
        kw["is_causal"] = True
    if case == "padding":
        kw["key_padding_mask"] = torch.tensor([[False] * (T - 1) + [True]], device=ctx.device)  # (1, T)

    def fn(t: Tensor) -> Tensor:
        return a64(t, t, t, **kw)

    # Masks make the function piecewise with large local gradients: seed 002 runs fast_mode there.
    fast = case != "plain"
    ok = gradcheck(fn, (x,), eps=1e-6, atol=GRADCHECK_ATOL, rtol=GRADCHECK_RTOL, fast_mode=fast, raise_exception=False)
    # The figure shown, by gradcheck's own rule: along unit directions u (input) and w (output), the gap
    # |analytical - numerical| over what gradcheck allows there, atol + rtol |numerical|; <= 1 passes.
    ratio = 0.0
    for _ in range(GRADCHECK_DIRECTIONS):
        u, w = torch.randn(x.shape, generator=g, dtype=x.dtype), torch.randn(x.shape, generator=g, dtype=x.dtype)
        u, w = (u / u.norm()).to(ctx.device), (w / w.norm()).to(ctx.device)
        (grad,) = torch.autograd.grad((fn(x) * w).sum(), x)
        with torch.no_grad():
            numeric = float(((fn(x + 1e-6 * u) - fn(x - 1e-6 * u)) * w).sum() / 2e-6)
        gap = abs(float((grad * u).sum()) - numeric)
        ratio = max(ratio, gap / (GRADCHECK_ATOL + GRADCHECK_RTOL * abs(numeric)))
    mode = "fast_mode" if fast else "full Jacobian"
    detail = (
        f"gradcheck float64, {mode}: {'passed' if ok else 'FAILED'}; figure: the worst of "
        f"{GRADCHECK_DIRECTIONS} directional gaps over its allowance atol + rtol |numerical| "
        f"({GRADCHECK_ATOL:g} + {GRADCHECK_RTOL:g} |numerical|)"
    )
    if not ok and ratio <= 1.0:  # gradcheck found an element no direction here shows: its verdict, in words
        return _row(False, "gradcheck failed", "gradcheck passes", f"{detail}: {ratio:.2e}")
    return _row(ok and ratio <= 1.0, ratio, 1.0, detail)


def check_grad_parity(ctx: Context) -> CheckResult:
    a = ctx.adapter
    g, x = ctx.self_input("grad_parity")  # (B, T, E)
    B, T, E = ctx.batch, ctx.seq_len, a.embed_dim
    up = ctx.inputs(g, B, T, E)  # (B, T, E): upstream gradient
    pad = ctx.padding(B, T, 2)
    errs = {}
    cases: dict[str, _MaskKwargs] = {"unmasked": {}, "causal+padding": {"is_causal": True, "key_padding_mask": pad}}
    for name, kw in cases.items():
        errs[name] = _input_grad_err(ctx, x, up, kw)
    worst = max(errs, key=errs.__getitem__)
    tol = ctx.tol(GRAD_TOL, grads=True)
    where = str(ctx.dtype).removeprefix("torch.")
    return _row(errs[worst] <= tol, errs[worst], tol, f"{where} input grads vs float64; worst: {worst}")


# -- 4. properties -------------------------------------------------------------------------------
def check_no_causal_leak(ctx: Context) -> CheckResult:
    g, x = ctx.self_input("no_causal_leak")  # (B, T, E)
    B, T, E = ctx.batch, ctx.seq_len, ctx.adapter.embed_dim
    half = T // 2
    future = x.clone()
    future[:, half:] += 3.0 * ctx.inputs(g, B, T - half, E)  # only positions >= half change
    before, after = ctx.adapter(x, x, x, is_causal=True), ctx.adapter(future, future, future, is_causal=True)
    err, tol = _rel(after[:, :half], before[:, :half]), ctx.tol(INVARIANCE_TOL)
    return _row(err <= tol, err, tol, f"outputs < {half} after changing tokens >= {half}")


def check_padding_invariance(ctx: Context) -> CheckResult:
    g, x = ctx.self_input("padding_invariance")  # (B, T, E)
    B, T, E = ctx.batch, ctx.seq_len, ctx.adapter.embed_dim
    n_pad = 3
    pad = ctx.padding(B, T, n_pad)
    changed = x.clone()
    changed[0, -n_pad:] += 3.0 * ctx.inputs(g, n_pad, E)  # rewrite the pad tokens of sequence 0
    before = ctx.adapter(x, x, x, key_padding_mask=pad)
    after = ctx.adapter(changed, changed, changed, key_padding_mask=pad)
    real = ~pad  # the pad tokens' own outputs may change; nothing else may
    err, tol = _rel(after[real], before[real]), ctx.tol(INVARIANCE_TOL)
    return _row(err <= tol, err, tol, f"non-pad outputs after rewriting {n_pad} pad tokens")


def check_padded_kv_nonfinite(ctx: Context) -> CheckResult:
    """NaN or inf in the padded key/value rows must not reach any output of a real query."""
    a = ctx.adapter
    g, x = ctx.self_input("padded_kv_nonfinite")  # (B, T, E)
    B, T, E = ctx.batch, ctx.seq_len, a.embed_dim
    q = ctx.inputs(g, B, ctx.cross_len, E)  # (B, T_q, E): clean queries for cross-attention
    pad = ctx.padding(B, T)
    pad[-1, -1] = True
    items: dict[str, tuple[float, float]] = {}
    findings = []
    for poison in ("nan", "inf"):
        dirty = x.masked_fill(pad[..., None], float(poison))  # (B, T, E): the pad rows poisoned
        # (name, clean inputs, poisoned inputs, outputs compared): self-attention's pad queries may be anything
        cases = [("self", (x, x, x), (dirty, dirty, dirty), ~pad)]
        if getattr(a, "supports_cross_attention", True):
            cases.append(("cross", (q, x, x), (q, dirty, dirty), torch.ones_like(q[..., 0], dtype=torch.bool)))
        for case, clean, poisoned, rows in cases:
            worst, bad = 0.0, 0
            for mode in MODES:
                before = _call(a, mode, *clean, key_padding_mask=pad)[rows]  # (N, E) outputs of real queries
                after = _call(a, mode, *poisoned, key_padding_mask=pad)[rows]
                bad += int((~torch.isfinite(after)).sum())
                worst = max(worst, _rel(after, before))
            items[f"{poison}, {case}"] = (worst, ctx.tol(INVARIANCE_TOL))
            findings.append(f"{poison} {case}: " + (f"{bad} NaN/inf outputs" if bad else f"finite, err {worst:.1e}"))
    detail = (
        f"pad rows of the K/V inputs set to NaN, inf; real queries' outputs vs clean pad rows ({'; '.join(findings)})"
    )
    return _worst_row(items, detail)


def check_permutation_equivariance(ctx: Context) -> CheckResult:
    if getattr(ctx.adapter, "always_causal", False):
        return _skip("the target is always causal: position order matters to it by design")
    if ctx.adapter.projections().rotary is not None:
        return _skip("the target turns Q and K by position (rotary): position order matters to it by design")
    if getattr(ctx.adapter.projections().score_map, "positional", False):
        return _skip("the target biases its scores by position: position order matters to it by design")
    g, x = ctx.self_input("permutation_equivariance")  # (B, T, E)
    perm = torch.randperm(ctx.seq_len, generator=g).to(ctx.device)
    xp = x[:, perm]  # (B, T, E), positions shuffled
    err, tol = _rel(ctx.adapter(xp, xp, xp), ctx.adapter(x, x, x)[:, perm]), ctx.tol(PARITY_TOL)
    return _row(err <= tol, err, tol, "f(x[:, perm]) vs f(x)[:, perm], unmasked")


def check_fully_masked_rows(ctx: Context) -> CheckResult:
    a = ctx.adapter
    _, x = ctx.self_input("fully_masked_rows")  # (B, T, E)
    T = ctx.seq_len
    keep = torch.ones(T, T, dtype=torch.bool, device=ctx.device)
    keep[2] = False  # query 2 may see no key: its context must be zeros, its output the out bias
    ref = ctx.reference(x, x, x, keep_mask=keep)
    findings, worst = [], 0.0
    for mode in MODES:
        xi = x.clone().requires_grad_(mode == "autograd")
        with torch.set_grad_enabled(mode == "autograd"):
            out = a(xi, xi, xi, keep_mask=keep)
        bad_out = int((~torch.isfinite(out)).sum())
        bad_grad = 0
        if mode == "autograd" and not bad_out:
            (grad,) = torch.autograd.grad(out.sum(), xi)
            bad_grad = int((~torch.isfinite(grad)).sum())
        err = math.inf if bad_grad else _rel(out, ref)
        worst = max(worst, err)
        if bad_out:
            findings.append(f"{mode}: {bad_out} NaN/inf outputs")
        elif bad_grad:
            findings.append(f"{mode}: {bad_grad} NaN/inf input grads")
        else:
            findings.append(f"{mode}: finite, err {err:.1e}")
    tol = ctx.tol(PARITY_TOL)
    return _row(worst <= tol, worst, tol, "; ".join(findings))


# -- 5. mask semantics -------------------------------------------------------------------------
def check_mask_semantics(ctx: Context) -> CheckResult:
    a = ctx.adapter
    g, x = ctx.self_input("mask_semantics")  # (B, T, E)
    T = ctx.seq_len
    mask = torch.rand(T, T, generator=g) > 0.5  # (T, T)
    rows = torch.arange(T)
    mask[rows, rows] = True
    mask[rows, (rows + 1) % T] = False  # every row holds a True and a False: both readings are valid
    # an always-causal target sees no later key: each row's False is then the key before it, and the first row,
    # which sees itself only, is left out (one of the readings masks it fully, which no convention settles)
    causal = bool(getattr(a, "always_causal", False))
    if causal:
        mask[rows[1:], rows[1:] - 1] = False
    mask = mask.to(ctx.device)
    try:
        out = a.raw_bool_mask(x, mask)
    except Unsupported as e:
        return _skip(str(e))
    seen = slice(1, None) if causal else slice(None)
    err_keep = _rel(out[:, seen], ctx.reference(x, x, x, keep_mask=mask)[:, seen])
    err_block = _rel(out[:, seen], ctx.reference(x, x, x, keep_mask=~mask)[:, seen])
    tol = ctx.tol(PARITY_TOL)
    found = "True = may attend" if err_keep <= tol else "True = blocked" if err_block <= tol else "neither"
    meaning: dict[str | None, str] = {"keep": "True = may attend", "block": "True = blocked"}
    declared = meaning.get(getattr(a, "bool_mask_convention", None))
    ok = found != "neither" and declared in (None, found)
    return _row(
        ok,
        found,
        declared or "keep or block",
        f"err if keep {err_keep:.1e}, if block {err_block:.1e}" + ("" if declared else "; convention not declared"),
    )


def check_attention_weights(ctx: Context) -> CheckResult:
    """The weights a target returns (``need_weights``): per head, or averaged over heads as torch's default."""
    a = ctx.adapter
    _, x = ctx.self_input("attention_weights")  # (B, T, E)
    B, T = ctx.batch, ctx.seq_len
    pad = ctx.padding(B, T)
    cases: dict[str, _MaskKwargs] = {
        "unmasked": {},
        "causal": {"is_causal": True},
        "padding": {"key_padding_mask": pad},
    }
    items: dict[str, tuple[float, float]] = {}
    shape = ""
    weights = getattr(a, "attention_weights", None)
    if weights is None:
        return _skip(f"{type(a).__name__} does not return attention weights")
    for name, kw in cases.items():
        try:
            got = weights(x, x, x, **kw)
        except Unsupported as e:
            return _skip(str(e))
        if name == "unmasked" and not torch.allclose(got.double().sum(-1), torch.ones((), dtype=torch.float64)):
            # rows that do not sum to 1 are no attention weights (Whisper returns its raw scores Q K^T there)
            return _skip("the second output is not attention weights (its rows do not sum to 1 over the keys)")
        heads = ctx.stages(x, x, x, **kw)["weights"]  # (B, H, T, T)
        want = heads
        shape = "(B, H, T_q, T_k)"
        if got.dim() == 3:  # averaged over heads, as nn.MultiheadAttention returns by default ...
            want, shape = heads.mean(dim=1), "(B, T_q, T_k), averaged over heads"
            if got.shape == want.shape and _rel(got, want) > ctx.tol(PARITY_TOL):
                # ... or one head's own, as OpenNMT returns the first head's ("top_attn")
                errs = [_rel(got, heads[:, h]) for h in range(heads.size(1))]
                h = min(range(len(errs)), key=errs.__getitem__)
                if errs[h] <= ctx.tol(PARITY_TOL):
                    want, shape = heads[:, h], f"(B, T_q, T_k), head {h}'s own"
        if got.dim() == 4 and got.shape != want.shape and got.transpose(1, 2).shape == want.shape:
            got, shape = got.transpose(1, 2), "(B, T_q, H, T_k)"  # GPTBigCode's multi-query layout, heads inside
        if got.shape != want.shape:
            return _row(
                False, "shape", str(list(want.shape)), f"{name}: weights {list(got.shape)}, want {list(want.shape)}"
            )
        items[name] = (_rel(got, want), ctx.tol(PARITY_TOL))
    return _worst_row(items, f"returned weights {shape} vs softmax(Q K^T * scale) of the reference")


def check_scale_attribute(ctx: Context) -> CheckResult:
    """A ``scale`` the module states must be the expected one: the module is not its own reference."""
    a = ctx.adapter
    declared = getattr(a, "declared_scale", None)
    if declared is None:
        return _skip("the target states no scale attribute; its scale is measured through its outputs")
    want = a.scale
    D = a.embed_dim // a.num_heads
    ok = math.isclose(declared, want, rel_tol=1e-6)
    names = {
        1.0 / math.sqrt(D): "1/sqrt(head_dim)",
        1.0 / math.sqrt(a.embed_dim): "1/sqrt(embed_dim)",
        1.0 / D: "1/head_dim",
    }
    said = next((n for v, n in names.items() if math.isclose(declared, v, rel_tol=1e-6)), f"{declared:.4g}")
    return _row(
        ok,
        declared,
        want,
        f"the module's scale attribute is {said} = {declared:.4g}; expected {want:.4g}"
        + ("" if ok else " (1/sqrt(head_dim) unless you pass --scale)"),
    )


# -- 6. KV cache ---------------------------------------------------------------------------------
def check_kv_cache(ctx: Context) -> CheckResult:
    _, x = ctx.self_input("kv_cache")  # (B, T, E)
    T = ctx.seq_len
    chunks = [T - 3, 1, 1, 1]  # a prefill, then token-by-token decode
    try:
        out = ctx.adapter.decode_with_cache(x, chunks)
    except Unsupported as e:
        return _skip(str(e))
    err, tol = _rel(out, ctx.reference(x, x, x, is_causal=True)), ctx.tol(PARITY_TOL)
    return _row(err <= tol, err, tol, f"chunks {chunks} vs full causal reference")


# -- 7. eval mode --------------------------------------------------------------------------------
def check_determinism(ctx: Context) -> CheckResult:
    _, x = ctx.self_input("determinism")  # (B, T, E)
    first, second = ctx.adapter(x, x, x).detach(), ctx.adapter(x, x, x).detach()
    if not bool(torch.isfinite(first).all()):  # NaN != NaN: two calls agree when they agree bit for bit
        same = _bitwise_equal(first, second)
        n = int((~torch.isfinite(first)).sum())
        return _row(same, 0.0 if same else math.inf, 0.0, f"two eval calls, bit for bit ({n} NaN/inf outputs)")
    diff = float((first - second).abs().max())
    return _row(diff == 0.0, diff, 0.0, "max abs diff of two eval calls")


def _bitwise_equal(x: Tensor | None, y: Tensor | None) -> bool:
    if x is None or y is None:
        return x is y
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.shape == y.shape and torch.equal(x.view(ints), y.view(ints))  # NaN payloads compared too


def check_deterministic_backward(ctx: Context) -> CheckResult:
    """Eval mode, two backward passes on identical inputs: bitwise identical input and weight grads."""
    a = ctx.adapter
    g = ctx.generator("deterministic_backward")
    B, T, E = ctx.batch, ctx.length(64), a.embed_dim  # long enough for a kernel to split the keys into blocks
    names = _grad_names(a)
    xs = [ctx.inputs(g, B, T, E) for _ in names]  # (B, T, E) each
    up = ctx.inputs(g, B, T, E)  # (B, T, E): upstream gradient
    params = [p for p in getattr(a, "parameters", list)() if p.requires_grad]
    a.set_training(False)
    pad = ctx.padding(B, T, 5)
    cases: dict[str, _MaskKwargs] = {"unmasked": {}, "causal+padding": {"is_causal": True, "key_padding_mask": pad}}

    def grads(kw: _MaskKwargs) -> tuple[Tensor | None, ...]:
        leaves = [x.clone().requires_grad_() for x in xs]
        q, k, v = _as_qkv(leaves)
        out = a(q, k, v, **kw)  # (B, T, E)
        return torch.autograd.grad(out, leaves + params, up, allow_unused=True)

    differ, diff = [], 0.0
    for case, kw in cases.items():
        first, second = grads(kw), grads(kw)
        labels = [*names, *(f"weight {i}" for i in range(len(params)))]
        for label, f, s in zip(labels, first, second, strict=True):
            if not _bitwise_equal(f, s):
                differ.append(f"{case} {label}")
                diff = max(
                    diff, math.inf if f is None or s is None else float((f - s).abs().max().nan_to_num(math.inf))
                )
    n = len(cases) * (len(names) + len(params))
    detail = f"{len(differ)} of {n} grads differ" + (f": {', '.join(differ[:4])}" if differ else "")
    return _row(
        not differ, diff, 0.0, f"eval, two backward passes ({', '.join(names)} and {len(params)} weights); {detail}"
    )


def check_dropout_off_in_eval(ctx: Context) -> CheckResult:
    a = ctx.adapter
    p = float(getattr(a, "dropout_p", 0.0))
    if p == 0.0:
        return _skip("target has dropout 0; build it with dropout > 0 to check that eval turns it off")
    _, x = ctx.self_input("dropout_off_in_eval")  # (B, T, E)
    a.set_training(True)
    try:
        train_gap = float((a(x, x, x) - a(x, x, x)).detach().abs().max())
    finally:
        a.set_training(False)
    err, tol = _rel(a(x, x, x), ctx.reference(x, x, x)), ctx.tol(PARITY_TOL)
    active = "active" if train_gap > 0 else "INACTIVE even"
    return _row(
        err <= tol,
        err,
        tol,
        f"p={p:g} {active} in train (calls differ by {train_gap:.1e}); eval vs reference",
    )


def _head_contexts(p: Projections, out: Tensor, num_heads: int) -> Tensor:
    """Undo the out-projection: per-head contexts ``(N, H, D)`` from outputs ``(N, 1, E)``, in float64."""
    W = p.out_weight.detach().double()  # (E, H*D)
    y = out.detach().double().reshape(-1, W.size(0))  # (N, E)
    if p.out_bias is not None:
        y = y - p.out_bias.detach().double()
    merged = torch.linalg.lstsq(W, y.T).solution.T  # (N, H*D): the least-squares solution of W m = y
    return merged.reshape(merged.size(0), num_heads, -1)  # (N, H, D)


def check_dropout_rate(ctx: Context) -> CheckResult:
    """Training mode: the attention weights are dropped at rate p and the kept ones scaled by 1/(1-p).

    Sequences of one token make every attention weight 1 before dropout, so each head's context
    is either 0 (dropped) or 1/(1-p) times its value vector. The contexts are read back from the
    outputs by inverting the out-projection, so the weights need not be observable.
    """
    a = ctx.adapter
    p = float(getattr(a, "dropout_p", 0.0))
    if not 0.0 < p < 1.0:
        return _skip(f"target has dropout {p:g}; build it with 0 < dropout < 1 to check the rate")
    proj = a.projections()
    E, HD = proj.out_weight.shape
    cond = float(torch.linalg.cond(proj.out_weight.detach().double())) if HD <= E else math.inf
    if cond > 1e6:
        return _skip(f"out_proj ({E}x{HD}, condition number {cond:.1e}) cannot be inverted to read the heads back")
    g = ctx.generator("dropout_rate")
    H = a.num_heads
    x = ctx.inputs(g, -(-DROPOUT_SAMPLES // H), 1, E)  # (N, 1, E): N * H >= DROPOUT_SAMPLES draws
    want = _head_contexts(proj, ctx.reference(x, x, x), H)  # (N, H, D): undropped, weight 1
    a.set_training(True)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(g.initial_seed())
            out = a(x, x, x)  # (N, 1, E)
            if not bool(torch.isfinite(out).all()):  # nothing to read the heads back from
                n_bad = int((~torch.isfinite(out)).sum())
                return _row(False, math.inf, f"{p:g}", f"training mode: {n_bad} NaN/inf outputs; no rate to read")
            got = _head_contexts(proj, out, H)  # (N, H, D)
    finally:
        a.set_training(False)
    ratio = (got * want).sum(-1) / (want * want).sum(-1)  # (N, H): 0 if dropped, 1/(1-p) if kept
    scale = 1.0 / (1.0 - p)
    dropped = ratio.abs() < scale / 2
    n, frac = ratio.numel(), float(dropped.double().mean())
    band = DROPOUT_Z * math.sqrt(p * (1.0 - p) / n)
    kept = float(ratio[~dropped].mean()) if bool((~dropped).any()) else math.nan
    scale_tol = DROPOUT_SCALE_TOL * (scale - 1.0)
    ok = abs(frac - p) <= band and abs(kept - scale) <= scale_tol
    row = _row(
        ok,
        frac,
        f"{p:g} ± {band:.3f}",
        f"dropped fraction of {n} (sequence, head) weights, band {DROPOUT_Z:g} binomial SE; kept weights "
        f"x{kept:.4f}, want 1/(1-p) = {scale:.4f} ± {scale_tol:.4f}",
    )
    return replace(
        row, data={"p": p, "dropped": frac, "kept_scale": round(kept, 6) if math.isfinite(kept) else 0.0, "draws": n}
    )


CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "parity_self": check_parity_self,
    "parity_cross": check_parity_cross,
    "parity_masked": check_parity_masked,
    "parity_head_dims": check_parity_head_dims,
    "odd_lengths": check_odd_lengths,
    "low_precision[bf16]": partial(check_low_precision, dtype=torch.bfloat16),
    "low_precision[fp16]": partial(check_low_precision, dtype=torch.float16),
    "low_precision_grad[bf16]": partial(check_low_precision, dtype=torch.bfloat16, grads=True),
    "low_precision_grad[fp16]": partial(check_low_precision, dtype=torch.float16, grads=True),
    "gradcheck[plain]": partial(check_gradcheck, case="plain"),
    "gradcheck[causal]": partial(check_gradcheck, case="causal"),
    "gradcheck[padding]": partial(check_gradcheck, case="padding"),
    "grad_parity": check_grad_parity,
    "no_causal_leak": check_no_causal_leak,
    "padding_invariance": check_padding_invariance,
    "padded_kv_nonfinite": check_padded_kv_nonfinite,
    "permutation_equivariance": check_permutation_equivariance,
    "fully_masked_rows": check_fully_masked_rows,
    "mask_semantics": check_mask_semantics,
    "attention_weights": check_attention_weights,
    "scale_attribute": check_scale_attribute,
    "kv_cache": check_kv_cache,
    "determinism": check_determinism,
    "deterministic_backward": check_deterministic_backward,
    "dropout_off_in_eval": check_dropout_off_in_eval,
    "dropout_rate": check_dropout_rate,
    **VARIANT_CHECKS,
}

# The only checks that do not feed one tensor as query, key and value.
CROSS_ATTENTION_CHECKS = frozenset({"parity_cross"})


def placed(target: object, device: str | torch.device | None, dtype: str | torch.dtype | None) -> object:
    """``target`` on ``device`` in ``dtype`` (each None: where and as it is), both checked first.

    Raises:
        UsageError: a ``ValueError`` naming the argument, what was given, what this machine has and the fix.
    """
    if device is None and dtype is None:
        return target
    now = where(target)
    dev = resolve_device(device, flag="device") if device is not None else None
    dt = resolve_dtype(dtype, dev or (now[0] if now else None), flag="dtype") if dtype is not None else None
    return place(target, dev, dt)


# Frames that are not the target's own code: torch's, and attnlab's (this package's parent).
_NOT_THEIRS = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parents[1])


def raised_at(error: BaseException) -> str:
    """Where the target's own code raised ``error``: ``file.py:LINE: the line``, the innermost frame outside
    torch and attnlab (a frame of the user's module); empty when every frame is theirs or ours."""
    return their_line(traceback.extract_tb(error.__traceback__))


# Where an exception passes through a module call: nn.Module.__call__'s frames (the target's forward, torch's or
# attnlab's own modules included).
_MODULE_CALL = frozenset({"_call_impl", "_wrapped_call_impl"})
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
# A backward pass runs the graph the target's forward built (an in-place edit of a saved tensor raises there).
_AUTOGRAD = Path(torch.autograd.__file__).resolve().parent


def raised_in_target(error: BaseException) -> bool:
    """Whether ``error`` came from the target: raised inside a module call (its forward, or a module it calls),
    in a backward pass through its graph, or in code that is neither torch's, attnlab's nor the standard
    library's (the user's own). Anything else is attnlab check's own failure, never blamed on the module."""
    for f in traceback.extract_tb(error.__traceback__):
        here = Path(f.filename).resolve()
        if (f.name in _MODULE_CALL and here.name == "module.py") or here.is_relative_to(_AUTOGRAD):
            return True
        if not any(here.is_relative_to(r) for r in (*_NOT_THEIRS, _STDLIB)):
            return True
    return False


def their_line(frames: list[traceback.FrameSummary]) -> str:
    """``file.py:LINE: the line`` of the innermost of ``frames`` (outermost first) that is the target's own
    code, not torch's or attnlab's; empty when there is none."""
    theirs = [f for f in frames if not any(Path(f.filename).resolve().is_relative_to(r) for r in _NOT_THEIRS)]
    if not theirs:
        return ""
    f = theirs[-1]
    return f"{Path(f.filename).name}:{f.lineno}: {(f.line or '').strip()}"


# torch's words for an op with no kernel in a dtype (not a shape or a logic error)
_UNSUPPORTED_DTYPE = re.compile(
    r"Expected both inputs to be Half, Float or Double|not implemented for '(BFloat16|Half)'|"
    r"is only supported for (float|floating)|Unsupported dtype (BFloat16|Half)"
)


def run_rows(target: object, checks: Iterable[str] | None, seed: int, batch: int, seq_len: int, scale: float | None,
             device: str | torch.device | None, dtype: str | torch.dtype | None) -> tuple[AttentionAdapter, Report]:  # fmt: skip
    """The rows of :func:`attnlab.check.run_checks` (its arguments, in its order), without the diagnosis:
    ``(the adapter, the report)``."""
    adapter = as_adapter(placed(target, device, dtype), scale=scale)
    names = list(CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"checks has unknown names {unknown}; expected names from {list(CHECKS)}.")
    if seq_len < 4:
        raise ValueError(
            f"seq_len={seq_len} is too short for the checks (they pad 3 tokens and split halves); pass seq_len >= 4."
        )
    ctx = Context(adapter, batch=batch, seq_len=seq_len, seed=seed)
    report = Report(
        adapter.name,
        config={
            "embed_dim": adapter.embed_dim,
            "num_heads": adapter.num_heads,
            "num_kv_heads": adapter.num_kv_heads,
            "batch": batch,
            "seq_len": seq_len,
            "seed": seed,
            "device": str(ctx.device),
            "dtype": str(ctx.dtype).removeprefix("torch."),
            "torch": torch.__version__,
            **({"called_as": adapter.describe()} if hasattr(adapter, "describe") else {}),
        },
    )
    with torch.random.fork_rng(devices=[]):  # dropout draws from the global RNG: leave the caller's alone
        torch.manual_seed(seed)
        adapter.set_training(False)
        self_attention = adapter.kdim == adapter.embed_dim and adapter.vdim == adapter.embed_dim
        for name in names:
            try:
                torch.manual_seed(seed)  # each row's dropout draws alike however the rows are run
                if not self_attention and name not in CROSS_ATTENTION_CHECKS:
                    result = _skip(
                        f"kdim={adapter.kdim}, vdim={adapter.vdim} differ from embed_dim={adapter.embed_dim}: "
                        f"the target cannot attend to its own input"
                    )
                else:
                    result = CHECKS[name](ctx)
            except Unsupported as e:  # the target lacks what the row needs (a mask argument, a cast ...)
                result = _skip(str(e))
            except Exception as e:  # a crash of the target is a finding about it; one of check's own is not
                if not raised_in_target(e):
                    raise CheckError(f"running check {name}", e) from e
                if name.startswith("low_precision") and _UNSUPPORTED_DTYPE.search(str(e)):
                    # an op of its own that torch has no half-precision kernel for (view_as_complex in bf16):
                    # the target cannot run in that dtype, which is no mistake in the attention it computes
                    report.results.append(
                        replace(_skip(f"the target cannot run in this dtype: {str(e).splitlines()[0]}"), name=name)
                    )
                    continue
                result = CheckResult(
                    "",
                    "fail",
                    None,
                    None,
                    f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                    data={"raised_at": at} if (at := raised_at(e)) else {},
                )
            report.results.append(replace(result, name=name))
    return adapter, report
