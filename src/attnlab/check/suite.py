"""The checks: each a small function of a :class:`Context`, each returning one row.

Notation: B batch, T positions (query length; self-attention keys too), T_k cross-attention
key length, E embed_dim. Every figure is a *relative* error, ``max |got - want| / max |want|``,
unless a row says otherwise, so tolerances hold for any width of output.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import TypedDict

import torch
from torch import Tensor
from torch.autograd import gradcheck

from .adapters import AttentionAdapter, Unsupported, as_adapter
from .reference import plain_attention, reference_attention
from .result import CheckResult, Report

__all__ = ["CHECKS", "Context", "run_checks"]

# float32 against float64, tiny dims: observed errors are ~1e-7 relative; 2e-5 leaves room for
# longer rows and fused kernels yet stays far below any real bug (a wrong scale or mask is > 1e-2).
PARITY_TOL = 2e-5
# Backward sums over more terms than forward, in float32.
GRAD_TOL = 1e-4
# Changing tokens a query cannot see must change nothing beyond rounding noise.
INVARIANCE_TOL = 1e-6
# gradcheck in float64 (seed 002): eps 1e-6 central differences agree to ~1e-9 when right.
GRADCHECK_ATOL, GRADCHECK_RTOL = 1e-5, 1e-3
# Low precision: the module may lose at most 2x what plain PyTorch loses (flash-attention's rule),
# plus this absolute floor so that two near-zero errors do not fail on noise.
LOW_PRECISION_FACTOR, LOW_PRECISION_FLOOR = 2.0, 1e-6


class _HeadKwargs(TypedDict):
    """The head layout the reference needs: keyword arguments of :func:`reference_attention`."""

    num_heads: int
    num_kv_heads: int
    scale: float


class _MaskKwargs(TypedDict, total=False):
    """Mask keyword arguments, valid for an adapter call and for :meth:`Context.reference` alike."""

    is_causal: bool
    key_padding_mask: Tensor


@dataclass
class Context:
    """The target and the input sizes every check uses."""

    adapter: AttentionAdapter
    batch: int = 2  # B
    seq_len: int = 8  # T
    cross_len: int = 6  # T_k of cross-attention: unequal to T so a swapped axis cannot hide
    seed: int = 0

    def generator(self, name: str) -> torch.Generator:
        """Seeded per check, so that a row's inputs do not depend on which other checks ran."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    @property
    def device(self) -> torch.device:
        return self.adapter.projections().q_weight.device

    def inputs(self, g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.randn(*shape, generator=g).to(self.device, dtype)

    def reference(self, query: Tensor, key: Tensor, value: Tensor, **masks) -> Tensor:
        a = self.adapter
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


# -- 1. output parity in float32 -------------------------------------------------------------
def check_parity_self(ctx: Context) -> CheckResult:
    g = ctx.generator("parity_self")
    x = ctx.inputs(g, ctx.batch, ctx.seq_len, ctx.adapter.embed_dim)  # (B, T, E)
    ref = ctx.reference(x, x, x)
    errs = {mode: _rel(_call(ctx.adapter, mode, x, x, x), ref) for mode in MODES}
    worst = max(errs, key=errs.__getitem__)
    return _row(
        errs[worst] <= PARITY_TOL,
        errs[worst],
        PARITY_TOL,
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
    out, ref = a(q, k, v), ctx.reference(q, k, v)
    err = _rel(out, ref)
    return _row(
        err <= PARITY_TOL,
        err,
        PARITY_TOL,
        f"T_q={ctx.seq_len}, T_k={ctx.cross_len}; max abs err {(out.double() - ref).abs().max():.1e}",
    )


def _mask_cases(ctx: Context, g: torch.Generator) -> dict[str, dict]:
    """Every mask kind, no query fully masked (those have their own check)."""
    B, T = ctx.batch, ctx.seq_len
    keep = torch.rand(B, T, T, generator=g) > 0.4  # (B, T, T)
    keep[..., 0] = True  # key 0 stays visible: causal row 0 sees only it
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -3:] = True  # sequence 0 ends in 3 pad tokens
    keep, pad = keep.to(ctx.device), pad.to(ctx.device)
    return {
        "causal": {"is_causal": True},
        "padding": {"key_padding_mask": pad},
        "bool (B,T,T)": {"keep_mask": keep},
        "bool (T,T)": {"keep_mask": keep[0]},
        "all": {"keep_mask": keep, "key_padding_mask": pad, "is_causal": True},
    }


def check_parity_masked(ctx: Context) -> CheckResult:
    g = ctx.generator("parity_masked")
    x = ctx.inputs(g, ctx.batch, ctx.seq_len, ctx.adapter.embed_dim)  # (B, T, E)
    errs = {}
    for name, kw in _mask_cases(ctx, g).items():
        ref = ctx.reference(x, x, x, **kw)
        for mode in MODES:
            errs[f"{name}, {mode}"] = _rel(_call(ctx.adapter, mode, x, x, x, **kw), ref)
    worst = max(errs, key=errs.__getitem__)
    return _row(errs[worst] <= PARITY_TOL, errs[worst], PARITY_TOL, f"causal, padding, bool, all; worst: {worst}")


# -- 2. low precision --------------------------------------------------------------------------
def check_low_precision(ctx: Context, dtype: torch.dtype) -> CheckResult:
    a = ctx.adapter
    try:
        low = a.cast(dtype)
    except Unsupported as e:
        return _skip(str(e))
    g = ctx.generator(f"low_precision[{dtype}]")
    x = ctx.inputs(g, ctx.batch, ctx.seq_len, a.embed_dim, dtype=dtype)  # (B, T, E) already rounded
    low.set_training(False)
    try:
        out = low(x, x, x, is_causal=True).detach()
    except (RuntimeError, NotImplementedError) as e:
        if "not implemented" not in str(e).lower():
            raise  # a real error: the runner reports it as a failed row
        return _skip(f"this device has no {dtype} kernel for the target: {str(e).splitlines()[0]}")
    # The reference sees the low-precision weights and inputs: only arithmetic error is measured.
    p = low.projections()
    heads: _HeadKwargs = {"num_heads": a.num_heads, "num_kv_heads": a.num_kv_heads, "scale": a.scale}
    ref = reference_attention(p, x, x, x, is_causal=True, **heads)
    plain = plain_attention(p, x, x, x, is_causal=True, **heads)
    err = float((out.double() - ref).abs().max()) if torch.isfinite(out).all() else math.inf
    err_plain = float((plain.double() - ref).abs().max())
    tol = LOW_PRECISION_FACTOR * err_plain + LOW_PRECISION_FLOOR
    return _row(
        err <= tol,
        err,
        tol,
        f"max abs err (causal); plain PyTorch: {err_plain:.2e}, tolerance 2x that + {LOW_PRECISION_FLOOR:g}",
    )


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
    # The figure shown: analytical vs numerical derivative along one random direction.
    u, w = torch.randn(x.shape, generator=g, dtype=x.dtype), torch.randn(1, T, a.embed_dim, generator=g, dtype=x.dtype)
    u, w = u.to(ctx.device), w.to(ctx.device)
    (grad,) = torch.autograd.grad((fn(x) * w).sum(), x)
    with torch.no_grad():
        numeric = ((fn(x + 1e-6 * u) - fn(x - 1e-6 * u)) * w).sum() / 2e-6
    gap = abs(float((grad * u).sum() - numeric))
    mode = "fast_mode" if fast else "full Jacobian"
    return _row(
        ok, gap, GRADCHECK_ATOL, f"gradcheck float64, {mode}: {'passed' if ok else 'FAILED'}; figure: directional gap"
    )


def check_grad_parity(ctx: Context) -> CheckResult:
    a = ctx.adapter
    g = ctx.generator("grad_parity")
    B, T, E = ctx.batch, ctx.seq_len, a.embed_dim
    x = ctx.inputs(g, B, T, E)  # (B, T, E)
    up = ctx.inputs(g, B, T, E)  # (B, T, E): upstream gradient
    pad = torch.zeros(B, T, dtype=torch.bool, device=ctx.device)
    pad[0, -2:] = True
    errs = {}
    cases: dict[str, _MaskKwargs] = {"unmasked": {}, "causal+padding": {"is_causal": True, "key_padding_mask": pad}}
    for name, kw in cases.items():
        x32, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
        (got,) = torch.autograd.grad((a(x32, x32, x32, **kw) * up).sum(), x32)
        (want,) = torch.autograd.grad((ctx.reference(x64, x64, x64, **kw) * up.double()).sum(), x64)
        errs[name] = _rel(got, want)
    worst = max(errs, key=errs.__getitem__)
    return _row(errs[worst] <= GRAD_TOL, errs[worst], GRAD_TOL, f"float32 input grads vs float64; worst: {worst}")


# -- 4. properties -------------------------------------------------------------------------------
def check_no_causal_leak(ctx: Context) -> CheckResult:
    g = ctx.generator("no_causal_leak")
    B, T, E = ctx.batch, ctx.seq_len, ctx.adapter.embed_dim
    x = ctx.inputs(g, B, T, E)  # (B, T, E)
    half = T // 2
    future = x.clone()
    future[:, half:] += 3.0 * ctx.inputs(g, B, T - half, E)  # only positions >= half change
    before, after = ctx.adapter(x, x, x, is_causal=True), ctx.adapter(future, future, future, is_causal=True)
    err = _rel(after[:, :half], before[:, :half])
    return _row(err <= INVARIANCE_TOL, err, INVARIANCE_TOL, f"outputs < {half} after changing tokens >= {half}")


def check_padding_invariance(ctx: Context) -> CheckResult:
    g = ctx.generator("padding_invariance")
    B, T, E = ctx.batch, ctx.seq_len, ctx.adapter.embed_dim
    n_pad = 3
    x = ctx.inputs(g, B, T, E)  # (B, T, E)
    pad = torch.zeros(B, T, dtype=torch.bool, device=ctx.device)
    pad[0, -n_pad:] = True
    changed = x.clone()
    changed[0, -n_pad:] += 3.0 * ctx.inputs(g, n_pad, E)  # rewrite the pad tokens of sequence 0
    before = ctx.adapter(x, x, x, key_padding_mask=pad)
    after = ctx.adapter(changed, changed, changed, key_padding_mask=pad)
    real = ~pad  # the pad tokens' own outputs may change; nothing else may
    err = _rel(after[real], before[real])
    return _row(err <= INVARIANCE_TOL, err, INVARIANCE_TOL, f"non-pad outputs after rewriting {n_pad} pad tokens")


def check_permutation_equivariance(ctx: Context) -> CheckResult:
    g = ctx.generator("permutation_equivariance")
    x = ctx.inputs(g, ctx.batch, ctx.seq_len, ctx.adapter.embed_dim)  # (B, T, E)
    perm = torch.randperm(ctx.seq_len, generator=g).to(ctx.device)
    xp = x[:, perm]  # (B, T, E), positions shuffled
    err = _rel(ctx.adapter(xp, xp, xp), ctx.adapter(x, x, x)[:, perm])
    return _row(err <= PARITY_TOL, err, PARITY_TOL, "f(x[:, perm]) vs f(x)[:, perm], unmasked")


def check_fully_masked_rows(ctx: Context) -> CheckResult:
    a = ctx.adapter
    g = ctx.generator("fully_masked_rows")
    T = ctx.seq_len
    x = ctx.inputs(g, ctx.batch, T, a.embed_dim)  # (B, T, E)
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
    return _row(worst <= PARITY_TOL, worst, PARITY_TOL, "; ".join(findings))


# -- 5. mask semantics -------------------------------------------------------------------------
def check_mask_semantics(ctx: Context) -> CheckResult:
    a = ctx.adapter
    g = ctx.generator("mask_semantics")
    T = ctx.seq_len
    x = ctx.inputs(g, ctx.batch, T, a.embed_dim)  # (B, T, E)
    mask = torch.rand(T, T, generator=g) > 0.5  # (T, T)
    rows = torch.arange(T)
    mask[rows, rows] = True
    mask[rows, (rows + 1) % T] = False  # every row holds a True and a False: both readings are valid
    mask = mask.to(ctx.device)
    try:
        out = a.raw_bool_mask(x, mask)
    except Unsupported as e:
        return _skip(str(e))
    err_keep = _rel(out, ctx.reference(x, x, x, keep_mask=mask))
    err_block = _rel(out, ctx.reference(x, x, x, keep_mask=~mask))
    found = (
        "True = may attend" if err_keep <= PARITY_TOL else "True = blocked" if err_block <= PARITY_TOL else "neither"
    )
    meaning: dict[str | None, str] = {"keep": "True = may attend", "block": "True = blocked"}
    declared = meaning.get(getattr(a, "bool_mask_convention", None))
    ok = found != "neither" and declared in (None, found)
    return _row(
        ok,
        found,
        declared or "keep or block",
        f"err if keep {err_keep:.1e}, if block {err_block:.1e}" + ("" if declared else "; convention not declared"),
    )


# -- 6. KV cache ---------------------------------------------------------------------------------
def check_kv_cache(ctx: Context) -> CheckResult:
    g = ctx.generator("kv_cache")
    T = ctx.seq_len
    x = ctx.inputs(g, ctx.batch, T, ctx.adapter.embed_dim)  # (B, T, E)
    chunks = [T - 3, 1, 1, 1]  # a prefill, then token-by-token decode
    try:
        out = ctx.adapter.decode_with_cache(x, chunks)
    except Unsupported as e:
        return _skip(str(e))
    err = _rel(out, ctx.reference(x, x, x, is_causal=True))
    return _row(err <= PARITY_TOL, err, PARITY_TOL, f"chunks {chunks} vs full causal reference")


# -- 7. eval mode --------------------------------------------------------------------------------
def check_determinism(ctx: Context) -> CheckResult:
    g = ctx.generator("determinism")
    x = ctx.inputs(g, ctx.batch, ctx.seq_len, ctx.adapter.embed_dim)  # (B, T, E)
    first, second = ctx.adapter(x, x, x).detach(), ctx.adapter(x, x, x).detach()
    diff = float((first - second).abs().max()) if torch.isfinite(first).all() else math.inf
    return _row(diff == 0.0, diff, 0.0, "max abs diff of two eval calls")


def check_dropout_off_in_eval(ctx: Context) -> CheckResult:
    a = ctx.adapter
    p = float(getattr(a, "dropout_p", 0.0))
    if p == 0.0:
        return _skip("target has dropout 0; build it with dropout > 0 to check that eval turns it off")
    g = ctx.generator("dropout_off_in_eval")
    x = ctx.inputs(g, ctx.batch, ctx.seq_len, a.embed_dim)  # (B, T, E)
    a.set_training(True)
    try:
        train_gap = float((a(x, x, x) - a(x, x, x)).detach().abs().max())
    finally:
        a.set_training(False)
    err = _rel(a(x, x, x), ctx.reference(x, x, x))
    active = "active" if train_gap > 0 else "INACTIVE even"
    return _row(
        err <= PARITY_TOL,
        err,
        PARITY_TOL,
        f"p={p:g} {active} in train (calls differ by {train_gap:.1e}); eval vs reference",
    )


CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "parity_self": check_parity_self,
    "parity_cross": check_parity_cross,
    "parity_masked": check_parity_masked,
    "low_precision[bf16]": partial(check_low_precision, dtype=torch.bfloat16),
    "low_precision[fp16]": partial(check_low_precision, dtype=torch.float16),
    "gradcheck[plain]": partial(check_gradcheck, case="plain"),
    "gradcheck[causal]": partial(check_gradcheck, case="causal"),
    "gradcheck[padding]": partial(check_gradcheck, case="padding"),
    "grad_parity": check_grad_parity,
    "no_causal_leak": check_no_causal_leak,
    "padding_invariance": check_padding_invariance,
    "permutation_equivariance": check_permutation_equivariance,
    "fully_masked_rows": check_fully_masked_rows,
    "mask_semantics": check_mask_semantics,
    "kv_cache": check_kv_cache,
    "determinism": check_determinism,
    "dropout_off_in_eval": check_dropout_off_in_eval,
}

