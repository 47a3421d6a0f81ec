"""Trace the data flow through attention as it actually happens: every stage, its real shape.

``with attnlab.trace(model) as t: model(x)`` records, for every
:class:`attnlab.MultiHeadAttention` inside ``model`` (or ``model`` itself), each tensor
operation on the data path — projections, the ``view`` into heads, ``transpose``, scores,
mask, softmax, dropout, weighted sum, merge, output projection — with the shape of the tensor
it produced and whether that tensor is a zero-copy view or new memory. Shapes are read off the
tensors that flowed (a ``TorchFunctionMode`` sees each op), never computed from a formula.

Only ops whose inputs descend from the module's query/key/value are recorded, so mask
bookkeeping stays out of the table. ``attnlab trace --model smollm2 --layer N`` traces one layer
of a real model as the model calls it: its weights, its widths, the rotary embedding it applies. On the ``"sdpa"`` backend the scores, softmax and
weighted sum happen inside one fused kernel and appear as a single row.

``attnlab trace --target mine.py:Name`` (or :func:`trace_module` on a module) traces any hand-written
attention module instead: every op it runs on its inputs (:func:`attnlab.check.capture.capture`), each
result named after the reference stage its value equals (:mod:`attnlab.check.recipe`), and the first
stage it never produces marked where it should have been. A module that raises shows the ops up to the
failing one and the exception, with the line of its file that raised.
"""

from __future__ import annotations

import inspect
import json as _json
import re
import shutil
import textwrap
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..check import dataflow as flow
from ..check.adapters import AttentionAdapter, Unsupported
from ..check.capture import (
    DOWNSTREAM,
    FUSED,
    MATCH_TOL,
    Op,
    capture_until_error,
    departure_hint,
    match_stages,
    stage_error,
)
from ..check.cli import model_flag_conflicts, model_layer, say_layer_weights
from ..check.mla import MLAAdapter
from ..check.probe import ProbedAdapter, as_adapter
from ..check.recipe import STAGES, stages_of
from ..check.target import build_target
from ..core.attention import Backend, MultiHeadAttention
from ..hf.trace import hf_attention_route, trace_hf
from ..runtime import UsageError, check_range
from .trace_mla import trace_mla_command
from .trace_rows import AttentionTrace, TraceRow, aligned

__all__ = ["TraceRow", "AttentionTrace", "trace", "TargetRow", "Departure", "Raised", "TargetTrace", "trace_module"]


# What each recognised op means: stage, axes of its output. Scores and weights use the seed's
# reading: scores[b][h][i][j] is query i against key j.
_AXES = {
    "input": "(b, t, e): batch, position, features",
    "proj": "(b, t, features of all heads)",
    "view_heads": "(b, t, h, d): features cut into h heads of d",
    "heads_first": "(b, h, t, d): heads become a batch dim",
    "repeat_kv": "(b, h, t, d): K/V head g shared by its query group",
    "kT": "(b, h, d, j)",
    "scores": "scores[b][h][i][j] = query i . key j",
    "weights": "weights[b][h][i] = distribution over keys j",
    "context": "context[b][h][i] = weighted mix of values",
    "heads_back": "(b, i, h, d)",
    "merge": "(b, i, h*d = e)",
    "out": "(b, i, e)",
}


class _Recorder(TorchFunctionMode):
    """Records the ops on the data path of one attention call and names what they produce."""

    def __init__(self, trace_: AttentionTrace, m: MultiHeadAttention, inputs: dict[str, Tensor]) -> None:
        super().__init__()
        self.trace, self.m = trace_, m
        self.names: dict[int, str] = {}
        self.keep_alive: list[Tensor] = []  # ids stay unique while we hold the tensors
        self.linears = 0
        self.core_done = False  # the weighted sum has happened: later transposes merge heads
        self.rope_seen = False  # Q or K was split in halves: the module applies rotary embeddings
        self.softcap_seen = False  # tanh ran on the scores: the next multiply is the cap's
        for name, t in inputs.items():
            self._track(t, name)
            self.trace.rows.append(TraceRow("input", name, list(t.shape), _AXES["input"], "input"))

    def _track(self, t: Tensor, name: str) -> None:
        self.names[id(t)] = name
        self.keep_alive.append(t)

    def _name(self, a: object) -> str:
        if isinstance(a, Tensor):  # untracked tensors are weights, biases or masks
            fallback = "mask" if a.dtype == torch.bool else {2: "W", 1: "b"}.get(a.dim(), "t")
            return self.names.get(id(a), fallback)
        if isinstance(a, float):
            return f"{a:.4g}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(self._name(b) for b in a) + "]"
        return repr(a)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat = [b for a in args for b in (a if isinstance(a, (list, tuple)) else (a,))]  # cat takes a list
        tracked = [a for a in flat if isinstance(a, Tensor) and id(a) in self.names]
        outs = out if isinstance(out, tuple) else (out,)
        if not tracked or not all(isinstance(o, Tensor) for o in outs) or out is tracked[0]:
            return out  # not on the data path, not a tensor op, or a no-op (e.g. .to(same dtype))
        src = tracked[0]
        fname = getattr(func, "__name__", str(func))
        stage, name, axes = self._label(fname, src, args, outs)
        call = f"{fname}({', '.join(self._name(a) for a in args)}{''.join(f', {k}={self._name(v)}' for k, v in kwargs.items())})"
        shares = (
            out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() if isinstance(out, Tensor) else True
        )
        shape = [list(o.shape) for o in outs] if isinstance(out, tuple) else list(out.shape)
        names = name.split(",")
        for i, o in enumerate(outs):
            self._track(o, names[min(i, len(names) - 1)])
        self.trace.rows.append(TraceRow(stage, f"{name} = {call}", shape, axes, "view" if shares else "new"))
        return out

    def _rope_label(self, fname: str) -> tuple[str, str] | None:
        """(stage, axes) of a step of rotary embedding on Q or K (:func:`attnlab.core.rope.apply_rope`:
        ``x * cos + cat(-x2, x1) * sin``); the ``cat`` takes a tuple, so it shows in the ``add``."""
        if fname == "chunk":
            self.rope_seen = True
            return "RoPE: halves x1, x2", "(b, h, t, d/2) each"
        if not self.rope_seen:
            return None
        if fname == "neg":
            return "RoPE: -x2", "(b, h, t, d/2)"
        if fname == "mul":
            return "RoPE: x * cos", "(b, h, t, d): cos of each position's angle"
        return "RoPE: + cat(-x2, x1) * sin", "(b, h, t, d): each channel pair rotated by position"

    def _label(self, fname: str, src: Tensor, args: tuple, outs: tuple) -> tuple[str, str, str]:
        """(stage, name of the result, axes) for one recorded op."""
        srcname = self.names[id(src)]
        m = self.m
        if fname == "linear":
            self.linears += 1
            if self.core_done:
                return "output projection", "out", _AXES["out"]
            which = {1: "q", 2: "k", 3: "v"}[min(self.linears, 3)]
            return f"{which.upper()} projection", which, _AXES["proj"]
        if fname == "view" and outs[0].dim() == 4:
            return "split heads (view)", srcname, _AXES["view_heads"]
        if fname == "transpose" and not self.core_done and tuple(args[1:]) == (1, 2):
            return "heads to dim 1 (transpose)", srcname, _AXES["heads_first"]
        if fname == "masked_fill" and srcname in ("k", "v"):
            return "zero padded keys/values (no NaN via 0 weights)", srcname, "(b, g, j, d): padded j set to 0"
        if fname == "to" and not self.core_done:
            return f"to {str(outs[0].dtype).removeprefix('torch.')} (accumulate)", srcname, "same axes, wider dtype"
        if fname == "to" and self.core_done:
            return f"back to {str(outs[0].dtype).removeprefix('torch.')}", srcname, "same axes"
        if not self.core_done and srcname in ("q", "k") and fname in ("chunk", "neg", "mul", "add"):
            rope = self._rope_label(fname)
            if rope is not None:
                return rope[0], srcname, rope[1]
        if fname == "repeat_interleave":
            return "GQA: repeat K/V heads", srcname, _AXES["repeat_kv"]
        if fname == "transpose" and tuple(args[1:]) == (-2, -1):
            return "K^T (transpose)", f"{srcname}T", _AXES["kT"]
        if fname == "matmul" and not self.core_done and srcname.startswith("q"):
            return "scores = Q K^T", "scores", _AXES["scores"]
        if fname in ("div", "__truediv__") and srcname == "scores" and m.softcap is not None:
            return f"softcap: scores / {m.softcap:g}", "scores", _AXES["scores"]
        if fname == "tanh" and srcname == "scores":
            self.softcap_seen = True
            return "softcap: tanh", "scores", _AXES["scores"]
        if fname in ("mul", "__rmul__") and srcname == "scores" and self.softcap_seen:
            self.softcap_seen = False
            return f"softcap: {m.softcap:g} * tanh(scores / {m.softcap:g})", "scores", _AXES["scores"]
        if fname == "mul" and srcname == "scores":
            return f"scale by 1/sqrt(d) = {m.scale:.4g}", "scores", _AXES["scores"]
        if fname == "add" and srcname == "scores":
            what = "ALiBi bias -m_h |i - j|" if m.alibi_slopes is not None else "float mask"
            return f"add {what}", "scores", _AXES["scores"]
        if fname == "masked_fill" and srcname == "scores":
            what = f": causal + window {m.window}" if m.window is not None else ""
            return f"mask{what} (before softmax)", "scores", _AXES["scores"]
        if fname == "cat" and srcname == "scores":
            return "sinks: append each head's sink logit", "scores", "(b, h, i, j + 1): the sink is one more 'key'"
        if fname == "__getitem__" and srcname == "weights" and m.sinks is not None:
            return "sinks: drop the sink's share", "weights", "(b, h, i, j): rows sum to < 1"
        if fname == "softmax":
            return "softmax over keys", "weights", _AXES["weights"]
        if fname == "masked_fill" and srcname == "weights":
            return "zero fully-masked rows", "weights", _AXES["weights"]
        if fname == "dropout":
            return "dropout on weights", "weights", _AXES["weights"]
        if fname == "matmul" and srcname == "weights":
            self.core_done = True
            return "weighted sum = weights V", "context", _AXES["context"]
        if fname == "scaled_dot_product_attention":
            self.core_done = True
            return "fused SDPA (scores..weighted sum)", "context", _AXES["context"]
        if fname == "masked_fill" and srcname == "context":
            return "zero fully-masked rows", "context", _AXES["context"]
        if fname == "transpose" and self.core_done:
            return "heads back (transpose)", "context", _AXES["heads_back"]
        if fname == "contiguous":
            return "contiguous (copy for view)", "context", _AXES["heads_back"]
        if fname == "view" and self.core_done:
            return "merge heads (view)", "context", _AXES["merge"]
        return fname, srcname, ""


