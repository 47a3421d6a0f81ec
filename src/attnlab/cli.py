"""The ``attnlab`` command line. Every subcommand's flags are derived from a typed function
or dataclass by tyro: no hand-copied flag lists, unknown flags rejected.

What reaches the user is one of: the command's own output; ``attnlab: error: <what>, <got>, <fix>``
with exit code 2 for a mistake in the input (:class:`attnlab.runtime.UsageError`, and the
``ValueError``/``TypeError`` of attnlab's argument checks); one line and exit code 130 (Ctrl-C) or 143
(SIGTERM) for an interrupt. Never a traceback, unless ``ATTNLAB_DEBUG=1`` asks for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType

import tyro

from .bench.attention import bench
from .bench.decode import bench_decode
from .check.cli import check
from .lab.cli import ablate_command, lab_main, train_command
from .models.generate_cli import generate_command
from .runtime import UsageError
from .tools.demo import demo
from .tools.doctor import doctor
from .tools.inspect_cli import inspect_command
from .tools.trace import trace_command

LAB = ("train", "ablate-heads")  # they also take --config FILE as tyro defaults, and own their interrupts: lab/cli.py


class _Terminated(Exception):
    """SIGTERM, raised in the main thread where Ctrl-C raises ``KeyboardInterrupt``."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``attnlab`` and ``python -m attnlab``; returns the exit code."""
    commands: dict[str, Callable[..., int]] = {
        "demo": demo,
        "check": check,
        "trace": trace_command,
        "inspect": inspect_command,
        "doctor": doctor,
        "bench": bench,
        "generate": generate_command,
        "bench-decode": bench_decode,
        "train": train_command,
        "ablate-heads": ablate_command,
    }
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args and args[0] in commands else "attnlab"
    # train and ablate-heads finish their step and save on SIGTERM themselves; the rest stop at once, in one line
    own_sigterm = command not in LAB and threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    if own_sigterm:
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        if command in LAB:
            return lab_main(args)
        result = tyro.extras.subcommand_cli_from_dict(
            commands,
            prog="attnlab",
            description="attnlab: multi-head attention, readable, verified, fast.",
            args=args,
        )
    except (UsageError, ValueError, TypeError) as err:  # a mistake in the input: one sentence, no traceback
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        print(f"attnlab: error: {err}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, _Terminated) as err:
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        how, code = ("Ctrl-C", 130) if isinstance(err, KeyboardInterrupt) else ("SIGTERM", 143)
        print(f"attnlab: {command} interrupted ({how}) before it finished; nothing more was written.", file=sys.stderr)
        return code
    finally:
        if own_sigterm:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
