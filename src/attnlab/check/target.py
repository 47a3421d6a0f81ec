"""``--target``: what ``attnlab check`` and ``attnlab trace`` run, built from a file path or a module path.

Accepted forms:

- ``path/to/mine.py:Name`` (or ``./mine.py:Name``): the file is imported as it is, its folder on
  ``sys.path`` so that its own imports work;
- ``package.module:Name``: imported from ``PYTHONPATH`` or the current folder.

``Name`` is an ``nn.Module`` class, a factory returning a module or an adapter, or a module
instance. A class or factory is called with whichever of these its signature names, under any of
the usual spellings: the width (``embed_dim``, ``d_model``, ``model_dim``, ``dim``, ``hidden_size``
...), the heads (``num_heads``, ``n_heads``, ``nhead``, ``heads``, ``h`` ...), the K/V heads
(``num_kv_heads``, ``n_kv_heads`` ...) and dropout (``dropout``, ``dropout_p``, ``p`` ...). Any
other argument without a default is an error naming it. Projection biases that are all zero
(the usual init) get small random values, seeded, so that a bias bug cannot hide.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Literal, cast

import torch
from torch import nn

from ..runtime import UsageError
from .adapters import AttentionAdapter
from .device import place, resolve_device, resolve_dtype
from .probe import NotAttention, ProbedAdapter, as_adapter

__all__ = ["TargetError", "build_target", "load_object", "random_biases"]


class TargetError(UsageError):
    """A ``--target`` that cannot be built; its message is the one line shown to the user."""


ALIASES: dict[str, tuple[str, ...]] = {
    "embed_dim": ("embed_dim", "d_model", "model_dim", "dim", "hidden_size", "hidden_dim", "n_embd", "emb_dim",
                  "embedding_dim", "d_embed", "embed_size", "n_embed", "width", "in_dim", "input_dim"),
    "num_heads": ("num_heads", "n_heads", "n_head", "heads", "nhead", "h", "num_attention_heads", "head_count",
                  "nheads", "num_head"),
    "num_kv_heads": ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "kv_heads", "n_kv_head", "num_kv_head"),
    "dropout": ("dropout", "dropout_p", "p", "attn_dropout", "dropout_rate", "attention_dropout", "drop", "attn_drop",
                "dropout_prob"),
}  # fmt: skip


def random_biases(module: nn.Module, seed: int) -> nn.Module:
    """Projection biases that are all zero get ``0.1 * N(0, 1)`` values (seeded): a bias bug then shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias") and p.dtype.is_floating_point and not bool(p.any()):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


def _import_file(spec: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise TargetError(
            f"--target {spec!r}: there is no file {str(path)!r} (looked in {os.getcwd()}); pass the path of "
            f"the .py file that defines your module, e.g. --target path/to/mine.py:MultiHeadAttention."
        )
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the file's own `import helpers` works, as under `python mine.py`
    name = f"_attnlab_target_{path.stem}_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None  # a .py file always has one
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        where = f" at line {frames[-1].lineno}" if frames else ""
        raise TargetError(
            f"--target {spec!r}: importing {path} raised {type(e).__name__}{where}: {e}; "
            f"fix the file so that `python {path}` runs."
        ) from None
    return module


def load_object(spec: str) -> tuple[object, str]:
    """``(the object spec names, its name)``; a :class:`TargetError` for each way that can fail."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        if spec.endswith(".py"):
            raise TargetError(
                f"--target {spec!r} names a file but not what to build in it; add ':ClassName', e.g. "
                f"--target {spec}:MultiHeadAttention."
            )
        raise TargetError(
            f"--target {spec!r} is not 'attnlab', 'torch', 'path/to/file.py:Name' or 'package.module:Name'; "
            f"pass e.g. --target mine.py:MultiHeadAttention."
        )
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_file(spec, Path(where))
    else:
        if os.getcwd() not in sys.path:  # as `python -m` would: the user's own package in the current folder
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise TargetError(
                f"--target {spec!r}: module {where!r} cannot be imported ({e}); check that it is on PYTHONPATH, "
                f"or pass the file's path: --target path/to/{where.rsplit('.', 1)[-1]}.py:{attr}."
            ) from None
        except Exception as e:
            raise TargetError(f"--target {spec!r}: importing {where} raised {type(e).__name__}: {e}.") from None
    if not hasattr(module, attr):
        classes = [
            n
            for n, v in vars(module).items()
            if inspect.isclass(v) and issubclass(v, nn.Module) and v.__module__ == module.__name__
        ]
        funcs = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        offer = (
            "; ".join(
                p
                for p in (
                    f"nn.Module classes: {', '.join(classes)}" if classes else "",
                    f"functions: {', '.join(funcs)}" if funcs else "",
                )
                if p
            )
            or "no classes or functions"
        )
        raise TargetError(f"--target {spec!r}: {where} defines no {attr!r} ({offer}); pass one of them after the ':'.")  # fmt: skip
    return getattr(module, attr), attr


def _constructor_kwargs(spec: str, obj: Callable, wanted: dict[str, object]) -> dict[str, object]:
    """The keyword arguments to build ``obj`` with: each of ``wanted`` under the spelling its signature uses."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return {}
    kwargs: dict[str, object] = {}
    for canonical, value in wanted.items():
        name = next((n for n in ALIASES[canonical] if n in params), None)
        if name is not None and value is not None:
            kwargs[name] = value
    unguessable = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and n not in kwargs
    ]
    if unguessable:
        what = getattr(obj, "__name__", "it")
        raise TargetError(
            f"--target {spec!r}: {what}() needs {', '.join(repr(n) for n in unguessable)}, which check cannot guess "
            f"(it fills the width, heads, K/V heads and dropout from --embed-dim, --num-heads, --num-kv-heads, --dropout); "
            f"give them defaults, or point --target at a factory: def make(embed_dim, num_heads): return {what}(...)."
        )
    return kwargs


