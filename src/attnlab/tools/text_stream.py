"""Token ids to text as they stream, never half a character.

For byte-level BPE (SmolLM2, GPT-2) and attnlab's byte tokenizer, each token's bytes go through an
incremental UTF-8 decoder (:class:`Utf8Text`), which holds back exactly the bytes of a character
not yet whole and turns bytes that can never be UTF-8 into U+FFFD at once. Other tokenizers
(:class:`Redecode`) decode the reply so far again at each step, and hold a trailing U+FFFD back
only while it may still become a character: a character lacks at most 3 bytes, and each token
adds at least one (:data:`MAX_PENDING`).
"""

from __future__ import annotations

import codecs
import functools
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ..runtime.text import bytes_named

__all__ = [
    "MAX_PENDING",
    "PerToken",
    "Redecode",
    "TextStream",
    "Utf8Text",
    "byte_alphabet",
    "byte_level_bytes",
    "can_complete",
    "hf_text",
]

MAX_PENDING = 3  # tokens a character can still be arriving over: UTF-8 is at most 4 bytes, a token adds at least 1


class TextStream(Protocol):
    """Streamed text: ``push`` a token, print what it returns; ``held`` tokens are half a character, not printed."""

    held: int

    def push(self, token: int) -> str: ...

    def held_what(self) -> str: ...


class Utf8Text:
    """The text of tokens whose bytes are known, as ``bytes.decode(errors="replace")`` of them all gives it.

    The incremental decoder returns every character as soon as it is whole and holds back exactly
    the bytes of one that is not; bytes that can never start a character are U+FFFD at once.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._sizes: deque[int] = deque(maxlen=MAX_PENDING)  # bytes of each of the last tokens that had any
        self.held = 0  # the last tokens, whose bytes the decoder holds

    def push(self, token: int) -> str:
        raw = self._bytes(token)
        if raw:
            self._sizes.append(len(raw))
        text = self._decoder.decode(raw)
        if not can_complete(self._decoder.getstate()[0]):  # CPython holds ED A0..BF (a surrogate) a byte too long
            text += self._decoder.decode(b"", final=True)  # U+FFFD for each, as decoding them all gives
        pending = len(self._decoder.getstate()[0])  # at most 3 bytes, from at most the last 3 tokens
        self.held = 0
        while pending > 0:
            pending -= self._sizes[-1 - self.held]
            self.held += 1
        return text

    def held_what(self) -> str:
        return bytes_named(self._decoder.getstate()[0])


def can_complete(pending: bytes) -> bool:
    """Whether ``pending``, the bytes an incremental UTF-8 decoder holds, can still become a character.

    One byte always can (the decoder turns a byte that cannot start one into U+FFFD at once); two
    or three can when the first continuation byte is in the lead byte's range, which completing
    them with the lowest continuation bytes (0x80) tests.
    """
    if len(pending) <= 1:
        return True
    length = 2 if pending[0] < 0xE0 else 3 if pending[0] < 0xF0 else 4
    try:
        (pending + b"\x80" * (length - len(pending))).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class Redecode:
    """The text of any tokenizer: the new tokens so far decoded again at each step, and what the text gained.

    A tokenizer that hides its bytes (SentencePiece's byte fallback, a decoder that cleans spaces)
    shows half a character as U+FFFD. A trailing U+FFFD is held back while it may still become a
    character, that is while it lies past the text's length of 3 tokens ago; one older than that
    is the model's own and is printed, so nothing is held back for ever.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._ends: deque[int] = deque([0], maxlen=MAX_PENDING + 1)  # text length 3 tokens ago .. now
        self._printed = 0  # characters of the text printed
        self.held = 0

    def push(self, token: int) -> str:
        self._ids.append(token)
        text = self._decode(self._ids)
        self._ends.append(len(text))
        whole = len(text.rstrip("\ufffd"))
        if whole < len(text):  # U+FFFD the text had 3 tokens ago is final: a character lacks at most 3 bytes
            whole = max(whole, min(len(text), self._ends[0]))
        piece = text[self._printed : whole]
        self._printed = max(self._printed, whole)
        self.held = sum(1 for end in list(self._ends)[1:] if end > whole)
        return piece

    def held_what(self) -> str:
        return "decoded as U+FFFD"


class PerToken:
    """One token is whole characters (attnlab's character tokenizer, token ids as numbers): nothing is held back."""

    held = 0

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode

    def push(self, token: int) -> str:
        return self._decode([token])

    def held_what(self) -> str:
        return ""


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves,
    the other 68 for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if chr(b) not in table)
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def byte_level_bytes(tok: Any) -> Callable[[int], bytes] | None:
    """The bytes of each token id of a byte-level BPE tokenizer, as its ``decode(skip_special_tokens=True)``
    reads them (special tokens: none); None when the tokenizer is not plain byte-level BPE."""
    try:
        from tokenizers import decoders
    except ImportError:
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    if getattr(tok, "clean_up_tokenization_spaces", False):  # decode edits the text after the bytes
        return None
    special = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    alphabet = byte_alphabet()

    @functools.cache
    def token_bytes(i: int) -> bytes:
        piece = None if i in special else backend.id_to_token(i)
        if piece is None:  # special, or an id the vocabulary lacks: decode leaves both out
            return b""
        try:
            return bytes(alphabet[c] for c in piece)
        except KeyError:  # not in the byte alphabet (an added token's own text): as is, as tokenizers decodes it
            return piece.encode("utf-8")

    return token_bytes


def hf_text(tok: Any) -> TextStream:
    token_bytes = byte_level_bytes(tok)
    if token_bytes is not None:
        return Utf8Text(token_bytes)
    return Redecode(lambda ids: tok.decode(ids, skip_special_tokens=True))
