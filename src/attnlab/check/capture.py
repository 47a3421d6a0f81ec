"""Record every tensor operation a module runs on its inputs, and match each with a reference stage.

Notation: B batch, T_q/T_k query/key positions, E embed_dim, H heads, D head dim.

:func:`capture` runs any callable under a ``TorchFunctionMode`` and keeps each op whose inputs
descend from the given tensors (so weight and mask bookkeeping stays out): its name, its
arguments, the tensor it produced, and whether that tensor is a view. :func:`match_stages`
compares each produced tensor with the stages of :func:`attnlab.check.recipe.recipe_attention`
(projections, split, scores, scaled, masked, weights, context, merge, output) by *value*, in
any of the layouts people use ((B, T, H, D) for (B, H, T, D), (B*H, T, D)). That tells which
stages a hand-written module reproduces and the first one it does not, whatever its code looks
like. ``attnlab trace --target`` prints it; the diagnosis uses it where no catalogued mistake fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .recipe import STAGES

__all__ = ["Op", "capture", "capture_until_error", "departure_hint", "first_departure", "match_stages"]

MATCH_TOL = 1e-4  # relative: a float32 module against the float64 reference is ~1e-7; a mistake is >1e-2


@dataclass
class Op:
    """One recorded operation."""

    func: str  # the op's name: linear, view, transpose, matmul, softmax, ...
    args: list[int | str]  # an int: the index of the op that produced that argument (-1, -2, ...: inputs); else text
    kwargs: dict[str, str]
    shape: list[int]
    dtype: torch.dtype
    memory: str  # "view" (shares its input's storage) or "new"
    out: Tensor = field(repr=False)
    input_dtypes: list[torch.dtype] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)  # the ops that produced its tracked tensor inputs, lists included
    stage: str | None = None  # the reference stage its value equals (match_stages)


def _fname(func: object) -> str:
    name = getattr(func, "__name__", str(func))
    if name == "__get__":  # a property such as .T or .mT
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name.strip("_")  # __matmul__ -> matmul, __getitem__ -> getitem


def _in_place(func: object) -> bool:
    """``q *= s``, ``scores.masked_fill_(...)``: an op that rewrites its first argument and returns it."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or (name.startswith("__i") and name.endswith("__"))


_LOW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CASTS = {Tensor.to, Tensor.float, Tensor.half, Tensor.bfloat16, Tensor.type, Tensor.type_as}


