"""A module's score map: what it does to its scaled scores before the softmax, read off its own ops and replayed.

Notation: B batch, H heads, T_q/T_k query/key positions.

Some attention changes the scores between ``Q K^T * scale`` and the softmax on purpose: a bias set by the positions
alone (ALiBi, T5's bucketed table, Swin's relative table, any learned per-head table) and soft-capping
``c * tanh(s / c)`` (Gemma-2, Grok). :func:`read_score_map` runs the module on two inputs under
:func:`attnlab.check.capture.capture` and reads the tensor its first softmax takes, ``S``. Where a ``tanh`` of the
scores' shape comes before it, ``S = c * tanh(..) + b``; else ``S = a * (the reference's scaled scores) + b``. A
scalar (``c`` or ``a``) is fitted over both inputs, and what is left, ``b``, must be the same for both: a bias set by
the positions, not the values. ``a`` is the module's own scale and stays its business (a wrong scale stays a
mistake); ``c`` and ``b`` make the :class:`ScoreMap` the reference applies too (:mod:`attnlab.check.recipe`).

One map is itself judged: a bias linear in the distance between query and key (ALiBi-style) that *rises* with it
rewards the farthest keys, ALiBi's slopes with the wrong sign. The reference then applies it negated, and the
catalogue's ``alibi_slope_sign`` recipe the module's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .capture import Op, _layouts

__all__ = ["ScoreMap", "read_score_map"]

FIT_TOL = 1e-5  # relative to the scores: a float32 module's bias is off by ~1e-7; an input-dependent one by > 1e-2
_SOFTMAXES = ("softmax", "_softmax", "softmax_", "log_softmax")
GAINS = (1.0, 4.0)  # the inputs' loudness: the second makes large scores, so that a cap bites

# one run at lengths (T_q, T_k) on an input of this loudness, each (1, H, T_q, T_k): S, the tanh's input and output
# before it (None: no tanh), the reference's scaled scores, where the reference's masks let through
Sample = tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor]
Run = Callable[[int, int, float], Sample]
Biases = tuple[Tensor, Tensor]  # (H, T_q, T_k) each: added before the cap, after it (zero: none)


def _rest(Y: Tensor, X: Tensor, valid: Tensor, tol: float, strict: bool) -> tuple[float, Tensor] | None:
    """``(a, b)`` with ``Y = a X + b`` on every sample (N, H, T_q, T_k), ``b`` (H, T_q, T_k) the same for all
    (zero where not ``valid``, or where it is rounding); None when no such ``b`` exists (``strict``)."""
    dY, dX = (Y - Y.mean(0))[:, valid], (X - X.mean(0))[:, valid]
    a = float((dY * dX).sum() / (dX * dX).sum().clamp_min(1e-300))
    top = float(Y[:, valid].abs().max().clamp_min(1e-12))
    if strict and float((dY - a * dX).abs().max()) > tol * top:
        return None
    b = torch.where(valid, (Y - a * X).mean(0), 0.0)
    return a, (b if float(b.abs().max()) > tol * top else torch.zeros_like(b))


def _fit(samples: list[Sample], strict: bool = True) -> tuple[float | None, Biases] | None:
    """``(cap or None, biases)`` that make each sample's ``S`` out of the reference's scaled scores (times the
    module's own factor), or None: what is left depends on the input. Not ``strict``: the map is known, and only its
    bias at new lengths is read (where rounding grows with the positions, rotary's in float32 at 1024)."""
    cat = lambda n: torch.cat([s[n] for s in samples]).double()  # type: ignore[misc]
    tol = max(FIT_TOL, 16 * torch.finfo(samples[0][0].dtype).eps)  # a half-precision copy reads its map coarser
    S, R = cat(0), cat(3)  # (N, H, T_q, T_k)
    keep = torch.cat([s[4] for s in samples])
    valid = (keep & torch.isfinite(S) & (S > -1e4)).all(0)  # (H, T_q, T_k): where no mask reaches
    if int(valid.sum()) < 2:
        return None
    if not all(s[1] is not None for s in samples):
        found = _rest(S, R, valid, tol, strict)
        return None if found is None else (None, (found[1], torch.zeros_like(found[1])))
    outer = _rest(S, cat(2), valid, tol, strict)  # S = c tanh(u) + b_out
    if outer is None or outer[0] <= 0:
        return None
    inner = _rest(
        outer[0] * cat(1), R, valid, tol, strict
    )  # c u = a R + b_in: a, the module's scale, stays its business
    return None if inner is None else (outer[0], (inner[1], outer[1]))


def _alibi_slopes(bias: Tensor) -> Tensor | None:
    """Per head, the slope of ``bias`` (H, T_q, T_k) against -|i - j| (positive: farther keys lose), each row's
    constant aside; None unless the bias is exactly that line (ALiBi-style), with one slope nonzero."""
    _, T_q, T_k = bias.shape
    if T_q < 3:
        return None
    i, j = torch.arange(T_q)[:, None], torch.arange(T_k)[None, :]
    near = -(i + T_k - T_q - j).abs().to(bias).expand_as(bias)  # bottom-right aligned, as causal masks are
    seen = bias != 0
    n = seen.sum(-1, keepdim=True).clamp_min(1)
    centre = lambda t: torch.where(seen, t - (t * seen).sum(-1, keepdim=True) / n, 0.0)
    b, d = centre(bias), centre(near)
    slopes = (b * d).sum((1, 2)) / (d * d).sum((1, 2)).clamp_min(1e-300)  # (H,)
    line = float((b - slopes[:, None, None] * d).abs().max()) <= 1e-4 * float(b.abs().max().clamp_min(1e-12))
    return slopes if line and float(slopes.abs().max()) > 1e-6 else None


@dataclass
class ScoreMap:
    """A bias by position, a soft-cap ``c * tanh(s / c)`` (``cap``; None: none), a bias by position again: what
    the module does to its scaled scores, the reference's biases read per length (``run``) and kept in ``biases``.
    ``negated``: the module's bias rises with distance, and the reference's is its negation (module docstring)."""

    run: Run
    cap: float | None
    slopes: Tensor | None = None  # ALiBi-style: the reference's slope per head against -distance
    negated: bool = False
    biases: dict[tuple[int, int], Biases] = field(default_factory=dict)

    @property
    def positional(self) -> bool:
        """Whether the map biases the scores by position (a soft-cap alone does not)."""
        return any(bool(b.any()) for pair in self.biases.values() for b in pair)

    def bias(self, T_q: int, T_k: int, device: torch.device) -> Biases:
        """The reference's biases ``(H, T_q, T_k)`` at these lengths, before and after the cap, float64."""
        if (T_q, T_k) not in self.biases and not self.positional:  # a soft-cap alone: nothing to read
            return torch.zeros(1, device=device), torch.zeros(1, device=device)
        if (T_q, T_k) not in self.biases:
            found = _fit([self.run(T_q, T_k, gain) for gain in GAINS], strict=False)
            if found is None:
                raise RuntimeError(f"the score map read at length {T_q}x{T_k} is not the one read before")
            self.biases[T_q, T_k] = self._held(found[1])
        b_in, b_out = self.biases[T_q, T_k]
        return b_in.to(device), b_out.to(device)

    def _held(self, found: Biases) -> Biases:
        return (-found[0].cpu(), -found[1].cpu()) if self.negated else (found[0].cpu(), found[1].cpu())

    def apply(self, s: Tensor, *, negated: bool = False) -> Tensor:
        """Scaled scores ``s`` ``(B, H, T_q, T_k)`` through the map; ``negated``: with the biases negated (the
        ``alibi_slope_sign`` recipe)."""
        sign = -1.0 if negated else 1.0
        b_in, b_out = self.bias(s.size(-2), s.size(-1), s.device)
        s = s + sign * b_in.to(s.dtype)
        if self.cap is not None:
            s = self.cap * torch.tanh(s / self.cap)
        return s + sign * b_out.to(s.dtype)

    def describe(self) -> str:
        parts = []
        if self.slopes is not None:
            said = ", ".join(f"{float(x):.4g}" for x in self.slopes)
            rises = ", rising with distance: the reference's falls, with these slopes" if self.negated else ""
            parts.append(f"an ALiBi-style bias (slopes {said} per key of distance{rises})")
        elif self.positional:
            parts.append("a bias set by the positions alone (the same for any input)")
        if self.cap is not None:
            parts.append(f"a soft-cap c * tanh(s / c) with c = {self.cap:.4g}")
        same = "otherwise the same" if self.negated else "the same"
        return f"scores pass through {' and '.join(parts)}: the reference applies {same}"


def read_score_map(run: Run, T: int) -> ScoreMap | None:
    """The map the scores pass through, read at length ``T`` on two inputs (see the module docstring); None
    where the module's softmax takes the reference's scaled scores times a factor, or a map this cannot read."""
    try:
        found = _fit([run(T, T, gain) for gain in GAINS])
    except Exception:  # no softmax of the scores' shape, a module that needs masks: nothing read, nothing replayed
        return None
    if found is None or (found[0] is None and not bool(found[1][0].any())):
        return None
    cap, (b_in, b_out) = found
    slopes = _alibi_slopes(b_in + b_out)
    negated = slopes is not None and bool((slopes <= 1e-6).all())
    m = ScoreMap(run, cap, None if slopes is None else slopes.abs(), negated)
    m.biases[T, T] = m._held((b_in, b_out))
    return m


def scores_of(ops: list[Op], want: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """The tensor the first softmax in ``ops`` takes, and the input and output of the last ``tanh`` of the scores'
    shape before it (None: none), each in ``want``'s layout (B, H, T_q, T_k); None when no softmax takes a tensor
    of that shape."""
    at = next((n for n, o in enumerate(ops) if o.func in _SOFTMAXES), None)
    src = None if at is None else _source(ops, ops[at])
    S = None if src is None else _as(src.out, want)
    if at is None or S is None:
        return None
    tanh = next((o for o in reversed(ops[:at]) if o.func == "tanh" and _as(o.out, want) is not None), None)
    pre = None if tanh is None else _source(ops, tanh)
    if tanh is None or pre is None:
        return S, None, None
    return S, _as(pre.out, want), _as(tanh.out, want)


def _source(ops: list[Op], op: Op) -> Op | None:
    """The op that made ``op``'s first argument (None: an input, or no tensor of the data path)."""
    first = op.args[0] if op.args else None
    return ops[first] if isinstance(first, int) and first >= 0 else None


def _as(t: Tensor, want: Tensor) -> Tensor | None:
    """``t`` in ``want``'s layout (B, H, T_q, T_k): one of :func:`attnlab.check.capture._layouts`, or the query heads
    grouped under their K/V head, (B, G, H/G, T_q, T_k) (Grok's one einsum for all groups)."""
    found = next((c for c in _layouts(t, want) if c.shape == want.shape), None)
    grouped = t.dim() == 5 and t.shape[0] == want.shape[0] and t.shape[-2:] == want.shape[-2:]
    if found is None and grouped and t.shape[1] * t.shape[2] == want.shape[1]:
        return t.reshape(want.shape)
    return found
