"""``attnlab.swap(model)``: attnlab's attention in a model somebody else wrote, in one call.

It walks ``model`` and replaces, in place, every attention module it recognises:

==========================================================  ================================================
found                                                       replaced by
==========================================================  ================================================
``torch.nn.MultiheadAttention`` (also inside                ``attnlab.compat.MultiheadAttention``, holding
``nn.TransformerEncoderLayer``/``DecoderLayer``/            the same Parameter objects (same state dict)
``nn.Transformer``, torchvision's ViT, open_clip's blocks)
timm's ``Attention`` (``timm.layers.Attention``, ViT)       ``attnlab.compat.FusedQKVAttention``
open_clip's ``transformer.Attention``                       ``attnlab.compat.FusedQKVAttention``
a Hugging Face ``PreTrainedModel``                          not module-swapped:
                                                            ``model.set_attn_implementation("attnlab")``, once
                                                            ``attnlab.hf.register()`` has run (else left, saying so)
==========================================================  ================================================

and returns a :class:`SwapReport`: what was replaced (path, from class, to class) and what was
left and why (an attention-like module it does not know, options attnlab cannot express exactly,
hooks it could not keep, modules already attnlab's). ``verify=sample`` runs the model before and
after and raises :class:`SwapVerificationError` (restoring the original modules) when the outputs
differ past flash-attention's rule (see :func:`swap`).
"""

from __future__ import annotations

import copy
import functools
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention
from ..core.validation import BACKEND_NAMES, Backend
from .fused import FusedQKVAttention
from .multihead import MultiheadAttention

__all__ = ["ATOL", "Left", "SwapReport", "SwapVerificationError", "Swapped", "Verified", "swap"]

# verify's floor per output dtype, times max(1, max |float64 reference|): the slack beyond 2x the original's
# own error against the float64 reference (flash-attention's test rule), for outputs whose original error is ~0.
ATOL: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}

# Child names that mark a module as computing attention even when its class name does not say so.
_PROJECTION_NAMES = ("qkv", "in_proj_weight", "q_proj", "k_proj", "v_proj", "to_q", "to_k", "to_v", "c_attn")

# Attention modules swap knows but does not replace, by their defining path, with the reason the report gives.
_KNOWN_UNSUPPORTED = {
    "timm.layers.attention.AttentionRope": "timm's rotary attention (rope= per call, prefix tokens left unrotated) is "
    "not reproduced by attnlab.swap",
    "timm.layers.diff_attention.DiffAttention": "differential attention (the difference of two softmaxes) has no "
    "attnlab module",
    "timm.layers.attention2d.Attention2d": "attention over NCHW feature maps with 1x1-conv projections; attnlab's "
    "modules take (B, T, C) tokens",
    "timm.layers.attention2d.MultiQueryAttention2d": "attention over NCHW feature maps with conv projections; "
    "attnlab's modules take (B, T, C) tokens",
    "timm.layers.attention2d.MultiQueryAttentionV2": "attention over NCHW feature maps; attnlab's modules take "
    "(B, T, C) tokens",
    "timm.layers.attention_pool.AttentionPoolLatent": "latent-query attention pooling (its own q and fused kv "
    "projections) is not reproduced by attnlab.swap",
    "timm.layers.attention_pool2d.AttentionPool2d": "attention pooling over NCHW maps with position embeddings is "
    "not reproduced by attnlab.swap",
    "timm.layers.attention_pool2d.RotAttentionPool2d": "attention pooling over NCHW maps with rotary embeddings is "
    "not reproduced by attnlab.swap",
}
_UNKNOWN = "an attention-like module attnlab.swap does not know (by its class name or q/k/v projections)"

# Module hook dicts moved, as the same dict objects (so that the user's RemovableHandles still remove them),
# from a replaced module to its replacement; forward and backward hooks see the same arguments and outputs.
_CALL_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_STATE_HOOKS = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@dataclass(frozen=True)
class Swapped:
    """One replaced module: where, what it was, what it is now, and anything else that moved with it."""

    path: str
    from_class: str
    to_class: str
    note: str = ""