class _Mode(TorchFunctionMode):
    def __init__(
        self, inputs: dict[str, Tensor], names: dict[int, str], tuples: bool = False, exact: bool = False
    ) -> None:
        super().__init__()
        self.tuples = tuples  # record each tensor of a split/chunk/unbind as an op of its own, "split[0]" ...
        # a float64 run stays float64: a module's own casts to a narrower float (CodeGen's q.to(float32), Phi-3's
        # softmax(dtype=float32), a rotary table's .float()) are made to float64, so that they neither round the
        # values a data-flow reading matches at 1e-6 (dataflow.py) nor meet float64 tensors in another dtype
        self.exact = exact
        self.ops: list[Op] = []
        self.ids: dict[int, int] = {}  # id(tensor) -> producing op index (inputs negative)
        self.keep: list[Tensor] = []  # the tensors stay alive, so their ids stay unique
        self.names = names  # id(parameter) -> "q_proj.weight"
        self.input_names = list(inputs)
        for i, t in enumerate(inputs.values()):
            self.ids.setdefault(id(t), -1 - i)
            self.keep.append(t)

    def _inside_mha(self, func: Callable[..., object], args: tuple, kwargs: dict) -> object:
        """``nn.MultiheadAttention``'s forward as its own ops (in-projection, split, scores, softmax ...), not one.

        ``F.multi_head_attention_forward`` is written in Python and hands itself to an active mode whole (its
        first line asks ``has_torch_function``). It runs again here with this mode pushed back and that one
        question answered no, once: every op in its body then reaches the mode as usual.
        """
        asked = F.has_torch_function  # type: ignore[attr-defined]
        answered = False

        def once(ops: object) -> bool:
            nonlocal answered
            if answered:
                return bool(asked(ops))
            answered = True
            return False

        F.has_torch_function = once  # type: ignore[attr-defined]
        try:
            with self:
                return func(*args, **kwargs)
        finally:
            F.has_torch_function = asked  # type: ignore[attr-defined]

    def _arg(self, a: object) -> int | str:
        if isinstance(a, Tensor):
            if id(a) in self.ids:
                return self.ids[id(a)]
            if id(a) in self.names:
                return self.names[id(a)]
            return f"<{'mask' if a.dtype == torch.bool else 'tensor'} {list(a.shape)}>"
        if isinstance(a, float):
            return f"{a:.4g}"
        if isinstance(a, list | tuple):
            return "[" + ", ".join(str(self._arg(b)) for b in a) + "]"
        if isinstance(a, torch.dtype):
            return str(a)
        return repr(a)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            return self._inside_mha(func, args, kwargs)
        args, kwargs = _positional(func, args, kwargs)
        if self.exact and kwargs.get("dtype") in _LOW_FLOATS:
            kwargs = {**kwargs, "dtype": torch.float64}
        out = func(*args, **kwargs)
        if self.exact and func in _CASTS and isinstance(out, Tensor) and out.dtype in _LOW_FLOATS:
            src = args[0]  # a cast to a narrower float is made to float64 instead, from the values as they were
            out = src if src.dtype == torch.float64 else src.to(torch.float64)
        flat = [b for a in args for b in (a if isinstance(a, list | tuple) else (a,))]
        tracked = [a for a in flat if isinstance(a, Tensor) and id(a) in self.ids]
        split = self.tuples and isinstance(out, tuple | list) and len(out) > 0
        parts = list(out) if split else [out]
        if not tracked or not all(isinstance(o, Tensor) for o in parts):
            return out  # off the data path, or not one tensor
        if any(out is t for t in tracked) and not _in_place(func):
            return out  # a no-op such as .to(its own dtype)
        src = tracked[0]
        args_text, kwargs_text = [self._arg(a) for a in args], {k: str(self._arg(v)) for k, v in kwargs.items()}
        for i, part in enumerate(parts):
            try:
                shares = part.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
            except RuntimeError:
                shares = False
            self.ops.append(
                Op(
                    func=f"{_fname(func)}[{i}]" if split else _fname(func),
                    args=args_text,
                    kwargs=kwargs_text,
                    shape=list(part.shape),
                    dtype=part.dtype,
                    memory="view" if shares else "new",
                    out=part.detach().clone(),  # its value now: a later in-place op must not rewrite it
                    input_dtypes=[t.dtype for t in tracked],
                    inputs=[self.ids[id(t)] for t in tracked],
                )
            )
            self.ids[id(part)] = len(self.ops) - 1
            self.keep.append(part)
        return out


# products whose tensor operands may come by keyword (BLOOM's ``alibi.baddbmm(batch1=q, batch2=k, beta=..)``),
# in their positional order: moved to their places, so that the operands are tracked and read as the others
_OPERANDS = {
    "baddbmm": ("input", "batch1", "batch2"),
    "addbmm": ("input", "batch1", "batch2"),
    "bmm": ("input", "mat2"),
    "matmul": ("input", "other"),
    "linear": ("input", "weight", "bias"),  # BEiT's F.linear(input=x, weight=..., bias=...)
}


