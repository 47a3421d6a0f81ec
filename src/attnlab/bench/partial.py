"""What an interrupted benchmark keeps: the lengths it finished, written as JSON and Markdown marked partial.

The timing loops run inside :func:`carried_by_interrupts`, which hands the result so far up with the
interrupt; the command then writes it with :func:`save_partial` and re-raises, and the CLI's one
line says where the partial files are. A row is only appended once every runner at its length
was timed, so a partial file never holds half a comparison.

Partial files are ``<stem>.partial.json`` and ``<stem>.partial.md``, beside (never over) the last
complete ``<stem>.json``: an interrupted rerun does not cost the earlier full result. A complete
run removes a stale partial pair (:func:`drop_partial`).

Python raises the interrupt only between bytecodes, and one torch call of a benchmark can run for
seconds (a 4096 x 4096 GEMM probe took 7 s on 2 busy cores; SIGTERM was measured answered after
17.5 s). :class:`PromptStop` makes the stop prompt all the same: a watchdog thread hears the signal
through :func:`signal.set_wakeup_fd` the moment it arrives (torch releases the GIL inside its
calls, so the thread runs), and when the main thread has not ended within half a second, it writes
the partial files itself, prints the same one line as ``attnlab.cli`` and ends the process (after
``cleanup``: the ``finally`` blocks it skips).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

from ..runtime import INTERRUPTS, Terminated, atomic_write_text, interrupt_exit, keep, kept

__all__ = ["PromptStop", "carried_by_interrupts", "drop_partial", "save_partial"]


def _carry(err: BaseException, result: Any) -> None:
    how, _ = interrupt_exit(err)
    done = len({row.T for row in result.rows})
    result.partial = f"interrupted ({how}) after {done} of {len(result.config['lengths'])} lengths"
    err.attnlab_result = result  # type: ignore[attr-defined]


@contextmanager
def carried_by_interrupts(result: Any) -> Iterator[None]:
    """Attach ``result`` (a dataclass with ``rows``, ``config`` and ``partial``) to an interrupt raised inside."""
    try:
        yield
    except INTERRUPTS as err:
        _carry(err, result)
        raise


def save_partial(err: BaseException, out: Path, stem: str, markdown: Callable[[Any], str]) -> BaseException:
    """Write ``<stem>.partial.json`` and ``.partial.md`` of the result ``err`` carries; returns ``err``
    with what was kept recorded (:func:`attnlab.runtime.keep`). Nothing is written when no length finished."""
    result = getattr(err, "attnlab_result", None)
    if result is None or not result.rows:
        return err
    paths = [out / f"{stem}.partial.json", out / f"{stem}.partial.md"]
    atomic_write_text(paths[0], json.dumps(asdict(result), indent=2) + "\n")
    try:  # the table of the lengths that finished; the JSON above already holds every figure
        atomic_write_text(paths[1], f"PARTIAL: {result.partial}\n\n{markdown(result)}\n")
    except Exception:  # a summary that needs the missing lengths: the JSON is kept regardless
        paths[1].unlink(missing_ok=True)
        paths = paths[:1]
    return keep(err, f"{result.partial}, marked partial, in {', '.join(str(p) for p in paths)}")


def drop_partial(out: Path, stem: str) -> None:
    """Remove the partial files of an earlier interrupted run, once a complete result is written."""
    for suffix in (".partial.json", ".partial.md"):
        (out / f"{stem}{suffix}").unlink(missing_ok=True)


class PromptStop:
    """Inside the block, a stop signal ends the process within a second, even in the middle of a long torch call.

    The usual path is untouched: the signal's handler raises in the main thread, the command keeps its
    partial files and ``attnlab.cli`` prints the line. Only when the main thread is still busy
    :data:`GRACE` seconds after the signal (inside one call), the watchdog does the same from its
    thread: the rows of ``result`` (set by the benchmark once it exists) into ``<stem>.partial.*``,
    the line, and ``os._exit`` with the signal's code. A no-op off the main thread.
    """

    GRACE = 0.5  # seconds the main thread has to stop on its own

    def __init__(
        self,
        command: str,
        out: Path,
        stem: str,
        markdown: Callable[[Any], str],
        *,
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        """``cleanup``: what the ``finally`` blocks around the block would undo, which ``os._exit`` skips (the
        folder's lock file)."""
        self.command, self.out, self.stem, self.markdown, self.cleanup = command, out, stem, markdown, cleanup
        self.result: Any = None  # the benchmark's result so far, once it exists
        self._done = threading.Event()
        self._acting = threading.Lock()  # held by whichever ends the block first: the main thread or the watchdog
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1

    def __enter__(self) -> PromptStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)
        try:
            self._previous_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main interpreter
            read.close()
            write.close()
            return self
        self._pair = (read, write)
        threading.Thread(target=self._watch, name="attnlab-prompt-stop", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        with self._acting:  # the watchdog, if already acting, ends the process while this waits
            self._done.set()
        if self._pair is not None:
            signal.set_wakeup_fd(self._previous_fd, warn_on_full_buffer=False)
            for sock in self._pair:
                sock.close()
            self._pair = None

    def _watch(self) -> None:
        pair = self._pair
        assert pair is not None
        while not self._done.is_set():
            try:
                ready, _, _ = select.select([pair[0]], [], [], 0.1)
                data = pair[0].recv(64) if ready else b""
            except (OSError, ValueError):  # closed by __exit__
                return
            stops = [n for n in data if n in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", -1))]
            if stops and not self._done.wait(self.GRACE):
                with self._acting:
                    if not self._done.is_set():  # the main thread did not get there first
                        self._end(stops[0])
                return

    def _end(self, signum: int) -> None:
        """Keep what the main thread measured, print the line ``attnlab.cli`` prints, and end the process."""
        err: BaseException = KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)
        how, code = interrupt_exit(err)
        try:
            if self.result is not None:
                _carry(err, self.result)
                save_partial(err, self.out, self.stem, self.markdown)
        except Exception:  # a full disk, say: the line still comes, saying nothing was kept
            pass
        saved = kept(err)
        outcome = f"kept {saved}" if saved else "nothing more was written"
        try:
            print(
                f"attnlab: {self.command} interrupted ({how}) before it finished; {outcome}.",
                file=sys.stderr,
                flush=True,
            )
        except (OSError, ValueError):
            pass
        if self.cleanup is not None:
            try:
                self.cleanup()
            except Exception:  # the process ends regardless; what is left is a stale file a later run takes over
                pass
        os._exit(code)
