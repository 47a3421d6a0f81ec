"""Check a hand-written attention module as it is written: find its weights and how it is called.

Notation: B batch, T_q query positions, T_k key positions, E embed_dim, H query heads,
G key/value heads, D head dim.

:class:`ProbedAdapter` reads three things off a module, so that nobody has to write an adapter:

- **the weights**: its ``nn.Linear`` children, by the names people give them (``q_proj``,
  ``w_q``, ``query``, ``to_q``, ``W_o``, ``fc_out``, a fused ``qkv``/``in_proj``/``c_attn``...);
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

What the module lacks is expressed another way: key padding and causality go through its mask
when it takes no ``key_padding_mask`` or ``is_causal``. A module with no mask argument at all
raises :class:`~attnlab.check.adapters.Unsupported` for masked calls, and the checks that need
masks are skipped.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention
from ..core.functional import causal_keep
from .adapters import AttentionAdapter, ModuleAdapter, Projections, TorchMHAAdapter, Unsupported, _same_size, _wrap

__all__ = ["CallForm", "MaskForm", "NotAttention", "ProbedAdapter", "as_adapter", "find_projections"]


class NotAttention(TypeError):
    """The module cannot be read as multi-head attention (no projections found, or it does not run as one)."""


def _key(name: str) -> str:
    return name.lower().replace("_", "")


# Child names, lowercased without underscores, that people give each projection.
_NAMES = {
    "q": {"qproj", "q", "query", "wq", "qlinear", "linearq", "toq", "queryproj", "projq", "qlin", "queries", "wquery"},
    "k": {"kproj", "k", "key", "wk", "klinear", "lineark", "tok", "keyproj", "projk", "klin", "keys", "wkey"},
    "v": {"vproj", "v", "value", "wv", "vlinear", "linearv", "tov", "valueproj", "projv", "vlin", "values", "wvalue"},
    "out": {
        "outproj", "oproj", "out", "wo", "fcout", "o", "proj", "outlinear", "linearout", "toout", "dense",
        "cproj", "output", "olin", "outputproj", "projout", "wout", "linear", "fc", "olinear",
    },
    "qkv": {"qkv", "qkvproj", "inproj", "cattn", "toqkv", "wqkv", "qkvlinear", "attn", "inprojection"},
}  # fmt: skip
_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "heads", "nhead", "h", "num_attention_heads", "head_count")
_SCALE_ATTRS = ("scale", "scaling", "softmax_scale", "scale_factor", "attn_scale", "inv_sqrt_d")
_MASK_ARGS = ("attn_mask", "mask", "attention_mask")
_PAD_ARGS = ("key_padding_mask", "padding_mask", "src_key_padding_mask", "kv_padding_mask")
_CAUSAL_ARGS = ("is_causal", "causal")
_WEIGHTS_ARGS = ("need_weights", "return_weights", "return_attention", "output_attentions")


def _linear_in(module: nn.Module) -> nn.Linear | None:
    """``module`` itself if it is a Linear, else its first Linear (``to_out = Sequential(Linear, Dropout)``)."""
    if isinstance(module, nn.Linear):
        return module
    return next((m for m in module.modules() if isinstance(m, nn.Linear)), None)


@dataclass(frozen=True)
class _Found:
    """Where the projections live: child names (``qkv`` for a fused one, split in thirds)."""

    q: str | None
    k: str | None
    v: str | None
    out: str
    qkv: str | None = None

    def describe(self) -> str:
        qkv = f"{self.qkv} (fused, split in thirds)" if self.qkv else f"{self.q}, {self.k}, {self.v}"
        return f"Q/K/V: {qkv}; out: {self.out}"


def find_projections(module: nn.Module) -> _Found:
    """Name the q/k/v/out projections of ``module`` among its direct children.

    Raises:
        NotAttention: naming the Linear children found and the names looked for.
    """
    children = {n: lin for n, c in module.named_children() if (lin := _linear_in(c)) is not None}
    by_role: dict[str, str] = {}
    for name in children:
        for role, names in _NAMES.items():
            if _key(name) in names and role not in by_role:
                by_role[role] = name
    if "out" in by_role and "qkv" in by_role and not {"q", "k", "v"} <= by_role.keys():
        return _Found(None, None, None, by_role["out"], qkv=by_role["qkv"])
    if {"q", "k", "v", "out"} <= by_role.keys():
        return _Found(by_role["q"], by_role["k"], by_role["v"], by_role["out"])
    if len(children) == 4 and not by_role.keys() & {"q", "k", "v"}:
        q, k, v, out = children  # four Linears with names of their own: taken in declaration order
        return _Found(q, k, v, out)
    listed = ", ".join(f"{n} ({c.in_features}->{c.out_features})" for n, c in children.items()) or "none"
    raise NotAttention(
        f"{type(module).__name__} has no recognisable q/k/v/out projections (nn.Linear children found: {listed}); "
        f"name them q_proj, k_proj, v_proj, out_proj (or w_q.., query.., a fused qkv), or wrap the module in an "
        f"attnlab.check.AttentionAdapter"
    )


def _param_names(fn: Callable) -> tuple[list[str], dict[str, inspect.Parameter]]:
    params = dict(inspect.signature(fn).parameters)
    positional = [
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and n not in _MASK_ARGS + _PAD_ARGS
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

    def describe(self) -> str:
        sig = ", ".join(self.input_names)
        extras = [a for a in (self.mask_arg, self.padding_arg, self.causal_arg, self.weights_arg) if a]
        return f"forward({sig}{''.join(', ' + e for e in extras)})"


def read_call_form(module: nn.Module) -> CallForm:
    positional, params = _param_names(module.forward)
    pick = lambda names: next((n for n in names if n in params), None)
    inputs = [n for n in positional if n not in _CAUSAL_ARGS + _WEIGHTS_ARGS + ("average_attn_weights",)]
    required = [n for n in inputs if params[n].default is inspect.Parameter.empty]
    n_inputs = min(3, max(1, len(required)))
    if (
        n_inputs < 3
        and len(inputs) >= 3
        and _key(inputs[1]) in ("key", "k", "keys")
        and _key(inputs[2]) in ("value", "v", "values")
    ):
        n_inputs = 3  # forward(query, key=None, value=None): the optional key and value are taken
    if (
        n_inputs == 1
        and len(inputs) >= 2
        and any(w in _key(inputs[1]) for w in ("context", "kv", "memory", "key", "encoder", "xc"))
    ):
        n_inputs = 2  # forward(x, context=None)
    mask_arg, pad_arg = pick(_MASK_ARGS), pick(_PAD_ARGS)
    weights_arg = pick(_WEIGHTS_ARGS)
    return CallForm(
        inputs=n_inputs,
        input_names=tuple(inputs[:n_inputs]),
        mask_arg=mask_arg,
        padding_arg=pad_arg,
        causal_arg=pick(_CAUSAL_ARGS),
        weights_arg=weights_arg,
        average_arg="average_attn_weights" if "average_attn_weights" in params else None,
        torch_form=pad_arg is not None and weights_arg is not None and mask_arg is not None,
    )


@dataclass(frozen=True)
class MaskForm:
    """What the module's attention mask means, found by :meth:`ProbedAdapter.probe_masks`."""

    bool_reading: Literal["keep", "block"] | None  # what True means to it; None: a bool mask had no clear effect
    use: Literal["bool", "float"]  # what the checks hand it: bool in its reading, or additive 0 / -inf
    polarity: Literal["keep", "block"]  # for "bool"
    layout: Literal["b1qk", "bhqk", "bqk", "per_sequence"]  # a per-sequence mask
    note: str = ""  # what the probe found, for the report

    def describe(self) -> str:
        if self.use == "float":
            what = "additive float (0 = attend, -inf = blocked)"
        else:
            what = f"bool, True = {'may attend' if self.polarity == 'keep' else 'blocked'}"
        shapes = {
            "b1qk": "(B, 1, T_q, T_k)",
            "bhqk": "(B*H, T_q, T_k)",
            "bqk": "(B, T_q, T_k)",
            "per_sequence": "one call per sequence",
        }
        return f"{what}; per-sequence masks as {shapes[self.layout]}"