@dataclass(frozen=True)
class Left:
    """One module left as it was, and why."""

    path: str
    class_name: str
    reason: str


@dataclass(frozen=True)
class Verified:
    """One floating output compared by ``verify=``: errors against the float64 reference."""

    output: str  # e.g. "output", "output[0]", "output['logits']"
    dtype: torch.dtype
    max_error: float  # max |swapped - reference|
    original_error: float  # max |original - reference|
    allowed: float  # 2 * original_error + atol
    not_compared: int = 0  # values where neither the reference nor the original is finite (NaN of fully masked rows)


@dataclass
class SwapReport:
    """What :func:`swap` did. ``str(report)`` is a small table; the fields are for programs."""

    swapped: list[Swapped] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # model-level changes, e.g. an encoder's nested-tensor flag
    verified: list[Verified] | None = None  # None unless verify= was given

    @property
    def swapped_paths(self) -> list[str]:
        return [s.path for s in self.swapped]

    def __str__(self) -> str:
        lines = [f"attnlab.swap: {len(self.swapped)} replaced, {len(self.left)} left"]
        if self.swapped:
            lines += _table(
                ("replaced", "from", "to"), [(s.path, s.from_class, s.to_class + _suffix(s.note)) for s in self.swapped]
            )
        if self.left:
            lines += _table(("left", "class", "why"), [(x.path, x.class_name, x.reason) for x in self.left])
        lines += [f"  note: {n}" for n in self.notes]
        for v in self.verified or []:
            extra = f" ({v.not_compared} values NaN in the original not compared)" if v.not_compared else ""
            lines.append(
                f"  verified {v.output} ({str(v.dtype).removeprefix('torch.')}): max error {v.max_error:.2e} "
                f"<= allowed {v.allowed:.2e}{extra}"
            )
        return "\n".join(lines)


class SwapVerificationError(RuntimeError):
    """``swap(verify=...)`` found an output past the allowed error; the model was restored."""

    def __init__(self, message: str, report: SwapReport, failed: Verified | None) -> None:
        super().__init__(message)
        self.report = report  # what the swap did before it was undone
        self.failed = failed  # the output past its allowed error; None when the swapped model raised


def _suffix(note: str) -> str:
    return f" ({note})" if note else ""


