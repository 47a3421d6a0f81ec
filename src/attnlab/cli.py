"""The ``attnlab`` command line. Every subcommand's flags are derived from a typed function
or dataclass by tyro: no hand-copied flag lists, unknown flags rejected.

What reaches the user is one of: the command's own output; ``attnlab: error: <what>, <got>, <fix>``
with exit code 2 for a mistake in the input (:class:`attnlab.runtime.UsageError`, and the
``ValueError``/``TypeError`` of attnlab's argument checks); one line, ``attnlab: <command>
interrupted (...)``, naming any partial results kept, and exit code 128 + the signal's number (130
Ctrl-C, 143 SIGTERM, 129 SIGHUP, ...) for an interrupt by any stop signal
(:data:`attnlab.runtime.signals.STOP_SIGNALS`, where each is argued); one line and exit 75 under
torchrun when another rank died or stopped answering (:mod:`attnlab.distributed.failures`). Output
piped into ``head`` or ``less`` and cut short ends quietly (exit 141, as a Unix tool killed by SIGPIPE).
Memory or disk space that runs out during the work (each command estimates both first and refuses,
with exit 2, what cannot fit) is one line with the size and the fix, and exit 1; so is a stdout that
cannot take the output (``> /dev/full``). A ``ValueError``/``TypeError`` is the user's mistake only when
an attnlab check raised it; from inside a library or an operation of ours it is our crash, said as ours
in one line (``attnlab: internal error: ...``), exit 3, as is any other unexpected exception. stdout
closed (``>&-``) or in an encoding that cannot show the output is made safe first, with one note
(:mod:`attnlab.runtime.streams`). Never a traceback, unless ``ATTNLAB_DEBUG=1`` asks for it.
"""

from __future__ import annotations

import linecache
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
from .distributed.failures import RankLost
from .lab.cli import ablate_command, lab_main, train_command
from .lab.stopping import TrainingInterrupted
from .lab.train import RunStopped
from .runtime import INTERRUPTS, Terminated, UsageError, disk_full_line, interrupt_exit, kept, out_of_memory_line
from .runtime.disk import is_disk_full
from .runtime.signals import STOP_SIGNALS, detach_hung_up_terminal
from .runtime.streams import prepare_streams, stdout_is_full, stdout_target
from .tools.demo import demo
from .tools.doctor import doctor
from .tools.generate_cli import generate_command
from .tools.inspect_cli import inspect_command
from .tools.trace import trace_command

LAB = ("train", "ablate-heads")  # they also take --config FILE as tyro defaults, and own their interrupts: lab/cli.py
# What to shrink when a command runs out of memory past its estimate (each estimates its work before it starts)
SHRINK = {
    "train": "--data.batch-size, sequence length or --model.embed-dim",
    "ablate-heads": "--train.data.batch-size or --train.model.embed-dim",
    "bench": "--tokens, --lengths or --embed-dim",
    "bench-decode": "--batch-sizes, --prompt-len or --max-new-tokens",
    "generate": "model (or --dtype gguf / bfloat16 weights) or --max-new-tokens",
    "inspect": "--max-tokens, --probe-batch or --probe-len",
}


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    if signum == getattr(signal, "SIGHUP", None):
        detach_hung_up_terminal()  # the terminal is gone: the last line must not fail on it
    raise Terminated(signum)


