"""Read an attention module by what it computes: which weights make Q, K and V, and what reaches the output.

Notation: B batch, T positions, E the input width, H query heads, G key/value heads, D head dim.

Names are hints at best: a module may keep its projections in a packed ``in_proj_weight``, in a
``ModuleList`` of per-head modules, in a fused ``qkv`` laid out ``(B, T, H, 3, D)``, or under names
nobody listed. So :func:`read_dataflow` runs the module once on probe inputs under a
``TorchFunctionMode`` (the ops recorded by :mod:`attnlab.check.capture`, each value copied when it is
produced, so a later in-place change cannot spoil it) and reads the data flow:

1. **The softmax** (``softmax``, or ``exp`` of a manual one, or inside ``scaled_dot_product_attention``).
2. **The score product** that feeds it, walking back through the scaling and masking: its two operands
   are Q and K, laid out by the product itself (``matmul``/``bmm``: ``(..., T, D)`` against
   ``(..., D, T)``; ``einsum``: by its equation, ``...`` spelled out as the operands' own dims).
3. **The product that consumes the weights**: its other operand is V, its result the context.
4. **Which parameter rows make each of Q, K and V.** The probe batch holds one-hot inputs at position 0
   (sequence ``i`` carries ``e_i``, the last one zeros), so each feature of Q at position 0 is ``c * W[r, i] +
   c * b[r]`` for some parameter row ``r`` and factor ``c`` (a scale folded into q, as fairseq's ``q *=
   scaling`` or Whisper's ``d^-1/4``). Each feature's column over the probe is matched with every row (and
   column, for weights stored transposed) of every 2-D parameter, so packed and per-head layouts read alike;
   a parameter of more dims is read as the linear map it is, its axis of the input's width against the input
   and the others flattened into rows (a Flax kernel ``(E, H, D)``, a per-head ``(H, E, D)``), whatever op
   applies it (einsum, matmul, bmm, tensordot, ``F.linear`` on a reshape): only the values are matched.
5. **The output projection**, by least squares of the output on the contexts, matched the same way.

A role's weight is then the rows it uses, **in the parameter's own order** (head ``h`` = rows ``h*D ..``):
a module that groups them into heads another way makes a mistake the checks name (heads interleaved),
while a fused layout that is another checkpoint's convention reads as it is. A position map applied to Q
and K after the projection (rotary) shows as features that are the projection's at position 0 only; it is
fitted per position and per tensor (q, k and v each: none, or a rotation of feature pairs, adjacent or
half-split, on all dims or a part) and, when it is a rotation by angles linear in the position, kept as a
:class:`Rotary` that the float64 reference applies to Q and K (so that a map on Q alone or on V too is a
mistake the recipes name). Features that are no rows even at position 0 are matched pair by pair with two
rows each: a rotation by the head index instead of the position (rotary along the wrong axis) reads so, and
the reference turns by the position with the angles read.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .capture import SOFTMAX_OPS, Op, capture_until_error

__all__ = [
    "FUSED_OPS",
    "SOFTMAX_OPS",
    "Reading",
    "Rotary",
    "RowSource",
    "Unreadable",
    "attention_sites",
    "descendants",
    "product_sides",
    "read_dataflow",
    "score_product",
    "tracked_args",
]

_PRODUCTS = ("matmul", "bmm", "einsum", "baddbmm", "rmatmul")
FUSED_OPS = ("scaled_dot_product_attention",)
MATCH = 1e-6  # float64 probe: a row that is the parameter's matches to ~1e-15; anything else is far off
PROBE_T = 5
PROBE_B = 12  # sequences: each feature's 12 values at position 0 tell its parameter row apart from all others


@dataclass(frozen=True)
class Rotary:
    """A rotation of head-feature pairs by ``position * omega``: ``(x_i, x_j) -> (x_i cos - x_j sin, x_i sin +
    x_j cos)`` for each pair ``(i, j)`` in ``pairs`` ``(P, 2)`` with its angle per position ``omega`` ``(P,)``."""

    pairs: tuple[tuple[int, int], ...]
    omega: tuple[float, ...]
    # the module turns each feature by its pair's angle but against a feature of the other pairing (its cos/sin
    # tables laid out for adjacent pairs, its rotate function taking halves, or the reverse): see :meth:`crossing`
    crossed: bool = False

    def apply(self, x: Tensor, positions: Tensor | None = None, crossed: bool = False) -> Tensor:
        """``x`` ``(..., T, D)`` rotated at positions ``0 .. T-1`` (or ``positions`` ``(T,)``); ``crossed``: each
        feature turned by its own pair's angle against its partner in the other pairing (the mistake)."""
        T = x.size(-2)
        if max(max(p) for p in self.pairs) >= x.size(-1):  # a recipe that splits heads another width: not this map
            raise RuntimeError(f"a rotary read on {self.dims}-wide heads cannot turn {x.size(-1)}-wide ones")
        pos = torch.arange(T, device=x.device, dtype=torch.float64) if positions is None else positions.double()
        pairs = self.crossing() if crossed else self.pairs
        angles = dict(zip((f for p in self.pairs for f in p), (w for w in self.omega for _ in (0, 1)), strict=True))
        i = torch.tensor([p[0] for p in pairs], device=x.device)
        j = torch.tensor([p[1] for p in pairs], device=x.device)
        omega = lambda side: torch.tensor([angles[p[side]] for p in pairs], dtype=torch.float64, device=x.device)
        ai, aj = pos[:, None] * omega(0), pos[:, None] * omega(1)  # (T, P): each feature's own angle
        xi, xj = x[..., i], x[..., j]  # (..., T, P)
        out = x.clone()
        out[..., i] = xi * ai.cos().to(x.dtype) - xj * ai.sin().to(x.dtype)
        out[..., j] = xj * aj.cos().to(x.dtype) + xi * aj.sin().to(x.dtype)
        return out

    def crossing(self) -> tuple[tuple[int, int], ...]:
        """The same features paired the other way: halves for adjacent pairs, adjacent pairs for halves."""
        f = sorted(i for p in self.pairs for i in p)
        n = len(f) // 2
        if self.pairs == tuple((f[a], f[a + n]) for a in range(n)):
            return tuple((f[2 * a], f[2 * a + 1]) for a in range(n))
        if self.pairs == tuple((f[2 * a], f[2 * a + 1]) for a in range(n)):
            return tuple((f[a], f[a + n]) for a in range(n))
        raise RuntimeError("rotary pairs that are neither adjacent nor halves have no other pairing")

    @property
    def dims(self) -> int:
        """The head width the map was read at (its highest paired feature + 1, at least)."""
        return max(max(p) for p in self.pairs) + 1

    def describe(self) -> str:
        split = all(j - i == len(self.pairs) for i, j in self.pairs)
        how = (
            "halves (i, i + D/2)"
            if split
            else "adjacent pairs (2i, 2i+1)"
            if all(j == i + 1 for i, j in self.pairs)
            else "pairs"
        )
        text = f"rotary on {2 * len(self.pairs)} dims, {how}, base angle {max(self.omega):.3g} rad/position"
        return text + (" (each feature turned against a partner of the other pairing)" if self.crossed else "")


