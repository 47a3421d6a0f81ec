"""The ``attnlab`` console script: the stop signals handled from its first instant, then :func:`attnlab.cli.main`.

Importing attnlab takes seconds (torch, its compiler, the models); a Ctrl-C in them would end in a
``KeyboardInterrupt`` traceback from deep inside torch's import, and a SIGTERM or SIGHUP in a silent
kill. The signals are those of ``attnlab.runtime.signals.STOP_SIGNALS`` (where each is argued), named
here because importing that module is the import this one guards. ``python -m attnlab`` imports the
package before its ``__main__``: the package's ``__init__`` calls :func:`guard_start` first thing when
``sys.argv[0]`` is ``"-m"`` (what it is while ``-m`` imports the package), and ``__main__`` ends the guard.
This module lives outside the ``attnlab`` package, whose ``__init__`` is that import, so that its
handlers are in place before it starts. ``attnlab.cli.main`` installs its own once it runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["end_guard", "guard_start", "main", "running_module"]


STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGPWR")
    if hasattr(signal, name)
)


LOST_EXIT = 75  # attnlab.distributed.failures.LOST_EXIT: every rank's exit code when one is lost


def _sibling_ranks() -> set[int]:
    """The ranks of this torchrun job alive on this host: the processes of the same parent and rendezvous."""
    port, parent = os.environ.get("MASTER_PORT"), os.getppid()
    alive: set[int] = set()
    try:
        stats = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return alive
    for pid in stats:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"MASTER_PORT", b"").decode() == port and env.get(b"RANK", b"").isdigit():
            alive.add(int(env[b"RANK"]))
    return alive


def _lost_while_starting() -> str | None:
    """Under torchrun with every rank on this host: the line for a rank that died while the ranks started (the
    SIGTERM is torchrun's agent ending the others); "" on the ranks that stay silent; None if none died."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), int(os.environ.get("RANK", "0"))
    if world == "1" or os.environ.get("LOCAL_WORLD_SIZE") != world or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    alive = _sibling_ranks() | {rank}
    dead = [r for r in range(int(world)) if r not in alive]
    if not dead:
        return None
    if rank != min(alive):
        return ""  # the lowest surviving rank speaks, as after the group forms
    again = " ".join(["torchrun", "--nproc_per_node", world, "-m", "attnlab", *sys.argv[1:]])
    who = f"rank {dead[0]}" + (f" (also lost: {', '.join(map(str, dead[1:]))})" if dead[1:] else "")
    return (
        f"attnlab: {who} died while the ranks were starting, before the process group formed (kill -9, a crash or "
        f"the out-of-memory killer); so every rank stopped, before any work. Start it again with `{again}`"
    )


def _while_starting(signum: int, frame: FrameType | None) -> None:
    how = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    lost = _lost_while_starting() if signum == signal.SIGTERM else None
    try:
        if lost is None:
            sys.stderr.write(f"attnlab: interrupted ({how}) while starting, before any work; nothing was written.\n")
        elif lost:
            sys.stderr.write(lost + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # SIGHUP: the terminal may be gone
        pass
    # mid-import: nothing to clean up, and a half-imported torch has no business running atexit
    os._exit(LOST_EXIT if lost is not None else 128 + signum)


def guard_start() -> dict[int, object]:
    """Install the start-up handlers (main thread only); returns the handlers they replace, for :func:`end_guard`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _while_starting) for sig in STOP_SIGNALS}


def end_guard(usual: dict[int, object]) -> None:
    """Put back the handlers :func:`guard_start` replaced (those still its own: a later owner keeps its own)."""
    for sig, handler in usual.items():
        if signal.getsignal(sig) is _while_starting:
            signal.signal(sig, handler)  # type: ignore[arg-type]


def running_module() -> str | None:
    """The module ``python -m`` runs (``"attnlab"``, ``"attnlab.quant"``), or None for a script or ``-c``."""
    argv = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("-m"):
            return arg[2:] or (argv[i + 1] if i + 1 < len(argv) else None)
        if not arg.startswith("-") or arg == "-c":
            return None
    return None


def main() -> int:
    """Install the start-up handlers, import the CLI, restore the usual handlers, run it."""
    usual = guard_start()
    try:
        from attnlab.cli import main as cli_main
    finally:
        end_guard(usual)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
