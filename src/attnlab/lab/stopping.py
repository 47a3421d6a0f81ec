"""How a run stops early: on SIGINT/SIGTERM (saved, resumable) or on a non-finite loss (refused).

While training, SIGINT (Ctrl-C) and SIGTERM (a scheduler, ``kill``, ``torchrun`` passing a signal
on) only set a flag. The loop reads it between steps: the step under way finishes, the checkpoint
is written atomically, and :class:`TrainingInterrupted` carries one line (the step, the checkpoint,
the command that resumes) up to the command line, which prints it and exits ``128 + signal``
(130 for SIGINT, 143 for SIGTERM). Further signals while stopping are ignored: stopping already
under way, they would only lose the checkpoint (SIGKILL still ends the process at once; the last
periodic checkpoint then resumes it).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["StopSignals", "TrainingInterrupted", "TrainingDiverged", "exit_code"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM after saving its checkpoint. A ``KeyboardInterrupt``, so code
    that handles Ctrl-C handles it; ``str(err)`` is the one line to print. ``announce`` is False on
    ranks other than 0 under torchrun: one line per run, not one per process."""

    def __init__(self, line: str, *, signum: int, step: int, announce: bool = True) -> None:
        super().__init__(line)
        self.line, self.signum, self.step, self.announce = line, signum, step, announce

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class TrainingDiverged(RuntimeError):
    """The loss (or the gradient norm) became NaN or infinite; the weights were not updated with it."""

    def __init__(self, message: str, *, step: int, reason: str = "", announce: bool = True) -> None:
        super().__init__(message)
        self.step, self.reason, self.announce = step, reason, announce  # reason: "the loss is nan (...)"


class StopSignals:
    """Context manager: while active, SIGINT and SIGTERM set :attr:`signum` instead of raising.

    Only the main thread can install signal handlers; elsewhere (a notebook's worker thread, a
    test runner's thread) the manager is inert and signals behave as usual. Nested use is allowed:
    an inner ``with`` on an already active manager changes nothing.
    """

    def __init__(self) -> None:
        self.signum = 0  # 0: no stop asked for; else the first signal received
        self._previous: dict[int, Any] = {}
        self._depth = 0

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum:
            self.signum = signum

    def __enter__(self) -> StopSignals:
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._depth -= 1
        if self._depth == 0:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()