def _positional(func: object, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args, kwargs`` with a product's tensor operands given by keyword moved into ``args``, in order."""
    names = _OPERANDS.get(getattr(func, "__name__", ""))
    if names is None or not any(n in kwargs for n in names[len(args) :]):
        return args, kwargs
    kwargs = dict(kwargs)
    moved = list(args)
    for n in names[len(args) :]:  # the leading ones given: the rest stay keywords
        if n not in kwargs:
            break
        moved.append(kwargs.pop(n))
    return tuple(moved), kwargs


def capture(
    fn: Callable[[], object], inputs: dict[str, Tensor], module: nn.Module | None = None, *, tuples: bool = True
) -> list[Op]:
    """The ops ``fn()`` runs on ``inputs`` (named as given), in order. ``module``'s parameters are named in calls.

    ``tuples``: ops that return several tensors (``split``, ``chunk``, ``unbind``: a fused ``qkv``) are
    recorded one op per tensor, ``split[0]``, ``split[1]`` ...; without it they, and all that follows
    from them, are left out. An exception from ``fn`` propagates; the ops recorded until then are lost
    with it (:func:`capture_until_error` keeps them).
    """
    mode = _Mode(inputs, _param_names(module), tuples)
    with mode:
        fn()
    return mode.ops


def capture_until_error(
    fn: Callable[[], object],
    inputs: dict[str, Tensor],
    module: nn.Module | None = None,
    *,
    tuples: bool = True,
    exact: bool = False,
) -> tuple[list[Op], Exception | None]:
    """:func:`capture` that survives ``fn`` raising: ``(the ops recorded until then, the exception or None)``.
    ``exact``: a float64 run is kept float64 (the module's casts down are not made)."""
    mode = _Mode(inputs, _param_names(module), tuples, exact)
    try:
        with mode:
            fn()
    except Exception as e:  # the module's own failure is the finding: the ops before it show where
        return mode.ops, e
    return mode.ops, None


def _param_names(module: nn.Module | None) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()} if module is not None else {}


def _layouts(t: Tensor, want: Tensor) -> list[Tensor]:
    """``t`` read in each layout that could hold ``want``'s values: as it is, heads and positions swapped,
    heads folded into the batch."""
    if t.numel() != want.numel():
        return []
    out = [t] if t.shape == want.shape else []
    if want.dim() == 3 and t.dim() == 3 and t.shape == (want.shape[1], want.shape[0], want.shape[2]) != want.shape:
        out.append(t.transpose(0, 1))  # (T, B, E): nn.MultiheadAttention's own layout, batch_first or not
    if want.dim() == 4:
        B, H, T, D = want.shape
        if t.dim() == 4 and t.shape == (B, T, H, D):
            out.append(t.transpose(1, 2))
        if t.dim() == 3 and t.shape == (B * H, T, D):
            out.append(t.reshape(B, H, T, D))
    return out


def _equal(t: Tensor, want: Tensor) -> float:
    """Relative error, NaN-free: positions that are -inf in ``want`` must be -inf (or hugely negative) in ``t``."""
    t, want = t.double(), want.double()
    finite = torch.isfinite(want)
    if not bool(finite.all()):
        if bool((t[~finite] > -1e4).any()):
            return float("inf")
        t, want = t[finite], want[finite]
    if not bool(torch.isfinite(t).all()):
        return float("inf")
    return float((t - want).abs().max() / want.abs().max().clamp_min(1e-12)) if want.numel() else 0.0


def stage_error(t: Tensor, want: Tensor) -> float | None:
    """The smallest relative error of ``t`` against ``want`` over the layouts that fit; None when none fits."""
    errs = [_equal(c, want) for c in _layouts(t, want)]
    return min(errs) if errs else None


def match_stages(ops: list[Op], stages: dict[str, Tensor]) -> None:
    """Set each op's ``stage``: the reference stage its output equals, moving forward through :data:`STAGES`."""
    reached = -1
    for op in ops:
        op.stage = None  # matched afresh: a second reference (the causal one) replaces the first's labels
        if not op.out.is_floating_point():
            continue
        hits = []
        for i, name in enumerate(STAGES):
            err = stage_error(op.out, stages[name])
            if err is not None and err <= MATCH_TOL:
                hits.append(i)
        if not hits:
            continue
        ahead = [i for i in hits if i >= reached]
        pick = min(ahead) if ahead else max(hits)
        op.stage = STAGES[pick]
        reached = max(reached, pick)


# Ops that compute several stages inside (scores, softmax, weights times V) and hand back only the context.
FUSED = ("scaled_dot_product_attention", "flex_attention", "multi_head_attention_forward")

# Stages that every later step feeds on: one of them matching means that nothing before it departed.
DOWNSTREAM = ("scaled", "masked", "weights", "context", "merged", "out")


