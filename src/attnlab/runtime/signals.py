"""Interrupts (Ctrl-C, SIGTERM, SIGHUP, ...) as exceptions no ``except Exception`` can swallow.

``attnlab`` turns every signal of :data:`STOP_SIGNALS` but SIGINT into :class:`Terminated` in the
main thread, where Ctrl-C raises ``KeyboardInterrupt``. Both derive from ``BaseException`` only, so
the broad ``except Exception`` of a check or benchmark loop (which reports the code under test
failing) lets them through: an interrupt is never a failure of what is being checked.

Which signals stop a command, and why (the same set for every command; train and ablate-heads save a
checkpoint on each, :mod:`attnlab.lab.stopping`):

* SIGINT (Ctrl-C), SIGTERM (``kill``, a scheduler, torchrun passing a signal on): asked to stop.
* SIGHUP: the terminal closed or the ssh session dropped. Its default action kills the process
  without a word; a run started without ``nohup`` would lose every step since its last checkpoint.
* SIGQUIT (Ctrl-\\): its default is to end with a core dump, which is of no use for a Python
  process (``faulthandler`` is the tool for stacks). A user who presses it wants the process gone,
  and losing the run's steps is the worse outcome; SIGKILL remains the way to end at once.
* SIGUSR1, SIGUSR2: Slurm's ``--signal=USR1@60`` warning before the time limit, and other
  schedulers' pre-emption notices. Their default action ends the process, so a user sending one by
  hand also expects it to end; it ends after saving, in time for the SIGKILL that follows.
* SIGXCPU: the soft CPU-time limit (``ulimit -t``, a scheduler's CPU limit) is reached; SIGKILL
  follows at the hard limit, so this is the moment to save.
* SIGPWR (Linux): a UPS daemon announcing a power failure; the same reasoning.

Left alone: SIGKILL and SIGSTOP (cannot be caught); SIGALRM, SIGVTALRM and SIGPROF (timers the
process or a library in it arms for itself, such as pytest-timeout: taking them over would break
those users); SIGPIPE (Python ignores it, a closed pipe is ``BrokenPipeError``, handled by the CLI);
SIGXFSZ (a file-size limit: the write that crossed it fails, and saving would cross it again);
SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGTRAP, SIGSYS (the process itself is broken, and no
state of it can be trusted to save); SIGIO, SIGURG, SIGWINCH, SIGCHLD, SIGCONT, SIGTSTP, SIGTTIN,
SIGTTOU and the real-time signals (a program's own notices, which do not ask it to end).

A command that keeps partial results says where with :func:`keep`, and the one line the CLI
prints names them: ``attnlab: check interrupted (SIGTERM); kept 3 of 32 rows, marked partial, in x.json``.
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = [
    "INTERRUPTS",
    "STOP_SIGNALS",
    "Terminated",
    "detach_hung_up_terminal",
    "exit_code",
    "interrupt_exit",
    "keep",
    "kept",
    "signal_name",
]

# The signals that stop a command (see the module docstring for each, and for those left out).
STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGPWR")
    if hasattr(signal, name)  # SIGPWR is Linux's; Windows has SIGINT and SIGTERM only
)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 SIGINT, 143 SIGTERM, ...)."""
    return 128 + signum


def signal_name(signum: int) -> str:
    """``"SIGHUP"`` for 1; ``"signal 99"`` for a number this platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Terminated(BaseException):
    """A stop signal other than SIGINT (SIGTERM by default), raised in the main thread by ``attnlab``'s handler
    as Ctrl-C raises ``KeyboardInterrupt``; ``signum`` says which."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal_name(signum))
        self.signum = int(signum)


INTERRUPTS = (KeyboardInterrupt, Terminated)


def interrupt_exit(err: BaseException) -> tuple[str, int]:
    """``(what, exit code)`` of an interrupt: ``("Ctrl-C", 130)``, ``("SIGTERM", 143)``, ``("SIGHUP", 129)``, ..."""
    if isinstance(err, Terminated):
        return signal_name(err.signum), exit_code(err.signum)
    return "Ctrl-C", exit_code(signal.SIGINT)


def detach_hung_up_terminal() -> None:
    """Point stdout/stderr at ``/dev/null`` where they are a terminal that has hung up (writes fail with EIO).

    A zero-byte write is the test: it fails with EIO on a hung-up terminal and does nothing on a live
    terminal, a pipe or a file. Called from a signal handler, so it only makes system calls.
    """
    for fd in (1, 2):
        try:
            os.write(fd, b"")
        except OSError as e:
            if e.errno != errno.EIO:
                continue
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, fd)
                os.close(devnull)
            except OSError:
                pass


def keep(err: BaseException, what: str) -> BaseException:
    """Record on the interrupt ``err`` what partial results were kept (``"3 of 32 rows, marked partial, in x.json"``)."""
    err.attnlab_kept = what  # type: ignore[attr-defined]
    return err


def kept(err: BaseException) -> str | None:
    """What :func:`keep` recorded on ``err``, or None: nothing was kept."""
    return getattr(err, "attnlab_kept", None)