@contextmanager
def trace(model: nn.Module) -> Iterator[list[AttentionTrace]]:
    """Record every call of every :class:`MultiHeadAttention` in ``model`` while the block runs.

    Yields a list that fills with one :class:`AttentionTrace` per call::

        with attnlab.trace(model) as calls:
            model(x)
        print(calls[0].to_text())

    A Hugging Face model running ``attn_implementation="attnlab"`` is traced by :func:`attnlab.hf.trace.trace_hf`:
    one :class:`attnlab.hf.trace.HFAttentionCall` per layer's call, beside the float64 reference.
    """
    if hf_attention_route(model):  # a transformers model with no attnlab module in it: its layers' attnlab calls
        with trace_hf(model) as hf_calls:
            yield cast(list[AttentionTrace], hf_calls)  # HFAttentionCall: the same to_text() and to_dict()
        return
    calls: list[AttentionTrace] = []
    active: list[_Recorder] = []
    handles = []

    def before(mod: MultiHeadAttention, args: tuple, kwargs: dict) -> None:
        q = args[0] if args else kwargs["query"]
        k = args[1] if len(args) > 1 else kwargs.get("key")
        v = args[2] if len(args) > 2 else kwargs.get("value")
        inputs = {"query": q}
        if k is not None and k is not q:
            inputs["key"] = k
        if v is not None and v is not k and v is not q:
            inputs["value"] = v
        name = next((n for n, sub in model.named_modules() if sub is mod), "") or type(mod).__name__
        call = AttentionTrace(module=name)
        calls.append(call)
        rec = _Recorder(call, mod, inputs)
        rec.__enter__()
        active.append(rec)

    def after(mod: MultiHeadAttention, args: tuple, kwargs: dict, out: object) -> None:
        rec = active.pop()
        rec.__exit__(None, None, None)
        rec.trace.backend = mod.last_backend

    for sub in model.modules():
        if isinstance(sub, MultiHeadAttention):
            handles.append(sub.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(sub.register_forward_hook(after, with_kwargs=True))
    if not handles:
        raise ValueError(
            f"trace(model) found no attnlab.MultiHeadAttention inside {type(model).__name__}; "
            f"pass the module (or a model containing it) whose attention you want to see."
        )
    try:
        yield calls
    finally:
        while active:  # the forward raised: leave no recorder installed
            active.pop().__exit__(None, None, None)
        for h in handles:
            h.remove()


def traces_to_json(calls: list[AttentionTrace]) -> str:
    return _json.dumps([c.to_dict() for c in calls], indent=2)


# -- --target: a hand-written module, op by op, against the reference's stages ---------------------------

# What an op's result is called in later rows: the reference stage it equals, in the seed's words.
_SHOWN = {"q_heads": "q", "k_heads": "k", "v_heads": "v", "scaled": "scores", "masked": "scores"}


@dataclass
class TargetRow:
    """One op the module ran on its inputs."""

    index: int  # 1-based, as printed and as the departure names it
    name: str  # what its result is called in later rows: its stage's name, else t<index>
    operation: str  # "q = linear(x, q_proj.weight, q_proj.bias)"
    func: str
    shape: list[int]
    dtype: str
    memory: str  # "view" (shares its input's storage) or "new"
    stage: str | None  # the reference stage its value equals, in any layout of it; None: none
    reference_shape: list[int] | None  # that stage's shape in the reference: (B, H, T, D) for heads

    def reference(self) -> str:
        return f"{self.stage} {self.reference_shape}" if self.stage else ""


@dataclass
class Departure:
    """The first reference stage that the module never produces."""

    stage: str
    reference_shape: list[int]
    op: int | None  # the row that should have produced it: the first after the last match whose shape fits
    op_func: str | None
    op_shape: list[int] | None
    hint: str = ""  # what is off about that op's tensor (attnlab.check.capture.departure_hint)

    def text(self) -> str:
        where = (
            f"op #{self.op} ({self.op_func}, shape {self.op_shape}) is where it should be"
            if self.op is not None
            else "no op after the last matching one has its shape"
        )
        hint = f"; {self.hint}" if self.hint and self.op is not None else ""
        return (
            f">> first departure: the reference's {self.stage} {self.reference_shape} is never produced; {where}{hint}"
        )


@dataclass
class Raised:
    """The exception the module raised during the trace."""

    type: str
    message: str
    where: str  # the line of the module's file that raised, "mine.py:63"; "" when the traceback has none
    source: str  # that line's code

    def text(self) -> str:
        return f">> raised {self.type}: {self.message}"


@dataclass
class TargetTrace:
    """One call of a hand-written attention module, each op it ran matched with the reference's stages."""

    module: str  # its name (on the command line, the --target spec)
    call: str  # how it was called: forward(query, key, value, attn_mask, ...)
    mask: str  # what its mask means to it, as probed
    inputs: dict[str, list[int]]  # the inputs as the rows name them -> shape
    masks: list[str]  # this call's masks: "is_causal", "key_padding_mask [2, 10]", ...
    training: bool  # train mode: dropout acts, and the stages after it cannot match the reference
    reference: dict[str, list[int]]  # every reference stage's shape
    rows: list[TargetRow] = field(default_factory=list)
    matched: list[str] = field(default_factory=list)  # the reference stages some op reproduced, in order
    departure: Departure | None = None
    error: Raised | None = None
    weights: str = ""  # where the probe found the projections ("" when the adapter says nothing)
    also: str = ""  # the calls traced besides this one, which reproduced every stage too

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self, width: int | None = None) -> str:
        """A table (what ``attnlab trace --target`` prints), one line per op, the departure marked where it is.

        Args:
            width: the columns the table may use (``None``: no limit). When one line per op does not fit,
                each op takes two: number, shape, memory and reference; then, indented, the operation.
        """
        wrap = lambda text, indent: textwrap.wrap(text, width, subsequent_indent=indent) if width else [text]
        names = list(self.inputs)
        mode = "train mode (dropout acts: the stages after it differ)" if self.training else "eval mode"
        if len(names) == 1:
            given = f"{names[0]} {self.inputs[names[0]]} as query, key and value"
        else:
            given = ", ".join(f"{n} {s}" for n, s in self.inputs.items())
            given += " as key and value" if len(names) == 2 else ""
        title = [
            *wrap(self.module, "    "),
            *wrap(f"  called as {self.call}", "    "),
            *wrap(f"  its mask: {self.mask}", "    "),
            *(wrap(f"  weights: {self.weights}", "    ") if self.weights else []),
            *wrap(f"  inputs: {given}; masks: {', '.join(self.masks) or 'none'}; {mode}", "    "),
        ]
        body = [(str(r.index), r.operation, str(r.shape), r.memory, r.reference()) for r in self.rows]
        wide = aligned(("#", "operation", "shape", "memory", "reference"), body)
        if width is None or max(len(line) for line in wide) <= width:
            head, blocks = wide[:2], [[line] for line in wide[2:]]
        else:
            short = aligned(("#", "shape", "memory", "reference"), [(b[0], b[2], b[3], b[4]) for b in body])
            head = [short[0], "    operation", short[1]]
            blocks = [
                [line, *wrap(f"    {op}", "      ")] for line, (_, op, _, _, _) in zip(short[2:], body, strict=True)
            ]
        tail: list[str] = []
        if self.departure is not None:
            marker = wrap(self.departure.text(), "   ")
            (blocks[self.departure.op - 1] if self.departure.op is not None else tail).extend(marker)
            tail += wrap(f"reference stages reproduced: {', '.join(self.matched) or 'none'}", "  ")
        elif self.error is not None:
            tail += wrap(self.error.text(), "   ")
            if self.error.where:
                tail += [f"   at {self.error.where}:", *wrap(f"      {self.error.source}", "        ")]
        else:
            skipped = [s for s in STAGES if s not in self.matched and (s != "masked" or self.masks)]
            note = f"; not seen on their own: {', '.join(skipped)} (folded into a neighbouring step)" if skipped else ""
            also = f"; {self.also}" if self.also else ""
            tail += wrap(f"every reference stage was reproduced: {', '.join(self.matched)}{note}{also}", "  ")
        return "\n".join([*title, *head, *(line for block in blocks for line in block), *tail])