def first_departure(
    ops: list[Op], stages: dict[str, Tensor], *, masked: bool = False
) -> tuple[list[str], str | None, Op | None]:
    """(the stages matched, the first stage not matched, the op that should have produced it).

    Stages a correct module may skip are not required: ``masked`` when no mask applies (it equals
    ``scaled``), ``scores`` and ``scaled`` when the module scales Q or K first, the split K/V heads when
    it reads them another way; and a stage that a later one (``DOWNSTREAM``) matches after ran inside a
    fused op such as SDPA, and ran right. The op is the first floating-point one (never mask
    bookkeeping) after the last op that matched an earlier stage, whose shape can hold the missing
    stage; None when there is none.
    """
    matched = [s for s in STAGES if any(op.stage == s for op in ops)]
    required = ["q", "k", "v", "q_heads", "weights", "context", "merged", "out"]
    if "scores" in matched or "scaled" in matched:
        required.insert(4, "scaled")
    if masked and "scaled" in required:  # a mask applies: the masked scores are a stage of their own
        required.insert(required.index("scaled") + 1, "masked")

    def vouched(stage: str) -> bool:
        # a later stage vouches for a missing one only if it is computed from it: the scores and weights from Q
        # and K alone, so V (a value projection mixed up) shows first in the context; a role's heads from the role
        # (a fused per-head projection never holds Q as (B, T, E): BLOOM's (B, T, H, 3, D))
        if stage in ("q", "k", "v") and f"{stage}_heads" in matched:
            return True
        vouching = ("context", "merged", "out") if stage in ("v", "v_heads") else DOWNSTREAM
        return any(s in matched for s in STAGES[STAGES.index(stage) + 1 :] if s in vouching)

    missing = next((s for s in required if s not in matched and not vouched(s)), None)
    if missing is None:
        return matched, None, None
    before = STAGES[: STAGES.index(missing)]
    floats = [op for op in ops if op.out.is_floating_point()]
    last = max((n for n, op in enumerate(floats) if op.stage in before), default=-1)
    want = stages[missing]
    candidate = next((op for op in floats[last + 1 :] if _layouts(op.out, want)), None)
    if candidate is None:  # computed inside a fused kernel (SDPA): the stage never leaves it, the kernel is the place
        candidate = next((op for op in floats[last + 1 :] if op.func in FUSED), None)
    return matched, missing, candidate


def departure_hint(
    missing: str, op: Op | None, stages: dict[str, Tensor], scale: float, ops: list[Op] | None = None
) -> str:
    """What is off about ``op``'s tensor, the one that should have been stage ``missing`` (for messages).
    ``ops``: all the ops recorded, so that a departure in the scores is read off the weights the module makes."""
    if ops is not None and op is not None and missing in ("scores", "scaled", "masked", "weights"):
        said = score_map(ops[ops.index(op) :], stages)
        if said:
            return said
    if op is None:
        return f"no tensor of its shape {list(stages[missing].shape)} comes after the last matching one"
    if op.func in FUSED and not _layouts(op.out, stages[missing]):
        err = stage_error(op.out, stages["context"])
        off = f": its output is off the reference's context by {err:.1e} (relative)" if err is not None else ""
        return f"{op.func} computes it inside, unseen{off}"
    t = op.out.double()
    if missing == "weights" and t.dim() == 4:
        rows = float((t.sum(-1) - 1).abs().max())
        cols = float((t.sum(-2) - 1).abs().max())
        if cols < 1e-4 < rows:
            return "each column sums to 1, so softmax ran over the query axis"
        if rows < 1e-4:
            return "each row sums to 1, but the values differ: the scores going into softmax are not the reference's"
        return f"their rows sum to {float(t.sum(-1).mean()):.3g} on average, not 1"
    if missing == "masked" and t.dim() == 4:
        want = stages["masked"]
        blocked = ~torch.isfinite(want)
        left_open = int((blocked & (t > -1e4)).sum()) if t.shape == want.shape else -1
        if left_open > 0:
            return f"{left_open} of the {int(blocked.sum())} pairs the mask blocks keep a finite score: the mask does not reach the scores"
    if missing == "scaled":
        raw = stages["scores"]
        err = stage_error(t, raw)
        if err is not None and err > MATCH_TOL:
            ratio = float((t.flatten() @ raw.flatten()) / (raw.flatten() @ raw.flatten()))
            return f"your scores are {ratio:.4g} x Q K^T; expected {scale:.4g} x Q K^T"
    err = stage_error(t, stages[missing])
    return f"the closest tensor differs by {err:.1e} (relative)" if err is not None else ""


