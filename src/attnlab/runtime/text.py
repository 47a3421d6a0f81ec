"""Text that must be UTF-8 (prompts, texts to inspect, stdin lines), refused by its bytes and their place.

A byte the shell could not decode reaches ``sys.argv`` as a lone surrogate (``'\\udcff'`` for byte
0xff, Python's surrogateescape); tokenizers fail on it with their own ``TextEncodeInput`` error.
"""

from __future__ import annotations

from .errors import UsageError

__all__ = ["bytes_named", "check_text", "not_text"]


def bytes_named(raw: bytes) -> str:
    return ("byte " if len(raw) == 1 else "bytes ") + " ".join(f"0x{b:02x}" for b in raw)


def not_text(where: str, bad: str, place: str, before: str, encoding: str = "UTF-8") -> UsageError:
    """The error of text that is not ``encoding``: where, the offending bytes, their place and the fix."""
    after = f" (after {before[-12:]!r})" if before else ""
    return UsageError(
        f"{where} is not {encoding} text: {bad} at {place}{after}; pass it as {encoding} "
        f"(convert other text with iconv -f ITS-ENCODING -t {encoding})."
    )


def check_text(text: str, where: str) -> None:
    """A :class:`UsageError` unless ``text`` encodes to UTF-8, as every tokenizer needs.

    ``where`` names the text in the message (``"--prompt"``, ``"stdin line 3"``).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        chars = text[e.start : e.end]
        if all("\udc80" <= c <= "\udcff" for c in chars):  # escaped bytes: name them as the bytes they were
            bad = bytes_named(bytes(ord(c) - 0xDC00 for c in chars))
        else:
            bad = "unpaired surrogate " + " ".join(f"U+{ord(c):04X}" for c in chars)
        raise not_text(where, bad, f"character {e.start}", text[: e.start]) from None
