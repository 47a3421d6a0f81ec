"""``attnlab check``: build or import the target, run the suite, print a table or JSON."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Literal, TypeVar

import torch
from torch import nn

from ..core.attention import Backend, MultiHeadAttention
from .adapters import AttentionAdapter, TorchMHAAdapter, as_adapter, call_factory
from .report import print_tables, to_json
from .suite import CHECKS, run_checks

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class TargetError(ValueError):
    """A ``--target`` that cannot be built; its message is the one line shown to the user."""


def _random_biases(module: ModuleT, seed: int) -> ModuleT:
    """Nonzero biases (both libraries init them to 0), so that a bias bug cannot hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


def _factory_target(spec: str, kwargs: dict) -> AttentionAdapter:
    """``package.module:factory`` called with whichever of ``kwargs`` its signature names."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TargetError(
            f"--target {spec!r} is not 'attnlab', 'torch' or 'package.module:factory'; pass e.g. --target mypkg.layers:make_attention."
        )
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's own package in the current folder imports
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(module_name)
    except ImportError as e:
        raise TargetError(
            f"--target {spec!r}: module {module_name!r} cannot be imported ({e}); check that it is on PYTHONPATH."
        ) from None
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise TargetError(
            f"--target {spec!r}: {module_name} has no callable {attr!r}; name a function returning an nn.Module or an adapter."
        )
    try:
        built = call_factory(factory, **kwargs)
    except Exception as e:  # the user's code: show its complaint in one line, not a traceback
        raise TargetError(
            f"--target {spec!r}: calling {attr}() raised {type(e).__name__}: {e}; a factory takes no arguments "
            f"besides any of {sorted(kwargs)} and returns an nn.Module or an adapter."
        ) from None
    try:
        adapter = as_adapter(built)
    except TypeError as e:
        raise TargetError(f"--target {spec!r}: {e}") from None
    if isinstance(adapter, AttentionAdapter) and adapter.factory is None:
        adapter.factory = factory  # the head-dim and head-layout checks rebuild the target through it
    return adapter


def _targets(
    target: str,
    backend: Backend | Literal["both"],
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    dropout: float,
    need_weights: bool,
    seed: int,
) -> list[object]:
    torch.manual_seed(seed)
    if target == "attnlab":
        backends: tuple[Backend, ...] = ("math", "sdpa") if backend == "both" else (backend,)
        return [
            _random_biases(
                MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, dropout=dropout, backend=b), seed
            )
            for b in backends
        ]
    if target == "torch":
        if num_kv_heads not in (None, num_heads):
            raise TargetError(
                f"--num-kv-heads {num_kv_heads} with --target torch: torch.nn.MultiheadAttention has no GQA; drop the flag."
            )
        m = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True)
        return [TorchMHAAdapter(_random_biases(m, seed), need_weights=need_weights)]
    kwargs = {"embed_dim": embed_dim, "num_heads": num_heads, "num_kv_heads": num_kv_heads, "dropout": dropout}
    return [_factory_target(target, kwargs)]


def check(
    target: str = "attnlab",
    backend: Literal["both", "auto", "math", "sdpa"] = "both",
    json: bool = False,
    embed_dim: int = 32,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    dropout: float = 0.1,
    need_weights: bool = True,
    batch: int = 2,
    seq_len: int = 8,
    seed: int = 0,
    checks: tuple[str, ...] = (),
) -> int:
    """Audit an attention module against attnlab's float64 reference; exit code 1 if a check fails.

    Args:
        target: 'attnlab', 'torch' (torch.nn.MultiheadAttention) or 'package.module:factory'
            (returns an nn.Module following attnlab's convention, or an adapter; called with
            whichever of embed_dim, num_heads, num_kv_heads, dropout it accepts; one that takes
            embed_dim and num_heads is also called at other sizes, for the head-dim checks).
        backend: attnlab backends to audit ('both' = math and sdpa).
        json: print JSON for CI instead of tables.
        embed_dim: E.
        num_heads: H.
        num_kv_heads: G (GQA) for attnlab; default H.
        dropout: attention dropout of the built module; > 0 so that 'dropout off in eval' is checked.
        need_weights: passed to torch.nn.MultiheadAttention on every call (its default is True).
        batch: B of the inputs.
        seq_len: T of the inputs (>= 4).
        seed: seeds weights and inputs.
        checks: run only these checks (default: all).
    """
    unknown = [c for c in checks if c not in CHECKS]
    try:
        if unknown:
            raise TargetError(f"--checks got unknown names {unknown}; expected names among {list(CHECKS)}.")
        targets = _targets(target, backend, embed_dim, num_heads, num_kv_heads, dropout, need_weights, seed)
        # run_checks turns every failure inside a check into a row: what escapes is an argument error
        reports = [run_checks(t, checks=checks or None, seed=seed, batch=batch, seq_len=seq_len) for t in targets]
    except (TargetError, ValueError, TypeError) as e:  # ValueError/TypeError: argument checks, ours or the module's
        print(f"attnlab check: error: {e}", file=sys.stderr)
        return 2
    if json:
        print(to_json(reports))
    else:
        print_tables(reports)
    return 0 if all(r.ok for r in reports) else 1