def _lost_rank(err: RankLost) -> None:
    """Another rank died or stopped answering: print the line (one rank does) and end the process now.

    Not a return: the process group holds a dead or frozen peer, and gloo's threads would abort the
    interpreter's shutdown ("terminate called without an active exception") or wait on the peer.
    """
    if err.announce:
        try:
            print(err.line, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(err.exit_code)


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null, so that the interpreter's last flush is silent too."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout closed or not a file: nothing is left to flush into
        pass


def _flushed() -> bool:
    """Flush stdout; False (and stdout silenced) when its pipe was closed: it breaks here, not at exit.

    A stdout that cannot take the output (a full disk) raises :class:`StdoutLost`: the output is lost, and
    that is said."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        return False
    except OSError as err:
        lost = StdoutLost(err)
        _quiet_stdout()
        raise lost from None
    except ValueError:  # closed by the command itself
        pass
    return True


class StdoutLost(OSError):
    """stdout refused the command's output (a full disk: ``> /dev/full``); ``str`` is the line to print."""

    def __init__(self, err: OSError) -> None:
        super().__init__(err.errno, err.strerror)
        self.target = stdout_target()  # before stdout is pointed at /dev/null

    def __str__(self) -> str:
        return (
            f"stdout ({self.target}) cannot take this command's output ({self.strerror}), so it was lost; "
            "send it to a file on a disk with room (`> out.txt`) and run the command again"
        )


def _stdout_failed(err: BaseException) -> bool:
    """``err`` came from stdout: a refused write that named no file, while stdout's disk is full."""
    return isinstance(err, OSError) and err.filename is None and is_disk_full(err) and stdout_is_full()


def _argument_check(err: BaseException) -> bool:
    """``err`` is attnlab's own check of an argument: raised by a ``raise`` statement in attnlab's code, not
    from inside a library or a failing operation of ours (those are our bugs, and said as such)."""
    tb = err.__traceback__
    if tb is None:
        return True  # raised, not propagated from a call: a check
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    package = os.path.dirname(os.path.abspath(__file__))
    if not os.path.abspath(code.co_filename).startswith(package + os.sep):
        return False
    return linecache.getline(code.co_filename, tb.tb_lineno).lstrip().startswith("raise ")


def _internal_error(err: BaseException) -> str:
    """The line for a crash of attnlab's own: what, where, and how to report it."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = ""
    if tb is not None:
        code = tb.tb_frame.f_code
        where = f" (in {code.co_name}, {os.path.basename(code.co_filename)}:{tb.tb_lineno})"
    text = str(err).strip().splitlines()
    what = f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__
    return (
        f"attnlab: internal error: {what}{where}; this is attnlab's bug, not a mistake in your input: rerun with "
        "ATTNLAB_DEBUG=1 for the traceback, and report it with the command."
    )


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
    prepare_streams()  # stdout closed or unable to encode the output: one note, never a traceback
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args and args[0] in commands else "attnlab"
    # train and ablate-heads finish their step and save on a stop signal themselves; the rest stop at once, in one
    # line (SIGINT is Python's KeyboardInterrupt already)
    own_sigterm = command not in LAB and threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS if sig != signal.SIGINT}
    if own_sigterm:
        for sig in previous:
            signal.signal(sig, _raise_terminated)
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
        if not isinstance(err, UsageError) and not _argument_check(err):  # ours, from inside: a bug
            print(_internal_error(err), file=sys.stderr)
            return 3
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
    except RankLost as err:  # under torchrun: another rank died or stopped answering
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        _lost_rank(err)
        raise  # not reached: _lost_rank ends the process
    except RunStopped as err:  # train's folder removed, or its stdout's reader gone: what was saved, and how to go on
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        if err.exit_code == 141:
            _quiet_stdout()
        print(err.line, file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # `attnlab ... | head`: the reader has what it wanted
        _quiet_stdout()
        return 141
    except (MemoryError, RuntimeError, OSError) as err:  # memory or disk space ran out all the same: one line, exit 1
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        if _stdout_failed(err):  # `> /dev/full`: the output is what was lost
            err = StdoutLost(err)  # type: ignore[arg-type]
            _quiet_stdout()
        line = (
            str(err)
            if isinstance(err, StdoutLost)
            else disk_full_line(err) or out_of_memory_line(err, command, SHRINK.get(command, "request"))
        )
        print(f"attnlab: error: {line}" if line is not None else _internal_error(err), file=sys.stderr)
        return 1 if line is not None else 3
    except SystemExit:  # --help and tyro's own usage errors: their text may sit in a pipe's buffer still
        if not _flushed():
            return 141
        raise
    except Exception as err:  # anything else is a bug of ours: one line saying so, not a traceback
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        print(_internal_error(err), file=sys.stderr)
        return 3
    finally:
        if own_sigterm:
            for sig, handler in previous.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    try:
        if not _flushed():
            return 141
    except StdoutLost as err:
        print(f"attnlab: error: {err}", file=sys.stderr)
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
