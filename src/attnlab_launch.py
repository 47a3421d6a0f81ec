"""The ``attnlab`` console script: the stop signals handled from its first instant, then :func:`attnlab.cli.main`.

Importing attnlab takes seconds (torch, its compiler, the models); a Ctrl-C in them would end in a
``KeyboardInterrupt`` traceback from deep inside torch's import, and a SIGTERM or SIGHUP in a silent
kill. The signals are those of ``attnlab.runtime.signals.STOP_SIGNALS`` (where each is argued), named
here because importing that module is the import this one guards.
This module lives outside the ``attnlab`` package, whose ``__init__`` is that import, so that its
handlers are in place before it starts. ``attnlab.cli.main`` installs its own once it runs.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["main"]


STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGPWR")
    if hasattr(signal, name)
)


def _while_starting(signum: int, frame: FrameType | None) -> None:
    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    try:
        sys.stderr.write(f"attnlab: interrupted ({how}) while starting, before any work; nothing was written.\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # SIGHUP: the terminal may be gone
        pass
    os._exit(128 + signum)  # mid-import: nothing to clean up, and a half-imported torch has no business running atexit


def main() -> int:
    """Install the start-up handlers, import the CLI, restore the usual handlers, run it."""
    usual = {sig: signal.signal(sig, _while_starting) for sig in STOP_SIGNALS}
    try:
        from attnlab.cli import main as cli_main
    finally:
        for sig, handler in usual.items():
            signal.signal(sig, handler)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
