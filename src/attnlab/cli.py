"""The ``attnlab`` command line. Every subcommand's flags are derived from a typed function
or dataclass by tyro: no hand-copied flag lists, unknown flags rejected.

What reaches the user is one of: the command's own output; ``attnlab: error: <what>, <got>, <fix>``
with exit code 2 for a mistake in the input (:class:`attnlab.runtime.UsageError`, and the
``ValueError``/``TypeError`` of attnlab's argument checks); one line, ``attnlab: <command>
interrupted (...)``, naming any partial results kept, and exit code 130 (Ctrl-C) or 143 (SIGTERM)
for an interrupt. Output piped into ``head`` or ``less`` and cut short ends quietly (exit 141, as a
Unix tool killed by SIGPIPE). Never a traceback, unless ``ATTNLAB_DEBUG=1`` asks for it.
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
from .lab.stopping import TrainingInterrupted
from .models.generate_cli import generate_command
from .runtime import INTERRUPTS, Terminated, UsageError, interrupt_exit, kept
from .tools.demo import demo
from .tools.doctor import doctor
from .tools.inspect_cli import inspect_command
from .tools.trace import trace_command

LAB = ("train", "ablate-heads")  # they also take --config FILE as tyro defaults, and own their interrupts: lab/cli.py


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so that the interpreter's last flush is silent too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout closed or not a file: nothing is left to flush into
        pass


def _flushed() -> bool:
    """Flush stdout; False (and stdout silenced) when its pipe was closed: it breaks here, not at exit."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        return False
    except (OSError, ValueError):
        pass
    return True


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
    except INTERRUPTS as err:
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        if isinstance(err, TrainingInterrupted):  # a training run (the demo's) saved and says how to resume
            print(err.line, file=sys.stderr)
            return err.exit_code
        how, code = interrupt_exit(err)
        saved = kept(err)
        outcome = f"kept {saved}" if saved else "nothing more was written"
        print(f"attnlab: {command} interrupted ({how}) before it finished; {outcome}.", file=sys.stderr)
        return code
    except BrokenPipeError:  # `attnlab ... | head`: the reader has what it wanted
        _quiet_stdout()
        return 141
    except SystemExit:  # --help and tyro's own usage errors: their text may sit in a pipe's buffer still
        if not _flushed():
            return 141
        raise
    finally:
        if own_sigterm:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    if not _flushed():
        return 141
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
