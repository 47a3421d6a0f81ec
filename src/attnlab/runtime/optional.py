"""Optional dependencies that fail to import: say which fix applies, since "pip install X" is wrong when X is there.

Two entry points, one diagnosis. :func:`import_advice` (the model loaders') tells three cases
apart: not installed, too old, broken by a package it imports. :func:`import_failure` (what
``attnlab.hf.register()`` raises) tells those and three more (the names it needs missing, the
package's files missing under its metadata, an error of the package's own) and, when another
package broke the import, names that package's version, the module that raised, the error that
surfaced it, and for a torch extension (torchvision, torchaudio) how it fails to match torch.

Both read the whole chain of the error (``__cause__``, else ``__context__``): transformers' lazy
imports re-raise the real error as ``ModuleNotFoundError: Could not import module 'X'. Are this
object's requirements defined correctly?``, which names neither the cause nor where it was raised.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from types import TracebackType

__all__ = ["import_advice", "import_failure", "installed_version"]

# Frames of these top-level modules are the import machinery or the caller, never a culprit.
_NOT_CULPRITS = ("importlib", "attnlab", "builtins", "__main__")


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors under it, outermost first: ``__cause__``, else an unsuppressed ``__context__``."""
    chain: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and all(e is not seen for seen in chain):  # a cycle ends the walk
        chain.append(e)
        e = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
    return chain


