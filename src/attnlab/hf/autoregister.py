"""``attn_implementation="attnlab"`` right after ``import attnlab``, without importing transformers then.

``import attnlab`` calls :func:`install`: when transformers' ``modeling_utils`` (where ``AttentionInterface``
lives) is already imported, :func:`attnlab.hf.register` runs at once; otherwise a finder on ``sys.meta_path``
waits for that module and registers right after it has run, before any model can be built. Importing attnlab
costs the finder (no transformers import: measured in ``tests/test_hf_import_register.py``). A registration that
fails here (transformers too old, the name taken by another function) stays silent: the error is kept in
:data:`failure` and ``attnlab.hf.register()`` raises it with its fix when called.

``ATTNLAB_HF_AUTOREGISTER=0`` in the environment turns it off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["WATCHED", "failure", "install"]

WATCHED = "transformers.modeling_utils"  # defines AttentionInterface; models are built only after it has run
failure: BaseException | None = None  # why the automatic registration did not happen, when it failed


def _register_quietly() -> None:
    global failure
    from .attention import register

    try:
        register()
        failure = None
    except Exception as err:  # transformers 4, a conflicting registration...: register() says so when called
        failure = err


class _RegisterAfter(importlib.abc.Loader):
    """The real loader of :data:`WATCHED`, then :func:`attnlab.hf.register`."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register_quietly()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: as the real loader
        return getattr(self._loader, name)


class _Watch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: hands :data:`WATCHED`'s spec from the other finders, its loader wrapped."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now if transformers' models are importable already, else when they are imported. Idempotent."""
    if os.environ.get("ATTNLAB_HF_AUTOREGISTER", "1") == "0":
        return
    if WATCHED in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _Watch) for f in sys.meta_path):
        sys.meta_path.insert(0, _Watch())