def _table(header: tuple[str, str, str], rows: list[tuple[str, str, str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(2)]
    return [f"  {a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in [header, *rows]]


def _class_name(obj: object) -> str:
    """The shortest import path of ``obj``'s class: ``torch.nn.MultiheadAttention``, ``timm.layers.Attention``,
    ``attnlab.compat.MultiheadAttention`` (not the defining file's ``torch.nn.modules.activation...``)."""
    cls = type(obj)
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if getattr(sys.modules.get(prefix), cls.__qualname__, None) is cls:
            return f"{prefix}.{cls.__qualname__}"
    return f"{cls.__module__}.{cls.__qualname__}"


# -- recognising modules ----------------------------------------------------------------------
def _is_class(obj: object, module: str, name: str) -> bool:
    """``type(obj)`` is exactly ``module.name``, read only if the user's program imported ``module``
    (attnlab never imports timm or open_clip itself)."""
    mod = sys.modules.get(module)
    return mod is not None and type(obj) is getattr(mod, name, None)


def _is_hf_model(obj: object) -> bool:
    mod = sys.modules.get("transformers.modeling_utils")
    return mod is not None and isinstance(obj, mod.PreTrainedModel)


def _looks_like_attention(m: nn.Module) -> bool:
    names = set(m._modules) | set(m._parameters)
    return "Attention" in type(m).__name__ or any(n in names for n in _PROJECTION_NAMES)


def _hooks_on(m: nn.Module, names: Iterable[str]) -> int:
    return sum(len(getattr(m, n, {})) for n in names if n != "_forward_hooks_always_called")


# -- replacing modules -----------------------------------------------------------------------
def _compat_from_torch(old: nn.MultiheadAttention, backend: Backend) -> MultiheadAttention:
    """``compat.MultiheadAttention`` holding ``old``'s own Parameter objects and ``out_proj`` module."""
    new = MultiheadAttention(
        old.embed_dim,
        old.num_heads,
        dropout=old.dropout,
        bias=old.in_proj_bias is not None,
        add_bias_kv=old.bias_k is not None,
        add_zero_attn=old.add_zero_attn,
        kdim=old.kdim,
        vdim=old.vdim,
        batch_first=old.batch_first,
        device="meta",  # every tensor is replaced by old's below: nothing is allocated
        backend=backend,
    )
    for name, param in old._parameters.items():
        setattr(new, name, param)  # the same Parameter: optimizers, tied weights and grads keep working
    new.out_proj = old.out_proj
    new.training = old.training
    return new


def _replacement(m: nn.Module, backend: Backend) -> tuple[nn.Module | None, str]:
    """``(replacement, "")`` for a module swap recognises, ``(None, why not)`` for one it recognises but
    cannot replace exactly, ``(None, "")`` for one it does not recognise."""
    if type(m) is nn.MultiheadAttention:
        return _compat_from_torch(m, backend), ""
    if isinstance(m, nn.MultiheadAttention):
        return None, (
            f"a subclass of nn.MultiheadAttention ({type(m).__name__}: parametrized, quantized or with its own "
            f"forward), whose computation attnlab cannot know"
        )
    timm = _is_class(m, "timm.layers.attention", "Attention")
    open_clip = _is_class(m, "open_clip.transformer", "Attention")
    if not (timm or open_clip):
        return None, ""
    if _hooks_on(m, _STATE_HOOKS):
        return None, "it has state_dict hooks, written for its fused keys, which its replacement does not have"
    fused = getattr(m, "qkv", None)
    if isinstance(fused, nn.Module) and _hooks_on(fused, _CALL_HOOKS):
        return None, "a hook is registered on its qkv Linear, which the swap would split into q/k/v_proj"
    try:
        new = (
            FusedQKVAttention.from_timm(m, backend=backend)
            if timm
            else FusedQKVAttention.from_open_clip(m, backend=backend)
        )
    except ValueError as e:
        return None, str(e).rstrip(".")
    return new, ""


def _move_hooks(old: nn.Module, new: nn.Module, names: Iterable[str]) -> int:
    """Give ``new`` ``old``'s hook dicts (the same objects); returns how many hooks moved."""
    moved = 0
    for name in names:
        hooks, own = getattr(old, name), getattr(new, name)
        if not hooks:
            continue
        moved += len(hooks) if name != "_forward_hooks_always_called" else 0
        if own:  # the replacement has hooks of its own there: keep them, add the user's after
            setattr(new, name, type(own)({**own, **hooks}))
        else:
            setattr(new, name, hooks)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
    return moved


@dataclass
class _Walk:
    report: SwapReport
    undo: list[Callable[[], None]]
    backend: Backend
    exclude: frozenset[str]
    seen: set[str] = field(default_factory=set)  # exclude= paths that exist
    new: set[int] = field(default_factory=set)  # id() of the modules this call installed
    # id(old) -> (its replacement, its first path): a module shared by two parents (tied layers) gets one
    # replacement, so that it stays shared
    made: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)
    visited: set[int] = field(default_factory=set)  # id() of the containers walked


def _visit(walk: _Walk, module: nn.Module, path: str) -> bool:
    """Swap what is recognised under ``module`` (at ``path``); True if anything there is attnlab's now."""
    found = False
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        p = f"{path}.{name}" if path else name
        if p in walk.exclude:
            walk.seen.add(p)
            walk.report.left.append(Left(p, _class_name(child), "excluded by exclude="))
            continue
        if isinstance(child, (MultiheadAttention, MultiHeadAttention)):
            walk.report.left.append(Left(p, _class_name(child), "already attnlab"))
            found = True
            continue
        if _is_hf_model(child):
            found |= _swap_hf(walk, child, p)
            continue
        if id(child) in walk.visited:  # a container shared by two parents: walked once, at its first path
            continue
        new: nn.Module | None
        if id(child) in walk.made:  # the second parent of a shared module
            new, why = walk.made[id(child)][0], ""
        else:
            new, why = _replacement(child, walk.backend)
        if new is not None:
            _install(walk, module, name, child, new, p)
            found = True
            continue
        if why:
            walk.report.left.append(Left(p, _class_name(child), why))
            continue
        walk.visited.add(id(child))
        if _visit(walk, child, p):
            found = True
        elif _looks_like_attention(child):
            defined_at = f"{type(child).__module__}.{type(child).__qualname__}"
            walk.report.left.append(Left(p, _class_name(child), _KNOWN_UNSUPPORTED.get(defined_at, _UNKNOWN)))
    return found


def _install(walk: _Walk, parent: nn.Module, name: str, old: nn.Module, new: nn.Module, path: str) -> None:
    """Put ``new`` in ``old``'s place under ``parent``, moving ``old``'s hooks; record how to undo it."""
    if id(old) in walk.made:  # already built and given old's hooks at its first path
        setattr(parent, name, new)
        walk.undo.append(functools.partial(setattr, parent, name, old))
        first = walk.made[id(old)][1]
        walk.report.swapped.append(Swapped(path, _class_name(old), _class_name(new), f"the same module as {first}"))
        return
    # compat's state dict is torch's, so state-dict hooks move too; FusedQKVAttention's keys differ (refused before)
    hook_names = _CALL_HOOKS + (_STATE_HOOKS if isinstance(new, MultiheadAttention) else ())
    saved = {n: getattr(new, n) for n in hook_names}
    moved = _move_hooks(old, new, hook_names)
    setattr(parent, name, new)
    walk.new.add(id(new))
    walk.made[id(old)] = (new, path)

    def restore() -> None:
        setattr(parent, name, old)
        for n, hooks in saved.items():
            setattr(new, n, hooks)

    walk.undo.append(restore)
    note = f"{moved} hook{'s' if moved != 1 else ''} moved" if moved else ""
    walk.report.swapped.append(Swapped(path, _class_name(old), _class_name(new), note))


def _swap_hf(walk: _Walk, model: nn.Module, path: str) -> bool:
    """A Hugging Face model: its attention is chosen by name, so set the name rather than swap modules."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    shown = path or "(model)"
    if before == "attnlab":
        walk.report.left.append(Left(shown, _class_name(model), "already attnlab (attn_implementation='attnlab')"))
        return True
    if not _calls_attention_by_name(model):
        walk.report.left.append(
            Left(
                shown,
                _class_name(model),
                "its attention is computed inline (its modeling file never calls an attention function by name), "
                "so attn_implementation='attnlab' would not run attnlab there",
            )
        )
        return False
    if not _hf_attention_registered():
        walk.report.left.append(Left(shown, _class_name(model), _HF_NOT_REGISTERED))
        return False
    try:
        model.set_attn_implementation("attnlab")  # type: ignore[operator]
    except (ValueError, TypeError) as e:
        walk.report.left.append(Left(shown, _class_name(model), f"set_attn_implementation('attnlab') refused: {e}"))
        return False
    if getattr(config, "_attn_implementation", None) != "attnlab":
        walk.report.left.append(
            Left(
                shown,
                _class_name(model),
                "its attention does not go through transformers' AttentionInterface, so it cannot be set by name",
            )
        )
        return False

    def restore() -> None:
        model.set_attn_implementation(before)  # type: ignore[operator]

    walk.undo.append(restore)
    walk.report.swapped.append(
        Swapped(shown, f"{_class_name(model)} (attn_implementation={before!r})", "attn_implementation='attnlab'")
    )
    return True


# attnlab.hf sits beside compat in the layering (both on core), so swap does not import it: it uses
# attnlab's HF attention once attnlab.hf.register() has put it in transformers' registry.
_HF_NOT_REGISTERED = (
    "attnlab's attention is not registered with transformers yet: call attnlab.hf.register() and swap again "
    "(or load the model with attn_implementation=attnlab.hf.register())"
)


def _calls_attention_by_name(model: nn.Module) -> bool:
    """Whether ``model``'s modeling file dispatches attention through transformers' registry (it then
    imports ``ALL_ATTENTION_FUNCTIONS``; BLOOM's or MPNet's, which compute it inline, do not). The
    same test as :mod:`attnlab.hf.routing`'s, on the instance's own class."""
    module = sys.modules.get(type(model).__module__)
    return module is None or "ALL_ATTENTION_FUNCTIONS" in vars(module)


def _hf_attention_registered() -> bool:
    """Whether transformers' ``AttentionInterface`` maps ``"attnlab"`` (what ``attnlab.hf.register()`` does)."""
    mod = sys.modules.get("transformers.modeling_utils")
    mapping = getattr(getattr(mod, "AttentionInterface", None), "_global_mapping", None)
    return isinstance(mapping, dict) and "attnlab" in mapping


def _note_nested_encoders(walk: _Walk, model: nn.Module) -> None:
    """An ``nn.TransformerEncoder`` built around torch's layers with ``enable_nested_tensor=True`` keeps
    passing NestedTensors to its layers in eval + no_grad with a padding mask; the compat module takes
    them (tests/test_compat_nested.py), so the flag stays, and the report says so."""
    for path, m in model.named_modules():
        if not isinstance(m, nn.TransformerEncoder) or not getattr(m, "use_nested_tensor", False):
            continue
        if id(getattr(m.layers[0], "self_attn", None)) not in walk.new:
            continue
        shown = f"{path}.use_nested_tensor" if path else "use_nested_tensor"
        walk.report.notes.append(
            f"{shown} kept True: attnlab.compat.MultiheadAttention takes the NestedTensors "
            f"it builds from a padded batch in eval + no_grad"
        )


# -- verify ----------------------------------------------------------------------------------
def _check_sample(sample: object) -> None:
    if not isinstance(sample, (Tensor, tuple, dict)):
        raise TypeError(
            f"verify must be a sample input: a tensor (model(x)), a tuple of positional arguments (model(*args)) "
            f"or a dict of keyword arguments (model(**kwargs)), got {type(sample).__name__}."
        )
    if isinstance(sample, dict) and not all(isinstance(k, str) for k in sample):
        raise TypeError("verify is a dict, read as keyword arguments (model(**verify)); its keys must be str.")


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _to_float64(t: Tensor) -> Tensor:
    return t.to(torch.float64) if t.is_floating_point() else t


def _run(model: nn.Module, sample: Any) -> Any:
    """``model`` on ``sample`` in eval mode under no_grad, every module's training flag restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(sample, dict):
                return model(**sample)
            if isinstance(sample, tuple):
                return model(*sample)
            return model(sample)
    finally:
        for m, mode in modes:
            m.training = mode


def _leaves(obj: Any, name: str = "output") -> Iterator[tuple[str, Tensor]]:
    """Every floating tensor in an output (tensors, tuples, lists, dicts, HF ModelOutput), by name."""
    if isinstance(obj, Tensor):
        if obj.is_nested:
            obj = obj.to_padded_tensor(0.0)
        if obj.is_floating_point():
            yield name, obj
    elif isinstance(obj, Mapping):  # HF's ModelOutput is an OrderedDict
        for k, v in obj.items():
            yield from _leaves(v, f"{name}[{k!r}]")
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{name}[{i}]")


def _compare(name: str, original: Tensor, reference: Tensor, swapped: Tensor) -> Verified:
    """Errors of ``original`` and ``swapped`` against ``reference`` (float64). Where the reference is not
    finite (a fully masked row, NaN in the math path) but the original is (torch's fused kernels give
    zeros there), the original stands in; where neither is, nothing is compared."""
    if swapped.shape != original.shape:
        return Verified(name, original.dtype, math.inf, 0.0, 0.0)
    orig64 = original.to(torch.float64)
    ref = reference.to(torch.float64)
    ref = torch.where(torch.isfinite(ref), ref, orig64)
    finite = torch.isfinite(ref)
    zero = torch.zeros((), dtype=torch.float64, device=ref.device)

    def max_err(x: Tensor) -> float:
        diff = torch.where(finite, (x.to(torch.float64) - ref).abs(), zero)
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)  # NaN where ref is finite
        return float(diff.max()) if diff.numel() else 0.0

    original_error, max_error = max_err(original), max_err(swapped)
    scale = max(1.0, float(ref[finite].abs().max())) if bool(finite.any()) else 1.0
    allowed = 2 * original_error + ATOL.get(original.dtype, 1e-5) * scale
    return Verified(name, original.dtype, max_error, original_error, allowed, int((~finite).sum()))


def _verify(model: nn.Module, sample: Any, original: Any, reference: Any) -> list[Verified]:
    """Each floating output of ``original`` against the swapped model's on ``sample``."""
    got = dict(_leaves(_run(model, sample)))
    results = []
    ref = dict(_leaves(reference))
    for name, out in _leaves(original):
        if name not in got or name not in ref:
            results.append(Verified(name, out.dtype, math.inf, 0.0, 0.0))
            continue
        results.append(_compare(name, out, ref[name], got[name]))
    return results


# -- the one call ----------------------------------------------------------------------------
def swap(
    model: nn.Module,
    *,
    verify: Tensor | tuple[Any, ...] | dict[str, Any] | None = None,
    backend: Backend = "auto",
    exclude: Iterable[str] = (),
) -> SwapReport:
    """Replace every attention module attnlab recognises in ``model``, in place; return what was done.

    Args:
        model: any ``nn.Module`` (a torch Transformer, a torchvision/timm/open_clip model, an HF model,
            or a model containing them). Replacements keep each module's device, dtype, training mode
            and ``requires_grad`` flags; ``nn.MultiheadAttention``'s Parameters are moved as the same
            objects, timm's/open_clip's fused QKV weights are split into new ones (so build an
            optimizer after the swap). Forward/backward hooks on a replaced module are moved to its
            replacement (the report says how many).
        verify: a sample input: a tensor (``model(x)``), a tuple (``model(*args)``) or a dict
            (``model(**kwargs)``). The model runs in eval mode under no_grad (training flags restored
            after) before and after the swap, and a float64 deep copy of the original runs on the
            sample cast to float64. Every floating output ``o`` must satisfy flash-attention's rule
            ``max|o_swapped - o_64| <= 2 * max|o_original - o_64| + atol * max(1, max|o_64|)``, with
            ``atol`` from :data:`ATOL` for ``o``'s dtype. Where the float64 reference is not finite
            (a fully masked row) the original's value stands in for it; where the original is not
            finite either (NaN, where attnlab returns a finite value) nothing is compared.
            On failure every original module is put back and :class:`SwapVerificationError` is raised.
        backend: the ``backend`` of every new module: ``"auto"``, ``"math"`` or ``"sdpa"``.
        exclude: module paths (as in ``model.named_modules()``) to leave alone.

    Returns:
        a :class:`SwapReport`. Swapping an already swapped model replaces nothing and reports
        "already attnlab".
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; pass the model object itself "
            f"(attnlab.swap(model)), not its state_dict or output."
        )
    if backend not in BACKEND_NAMES or backend == "flex":
        raise ValueError(
            f"backend must be one of 'auto', 'math' or 'sdpa', got {backend!r}; 'auto' runs SDPA and the math "
            f"path where the call needs it."
        )
    if isinstance(exclude, str):
        raise TypeError(f"exclude must be a collection of module paths, got the str {exclude!r}; pass [{exclude!r}].")
    excluded = frozenset(exclude)
    if verify is not None:
        _check_sample(verify)
    if not _is_hf_model(model) and _is_swappable_itself(model):
        raise ValueError(
            f"model is itself a {_class_name(model)}; swap replaces modules inside a model, in place, and cannot "
            f"replace the object you hold: wrap it (attnlab.swap(nn.Sequential(module))) or build the attnlab "
            f"module directly (attnlab.compat.MultiheadAttention / FusedQKVAttention.from_timm)."
        )

    original = reference = None
    training = any(m.training for m in model.modules())
    if verify is not None:
        try:
            original = _run(model, verify)
        except Exception as e:  # the user's model on the user's sample: nothing was swapped yet
            raise ValueError(
                f"verify=: the model itself, before any swap, raised {type(e).__name__} on the sample ({e}); "
                f"pass a sample the model accepts (verify=x calls model(x), a tuple model(*args), a dict model(**kwargs))."
            ) from e
        try:  # Exception: deepcopy, .to(float64) and a float64 run can fail in ways only the model knows
            twin = copy.deepcopy(model).to(torch.float64)
            reference = _run(twin, _map_tensors(verify, _to_float64))
        except Exception as e:
            raise ValueError(
                f"verify= compares against a float64 copy of the model, and copying or running it in float64 failed "
                f"({type(e).__name__}: {e}); nothing was swapped. Call swap without verify= and compare outputs yourself."
            ) from e
        del twin

    walk = _Walk(SwapReport(), [], backend, excluded)
    if _is_hf_model(model):
        _swap_hf(walk, model, "")
    else:
        _visit(walk, model, "")
        _note_nested_encoders(walk, model)
    unknown = sorted(excluded - walk.seen)
    if unknown:
        _undo(walk)
        raise ValueError(
            f"exclude names {unknown}, which are not module paths of this model; the paths look like "
            f"{[p for p, _ in model.named_modules()][1:4]} (model.named_modules())."
        )
    if verify is None:
        return walk.report

    paths = ", ".join(walk.report.swapped_paths) or "none"
    try:
        results = _verify(model, verify, original, reference)
    except Exception as e:  # the swapped model refused a call the original ran: undo, and say which call
        _undo(walk)
        raise SwapVerificationError(
            f"attnlab.swap(verify=...): the swapped model raised {type(e).__name__} on the sample the original ran "
            f"({e}). Swapped: {paths}. The model was restored: every original module is back in place and nothing "
            f"else was changed.",
            walk.report,
            None,
        ) from e
    walk.report.verified = results
    if training:
        walk.report.notes.append("verify ran the model in eval mode under no_grad; its training flags are as they were")
    for v in results:
        if not v.max_error <= v.allowed:
            _undo(walk)
            raise SwapVerificationError(
                f"attnlab.swap(verify=...): {v.output} ({str(v.dtype).removeprefix('torch.')}) differs after the swap "
                f"by {v.max_error:.3e} from a float64 copy of the original model; allowed {v.allowed:.3e} (2 x the "
                f"original's own error {v.original_error:.3e} + atol {ATOL.get(v.dtype, 1e-5):.0e} x max(1, "
                f"max |reference|)). Swapped: {paths}. The model was restored: every original module is back in "
                f"place and nothing else was changed.",
                walk.report,
                v,
            )
    return walk.report


def _is_swappable_itself(m: nn.Module) -> bool:
    """Whether ``m`` is itself an attention module swap would replace (the caller holds it: no parent to swap in)."""
    return isinstance(m, nn.MultiheadAttention) or any(
        _is_class(m, module, "Attention") for module in ("timm.layers.attention", "open_clip.transformer")
    )


def _undo(walk: _Walk) -> None:
    for restore in reversed(walk.undo):
        restore()
    walk.undo.clear()
