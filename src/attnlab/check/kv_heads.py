"""The argument or config field that sets a module's K/V head count, found by what the module computes.

gpt-fast's ``ModelArgs.n_local_heads`` (default -1: as many as the heads), a constructor's ``kv_groups``: a
count of K/V heads under a name no list knows. Built with it left alone such a module is plain multi-head
attention, and a mistake in how it shares K/V heads between query heads (tiled where grouped) changes nothing.
So each integer it takes that nothing else fills (a config field its source reads, a constructor argument
with a default) is set in turn to G < H, the module built, and its data flow read
(:func:`attnlab.check.dataflow.read_dataflow`): the knob is the one whose module then has H query heads and
G K/V heads (the K projection's width ``G * D`` against Q's ``H * D``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["find_kv_knob", "has_kv_knob", "set_kv_knob"]

# what was found per constructor, so that each rebuild (other sizes, GQA, MQA) does not search again
_FOUND: dict[object, tuple[str, str | None] | None] = {}


def _int_like(v: object) -> bool:
    return type(v) is int


def _knobs(
    obj: Callable, kwargs: Mapping[str, object], config_fields: Mapping[str, list[str]]
) -> list[tuple[str, str | None]]:
    """Candidates ``(argument, field)``: each integer field a config argument carries that ``config_fields``
    (per argument, the fields nothing named) lists, then each integer-defaulted argument not filled."""
    out: list[tuple[str, str | None]] = []
    for arg, fields in config_fields.items():
        cfg = kwargs.get(arg)
        out += [(arg, f) for f in fields if _int_like(getattr(cfg, f, None))]
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return out
    out += [(n, None) for n, p in params.items() if n not in kwargs and _int_like(p.default)]
    return out


def set_kv_knob(kwargs: Mapping[str, object], knob: tuple[str, str | None], G: int) -> dict[str, object]:
    """``kwargs`` with the knob set to ``G`` (a config argument copied first: the caller's is not changed)."""
    arg, field = knob
    trial = dict(kwargs)
    if field is None:
        trial[arg] = G
        return trial
    cfg = copy.copy(trial[arg])
    try:
        setattr(cfg, field, G)
    except (AttributeError, TypeError):
        return trial
    trial[arg] = cfg
    return trial


def _heads(obj: Callable, kwargs: Mapping[str, object], E: int) -> tuple[int, int] | None:
    """``(H, G)`` that ``obj(**kwargs)``'s data flow reads on self-attention of width ``E``; None when it does
    not build, run or read."""
    from .dataflow import read_dataflow
    from .probe import _call, context_required, read_call_form

    def built() -> nn.Module | None:
        with torch.random.fork_rng():  # the caller's draws stay as they were
            made = obj(**kwargs)
        return made.eval() if isinstance(made, nn.Module) else None

    try:
        module = built()
        if module is None:
            return None
        form = context_required(module, read_call_form(module), E)
        reading = read_dataflow(module, lambda m, x: _call(m, form, (x, x, x), {}), E)
    except Exception:
        return None
    return None if reading is None else (reading.num_heads, reading.num_kv_heads)


def find_kv_knob(
    obj: Callable, kwargs: Mapping[str, object], config_fields: Mapping[str, list[str]], E: int, H: int, G: int
) -> tuple[str, str | None] | None:
    """The ``(argument, config field or None)`` that sets ``obj``'s K/V heads, by experiment (see the module
    docstring); None when the module built from ``kwargs`` already reads G K/V heads, or no knob gives them."""
    try:
        if obj in _FOUND:
            return _FOUND[obj]
    except TypeError:  # an unhashable callable: searched each time
        pass
    if not (1 <= G < H and H % G == 0):
        return None
    found: tuple[str, str | None] | None = None
    knobs = _knobs(obj, kwargs, config_fields)
    base = _heads(obj, kwargs, E) if knobs else None
    if base == (H, H):  # plain multi-head as built: is there a count that groups them?
        found = next((k for k in knobs if _heads(obj, set_kv_knob(kwargs, k, G), E) == (H, G)), None)
    try:
        _FOUND[obj] = found
    except TypeError:
        pass
    return found


def has_kv_knob(obj: Callable) -> bool:
    """Whether a search found ``obj``'s K/V-heads knob."""
    try:
        return _FOUND.get(obj) is not None
    except TypeError:
        return False
