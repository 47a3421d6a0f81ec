"""Optional dependencies that fail to import: say which fix applies, since "pip install X" is wrong when X is there."""

from __future__ import annotations

from importlib import metadata

__all__ = ["import_advice"]


def _culprit(err: BaseException, package: str) -> str | None:
    """The top-level package of the deepest frame of ``err``'s traceback outside ``package`` and the import system."""
    tb, found = err.__traceback__, None
    while tb is not None:
        name = str(tb.tb_frame.f_globals.get("__name__", "")).split(".")[0]
        if name and name not in (package, "importlib", "attnlab", "builtins", "__main__"):
            found = name
        tb = tb.tb_next
    missing = getattr(err, "name", None)  # ModuleNotFoundError: the module that is absent
    if found is None and missing and str(missing).split(".")[0] != package:
        found = str(missing).split(".")[0]
    return found


def import_advice(package: str, need: str, err: BaseException, *, min_major: int | None = None) -> str:
    """One sentence for an ``import package`` that raised ``err``: ``need`` (what needs it), then why and the fix.

    Three cases, three fixes: not installed (install it), older than ``min_major`` (upgrade it), or
    installed and broken by a package it imports (repair or remove that one; a torchvision built for
    CUDA under a CPU torch is the usual culprit, and reinstalling ``package`` would not help).
    """
    spec = f"'{package}>={min_major}'" if min_major else package
    try:
        version = metadata.version(package)
    except metadata.PackageNotFoundError:
        return f"{need}, and {package} is not installed; install it with pip install {spec}."
    if min_major is not None and version.split(".")[0].isdigit() and int(version.split(".")[0]) < min_major:
        return f"{need}, and {package} {version} is installed; upgrade it with pip install -U {spec}."
    culprit = _culprit(err, package)
    where = f"comes from {culprit!r}, not from {package}" if culprit else f"comes from a package {package} imports"
    return (
        f"{need}; {package} {version} is installed but failed to import ({type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''}), which {where}: repair or uninstall that package "
        f"(a torchvision built for another torch, say: pip uninstall torchvision) and retry."
    )