SOFTMAX_OPS = ("softmax", "_softmax", "softmax_")


def score_map(ops: list[Op], stages: dict[str, Tensor]) -> str:
    """How the module's attention weights (the first softmax in ``ops``) depart from the reference's, where the
    scores going into them are the reference's through a map it does not apply: an additive bias set by the
    positions (ALiBi), or an elementwise squashing of the scores (soft-capping ``tanh(s / c) * c``). Read off
    the log-weights on the keys both keep, each row centred (softmax forgets a constant per row). "" when it
    is neither: the caller says what it can instead."""
    w_op = next((o for o in ops if o.func in SOFTMAX_OPS), None)
    want = stages["weights"].double()
    if w_op is None:
        return ""
    got = next((c for c in _layouts(w_op.out, want) if c.shape == want.shape), None)
    if got is None:
        return ""
    got = got.double()
    kept = (got > 1e-12) & (want > 1e-12)
    if int(kept.sum()) < 8 or not bool((kept == (want > 1e-12)).all()):
        return ""  # a key kept by one and not the other is a mask's business, not a map of the scores
    lg = torch.where(kept, got.clamp_min(1e-300).log(), 0.0)
    lw = torch.where(kept, want.clamp_min(1e-300).log(), 0.0)
    n = kept.sum(-1, keepdim=True).clamp_min(1)
    d = torch.where(kept, (lg - lw) - ((lg - lw) * kept).sum(-1, keepdim=True) / n, 0.0)  # (B, H, T_q, T_k)
    spread = float(d.abs().max())
    if spread < 1e-6:
        return ""
    H, Tk = d.shape[1], d.shape[3]
    j = torch.arange(Tk, dtype=torch.float64).expand_as(d)
    jc = torch.where(kept, j - (j * kept).sum(-1, keepdim=True) / n, 0.0)
    slope = (d * jc).sum((0, 2, 3)) / (jc * jc).sum((0, 2, 3)).clamp_min(1e-300)  # (H,): per head, per key
    if float((d - slope.view(1, H, 1, 1) * jc).abs().max()) <= 1e-6 * max(1.0, spread):
        slopes = ", ".join(f"{float(x):+.4g}" for x in slope)
        return (
            f"the weights are the reference's with an additive bias on the scores that grows with the key's "
            f"position, per head ({slopes} per key later; an ALiBi-style bias): the reference adds none, so "
            f"check cannot say whether the bias is right, only that the rest matches up to it"
        )
    ref = stages["masked"].double() if "masked" in stages else stages["scaled"].double()
    s = torch.where(kept, ref, 0.0)
    sc = torch.where(kept, s - (s * kept).sum(-1, keepdim=True) / n, 0.0)
    cube = torch.where(kept, s**3, 0.0)
    cc = torch.where(kept, cube - (cube * kept).sum(-1, keepdim=True) / n, 0.0)
    basis = torch.stack([sc[kept], cc[kept]], dim=1)  # d = a * s + b * s^3 (+ a row constant)
    sol = torch.linalg.lstsq(basis, d[kept].unsqueeze(1)).solution.flatten()
    resid = float((basis @ sol - d[kept]).abs().max())
    a, b = float(sol[0]), float(sol[1])
    if resid <= 0.05 * spread and b < 0 and abs(a) < 0.05:
        cap = math.sqrt(-1.0 / (3.0 * b))
        return (
            f"the weights are the reference's after the scores are squashed elementwise (s - s^3 / {1 / -b:.4g}: "
            f"a soft-cap tanh(s / c) * c with c ~ {cap:.3g}): the reference applies none, so check cannot say "
            f"whether the cap is right, only that the rest matches up to it"
        )
    return ""
