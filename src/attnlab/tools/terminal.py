"""What ``attnlab generate`` reads and prints: chat turns from stdin, the stdout it streams to, and text that
is not UTF-8, named by its bytes and their place.

Turns are read as bytes and decoded here, so that a line that is not text is named with its number;
:class:`Stdout` tracks the line left open and the tokens printed, so that an interrupt can end the
line and say what was kept.
"""

from __future__ import annotations

import os
import select
import stat
from typing import Any

from ..runtime import UsageError
from ..runtime.text import bytes_named, check_text, not_text

__all__ = ["EXAMPLE_TURNS", "Stdout", "Turns", "check_text", "isatty", "ready"]

EXAMPLE_TURNS = "printf 'What is the capital of France?\\nAnd of Italy?\\n'"  # a conversation piped in, for messages


def _tokens(n: int) -> str:
    return f"{n} token{'s' if n != 1 else ''}"


def _new(n: int) -> str:
    return "no new tokens" if n == 0 else f"{n} new token{'s' if n != 1 else ''}"


# -- stdin, for --chat without --prompt ----------------------------------------------------------------------------


def isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):  # no such method, or closed
        return False


def ready(stream: Any) -> bool:
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


class Turns:
    """The user turns of ``--chat`` without ``--prompt``: one per line of stdin, until an empty line or its end.

    Lines are read as bytes and decoded here, strictly, so that a line that is not text is named
    with its number and the byte: a text stream fails on the whole block it decodes (with no line
    number), or passes lone surrogates on to the tokenizer.
    """

    def __init__(self, stdin: Any, command: str) -> None:
        self._stdin = stdin
        self._command = command  # `attnlab generate --model M`, for the messages
        self._encoding = (getattr(stdin, "encoding", None) or "utf-8").upper()
        self.interactive = isatty(stdin)  # a person typing: a "> " prompt, and a turn that does not fit is skipped
        self.number = 0  # lines read
        self._ended = False  # the last read found the end of input
        self._ahead: list[str | None] = []

    @classmethod
    def from_stdin(cls, stdin: Any, command: str) -> Turns:
        """The turns on ``stdin`` (``command``: the ``attnlab generate --model M`` the messages suggest); a
        :class:`UsageError` now, before the model loads, when stdin is closed, or
        when it can tell without waiting that there is no turn to answer."""
        turns = cls(stdin, command)
        if stdin is None:  # started with stdin closed (`0<&-`)
            raise turns.missing("is closed")
        if not turns.interactive and ready(stdin):  # its first line is there, or its end: look now
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

    def next(self, out: Stdout) -> str | None:
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
            bad = bytes_named(e.object[e.start : e.end])
            raise not_text(where, bad, f"byte {e.start} of the block read", "", self._encoding) from None
        except (OSError, ValueError) as e:  # closed, or not readable at all
            raise self.missing(f"cannot be read ({e})") from None
        self._ended = not raw
        if isinstance(raw, bytes):
            try:
                line = raw.decode(self._encoding)
            except UnicodeDecodeError as e:
                before = raw[: e.start].decode(self._encoding, errors="replace")
                raise not_text(
                    where, bytes_named(raw[e.start : e.end]), f"byte {e.start}", before, self._encoding
                ) from None
        else:
            line = raw
            check_text(line, where)
        line = line.rstrip("\r\n")
        return line if line.strip() else None


# -- stdout --------------------------------------------------------------------------------------------------------


class Stdout:
    """Everything ``attnlab generate`` prints on stdout goes through here, so that an interrupt can end
    the line left open and name what was kept."""

    def __init__(self) -> None:
        self.line_open = False  # the last text printed did not end its line
        self.prompt = False  # the prompt was printed: a continuation, not a chat
        self.answers = 0  # --chat answers printed whole
        self.tokens = 0  # new tokens of the text now streaming, printed
        self.held = 0  # new tokens after those, half a character, not printed
        self.streams: list[Any] = []  # generate_cli.StreamRate of each stream printed, for callers that report them

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