def _input_names(query: Tensor, key: Tensor, value: Tensor) -> dict[str, Tensor]:
    """The inputs as the rows name them: ``x`` for self-attention, ``context`` for one K/V source."""
    if key is query and value is query:
        return {"x": query}
    if value is key:
        return {"query": query, "context": key}
    return {"query": query, "key": key, "value": value}


def _arg_text(a: int | str, rows: list[TargetRow], inputs: list[str]) -> str:
    if isinstance(a, int) and a < 0:
        return inputs[-1 - a] if -1 - a < len(inputs) else "input"
    if isinstance(a, int):
        return rows[a].name
    return a


def _raised(error: Exception, module: nn.Module | None) -> Raised:
    """The exception in one line, with the line of the module's file that raised it."""
    where = code = ""
    try:
        source = inspect.getsourcefile(type(module)) if module is not None else None
    except TypeError:  # a class defined in C or at the prompt
        source = None
    if source is not None:
        path = Path(source).resolve()
        mine = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).resolve() == path]
        if mine:
            where, code = f"{path.name}:{mine[-1].lineno}", (mine[-1].line or "").strip()
    return Raised(type(error).__name__, " ".join(str(error).split()), where, code)


@torch.no_grad()
def trace_module(
    target: nn.Module | AttentionAdapter,
    query: Tensor,
    key: Tensor | None = None,
    value: Tensor | None = None,
    *,
    keep_mask: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    is_causal: bool = False,
    name: str | None = None,
    exercise: bool = True,
) -> TargetTrace:
    """Run ``target`` once; record every op it runs on its inputs and match each with the reference's stages.

    Args:
        target: any attention ``nn.Module`` (its weights and call form are read off it, see
            :class:`attnlab.check.probe.ProbedAdapter`) or an adapter.
        query: ``(B, T_q, E)``.
        key, value: ``(B, T_k, E)``; ``key`` defaults to ``query`` (self-attention), ``value`` to ``key``.
        keep_mask: bool ``(T_q, T_k)`` or ``(B, T_q, T_k)``, True = may attend; handed to the module in its
            own mask form.
        key_padding_mask: bool ``(B, T_k)``, True = padding.
        is_causal: causal masking, aligned bottom-right.
        name: the title (default: the module's class name).
        exercise: when no mask is given and the call reproduces every stage, trace it again with what the
            module's forward also takes (:func:`_own_masks`: key padding, and causal where it takes a flag;
            for self-attention, a separate context where it takes one, then those masks without it), so that a
            mistake in how it masks or where it reads K and V from shows; the first call that departs is
            returned, else the first one with a note (``also``). False: the call as given only.

    The module runs as it is (train or eval mode untouched), under ``no_grad``. An exception from it is
    kept in ``error`` with the ops before it; :class:`~attnlab.check.adapters.Unsupported` (the module
    cannot take these inputs or masks at all) propagates. Masks the trace added itself are dropped again
    when the module cannot take them or raises with them.

    Each op's value is compared with the reference's stages in the layouts people use; where the module's
    layout is its own (an einsum's ``(T_q, T_k, B, H)``, heads folded into the batch), the attention's
    data flow places it (:func:`_flow_stages`): what meets in the score product, what reaches the softmax,
    what the weights multiply.
    """
    key = query if key is None else key
    value = key if value is None else value
    adapter, note = _reheaded(as_adapter(target), query, key, value)
    traced = _trace_module(adapter, query, key, value, keep_mask, key_padding_mask, is_causal, name, exercise, target)
    traced.weights += note if traced.weights else note.removeprefix("; ")
    return traced


def _trace_module(
    adapter: AttentionAdapter,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    keep_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    name: str | None,
    exercise: bool,
    target: object,
) -> TargetTrace:
    """:func:`trace_module` on an adapter."""
    given: dict[str, Any] = {"keep_mask": keep_mask, "key_padding_mask": key_padding_mask, "is_causal": is_causal}
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    title = name or getattr(adapter, "name", None) or type(target).__name__
    first = _trace_call(adapter, title, query, key, value, given, {})
    if not exercise or given or first.departure is not None or first.error is not None:
        return first
    # the call as asked reproduces every stage: again with what forward also takes, where a mistake may hide
    added = _own_masks(adapter, query, key)
    context = _own_context(adapter, query, key, value)
    # with a context and without: a module may hand key padding to another argument in cross-attention (one that
    # folds it into the attention mask) than in self-attention, and a mistake in either shows only in its call
    tries = [(context, added)] + ([(None, added)] if context is not None and added else [])
    if getattr(adapter, "causal_unless_masked", False):  # causal by itself when handed no mask: its own mask first
        tries.insert(0, (None, {"is_causal": True}))
    reproduced: list[str] = []
    for ctx, masks in tries:
        if ctx is None and not masks:
            continue
        try:
            fuller = _trace_call(adapter, title, query, *(ctx, ctx) if ctx is not None else (key, value), {}, masks)
        except Unsupported:
            continue
        if fuller.error is not None:
            continue
        if fuller.departure is not None:
            return fuller
        what = [_added_text(masks)] if masks else []
        what += ["a separate context as key and value"] if ctx is not None else []
        reproduced.append("the same masks in self-attention" if reproduced else " and ".join(what))
    values = _own_values(adapter, context)
    if values is not None:  # key and value apart: a module that reads its values from the key shows only so
        try:
            apart: TargetTrace | None = _trace_call(adapter, title, query, cast(Tensor, context), values, {}, {})
        except Unsupported:
            apart = None
        if apart is not None and apart.error is None:
            if apart.departure is not None:
                return apart
            reproduced.append("the context as key and another tensor as value")
    if reproduced:
        first.also = f"traced again with {', and with '.join(reproduced)}: every stage reproduced too"
    return first


