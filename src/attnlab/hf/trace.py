"""Trace attnlab's attention inside a Hugging Face model: what each layer handed it, what ran, and how close the
result is to the float64 reference.

A model loaded with ``attn_implementation="attnlab"`` computes its projections, rotary embedding and output
projection in its own code and calls :func:`attnlab.hf.attention.attnlab_attention_forward` in between, so what
attnlab sees of a layer is that call: ``q (B, H, T_q, D)``, ``k (B, G, T_k, D)``, ``v (B, G, T_k, Dv)``, HF's
mask, the scale. :func:`trace_hf` records each such call while the block runs (``attnlab.trace(model)`` comes
here for an HF model), with the shapes read off the tensors that flowed, the backend that ran and why
(``last_backend`` / ``last_backend_reason``, as on :class:`attnlab.MultiHeadAttention`), and the same call run
again on the math reference in float64: the largest error of attnlab's output relative to the reference's
largest value, against what the layer's dtype allows.

Notation: b batch, h query heads, g key/value heads, i query positions, j key positions, d head dim.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention
from .attention import ATTENTION_NAME, OBSERVERS, ObservedCall

__all__ = ["HFAttentionCall", "HFTraceRow", "hf_attention_layers", "hf_attention_route", "trace_hf"]

# The allowed error relative to the reference's largest value: check's float32 parity bound, the reference's own
# rounding in float64; in a half dtype at least twice plain attention's error in that dtype, plus half its eps
# (the output rounded once), as flash-attention's tests allow.
FLOAT32_ALLOWED = 2e-5
FLOAT64_ALLOWED = 1e-12


@dataclass
class HFTraceRow:
    stage: str  # query, key, value, mask, scale, context, output
    shape: list[int] | None  # of the tensor at that stage (None: no tensor, e.g. no mask)
    what: str  # what the dims mean, or what the stage holds


@dataclass
class HFAttentionCall:
    """One call of attnlab's attention from one layer of a Hugging Face model."""

    module: (
        str  # the layer's name in the model, its class and index: "model.layers.0.self_attn (LlamaAttention, layer 0)"
    )
    backend: str  # the layer's last_backend after the call: "sdpa" or "math"
    reason: str | None  # its last_backend_reason: why not plain SDPA, or how SDPA was adapted
    dtype: str  # what q, k, v came in
    error: float  # max |attnlab - reference| / max |reference| over the context, reference: math in float64
    allowed: float  # what the dtype allows (FLOAT32_ALLOWED, FLOAT64_ALLOWED, or flash-attention's rule)
    rows: list[HFTraceRow] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return self.error <= self.allowed

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "agrees": self.agrees}

    def to_text(self, width: int | None = None) -> str:
        """A table, one line per stage, then the backend and the reference's verdict; ``width`` wraps the
        last two lines (``None``: no limit)."""
        body = [(str(n), r.stage, "-" if r.shape is None else str(r.shape), r.what) for n, r in enumerate(self.rows, 1)]
        head = ("#", "stage", "shape", "what")
        widths = [max(len(row[c]) for row in [head, *body]) for c in range(3)]
        line = lambda cells: "  ".join([*(c.ljust(w) for c, w in zip(cells, widths, strict=False)), cells[3]]).rstrip()
        table = [line(head), line(tuple("-" * w for w in [*widths, 4])), *(line(r) for r in body)]
        why = f" ({self.reason})" if self.reason else ""
        verdict = "agrees" if self.agrees else "DISAGREES"
        notes = [
            f"backend: {self.backend}{why}",
            f"reference: the same call on the math backend in float64: largest error {self.error:.1e} of the "
            f"output's scale, allowed {self.allowed:.0e} in {self.dtype}: {verdict}",
        ]
        wrap = (lambda s: [s]) if width is None else (lambda s: textwrap.wrap(s, width, subsequent_indent="  "))
        return "\n".join([self.module, *table, *(piece for note in notes for piece in wrap(note))])


