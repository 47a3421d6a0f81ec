"""A griffe extension for the documentation site: Sphinx roles in docstrings read as code.

attnlab's docstrings cross-reference with Sphinx roles (``:class:`attnlab.TinyGPT```, ``:func:`~x.y```),
which the terminal's ``help()`` shows as they are but Markdown does not know: the API page printed
``:class:`` before each name. Each role becomes a code span of its target (``~`` keeps the last part of a
dotted name, as Sphinx shows it), before mkdocstrings renders the docstring.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|term|ref):`(~?)([^`]+)`")


def plain_roles(text: str) -> str:
    """``:class:`~a.b.C``` -> ```C```, ``:func:`a.f``` -> ```a.f```."""
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
