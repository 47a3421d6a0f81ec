"""An output gate: the merged heads multiplied, feature by feature, by a tensor computed from the input alone.

Notation: B batch, T_q query positions, H heads, D head dim.

OpenFold's (AlphaFold 2's) ``linear_o(sigmoid(linear_g(q_x)) * o)``, gated attention (Qwen3-Next's
``o * sigmoid(gate)``): whatever computes the gate, it is read by data flow. In the ops a module runs
(:func:`attnlab.check.capture.capture`), the gate is the other factor of a product whose one factor descends from
the attention weights (a softmax or a fused attention call) and whose other does not, taken where the first
factor holds the context, ``(B, T_q, H*D)`` in one of the layouts heads are kept in. :func:`find_gate` finds it;
the reference multiplies the merged heads by the module's own gate values at the queries it is given
(:meth:`OutputGate.apply` reruns the module on them and reads the factor again), before the output projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from .capture import SOFTMAX_OPS, Op, capture
from .dataflow import FUSED_OPS, descendants, tracked_args

__all__ = ["OutputGate", "find_gate"]

Layout = Literal["b_t", "b_h_t", "bh_t"]  # (B, T, H, D) or (B, T, H*D); (B, H, T, D); (B*H, T, D)
Run = Callable[[Tensor, Tensor, Tensor], object]


def _merged(x: Tensor, layout: Layout, B: int, T: int, H: int) -> Tensor:
    """``x`` in ``layout`` -> ``(B, T, H*D)``, heads side by side."""
    if layout == "b_h_t":
        return x.transpose(1, 2).reshape(B, T, -1)
    if layout == "bh_t":
        return x.reshape(B, H, T, -1).transpose(1, 2).reshape(B, T, -1)
    return x.reshape(B, T, -1)


def _layout(x: Tensor, B: int, T: int, H: int, width: int) -> Layout | None:
    """The layout ``x`` keeps the context of ``H`` heads (``width`` = H*D features) in; None: none of them."""
    if x.numel() != B * T * width:
        return None
    if x.shape[:2] == (B, T):
        return "b_t"
    if x.dim() == 4 and x.shape[:3] == (B, H, T):
        return "b_h_t"
    if x.dim() == 3 and x.shape[:2] == (B * H, T):
        return "bh_t"
    return None


def _gate_of(ops: list[Op], B: int, T: int, H: int, width: int) -> tuple[Tensor, Layout] | None:
    """The gate in ``ops``: ``(its values as (B, T, H*D), the layout the context is kept in)``, or None."""
    starts = [i for i, op in enumerate(ops) if op.func in SOFTMAX_OPS or op.func in FUSED_OPS]
    if not starts:
        return None
    attended: set[int] = set()
    for s in starts:
        attended |= descendants(ops, s)
    for i in sorted(attended):
        op = ops[i]
        args = tracked_args(op)
        if op.func not in ("mul", "mul_", "imul") or len(args) != 2:
            continue
        inside = [a for a in args if a in attended]
        outside = [a for a in args if a not in attended]
        if len(inside) != 1 or len(outside) != 1:
            continue
        ctx = ops[inside[0]].out
        g = ops[outside[0]].out if outside[0] >= 0 else None
        layout = _layout(ctx, B, T, H, width)
        if g is None or layout is None or not g.is_floating_point():
            continue
        try:
            full = torch.broadcast_to(g, ctx.shape)  # a gate per head broadcasts over its features
        except RuntimeError:
            continue
        if g.numel() < B * T:  # a factor with no row per query is no gate computed from them
            continue
        return _merged(full, layout, B, T, H), layout
    return None


@dataclass(eq=False)
class OutputGate:
    """The module's output gate, found by :func:`find_gate`: ``apply`` gives its values for given queries."""

    run: Run = field(repr=False)  # the module called as (query, key, value) -> output
    module: nn.Module = field(repr=False)
    num_heads: int
    width: int  # H*D
    layout: Layout
    _last: tuple[Tensor, Tensor] | None = field(default=None, repr=False)

    def describe(self) -> str:
        return "an output gate computed from the queries, multiplying the merged heads before the output projection"

    @torch.no_grad()
    def apply(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """The gate ``(B, T_q, H*D)`` the module multiplies the merged heads by, for these inputs, in ``query``'s
        dtype (the module runs in its own)."""
        if self._last is not None and self._last[0].shape == query.shape and torch.equal(self._last[0], query):
            return self._last[1].to(query.dtype)
        w = next(p for p in self.module.parameters() if p.is_floating_point())
        q, k, v = (t.detach().to(device=w.device, dtype=w.dtype) for t in (query, key, value))
        q = k if key is query else q  # one tensor stays one (a module that takes one context for K and V)
        v = k if value.shape == key.shape else v  # the gate reads the queries alone: K for V where it fits
        ops = capture(lambda: self.run(q, k, v), {"query": q, "key": k, "value": v}, self.module)
        B, T = query.shape[:2]
        found = _gate_of(ops, B, T, self.num_heads, self.width)
        if found is None:
            raise RuntimeError("the module's output gate was not found on these inputs")
        gate = found[0].to(device=query.device, dtype=torch.float64)
        self._last = (query.detach().clone(), gate)
        return gate.to(query.dtype)


@torch.no_grad()
def find_gate(run: Run, module: nn.Module, E: int, kdim: int, H: int, width: int) -> OutputGate | None:
    """The module's output gate (see the module docstring), found on a seeded self-attention run; None: none."""
    params = [p for p in module.parameters() if p.is_floating_point()]
    if not params:
        return None
    w = params[0]
    B, T = 2, 7
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(50)).to(w)
    kv = x if kdim == E else torch.randn(B, T, kdim, generator=torch.Generator().manual_seed(51)).to(w)
    try:
        ops = capture(lambda: run(x, kv, kv), {"query": x, "key": kv}, module)
    except Exception:
        return None
    found = _gate_of(ops, B, T, H, width)
    return None if found is None else OutputGate(run, module, H, width, found[1])