EXACT = 1e-5  # relative change of the other queries' outputs when a hidden key's input changes: rounding only


def _first(out: object) -> Tensor:
    return out[0] if isinstance(out, tuple | list) else out  # type: ignore[return-value]


class ProbedAdapter(AttentionAdapter):
    """Any attention ``nn.Module``, called the way its ``forward`` is written.

    Args:
        module: the module to check, with ``nn.Linear`` projections (see :func:`find_projections`).
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
        _forms: tuple[CallForm, MaskForm] | None = None,
    ) -> None:
        self.module, self.factory = module, factory
        self.name = name or type(module).__name__
        self.found = find_projections(module)
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
        self.dropout_p = _dropout_of(module) if dropout is None else float(dropout)
        if _forms is None:
            form = read_call_form(module)
            self.form = form
            self.convention: Literal["keep", "block"] = mask_convention or ("block" if form.torch_form else "keep")
            self.bool_mask_convention = self.convention
            self.masks = self.probe_masks()
        else:
            self.form, self.masks = _forms
            self.convention = mask_convention or ("block" if self.form.torch_form else "keep")
            self.bool_mask_convention = self.convention
        self.supports_cross_attention = self.form.inputs > 1
        self.shared_kv = self.form.inputs == 2

    def describe(self) -> str:
        """How check calls the module, for the report: its call form, what its mask means, what is folded into it."""
        f = self.form
        folded = [
            what
            for what, arg in (("key padding", f.padding_arg), ("causality", None if f.torch_form else f.causal_arg))
            if arg is None
        ]
        mask = "no mask argument" if f.mask_arg is None else f"{f.mask_arg}: {self.masks.describe()}"
        via = f"; {' and '.join(folded)} through {f.mask_arg}" if folded and f.mask_arg else ""
        return f"called as {f.describe()}; {mask}{via}; weights from {self.found.describe()}"

    # -- the protocol ------------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self.expected_scale

    def projections(self) -> Projections:
        f, m = self.found, self.module

        def lin(name: str) -> nn.Linear:
            found = _linear_in(getattr(m, name))
            assert found is not None  # find_projections saw it
            return found

        out = lin(f.out)
        if f.qkv is not None:
            fused = lin(f.qkv)
            wq, wk, wv = fused.weight.chunk(3)  # (E, E) each
            bq = bk = bv = None
            if fused.bias is not None:
                bq, bk, bv = fused.bias.chunk(3)
            return Projections(wq, wk, wv, out.weight, bq, bk, bv, out.bias)
        q, k, v = lin(f.q), lin(f.k), lin(f.v)  # type: ignore[arg-type]
        return Projections(q.weight, k.weight, v.weight, out.weight, q.bias, k.bias, v.bias, out.bias)

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
        if self.form.mask_arg is None:
            raise Unsupported(f"{self.name}.forward takes no attention mask")
        return _first(self._invoke(query, query, query, {self.form.mask_arg: mask}))

    def cast(self, dtype: torch.dtype) -> ProbedAdapter:
        return self._sibling(copy.deepcopy(self.module).to(dtype))

    def to(self, device: torch.device, dtype: torch.dtype) -> ProbedAdapter:
        """A copy on ``device`` in ``dtype``, probed again there: its mask may read otherwise on another device."""
        return ProbedAdapter(
            copy.deepcopy(self.module).to(device=device, dtype=dtype),
            num_heads=self.num_heads,
            scale=self._scale_given,
            mask_convention=self.convention,
            name=self.name,
            factory=self.factory,
            dropout=self.dropout_p,
        )

    def parameters(self) -> list[Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def resized(self, embed_dim: int, num_heads: int, num_kv_heads: int) -> AttentionAdapter:
        made = self._build(embed_dim, num_heads, num_kv_heads)
        if not isinstance(made, nn.Module):
            return _same_size(_wrap(made), embed_dim, num_heads, num_kv_heads)
        # the same code at another size: its call form and mask reading are the same
        built = ProbedAdapter(
            made,
            num_heads=num_heads,
            scale=self._scale_given,
            mask_convention=self.convention,
            name=self.name,
            factory=self.factory,
            dropout=self.dropout_p,
            _forms=(self.form, self.masks),
        )
        return _same_size(built, embed_dim, num_heads, num_kv_heads)

    def _sibling(self, module: nn.Module) -> ProbedAdapter:
        return ProbedAdapter(
            module,
            num_heads=self.num_heads,
            scale=self._scale_given,
            mask_convention=self.convention,
            name=self.name,
            factory=self.factory,
            dropout=self.dropout_p,
            _forms=(self.form, self.masks),
        )

    # -- calling the module ----------------------------------------------------------------------
    def _invoke(self, query: Tensor, key: Tensor, value: Tensor, kwargs: dict) -> object:
        form = self.form
        if form.inputs == 3:
            args: tuple[Tensor, ...] = (query, key, value)
        elif form.inputs == 2:
            if value is not key:
                raise Unsupported(f"{self.name} takes one context for K and V ({form.describe()})")
            args = (query, key)
        else:
            if key is not query or value is not query:
                raise Unsupported(f"{self.name} is self-attention only ({form.describe()})")
            args = (query,)
        return self.module(*args, **kwargs)

    def _run(self, query, key, value, keep_mask, key_padding_mask, is_causal, *, weights: bool) -> object:
        form = self.form
        B, T_q, T_k = query.size(0), query.size(1), key.size(1)
        kwargs: dict[str, object] = {}
        if form.weights_arg is not None:
            kwargs[form.weights_arg] = weights
            if weights and form.average_arg is not None:
                kwargs[form.average_arg] = False  # per-head weights
        keep: Tensor | None = keep_mask  # (T_q, T_k) or (B, T_q, T_k), True = may attend
        if key_padding_mask is not None:
            if form.padding_arg is not None:
                kwargs[form.padding_arg] = key_padding_mask
            else:
                pad_keep = (~key_padding_mask)[:, None, :].expand(B, T_q, T_k)  # (B, T_q, T_k)
                keep = pad_keep if keep is None else keep & pad_keep
        if is_causal:
            if form.causal_arg is not None and not form.torch_form:
                kwargs[form.causal_arg] = True
            else:
                tri = causal_keep(T_q, T_k, query.device)  # (T_q, T_k)
                keep = tri if keep is None else keep & tri
        if keep is None:
            return self._invoke(query, key, value, kwargs)
        if form.mask_arg is None:
            raise Unsupported(f"{self.name}.forward takes no attention mask ({form.describe()})")
        if keep.dim() == 2:
            return self._invoke(query, key, value, {**kwargs, form.mask_arg: self._mask(keep)})
        if self.masks.layout == "per_sequence":  # each sequence alone, with its own 2-D mask
            outs = []
            for b in range(B):
                kw_b = {n: (t[b : b + 1] if isinstance(t, Tensor) and t.dim() >= 2 else t) for n, t in kwargs.items()}
                kw_b[form.mask_arg] = self._mask(keep[b])
                outs.append(self._invoke(*_sequence(query, key, value, b), kw_b))
            return _cat(outs)
        return self._invoke(query, key, value, {**kwargs, form.mask_arg: self._mask(keep)})

    def _mask(self, keep: Tensor) -> Tensor:
        """A keep mask ``(T_q, T_k)`` or ``(B, T_q, T_k)`` in the module's own form."""
        mf = self.masks
        if mf.use == "float":
            m: Tensor = torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))
            m = m.to(self.projections().q_weight.dtype)
        else:
            m = keep if mf.polarity == "keep" else ~keep
        if keep.dim() == 2:
            return m
        if mf.layout == "b1qk":
            return m[:, None]  # (B, 1, T_q, T_k)
        if mf.layout == "bhqk":
            return m.repeat_interleave(self.num_heads, dim=0)  # (B*H, T_q, T_k), batch-major
        return m  # (B, T_q, T_k)

    # -- probing -------------------------------------------------------------------------------
    @torch.no_grad()
    def probe_masks(self) -> MaskForm:
        """Find what the module's mask means, by experiment (see the module docstring)."""
        default = MaskForm(None, "bool", self.convention, "b1qk")
        if self.form.mask_arg is None:
            return replace(default, note="no mask argument")
        training = self.module.training
        self.module.eval()
        try:
            return self._probe()
        except Unsupported:
            raise
        except Exception as e:  # the module fails on a plain call: the checks will say so, row by row
            return replace(default, note=f"not probed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            self.module.train(training)

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
            note = f"a bool mask raised {type(e).__name__}"
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

    def _probe_layout(self, x: Tensor, hide: Tensor) -> Literal["b1qk", "bhqk", "bqk", "per_sequence"]:
        """The first per-sequence layout for which each sequence gets its own mask."""
        other = hide.clone()
        other[:, 0], other[:, 2] = False, True  # (T, T): a second mask, key 0 hidden instead
        arg = self.form.mask_arg
        masks = torch.stack([hide, other])  # (B=2, T, T)
        x0, x1 = x[:1], x[1:]  # one tensor object each: self-attention
        want = torch.cat(
            [
                _first(self._invoke(x0, x0, x0, {arg: self._mask(hide)})),
                _first(self._invoke(x1, x1, x1, {arg: self._mask(other)})),
            ]
        )  # (B, T, E): each sequence alone, with its 2-D mask
        layouts: tuple[Literal["b1qk", "bhqk", "bqk"], ...] = ("b1qk", "bhqk", "bqk")
        for layout in layouts:
            self.masks = replace(self.masks, layout=layout)
            try:
                got = _first(self._invoke(x, x, x, {arg: self._mask(masks)}))
            except Exception:
                continue
            if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                return layout
        return "per_sequence"


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


def _dropout_of(module: nn.Module) -> float:
    """The attention dropout: a float attribute (``dropout``, ``dropout_p``, ``p``...), else the first ``nn.Dropout``."""
    for a in ("dropout", "dropout_p", "attn_dropout", "p", "dropout_rate", "attention_dropout"):
        v = getattr(module, a, None)
        if isinstance(v, float | int) and not isinstance(v, bool):
            return float(v)
    return next((float(m.p) for m in module.modules() if isinstance(m, nn.Dropout)), 0.0)


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