def build_target(
    spec: str,
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    dropout: float,
    seed: int,
    scale: float | None = None,
    mask_convention: Literal["keep", "block"] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> AttentionAdapter:
    """The adapter for ``--target spec``, built at those sizes (see the module docstring), then moved to
    ``device`` in ``dtype`` (each None: where and as it was built) before its call form and mask are probed:
    a module may behave otherwise on another device. An instance named by ``spec`` is copied, not moved."""
    dev = None if device is None else resolve_device(device, "--device")
    dt = None if dtype is None else resolve_dtype(dtype, dev, "--dtype")
    obj, attr = load_object(spec)
    wanted: dict[str, object] = {
        "embed_dim": embed_dim,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "dropout": dropout,
    }
    if isinstance(obj, nn.Module):  # an instance: checked at its own size, never rebuilt
        built: object = obj
        factory = None
    elif callable(obj):
        kwargs = _constructor_kwargs(spec, obj, wanted)
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        torch.manual_seed(seed)
        try:
            built = obj(**kwargs)
        except Exception as e:  # the user's code: its complaint in one line, not a traceback
            raise TargetError(
                f"--target {spec!r}: {attr}({shown}) raised {type(e).__name__}: {e}; pass sizes it accepts "
                f"(--embed-dim, --num-heads, --num-kv-heads), or point --target at a factory that builds it."
            ) from None
        factory = _canonical_factory(spec, obj)
    else:
        raise TargetError(
            f"--target {spec!r}: {attr} is a {type(obj).__name__}, not an nn.Module class, a factory or a module."
        )
    if isinstance(built, nn.Module):
        random_biases(built, seed)  # drawn on the CPU, as in every run: then moved
        built = place(built, dev, dt, copy_module=built is obj)
    if isinstance(built, nn.Module) and not isinstance(built, nn.MultiheadAttention):
        from ..core.attention import MultiHeadAttention

        if not isinstance(built, MultiHeadAttention):
            try:
                took_dropout = callable(obj) and not isinstance(obj, nn.Module) and _takes(obj, "dropout")
                probed = ProbedAdapter(
                    built,
                    num_heads=num_heads,
                    scale=scale,
                    mask_convention=mask_convention,
                    name=attr,
                    factory=factory,
                    dropout=dropout if took_dropout else None,  # what it was asked for is the truth
                )
            except NotAttention as e:
                raise TargetError(f"--target {spec!r}: {e}.") from None
            _check_runs(spec, probed)
            return probed
    try:
        adapter = cast(AttentionAdapter, place(as_adapter(built, scale=scale), dev, dt))
    except TypeError as e:
        raise TargetError(f"--target {spec!r}: {e}") from None
    except ValueError as e:  # an adapter elsewhere without to(): its message names the fix
        raise TargetError(f"--target {spec!r}: {e}") from None
    if isinstance(adapter, AttentionAdapter) and adapter.factory is None:
        adapter.factory = factory  # the head-dim and head-layout checks rebuild the target through it
    return adapter


def _takes(obj: Callable, canonical: str) -> bool:
    try:
        return any(n in inspect.signature(obj).parameters for n in ALIASES[canonical])
    except (TypeError, ValueError):
        return False


def _canonical_factory(spec: str, obj: Callable) -> Callable[..., object]:
    """``obj`` behind a factory taking the canonical names, for ``resized``; it takes ``num_kv_heads``
    only when ``obj`` does (a module without K/V heads of its own cannot be rebuilt as GQA)."""

    def build(**wanted: object) -> object:
        built = obj(**_constructor_kwargs(spec, obj, wanted))
        return random_biases(built, 0) if isinstance(built, nn.Module) else built

    def make(embed_dim: int, num_heads: int, dropout: float = 0.0) -> object:
        return build(embed_dim=embed_dim, num_heads=num_heads, dropout=dropout)

    def make_gqa(embed_dim: int, num_heads: int, num_kv_heads: int, dropout: float = 0.0) -> object:
        return build(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, dropout=dropout)

    if not (_takes(obj, "embed_dim") and _takes(obj, "num_heads")):
        return obj  # it cannot build other sizes: resized() says so, naming what it lacks
    return make_gqa if _takes(obj, "num_kv_heads") else make


@torch.no_grad()
def _check_runs(spec: str, adapter: ProbedAdapter) -> None:
    """One self-attention call: the module must give back ``(B, T, E)``. An exception is left to the checks
    (it is a finding about the module), unless it says the call's arguments are wrong."""
    x = torch.randn(2, 7, adapter.embed_dim).to(adapter.projections().q_weight)
    try:
        out = adapter(x, x, x)
    except TypeError as e:
        if "argument" in str(e):
            raise TargetError(
                f"--target {spec!r}: calling it as {adapter.form.describe()} raised TypeError: {e}; "
                f"attnlab check calls forward(query, key, value), forward(x_query, x_context) or forward(x)."
            ) from None
        return
    except Exception:
        return
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TargetError(
            f"--target {spec!r}: {adapter.name} is not attention as check reads it: called on query/key/value of "
            f"shape {list(x.shape)} it returned {got}, not {list(x.shape)} (B, T, E)."
        )
