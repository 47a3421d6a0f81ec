"""Interrupts (Ctrl-C, SIGTERM) as exceptions no ``except Exception`` can swallow.

``attnlab`` turns SIGTERM into :class:`Terminated` in the main thread, where Ctrl-C raises
``KeyboardInterrupt``. Both derive from ``BaseException`` only, so the broad ``except Exception``
of a check or benchmark loop (which reports the code under test failing) lets them through: an
interrupt is never a failure of what is being checked.

A command that keeps partial results says where with :func:`keep`, and the one line the CLI
prints names them: ``attnlab: check interrupted (SIGTERM); kept 3 of 32 rows, marked partial, in x.json``.
"""

from __future__ import annotations

__all__ = ["INTERRUPTS", "Terminated", "interrupt_exit", "keep", "kept"]


class Terminated(BaseException):
    """SIGTERM, raised in the main thread (``attnlab``'s handler) as Ctrl-C raises ``KeyboardInterrupt``."""


INTERRUPTS = (KeyboardInterrupt, Terminated)


def interrupt_exit(err: BaseException) -> tuple[str, int]:
    """``(what, exit code)`` of an interrupt: ``("Ctrl-C", 130)`` or ``("SIGTERM", 143)``, the shell's codes."""
    return ("SIGTERM", 143) if isinstance(err, Terminated) else ("Ctrl-C", 130)


def keep(err: BaseException, what: str) -> BaseException:
    """Record on the interrupt ``err`` what partial results were kept (``"3 of 32 rows, marked partial, in x.json"``)."""
    err.attnlab_kept = what  # type: ignore[attr-defined]
    return err


def kept(err: BaseException) -> str | None:
    """What :func:`keep` recorded on ``err``, or None: nothing was kept."""
    return getattr(err, "attnlab_kept", None)