def _trace_call(
    adapter: AttentionAdapter,
    title: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    given: dict[str, Any],
    added: dict[str, Any],
) -> TargetTrace:
    """One call of the module with the masks ``given`` and ``added`` (by the trace), traced and matched."""
    inputs = _input_names(query, key, value)
    # An always-causal module (nanoGPT's forward(x)) masks the future by itself: the reference's stages too.
    always = {"is_causal": True} if getattr(adapter, "always_causal", False) else {}
    module = getattr(adapter, "module", None)
    module = module if isinstance(module, nn.Module) else None
    masks = {**given, **added, **always}
    with _in_convention(adapter):
        ops, error = capture_until_error(lambda: adapter(query, key, value, **masks), inputs, module)
    if isinstance(error, Unsupported):
        raise error

    def reference(**given: Any) -> dict[str, Tensor]:
        return stages_of(adapter, query, key, value, **given)

    stages = reference(**masks)
    given_inputs = list(inputs.values())
    sites = _flow_sites(ops, given_inputs)
    verdicts = _label(ops, stages, sites, given_inputs, masked=bool(masks))
    causal_inside = False
    if error is None and not masks and _may_mask_itself(adapter):
        # forward takes no mask, yet the module was not found causal by experiment (a mistake after the
        # attention, such as a merge without transpose, mixes positions): follow the causal reference when
        # the module's ops do (they match more of it, or the same and mask something themselves)
        plain = len({op.stage for op in ops if op.stage})
        causal = reference(is_causal=True)
        causal_verdicts = _label(ops, causal, sites, given_inputs, masked=True)
        followed = len({op.stage for op in ops if op.stage})
        masks_itself = any(op.func == "masked_fill" or op.kwargs.get("is_causal") == "True" for op in ops)
        if followed > plain or (followed == plain and masks_itself):
            stages, causal_inside, verdicts = causal, True, causal_verdicts
            masks = {"is_causal": True}
        else:
            _label(ops, stages, sites, given_inputs, masked=False)
    rows: list[TargetRow] = []
    for i, op in enumerate(ops, 1):
        shown = _SHOWN.get(op.stage, op.stage) if op.stage else f"t{i}"
        args = [_arg_text(a, rows, list(inputs)) for a in op.args] + [f"{k}={v}" for k, v in op.kwargs.items()]
        ref = list(stages[op.stage].shape) if op.stage else None
        dtype = str(op.dtype).removeprefix("torch.")
        func, bracket, part = op.func.partition("[")  # "split[0]": the first tensor of a split
        call = f"{shown} = {func}({', '.join(args)}){bracket}{part}"  # q = split(t1, 64, dim=2)[0]
        rows.append(TargetRow(i, shown, call, op.func, op.shape, dtype, op.memory, op.stage, ref))
    trace_ = TargetTrace(
        module=title,
        call=_call_form(adapter),
        mask=_mask_form(adapter)
        + ("; causal by its own ops (compared with the causal reference, which they follow)" if causal_inside else "")
        + (f"; the trace adds {_added_text(added)}, as forward takes them (--no-exercise: none)" if added else ""),
        inputs={n: list(t.shape) for n, t in inputs.items()},
        masks=[
            (k if isinstance(v, bool) else f"{k} {list(v.shape)}") + (" (added)" if k in added else "")
            for k, v in masks.items()
        ],
        training=bool(module is not None and module.training),
        reference={s: list(t.shape) for s, t in stages.items()},
        rows=rows,
        weights=adapter.describe_weights() if isinstance(adapter, ProbedAdapter) else "",
    )
    if error is not None:
        trace_.matched = [s for s in STAGES if any(op.stage == s for op in ops)]
        trace_.error = _raised(error, module)
        return trace_
    trace_.matched, missing, at, view = _first_departure(ops, stages, verdicts, sites, given_inputs, masked=bool(masks))
    trace_.departure = _departure(ops, stages, missing, at, adapter.scale, view)
    return trace_


def _flow_heads(adapter: ProbedAdapter, sites: list[_FlowSite], batch: int) -> int | None:
    """The query heads of the one attention the data flow finds, where their width (what the score product sums
    over) is not the adapter's: a module whose constructor names no head count is built with its own, and the
    probe took the count asked for. None where they agree or the flow says nothing clear."""
    if len(sites) != 1:
        return None
    p = adapter.projections()
    q, k = sites[0].q, sites[0].k  # (L, T_q, D), (L, T_k, D)
    D, HD, GD = q.size(-1), p.q_weight.size(0), p.k_weight.size(0)
    if D == HD // adapter.num_heads or k.size(-1) != D or HD % D or GD % D or (HD // D) % (GD // D):
        return None
    return None if q.numel() % (batch * HD) else HD // D


def _reheaded(adapter: AttentionAdapter, query: Tensor, key: Tensor, value: Tensor) -> tuple[AttentionAdapter, str]:
    """``adapter``, or the same module probed again with the head count its data flow computes with (see
    :func:`_flow_heads`), and what the trace's header says of it."""
    if not isinstance(adapter, ProbedAdapter):
        return adapter, ""
    inputs = _input_names(query, key, value)
    ops, error = capture_until_error(lambda: adapter(query, key, value), inputs, adapter.module)
    heads = None if error is not None else _flow_heads(adapter, _flow_sites(ops, list(inputs.values())), query.size(0))
    if heads is None:
        return adapter, ""
    try:
        again = ProbedAdapter(
            adapter.module,
            num_heads=heads,
            name=adapter.name,
            factory=adapter.factory,
            dropout=adapter.dropout_p,
            embed_dim=adapter.embed_dim,
        )
    except Exception:  # the first reading stands; its trace shows where it parts from the flow
        return adapter, ""
    note = (
        f"; {heads} heads, as its data flow computes them (it names no head count; {adapter.num_heads} were asked for)"
    )
    return again, note