def hf_attention_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: layer}`` of the attention layers of an HF ``model`` that call attnlab's attention: the modules
    with a ``layer_idx`` (HF's attention layers carry one) under a config set to ``attn_implementation="attnlab"``.
    Empty for a model that is not a transformers model."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return {}
    return {name: m for name, m in model.named_modules() if name and _index(m) is not None}


def _index(layer: nn.Module) -> int | None:
    """An HF attention layer's ``layer_idx`` (None: not such a layer)."""
    index = getattr(layer, "layer_idx", None)
    return index if isinstance(index, int) else None


def hf_attention_route(model: nn.Module) -> bool:
    """Whether ``attnlab.trace(model)`` traces ``model`` here: a transformers model (its config names an attention
    implementation) with no :class:`attnlab.MultiHeadAttention` inside (a layer swapped for one is traced as
    attnlab's own module)."""
    config = getattr(model, "config", None)
    return hasattr(config, "_attn_implementation") and not any(
        isinstance(m, MultiHeadAttention) for m in model.modules()
    )


def _refuse(model: nn.Module) -> ValueError:
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return ValueError(
        f"trace found no attnlab attention in {type(model).__name__}: its config runs attn_implementation="
        f"{implementation!r}, and attnlab traces the layers that call its own; switch the model first with "
        f"model.set_attn_implementation({ATTENTION_NAME!r}) (or load it with attn_implementation={ATTENTION_NAME!r})."
    )


@contextmanager
def trace_hf(model: nn.Module, layer: int | None = None) -> Iterator[list[HFAttentionCall]]:
    """Record every call of attnlab's attention from ``model``'s layers (or only from layer index ``layer``)
    while the block runs; yields the list that fills with one :class:`HFAttentionCall` per call::

        model.set_attn_implementation("attnlab")
        with attnlab.trace(model) as calls:  # or attnlab.hf.trace.trace_hf(model, layer=0)
            model(ids)
        print(calls[0].to_text())

    Each recorded call also runs once more on the math backend in float64 (and, in fp16/bf16, in its own
    dtype, for the allowed error): a tiny model's layers cost nothing, a large model's call ``T_q x T_k``
    scores more, so pass ``layer`` to trace one. The reference runs without dropout: trace a model in eval mode
    (``model.eval()``), or the error is the dropout's.

    Raises:
        ValueError: ``model`` is a transformers model that does not run attnlab's attention (the message names the
            call that switches it), or ``layer`` names no attention layer of it.
    """
    layers = hf_attention_layers(model)
    if not layers:
        raise _refuse(model)
    indices = sorted({i for m in layers.values() if (i := _index(m)) is not None})
    if layer is not None and layer not in indices:
        raise ValueError(
            f"layer={layer!r}, but {type(model).__name__}'s attention layers are numbered {indices[0]} .. "
            f"{indices[-1]}; pass one of them (0 is the first)."
        )
    names = {id(m): name for name, m in layers.items()}
    calls: list[HFAttentionCall] = []

    def observe(call: ObservedCall, rerun: Callable[[torch.dtype], Tensor]) -> None:
        name = names.get(id(call.module))
        index = _index(call.module)
        if name is None or (layer is not None and index != layer):
            return  # another model's call, or a layer not asked for
        calls.append(_record(f"{name} ({type(call.module).__name__}, layer {index})", call, rerun))

    OBSERVERS.append(observe)
    try:
        yield calls
    finally:
        OBSERVERS.remove(observe)


def _relative(ours: Tensor, ref: Tensor) -> float:
    """max |ours - ref| / max |ref| (the reference's scale; 1 where it is all zeros)."""
    scale = float(ref.abs().max()) or 1.0
    return float((ours.to(ref.dtype) - ref).abs().max()) / scale


def _record(module: str, call: ObservedCall, rerun: Callable[[torch.dtype], Tensor]) -> HFAttentionCall:
    q, k, v, context = call.query, call.key, call.value, call.context
    dtype = q.dtype
    reference = rerun(torch.float64)  # (B, H, T_q, Dv)
    error = _relative(context.detach(), reference)
    if dtype == torch.float64:
        allowed = FLOAT64_ALLOWED
    elif dtype == torch.float32:
        allowed = FLOAT32_ALLOWED
    else:  # flash-attention's rule: twice plain attention's own error in this dtype, plus one rounding
        allowed = max(FLOAT32_ALLOWED, 2 * _relative(rerun(dtype), reference) + torch.finfo(dtype).eps / 2)
    H, G = q.size(1), k.size(1)
    group = f"{G} K/V heads for {H} query heads (GQA)" if G < H else f"{G} K/V heads"
    rows = [
        HFTraceRow("query", list(q.shape), "(b, h, i, d): the layer's own, projected, positions applied"),
        HFTraceRow("key", list(k.shape), f"(b, g, j, d): {group}, cached keys included"),
        HFTraceRow("value", list(v.shape), "(b, g, j, dv)"),
        _mask_row(call),
        HFTraceRow("scale", None, f"{call.scale:.4g} on q . k (the layer's own scaling)"),
        HFTraceRow("context", list(context.shape), f"(b, h, i, dv): attnlab's attention, {str(dtype).removeprefix('torch.')}"),
        HFTraceRow("output", [context.size(0), context.size(2), H, context.size(3)], "(b, i, h, dv): handed back; the layer merges heads, projects"),
    ]  # fmt: skip
    return HFAttentionCall(module, call.backend, call.reason, str(dtype).removeprefix("torch."), error, allowed, rows)


def _mask_row(call: ObservedCall) -> HFTraceRow:
    mask = call.attention_mask
    if mask is None:
        what = "none handed: causal, attnlab's own" if call.masks.causal else "none handed, none applied"
        return HFTraceRow("mask", None, what)
    kind = "bool, True = may attend (HF's sdpa_mask)" if mask.dtype == torch.bool else "float, added to the scores"
    if mask.dtype == torch.bool:
        blocked = int((~mask).sum())
        kind += f"; {blocked} of {mask.numel()} entries blocked"
    return HFTraceRow("mask", list(mask.shape), f"(b, 1, i, j) {kind}")
