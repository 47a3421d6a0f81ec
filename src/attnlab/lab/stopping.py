"""How a run stops early: on a stop signal (saved, resumable), a non-finite loss (refused), or a lost rank.

While training, every signal of :data:`attnlab.runtime.signals.STOP_SIGNALS` (SIGINT from Ctrl-C,
SIGTERM from a scheduler or ``kill``, SIGHUP from a closed terminal or a dropped ssh session,
SIGQUIT from Ctrl-\\, SIGUSR1/SIGUSR2 from Slurm's warning before its time limit, SIGXCPU from a CPU
limit, SIGPWR; that module's docstring says why each, and why the others are left alone) only sets
a flag. The loop reads it between steps: the step under way finishes, the checkpoint is written
atomically, and :class:`TrainingInterrupted` carries one line (the signal, the step, the checkpoint,
the command that resumes) up to the command line, which prints it and exits ``128 + signal`` (130
for SIGINT, 143 for SIGTERM, 129 for SIGHUP). The command line holds the flag from its first line
to its last, so a signal while flags are parsed, the model built, a checkpoint or ``model/`` written
or the curve drawn is obeyed at the next point where stopping loses nothing. Further signals while
stopping are ignored: stopping already under way, they would only lose the checkpoint (torchrun
passes a terminal's Ctrl-C on, so each rank gets two; SIGKILL still ends the process at once, and
the last periodic checkpoint then resumes it).

A SIGHUP also means the terminal is gone: writes to it fail (EIO), and a progress bar or the last
line would then end the run with an ``OSError`` before it saves. So when one arrives, a standard
stream that points at a hung-up terminal is pointed at ``/dev/null`` (:func:`detach_hung_up_terminal`);
a ``kill -HUP`` whose terminal is still there changes nothing.

Under torchrun a signal may reach one rank only (``kill`` of one process, a scheduler's notice on
one node). The flag travels in the all-reduce each step already does, one slot per rank
(:func:`signal_slots`), so every rank stops at the same step and knows which signal, sent to which
rank, stopped it (:func:`first_signal`): the line names it and every rank exits with its code.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

from ..runtime.signals import STOP_SIGNALS, detach_hung_up_terminal, exit_code, signal_name

__all__ = [
    "StopSignals",
    "TrainingInterrupted",
    "TrainingDiverged",
    "detach_hung_up_terminal",
    "exit_code",
    "first_signal",
    "signal_slots",
]

SIGNALS = STOP_SIGNALS


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by a stop signal after saving its checkpoint. A ``KeyboardInterrupt``, so code
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


def signal_slots(world: int, rank: int, signum: int) -> list[float]:
    """This rank's share of the per-rank signal slots: its signal number at its own index, zeros elsewhere.

    Summed over the ranks (the step's all-reduce), slot ``r`` holds rank ``r``'s signal: no rank's
    number is lost or mixed with another's, whatever signals arrived where.
    """
    slots = [0.0] * world
    slots[rank] = float(signum)
    return slots


def first_signal(slots: Sequence[float]) -> tuple[int, int]:
    """``(signum, rank)`` of the lowest rank that received a stop signal, from the summed slots; ``(0, -1)``: none."""
    for r, value in enumerate(slots):
        if value:
            return int(value), r
    return 0, -1


class StopSignals:
    """Context manager: while active, the stop signals set :attr:`signum` instead of ending the process.

    Only the main thread can install signal handlers; elsewhere (a notebook's worker thread, a
    test runner's thread) the manager is inert and signals behave as usual. Nested use is allowed:
    an inner ``with`` on an already active manager changes nothing.
    """

    def __init__(self) -> None:
        self.signum = 0  # 0: no stop asked for; else the first signal received (or agreed between ranks)
        self.rank = -1  # under torchrun: the rank that received it, once agreed (-1: this process, or none)
        self._previous: dict[int, Any] = {}
        self._depth = 0

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def name(self) -> str:
        return signal_name(self.signum) if self.signum else ""

    @property
    def sender(self) -> str:
        """``" by rank 1"`` when the agreed signal reached a rank other than 0 (the one that speaks); else ``""``."""
        return f" by rank {self.rank}" if self.rank > 0 else ""

    def agree(self, signum: int, rank: int) -> None:
        """Adopt the signal the ranks agreed on (:func:`first_signal`), which this rank may not have received,
        in place of its own: every rank then names the same signal and exits with the same code."""
        if signum:
            self.signum, self.rank = signum, rank

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == getattr(signal, "SIGHUP", None):
            detach_hung_up_terminal()
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
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            self._previous.clear()


def print_line(line: str) -> None:
    """Print ``line`` on stderr; a terminal or pipe that is gone (a hangup) loses the line, not the exit code."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