# The only checks that do not feed one tensor as query, key and value.
CROSS_ATTENTION_CHECKS = frozenset({"parity_cross"})


def run_checks(
    target: object, *, checks: Iterable[str] | None = None, seed: int = 0, batch: int = 2, seq_len: int = 8
) -> Report:
    """Audit an attention module against attnlab's float64 reference.

    Args:
        target: an :class:`~attnlab.check.adapters.AttentionAdapter` (or any object following
            its protocol), a ``torch.nn.MultiheadAttention``, or an ``nn.Module`` following
            attnlab's calling convention.
        checks: names from :data:`CHECKS` to run (default: all, in that order).
        seed: seeds every input; the same seed gives the same figures.
        batch, seq_len: B and T of the inputs (seq_len >= 4).

    Returns:
        A :class:`Report`; ``report.ok`` is False when a check failed. The target is left in
        eval mode, and the global RNG state is untouched.
    """
    adapter = as_adapter(target)
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
            "torch": torch.__version__,
        },
    )
    with torch.random.fork_rng(devices=[]):  # dropout draws from the global RNG: leave the caller's alone
        torch.manual_seed(seed)
        adapter.set_training(False)
        self_attention = adapter.kdim == adapter.embed_dim and adapter.vdim == adapter.embed_dim
        for name in names:
            try:
                if not self_attention and name not in CROSS_ATTENTION_CHECKS:
                    result = _skip(
                        f"kdim={adapter.kdim}, vdim={adapter.vdim} differ from embed_dim={adapter.embed_dim}: "
                        f"the target cannot attend to its own input"
                    )
                else:
                    result = CHECKS[name](ctx)
            except Exception as e:  # a crash is a finding about the target, not a crash of the suite
                result = CheckResult(
                    "", "fail", None, None, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                )
            report.results.append(replace(result, name=name))
    return report
