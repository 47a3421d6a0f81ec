"""The ``attnlab`` console script: Ctrl-C and SIGTERM handled from its first instant, then :func:`attnlab.cli.main`.

Importing attnlab takes seconds (torch, its compiler, the models); a Ctrl-C in them would end in a
``KeyboardInterrupt`` traceback from deep inside torch's import, and a SIGTERM in a silent kill.
This module lives outside the ``attnlab`` package, whose ``__init__`` is that import, so that its
handlers are in place before it starts. ``attnlab.cli.main`` installs its own once it runs.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

__all__ = ["main"]


def _while_starting(signum: int, frame: FrameType | None) -> None:
    how, code = ("Ctrl-C", 130) if signum == signal.SIGINT else ("SIGTERM", 143)
    sys.stderr.write(f"attnlab: interrupted ({how}) while starting, before any work; nothing was written.\n")
    sys.stderr.flush()
    os._exit(code)  # mid-import: nothing to clean up, and a half-imported torch has no business running atexit


def main() -> int:
    """Install the start-up handlers, import the CLI, restore the usual handlers, run it."""
    signals = (signal.SIGINT, signal.SIGTERM)
    usual = {sig: signal.signal(sig, _while_starting) for sig in signals}
    try:
        from attnlab.cli import main as cli_main
    finally:
        for sig, handler in usual.items():
            signal.signal(sig, handler)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
