"""Tokenizers small enough to live in a checkpoint's ``config.json``.

* :class:`CharTokenizer`: one id per character of a fixed alphabet (nanoGPT's shakespeare_char).
* :class:`ByteTokenizer`: the 256 UTF-8 byte values, so that any text has ids; the fallback
  for a checkpoint saved without a tokenizer whose vocabulary has at least 256 entries.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CharTokenizer", "ByteTokenizer", "Tokenizer", "tokenizer_from_json"]


class CharTokenizer:
    """Characters of ``chars`` get ids ``0 .. len(chars) - 1`` in order."""

    kind = "char"

    def __init__(self, chars: str) -> None:
        if not chars or len(set(chars)) != len(chars):
            raise ValueError(
                f"chars must be a non-empty string of distinct characters, got {len(chars)} chars with {len(chars) - len(set(chars))} repeats; use CharTokenizer.from_text(text)."
            )
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The alphabet of ``text``, sorted so that the ids do not depend on the order of the text."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self._ids.keys())
        if unknown:
            raise ValueError(
                f"text contains {len(unknown)} character(s) outside the tokenizer's alphabet, e.g. "
                f"{''.join(unknown[:10])!r}; remove them or build the tokenizer from text that has them."
            )
        return [self._ids[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "chars": self.chars}


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; decoding replaces a cut multi-byte character by U+FFFD."""

    kind = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind}


Tokenizer = CharTokenizer | ByteTokenizer


def tokenizer_from_json(data: dict[str, Any]) -> Tokenizer:
    """Inverse of ``tokenizer.to_json()``."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "char" and isinstance(data.get("chars"), str):
        return CharTokenizer(data["chars"])
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"tokenizer json must be {{'kind': 'char', 'chars': ...}} or {{'kind': 'byte'}}, got {data!r}.")
