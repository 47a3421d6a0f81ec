"""Lets the registry's torchvision import next to a CPU build of torch: test set-up only.

Why: PyPI's torchvision 0.28.0 (the release paired with torch 2.13) is a CUDA build. Its C++
extension (``torchvision/_C.so``) cannot load against the CPU torch the project pins, and
torchvision then still registers fake kernels for two of those C++ operators
(``torchvision::nms``, ``torchvision::qnms``) at import. Registering a kernel for an operator that
was never defined raises ``RuntimeError: operator torchvision::nms does not exist``, so
``import torchvision`` fails, and with it ``import timm``, ``import open_clip`` and most of
``transformers`` (which imports torchvision when it is installed).

What: when, and only when, torchvision has already failed to load its extension, define the
schemas of those two operators (no kernel) just before ``torchvision._meta_registrations`` runs.
torchvision's pure-Python parts (the ViT and every other model, transforms) then work;
``torchvision.ops.nms`` and the other C++ ops still refuse with torchvision's own "Couldn't load
custom C++ ops" error. With a torchvision whose extension loads, this does nothing.

How it is installed: ``make`` runs ``python tests/support/torchvision_cpu_shim.py --install``,
which copies this file into the project's virtual environment with a ``.pth`` line that imports
it at interpreter start-up, so test subprocesses get it too. attnlab itself never imports it.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # the torch.library.Library holding the schemas; kept alive for the process


class _BeforeMetaRegistrations(importlib.abc.MetaPathFinder):
    """Runs once, as torchvision imports its fake-kernel module, then steps aside."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        global _library
        if fullname != _TARGET or _library is not None:
            return None
        extension = sys.modules.get("torchvision.extension")
        if extension is None or extension._has_ops():
            return None
        import torch

        _library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            _library.define(schema)
        return None  # the ordinary finders import the module itself


def install_hook() -> None:
    if not any(isinstance(f, _BeforeMetaRegistrations) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeMetaRegistrations())


def _install_into_environment() -> None:
    import shutil
    import sysconfig
    from pathlib import Path

    site = Path(sysconfig.get_paths()["purelib"])
    shutil.copyfile(__file__, site / "_attnlab_torchvision_cpu_shim.py")
    (site / "_attnlab_torchvision_cpu_shim.pth").write_text(
        "import _attnlab_torchvision_cpu_shim; _attnlab_torchvision_cpu_shim.install_hook()\n"
    )
    print(f"torchvision CPU shim installed in {site}")


if __name__ == "__main__" and sys.argv[1:] == ["--install"]:
    _install_into_environment()