@dataclass(frozen=True)
class RowSource:
    """Rows of parameters that make one role, in the parameters' own order: ``(path, transposed, rows)``."""

    parts: tuple[tuple[str, bool, tuple[int, ...]], ...]
    bias: tuple[tuple[str, tuple[int, ...]], ...] | None
    factor: float  # the scale folded into the role (q *= scaling): 1 when none
    # parameters of more than two dims, read as matrices: ``(path, axis)``, the axis that meets the input (or
    # makes the output), the others flattened in their order into rows (see :func:`as_matrix`)
    views: tuple[tuple[str, int], ...] = ()

    def weight(self, module: nn.Module) -> Tensor:
        """``(rows, in)`` in ``nn.Linear``'s layout, live: gradients and in-place changes reach the parameters."""
        axes = dict(self.views)
        pieces = []
        for path, transposed, rows in self.parts:
            p = as_matrix(module.get_parameter(path), axes.get(path, 1))
            w = p.t() if transposed else p
            pieces.append(w[torch.tensor(rows, device=p.device)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def bias_of(self, module: nn.Module) -> Tensor | None:
        if self.bias is None:
            return None
        pieces = []
        for path, rows in self.bias:
            p = module.get_parameter(path).reshape(-1)  # a bias kept per head (H, D) reads flattened
            pieces.append(p[torch.tensor(rows, device=p.device)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    @property
    def rows(self) -> int:
        return sum(len(r) for _, _, r in self.parts)

    def describe(self) -> str:
        def span(rows: tuple[int, ...]) -> str:
            if rows == tuple(range(rows[0], rows[-1] + 1)):
                return f"{rows[0]}:{rows[-1] + 1}"
            return f"{len(rows)} rows from {rows[0]} to {rows[-1]}"

        flat = dict(self.views)
        paths = [
            f"{p}{f' (read at dim {flat[p]}, the rest flattened)' if p in flat else ''}{'.T' if t else ''}[{span(r)}]"
            for p, t, r in self.parts
        ]
        if len(paths) > 3:
            paths = [paths[0], "...", paths[-1]]
        scaled = f" (x {self.factor:.4g} folded in)" if abs(self.factor - 1.0) > 1e-9 else ""
        return " + ".join(paths) + scaled


def as_matrix(p: Tensor, axis: int = 1) -> Tensor:
    """``p`` as the linear map it applies: a 2-D parameter as it is; one of more dims as ``(rows, p.size(axis))``,
    ``axis`` the one that meets the input width (or makes the output's), the others flattened into rows in their
    own order. A Flax kernel ``(E, H, D)`` at axis 0 is ``(H*D, E)``, nn.Linear's layout; ``(H, D, E)`` at 2 the
    same; a per-head ``(H, E, D)`` applied by ``bmm`` (or ``matmul``, ``tensordot``, ``einsum``) at 1, too."""
    if p.dim() == 2:
        return p
    return p.movedim(axis, -1).reshape(-1, p.size(axis))


def matrix_views(p: Tensor, width: int) -> list[tuple[int | None, Tensor]]:
    """The ``(axis, matrix)`` views of a parameter as a linear map with one side ``width``: a 2-D one as it is
    (axis None: either orientation), one of more dims at each axis of that size (see :func:`as_matrix`)."""
    if p.dim() < 2 or not p.is_floating_point():
        return []
    if p.dim() == 2:
        return [(None, p)] if width in p.shape else []
    return [(a, as_matrix(p, a)) for a in range(p.dim()) if p.size(a) == width]


@dataclass
class Reading:
    """What the module computes, read off its data flow."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q: RowSource
    k: RowSource
    v: RowSource
    out: RowSource | None  # None: nothing after the context is a projection of the parameters
    rotary: Rotary | None = None
    rotary_roles: tuple[str, ...] = ()  # which of q, k, v carry a position map
    # the map turns by the head index, the same at every position (rotary applied along the heads axis): the
    # reference turns by the position, as rotary means, with the angles read
    rotary_on_heads: bool = False
    unused: tuple[str, ...] = ()  # parameters of two dims or more that no role uses

    def describe(self) -> str:
        parts = [f"q {self.q.describe()}", f"k {self.k.describe()}", f"v {self.v.describe()}"]
        parts.append(f"out {self.out.describe()}" if self.out is not None else "no output projection")
        text = "weights read by data flow: " + "; ".join(parts)
        if self.rotary is not None:
            text += f"; {self.rotary.describe()} on {', '.join(self.rotary_roles)}"
            if self.rotary_on_heads:
                text += " (applied along the heads axis: its angle follows the head index, not the position)"
        return text


class Unreadable(Exception):
    pass


def _probe_input(E: int, dtype: torch.dtype, seed: int, batch: int) -> Tensor:
    """``(batch, PROBE_T, E)`` random inputs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, PROBE_T, E, generator=g, dtype=torch.float64).to(dtype)


def _tensor(ops: list[Op], ref: int | str, inputs: list[Tensor]) -> Tensor | None:
    if isinstance(ref, int):
        return ops[ref].out if ref >= 0 else inputs[-1 - ref]
    return None


def tracked_args(op: Op) -> list[int]:
    return op.inputs or [a for a in op.args if isinstance(a, int)]


def _einsum_letters(op: Op, dims: list[int] | None = None) -> tuple[list[str], str] | None:
    """The einsum's operand letters and its output's, ``...`` spelled out as letters of its own when ``dims``
    (each operand's number of dims) is given: right-aligned, so that a shorter ``...`` broadcasts."""
    eq = next((a for a in op.args if isinstance(a, str) and "->" in a), None)
    if eq is None:
        return None
    eq = eq.strip("'\"").replace(" ", "")
    lhs, rhs = eq.split("->")
    terms = lhs.split(",")
    if "..." not in eq:
        return terms, rhs
    if dims is None or len(dims) != len(terms):
        return None
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    spans = [d - (len(t) - 3) if "..." in t else 0 for t, d in zip(terms, dims, strict=True)]
    if min(spans) < 0 or max(spans) > len(free):
        return None
    widest = free[: max(spans)]
    terms = [t.replace("...", "".join(widest[len(widest) - n :])) for t, n in zip(terms, spans, strict=True)]
    return terms, rhs.replace("...", "".join(widest))


def _operands(op: Op, ops: list[Op], inputs: list[Tensor]) -> list[Tensor]:
    """The tensor operands of a product, tracked or not, in order."""
    out = []
    for a in op.args:
        if isinstance(a, int):
            t = _tensor(ops, a, inputs)
            if t is not None:
                out.append(t)
    return out


def _as_rows(x: Tensor, letters: str, keep: tuple[str, str], group: str, sizes: dict[str, int]) -> Tensor:
    """``x`` whose dims are named by ``letters``, permuted to ``(group..., keep[0], keep[1])``; a group letter it
    lacks (or holds at size 1: broadcast) is expanded to its size in ``sizes``."""
    for c in group:
        if c not in letters:
            x, letters = x.unsqueeze(0), c + letters
    order = [letters.index(c) for c in group] + [letters.index(keep[0]), letters.index(keep[1])]
    x = x.permute(order)
    return x.expand(*(sizes[c] for c in group), *x.shape[len(group) :])


def product_sides(op: Op, ops: list[Op], inputs: list[Tensor], first_is_weights: bool) -> tuple[Tensor, Tensor, Tensor]:
    """For Q K^T (``first_is_weights`` False): ``(Q (L, T_q, D), K (L, T_k, D), scores)``; for P V:
    ``(P (L, T_q, T_k), V (L, T_k, D), context (L, T_q, D))``, the group dims flattened to L."""
    if op.func == "baddbmm":  # the added term (an empty buffer, an ALiBi bias) is no operand, tracked or not
        tensors = _operands(Op(**{**vars(op), "args": op.args[1:3]}), ops, inputs)
    else:
        tensors = _operands(op, ops, inputs)
    if len(tensors) != 2:
        raise Unreadable(f"{op.func} with {len(tensors)} tensor operands")
    a, b = tensors
    res = op.out
    if op.func == "einsum":
        parsed = _einsum_letters(op, [a.dim(), b.dim()])
        if parsed is None or len(parsed[0]) != 2:
            raise Unreadable("einsum equation not read")
        (la, lb), lo = parsed
        if len(la) != a.dim() or len(lb) != b.dim() or len(lo) != res.dim():
            raise Unreadable("einsum equation does not fit its operands")
        sizes = dict(zip(lo, res.shape, strict=True))
        contracted = [c for c in la if c in lb and c not in lo]
        if len(contracted) != 1:
            raise Unreadable("einsum contracts more than one index")
        c = contracted[0]
        # the free position indices: the last of each side's own (a batch index that one side broadcasts, a
        # shorter '...', comes first)
        ta = next((x for x in reversed(la) if x in lo and x not in lb), None)
        tb = next((x for x in reversed(lb) if x in lo and x not in la), None)
        if ta is None or tb is None:
            raise Unreadable("einsum without two free position indices")
        group = "".join(x for x in lo if x not in (ta, tb))
        if any(x not in la and x not in lb for x in group):
            raise Unreadable("einsum output index of neither operand")
        A = _as_rows(a, la, (ta, c), group, sizes)
        Bm = _as_rows(b, lb, (tb, c), group, sizes)
        R = _as_rows(res, lo, (ta, tb), group, sizes)
    else:
        if a.dim() < 2 or b.dim() < 2:
            raise Unreadable("a product of vectors")
        A, Bm, R = a, b.transpose(-2, -1), res  # A (..., T_q, C), Bm (..., T_k, C)
        lead = torch.broadcast_shapes(A.shape[:-2], Bm.shape[:-2])
        A = A.expand(*lead, *A.shape[-2:])
        Bm = Bm.expand(*lead, *Bm.shape[-2:])
    L = int(math.prod(A.shape[:-2]))
    A = A.reshape(L, *A.shape[-2:])
    Bm = Bm.reshape(L, *Bm.shape[-2:])
    R = R.reshape(L, *R.shape[-2:])
    if first_is_weights:  # P (L, T_q, T_k) @ V: Bm is V^T read back, (L, D, T_k) -> (L, T_k, D)
        return A, Bm.transpose(-2, -1), R
    return A, Bm, R


def descendants(ops: list[Op], start: int) -> set[int]:
    seen = {start}
    for i in range(start + 1, len(ops)):
        if any(a in seen for a in tracked_args(ops[i])):
            seen.add(i)
    return seen


def score_product(ops: list[Op], s: int) -> int:
    """The product whose result flows, through elementwise steps, into the softmax at ``s``."""
    i = s
    for _ in range(40):
        args = [a for a in tracked_args(ops[i]) if a >= 0]
        if not args:
            break
        i = args[0]
        if ops[i].func in _PRODUCTS and len([a for a in tracked_args(ops[i])]) >= 2:
            return i
    raise Unreadable("no product of two computed tensors feeds the softmax")


@dataclass
class _Site:
    """One attention computation: Q (L, T, D), K (L, T, D), V (L, T, Dv), context (L, T, Dv)."""

    q: Tensor
    k: Tensor
    v: Tensor
    context: Tensor
    at: int  # the op that produced the context


def attention_sites(ops: list[Op], inputs: list[Tensor], heads_first: bool = False) -> list[_Site]:
    sites: list[_Site] = []
    for n, op in enumerate(ops):
        if op.func in FUSED_OPS:
            q, k, v = (_tensor(ops, a, inputs) for a in op.args[:3])
            if q is None or k is None or v is None:
                raise Unreadable("a fused attention call on a tensor not computed from the input")
            L = int(math.prod(q.shape[:-2]))
            kk = k.expand(*q.shape[:-2], *k.shape[-2:]) if k.dim() == q.dim() else k
            vv = v.expand(*q.shape[:-2], *v.shape[-2:]) if v.dim() == q.dim() else v
            sites.append(
                _Site(
                    q.reshape(L, *q.shape[-2:]),
                    kk.reshape(L, *kk.shape[-2:]),
                    vv.reshape(L, *vv.shape[-2:]),
                    op.out.reshape(L, *op.out.shape[-2:]),
                    n,
                )
            )
        elif op.func in SOFTMAX_OPS or op.func == "exp":
            # a manual softmax: exp of the scores minus their max, then divided by their sum
            if op.func == "exp" and not any(o.func == "sum" for o in ops[n + 1 : n + 4]):
                continue
            sp = score_product(ops, n)
            q, k, _ = product_sides(ops[sp], ops, inputs, first_is_weights=False)
            below = descendants(ops, n)
            pv = next(
                (
                    i
                    for i in sorted(below)
                    if i > n and ops[i].func in _PRODUCTS and any(a not in below for a in tracked_args(ops[i]))
                ),
                None,
            )
            if pv is None:
                raise Unreadable("nothing multiplies the attention weights")
            _, v, ctx = product_sides(ops[pv], ops, inputs, first_is_weights=True)
            if _keys_first(ops[sp], ops[pv], ops, inputs):
                q, k = k, q
            sites.append(_unfold_queries(_Site(q, k, v, ctx, pv), heads_first))
    return sites


def _keys_first(score: Op, pv: Op, ops: list[Op], inputs: list[Tensor]) -> bool:
    """Whether the score einsum's first operand is K: its free index sits where the product with V contracts the
    weights (Keras's ``einsum("aecd,abcd->acbe", key, query)`` then ``einsum("acbe,aecd->abcd", weights, v)``)."""
    if score.func != "einsum":
        return False

    def letters(op: Op) -> tuple[list[str], str] | None:
        tensors = _operands(op, ops, inputs)
        parsed = _einsum_letters(op, [t.dim() for t in tensors]) if len(tensors) == 2 else None
        return parsed if parsed is not None and len(parsed[0]) == 2 else None

    parsed = letters(score)
    if parsed is None:
        return False
    (la, lb), lo = parsed
    ta = next((x for x in reversed(la) if x in lo and x not in lb), None)
    contracted = -1  # P @ V (matmul, bmm): the weights' last axis
    if pv.func == "einsum":
        p = letters(pv)
        c = None if p is None else next((x for x in p[0][0] if x in p[0][1] and x not in p[1]), None)
        if p is None or c is None:
            return False
        contracted = p[0][0].index(c) - len(p[0][0])
    return ta is not None and lo.index(ta) - len(lo) == contracted


def _unfold_queries(site: _Site, heads_first: bool) -> _Site:
    """A site whose queries fold the heads into the query axis against one shared K/V head (GPTBigCode's
    multi-query ``(B, T * H, D)`` against ``(B, D, S)``), with the heads unfolded into groups: Q and the context
    ``(L * H, T, D)``. ``heads_first``: folded ``(H, T)`` rather than ``(T, H)``."""
    T, n = site.k.size(1), site.q.size(1) // max(site.k.size(1), 1)
    if n < 2 or site.q.size(1) != n * T or site.context.shape[:2] != site.q.shape[:2]:
        return site

    def unfold(t: Tensor) -> Tensor:
        L, _, D = t.shape
        g = t.reshape(L, n, T, D) if heads_first else t.reshape(L, T, n, D).transpose(1, 2)
        return g.reshape(L * n, T, D)

    return _Site(unfold(site.q), site.k, site.v, unfold(site.context), site.at)


def _batch_rows(first: Tensor, moved: Tensor, B: int) -> Tensor | None:
    """Which sequence each of the ``L`` groups belongs to, ``(L,)``: from the groups that change when
    sequence 0's input does (``moved``), contiguous (batch-major) or strided (heads-major)."""
    L = first.size(0)
    if L % B:
        return None
    changed = ((first - moved).abs().flatten(1).amax(1) > 1e-9 * first.abs().max().clamp_min(1e-12)).nonzero().flatten()
    n = L // B
    if changed.tolist() == list(range(n)):
        return torch.arange(L) // n
    if changed.tolist() == list(range(0, L, B)):
        return torch.arange(L) % B
    return None


class _Bank:
    """Every input-weight row of the module's parameters read as linear maps (rows of ``nn.Linear``'s
    ``(out, in)``, columns of a weight stored ``(in, out)`` as GPT-2's ``Conv1D``, and of any parameter of more
    dims viewed flattened as a matrix with one side the input width: a Flax kernel ``(E, H, D)`` as
    ``(E, H*D)``, whatever op applies it), for matching features by their values over a probe."""

    def __init__(self, module: nn.Module, width: int) -> None:
        self.entries: list[tuple[str, bool, int]] = []  # (path, stored transposed, row)
        self.axes: dict[str, int] = {}  # parameters of more than two dims: the axis that meets the input
        vecs = []
        for path, p in module.named_parameters():
            for axis, w in matrix_views(p.detach().double(), width)[:1]:  # one view per parameter
                if axis is not None:  # (rows, width): its rows
                    self.axes[path] = axis
                    vecs.append(w)
                    self.entries += [(path, False, r) for r in range(w.size(0))]
                    continue
                if w.size(1) == width:
                    vecs.append(w)
                    self.entries += [(path, False, r) for r in range(w.size(0))]
                if w.size(0) == width:
                    vecs.append(w.t())
                    self.entries += [(path, True, r) for r in range(w.size(1))]
        self.raw = torch.cat(vecs) if vecs else torch.zeros(0, width, dtype=torch.float64)

    def views(self, paths: object) -> tuple[tuple[str, int], ...]:
        """The views of the parameters among ``paths`` that are read flattened."""
        return tuple((p, self.axes[p]) for p in dict.fromkeys(paths) if p in self.axes)  # type: ignore[call-overload]

    def matrix(self, module: nn.Module, path: str) -> Tensor:
        """The parameter at ``path`` as the matrix its entries index."""
        return as_matrix(module.get_parameter(path), self.axes.get(path, 1))

    def match_all(
        self, feats: Tensor, x0: Tensor, tol: float
    ) -> list[tuple[tuple[str, bool, int], float, float] | None]:
        """For each column of ``feats`` ``(B, n)`` (features at position 0 over the probe, whose inputs there are
        ``x0`` ``(B, E)``): the entry ``r`` with ``feats[:, d] = c * (x0 @ entry_r + b)``, the factor ``c`` and
        the bias ``c * b``; None where no entry fits. Matched by correlation over the probe, centred (the bias
        drops out), so any width costs one product."""
        if not self.entries:
            return [None] * feats.size(1)
        Y = x0 @ self.raw.t()  # (B, N): every row applied to the probe
        Yc, Fc = Y - Y.mean(0), feats - feats.mean(0)
        cos = (Fc / Fc.norm(dim=0).clamp_min(1e-300)).t() @ (Yc / Yc.norm(dim=0).clamp_min(1e-300))  # (n, N)
        best = cos.abs().argmax(dim=1)  # (n,): each feature's nearest entry, then all of them at once
        fits = (Fc.norm(dim=0) != 0) & (1.0 - cos.gather(1, best[:, None])[:, 0].abs() <= tol)
        Yb, Ycb = Y[:, best], Yc[:, best]  # (B, n)
        c = (Fc * Ycb).sum(0) / (Ycb * Ycb).sum(0)  # (n,): the factor
        bias = feats.mean(0) - c * Yb.mean(0)  # (n,): the bias, scaled
        return [
            (self.entries[i], ci, bi) if ok else None
            for i, ok, ci, bi in zip(best.tolist(), fits.tolist(), c.tolist(), bias.tolist(), strict=True)
        ]


def _bias_source(
    module: nn.Module, matched: list[tuple[str, bool, int]], factor: float, eff: Tensor, tol: float
) -> tuple[tuple[tuple[str, tuple[int, ...]], ...] | None, bool]:
    """The 1-D parameter entries equal to ``eff / factor`` at the matched rows' indices: ``(source, ok)``;
    ``(None, True)`` when the effective bias is zero and no bias is found."""
    want = eff / factor
    size = want.abs().max()
    by_path: dict[str, list[int]] = {}
    for path, _, r in matched:
        by_path.setdefault(path, []).append(r)
    found: list[tuple[str, tuple[int, ...]]] = []
    pos = 0
    params = dict(module.named_parameters())
    for path, rows in by_path.items():
        part = want[pos : pos + len(rows)]
        pos += len(rows)
        owner = path.rsplit(".", 1)[0] if "." in path else ""
        # a bias vector, the weight's own module's first; else, where it is not zero, one kept per head ((H, D),
        # read flattened)
        nonzero = float(part.abs().max()) > 1e-9 * max(1.0, float(eff.abs().max()))
        # at the rows' own indices, or from 0 (a vector of this role's alone: BEiT's q_bias, v_bias beside a packed
        # bias-free qkv)
        spans = list(dict.fromkeys([tuple(rows), tuple(r - min(rows) for r in rows)]))
        fits = [
            (n, at)
            for n, p in params.items()
            for at in spans
            if p.is_floating_point() and p.numel() > max(at) and (p.dim() == 1 or (nonzero and n != path))
        ]
        cands = sorted(
            fits, key=lambda c: (params[c[0]].dim() != 1, (c[0].rsplit(".", 1)[0] if "." in c[0] else "") != owner)
        )
        hit = None
        for n, at in cands:
            vals = params[n].detach().double().reshape(-1)[torch.tensor(at)]
            if float((vals - part).abs().max()) <= tol * max(float(size), 1e-12) * 10:
                hit = (n, at)
                break
        if hit is None:
            if float(part.abs().max()) <= 1e-9 * max(1.0, float(eff.abs().max())):
                continue
            return None, False
        found.append(hit)
    if not found:
        return None, float(eff.abs().max()) <= 1e-9
    return tuple(found), True


def _role_rows(
    module: nn.Module, feats: list[Tensor], x0: Tensor, bank: _Bank, tol: float
) -> tuple[RowSource, list[tuple[str, bool, int]]]:
    """``feats``: per head, ``(B, D)`` position-0 features over the probe. The parameter rows they come from
    (in the module's own per-head order) and the role's source in the parameters' order."""
    hits = bank.match_all(torch.cat(feats, dim=1), x0, tol)
    if any(h is None for h in hits):
        raise Unreadable("a feature is not any parameter's row")
    matched = [h[0] for h in hits if h is not None]
    factors = [h[1] for h in hits if h is not None]
    fac = factors[0]
    if any(abs(x - fac) > 1e-6 * abs(fac) for x in factors):
        raise Unreadable("features scaled unevenly")
    return _source(module, matched, fac, [h[2] for h in hits if h is not None], tol, bank), matched


def _source(
    module: nn.Module, matched: list[tuple[str, bool, int]], fac: float, biases: list[float], tol: float, bank: _Bank
) -> RowSource:
    """The role's rows in the parameters' order, with the bias parameter matching each row's ``biases``
    (scaled by ``fac``, as the features carry it)."""
    bias_by = dict(zip(matched, biases, strict=True))
    order = {p: n for n, (p, _) in enumerate(module.named_parameters())}
    unique = sorted(dict.fromkeys(matched), key=lambda e: (order.get(e[0], 0), e[1], e[2]))
    eff_sorted = torch.tensor([bias_by[e] for e in unique], dtype=torch.float64)
    bias, ok = _bias_source(module, unique, fac, eff_sorted, max(tol, 1e-9))
    if not ok:
        raise Unreadable("a bias that is no parameter's")
    return RowSource(_runs_of(unique), bias, fac, bank.views(p for p, _, _ in unique))


def _mapped_rows(
    module: nn.Module, feats: list[Tensor], x: Tensor, bank: _Bank, tol: float
) -> tuple[RowSource, list[tuple[str, bool, int]], list[Tensor], list[Tensor]]:
    """Where the features at position 0 are no parameter's rows but each pair of them (adjacent, or the two
    halves', as rotary pairs them) a fixed mix of two rows (a map after the projection that turns position 0
    too, such as a rotation by the head index): the two rows whose values over the probe span each pair's.
    ``feats`` per head ``(B, T, D)``, ``x`` ``(B, T, E)``. Returns the source (factor: the map's scale), the
    rows per head, the map ``M`` ``(D, D)`` per head (``features_0 = (rows_0 + bias) @ M``) and the
    projection before the map per head ``(B, T, D)``."""
    x0 = x[:, 0].double()
    Y = x0 @ bank.raw.t()  # (B, N)
    Yc = Y - Y.mean(0)
    units = Yc / Yc.norm(dim=0).clamp_min(1e-300)
    D = feats[0].size(-1)
    for pairs in ([(i, i + 1) for i in range(0, D - 1, 2)], [(i, i + D // 2) for i in range(D // 2)]):
        try:
            found = [_pair_rows(f[:, 0], pairs, Y, Yc, units, tol) for f in feats]
        except Unreadable:
            continue
        matched = [bank.entries[i] for idx, _, _ in found for i in idx]
        maps = [M for _, M, _ in found]
        fac = float(maps[0].square().sum().div(D).sqrt())  # a rotation times the scale folded in
        eff = (torch.cat([b for _, _, b in found]) * fac).tolist()
        preds = [x.double() @ bank.raw[idx].t() + b for idx, _, b in found]  # (B, T, D) per head
        return _source(module, matched, fac, eff, tol, bank), matched, maps, preds
    raise Unreadable("a feature is not any parameter's row, nor a mix of two in rotary's pairs")


def _pair_rows(
    f0: Tensor, pairs: list[tuple[int, int]], Y: Tensor, Yc: Tensor, units: Tensor, tol: float
) -> tuple[list[int], Tensor, Tensor]:
    """One head's features at position 0 ``(B, D)``, each of ``pairs`` spanned by two bank rows (``Y`` their
    values ``(B, N)``, ``Yc`` centred, ``units`` normalised): (the rows per feature, the map ``(D, D)``, the
    rows' biases ``(D,)``)."""
    D = f0.size(1)
    idx = [0] * D
    M = torch.zeros(D, D, dtype=f0.dtype)
    fc = f0 - f0.mean(0)
    for pair in pairs:
        basis = torch.linalg.qr(fc[:, pair]).Q  # (B, 2)
        near = ((units - basis @ (basis.t() @ units)).norm(dim=0) <= max(tol, 1e-9) * 100).nonzero().flatten()
        if near.numel() != 2:
            raise Unreadable("a pair of features is no mix of two parameter rows")
        for n, d in zip(near.tolist(), pair, strict=True):
            idx[d] = n
        rows = torch.tensor(pair)
        M[rows[:, None], rows] = torch.linalg.lstsq(Yc[:, near], fc[:, pair]).solution
    bias = torch.linalg.solve(M.t(), f0.mean(0)) - Y[:, idx].mean(0)  # (D,): each row's bias before the map
    return idx, M, bias


def _runs_of(entries: list[tuple[str, bool, int]]) -> tuple[tuple[str, bool, tuple[int, ...]], ...]:
    """Consecutive entries of one parameter (and orientation) gathered: ``(path, transposed, rows)``."""
    parts: list[tuple[str, bool, tuple[int, ...]]] = []
    for path, tr, r in entries:
        if parts and parts[-1][0] == path and parts[-1][1] == tr:
            parts[-1] = (path, tr, parts[-1][2] + (r,))
        else:
            parts.append((path, tr, (r,)))
    return tuple(parts)


def _out_projection(module: nn.Module, ops: list[Op], contexts_at: set[int], y: Tensor, width: int) -> RowSource | None:
    """The parameter that turns the merged heads into the output: among the tensors computed from the contexts,
    one ``M`` ``(B, T, N)`` (or ``(T, B, N)``) and a parameter ``P`` with ``y = M P^T + b`` exactly; its columns in
    the parameter's own order. None when nothing projects them (the output is the merged heads)."""
    B, T, E = y.shape
    flat_y = y.double().reshape(-1, E)
    exact = 1e-6 * float(flat_y.abs().max().clamp_min(1e-12))
    few = torch.arange(0, flat_y.size(0), max(1, flat_y.size(0) // 16))  # rows a candidate is tried on first
    below: set[int] = set()
    for i in sorted(contexts_at):
        below |= descendants(ops, i)
    params = [(n, axis, P) for n, p in module.named_parameters() for axis, P in matrix_views(p.detach().double(), E)]
    ones = {n: p.reshape(-1) for n, p in module.named_parameters() if p.dim() >= 1 and p.numel() == E}
    for i in sorted(below):
        m = ops[i].out
        if not m.is_floating_point() or m.dim() < 2 or m.numel() == 0 or m.numel() % (B * T):
            continue
        N = m.numel() // (B * T)
        # (B, T, N), (T, B, N), either flattened to 2-D (F.multi_head_attention_forward's (T*B, E)), or the heads
        # unmerged (B, T, H, D), as a Flax kernel (H, D, E) takes them
        for merged in (m.reshape(B, T, N), m.reshape(T, B, N).transpose(0, 1)):
            M = merged.double().reshape(-1, N)
            for path, axis, P in params:
                # W (E, N): nn.Linear's (out, in), or stored (in, out); a view of more dims is (rows, E)
                for tr, W in ((True, P), (False, P.t())):
                    if W.shape != (E, N) or (tr and axis is not None):
                        continue
                    part = flat_y[few] - M[few] @ W.t()  # an exact fit holds on any rows: most fail on a few
                    if float((part - part.mean(0)).abs().max()) > 2 * exact:
                        continue
                    rest = flat_y - M @ W.t()
                    bias = rest.mean(0)
                    if float((rest - bias).abs().max()) > exact:
                        continue
                    bias_src = None
                    for n, b in ones.items():
                        if b.numel() == E and float((b.detach().double() - bias).abs().max()) <= 1e-6 * max(
                            1.0, float(bias.abs().max())
                        ):
                            bias_src = ((n, tuple(range(E))),)
                            break
                    if bias_src is None and float(bias.abs().max()) > 1e-9:
                        continue
                    views = ((path, axis),) if axis is not None else ()
                    return RowSource(((path, tr, tuple(range(N))),), bias_src, 1.0, views)
    return None


def _fit_rotary(actual: list[Tensor], predicted: list[Tensor], tol: float) -> Rotary | None:
    """A rotation of feature pairs by angles linear in the position that maps ``predicted`` to ``actual``
    (per head ``(E + 1, T, D)``); None when the two are equal, raises when no such rotation fits."""
    P = torch.cat(predicted).detach()  # (N, T, D)
    A = torch.cat(actual).detach()
    size = P.abs().max().clamp_min(1e-12)
    if float((A - P).abs().max() / size) <= tol * 100:
        return None
    if P.size(1) < 3:
        raise Unreadable("too few positions to read a position map")
    R1 = torch.linalg.lstsq(P[:, 1], A[:, 1]).solution.t()  # (D, D): A_1 = P_1 @ R1^T
    for read in (_rotation, _crossed_rotation):
        try:
            rot = read(R1)
        except Unreadable:
            continue
        if rot is not None and float((rot.apply(P, crossed=rot.crossed) - A).abs().max() / size) <= 1e-6:
            return rot
    raise Unreadable("a position map other than a rotation linear in the position")


def _crossed_rotation(R1: Tensor) -> Rotary | None:
    """The rotary whose tables pair features one way while its rotate function pairs them the other (each
    feature ``f`` turned by its own angle against partner ``p``: ``R1[f, f] = cos``, ``R1[f, p] = -+sin``), as
    :class:`Rotary` with ``crossed``: its ``pairs`` those of equal angles (the tables'); None when ``R1`` is no
    such map."""
    D = R1.size(0)
    angle: dict[int, float] = {}
    partner: dict[int, int] = {}
    for f in range(D):
        off = R1[f].clone()
        off[f] = 0.0
        if float(off.abs().max()) < 1e-9:
            continue
        p = int(off.abs().argmax())
        partner[f] = p
        angle[f] = math.atan2(float(R1[f, p]) * (-1.0 if f < p else 1.0), float(R1[f, f]))
    turned = sorted(angle)
    if len(turned) < 4 or len(turned) % 2:
        return None
    n = len(turned) // 2
    for pairs in (
        tuple((turned[a], turned[a + n]) for a in range(n)),
        tuple((turned[2 * a], turned[2 * a + 1]) for a in range(n)),
    ):
        rot = Rotary(pairs, tuple(angle[i] for i, _ in pairs), crossed=True)
        same = all(abs(angle[i] - angle[j]) < 1e-6 for i, j in pairs)
        if same and all(partner[i] == j and partner[j] == i for i, j in rot.crossing()):
            return rot
    return None


def _heads_rotary(actual: list[Tensor], preds: list[Tensor], maps: list[Tensor]) -> Rotary | None:
    """The rotation of feature pairs by angles linear in the *head index* that ``maps`` (per head, from
    :func:`_mapped_rows`) make, the same at every position (rotary applied along the heads axis); None when
    it is no more than the scale; raises when the map changes with the position or is no such rotation."""
    A, P = torch.stack(actual, dim=-2), torch.stack(preds, dim=-2)  # (B, T, H, D)
    size = A.abs().max().clamp_min(1e-12)
    if float((torch.einsum("bthd,hde->bthe", P, torch.stack(maps)) - A).abs().max() / size) > 1e-6:
        raise Unreadable("a map after the projection that changes with the position and turns position 0")
    c = float(maps[0].square().sum().div(maps[0].size(0)).sqrt())
    if len(maps) < 2 or all(bool(torch.allclose(M / c, torch.eye(M.size(0), dtype=M.dtype), atol=1e-6)) for M in maps):
        return None
    rot = _rotation(maps[1].t() / c)
    if float((c * rot.apply(P) - A).abs().max() / size) > 1e-6:  # along -2: the heads
        raise Unreadable("a map after the projection that is no rotation linear in the head index")
    return rot


def _rotation(R1: Tensor) -> Rotary:
    """The rotation of feature pairs that ``R1`` ``(D, D)`` makes (``a = R1 p``), its angles read off it."""
    D = R1.size(0)
    pairs: list[tuple[int, int]] = []
    omega: list[float] = []
    used: set[int] = set()
    for i in range(D):
        if i in used:
            continue
        off = R1[:, i].clone()
        off[i] = 0.0
        j = int(off.abs().argmax())
        if float(off.abs().max()) < 1e-9:
            if abs(float(R1[i, i]) - 1.0) > 1e-6:
                raise Unreadable("a position map that is not a rotation")
            used.add(i)
            continue
        pairs.append((i, j))
        omega.append(math.atan2(float(R1[j, i]), float(R1[i, i])))
        used |= {i, j}
    if not pairs:
        raise Unreadable("a position map that is not a rotation")
    return Rotary(tuple(pairs), tuple(omega))


def read_dataflow(
    module: nn.Module, call: Callable[[nn.Module, Tensor], object], embed_dim: int, *, seed: int = 0
) -> Reading | None:
    """Read ``module``'s projections, heads and position map off what it computes (see the module docstring).

    Args:
        module: the attention module (not changed: a float64 copy runs).
        call: ``call(module, x)`` runs self-attention of ``x`` ``(B, T, E)`` and returns the output (or a tuple
            whose first element is it), in whatever call form and layout the module takes.
        embed_dim: E.

    Returns:
        The reading, or None when the data flow cannot be read that way (no softmax reached, a feature that
        is no parameter's row ...): the caller falls back on names.
    """
    try:
        with warnings.catch_warnings():  # the module's own warnings (a complex cast ...) are no reason to fail here
            warnings.simplefilter("ignore")
            try:
                return _read(module, call, embed_dim, seed)
            except (Unreadable, RuntimeError):  # heads folded into the queries (H, T) rather than (T, H)?
                return _read(module, call, embed_dim, seed, heads_first=True)
    except (Unreadable, RuntimeError, IndexError, ValueError, TypeError, UserWarning):
        return None


def _read(
    module: nn.Module,
    call: Callable[[nn.Module, Tensor], object],
    E: int,
    seed: int,
    batch: int = PROBE_B,
    heads_first: bool = False,
) -> Reading:
    probe = copy.deepcopy(module).eval()
    try:
        probe = probe.double()
        dtype, tol = torch.float64, MATCH
    except Exception:
        dtype, tol = torch.float32, 1e-4
    x = _probe_input(E, dtype, seed, batch)
    moved = x.clone()
    moved[0, 1:] += 1.0  # sequence 0 changes away from position 0
    moved[0, 0, 0] += 0.5
    results = []
    for inp in (x, moved):

        def run(inp: Tensor = inp) -> object:
            return call(probe, inp)

        with torch.no_grad():  # read only: no graph (an in-place op on a split's view is then allowed, as in eval)
            ops, err = capture_until_error(run, {"x": inp}, probe, exact=dtype == torch.float64)
        if err is not None:
            raise Unreadable(f"the probe call raised {type(err).__name__}: {err}")
        results.append((ops, attention_sites(ops, [inp], heads_first)))
    (ops, sites), (_, sites2) = results
    if not sites or len(sites) != len(sites2):
        raise Unreadable("no attention weights found")
    with torch.no_grad():
        out = call(probe, x)
    y = out[0] if isinstance(out, tuple | list) else out
    if not isinstance(y, Tensor) or y.shape != x.shape:
        raise Unreadable("the output is not (B, T, E)")
    B = x.size(0)
    feats: dict[str, list[Tensor]] = {"q": [], "k": [], "v": []}  # per head: (B, T, D)
    for site, site2 in zip(sites, sites2, strict=True):
        for role, t, t2 in (("q", site.q, site2.q), ("k", site.k, site2.k), ("v", site.v, site2.v)):
            rows = _batch_rows(t, t2, B)
            if rows is None:
                raise Unreadable(f"the {role} groups are not read as (batch, heads)")
            n = t.size(0) // B
            per_b = t[torch.argsort(rows, stable=True)].reshape(B, n, *t.shape[1:])  # (B, n, T, D)
            feats[role] += [per_b[:, h].double() for h in range(n)]
    H = len(feats["q"])
    D = feats["q"][0].size(-1)
    if H * B < 2 * D + 8 and batch == PROBE_B:  # a position map is fitted over the probe's sequences and heads:
        return _read(
            module, call, E, seed, batch=-(-(2 * D + 8) // H) + 1, heads_first=heads_first
        )  # twice the unknowns, well conditioned
    x0 = x[:, 0].double()  # (B, E)
    bank = _Bank(probe, E)
    sources: dict[str, RowSource] = {}
    matched: dict[str, list[tuple[str, bool, int]]] = {}
    mapped: dict[str, tuple[list[Tensor], list[Tensor]]] = {}  # roles turned at position 0 too: (maps, projections)
    for role in ("q", "k", "v"):
        try:
            sources[role], matched[role] = _role_rows(probe, [f[:, 0] for f in feats[role]], x0, bank, tol)
        except Unreadable:
            sources[role], matched[role], *rest = _mapped_rows(probe, feats[role], x, bank, tol)
            mapped[role] = (rest[0], rest[1])
    Dk = sources["k"].rows
    if sources["q"].rows != H * D or Dk % D:
        raise Unreadable("head widths do not add up")
    G = Dk // D

    def predicted(role: str) -> list[Tensor]:
        """The role's features at every position if nothing but its projection made them: (B, T, D) per head."""
        rows = matched[role]
        mats = {p: bank.matrix(probe, p).detach().double() for p in dict.fromkeys(p for p, _, _ in rows)}
        W = torch.stack([(mats[p].t() if tr else mats[p])[r] for p, tr, r in rows])  # (n*D, E)
        f0 = torch.cat([f[:, 0] for f in feats[role]], dim=1)  # (B, n*D)
        lin0 = x0 @ W.t()
        c = float((f0 - f0.mean(0)).flatten() @ (lin0 - lin0.mean(0)).flatten()) / float(
            ((lin0 - lin0.mean(0)) ** 2).sum().clamp_min(1e-300)
        )
        offset = (f0 - c * lin0).mean(0)  # (n*D,): the bias, scaled
        proj = c * (x.double() @ W.t()) + offset  # (B, T, n*D)
        d = W.size(0) // len(feats[role])
        return [proj[..., h * d : (h + 1) * d] for h in range(len(feats[role]))]

    rotaries = {
        role: _heads_rotary(feats[role], mapped[role][1], mapped[role][0])
        if role in mapped
        else _fit_rotary(feats[role], predicted(role), tol)
        for role in ("q", "k", "v")
    }
    carried = tuple(r for r in ("q", "k", "v") if rotaries[r] is not None)
    rotary = rotaries["q"] or rotaries["k"] or rotaries["v"]
    out_src = _out_projection(probe, ops, {site.at for site in sites}, y, E)
    used = {p for src in (*sources.values(), out_src) if src is not None for p, _, _ in src.parts}
    unused = tuple(n for n, p in probe.named_parameters() if p.dim() >= 2 and n not in used)
    return Reading(
        embed_dim=E,
        num_heads=H,
        num_kv_heads=G,
        head_dim=D,
        q=sources["q"],
        k=sources["k"],
        v=sources["v"],
        out=out_src,
        rotary=rotary,
        rotary_roles=carried,
        rotary_on_heads=any(rotaries[r] is not None for r in mapped),
        unused=unused,
    )


def name_hint(path: str) -> str | None:
    """The role a parameter's path suggests (``linear_values.weight`` -> ``v``), or None."""
    last = re.sub(r"\.(weight|bias)$", "", path).rsplit(".", 1)[-1].lower()
    for role, words in (
        ("q", ("query", "q")),
        ("k", ("key", "k")),
        ("v", ("value", "v")),
        ("out", ("out", "o", "proj", "dense")),
    ):
        tokens = re.split(r"[_\d]+", last)
        if any(t in words or t.rstrip("s") in words for t in tokens if t):
            return role
    return None