def _own_masks(adapter: AttentionAdapter, query: Tensor, key: Tensor) -> dict[str, Any]:
    """The masks to trace a module with when none was given: those its forward takes, as check's probe found
    them. Key padding (the last third of the first sequence's keys) wherever a mask reaches it (a key padding
    argument or an attention mask); ``is_causal`` where it takes a causal flag of its own, or an attention mask
    besides a key padding argument (so that the mask argument is exercised too). One sequence padded
    and the others not, so that masks spread over the wrong rows show too. Not through a mask handed one
    sequence at a time (the calls would not be the batch's)."""
    form, probed = getattr(adapter, "form", None), getattr(adapter, "masks", None)
    B, T_q, T_k = query.size(0), query.size(1), key.size(1)
    whole = probed is None or probed.layout != "per_sequence"
    out: dict[str, Any] = {}
    if T_k >= 2 and (form is None or form.padding_arg is not None or (form.mask_arg is not None and whole)):
        pad = torch.zeros(B, T_k, dtype=torch.bool, device=query.device)  # (B, T_k), True = padding
        pad[0, T_k - max(1, T_k // 3) :] = True
        out["key_padding_mask"] = pad
    if form is not None and form.causal_arg is not None and not form.torch_form and T_q <= T_k:
        out["is_causal"] = True
    elif form is not None and form.padding_arg is not None and form.mask_arg is not None and whole and T_q <= T_k:
        out["is_causal"] = True  # key padding has an argument of its own: causal masking reaches the attention mask
    return out


def _own_context(adapter: AttentionAdapter, query: Tensor, key: Tensor, value: Tensor) -> Tensor | None:
    """For self-attention of a module that takes a separate key/value source: a context of the query's shape
    (seeded), so that K and V read from the wrong input show; None otherwise."""
    if key is not query or value is not query or not getattr(adapter, "supports_cross_attention", False):
        return None
    g = torch.Generator().manual_seed(1)
    width = int(getattr(adapter, "kdim", None) or query.size(-1))  # the context's own width, where it has one
    shape = (query.size(0), query.size(1), width)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(query)  # (B, T_k = T_q, kdim)


def _own_values(adapter: AttentionAdapter, context: Tensor | None) -> Tensor | None:
    """For a module whose forward takes key and value apart: values other than the context (seeded), so that V
    read from the key shows; None otherwise."""
    form = getattr(adapter, "form", None)
    if context is None or form is None or form.inputs < 3:
        return None
    g = torch.Generator().manual_seed(2)
    width = int(getattr(adapter, "vdim", None) or context.size(-1))
    shape = (context.size(0), context.size(1), width)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(context)  # (B, T_k, vdim)


def _added_text(added: dict[str, Any]) -> str:
    parts = []
    if "key_padding_mask" in added:
        pad = added["key_padding_mask"]
        parts.append(f"key padding (the last {int(pad[0].sum())} keys of the first sequence)")
    if "is_causal" in added:
        parts.append("causal masking")
    return " and ".join(parts)


@contextmanager
def _in_convention(adapter: AttentionAdapter) -> Iterator[None]:
    """Masks handed over in the convention a module of its form takes (True = may attend, or torch's True =
    blocked), not in the reverse reading the probe found it to have: that reading is then where it departs."""
    masks, convention = getattr(adapter, "masks", None), getattr(adapter, "convention", None)
    if (
        masks is None
        or convention is None
        or masks.use not in ("bool", "int", "float01")
        or masks.polarity == convention
    ):
        yield
        return
    cast(Any, adapter).masks = replace(masks, polarity=convention)
    try:
        yield
    finally:
        cast(Any, adapter).masks = masks


# -- the attention's data flow: where each stage is, whatever the layout ------------------------------------


@dataclass
class _FlowSite:
    """One attention computation found in the ops (:mod:`attnlab.check.dataflow`'s reading of them)."""

    product: int  # the op of Q K^T
    softmax: int | None  # the softmax over its scores (None: inside a fused kernel)
    into_softmax: int | None  # the op whose tensor reaches the softmax: scaled (and masked) scores
    weighted: int  # the op of weights V: the context
    q: Tensor  # (L, T_q, D): L the (batch, head) groups, flattened in the op's own order
    k: Tensor  # (L, T_k, D)
    v: Tensor  # (L, T_k, D)
    context: Tensor  # (L, T_q, D)
    # a fused kernel (the weights unseen) given the reference's Q and K heads and other values, or the reference's
    # weights multiplying other values: the first stage off is V as it reaches the product (rotary or another map
    # applied to it); set by :func:`_label` for its reference
    v_off: bool = False
    # Q and K as they meet in the score product are the reference's heads: Q K^T is right, whatever reaches the
    # softmax; set by :func:`_label`
    qk_right: bool = False
    # the heads stage ("q_heads", "k_heads") that meets the product as the plain split of its projection where the
    # reference turns it by position (rotary): the map left out of that side; set by :func:`_label`
    unturned: str | None = None


def _flow_sites(ops: list[Op], inputs: list[Tensor]) -> list[_FlowSite]:
    """Each attention computation of the ops: the softmax, the product that feeds it, the one its weights
    feed; none when the data flow cannot be read that way."""
    try:
        found = flow.attention_sites(ops, inputs)
    except (flow.Unreadable, RuntimeError, IndexError, ValueError):
        return []
    out = []
    for site in found:
        op = ops[site.at]
        if op.func in flow.FUSED_OPS:
            out.append(_FlowSite(site.at, None, None, site.at, site.q, site.k, site.v, site.context))
            continue
        soft = next(
            (
                n
                for n in range(site.at - 1, -1, -1)
                if ops[n].func in flow.SOFTMAX_OPS and site.at in flow.descendants(ops, n)
            ),
            None,
        )
        if soft is None:  # a manual softmax (exp / sum): its steps are compared one by one
            continue
        try:
            product = flow.score_product(ops, soft)
        except flow.Unreadable:
            continue
        into = next((a for a in flow.tracked_args(ops[soft]) if a >= 0), None)
        out.append(_FlowSite(product, soft, into, site.at, site.q, site.k, site.v, site.context))
    return out


def _score_rows(ops: list[Op], site: _FlowSite, t: Tensor, inputs: list[Tensor]) -> Tensor | None:
    """``t``, a tensor on the way from the score product to the weights, as ``(L, T_q, T_k)`` in the site's
    groups: read the way the product's result is read (an einsum's own axis order) when it has that shape."""
    product = ops[site.product]
    L, T_q, T_k = site.q.size(0), site.q.size(1), site.k.size(1)
    if t.shape == product.out.shape:
        try:
            return flow.product_sides(replace(product, out=t), ops, inputs, first_is_weights=False)[2]
        except (flow.Unreadable, RuntimeError):
            return None
    if product.func != "einsum" and t.dim() >= 2 and tuple(t.shape[-2:]) == (T_q, T_k) and t.numel() == L * T_q * T_k:
        return t.reshape(L, T_q, T_k)
    return None


def _group_views(want: Tensor, L: int, part: tuple[int, int]) -> list[Tensor]:
    """``want`` ``(B, n, X, Y)``'s heads ``part`` (start, stop) as ``(L, X, Y)``: batch-major, then heads-major."""
    w = want[:, part[0] : part[1]]
    if w.size(0) * w.size(1) != L:
        return []
    return [w.reshape(L, *w.shape[2:]), w.transpose(0, 1).reshape(L, *w.shape[2:])]


def _parts(sites: list[_FlowSite], H: int) -> list[tuple[int, int]]:
    """The heads each site computes: all of them, or, for one site per head group (a list of head modules),
    the site's share in order."""
    n = len(sites)
    if n <= 1 or H % n:
        return [(0, H)] * n
    return [(i * H // n, (i + 1) * H // n) for i in range(n)]


def _softmax_gaps(t: Tensor, want: Tensor) -> tuple[float, float, bool]:
    """How far ``softmax(t)`` is from ``softmax(want)`` over the last axis (both ``(L, T_q, T_k)``): over every
    pair, and over the pairs both keep (renormalised there); and whether, on those pairs, ``t`` is ``want``
    times one factor (a scale mistake, wherever it was applied) rather than other scores. A per-row shift (the
    max subtracted) and a finite fill (-1e4, finfo.min) where the reference has -inf are the same to a softmax;
    rows the reference blocks entirely are left out (a module may give them anything)."""
    t, want = t.double(), want.double()
    live = torch.isfinite(want).any(-1)  # (L, T_q)
    if not bool(live.any()) or bool(torch.isnan(t).any()):
        return float("inf"), float("inf"), False
    t, want = t[live], want[live]  # (rows, T_k)
    top = t.masked_fill(~torch.isfinite(t), float("-inf")).amax(-1, keepdim=True)
    both = torch.isfinite(want) & torch.isfinite(t) & (t > top - 30.0)  # exp(-30): nothing a softmax keeps
    gap_all = float((torch.softmax(t, -1) - torch.softmax(want, -1)).abs().max())
    rows = both.any(-1)
    if not bool(rows.any()):
        return gap_all, float("inf"), False
    t, want, both = t[rows], want[rows], both[rows]
    a = torch.softmax(t.masked_fill(~both, float("-inf")), -1)
    b = torch.softmax(want.masked_fill(~both, float("-inf")), -1)
    n = both.sum(-1, keepdim=True)
    tc = torch.where(both, t - torch.where(both, t, 0.0).sum(-1, keepdim=True) / n, 0.0)  # centred per row
    wc = torch.where(both, want - torch.where(both, want, 0.0).sum(-1, keepdim=True) / n, 0.0)
    factor = float((tc * wc).sum() / (wc * wc).sum().clamp_min(1e-300))
    scaled = float((tc - factor * wc).abs().max()) <= 1e-4 * float(tc.abs().max().clamp_min(1e-12))
    return gap_all, float((a - b).abs().max()), scaled


@dataclass
class _FlowVerdict:
    """What the data flow says of the scores that reach the softmax, against the reference's masked scores."""

    op: int  # the op whose tensor reaches it
    scale_right: bool  # the pairs both keep agree: Q K^T and its scale are the reference's
    mask_right: bool  # and every pair too
    scale_only: bool  # on the pairs both keep, they are the reference's times one factor: only the scale is off
    # Q and K at the score product are the reference's heads (Q K^T is right), yet on pairs both keep the scores
    # differ otherwise than by a factor: what joined Q K^T before the softmax (a bias by position) is off. A mask
    # mistake changes which pairs are kept, never the scores of pairs both keep: it is not this.
    joined_off: bool = False


def _label(
    ops: list[Op], stages: dict[str, Tensor], sites: list[_FlowSite], inputs: list[Tensor], *, masked: bool
) -> list[_FlowVerdict]:
    """Set each op's ``stage`` by value (:func:`attnlab.check.capture.match_stages`); then, through the data flow,
    the ops that hold a stage in a layout of their own (the query heads, the scores reaching the softmax, the
    weights, the context), and what reaches each softmax compared with the reference's masked scores."""
    match_stages(ops, stages)
    _label_unrotated(ops, stages)
    verdicts: list[_FlowVerdict] = []
    if not sites:
        return verdicts
    H = stages["q_heads"].size(1)
    G = stages["k_heads"].size(1)
    k_rep = stages["k_heads"].repeat_interleave(H // G, dim=1) if G != H and H % G == 0 else stages["k_heads"]
    v_rep = stages["v_heads"].repeat_interleave(H // G, dim=1) if G != H and H % G == 0 else stages["v_heads"]

    def close(t: Tensor, want: Tensor, part: tuple[int, int]) -> bool:
        errs = [stage_error(t, w) for w in _group_views(want, t.size(0), part)]
        return any(e is not None and e <= MATCH_TOL for e in errs)

    def scaled(t: Tensor, want: Tensor, part: tuple[int, int]) -> bool:
        # the same up to a positive factor: Q or K with the softmax scale folded in (ESM's and fairseq's
        # q *= scaling before the heads meet) is still the side the position map did or did not turn
        unit = t / t.norm().clamp_min(1e-30)
        errs = [stage_error(unit, w / w.norm().clamp_min(1e-30)) for w in _group_views(want, t.size(0), part)]
        return any(e is not None and e <= MATCH_TOL for e in errs)

    def mark(i: int | None, stage: str) -> None:
        if i is not None and i >= 0 and ops[i].stage is None:
            ops[i].stage = stage

    for site, part in zip(sites, _parts(sites, H), strict=True):
        product = ops[site.product]
        operands = [a for a in product.args if isinstance(a, int)]
        if operands and scaled(site.q, stages["q_heads"], part):  # the query heads, a folded scale or not
            mark(operands[0], "q_heads")
        if product.func == "einsum" and len(operands) > 1 and close(site.k, k_rep, part):
            mark(operands[1], "k_heads")
        weighted = [a for a in ops[site.weighted].args if isinstance(a, int)]
        if site.softmax is not None and len(weighted) > 1 and close(site.v, v_rep, part):
            mark(weighted[1], "v_heads")
        q_right, k_right = scaled(site.q, stages["q_heads"], part), scaled(site.k, k_rep, part)
        site.qk_right = q_right and k_right
        v_right = close(site.v, v_rep, part)
        site.v_off = site.softmax is None and site.qk_right and not v_right
        site.unturned = None
        if q_right != k_right:
            side, heads = ("k", "k_heads") if q_right else ("q", "q_heads")
            split = _unturned_heads(stages, side, H)
            if split is not None and scaled(site.k if side == "k" else site.q, split, part):
                site.unturned = heads
        if close(site.context, stages["context"], part):
            mark(site.weighted, "context")
        if site.softmax is None or site.into_softmax is None:
            continue
        soft = _score_rows(ops, site, ops[site.softmax].out, inputs)
        if soft is not None and close(soft, stages["weights"], part):
            mark(site.softmax, "weights")
            # the reference's weights meet other values: V departs before the context (a map that turns it)
            site.v_off = not v_right
        into = _score_rows(ops, site, ops[site.into_softmax].out, inputs)
        want = _group_views(stages["masked"], into.size(0), part) if into is not None else []
        # scores of another shape than the reference's (K read from the queries in cross-attention, the axes
        # swapped) are no reading of them: the weights show it
        want = [w for w in want if into is not None and w.shape == into.shape]
        if into is None or not want:
            continue
        gaps = min((_softmax_gaps(into, w) for w in want), key=lambda g: (g[1], g[0]))
        joined_off = site.qk_right and MATCH_TOL < gaps[1] < float("inf") and not gaps[2]
        verdict = _FlowVerdict(site.into_softmax, gaps[1] <= MATCH_TOL, gaps[0] <= MATCH_TOL, gaps[2], joined_off)
        verdicts.append(verdict)
        if verdict.mask_right and ops[site.into_softmax].stage not in ("scaled", "masked"):
            ops[site.into_softmax].stage = "masked" if masked else "scaled"
    return verdicts


def _unturned_heads(stages: dict[str, Tensor], side: str, H: int) -> Tensor | None:
    """The projection ``side`` ("q" or "k") cut into heads as it is, ``(B, H, T, D)`` (K's heads repeated to the
    query heads), where the reference's heads differ from it (a position map turns them); None where they do not."""
    proj, want = stages[side], stages[f"{side}_heads"]  # (B, T, n*D), (B, n, T, D)
    B, n, T, D = want.shape
    if proj.shape != (B, T, n * D):
        return None
    split = proj.view(B, T, n, D).transpose(1, 2)
    same = stage_error(split, want)
    if same is not None and same <= MATCH_TOL:
        return None  # nothing turns them
    return split.repeat_interleave(H // n, dim=1) if n != H and H % n == 0 else split


def _label_unrotated(ops: list[Op], stages: dict[str, Tensor]) -> None:
    """Q, K or V that the module holds only cut into heads, before its position map (rotary) turns them (a fused
    projection viewed as ``(B, T, H, 3 D)``): such a tensor is the projection itself, per head, and is labelled
    with the projection's stage where no op holds it whole. Nothing changes where the reference's heads are the
    plain split (no rotary): those tensors already carry the heads' stages."""
    for name, heads in (("q", "q_heads"), ("k", "k_heads"), ("v", "v_heads")):
        if any(op.stage == name for op in ops):
            continue
        proj, want = stages[name], stages[heads]  # (B, T, n*D), (B, n, T, D)
        B, n, T, D = want.shape
        if proj.shape != (B, T, n * D):
            continue
        split = proj.view(B, T, n, D).transpose(1, 2)  # (B, n, T, D), unturned
        same = stage_error(split, want)
        if same is not None and same <= MATCH_TOL:
            continue  # nothing turns them: the heads' stage says it all
        for op in ops:
            err = stage_error(op.out, split) if op.stage is None and op.out.is_floating_point() else None
            if err is not None and err <= MATCH_TOL:
                op.stage = name


def _first_departure(
    ops: list[Op],
    stages: dict[str, Tensor],
    verdicts: list[_FlowVerdict],
    sites: list[_FlowSite],
    inputs: list[Tensor],
    *,
    masked: bool,
) -> tuple[list[str], str | None, Op | None, Tensor | None]:
    """(the stages matched, the first stage not matched, the op that should have produced it, and that op's
    tensor in the reference's layout where the data flow reads it so: the softmax's, ``(1, L, T_q, T_k)``).

    As :func:`attnlab.check.capture.first_departure`, with what the data flow tells: Q, K or V that the module
    never holds whole (a fused ``(B, T, H, 3, D)`` projection) is vouched for by its heads; and what reaches
    the softmax is the judge of the scaled and masked scores, wherever the scale was applied (folded into Q
    or K, split between them): on the pairs both keep it tells the scale, on the others the mask. A module
    that masks by itself where no mask was given departs at the masked scores.
    """
    matched = [s for s in STAGES if any(op.stage == s for op in ops)]
    # scores that differ otherwise than by a factor (K from the wrong head, Q K^T mixed up) are judged as before:
    # by the first stage that shows them, the weights
    # and scores from the reference's Q and K heads that differ on pairs both keep: what joined Q K^T (a bias by
    # position with the wrong sign) is off, at the scaled scores, where the reference adds it
    verdicts = [v for v in verdicts if v.scale_right or v.scale_only or v.joined_off]
    wrong = next((v for v in verdicts if not v.mask_right), None)
    required = ["q", "k", "v", "q_heads"]
    if verdicts or "scores" in matched or "scaled" in matched:
        required.append("scaled")
        if masked or (wrong is not None and wrong.scale_right):
            required.append("masked")
    required += ["weights", "context", "merged", "out"]
    same_out = stage_error(stages["out"], stages["merged"]) if stages["out"].shape == stages["merged"].shape else None
    no_out_proj = same_out is not None and same_out <= MATCH_TOL

    def vouched(stage: str) -> bool:
        if stage in ("q", "k", "v") and f"{stage}_heads" in matched:
            return True
        if stage in ("q", "k", "q_heads", "k_heads") and verdicts:  # Q K^T is the reference's (up to a factor):
            return True  # so are Q and K, wherever each head's were computed (a list of head modules)
        if stage in ("scaled", "masked") and verdicts:
            return wrong is None or (stage == "scaled" and wrong.scale_right)
        # a later stage vouches for a missing one only if it is computed from it: the scores and weights from Q
        # and K alone, so V (a value projection mixed up) shows first in the context
        vouching = ("context", "merged", "out") if stage in ("v", "v_heads") else DOWNSTREAM
        if stage == "out" and "merged" in matched and no_out_proj:
            return True  # no output projection: the merged heads are the output, and one op holds both
        return any(s in matched for s in STAGES[STAGES.index(stage) + 1 :] if s in vouching)

    missing = next((s for s in required if s not in matched and not vouched(s)), None)
    # one side of the product is its projection cut into heads, unturned, where the reference turns it by position
    unturned = next((site for site in sites if site.unturned), None)
    if unturned is not None and unturned.unturned and missing in DOWNSTREAM:
        operands = [a for a in ops[unturned.product].args if isinstance(a, int)]
        side = 0 if unturned.unturned == "q_heads" else 1
        at = operands[side] if len(operands) > side and operands[side] >= 0 else unturned.product
        return matched, unturned.unturned, ops[at], None
    off_v = next((site for site in sites if site.v_off), None)
    fused = off_v is not None and off_v.softmax is None
    after_v = missing is None or STAGES.index(missing) > STAGES.index("v_heads")
    if off_v is not None and (after_v if fused else missing in ("context", "merged", "out")):
        # Q and K heads (or the weights) are the reference's and V is not: V departs before the product's result
        fed = [a for a in ops[off_v.weighted].args if isinstance(a, int)]
        n = 2 if fused else 1  # the kernel's (q, k, v); the product's (weights, v)
        at = fed[n] if len(fed) > n and fed[n] >= 0 else off_v.weighted
        return matched, "v_heads", ops[at], None
    if missing is None:
        return matched, None, None, None
    if missing in ("scaled", "masked") and wrong is not None:
        return matched, missing, ops[wrong.op], None
    for site in sites if missing == "weights" else []:
        if site.softmax is not None and ops[site.softmax].stage is None:
            rows = _score_rows(ops, site, ops[site.softmax].out, inputs)  # (L, T_q, T_k)
            return matched, missing, ops[site.softmax], None if rows is None else rows[None]
    before = STAGES[: STAGES.index(missing)]
    floats = [op for op in ops if op.out.is_floating_point()]
    last = max((n for n, op in enumerate(floats) if op.stage in before), default=-1)
    want = stages[missing]
    candidate = next((op for op in floats[last + 1 :] if stage_error(op.out, want) is not None), None)
    if candidate is None:  # computed inside a fused kernel (SDPA): the stage never leaves it, the kernel is the place
        candidate = next((op for op in floats[last + 1 :] if op.func in FUSED), None)
    return matched, missing, candidate, None


def _departure(
    ops: list[Op],
    stages: dict[str, Tensor],
    missing: str | None,
    op: Op | None,
    scale: float,
    view: Tensor | None = None,
) -> Departure | None:
    """``missing`` (see :func:`attnlab.check.capture.first_departure`) as a departure, at the op where it should have been."""
    if missing is None:
        return None
    if op is None:
        return Departure(missing, list(stages[missing].shape), None, None, None)
    at = next(i for i, o in enumerate(ops, 1) if o is op)  # `is`: an Op holds tensors, == would compare them
    hint = departure_hint(missing, op if view is None else replace(op, out=view), stages, scale)
    return Departure(missing, list(stages[missing].shape), at, op.func, op.shape, hint)


def _may_mask_itself(adapter: AttentionAdapter) -> bool:
    """A probed module whose forward takes neither a mask nor a causal flag, not found causal by experiment."""
    form = getattr(adapter, "form", None)
    return (
        form is not None
        and form.mask_arg is None
        and form.causal_arg is None
        and not getattr(adapter, "always_causal", False)
    )


def _call_form(adapter: AttentionAdapter) -> str:
    form = getattr(adapter, "form", None)  # a ProbedAdapter read it off forward's signature
    return form.describe() if form is not None else "forward(query, key, value)"


def _mask_form(adapter: AttentionAdapter) -> str:
    form, masks = getattr(adapter, "form", None), getattr(adapter, "masks", None)
    causal = (
        "; always causal (no later token reaches an earlier output)" if getattr(adapter, "always_causal", False) else ""
    )
    if form is not None and form.mask_arg is None:
        return f"none (forward takes no mask){causal}"
    if masks is None:
        return "bool, as its adapter translates it"
    expected = getattr(adapter, "convention", masks.polarity)  # SDPA's keep, or torch's block for nn.MultiheadAttention
    if masks.use in ("bool", "int", "float01") and masks.polarity != expected:
        want = "may attend" if expected == "keep" else "blocked"
        return (
            f"{masks.describe()}: the reverse of the True = {want} that a module of this form takes (attnlab check "
            f"names it mask_polarity; the masks traced here are given as True = {want}, so the trace departs where its "
            "reading differs)"
        )
    return masks.describe()


def trace_command(
    batch_size: int = 2,
    seq_len: int = 10,
    embed_dim: int = 64,
    num_heads: int = 8,
    num_kv_heads: int | None = None,
    context_len: int | None = None,
    causal: bool = False,
    pad: int = 0,
    dropout: float = 0.0,
    backend: Backend = "math",
    json: bool = False,
    seed: int = 0,
    model: str | None = None,
    layer: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    alibi: bool = False,
    sinks: bool = False,
    qk_norm: bool = False,
    target: str | None = None,
    exercise: bool = True,
    mla: bool = False,
    path: Literal["naive", "absorbed", "both"] = "both",
    hidden_size: int = 896,
    q_lora_rank: int | None = 192,
    kv_lora_rank: int = 64,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 16,
) -> int:
    """Trace every stage of attention on random input (defaults: the seed-000 case), one layer of a real model, or your own module.

    Args:
        batch_size: B.
        seq_len: T_q, the query length.
        embed_dim: E (model_dim).
        num_heads: H.
        num_kv_heads: G key/value heads (GQA; 1 = MQA); must divide num_heads. Default: num_heads.
        context_len: T_k of a separate context: cross-attention. Default: self-attention.
        causal: apply causal masking (is_causal=True).
        pad: mark the last PAD keys of the first sequence as padding (key_padding_mask).
        dropout: attention dropout in [0, 1); when > 0 the module runs in training mode so it shows.
        backend: math (every stage visible), sdpa (one fused kernel) or auto.
        json: print JSON instead of a table (every field, never shortened).
        seed: torch.manual_seed.
        model: trace one layer of a pretrained model ('smollm2', a .gguf file or a Hugging Face directory) as the model calls it, on random token ids (batch_size x seq_len): its weights, widths and rotary embedding; --embed-dim/--num-heads/--num-kv-heads come from it, and it is causal.
        layer: with --model, which attention layer (0 = the first; default 0).
        window: sliding window W (query i sees keys i - W < j <= i); needs --causal.
        softcap: logit soft-capping C: scores C * tanh(scores / C) before masking (Gemma 2).
        alibi: ALiBi: head h adds -m_h |i - j| to its scores (BLOOM).
        sinks: a learned sink logit per head in the softmax denominator (gpt-oss; traced with values 0).
        qk_norm: RMSNorm on each head's q and k (Qwen 3).
        target: trace your own attention module, 'path/to/mine.py:Name' or 'package.module:Name' (a class, a factory or an instance), built at --embed-dim/--num-heads/--num-kv-heads: every op it runs on its inputs, each matched with the reference's stages, and the first stage it never produces marked. Default: attnlab's MultiHeadAttention.
        exercise: with --target: when the call traced (no --pad, no --causal) reproduces every stage, trace it again with what the module's forward also takes (key padding on the first sequence's last keys, causal where it takes a flag, a separate context where it takes one), and show the first call that departs; --no-exercise: the one call only.
        mla: trace MultiHeadLatentAttention (DeepSeek-V2/V3's MLA) instead, sized by the DeepSeek-named flags below and --num-heads (defaults: V3's shapes, scaled down); both paths, then the cache per token of MHA, GQA, MQA and MLA, and the path 'auto' picks. --num-kv-heads sets the GQA row's G.
        path: with --mla: naive (the paper's form: latents expanded into per-head keys and values), absorbed (W_UK folded into the query, attention over the latents), or both.
        hidden_size: with --mla: E (DeepSeek-V3: 7168).
        q_lora_rank: with --mla: Q, the query latent (V3: 1536); None: one q_proj (V2-Lite).
        kv_lora_rank: with --mla: C, the cached latent (V3: 512).
        qk_nope_head_dim: with --mla: N, query/key channels per head without RoPE (V3: 128).
        qk_rope_head_dim: with --mla: R, rotary channels, one key shared by all heads (V3: 64); even.
        v_head_dim: with --mla: Dv, value channels per head (V3: 128).
    """
    check_range("--batch-size", batch_size, low=1, integer=True)
    check_range("--seq-len", seq_len, low=1, integer=True, hint="it is T_q, the number of query positions")
    sizes = {"hidden_size": hidden_size, "num_heads": num_heads, "q_lora_rank": q_lora_rank, "kv_lora_rank": kv_lora_rank, "qk_nope_head_dim": qk_nope_head_dim, "qk_rope_head_dim": qk_rope_head_dim, "v_head_dim": v_head_dim}  # fmt: skip
    mla_only = {"--path": path, **{"--" + k.replace("_", "-"): v for k, v in sizes.items() if k != "num_heads"}}
    if not mla:
        _flags_at_default(mla_only, "sizes multi-head latent attention, and no --mla was given; add --mla")
    else:
        mha_only: dict[str, object] = {"--context-len": context_len, "--dropout": dropout, "--model": model, "--layer": layer, "--target": target, "--window": window, "--softcap": softcap, "--alibi": alibi, "--sinks": sinks, "--qk-norm": qk_norm}  # fmt: skip
        if embed_dim != 64:
            raise UsageError(f"--embed-dim {embed_dim} is MultiHeadAttention's width; with --mla pass --hidden-size {embed_dim} (DeepSeek's name for it).")  # fmt: skip
        _flags_at_default(mha_only, "configures attnlab's MultiHeadAttention, and --mla traces MultiHeadLatentAttention, which has no such option; drop it")  # fmt: skip
        if num_kv_heads is not None:
            check_range("--num-kv-heads", num_kv_heads, low=1, high=num_heads, integer=True, hint="with --mla it is G of the cache table's GQA row")  # fmt: skip
        return trace_mla_command(sizes=sizes, batch_size=batch_size, seq_len=seq_len, num_kv_heads=num_kv_heads, causal=causal, pad=pad, backend=backend, path=path, json=json, seed=seed)  # fmt: skip
    if target == "torch":
        raise UsageError(
            "--target torch: trace shows attnlab's own MultiHeadAttention by default, which computes what "
            "torch.nn.MultiheadAttention does stage by stage; drop --target (or pass your module: --target mine.py:Name)."
        )
    custom = target is not None and target != "attnlab"
    if model is not None and custom:
        raise UsageError(
            f"--target {target!r} and --model {model!r} both name what to trace; pass one: "
            f"attnlab trace --target {target} or attnlab trace --model {model}."
        )
    if model is not None:
        check_range("--pad", pad, low=0, high=seq_len - 1, integer=True, hint="a sequence keeps one real token")
        # before the model loads: neither applies to a decoder layer
        given: dict[str, tuple[object, object]] = {"--context-len": (context_len, None), "--dropout": (dropout, 0.0)}
        model_flag_conflicts(trace_command, model, layer or 0, given)
        return _trace_model_layer(
            model, layer or 0, batch_size, seq_len, num_heads, embed_dim, num_kv_heads, pad, backend, json, seed
        )
    if layer is not None:
        raise UsageError(
            f"--layer {layer} picks a layer of a pretrained model, and no --model was given; "
            f"pass one: attnlab trace --model smollm2 --layer {layer}"
        )
    check_range("--embed-dim", embed_dim, low=1, integer=True)
    check_range("--num-heads", num_heads, low=1, integer=True)
    if num_kv_heads is not None:
        check_range("--num-kv-heads", num_kv_heads, low=1, high=num_heads, integer=True, hint="leave it out for MHA")
    if context_len is not None:
        check_range("--context-len", context_len, low=1, integer=True, hint="leave it out for self-attention")
    t_k = context_len or seq_len
    check_range(
        "--pad", pad, low=0, high=t_k, integer=True, hint=f"it counts padded keys out of the T_k = {t_k} of a sequence"
    )
    check_range("--dropout", dropout, low=0, high=1, high_inclusive=False)
    if custom:
        assert target is not None  # custom says so; for mypy
        own: dict[str, object] = {"--backend": backend, "--window": window, "--softcap": softcap, "--alibi": alibi, "--sinks": sinks, "--qk-norm": qk_norm}  # fmt: skip
        _target_flag_conflicts(target, own)
        if causal and t_k < seq_len:
            raise UsageError(
                f"is_causal=True needs T_q <= T_k, got T_q={seq_len} queries and T_k={t_k} keys (--seq-len, "
                f"--context-len): the first {seq_len - t_k} queries would see no key; drop --causal or make --context-len >= --seq-len."
            )
        return _trace_target(
            target,
            batch_size,
            seq_len,
            embed_dim,
            num_heads,
            num_kv_heads,
            context_len,
            causal,
            pad,
            dropout,
            json,
            seed,
            exercise,
        )
    if not exercise:
        raise UsageError("--no-exercise applies to a traced --target (the calls added to it); drop it.")
    torch.manual_seed(seed)
    try:
        mha = MultiHeadAttention(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            backend=backend,
            window=window,
            softcap=softcap,
            alibi=alibi,
            sinks=sinks,
            qk_norm=qk_norm,
        )
    except ValueError as err:  # the module names its arguments; the user typed flags
        raise UsageError(_as_flags(str(err))) from None
    mha.train(dropout > 0)
    x = torch.randn(batch_size, seq_len, embed_dim)
    ctx = torch.randn(batch_size, context_len, embed_dim) if context_len else None
    kpm = None
    if pad:
        kpm = torch.zeros(batch_size, t_k, dtype=torch.bool)
        kpm[0, t_k - pad :] = True  # the first sequence ends with `pad` padding tokens
    if window is not None and not causal:
        raise UsageError(f"--window {window} is a causal sliding window; add --causal.")
    with trace(mha) as calls:
        mha(x, ctx, key_padding_mask=kpm, is_causal=causal)
    _print(calls, json)
    return 0


def _flags_at_default(given: Mapping[str, object], why: str) -> None:
    """Refuse the first flag of ``given`` that is not at its default: it ``why`` (what it does, and the fix)."""
    defaults = {n: p.default for n, p in inspect.signature(trace_command).parameters.items()}
    for flag, value in given.items():
        if value != defaults[flag.removeprefix("--").replace("-", "_")]:
            shown = flag if value is True else f"{flag} {value}"
            raise UsageError(f"{shown} {why}.")


def _target_flag_conflicts(target: str, given: dict[str, object]) -> None:
    """Flags that shape attnlab's own module mean nothing for a module that is traced as it is written."""
    defaults = {n: p.default for n, p in inspect.signature(trace_command).parameters.items()}
    for flag, value in given.items():
        if value != defaults[flag.removeprefix("--").replace("-", "_")]:
            shown = flag if value is True else f"{flag} {value}"
            raise UsageError(
                f"{shown} configures attnlab's own MultiHeadAttention, and --target {target!r} traces your module "
                f"as it is written; drop {flag}."
            )


def _trace_target(
    target: str,
    batch_size: int,
    seq_len: int,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    context_len: int | None,
    causal: bool,
    pad: int,
    dropout: float,
    json: bool,
    seed: int,
    exercise: bool = True,
) -> int:
    """Build ``--target``, trace one call on random input, print it; 1 when the module raised."""
    torch.manual_seed(seed)
    adapter = build_target(
        target, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, dropout=dropout, seed=seed
    )
    if isinstance(adapter, MLAAdapter):  # its stages are MLA's (latents, a shared rotary key): not these
        raise UsageError(
            f"--target {target!r} is multi-head latent attention (DeepSeek's MLA); attnlab trace --target matches the "
            "stages of plain multi-head attention, which MLA does not compute. Check it with attnlab check --target "
            f"{target!r}, or trace MLA's own stages on attnlab's module with attnlab trace --mla."
        )
    if num_kv_heads is not None and adapter.num_kv_heads != num_kv_heads:
        raise UsageError(
            f"--num-kv-heads {num_kv_heads}: {target} was built with {adapter.num_kv_heads} K/V heads (its "
            f"constructor takes no K/V head count); drop --num-kv-heads."
        )
    adapter.set_training(dropout > 0)
    w = adapter.projections().q_weight  # inputs on the module's device, in its dtype
    x = torch.randn(batch_size, seq_len, adapter.embed_dim).to(w)  # (B, T_q, E)
    ctx = torch.randn(batch_size, context_len, adapter.embed_dim).to(w) if context_len else x  # (B, T_k, E)
    t_k = ctx.size(1)
    kpm = None
    if pad:
        kpm = torch.zeros(batch_size, t_k, dtype=torch.bool, device=w.device)  # (B, T_k), True = padding
        kpm[0, t_k - pad :] = True  # the first sequence ends with `pad` padding tokens
    title = target
    if adapter.embed_dim != embed_dim:  # a global of its file fixes its width (nanoGPT's n_embd): built at that
        title += f" (built at E = {adapter.embed_dim}, the width its file fixes, not --embed-dim {embed_dim})"
    try:
        traced = trace_module(
            adapter, x, ctx, ctx, key_padding_mask=kpm, is_causal=causal, name=title, exercise=exercise
        )
    except Unsupported as err:
        flags = [f for f, on in (("--context-len", context_len), ("--causal", causal), ("--pad", pad)) if on]
        raise UsageError(f"--target {target!r}: {err}; drop {' / '.join(flags) or 'the masks'}.") from None
    if json:
        print(_json.dumps(traced.to_dict(), indent=2))
    else:
        print(traced.to_text(width=shutil.get_terminal_size((80, 24)).columns))
    return 1 if traced.error is not None else 0


def _print(calls: list[AttentionTrace], json: bool) -> None:
    if json:
        print(traces_to_json(calls))
    else:
        print(calls[0].to_text(width=shutil.get_terminal_size((80, 24)).columns))


@torch.no_grad()
def _trace_model_layer(
    model: str,
    layer: int,
    batch_size: int,
    seq_len: int,
    num_heads: int,
    embed_dim: int,
    num_kv_heads: int | None,
    pad: int,
    backend: Backend,
    json: bool,
    seed: int,
) -> int:
    """Run the whole model on random token ids and record what layer ``layer``'s attention did."""
    lm, name, attn = model_layer("trace", model, layer)
    widths: dict[str, tuple[object, object]] = {
        "--embed-dim": (embed_dim, attn.embed_dim),
        "--num-heads": (num_heads, attn.num_heads),
        "--num-kv-heads": (num_kv_heads, attn.num_kv_heads),
    }
    model_flag_conflicts(trace_command, model, layer, widths)
    say_layer_weights("trace", model)
    torch.manual_seed(seed)
    vocab = int(cast(Any, lm).config.vocab_size)  # every model from_pretrained builds has one
    idx = torch.randint(vocab, (batch_size, seq_len))  # (B, T) token ids
    kpm = None
    if pad:
        kpm = torch.zeros(batch_size, seq_len, dtype=torch.bool)  # (B, T), True = padding
        kpm[0, seq_len - pad :] = True  # the first sequence ends with `pad` padding tokens
    saved = attn.backend
    attn.backend = backend
    try:
        with trace(attn) as calls:
            lm(idx, key_padding_mask=kpm)  # the layer sees its real input: the hidden states after layers 0 .. N-1
    finally:
        attn.backend = saved
    calls[0].module = f"{model} {name} (layer {layer}), on token ids {list(idx.shape)}"
    _print(calls, json)
    return 0


def _as_flags(message: str) -> str:
    """A constructor's message about ``embed_dim=64`` / ``num_heads=6`` in the flags' words (``--embed-dim 64``)."""
    flag = lambda name: "--" + name.replace("_", "-")
    message = re.sub(r"\b(embed_dim|num_heads|num_kv_heads|dropout)=", lambda m: flag(m.group(1)) + " ", message)
    return re.sub(r"\b(choose|change) (embed_dim|num_heads|num_kv_heads)\b", lambda m: f"{m[1]} {flag(m[2])}", message)
