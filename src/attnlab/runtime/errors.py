"""The exceptions of a user's mistake, each reported by ``attnlab`` as one sentence and exit 2.

* :class:`UsageError`: bad input (an argument, a flag); a ``ValueError``.
* :class:`ModelFileError`: a model file (GGUF, ``config.json``, safetensors, tokenizer) that is
  damaged, inconsistent or claims more than it holds; a ``UsageError``.
* :class:`ModelFileNotFoundError`: a model file or directory that is not there; also a
  ``FileNotFoundError``, so ``except FileNotFoundError`` code keeps working.
* :class:`LimitError`: a request past a limit (the model's context, ``--max-tokens``, this
  machine's memory), refused before any work with the number that fits.
"""

from __future__ import annotations

import math

__all__ = ["LimitError", "ModelFileError", "ModelFileNotFoundError", "UsageError", "check_range", "range_words"]


class UsageError(ValueError):
    """Bad input from the user: ``attnlab`` prints ``attnlab: error: <message>`` and exits 2.

    The message names the argument, what was received, what was expected and the fix. A
    ``ValueError`` so that Python callers can catch it as the usual kind of bad argument.
    """


class ModelFileError(UsageError):
    """A model file attnlab cannot use: the message names the file, the field or tensor, what was
    found, what was expected, and the fix (copy the file again, or re-export it)."""


class ModelFileNotFoundError(ModelFileError, FileNotFoundError):
    """A model file or directory that does not exist."""


class LimitError(UsageError):
    """A request past a limit, refused before the work starts; the message says the number that fits."""


def check_range(
    flag: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
    hint: str = "",
) -> None:
    """Raise :class:`UsageError` unless ``low <= value <= high`` (bounds as asked) and finite.

    ``flag`` is the name the user typed (``"--steps"``), so the message points at it.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer and not isinstance(value, int):
        ok = False
    if ok and low is not None:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value <= high if high_inclusive else value < high
    if ok:
        return
    want = range_words(low=low, high=high, low_inclusive=low_inclusive, high_inclusive=high_inclusive, integer=integer)
    raise UsageError(f"{flag} must be {want}, got {value!r}{'; ' + hint if hint else ''}.")


def range_words(
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
) -> str:
    """:func:`check_range`'s bounds in words: ``an integer >= 1``, ``a number > 0 and <= 1``, ``a finite number``."""
    parts = []
    if low is not None:
        parts.append(f"{'>=' if low_inclusive else '>'} {low:g}")
    if high is not None:
        parts.append(f"{'<=' if high_inclusive else '<'} {high:g}")
    kind = "an integer" if integer else "a number"
    return f"{kind} {' and '.join(parts)}" if parts else f"a finite {'integer' if integer else 'number'}"
