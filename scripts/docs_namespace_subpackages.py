"""A griffe extension for the documentation site (mkdocs.yml loads it through mkdocstrings).

attnlab's core/, models/, tools/ and bench/ folders have no ``__init__.py``: Python imports them as
namespace subpackages, but griffe on purpose skips a folder without one inside a regular package, so
``::: attnlab.MultiHeadAttention`` (an alias of ``attnlab.core.attention.MultiHeadAttention``) would
not resolve. After griffe loads the package, this adds each such folder as a module and reads its
files the same static way (nothing is imported).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe


class NamespaceSubpackages(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if isinstance(pkg.filepath, list) or pkg.filepath is None or pkg.filepath.name != "__init__.py":
            return
        self._add_folders(pkg, pkg.filepath.parent, loader)

    def _add_folders(self, parent: griffe.Module, folder: Path, loader: griffe.GriffeLoader) -> None:
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and p.name.isidentifier()):
            if (sub / "__init__.py").exists() or sub.name in parent.members:
                continue  # a regular subpackage: griffe loaded it already
            files = sorted(sub.glob("*.py"))
            if not files:
                continue
            module = griffe.Module(sub.name, filepath=sub, parent=parent, lines_collection=loader.lines_collection)
            parent.set_member(sub.name, module)
            for file in files:
                code = file.read_text(encoding="utf-8")
                loader.lines_collection[file] = code.splitlines()
                child = griffe.visit(
                    file.stem,
                    filepath=file,
                    code=code,
                    extensions=loader.extensions,
                    parent=module,
                    docstring_parser=loader.docstring_parser,
                    docstring_options=loader.docstring_options,
                    lines_collection=loader.lines_collection,
                    modules_collection=loader.modules_collection,
                )
                module.set_member(file.stem, child)
            self._add_folders(module, sub, loader)
