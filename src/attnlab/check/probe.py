"""Check a hand-written attention module as it is written: find its weights and how it is called.

Notation: B batch, T_q query positions, T_k key positions, E embed_dim, H query heads,
G key/value heads, D head dim.

:class:`ProbedAdapter` reads three things off a module, so that nobody has to write an adapter:

- **the weights**: the parameter rows that make Q, K, V and the output, read off its data flow
  (:mod:`attnlab.check.dataflow`, settled by :mod:`attnlab.check.projections`), whatever their names;
- **the call form**, from ``forward``'s signature: ``forward(query, key, value, ...)``,
  ``forward(x_query, x_context, ...)`` (K and V from one context) or ``forward(x, ...)``
  (self-attention only); which keyword carries the mask (``attn_mask``, ``mask``,
  ``attention_mask``), whether it takes ``key_padding_mask``, ``is_causal``, ``need_weights``;
- **what its mask means**, by experiment: a bool mask that hides one key from every query is
  handed over; if changing that key's input leaves the other queries' outputs alone, True means
  *may attend*; the complementary mask tells *blocked*. A float mask (0 / -inf, added) is tried
  when a bool one has no clear effect. Per-sequence masks are tried as ``(B, 1, T_q, T_k)``
  (seed 002), ``(B*H, T_q, T_k)`` (``nn.MultiheadAttention``) and ``(B, T_q, T_k)``; when none
  gives each sequence its own mask, the module is called one sequence at a time.

When a bool ``(T_q, T_k)`` mask cannot be handed over (the module unsqueezes it, or takes one mask per
key), every other form is tried on a batch with a different mask per sequence: bool, 0/1 integer or
float (either polarity), additive float, in the shapes ``(B, T_q, T_k)``, ``(B, 1, T_q, T_k)``,
``(B*H, T_q, T_k)``, ``(B, 1, 1, T_k)``, ``(B, 1, T_k)``, ``(B, T_k)``, and d2l's ``valid_lens``
(``(B,)`` or ``(B, T_q)``). The first form under which exactly the hidden keys stop reaching each
query is the module's. Two more experiments: a module whose output at t never depends on later
tokens is *always causal* (checked against a causal reference); a fused ``qkv`` projection's thirds
are told apart by the data flow (which third meets which in the score product).

What the module lacks is expressed another way: key padding and causality go through its mask
when it takes no ``key_padding_mask`` or ``is_causal``. A module with no mask argument at all
raises :class:`~attnlab.check.adapters.Unsupported` for masked calls, and the checks that need
masks are skipped.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..core.attention import MultiHeadAttention
from ..core.functional import causal_keep
from .adapters import (
    AttentionAdapter,
    ModuleAdapter,
    Projections,
    TorchMHAAdapter,
    Unsupported,
    _same_size,
    _wrap,
    mha_projections,
    module_dropout,
)
from .capture import capture, capture_until_error
from .dataflow import SOFTMAX_OPS, Reading, attention_sites, read_dataflow
from .gate import OutputGate, find_gate
from .projections import NotAttention, _Found, find_projections, linear_weights, name_key, settle_roles
from .recipe import mask_period, recipe_attention
from .scoremap import Sample, ScoreMap, read_score_map, scores_of

__all__ = [
    "CallForm",
    "MaskForm",
    "ProbedAdapter",
    "as_adapter",
    "is_lazy",
    "materialise",
]


_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "heads", "nhead", "h", "num_attention_heads", "head_count")
_DROPOUT_ATTRS = ("dropout", "dropout_p", "attn_dropout", "p", "dropout_rate", "attention_dropout")
_SCALE_ATTRS = ("scale", "scaling", "softmax_scale", "scale_factor", "attn_scale", "inv_sqrt_d")
_MASK_ARGS = ("attn_mask", "mask", "attention_mask", "valid_lens", "valid_len", "src_mask")
# mask arguments a plain self-attention call may rightly leave unused (so one that changes nothing is no mistake)
_UNUSED_ALONE = ("padding", "head", "encoder", "cross", "context")
_INPUT_ROLES = {
    "query": ("query", "q", "queries", "xq", "qin"),
    "key": ("key", "k", "keys", "xk", "kin"),
    "value": ("value", "v", "values", "xv", "vin"),
}
_PAD_ARGS = ("key_padding_mask", "padding_mask", "src_key_padding_mask", "kv_padding_mask")
_CAUSAL_ARGS = ("is_causal", "causal")
PROBE_T = 7  # the length the score map is read at first (odd, unequal to the head counts)
_WEIGHTS_ARGS = ("need_weights", "return_weights", "return_attention", "output_attentions")


def is_lazy(module: nn.Module) -> bool:
    """Whether ``module`` still has weights that its first call will create (``nn.LazyLinear``)."""
    return any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters())


@torch.no_grad()
def materialise(module: nn.Module, embed_dim: int) -> bool:
    """Create a lazy module's weights with one self-attention call on ``(2, 5, embed_dim)`` (eval mode, no
    mask); True when there were any to create.

    Raises:
        NotAttention: the call raised (its one line named), or weights are still missing after it.
    """
    if not is_lazy(module):
        return False
    form = read_call_form(module)
    x = torch.zeros(2, 5, embed_dim).normal_(generator=torch.Generator().manual_seed(7))  # (B, T, E)
    try:
        with evaluating(module):
            _call(module, form, (x, x, x), {})
    except Exception as e:
        raise NotAttention(
            f"{type(module).__name__} has lazy weights (nn.LazyLinear) that one call on (B, T, E) = (2, 5, {embed_dim}) "
            f"should create, but {form.describe()} raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    for layer in module.modules():  # a lazy projection the call never used (V computed with W_k): at width E
        if isinstance(layer, nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params():
            layer(torch.zeros(1, embed_dim))
    if is_lazy(module):
        raise NotAttention(
            f"{type(module).__name__} still has uninitialised weights after one call; call it once yourself before "
            f"checking it, or use nn.Linear with explicit sizes"
        )
    return True


def _grid_args(params: dict[str, inspect.Parameter]) -> tuple[str, str] | None:
    """The required (height, width) of a vision module's token map (SegFormer's, PVT's ``forward(x, H, W)``),
    handed in with the tokens: their names, or None."""
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty and p.kind != p.VAR_KEYWORD]
    h = next((n for n in required if name_key(n) in ("height", "h", "imgh")), None)
    w = next((n for n in required if name_key(n) in ("width", "w", "imgw")), None)
    return (h, w) if h and w else None


def _grid(T: int) -> tuple[int, int]:
    """A token map of T tokens, as square as T allows: (height, width), height * width = T."""
    h = max(d for d in range(1, math.isqrt(T) + 1) if T % d == 0)
    return h, T // h


def _param_names(fn: Callable) -> tuple[list[str], dict[str, inspect.Parameter]]:
    params = dict(inspect.signature(fn).parameters)
    grid = _grid_args(params) or ()
    positional = [
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and n not in _MASK_ARGS + _PAD_ARGS + grid
    ]
    if not positional:  # forward(self, *, x, mask=None): the inputs are keyword-only
        positional = [
            n
            for n, p in params.items()
            if p.kind == p.KEYWORD_ONLY and p.default is inspect.Parameter.empty and n not in _MASK_ARGS + _PAD_ARGS
        ]
    return positional, params


@dataclass(frozen=True)
class CallForm:
    """How ``forward`` is called, read off its signature."""

    inputs: int  # 3: (query, key, value); 2: (query, context), K and V from the context; 1: (x,)
    input_names: tuple[str, ...]
    mask_arg: str | None  # the keyword carrying the attention mask
    padding_arg: str | None  # key padding, True = pad
    causal_arg: str | None  # is_causal
    weights_arg: str | None  # need_weights
    average_arg: str | None  # nn.MultiheadAttention's average_attn_weights
    torch_form: bool  # key_padding_mask + need_weights: nn.MultiheadAttention's conventions (True = blocked)
    # Mask arguments without a default (d2l's forward(queries, keys, values, valid_lens)): None when unused.
    required_none: tuple[str, ...] = ()
    # The three inputs go by keyword: their names say which is which, in another order than (query, key, value).
    by_name: bool = False
    # (T, B, E) inputs and output (fairseq, labml, nn.MultiheadAttention's default), found by experiment
    time_first: bool = False
    # the inputs go by keyword only (forward(self, *, x, mask=None))
    keyword_only: bool = False
    # forward(x, context=None): self-attention is the call without a context (its own route, masks included)
    context_optional: bool = False
    # the key padding argument reaches self-attention only (x-transformers' mask; its cross route has context_mask):
    # cross-attention calls fold key padding into the attention mask
    padding_self_only: bool = False
    # it declares batch_first = True yet reads (T, B, E): called batch-first (the mistake shows), read time-first
    declared_batch_first: bool = False
    # the inputs after the first are not the next positional parameters (T5's forward(hidden_states, mask=None,
    # key_value_states=None)): they go by keyword
    rest_by_name: bool = False
    # the output is the query plus the attention (mmcv's identity connection): the query is taken off again
    residual: bool = False
    # three inputs, but it asserts that key and value are the query (audiocraft's self-attention): self only
    self_only: bool = False
    # the (height, width) arguments of a token map, given a factorisation of T on each call (SegFormer's)
    grid: tuple[str, str] | None = None

    def describe(self) -> str:
        sig = ("*, " if self.keyword_only else "") + ", ".join(self.input_names)
        extras = [a for a in (self.mask_arg, self.padding_arg, self.causal_arg, self.weights_arg) if a]
        layout = " with (T, B, E) inputs" if self.time_first else ""
        layout += " (self-attention only: it asserts key and value are the query)" if self.self_only else ""
        layout += f" ({' * '.join(self.grid)} = T, as square as T allows)" if self.grid else ""
        return f"forward({sig}{''.join(', ' + e for e in extras)}){layout}"


def _roles(names: list[str]) -> list[str] | None:
    """``names`` as query/key/value when each names one of them (``forward(v, k, q)``), else None."""
    roles = [next((r for r, spellings in _INPUT_ROLES.items() if name_key(n) in spellings), "") for n in names]
    return roles if sorted(roles) == ["key", "query", "value"] else None


def _rest_by_name(params: dict[str, inspect.Parameter], names: tuple[str, ...]) -> bool:
    """Whether ``names`` (the inputs, in order) are not the first positional parameters of the signature."""
    order = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return list(names) != order[: len(names)]


def read_call_form(module: nn.Module) -> CallForm:
    positional, params = _param_names(module.forward)
    pick = lambda names: next((n for n in names if n in params), None)
    inputs = [n for n in positional if n not in _CAUSAL_ARGS + _WEIGHTS_ARGS + ("average_attn_weights",)]
    required = [n for n in inputs if params[n].default is inspect.Parameter.empty]
    n_inputs = min(3, max(1, len(required)))
    if (
        n_inputs < 3
        and len(inputs) >= 3
        and name_key(inputs[1]) in ("key", "k", "keys")
        and name_key(inputs[2]) in ("value", "v", "values")
    ):
        n_inputs = 3  # forward(query, key=None, value=None): the optional key and value are taken
    if (
        n_inputs == 1
        and len(inputs) >= 2
        and any(w in name_key(inputs[1]) for w in ("context", "kv", "memory", "key", "encoder", "xc"))
    ):
        n_inputs = 2  # forward(x, context=None)
    mask_arg, pad_arg = pick(_MASK_ARGS), pick(_PAD_ARGS)
    weights_arg = pick(_WEIGHTS_ARGS)
    roles = _roles(inputs[:3]) if n_inputs == 3 else None
    maskish = (*_MASK_ARGS, *_PAD_ARGS)
    return CallForm(
        inputs=n_inputs,
        input_names=tuple(inputs[:n_inputs]),
        mask_arg=mask_arg,
        padding_arg=pad_arg,
        causal_arg=pick(_CAUSAL_ARGS),
        weights_arg=weights_arg,
        average_arg="average_attn_weights" if "average_attn_weights" in params else None,
        torch_form=pad_arg is not None and weights_arg is not None and mask_arg is not None,
        required_none=tuple(n for n in maskish if n in params and params[n].default is inspect.Parameter.empty),
        by_name=roles is not None and roles != ["query", "key", "value"],
        keyword_only=bool(inputs) and params[inputs[0]].kind == inspect.Parameter.KEYWORD_ONLY,
        context_optional=n_inputs == 2 and params[inputs[1]].default is None,
        rest_by_name=bool(inputs)
        and params[inputs[0]].kind != inspect.Parameter.KEYWORD_ONLY
        and _rest_by_name(params, tuple(inputs[:n_inputs])),
        grid=_grid_args(params),
    )


def _call(module: nn.Module, form: CallForm, qkv: tuple[Tensor, ...], kwargs: dict) -> object:
    """``module`` called in ``form`` with ``qkv`` (the first ``form.inputs`` of them) and ``kwargs``; a mask
    argument without a default gets None when ``kwargs`` has none."""
    kwargs = {**{n: None for n in form.required_none}, **kwargs}
    if form.residual:  # the output less the query it adds back
        out = _call(module, replace(form, residual=False), qkv, kwargs)
        if isinstance(out, tuple | list) and out and isinstance(out[0], Tensor):
            return (out[0] - qkv[0], *out[1:])
        return out - qkv[0] if isinstance(out, Tensor) else out
    if form.time_first:  # (B, T, E) -> (T, B, E) in, and the output back
        out = _call(module, replace(form, time_first=False), tuple(t.transpose(0, 1) for t in qkv), kwargs)
        if isinstance(out, tuple | list) and out and isinstance(out[0], Tensor):
            return (out[0].transpose(0, 1), *out[1:])
        return out.transpose(0, 1) if isinstance(out, Tensor) else out
    if form.grid is not None and form.grid[0] not in kwargs:
        kwargs = {**kwargs, **dict(zip(form.grid, _grid(qkv[0].size(1)), strict=True))}
    if form.context_optional and qkv[1] is qkv[0] and qkv[2] is qkv[0]:  # self-attention: no context given
        return module(qkv[0], **kwargs)
    if form.keyword_only:
        return module(**dict(zip(form.input_names, qkv, strict=False)), **kwargs)
    if form.rest_by_name and not form.by_name:  # forward(x, mask=None, context=None): the context by its name
        return module(qkv[0], **dict(zip(form.input_names[1:], qkv[1 : form.inputs], strict=False)), **kwargs)
    if form.by_name:  # forward(v, k, q): each by its own name
        roles = _roles(list(form.input_names))
        assert roles is not None  # read_call_form saw them
        return module(**{n: qkv[("query", "key", "value").index(r)] for n, r in zip(form.input_names, roles, strict=True)}, **kwargs)  # fmt: skip
    return module(*qkv[: form.inputs], **kwargs)


@torch.no_grad()
def _with_context(module: nn.Module, form: CallForm, E: int, dtype: torch.dtype) -> CallForm:
    """``form`` taking a context for K and V in its second argument when that argument, optional, is one by
    experiment (Whisper's ``forward(x, xa=None)``): a context of another length gives a ``(B, T_q, E)`` output
    that depends on it."""
    names, params = _param_names(module.forward)
    names = [n for n in names if n not in _CAUSAL_ARGS + _WEIGHTS_ARGS]
    if form.inputs != 1 or len(names) < 2 or params[names[1]].default is not None:
        return form
    g = torch.Generator().manual_seed(98)
    x, c = torch.randn(2, 5, E, generator=g).to(dtype), torch.randn(2, 3, E, generator=g).to(dtype)
    try:
        plain = _first(module(x))
        one, two = _first(module(x, c)), _first(module(x, c + 1.0))
    except Exception:
        return form
    if not all(isinstance(t, Tensor) and t.shape == x.shape for t in (plain, one, two)):
        return form
    depends = float((one - two).abs().max()) > 1e-6 * float(one.abs().max().clamp_min(1e-12))
    named = any(w in name_key(names[1]) for w in ("xa", "context", "memory", "encoder", "kv", "src", "source", "cross"))
    if not depends and not named:  # a context that changes nothing, under a name that says nothing: not one
        return form
    return replace(form, inputs=2, input_names=(names[0], names[1]), context_optional=True,
                   rest_by_name=_rest_by_name(params, (names[0], names[1])))  # fmt: skip


def with_layout(module: nn.Module, form: CallForm, embed_dim: int | None) -> CallForm:
    """``form`` with ``time_first`` set by experiment: a batch-first module's output for sequence 1 ignores
    sequence 0's input; a time-first one (read (B, T, E) as (T, B, E)) mixes them, and its output at position 1
    ignores position 0's input instead.

    A module that declares ``batch_first = True`` (an attribute, as ``nn.MultiheadAttention``'s) is called
    batch-first whatever it does: one that then reads its inputs as (T, B, E) makes the ``batch_seq_swapped``
    mistake (time-first inputs handed to ``F.multi_head_attention_forward`` untransposed), which the checks show."""
    form = context_required(module, form, embed_dim)
    found = _with_residual(module, _layout_by_experiment(module, form, embed_dim), embed_dim)
    found = _refused(module, found, embed_dim)
    if found.time_first and getattr(module, "batch_first", None) is True:
        return replace(found, time_first=False, declared_batch_first=True)
    return found


_REFUSALS = (AssertionError, NotImplementedError)  # how a module says it takes no such input, not a crash


@torch.no_grad()
def _refused(module: nn.Module, form: CallForm, embed_dim: int | None) -> CallForm:
    """``form`` without the inputs the module refuses on purpose (audiocraft's ``assert attn_mask is None``,
    ``assert not need_weights``, ``assert key is query``): a plain self-attention call runs, and every call with
    the input raises AssertionError or NotImplementedError. A crash of another kind (a mask of the wrong dtype)
    is a finding, and the input stays."""
    widths = [embed_dim] if embed_dim else [p.size(-1) for p in module.parameters() if p.dim() == 2][:1]
    if not widths:
        return form
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    x = torch.randn(2, 5, widths[0], generator=torch.Generator().manual_seed(92)).to(dtype)

    def refused(tries: list[dict], qkv: tuple[Tensor, ...] = (x, x, x)) -> bool:
        for kwargs in tries:
            try:
                _call(module, form, qkv, kwargs)
            except _REFUSALS:
                continue
            except Exception:
                return False
            return False
        return True

    with evaluating(module):
        if not any((form.mask_arg, form.padding_arg, form.weights_arg, form.inputs == 3)):
            return form
        try:
            _call(module, form, (x, x, x), {})
        except Exception:
            return form
        shapes = [(5, 5), (2, 5, 5), (2, 1, 5, 5), (2, 1, 1, 5), (2, 5)]  # an assert on one shape is no refusal
        masks = [torch.ones(s, dtype=torch.bool) for s in shapes] + [torch.zeros(s, dtype=dtype) for s in shapes]
        mask = None if form.mask_arg and refused([{form.mask_arg: m} for m in masks]) else form.mask_arg
        pad = form.padding_arg
        if pad and refused([{pad: torch.zeros(2, 5, dtype=t)} for t in (torch.bool, dtype, torch.long)]):
            pad = None
        weights = None if form.weights_arg and refused([{form.weights_arg: True}]) else form.weights_arg
        causal = None if form.causal_arg and refused([{form.causal_arg: True}]) else form.causal_arg
        self_only = form.inputs == 3 and refused([{}], (x, x.clone(), x.clone()))
    return replace(
        form, mask_arg=mask, padding_arg=pad, weights_arg=weights, causal_arg=causal, self_only=self_only,
        average_arg=form.average_arg if weights else None, torch_form=form.torch_form and None not in (mask, pad, weights),
    )  # fmt: skip


@torch.no_grad()
def context_required(module: nn.Module, form: CallForm, embed_dim: int | None) -> CallForm:
    """``form`` taking K and V from its second argument when the module, called with the first alone, raises but
    runs with both (torchtune's ``forward(x, y=None)``: self-attention passes x twice, y=None reads a cache).

    The other way round, an optional second argument taken for a context by its name is dropped when the module
    runs without it but with no context tensor, of the query's length or another (MPT's ``forward(x,
    past_key_value=None, ...)``: a cache, read as ``past_key_value[0]``): self-attention only."""
    form = _context_refused(module, form, embed_dim)
    names, params = _param_names(module.forward)
    names = [n for n in names if n not in _CAUSAL_ARGS + _WEIGHTS_ARGS]
    widths = [embed_dim] if embed_dim else [p.size(-1) for p in module.parameters() if p.dim() == 2][:1]
    if form.inputs != 1 or len(names) < 2 or not widths or form.keyword_only:
        return form
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    x = torch.randn(2, 5, widths[0], generator=torch.Generator().manual_seed(94)).to(dtype)
    try:
        _call(module, form, (x, x, x), {})
        return form  # it runs on its own
    except Exception:
        pass
    both = replace(
        form, inputs=2, input_names=(names[0], names[1]), rest_by_name=_rest_by_name(params, (names[0], names[1]))
    )
    try:
        out = _first(_call(module, both, (x, x, x), {}))
    except Exception:
        return form
    return both if isinstance(out, Tensor) and out.shape == x.shape else form


@torch.no_grad()
def _context_refused(module: nn.Module, form: CallForm, embed_dim: int | None) -> CallForm:
    """``form`` as self-attention only (one input) when its optional second input, a context by its name, is
    refused: the module runs on the query alone, and raises (or answers in another shape) with a context tensor
    of the query's length and of another."""
    if form.inputs != 2 or not form.context_optional or form.keyword_only:
        return form
    widths = [embed_dim] if embed_dim else [p.size(-1) for p in module.parameters() if p.dim() == 2][:1]
    if not widths:
        return form
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    g = torch.Generator().manual_seed(93)
    x = torch.randn(2, 5, widths[0], generator=g).to(dtype)
    alone = replace(form, inputs=1, input_names=form.input_names[:1], context_optional=False, rest_by_name=False)
    with evaluating(module):
        try:
            out = _first(_call(module, alone, (x, x, x), {}))
        except Exception:
            return form
        if not isinstance(out, Tensor) or out.shape != x.shape:
            return form
        for length in (5, 3):
            c = torch.randn(2, length, widths[0], generator=g).to(dtype)
            try:
                out = _first(_call(module, form, (x, c, c), {}))
            except Exception:
                continue
            if isinstance(out, Tensor) and out.shape == x.shape:
                return form  # it takes a context
        return alone


@torch.no_grad()
def _with_residual(module: nn.Module, form: CallForm, embed_dim: int | None) -> CallForm:
    """``form`` with ``residual`` set when the module adds its query to what it returns (mmcv's identity
    connection): with every parameter zero the attention gives zeros, and such a module gives back its query."""
    if embed_dim is None or form.inputs == 0:
        return form
    g = torch.Generator().manual_seed(97)
    try:
        zeroed = copy.deepcopy(module).eval()
        for p in zeroed.parameters():
            p.zero_()
        dtype = next((p.dtype for p in zeroed.parameters() if p.is_floating_point()), torch.float32)
        x = torch.randn(2, 5, embed_dim, generator=g).to(dtype)
        out = _first(_call(zeroed, form, (x, x, x), {}))
    except Exception:
        return form
    if not isinstance(out, Tensor) or out.shape != x.shape or not torch.allclose(out, x, atol=1e-6, rtol=1e-5):
        return form
    return replace(form, residual=True)


@torch.no_grad()
def _layout_by_experiment(module: nn.Module, form: CallForm, embed_dim: int | None) -> CallForm:
    # (a wrapper that says batch_first = False, as mmcv's does, is time-first by its own word: found by experiment)
    wrapper_says = getattr(module, "batch_first", None) is False and not isinstance(module, nn.MultiheadAttention)
    if not wrapper_says and any(isinstance(m, nn.MultiheadAttention) for m in module.modules()):
        # a wrapper of torch's layer: its batch_first decides, and a wrapper that hands it (B, T, E) while it reads
        # (T, B, E) makes the batch_seq_swapped mistake (the wrapper's inputs are taken as batch-first)
        return form
    widths = [embed_dim] if embed_dim else []
    widths += [p.size(-1) for p in module.parameters() if p.dim() == 2]
    g = torch.Generator().manual_seed(99)
    with evaluating(module):
        for E in dict.fromkeys(w for w in widths if w):
            try:
                dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
                x = torch.randn(3, 5, E, generator=g).to(dtype)
                base = _first(_call(module, form, (x, x, x), {}))
                if not isinstance(base, Tensor) or base.shape != x.shape:
                    continue
                moved = x.clone()
                moved[0] += 1.0
                diff = (_first(_call(module, form, (moved, moved, moved), {})) - base).abs()
            except Exception:
                continue
            size = float(base.abs().max().clamp_min(1e-12))
            if float(diff[1:].max()) <= 1e-6 * size:
                return _with_context(module, form, E, dtype)  # batch-first
            moved = x.clone()
            moved[:, 0] += 1.0
            try:
                diff = (_first(_call(module, form, (moved, moved, moved), {})) - base).abs()
            except Exception:
                return form
            if float(diff[:, 1:].max()) <= 1e-6 * size:
                return replace(form, time_first=True)
            # rows mixed either way (a mistaken split or merge): the masks say, else the keys' axis of the scores
            found = _layout_by_padding(module, form, x)
            return found if found.time_first else _layout_by_keys(module, form, x)
    return form


def _layout_by_keys(module: nn.Module, form: CallForm, x: Tensor) -> CallForm:
    """``form`` time-first when the attention of a call on ``x`` ``(3, 5, E)`` spans 3 keys: the module reads the
    first axis of its input as the positions, whatever its merge then makes of the rows."""
    ops, err = capture_until_error(lambda: _call(module, form, (x, x, x), {}), {"x": x}, module)
    try:
        keys = {site.k.size(-2) for site in attention_sites(ops, [x])}
    except Exception:
        return form
    return replace(form, time_first=True) if err is None and keys == {x.size(0)} != {x.size(1)} else form


def _layout_by_padding(module: nn.Module, form: CallForm, x: Tensor) -> CallForm:
    """``form`` time-first when a key padding mask ``(B, T)`` fits the module only called so: a module whose rows
    mix in either layout (fairseq's split from (T, B, E) memory without its transpose) still reads its masks in
    its own."""
    if form.padding_arg is None:
        return form
    pad = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)  # (B, T), nothing padded
    runs = {}
    for time_first in (False, True):
        try:
            _call(module, replace(form, time_first=time_first), (x, x, x), {form.padding_arg: pad})
            runs[time_first] = True
        except Exception:
            runs[time_first] = False
    return replace(form, time_first=True) if runs[True] and not runs[False] else form


_Layout = Literal[
    "b1qk", "bhqk", "hbqk", "bqk", "qkb", "per_sequence", "b11k", "b1k", "bk", "bh1k", "kb", "lens", "lens_q"
]  # fmt: skip
# one mask per key: what differs between queries cannot go through
_PER_KEY = ("b11k", "b1k", "bk", "bh1k", "kb", "lens")
_SHAPES = {
    "b1qk": "(B, 1, T_q, T_k)",
    "bhqk": "(B*H, T_q, T_k)",
    "hbqk": "(H*B, T_q, T_k), head-major",
    "bqk": "(B, T_q, T_k)",
    "qkb": "(T_q, T_k, B), time-first",
    "bh1k": "(B*H, 1, T_k), one mask per key",
    "kb": "(T_k, B), time-first, one mask per key",
    "per_sequence": "one call per sequence",
    "b11k": "(B, 1, 1, T_k), one mask per key",
    "b1k": "(B, 1, T_k), one mask per key",
    "bk": "(B, T_k), one mask per key",
    "lens": "(B,), the length of each sequence",
    "lens_q": "(B, T_q), how many keys each query sees",
}


@dataclass(frozen=True)
class MaskForm:
    """What the module's attention mask means, found by :meth:`ProbedAdapter.probe_masks`."""

    bool_reading: Literal["keep", "block"] | None  # what True means to it; None: a bool mask had no clear effect
    # What the checks hand it: bool in its reading, additive float 0 / -inf, 0/1 integers or floats (1 = the
    # polarity), or valid lengths (layout "lens" / "lens_q").
    use: Literal["bool", "float", "int", "float01", "lens"]
    polarity: Literal["keep", "block"]  # for "bool", "int" and "float01"
    layout: _Layout  # a per-sequence mask
    note: str = ""  # what the probe found, for the report
    two_d: bool = True  # a (T_q, T_k) mask is handed as it is; False: expanded to the batch layout first
    fill: Literal["-inf", "min"] = "-inf"  # an additive mask's blocked value: -inf, or the dtype's finfo.min
    # it takes masks of fewer rows than its batch: one per window (Swin's (nW, N, N) for nW * B windows folded into
    # the batch); a mask whose rows repeat (windows fastest) is handed as its first period
    windows: bool = False

    def describe(self) -> str:
        one = "may attend" if self.polarity == "keep" else "blocked"
        what = {
            "float": f"additive float (0 = attend, {'-inf' if self.fill == '-inf' else 'finfo.min'} = blocked)",
            "bool": f"bool, True = {one}",
            "int": f"0/1 integers, 1 = {one}",
            "float01": f"0/1 floats, 1 = {one}",
            "lens": "valid lengths",
        }[self.use]
        if self.use == "lens":
            return f"{what} {_SHAPES[self.layout]}"
        windows = "; one mask per window (nW rows for a batch of nW * B, windows fastest)" if self.windows else ""
        if not self.two_d:
            return f"{what}, shaped {_SHAPES[self.layout]}{windows}"
        return f"{what}; per-sequence masks as {_SHAPES[self.layout]}{windows}"


# The longest sequence any check runs (odd_lengths' 1024): a module that runs it has no maximum length to find.
LONGEST = 1024
EXACT = 1e-5  # relative change of the other queries' outputs when a hidden key's input changes: rounding only
SEEN = 1e-4  # a visible key's input changing moves the outputs by more than this (relative)


def _first(out: object) -> Tensor:
    return out[0] if isinstance(out, tuple | list) else out  # type: ignore[return-value]


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode for the block (the experiments compare calls: dropout off), its own mode after."""
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


@dataclass(frozen=True)
class _Probed:
    """What the experiments found: the same for every instance of the same code (``resized``, ``cast``)."""

    form: CallForm
    masks: MaskForm
    always_causal: bool
    qkv_order: tuple[str, ...] | None
    reading: Reading | None = None  # the data flow, at this size (another size reads it again)
    padding_keeps: bool = False  # its key padding mask reads True = a real token (flash-attn's, HF's)
    max_len: int | None = None  # the longest sequence it runs (a causal buffer of fixed length); None: any
    causal_unless_masked: bool = False  # causal when no mask is handed, the mask alone otherwise
    unreadable: bool = False  # its data flow could not be read: the same code at another size is not read again


class ProbedAdapter(AttentionAdapter):
    """Any attention ``nn.Module``, called the way its ``forward`` is written.

    Args:
        module: the module to check (its weights read by data flow, see :func:`find_projections`).
        num_heads: H when the module has no ``num_heads``-like attribute (the constructor argument).
        scale: the expected multiplier of the scores (default ``1/sqrt(D)``): the truth does not
            come from the module; its own ``scale`` attribute is read only to report on it.
        mask_convention: what a bool mask should mean to this module, ``"keep"`` (True = may
            attend: SDPA's and the seeds') or ``"block"`` (True = blocked: ``nn.MultiheadAttention``'s).
            Default: ``"block"`` when the forward looks like ``nn.MultiheadAttention``'s
            (``key_padding_mask`` and ``need_weights``), else ``"keep"``. The module's actual
            reading is probed and used for every check; a mismatch fails ``mask_semantics``.
        name: shown in the report.
        factory: builds the module at another size (``resized``).
        dropout: the attention dropout the module was built with (its constructor's argument): the
            truth for the dropout checks. Default: read off the module (a float ``dropout`` attribute,
            else its first ``nn.Dropout``).
        embed_dim: E, for a module with lazy weights (``nn.LazyLinear``): one call at that width creates them.

    Attributes found by experiment: ``always_causal`` (the output at t never depends on later tokens),
    ``qkv_order`` (a fused projection's thirds in their order of use, e.g. ``("k", "q", "v")``; None when
    the projections are separate or the experiment could not tell), ``lazy`` (weights made by one call),
    ``max_len`` (the longest sequence it runs, a causal buffer's length; None when it runs ``LONGEST``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        num_heads: int | None = None,
        scale: float | None = None,
        mask_convention: Literal["keep", "block"] | None = None,
        name: str | None = None,
        factory: Callable[..., object] | None = None,
        dropout: float | None = None,
        embed_dim: int | None = None,
        materialised: bool = False,
        _forms: _Probed | None = None,
    ) -> None:
        self.module, self.factory = module, factory
        self.name = name or type(module).__name__
        self.lazy = materialised or is_lazy(module)
        if is_lazy(module):
            if embed_dim is None:
                raise NotAttention(
                    f"{type(module).__name__} has lazy weights (nn.LazyLinear): pass embed_dim= so that one call "
                    f"can create them"
                )
            materialise(module, embed_dim)
        form = _forms.form if _forms is not None else with_layout(module, read_call_form(module), embed_dim)
        self.reading = _forms.reading if _forms is not None else None
        if _forms is None or (_forms.reading is None and not _forms.unreadable):
            # its data flow is read in the layout it computes in, even where it is called in the one it declares
            self.reading = _read(module, replace(form, time_first=form.time_first or form.declared_batch_first), embed_dim)  # fmt: skip
        if self.reading is not None:
            self.reading = settle_roles(module, self.reading)
        self.found: _Found | None = find_projections(module, self.reading)
        self.use_reading = self.found is None  # its rows, as the data flow reads them, are the weights
        mha = self._mha()
        heads = mha.num_heads if mha is not None else None
        if heads is None and self.use_reading and self.reading is not None:
            heads = self.reading.num_heads  # what it computes: the softmax's head count
        if heads is None:
            heads = next((getattr(module, a) for a in _HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
        heads = heads if heads is not None else num_heads
        if heads is None or heads < 1:
            raise NotAttention(
                f"{type(module).__name__} has no num_heads attribute (looked for {', '.join(_HEAD_ATTRS)}); "
                f"pass num_heads= (on the command line: --num-heads)"
            )
        p = self.projections()
        self.num_heads = int(heads)
        self.embed_dim = p.out_weight.size(0)
        HD = p.q_weight.size(0)
        if HD % self.num_heads or p.k_weight.size(0) % (HD // self.num_heads):
            raise NotAttention(
                f"{type(module).__name__}: Q projection width {HD} and K width {p.k_weight.size(0)} do not split into "
                f"{self.num_heads} heads; pass the right --num-heads"
            )
        D = HD // self.num_heads
        self.num_kv_heads = p.k_weight.size(0) // D
        self.kdim, self.vdim = p.k_weight.size(1), p.v_weight.size(1)
        self._scale_given = scale
        self.expected_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        raw = next(
            (getattr(module, a) for a in _SCALE_ATTRS if isinstance(getattr(module, a, None), float | int)), None
        )
        self.declared_scale = None if raw is None or isinstance(raw, bool) else float(raw)
        if dropout is not None:
            self.dropout_p = float(dropout)
        else:  # what it was built with: the inner nn.MultiheadAttention's, else read off the module
            self.dropout_p = float(mha.dropout) if mha is not None else module_dropout(module, _DROPOUT_ATTRS)
        self.padding_keeps = False  # until probed
        self.padding_note = ""  # what its own words say of its padding convention, where they contradict its behaviour
        if _forms is None:
            self.form = form
            self.max_len = self.probe_max_len()
            self.convention: Literal["keep", "block"] = mask_convention or self._default_convention()
            self.bool_mask_convention = self.convention
            self.always_causal = self.probe_causal()
            self.qkv_order = None if self.found is None else self.found.order
            self.masks = self.probe_masks()
            self.form, self.masks = self.probe_ignored_mask()
            self.masks = self.probe_window_masks()
            self.padding_keeps = self.probe_padding()
            if self.form.padding_arg is None:
                self.form, self.padding_keeps = self.probe_padding_arg()
            self.padding_keeps, self.padding_note = self._stated_padding()
            if mask_convention is None and self.convention == "keep" and self.masks.bool_reading == "block":
                if not self._compares_mask():  # masked_fill(mask, -inf): True = blocked is its own convention
                    self.convention = "block"
                    self.bool_mask_convention = self.convention
            self.causal_unless_masked = False  # until probed
            self.causal_unless_masked = self.always_causal and self.probe_causal_unless_masked()
            self.always_causal = self.always_causal and not self.causal_unless_masked
            stated = self._stated_mask()
            if mask_convention is None and stated.polarity != self.masks.polarity:  # its words over its behaviour
                self.convention = self.bool_mask_convention = stated.polarity
            self.masks = stated
        else:
            self.causal_unless_masked = _forms.causal_unless_masked
            self.form, self.masks = _forms.form, _forms.masks
            self.padding_keeps, self.max_len = _forms.padding_keeps, _forms.max_len
            self.always_causal, self.qkv_order = _forms.always_causal, _forms.qkv_order
            self.convention = mask_convention or self._default_convention()
            self.bool_mask_convention = self.convention
        self.supports_cross_attention = self.form.inputs > 1 and not self.form.self_only
        self.shared_kv = self.form.inputs == 2
        self.one_length = self.supports_cross_attention and self._one_length()
        self.supports_cross_attention = self.supports_cross_attention and not self.one_length

    @torch.no_grad()
    def _one_length(self) -> bool:
        """Whether the module turns Q and K by position with one table for both, so that keys of another length
        than the queries raise (ESM-2's rotary, built at the keys' length and cut to the queries'): cross-attention
        then has no positions to relate, and it is checked as self-attention. Keys of the queries' length run."""
        if self._projections().rotary is None:
            return False
        w = self._projections().q_weight
        g = torch.Generator().manual_seed(95)
        q, kv, other = (torch.randn(2, t, self.embed_dim, generator=g).to(w) for t in (7, 7, 5))
        training = self.module.training
        self.module.eval()
        try:
            try:
                _call(self.module, self.form, (q, kv, kv.clone()), {})
            except Exception:
                return False
            try:
                _call(self.module, self.form, (q, other, other.clone()), {})
            except Exception:
                return True
            return False
        finally:
            self.module.train(training)

    def _default_convention(self) -> Literal["keep", "block"]:
        """What a bool mask should mean to it: torch's True = blocked for nn.MultiheadAttention's call form or a
        wrapper of one (its masks pass through), else SDPA's True = may attend."""
        return "block" if self.form.torch_form or self._mha() is not None else "keep"

    def _mha(self) -> nn.MultiheadAttention | None:
        if self.found is None or self.use_reading:
            return None
        found = self.found.mha
        return None if found is None else self.module.get_submodule(found)  # type: ignore[return-value]

    def _probed(self) -> _Probed:
        return _Probed(
            self.form, self.masks, self.always_causal, self.qkv_order, self.reading, self.padding_keeps, self.max_len,
            self.causal_unless_masked, self.reading is None,
        )  # fmt: skip

    def describe(self) -> str:
        """How check calls the module, for the report: its call form, what its mask means, what is folded into it."""
        f = self.form
        folded = [
            what
            for what, arg in (("key padding", f.padding_arg), ("causality", None if f.torch_form else f.causal_arg))
            if arg is None and not (what == "causality" and self.always_causal)
        ]
        mask = "no mask argument" if f.mask_arg is None else f"{f.mask_arg}: {self.masks.describe()}"
        via = f"; {' and '.join(folded)} through {f.mask_arg}" if folded and f.mask_arg else ""
        causal = "; always causal" if self.always_causal else ""
        return f"called as {f.describe()}; {mask}{via}{causal}{self._longest()}; {self.describe_weights()}"

    def _longest(self) -> str:
        if self.max_len is None:
            return ""
        return (
            f"; runs at most {self.max_len} tokens (longer inputs raise: a maximum length, found by experiment; "
            f"every check stays within it)"
        )

    @property
    def adds_query(self) -> bool:
        """Whether the module returns query + attention (an identity connection), taken off by each call."""
        return self.form.residual

    def describe_call(self) -> str | None:
        """One line: the call form, the mask convention found, causality, and where the weights came from."""
        f, parts = self.form, [f"called as {self.form.describe()}"]
        if f.mask_arg is not None:
            parts.append(f"mask: {f.mask_arg} as {self.masks.describe()}")
            if self.masks.note:
                parts.append(self.masks.note)
        if f.padding_arg is not None:
            own = "a real token" if self.padding_keeps else "padding"
            apart = ", self-attention only (cross-attention folds it into the mask)" if f.padding_self_only else ""
            parts.append(f"key padding: {f.padding_arg} (True = {own}{apart})")
            if self.padding_note:
                parts.append(self.padding_note)
        if f.residual:
            parts.append("returns query + attention (an identity connection): the query is taken off the output")
        if self.always_causal:
            parts.append("always causal (no later token reaches an earlier output)")
        elif f.mask_arg is None and f.causal_arg is None:
            parts.append("no attention-mask argument" if f.padding_arg else "no mask argument")
        if self.one_length:
            parts.append(
                "keys of another length than the queries raise (one position table for both): checked as self-attention"
            )
        if self.max_len is not None:
            parts.append(self._longest().removeprefix("; "))
        parts.append(self.describe_weights())
        maps = self.projections().head_maps or {}
        if maps:
            names = {id(m): n for n, m in self.module.named_modules()}
            each = ", ".join(f"{names.get(id(h.module), type(h.module).__name__)} on {r}" for r, h in maps.items())
            parts.append(f"a per-vector map of the heads before the scores ({each}; qk-norm), applied by the reference")
            if self._mapless is not None and self._mapless.rotary is not None and not self.use_reading:
                parts.append(f"then {self._mapless.rotary.describe()}, read with those maps taken out")
        if self.projections().score_map is not None:
            parts.append(self.projections().score_map.describe())
        return "; ".join(parts)

    def describe_weights(self) -> str:
        """Where the q, k, v and out weights were found (and any redrawn, see ``distinct_copies``)."""
        if self.use_reading and self.reading is not None:
            return self.reading.describe()
        found = self.found
        assert found is not None
        if found.mha is not None:
            mha = self._mha()
            assert mha is not None
            first = "batch_first=True" if mha.batch_first else "batch_first=False, (T, B, E) inputs"
            return f"projections of the nn.MultiheadAttention {found.mha} ({first}), called through your forward"
        if found.qkv is not None:
            order = (
                f"split as {', '.join(self.qkv_order)} (their order of use, read by data flow)"
                if self.qkv_order
                else "split in thirds, taken as q, k, v (their data flow could not be read)"
            )
            return f"fused {found.qkv} {order}; out {found.out}"
        lazy = " (LazyLinear, materialised by one call)" if self.lazy else ""
        copies = getattr(self.module, "_attnlab_redrawn", ())  # see attnlab.check.target.distinct_copies
        zero = [c.removesuffix(" (all zero)") for c in copies if c.endswith(" (all zero)")]
        same = [c for c in copies if not c.endswith(" (all zero)")]
        said = [f"{', '.join(zero)} all zero"] * bool(zero)
        said += [f"{', '.join(same)} were copies of an earlier projection's weights"] * bool(same)
        if said:
            lazy += f" ({'; '.join(said)}: redrawn, seeded)"
        if found.listed is not None:
            return f"projections {found.listed}[0..3] taken as q, k, v, out{lazy}"
        return f"projections {found.q}, {found.k}, {found.v}, {found.out}{lazy}"

    # -- the protocol ------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self.expected_scale

    def projections(self) -> Projections:
        p = self._projections()
        if not hasattr(self, "form"):  # still being built: its call form is not known yet
            return p
        if not hasattr(self, "_head_maps"):
            self._head_maps = find_head_maps(self.module, self.form, p, self.num_heads, self.num_kv_heads)
            # the data flow cannot be read through a norm: read once more with the maps taken out, for the rotary
            # the module applies after them (Qwen3's, OLMo's q_norm then rotary)
            self._mapless: Reading | None = None
            if self._head_maps and p.rotary is None:
                form = replace(self.form, time_first=self.form.time_first or self.form.declared_batch_first)
                self._mapless = _read(_without(self.module, self._head_maps), form, self.embed_dim)
                if self.reading is None and self._mapless is not None:  # the rows, too, as read without them
                    settled = settle_roles(self.module, self._mapless)
                    if find_projections(self.module, settled) is None:  # rows no name reads (packed per head)
                        self.reading, self.found, self.use_reading = settled, None, True
                        p = self._projections()
        if self._mapless is not None and self._mapless.rotary is not None and p.rotary is None:
            p = replace(p, rotary=self._mapless.rotary)
        p = replace(p, head_maps=self._head_maps) if self._head_maps else p
        if not hasattr(self, "causal_unless_masked"):  # still probing: the map is read once that is done
            return p
        if not hasattr(self, "_score_map"):
            self._score_map: ScoreMap | None = None  # while it is read, the module runs without one
            self._score_map = read_score_map(partial(self._score_sample, p), PROBE_T)
        p = p if self._score_map is None else replace(p, score_map=self._score_map)
        if not hasattr(self, "_gate"):
            self._gate: OutputGate | None = None  # while it is read, the reference has none
            with evaluating(self.module):
                self._gate = find_gate(self, self.module, self.embed_dim, self.kdim, self.num_heads, p.q_weight.size(0))
        return p if self._gate is None else replace(p, gate=self._gate)

    @torch.no_grad()
    def _score_sample(self, p: Projections, T_q: int, T_k: int, gain: float) -> Sample:
        """One self-attention run (cross where ``T_q != T_k``) under capture, seeded by its lengths and gain: the
        tensors :func:`attnlab.check.scoremap.read_score_map` reads (raises Unsupported where none can be read)."""
        g = torch.Generator().manual_seed(T_q * 1009 + T_k * 31 + int(gain))
        w = p.q_weight
        q = (torch.randn(1, T_q, self.embed_dim, generator=g) * gain).to(w)
        kv = q if T_q == T_k else (torch.randn(1, T_k, self.kdim, generator=g) * gain).to(w)
        ops = capture(lambda: self(q, kv, kv), {"query": q, "key": kv}, self.module)
        want = recipe_attention(
            p, q, kv, kv, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, scale=self.scale,
            is_causal=self.always_causal,
        )["scaled"]  # (1, H, T_q, T_k)  # fmt: skip
        found = scores_of(ops, want)
        if found is None:
            raise Unsupported(f"no softmax of the scores' shape {list(want.shape)} in {self.name}'s ops")
        keep = causal_keep(T_q, T_k, want.device) if self.always_causal else torch.ones_like(want, dtype=torch.bool)
        return (*found, want, keep.expand_as(want))

    def _projections(self) -> Projections:
        if self.use_reading and self.reading is not None:
            return _read_projections(self.module, self.reading)
        named = self._named_projections()
        if self.reading is not None and self.reading.rotary is not None:
            return replace(named, rotary=self.reading.rotary)  # the position map it applies, found by data flow
        return named

    def _named_projections(self) -> Projections:
        f, m = self.found, self.module
        assert f is not None
        mha = self._mha()
        if mha is not None:
            return mha_projections(mha)

        def lin(path: str) -> tuple[Tensor, Tensor | None]:
            return linear_weights(m.get_submodule(path))  # a Linear (or Conv1D) itself: find_projections saw it

        wo, bo = lin(f.out)
        if f.qkv is not None:  # in the conventional order q, k, v: a module using another is a finding
            w, b = lin(f.qkv)
            wq, wk, wv = w.chunk(3)  # (E, E) each
            bq = bk = bv = None
            if b is not None:
                bq, bk, bv = b.chunk(3)
            return Projections(wq, wk, wv, wo, bq, bk, bv, bo)
        (wq, bq), (wk, bk), (wv, bv) = lin(f.q), lin(f.k), lin(f.v)  # type: ignore[arg-type]
        return Projections(wq, wk, wv, wo, bq, bk, bv, bo)

    def __call__(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        return _first(self._run(query, key, value, keep_mask, key_padding_mask, is_causal, weights=False))

    def attention_weights(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        """The weights the module returns, ``(B, H, T_q, T_k)`` or head-averaged ``(B, T_q, T_k)``."""
        out = self._run(query, key, value, keep_mask, key_padding_mask, is_causal, weights=True)
        if not isinstance(out, tuple | list) or len(out) < 2 or not isinstance(out[1], Tensor):
            how = f"with {self.form.weights_arg}=True" if self.form.weights_arg else "(it has no need_weights)"
            raise Unsupported(f"{self.name} returns no attention weights {how}")
        return out[1]

    def set_training(self, mode: bool) -> None:
        self.module.train(mode)

    def raw_bool_mask(self, query: Tensor, mask: Tensor) -> Tensor:
        """Self-attention with a bool ``(T_q, T_k)`` mask whose values are handed over as they are: in the
        shape the module takes, as 0/1 where it takes numbers."""
        arg, mf = self.form.mask_arg, self.masks
        if arg is None:
            raise Unsupported(f"{self.name}.forward takes no attention mask")
        if mf.use == "lens":
            raise Unsupported(f"{self.name}.forward takes valid lengths ({arg}), not a bool mask")
        if not mf.two_d:
            mask = self._shaped(mask.expand(query.size(0), *mask.shape))  # (B, ...) in its layout
        # A module that only adds what it is handed takes additive masks by design; one that converts it
        # (attention_mask * 1.0, .float(), masked_fill) takes bools, whatever its argument's name
        if mf.use == "float" and mf.bool_reading is None and not self._converts_bool_mask(query, mask):
            raise Unsupported(
                f"{self.name}.forward's {arg} takes additive float masks only: a bool mask is not what it takes"
            )
        if mf.use in ("int", "float01"):
            mask = mask.long() if mf.use == "int" else mask.to(query.dtype)
        return _first(self._invoke(query, query, query, {arg: mask}))

    def _mask_uses(self, query: Tensor, mask: Tensor) -> list[str] | None:
        """The ops that consume a bool ``mask`` handed to the module (after its reshapes): ``masked_fill``,
        ``eq``, ``add`` ...; None when the call raises."""
        arg = self.form.mask_arg
        assert arg is not None
        derived = {id(mask)}
        keep_alive: list[object] = [mask]
        uses: list[str] = []
        reshapes = (
            "expand",
            "expand_as",
            "view",
            "reshape",
            "unsqueeze",
            "getitem",
            "repeat",
            "repeat_interleave",
            "to",
            "contiguous",
            "squeeze",
        )

        class _Watch(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                flat = [b for a in args for b in (a if isinstance(a, list | tuple) else (a,))]
                if any(isinstance(a, Tensor) and id(a) in derived for a in flat):
                    name = getattr(func, "__name__", "").strip("_")
                    if name in reshapes and isinstance(out, Tensor) and out.dtype == mask.dtype:
                        derived.add(id(out))
                        keep_alive.append(out)
                    else:
                        uses.append(name)
                return out

        try:
            with torch.no_grad(), _Watch():
                self._invoke(query, query, query, {arg: mask})
        except Exception:
            return None
        return uses

    def _converts_bool_mask(self, query: Tensor, mask: Tensor) -> bool:
        """Whether the module is written for bool masks: it fills, selects or converts with the mask it is handed
        (``masked_fill``, ``where``, ``~mask``, ``mask.float()``). A module that only adds what it is handed to
        the scores takes additive float masks by design, and a bool mask is no input of its."""
        uses = self._mask_uses(query, mask)
        adds = ("add", "radd", "iadd", "sub", "rsub", "isub")
        reads = (
            "get",
            "size",
            "dim",
            "numel",
            "is_floating_point",
            "is_complex",
        )  # mask.shape[0]: no use of its values
        return uses is not None and any(u not in adds + reads for u in uses)

    def _compares_mask(self) -> bool:
        """Whether the module compares its mask with numbers (``mask == 0``, ``mask == 1``): it takes 0/1 data,
        whose convention (the seeds', the Annotated Transformer's, d2l's) is 1 = may attend. A module that
        fills where its bool mask is True, with no comparison, says by that that True = blocked."""
        T = 5
        x = torch.randn(2, T, self.embed_dim, generator=torch.Generator().manual_seed(5))
        x = x.to(self.projections().q_weight)
        keep = ~torch.eye(T, dtype=torch.bool)
        try:  # the mask in the module's own form (shape, 0/1 numbers), in its bool reading
            mask = self._mask(keep if self.masks.two_d else keep.expand(2, T, T))
        except Unsupported:
            return False
        uses = self._mask_uses(x, mask)
        return uses is not None and any(u in ("eq", "ne", "lt", "le", "gt", "ge") for u in uses)

    def cast(self, dtype: torch.dtype) -> ProbedAdapter:
        sibling = self._sibling(copy.deepcopy(self.module).to(dtype), self._probed())
        sibling._score_map = self.projections().score_map  # read at full precision: in half it reads coarser
        return sibling

    def to(self, device: torch.device, dtype: torch.dtype) -> ProbedAdapter:
        """A copy on ``device`` in ``dtype``, probed again there: its mask may read otherwise on another device."""
        return self._sibling(copy.deepcopy(self.module).to(device=device, dtype=dtype), None)

    def parameters(self) -> list[Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def resized(self, embed_dim: int, num_heads: int, num_kv_heads: int) -> AttentionAdapter:
        made = self._build(embed_dim, num_heads, num_kv_heads)
        if not isinstance(made, nn.Module):
            return _same_size(_wrap(made), embed_dim, num_heads, num_kv_heads)
        x = torch.zeros(1, 3, embed_dim, dtype=next((p.dtype for p in made.parameters()), torch.float32))
        try:  # a width fixed inside (a module-level n_embd) cannot follow the sizes it was built with
            with torch.no_grad():
                _call(made.eval(), self.form, (x, x, x), {})
        except Exception as e:
            raise Unsupported(
                f"{self.name} rebuilt at E={embed_dim}, H={num_heads} does not run at that width "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): a size fixed in its code"
            ) from None
        # the same code at another size: its call form and mask reading are the same; its data flow is read again
        built = self._sibling(made, replace(self._probed(), reading=None), num_heads, embed_dim)
        return _same_size(built, embed_dim, num_heads, num_kv_heads)

    def _sibling(
        self, module: nn.Module, forms: _Probed | None, heads: int | None = None, width: int | None = None
    ) -> ProbedAdapter:
        """An adapter of ``module`` built as this one was, with the call forms ``forms`` (None: found again on the
        first call); ``heads``, ``width``: another size than this one's."""
        return ProbedAdapter(
            module,
            num_heads=self.num_heads if heads is None else heads,
            scale=self._scale_given,
            mask_convention=self.convention,
            name=self.name,
            factory=self.factory,
            dropout=self.dropout_p,
            embed_dim=self.embed_dim if width is None else width,
            materialised=self.lazy,
            _forms=forms,
        )

    # -- calling the module ----------------------------------------------------------------------
    def _invoke(self, query: Tensor, key: Tensor, value: Tensor, kwargs: dict) -> object:
        form = self.form
        if form.inputs == 2 and value is not key:
            raise Unsupported(f"{self.name} takes one context for K and V ({form.describe()})")
        if (form.inputs == 1 or form.self_only) and (key is not query or value is not query):
            raise Unsupported(f"{self.name} is self-attention only ({form.describe()})")
        if self._causal_by_default and form.causal_arg not in kwargs:
            kwargs = {**kwargs, form.causal_arg: False}  # MPT's is_causal=True: a plain call says it is not
        return _call(self.module, form, (query, key, value), kwargs)

    @property
    def _causal_by_default(self) -> bool:
        """Whether forward's causal argument defaults to True (MPT's ``is_causal=True``): then a call that is not
        causal has to say so."""
        arg = self.form.causal_arg
        if arg is None or self.form.torch_form:
            return False
        try:
            param = inspect.signature(self.module.forward).parameters.get(arg)
        except (TypeError, ValueError):
            return False
        return param is not None and param.default is True

    def _run(self, query, key, value, keep_mask, key_padding_mask, is_causal, *, weights: bool) -> object:
        form = self.form
        B, T_q, T_k = query.size(0), query.size(1), key.size(1)
        kwargs: dict[str, object] = {}
        if form.weights_arg is not None:
            kwargs[form.weights_arg] = weights
            if weights and form.average_arg is not None:
                kwargs[form.average_arg] = False  # per-head weights
        keep: Tensor | None = keep_mask  # (T_q, T_k) or (B, T_q, T_k), True = may attend
        cross = key is not query
        if key_padding_mask is not None:
            if form.padding_arg is not None and not (cross and form.padding_self_only):
                # in its own polarity: True = padding, or True = a real token
                kwargs[form.padding_arg] = ~key_padding_mask if self.padding_keeps else key_padding_mask
            else:
                pad_keep = (~key_padding_mask)[:, None, :].expand(B, T_q, T_k)  # (B, T_q, T_k)
                keep = pad_keep if keep is None else keep & pad_keep
        if self.causal_unless_masked and keep is None and not is_causal:  # mask-less it would be causal: all keys
            keep = torch.ones(T_q, T_k, dtype=torch.bool, device=query.device)  # (T_q, T_k)
        if is_causal and not self.always_causal:  # an always-causal module masks the future by itself
            if self.causal_unless_masked and keep is None and T_q == T_k:  # so does one handed no mask: its own
                return self._invoke(query, key, value, kwargs)  # causal mask is then what is checked
            if form.causal_arg is not None and not form.torch_form:
                kwargs[form.causal_arg] = True
            else:
                tri = causal_keep(T_q, T_k, query.device)  # (T_q, T_k)
                keep = tri if keep is None else keep & tri
        if keep is None:
            return self._invoke(query, key, value, kwargs)
        if form.mask_arg is None:
            what = (
                "an attention mask"
                if keep_mask is not None
                else "key padding"
                if form.padding_arg is None and key_padding_mask is not None
                else "causal masking"
            )
            raise Unsupported(f"{self.name}.forward takes no attention mask, so {what} cannot be handed to it ({form.describe()})")  # fmt: skip
        if keep.dim() == 2 and self.masks.two_d:
            return self._invoke(query, key, value, {**kwargs, form.mask_arg: self._mask(keep)})
        if keep.dim() == 2:
            keep = keep.expand(B, T_q, T_k)  # (B, T_q, T_k): the module takes per-sequence masks only
        if self.masks.layout == "per_sequence":  # each sequence alone, with its own 2-D mask
            outs = []
            for b in range(B):
                kw_b = {n: (t[b : b + 1] if isinstance(t, Tensor) and t.dim() >= 2 else t) for n, t in kwargs.items()}
                kw_b[form.mask_arg] = self._mask(keep[b])
                outs.append(self._invoke(*_sequence(query, key, value, b), kw_b))
            return _cat(outs)
        if self.masks.windows and keep.dim() == 3:  # one row per window: a mask that repeats goes as its period
            keep = keep[: mask_period(keep)]
        return self._invoke(query, key, value, {**kwargs, form.mask_arg: self._mask(keep)})

    @property
    def window_masks(self) -> bool:
        """Whether it takes one mask per window, fewer rows than its batch (see :meth:`probe_window_masks`)."""
        return self.masks.windows

    @torch.no_grad()
    def probe_window_masks(self) -> MaskForm:
        """The masks, with ``windows`` set where the module takes masks of fewer rows than its batch and each
        row reaches its outputs: a batch of 4 runs with 2 masks, and swapping the 2 changes the output (Swin's
        window attention: ``(nW, N, N)`` masks for ``nW * B`` windows folded into the batch)."""
        mf = self.masks
        arg = self.form.mask_arg
        if arg is None or mf.use == "lens" or mf.layout not in ("bqk", "b1qk"):
            return mf
        g = torch.Generator().manual_seed(4242)
        w = self.projections().q_weight
        T = 6
        x = torch.randn(4, T, self.embed_dim, generator=g).to(w)  # (nW * B, T, E): 2 windows, 2 images
        keep = torch.rand(2, T, T, generator=g) > 0.5  # (nW, T, T)
        keep[..., 0] = True
        try:
            with evaluating(self.module):
                outs = [_first(self._invoke(x, x, x, {arg: self._mask(k)})) for k in (keep, keep.flip(0))]
        except Exception:
            return mf
        if any(not isinstance(o, Tensor) or o.shape != x.shape or not bool(torch.isfinite(o).all()) for o in outs):
            return mf
        size = float(outs[0].abs().max().clamp_min(1e-12))
        return replace(mf, windows=True) if float((outs[0] - outs[1]).abs().max()) > SEEN * size else mf

    def _mask(self, keep: Tensor) -> Tensor:
        """A keep mask ``(T_q, T_k)`` or ``(B, T_q, T_k)`` in the module's own form."""
        mf = self.masks
        if mf.use == "lens":
            return self._lengths(keep)
        dtype = self.projections().q_weight.dtype
        if mf.use == "float":
            blocked = float("-inf") if mf.fill == "-inf" else torch.finfo(dtype).min
            m: Tensor = torch.zeros(keep.shape, device=keep.device, dtype=dtype).masked_fill(~keep, blocked)
        else:
            m = keep if mf.polarity == "keep" else ~keep
            if mf.use == "int":
                m = m.long()
            elif mf.use == "float01":
                m = m.to(dtype)
        return m if keep.dim() == 2 else self._shaped(m)

    def _shaped(self, m: Tensor) -> Tensor:
        """A per-sequence mask ``(B, T_q, T_k)``, already in the module's values, in its layout."""
        layout = self.masks.layout
        if layout == "b1qk":
            return m[:, None]  # (B, 1, T_q, T_k)
        if layout == "bhqk":
            return m.repeat_interleave(self.num_heads, dim=0)  # (B*H, T_q, T_k), batch-major
        if layout == "hbqk":
            return m.repeat(self.num_heads, 1, 1)  # (H*B, T_q, T_k), head-major
        if layout == "qkb":
            return m.permute(1, 2, 0)  # (T_q, T_k, B)
        if layout in ("bqk", "per_sequence"):
            return m  # (B, T_q, T_k)
        if not bool((m == m[:, :1]).all()):
            raise Unsupported(
                f"{self.name}.forward's {self.form.mask_arg} takes one mask per key "
                f"{_SHAPES[layout].removesuffix(', one mask per key')}: "
                f"a mask that differs between queries (causal, or any (T_q, T_k) mask) cannot be handed to it"
            )
        per_key = m[:, 0]  # (B, T_k)
        if layout == "b11k":
            return per_key[:, None, None]  # (B, 1, 1, T_k)
        if layout == "b1k":
            return per_key[:, None]  # (B, 1, T_k)
        if layout == "bh1k":
            return per_key.repeat_interleave(self.num_heads, dim=0)[:, None]  # (B*H, 1, T_k)
        if layout == "kb":
            return per_key.t()  # (T_k, B)
        return per_key  # (B, T_k)

    def _lengths(self, keep: Tensor) -> Tensor:
        """Valid lengths ``(B,)`` or ``(B, T_q)`` for a keep mask that is a prefix of the keys in every row."""
        B = keep.size(0) if keep.dim() == 3 else 1
        keep = keep if keep.dim() == 3 else keep.expand(B, *keep.shape)  # (B, T_q, T_k)
        lens = keep.sum(-1)  # (B, T_q)
        prefix = torch.arange(keep.size(-1), device=keep.device) < lens[..., None]  # (B, T_q, T_k)
        arg = self.form.mask_arg
        if not bool((prefix == keep).all()):
            raise Unsupported(
                f"{self.name}.forward takes valid lengths ({arg}): only masks that hide the last keys of a "
                f"row can be handed to it"
            )
        if self.masks.layout == "lens_q":
            return lens  # (B, T_q)
        if not bool((lens == lens[:, :1]).all()):
            raise Unsupported(
                f"{self.name}.forward takes one valid length per sequence ({arg} (B,)): a mask that differs "
                f"between queries (causal) cannot be handed to it"
            )
        return lens[:, 0]  # (B,)

    # -- probing -------------------------------------------------------------------------------
    def _plain(self, x: Tensor) -> Tensor:
        """Self-attention of ``x`` with no mask at all."""
        return _first(self._invoke(x, x, x, {}))

    @torch.no_grad()
    def probe_ignored_mask(self) -> tuple[CallForm, MaskForm]:
        """The call form and mask form with the masks handed through a second attention-mask argument that the
        module accepts and ignores (CLIP's ``causal_attention_mask`` beside ``attention_mask``), when there is one.

        A mask argument that changes nothing, in the form the first one takes, while the first one hides a key,
        is the mistake ``mask_ignored``: the checks hand their masks through it, so that their rows show it.
        The arguments looked at are the listed mask names and any other ``*mask*`` but those of
        :data:`_UNUSED_ALONE` (padding, head, encoder, cross or context masks, which a self-attention call may
        leave unused)."""
        form, masks = self.form, self.masks
        if form.mask_arg is None or masks.use == "lens":
            return form, masks
        params = inspect.signature(self.module.forward).parameters
        others = [
            n
            for n, p in params.items()
            if n != form.mask_arg
            and p.default is None
            and (n in _MASK_ARGS or ("mask" in name_key(n) and not any(w in name_key(n) for w in _UNUSED_ALONE)))
        ]
        if not others:
            return form, masks
        w = self.projections().q_weight
        B, T = 2, 6
        x = torch.randn(B, T, self.embed_dim, generator=torch.Generator().manual_seed(4324)).to(w)  # (B, T, E)
        keep = torch.ones(T, T, dtype=torch.bool, device=w.device)
        keep[:, 2] = False  # (T, T): key 2 hidden
        try:
            with evaluating(self.module):
                mask = self._mask(keep if masks.two_d else keep.expand(B, T, T))
                plain = _first(self._invoke(x, x, x, {}))
                size = float(plain.abs().max().clamp_min(1e-12))
                if float((_first(self._invoke(x, x, x, {form.mask_arg: mask})) - plain).abs().max()) <= SEEN * size:
                    return form, masks  # the first mask changes nothing either: nothing to compare with
                for name in others:
                    try:
                        out = _first(self._invoke(x, x, x, {name: mask}))
                    except Exception:
                        continue  # it takes another form: not ignored
                    if isinstance(out, Tensor) and out.shape == plain.shape and torch.equal(out, plain):
                        note = (
                            f"{name} changes nothing (a mask hiding a key, in the form {form.mask_arg} takes, leaves "
                            f"every output as it is) while {form.mask_arg} masks: the checks hand their masks through "
                            f"{name}"
                        )
                        return replace(form, mask_arg=name), replace(masks, note=note)
        except Exception:
            return form, masks
        return form, masks

    def _stated_padding(self) -> tuple[bool, str]:
        """``(padding_keeps, note)``: a key padding convention stated in the forward's own docstring or comments
        (``True = keep``) is what the checks hand, even where the module behaves the other way round: behaviour
        alone cannot tell an inverted mask from the other convention, its words can (``padding_inverted``)."""
        arg = self.form.padding_arg
        if arg is None or self.form.torch_form:
            return self.padding_keeps, ""
        stated = stated_polarity(self.module.forward, arg)
        if stated is None:
            return self.padding_keeps, UNSTATED
        if (stated == "keep") == self.padding_keeps:
            return self.padding_keeps, ""
        said, does = ("a real token", "padding") if stated == "keep" else ("padding", "a real token")
        note = (
            f"{arg}: its docstring says True = {said}, but it behaves as True = {does}; the checks hand it as "
            f"its docstring says"
        )
        return stated == "keep", note

    def _stated_mask(self) -> MaskForm:
        """The mask in the convention the module's own words state for its mask argument, where its behaviour reads
        the other way round (``padding_inverted``): a statement in its docstring or comments (``attention_mask:
        1 for tokens to attend``), else, for a mask of one value per key, Hugging Face's documented meaning of the
        name ``attention_mask`` (1 = a real token). The probe alone cannot tell an inverted mask from the other
        convention; these words can."""
        arg, m = self.form.mask_arg, self.masks
        if arg is None or self.form.torch_form or m.use not in ("bool", "int", "float01"):
            return m
        stated, whose = stated_polarity(self.module.forward, arg), "its docstring"
        if stated is None and name_key(arg) == "attentionmask" and m.layout in _PER_KEY:
            stated, whose = "keep", "Hugging Face's attention_mask"
        if stated == m.polarity:
            return m
        if stated is None:  # said only where the experiment read it cleanly
            return replace(m, note=UNSTATED) if not m.note and (m.use != "bool" or m.bool_reading) else m
        said, does = ("a real token", "padding") if stated == "keep" else ("padding", "a real token")
        note = f"{whose} says 1/True = {said}, but it behaves as 1/True = {does}; the checks hand it as stated"
        return replace(m, polarity=stated, note=f"{m.note}; {note}" if m.note else note)

    @torch.no_grad()
    def probe_padding_arg(self) -> tuple[CallForm, bool]:
        """``(the call form, whether its padding reads True = keep)`` with a key padding argument found by
        experiment among the other mask arguments (x-transformers' ``mask`` (B, T) beside ``attn_mask``).

        A ``(B, T)`` bool argument is one when a constant mask in one polarity leaves the output exactly as no
        mask does (its polarity: all True, True = keep; all False, True = padding) and hiding position p in that
        polarity changes the outputs: at the other positions (it masks keys), or at position p alone (it masks
        the queries instead: the mistake ``padding_on_queries``, which the padding rows then show)."""
        form = self.form
        params = inspect.signature(self.module.forward).parameters
        named = set(form.input_names) | {form.mask_arg, form.causal_arg, form.weights_arg, form.average_arg}
        others = [n for n, p in params.items() if n not in named and p.default is None and "mask" in name_key(n)]
        others = [n for n in others if not any(w in name_key(n) for w in ("causal", "head", "encoder", "cross"))]
        if not others:
            return form, self.padding_keeps
        w = self.projections().q_weight
        B, T, p = 2, 6, 3
        g = torch.Generator().manual_seed(4325)
        x = torch.randn(B, T, self.embed_dim, generator=g).to(w)  # (B, T, E)
        c = torch.randn(B, T - 1, self.embed_dim, generator=g).to(w)  # (B, T_k, E): a context, for cross calls

        def acts(name: str, q: Tensor, kv: Tensor) -> tuple[bool, bool] | None:
            """(True = keep, on keys) for ``name`` on the call (q, kv, kv); None: no padding argument there."""
            run = lambda m: _first(self._invoke(q, kv, kv, {name: m}))
            plain = _first(self._invoke(q, kv, kv, {}))
            size = float(plain.abs().max().clamp_min(1e-12))
            ones = torch.ones(B, kv.size(1), dtype=torch.bool, device=w.device)  # (B, T_k)
            keeps = next((k for k, m in ((True, ones), (False, ~ones)) if torch.allclose(run(m), plain, rtol=0, atol=EXACT * size)), None)  # fmt: skip
            if keeps is None:
                return None
            hide = ones.clone()
            hide[:, p] = False  # (B, T_k): position p padded
            moved = (run(hide if keeps else ~hide) - plain).abs().amax(-1) / size  # (B, T_q)
            others_move = bool((moved[:, [i for i in range(q.size(1)) if i != p]] > SEEN).any())
            if others_move:
                return keeps, True
            return (keeps, False) if q is kv and bool((moved[:, p] > SEEN).all()) else None

        with evaluating(self.module):
            for name in others:
                try:
                    found = acts(name, x, x)
                except Exception:
                    continue
                if found is None:
                    continue
                keeps = found[0]
                self_only = False
                if form.inputs > 1:
                    try:
                        cross = acts(name, x, c)
                    except Exception:
                        cross = None
                    self_only = cross is None or cross != (keeps, True)
                return replace(form, padding_arg=name, padding_self_only=self_only), keeps
        return form, self.padding_keeps

    @torch.no_grad()
    def probe_padding(self) -> bool:
        """Whether its key padding argument reads True = a real token: a mask True at key 0 only hides that key
        (changing token 0 then leaves the later outputs alone) in the module's reading of True = padding; else,
        when the complement hides it, True = keep."""
        arg = self.form.padding_arg
        if (
            arg is None
            or self.form.torch_form
            or any(isinstance(m, nn.MultiheadAttention) for m in self.module.modules())
        ):
            return False  # torch's own layer inside: its convention, True = padding, is the wrapper's too
        g = torch.Generator().manual_seed(4322)
        w = self.projections().q_weight
        x = torch.randn(2, 6, self.embed_dim, generator=g).to(w)  # (B, T, E)
        moved = x.clone()
        moved[:, 0] += 2.0
        first = torch.zeros(2, 6, dtype=torch.bool, device=x.device)
        first[:, 0] = True

        def hides(m: Tensor) -> bool:
            a = _first(self._invoke(x, x, x, {arg: m}))
            b = _first(self._invoke(moved, moved, moved, {arg: m}))
            return float((a - b)[:, 1:].abs().max()) <= EXACT * float(a.abs().max().clamp_min(1e-12))

        def sees_others(m: Tensor) -> bool:  # the keys it keeps reach the other queries: a key mask
            other = x.clone()
            other[:, 2] += 2.0
            a = _first(self._invoke(x, x, x, {arg: m}))
            b = _first(self._invoke(other, other, other, {arg: m}))
            return float((a - b)[:, [1, 3, 4, 5]].abs().max()) > SEEN * float(a.abs().max().clamp_min(1e-12))

        try:
            with evaluating(self.module):
                return not hides(first) and hides(~first) and sees_others(~first)
        except Exception:
            return False

    @torch.no_grad()
    def probe_max_len(self) -> int | None:
        """The longest self-attention input it runs, by experiment; None when it runs ``LONGEST`` tokens.

        A causal buffer sized by a module global (Karpathy's ``tril`` of ``block_size``) caps the length: that
        is a maximum, not a mistake, and the checks keep every row within it. The longest length that runs is
        found by bisection between 8 tokens (which must run: else there is no maximum to speak of, and the
        checks show what fails) and ``LONGEST``; it must run at every length probed below it."""
        w = self.projections().q_weight
        g = torch.Generator().manual_seed(4323)

        def runs(T: int) -> bool:
            x = torch.randn(1, T, self.embed_dim, generator=g).to(w)  # (1, T, E)
            try:
                out = self._plain(x)
            except Exception:
                return False
            return isinstance(out, Tensor) and out.shape == x.shape

        with evaluating(self.module):
            if runs(LONGEST) or not runs(8):
                return None
            lo, hi = 8, LONGEST  # runs(lo), not runs(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if runs(mid) else (lo, mid)
            # a maximum, not a length the module happens to fail at: shorter lengths all run
            if not all(runs(T) for T in {lo - 1, lo // 2 + 1, (lo + 8) // 2}):
                return None
            return lo

    @torch.no_grad()
    def probe_causal(self) -> bool:
        """Whether the module is causal on its own: changing token 4 leaves outputs 0..3 exactly alone while it
        moves outputs 5.., and changing token 1 moves the outputs after it."""
        if self.form.causal_arg is not None and not self.form.torch_form:
            return False  # it is told when to be causal
        g = torch.Generator().manual_seed(4321)
        w = self.projections().q_weight
        B, T, p = 2, 7, 4
        x = torch.randn(B, T, self.embed_dim, generator=g).to(w)  # (B, T, E)
        try:
            with evaluating(self.module):
                base = self._plain(x)
                if not isinstance(base, Tensor) or base.shape != x.shape or not bool(torch.isfinite(base).all()):
                    return False
                moved = {i: x.clone() for i in (1, p)}
                for i, t in moved.items():
                    t[:, i] += 3.0 * torch.randn(B, self.embed_dim, generator=g).to(w)
                late, early = self._plain(moved[p]) - base, self._plain(moved[1]) - base  # (B, T, E) each
        except Exception:
            return False
        size = base.abs().max().clamp_min(1e-12)
        # output 0 aside: a mask that hides each query's own key leaves query 0 none, and its fill decides what it
        # sees (a finite fill: every key, evenly)
        past_alone = float(late[:, 1:p].abs().max() / size) <= EXACT
        reaches_later = float(late[:, p + 1 :].abs().max() / size) > SEEN
        earlier_reaches = float(early[:, 2:].abs().max() / size) > SEEN
        return (past_alone or self._weights_causal(x, lambda: self._plain(x))) and reaches_later and earlier_reaches

    @torch.no_grad()
    def _softmaxes(self, x: Tensor, call: Callable[[], object]) -> list[Tensor]:
        """The ``(..., T, T)`` attention weights of every softmax ``call`` (self-attention of ``x`` ``(B, T, E)``)
        computes; none where it raises."""
        with evaluating(self.module):
            ops, err = capture_until_error(call, {"x": x}, self.module)
        T = x.size(1)
        return [] if err else [op.out for op in ops if op.func in SOFTMAX_OPS and tuple(op.out.shape[-2:]) == (T, T)]

    def _weights_causal(self, x: Tensor, call: Callable[[], object]) -> bool:
        """Whether ``call``'s attention weights are all zero above the diagonal: causal by what it attends to,
        where its outputs mix positions afterwards (a mistaken merge)."""
        weights = self._softmaxes(x, call)
        above = torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device).triu(1)
        above[0] = False  # query 0 aside, as in probe_causal
        return bool(weights) and all(bool((w[..., above] == 0).all()) for w in weights)

    @torch.no_grad()
    def probe_causal_unless_masked(self) -> bool:
        """Whether a module found causal is so only when no mask is handed (torchtune's and Hugging Face's SDPA
        paths: ``is_causal = mask is None``): with a mask that keeps every key, a later token reaches earlier
        outputs."""
        if self.form.mask_arg is None or self.form.causal_arg is not None:
            return False
        g = torch.Generator().manual_seed(4322)
        w = self.projections().q_weight
        B, T, p = 2, 7, 4
        x = torch.randn(B, T, self.embed_dim, generator=g).to(w)  # (B, T, E)
        moved = x.clone()
        moved[:, p] += 3.0 * torch.randn(B, self.embed_dim, generator=g).to(w)
        every = torch.ones(T, T, dtype=torch.bool, device=w.device)  # (T, T): every key kept
        try:
            with evaluating(self.module):
                base = _first(self._run(x, x, x, every, None, False, weights=False))
                late = _first(self._run(moved, moved, moved, every, None, False, weights=False)) - base
        except Exception:
            return False
        size = base.abs().max().clamp_min(1e-12)
        run = lambda: self._run(x, x, x, every, None, False, weights=False)
        return float(late[:, :p].abs().max() / size) > SEEN and not self._weights_causal(x, run)

    @torch.no_grad()
    def probe_masks(self) -> MaskForm:
        """Find what the module's mask means, by experiment (see the module docstring)."""
        default = MaskForm(None, "bool", self.convention, "b1qk")
        if self.form.mask_arg is None:
            return replace(default, note="no mask argument")
        try:
            with evaluating(self.module):
                return self._probe()
        except Unsupported:
            raise
        except Exception as e:  # the module fails on a plain call: the checks will say so, row by row
            return replace(default, note=f"not probed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _probe(self) -> MaskForm:
        g = torch.Generator().manual_seed(12345)
        p = self.projections()
        dev, dtype = p.q_weight.device, p.q_weight.dtype
        B, T, j = 2, 6, 2
        x = torch.randn(B, T, self.embed_dim, generator=g).to(dev, dtype)  # (B, T, E)
        moved = x.clone()
        moved[:, j] += 3.0 * torch.randn(B, self.embed_dim, generator=g).to(dev, dtype)  # only key/query j changes
        rows = [i for i in range(T) if i != j]
        hide = torch.ones(T, T, dtype=torch.bool, device=dev)
        hide[:, j] = False  # (T, T): key j hidden from every query, if True means "may attend"
        arg = self.form.mask_arg
        assert arg is not None
        self.masks = MaskForm(None, "bool", "keep", "b1qk")  # _invoke below passes masks untranslated

        def change(mask: Tensor) -> float:
            before = _first(self._invoke(x, x, x, {arg: mask}))[:, rows]
            after = _first(self._invoke(moved, moved, moved, {arg: mask}))[:, rows]
            scale = before.abs().max().clamp_min(1e-12)
            return float((after - before).abs().max() / scale) if torch.isfinite(after).all() else math.inf

        def reading(a: float, b: float, exact: bool) -> Literal["keep", "block"] | None:
            """What True means, from the change with key j hidden (a) and with only key j visible (b)."""
            if exact:  # masking done right leaves the other queries exactly alone
                return "keep" if a <= EXACT < b else "block" if b <= EXACT < a else None
            if min(a, b) < 0.5 * max(a, b):  # masking of some kind (after softmax, say): the checks will tell
                return "keep" if a < b else "block"
            return None

        changes: tuple[float, float] | None = None
        note = ""
        try:
            changes = (change(hide), change(~hide))
        except Exception as e:
            note = f"a bool (T_q, T_k) mask raised {type(e).__name__}"
        exact = reading(*changes, exact=True) if changes else None
        if exact is not None:
            self.masks = MaskForm(exact, "bool", exact, "b1qk")
            return replace(self.masks, layout=self._probe_layout(x, hide))
        additive = torch.zeros(T, T, device=dev, dtype=dtype).masked_fill(~hide, float("-inf"))
        try:
            only_j = torch.zeros_like(additive).masked_fill(hide, float("-inf"))
            if reading(change(additive), change(only_j), exact=True) == "keep":
                note = (note + "; " if note else "") + "a bool mask had no clean effect, an additive float mask did"
                self.masks = MaskForm(None, "float", self.convention, "b1qk", note)
                return replace(self.masks, layout=self._probe_layout(x, hide))
        except Exception:
            pass
        batched = self._probe_batched()
        if batched is not None:
            return batched
        seen = self._weights_reading(x, hide, j)
        if seen is not None:  # its outputs mix positions (a mistaken merge), its weights do not
            self.masks = MaskForm(seen, "bool", seen, "b1qk", "read off its attention weights")
            return replace(self.masks, layout=self._probe_layout(x, hide, weights=True))
        if changes is None:  # no (T_q, T_k) mask runs, and no form masks cleanly: the module mixes positions
            runs = self._probe_runs()
            if runs is not None:
                return runs
        # No clean reading: the module masks after softmax, mixes positions, or ignores the mask. Its bool
        # masks are then handed over in the expected convention; what they seemed to do is only reported.
        weak = reading(*changes, exact=False) if changes else None
        seemed = (
            f"a bool mask acts only partly (like True = {'may attend' if weak == 'keep' else 'blocked'})"
            if weak
            else "a bool mask had no clear effect"
        )
        self.masks = MaskForm(weak, "bool", self.convention, "b1qk", (note + "; " if note else "") + seemed)
        return replace(self.masks, layout=self._probe_layout(x, hide))

    def _weights_reading(self, x: Tensor, hide: Tensor, j: int) -> Literal["keep", "block"] | None:
        """What True means by the attention weights alone: the mask ``hide`` ``(T, T)`` (False at key j) or its
        complement gives key j weight 0 for every query while the others keep some; None when neither does."""
        arg = self.form.mask_arg
        for polarity, mask in (("keep", hide), ("block", ~hide)):
            weights = self._softmaxes(x, functools.partial(self._invoke, x, x, x, {arg: mask}))
            if weights and all(bool((w[..., j] == 0).all()) and bool(w.sum(-1).gt(0).all()) for w in weights):
                return polarity  # type: ignore[return-value]
        return None

    def _probe_layout(self, x: Tensor, hide: Tensor, weights: bool = False) -> _Layout:
        """The first per-sequence layout for which each sequence gets its own mask (by its attention weights
        with ``weights``: a module whose outputs mix the sequences)."""
        other = hide.clone()
        other[:, 0], other[:, 2] = False, True  # (T, T): a second mask, key 0 hidden instead
        arg = self.form.mask_arg
        masks = torch.stack([hide, other])  # (B=2, T, T)
        x0, x1 = x[:1], x[1:]  # one tensor object each: self-attention

        def seen(q: Tensor, mask: Tensor) -> Tensor:
            call = lambda: self._invoke(q, q, q, {arg: self._mask(mask)})
            return torch.cat(self._softmaxes(q, call)[:1] or [torch.zeros(0)]) if weights else _first(call())

        want = torch.cat([seen(x0, hide), seen(x1, other)])  # each sequence alone, with its 2-D mask
        layouts: tuple[_Layout, ...] = ("b1qk", "bhqk", "bqk", "hbqk", "qkb")
        for layout in layouts:
            self.masks = replace(self.masks, layout=layout)
            try:
                got = seen(x, masks)
            except Exception:
                continue
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return layout
        return "per_sequence"

    def _probe_runs(self) -> MaskForm | None:
        """The first form a module that masks nothing cleanly (it mixes positions: a mistake the checks will
        show) runs with, giving ``(B, T, E)``; its name says which forms are tried (valid lengths first for
        ``valid_lens``, additive and 0/1 for ``attention_mask``, else bool in the expected convention only)."""
        g = torch.Generator().manual_seed(778)
        w = self.projections().q_weight
        B, T = 3, 7
        x = torch.randn(B, T, self.embed_dim, generator=g).to(w)  # (B, T, E)
        pos = torch.arange(T, device=w.device)
        keep = (pos[None, :] < torch.tensor([7, 5, 6], device=w.device)[:, None])[:, None, :].expand(B, T, T)
        arg = self.form.mask_arg
        assert arg is not None
        pol = self.convention
        bools = [MaskForm(pol, "bool", pol, lay, two_d=False) for lay in ("bqk", "b1qk", "bhqk", "b11k", "b1k", "bk")]  # fmt: skip
        lens = [MaskForm(None, "lens", "keep", lay, two_d=False) for lay in ("lens_q", "lens")]
        additive = [
            MaskForm(None, "float", pol, lay, two_d=False, fill=fill)
            for fill in ("-inf", "min")
            for lay in ("b1qk", "b11k", "bqk")
        ]  # -inf first; finfo.min where -inf gives NaN (a mask subtracted, say)
        ints = [MaskForm(None, "int", "keep", lay, two_d=False) for lay in ("bk", "b11k", "bqk")]
        if name_key(arg) in ("validlens", "validlen", "lengths"):
            order = lens + bools
        elif name_key(arg) == "attentionmask":
            order = additive + ints + bools + lens
        else:  # a bool mask it cannot take in any shape is a finding (mask_dtype_error): nothing else is tried
            order = bools
        for form in order:
            self.masks = form
            try:
                out = _first(self._invoke(x, x, x, {arg: self._mask(keep)}))
            except Exception:
                continue
            if isinstance(out, Tensor) and out.shape == x.shape and bool(torch.isfinite(out).all()):
                return replace(form, note="its effect could not be read (the output mixes positions); handed as the first form it runs with")  # fmt: skip
        return None

    def _probe_batched(self) -> MaskForm | None:
        """Every other mask form, on a batch whose sequences each hide other keys (see the module docstring):
        the first under which exactly the hidden keys stop reaching each query; None when none does."""
        g = torch.Generator().manual_seed(777)
        w = self.projections().q_weight
        B, T, E = 3, 7, self.embed_dim
        x = torch.randn(B, T, E, generator=g).to(w)  # (B, T, E)
        moved = {}
        for p in (4, 5):
            moved[p] = x.clone()
            moved[p][:, p] += 3.0 * torch.randn(B, E, generator=g).to(w)  # (B, T, E): token p changed
        pos = torch.arange(T, device=w.device)
        full = torch.ones(B, T, T, dtype=torch.bool, device=w.device)  # (B, T_q, T_k), True = may attend
        full[0, :3, 4] = full[1, 3:, 4] = full[2, :, 5] = full[0, 4:, 5] = False
        lens = torch.tensor([6, 4, 5], device=w.device)  # (B,)
        per_key = (pos[None, :] < lens[:, None])[:, None, :].expand(B, T, T)  # (B, T_q, T_k): the last keys hidden
        per_query = pos[None, None, :] < (pos[None, :, None] + 3 - torch.arange(B, device=w.device)[:, None, None])
        per_query[..., 0] = True  # (B, T_q, T_k): a prefix per query, at least one key each
        arg = self.form.mask_arg
        assert arg is not None
        causal = causal_keep(T, T, w.device) if self.always_causal else None  # (T, T)

        def fits(form: MaskForm, keep: Tensor) -> bool:
            if causal is not None and bool((keep & causal)[:, :, list(moved)].eq(causal[:, list(moved)]).all()):
                return False  # under its own causal mask this mask hides none of the moved keys: a module
                # ignoring it would fit (d2l's per-query lengths of a causal prefix are the causal mask itself)
            self.masks = form
            try:
                mask = self._mask(keep)
                base = _first(self._invoke(x, x, x, {arg: mask}))
                if not isinstance(base, Tensor) or base.shape != x.shape or not bool(torch.isfinite(base).all()):
                    return False
                size = base.abs().max().clamp_min(1e-12)
                for p, xp in moved.items():
                    out = _first(self._invoke(xp, xp, xp, {arg: mask}))
                    if not isinstance(out, Tensor) or out.shape != x.shape:
                        return False
                    change = ((out - base).abs().amax(-1) / size).nan_to_num(math.inf)  # (B, T_q)
                    seen = keep[:, :, p] if causal is None else keep[:, :, p] & causal[:, p]  # (B, T_q)
                    others = pos != p  # query p changed itself
                    if bool((change[~seen & others] > EXACT).any()) or bool((change[seen & others] <= SEEN).any()):
                        return False
                return True
            except Exception:
                return False

        values: list[tuple[Literal["bool", "float", "int", "float01"], Literal["keep", "block"]]] = [
            ("bool", "keep"), ("bool", "block"), ("float", "keep"), ("int", "keep"), ("float01", "keep"),
            ("int", "block"), ("float01", "block"),
        ]  # fmt: skip
        if name_key(arg) != "attentionmask":
            # 0/1 numbers are Hugging Face's documented attention_mask; elsewhere a module that only runs on
            # them rejects the bool mask its signature promises (a finding: mask_dtype_error), so none are tried
            values = [(use, pol) for use, pol in values if use in ("bool", "float")]
        # batch-first layouts first; a time-first module's masks may be time-first too (labml's (T_q, T_k, B))
        tries: list[tuple[tuple[_Layout, ...], Tensor]] = [
            (("bqk", "b1qk", "bhqk", "hbqk", "qkb"), full),
            (("b11k", "b1k", "bk", "bh1k", "kb"), per_key),
        ]
        for layouts, keep in tries:
            # one mask per key, (B, T_k): Hugging Face's 0/1 attention_mask before an additive reading of it
            ordered = values if keep is full else sorted(values, key=lambda v: v[0] == "float")
            for use, polarity in ordered:
                for layout in layouts:
                    reading = polarity if use == "bool" else None
                    form = MaskForm(reading, use, polarity, layout, two_d=False)
                    if fits(form, keep):
                        return form
        for layout, keep in (("lens_q", per_query), ("lens", per_key)):
            form = MaskForm(None, "lens", "keep", layout, two_d=False)
            if fits(form, keep):
                return form
        return None


# said of a mask whose convention was read by experiment alone: a module that reads it inverted would pass
UNSTATED = "read by experiment: its code does not say which way round it is meant"
# What a module's own words say a mask's True (or 1) means: "True = keep", "1 for tokens to attend", "True means
# padding". Only a statement of that form counts, never a name.
_STATED = re.compile(r"\b(?:true|1)(?:/(?:true|1))?\s*(?:=|==|:|->|means|marks|indicates|is|are|for)\s*(?:an?\s+|the\s+)?(not\s+)?(\w+)", re.I)  # fmt: skip
_KEEP_WORDS = ("keep", "kept", "valid", "attend", "real", "visible", "token", "tokens", "allowed", "may", "use", "used")
_BLOCK_WORDS = ("pad", "padding", "padded", "mask", "masked", "ignore", "ignored", "block", "blocked", "excluded")


def stated_polarity(fn: Callable, arg: str) -> Literal["keep", "block"] | None:
    """What ``fn``'s docstring or comments say ``arg``'s True means, where a clause naming ``arg`` says it in so many
    words (``key_padding_mask (B, S) bool, True = keep``); None where nothing is stated, or both readings are."""
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    doc = inspect.getdoc(fn) or ""
    comments = [line.split("#", 1)[1] for line in source.splitlines() if "#" in line and arg in line]
    found: set[Literal["keep", "block"]] = set()
    for clause in re.split(r"[;\n]|\.\s", "\n".join([doc, *comments])):
        if arg not in clause:
            continue
        for negated, word in _STATED.findall(clause.split(arg, 1)[1]):
            word = word.lower()
            kind: Literal["keep", "block"] | None = (
                "keep" if word in _KEEP_WORDS else "block" if word in _BLOCK_WORDS else None
            )
            if kind is not None:
                found.add(("block" if kind == "keep" else "keep") if negated else kind)
                break
    return next(iter(found)) if len(found) == 1 else None


@dataclass(frozen=True)
class HeadMap:
    """A map the module applies to each Q or K vector alone between the projection and the scores (qk-norm), found
    by :func:`find_head_maps`: the reference calls the module's own submodule, with its weights in the reference's
    dtype, on ``(B, n, T, D)`` heads (or on them merged to ``(B, T, n*D)`` when the module calls it so)."""

    module: nn.Module
    flat: bool  # called on the merged heads (B, T, n*D) rather than on (..., D)
    heads_last: bool = False  # called on (B, T, n, D) (Cohere's norm of weight (n, D)) rather than (B, n, T, D)

    def apply(self, x: Tensor) -> Tensor:
        state = {
            n: t.detach().to(device=x.device, dtype=x.dtype) if t.is_floating_point() else t.to(x.device)
            for n, t in [*self.module.named_parameters(), *self.module.named_buffers()]
        }
        if self.heads_last:
            return torch.func.functional_call(self.module, state, (x.transpose(1, 2),)).transpose(1, 2)
        if not self.flat:
            return torch.func.functional_call(self.module, state, (x,))
        B, n, T, D = x.shape
        y = torch.func.functional_call(self.module, state, (x.transpose(1, 2).reshape(B, T, n * D),))
        return y.view(B, T, n, D).transpose(1, 2)


@torch.no_grad()
def find_head_maps(module: nn.Module, form: CallForm, p: Projections, H: int, G: int) -> dict[str, HeadMap]:
    """The maps the module applies to each Q or K vector before the scores (qk-norm), found in eval mode (the
    experiments compare calls: dropout off); see :func:`_find_head_maps`."""
    with evaluating(module):
        return _find_head_maps(module, form, p, H, G)


def _find_head_maps(module: nn.Module, form: CallForm, p: Projections, H: int, G: int) -> dict[str, HeadMap]:
    """The submodules the module applies to the Q or K heads before the scores, each to every vector alone
    (qk-norm), by data flow: a call of a submodule whose input is a projection's output (merged, (B, T, n, D),
    (B, n, T, D) or (B*n, T, D)), whose output differs from it and whose map commutes with reordering positions
    and heads. Which side of the scores it feeds is found by experiment: moved at position 0, a map on the query
    side changes output row 0 alone, one on the key side the other rows too. {} when there is none."""
    if form.time_first or form.residual:
        return {}
    E = p.q_weight.size(-1)
    params = [t for t in module.parameters() if t.is_floating_point()]
    if not params:
        return {}
    dtype, device = params[0].dtype, params[0].device
    x = torch.randn(2, 5, E, generator=torch.Generator().manual_seed(96)).to(device=device, dtype=dtype)
    B, T = x.shape[:2]
    refs: list[tuple[Tensor, int]] = []  # (a projection's output in each layout, the layout's position axis)
    for w, b, n in ((p.q_weight, p.q_bias, H), (p.k_weight, p.k_bias, G)):
        flat = F.linear(x, w.to(dtype), None if b is None else b.to(dtype))  # (B, T, n*D)
        heads = flat.view(B, T, n, -1)
        refs += [(flat, 1), (heads, 1), (heads.transpose(1, 2), 2), (heads.transpose(1, 2).flatten(0, 1), 1)]
    subs = [m for m in module.modules() if m is not module]  # containers too: StableLM's one norm per head
    calls: list[tuple[nn.Module, object, object]] = []
    hooks = [m.register_forward_hook(lambda m, i, o: calls.append((m, i[0] if i else None, o))) for m in subs]
    try:
        base = _first(_call(module, form, (x, x, x), {}))
    except Exception:
        return {}
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(base, Tensor) or base.shape[:2] != (B, T):
        return {}
    size = float(base.abs().max().clamp_min(1e-12))
    found: dict[str, HeadMap] = {}
    for index, (sub, t, out) in enumerate(calls):
        if not (isinstance(t, Tensor) and isinstance(out, Tensor) and out.shape == t.shape and t.dim() >= 3):
            continue
        axis = next((a for r, a in refs if r.shape == t.shape and torch.allclose(t, r, rtol=1e-4, atol=1e-5)), None)
        if axis is None and t.dim() == 4:  # heads cut from any earlier layer's output (Persimmon's (B, T, H, 3, D))
            axis = _heads_of_a_layer(t, [o for _, _, o in calls[:index]], B, T, (H, G))
        # on (B, n, T, D) or (B, T, n, D) a map may differ per head (one norm per head, a weight per head and
        # feature), applied to the heads in the reference's order
        heads_axis = None if axis is None or t.dim() != 4 else 3 - axis
        if axis is None or torch.allclose(out, t, rtol=1e-4, atol=1e-5) or not _per_vector(sub, t, out, heads_axis):
            continue
        side = _side_of_scores(module, form, x, base, size, index, axis, subs)
        if side is not None and side not in found:
            found[side] = HeadMap(sub, flat=t.size(-1) != p.q_weight.size(0) // H, heads_last=heads_axis == 2)
    return found


def _heads_of_a_layer(t: Tensor, outputs: list[object], B: int, T: int, counts: tuple[int, int]) -> int | None:
    """The position axis of ``t`` ((B, T, n, D): 1, or (B, n, T, D): 2), n one of ``counts`` (all the Q or all
    the K/V heads: not one head of a norm per head), where each head is one D-wide slice of an earlier layer's
    ``(B, T, width)`` output, at every batch row and position; None where none is."""
    for axis in (1, 2):
        heads = t if axis == 1 else t.transpose(1, 2)  # (B, T, n, D)
        if heads.shape[:2] != (B, T) or heads.size(2) not in counts:
            continue
        D = heads.size(-1)
        for o in outputs:
            if not (isinstance(o, Tensor) and o.dim() == 3 and o.shape[:2] == (B, T) and o.size(-1) % D == 0):
                continue
            chunks = o.reshape(B, T, -1, D)  # (B, T, width / D, D)
            close = (heads[:, :, :, None] - chunks[:, :, None]).abs().amax(dim=(0, 1, 4))  # (n, width / D)
            if bool((close <= 1e-5 + 1e-4 * chunks.abs().max()).any(dim=1).all()):
                return axis
    return None


def _without(module: nn.Module, maps: dict[str, HeadMap]) -> nn.Module:
    """A copy of ``module`` with the submodules of ``maps`` replaced by ``nn.Identity``."""
    ids = {id(h.module) for h in maps.values()}
    names = [n for n, m in module.named_modules() if id(m) in ids and n]
    made = copy.deepcopy(module)
    for name in names:
        parent, _, leaf = name.rpartition(".")
        setattr(made.get_submodule(parent) if parent else made, leaf, nn.Identity())
    return made


def _per_vector(sub: nn.Module, t: Tensor, out: Tensor, heads_axis: int | None = None) -> bool:
    """Whether ``sub`` maps each vector alone: its output commutes with reversing any axis but the last (but the
    heads' axis too when given: each head's vectors alone, by a map of that head's own)."""
    try:
        return all(
            torch.allclose(sub(t.flip(d)), out.flip(d), rtol=1e-4, atol=1e-5)
            for d in range(t.dim() - 1)
            if t.size(d) > 1 and d != heads_axis
        )
    except Exception:
        return False


def _side_of_scores(
    module: nn.Module,
    form: CallForm,
    x: Tensor,
    base: Tensor,
    size: float,
    index: int,
    axis: int,
    subs: list[nn.Module],
) -> str | None:
    """ "q" or "k": the side of the scores the ``index``-th call of ``subs`` feeds, by moving its output at position
    0: a key there reaches the other rows. A causal module's row 0 sees key 0 alone, whatever its query: when the
    move changes nothing, the output is moved at the last position, and a query there changes its own row."""

    def moved_at(pos: int) -> Tensor | None:
        seen = [0]

        def move(m: nn.Module, i: tuple, o: Tensor) -> Tensor | None:
            seen[0] += 1
            if seen[0] - 1 != index:
                return None
            o = o.clone()
            row = o.select(axis, pos)  # a random push: a constant one may be orthogonal to what it meets (a normed K)
            row.add_(torch.randn(row.shape, generator=torch.Generator().manual_seed(95)).to(row))
            return o

        hooks = [m.register_forward_hook(move) for m in subs]
        try:
            return _first(_call(module, form, (x, x, x), {}))
        except Exception:
            return None
        finally:
            for h in hooks:
                h.remove()

    moved = moved_at(0)
    if not isinstance(moved, Tensor):
        return None
    diff = (moved - base).abs()
    if float(diff[:, 1:].max()) > 1e-6 * size:
        return "k"
    if float(diff[:, 0].max()) > 1e-6 * size:
        return "q"
    moved = moved_at(-1)  # nothing moved: a causal module's first row (a key there would have moved the others)
    if not isinstance(moved, Tensor):
        return None
    diff = (moved - base).abs()
    return "q" if float(diff[:, -1].max()) > 1e-6 * size and float(diff[:, :-1].max()) <= 1e-6 * size else None


def _sequence(query: Tensor, key: Tensor, value: Tensor, b: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence ``b`` of each input, keeping which of them are one tensor (self-attention, one context)."""
    q = query[b : b + 1]
    k = q if key is query else key[b : b + 1]
    v = k if value is key else q if value is query else value[b : b + 1]
    return q, k, v


def _cat(outs: list[object]) -> object:
    """Per-sequence results joined along the batch: tensors, or tuples of them (output, weights)."""
    if isinstance(outs[0], tuple | list):
        return tuple(
            torch.cat(parts) if all(isinstance(t, Tensor) for t in parts) else parts[0]
            for parts in zip(*outs, strict=True)
        )
    return torch.cat(outs)  # type: ignore[arg-type]


def as_adapter(target: object, *, scale: float | None = None) -> AttentionAdapter:
    """``target`` as an adapter: adapters pass through, modules are wrapped by their kind.

    ``torch.nn.MultiheadAttention``: :class:`~attnlab.check.adapters.TorchMHAAdapter`; attnlab's
    ``MultiHeadAttention``: :class:`~attnlab.check.adapters.ModuleAdapter`; any other module:
    :class:`ProbedAdapter`, which reads its weights and call form off the module itself. ``scale``:
    the expected multiplier of the scores (default 1/sqrt(D)); the module's own ``scale`` attribute
    is never taken as the truth.
    """
    if isinstance(target, nn.MultiheadAttention):
        return TorchMHAAdapter(target)
    if isinstance(target, MultiHeadAttention):
        return ModuleAdapter(target, scale=scale)
    if isinstance(target, nn.Module):
        return ProbedAdapter(target, scale=scale)
    return _wrap(target)


def _read(module: nn.Module, form: CallForm, embed_dim: int | None) -> Reading | None:
    """The module's data flow (:mod:`attnlab.check.dataflow`) at its input width, or None where it cannot
    be read (then its Linears are taken in declaration order)."""
    widths = [embed_dim] if embed_dim is not None else []
    widths += [p.size(-1) for p in module.parameters() if p.dim() == 2]
    for E in dict.fromkeys(widths):
        if E is None or E < 2 or E > 4096:
            continue
        reading = read_dataflow(module, lambda m, x: _call(m, form, (x, x, x), {}), int(E))
        if reading is not None:
            return reading
    return None


def _read_projections(module: nn.Module, r: Reading) -> Projections:
    """The weights as the data flow reads them, each role settled on its own (:func:`settle_roles`)."""
    wq, wk, wv = (src.weight(module) for src in (r.q, r.k, r.v))
    bq, bk, bv = (src.bias_of(module) for src in (r.q, r.k, r.v))
    if r.out is not None:
        wo, bo = r.out.weight(module).t(), r.out.bias_of(module)  # rows were columns: (E, H*D)
    else:  # nothing projects the merged heads: the identity, so the reference returns them as they are
        wo, bo = torch.eye(r.embed_dim, dtype=wq.dtype, device=wq.device), None
    return Projections(wq, wk, wv, wo, bq, bk, bv, bo, rotary=r.rotary)