def _frames(tb: TracebackType | None) -> list[tuple[str, str]]:
    """``(module __name__, file)`` of each frame of a traceback, outermost first."""
    frames = []
    while tb is not None:
        frames.append((str(tb.tb_frame.f_globals.get("__name__", "")), tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    return frames


def _raised_in(err: BaseException, package: str) -> tuple[str, str, str] | None:
    """Where in ``err``'s traceback the failure left ``package``: ``(module entered, its file, module
    that raised)``, dotted names; None when the failure never left ``package`` and the import system.

    The module entered is the first one outside ``package`` that ``package``'s own code called (a
    torchvision whose import fails inside ``torch.library`` is entered as ``torchvision``); frames
    before ``package``'s first are its caller's. A traceback that never passes through ``package``
    has only its deepest frame to go by.
    """

    def foreign(frames: list[tuple[str, str]]) -> list[tuple[str, str]]:
        return [(n, f) for n, f in frames if n.split(".")[0] not in (package, *_NOT_CULPRITS)]

    frames = [(name, file) for name, file in _frames(err.__traceback__) if name]
    tops = [name.split(".")[0] for name, _ in frames]
    if package in tops:
        after = foreign(frames[tops.index(package) :])
        return (after[0][0], after[0][1], after[-1][0]) if after else None
    outside = foreign(frames)
    return (outside[-1][0], outside[-1][1], outside[-1][0]) if outside else None


def _culprit(err: BaseException, package: str) -> str | None:
    """The top-level package, not ``package``, that broke an import of it, read down ``err``'s chain."""
    for e in reversed(_chain(err)):
        where = _raised_in(e, package)
        if where is not None:
            return where[0].split(".")[0]
    missing = getattr(err, "name", None)  # ModuleNotFoundError: the module that is absent
    if missing and str(missing).split(".")[0] != package:
        return str(missing).split(".")[0]
    return None


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def installed_version(package: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def import_advice(package: str, need: str, err: BaseException, *, min_major: int | None = None) -> str:
    """One sentence for an ``import package`` that raised ``err``: ``need`` (what needs it), then why and the fix.

    Three cases, three fixes: not installed (install it), older than ``min_major`` (upgrade it), or
    installed and broken by a package it imports (repair or remove that one; a torchvision built for
    CUDA under a CPU torch is the usual culprit, and reinstalling ``package`` would not help).
    The error named is the deepest of ``err``'s chain, the one that started it.
    """
    spec = f"'{package}>={min_major}'" if min_major else package
    version = installed_version(package)
    if version is None:
        return f"{need}, and {package} is not installed; install it with pip install {spec}."
    if min_major is not None and version.split(".")[0].isdigit() and int(version.split(".")[0]) < min_major:
        return f"{need}, and {package} {version} is installed; upgrade it with pip install -U {spec}."
    culprit = _culprit(err, package)
    where = f"comes from {culprit!r}, not from {package}" if culprit else f"comes from a package {package} imports"
    root = _chain(err)[-1]
    return (
        f"{need}; {package} {version} is installed but failed to import ({_first_line(root)}), which {where}: "
        f"repair or uninstall that package (a torchvision built for another torch, say: pip uninstall torchvision) "
        f"and retry."
    )


def _distribution_of(top: str, file: str) -> tuple[str, str] | None:
    """``(distribution, version)`` that installed the top-level module ``top``, when ``file`` (a module of
    it that ran) is that distribution's; None for a file that only shares the name (a local ``top/``)."""
    for name in metadata.packages_distributions().get(top) or []:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        home = Path(str(dist.locate_file(top))).resolve()
        here = Path(file).resolve()
        if file.startswith("<") or here == home or home in here.parents or here.with_suffix("") == home:
            version = installed_version(name)
            return (name, version) if version is not None else None
    return None


def _torch_pin(dist: str) -> str | bool | None:
    """How ``dist`` requires torch: the pinned version (``torch==X``), True (unpinned), or None (not at all)."""
    found: str | bool | None = None
    for req in metadata.requires(dist) or []:
        if ";" in req and "extra" in req.split(";", 1)[1]:
            continue  # an optional extra's requirement
        match = re.match(r"\s*torch\b(?![-_.\w])\s*\(?\s*([^;)]*)", req)
        if match:
            pin = re.fullmatch(r"==\s*([\w.+]+)", match.group(1).strip())
            found = pin.group(1) if pin else True
    return found


def _torch_extension_fix(dist: str, version: str, package: str) -> str | None:
    """For a package built against torch (torchvision, torchaudio): how it and torch disagree, and the fix."""
    pin = _torch_pin(dist)
    torch_version = installed_version("torch")
    if pin is None or torch_version is None or dist == "torch":
        return None
    torch_base, _, torch_label = torch_version.partition("+")
    base, _, label = version.partition("+")
    index = f" --index-url https://download.pytorch.org/whl/{torch_label}" if torch_label else ""
    if isinstance(pin, str) and pin.partition("+")[0] != torch_base:
        why = f"{dist} {version} was built for torch {pin}, but torch {torch_version} is installed"
        fix = f"install the {dist} release paired with torch {torch_base}" + (
            f" from torch's index ({index[1:]})" if index else ""
        )
    else:
        if label != torch_label:
            mine = f"a +{label} build" if label else "the default index's build (CUDA, on Linux)"
            theirs = f"a +{torch_label} build" if torch_label else "the default index's build"
            why = f"{dist} {version} is {mine}, but torch {torch_version} is {theirs}"
        else:
            why = (
                f"{dist} {version} is installed beside torch {torch_version}, and one built for another torch fails so"
            )
        fix = f"reinstall it from torch's index (pip install --force-reinstall --no-deps {dist}=={base}{index})"
    return f"{why}: {fix}, or pip uninstall {dist}, and retry; reinstalling {package} would not help."


def import_failure(package: str, need: str, err: BaseException, *, min_major: int | None = None) -> str:
    """The cause of an ``import package`` (or ``from package... import name``) that raised ``err``, and its fix.

    ``need`` says what needs the package. Cases, each with its own fix:

    * not installed: install it; its metadata there but its module not found: reinstall it;
    * older than ``min_major``: upgrade it (the installed version named);
    * it imports but lacks a name asked for: a file or folder shadowing it, or a build without it;
    * its import raised inside another package: that package and version, the module that raised,
      the error and the one that surfaced it; for a torch extension, how it and torch disagree;
    * its import raised in its own code (a dependency's version check, say): that error, verbatim.
    """
    spec = f"'{package}>={min_major}'" if min_major else package
    chain = _chain(err)
    root = chain[-1]
    version = installed_version(package)
    missing = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
    if version is None and missing == package:
        return f"{need}, and {package} is not installed; install it with pip install {spec}."
    if version is not None and min_major is not None:
        major = version.split(".")[0]
        if major.isdigit() and int(major) < min_major:
            return f"{need}, and {package} {version} is installed; upgrade it with pip install -U {spec}."
    which = f"{package} {version}" if version else f"{package} (with no installed version: no package metadata)"
    if missing == package:
        return (
            f"{need}; {which} is installed by its metadata, but no module {package} is found (an interrupted "
            f"install or uninstall); reinstall it with pip install --force-reinstall {spec}."
        )
    asked = re.match(r"cannot import name '([^']+)' from '([^']+)'", str(root))
    if type(root) is ImportError and asked and asked.group(2).split(".")[0] == package:
        name, module = asked.groups()
        path = getattr(root, "path", None)
        home = None
        if version is not None:
            home = Path(str(metadata.distribution(package).locate_file(package))).resolve()
        if path and home is not None and home not in Path(path).resolve().parents:
            fix = (
                f"that {module} is {path}, not the installed one under {home}: a file or folder named {package} "
                f"shadows it; rename it"
            )
        else:
            fix = f"this {package} build lacks it; reinstall a release with pip install --force-reinstall {spec}"
        return f"{need}; {which} is installed, but {module} has no {name} ({_first_line(root)}): {fix}."
    where = None
    for e in reversed(chain):
        where = _raised_in(e, package)
        if where is not None:
            break
    surfaced = ""
    if root is not err:
        outer = str(err).split(". ")[0].splitlines()[0] if str(err) else ""
        surfaced = f"; {package} re-raised it as {type(err).__name__}: {outer}"
    head = f"{need}; {which} is installed but failed to import ({_first_line(root)})"
    if where is None:
        origin = next((n for n, _ in reversed(_frames(root.__traceback__)) if n.split(".")[0] == package), package)
        return (
            f"{head}, in the code of {package} itself ({origin}{surfaced}): that error names the fault (a dependency "
            f"of {package} too old, say); fix it, or reinstall with pip install --force-reinstall {spec}, and retry."
        )
    entered, file, deepest = where
    top = entered.split(".")[0]
    raised = f"; raised in {deepest}" if deepest.split(".")[0] != top else ""
    dist = _distribution_of(top, file)
    if dist is None:
        return (
            f"{head}, inside {top}, which is no installed package but {file}{raised}{surfaced}: a file or folder "
            f"named {top} shadows the real one, or is broken; rename or repair it, and retry."
        )
    dist_name, dist_version = dist
    fix = _torch_extension_fix(dist_name, dist_version, package) or (
        f"repair it (pip install --force-reinstall {dist_name}) or uninstall it (pip uninstall {dist_name}), "
        f"and retry; reinstalling {package} would not help."
    )
    return f"{head}, inside {top} ({dist_name} {dist_version}{raised}{surfaced}). {fix}"
