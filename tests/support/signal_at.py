"""Run ``attnlab`` with a signal sent to itself from inside one phase: ``signal_at.py PHASE SIGNAL CALL -- ARGS``.

The function that does the phase is wrapped (the rest of the program is untouched): on its ``CALL``-th
call the wrapper sends ``SIGNAL`` to this process, then lets the function run. A Python handler runs at
the next bytecode of the main thread, so the signal lands inside the phase, every time, with no sleep
and no race, and no test-only code in ``attnlab``. ``step`` counts the step about to run (``lr_at``'s
argument) instead of calls. The phases of ``attnlab train``:

* ``parse``: the flags are parsed (nothing written yet)
* ``build``: the model is built, before step 1
* ``step``: step ``CALL + 1`` is under way
* ``eval``: the ``CALL``-th held-out evaluation (the first is step 0's)
* ``head-scores``: the ``CALL``-th head-score probe (each evaluation's)
* ``checkpoint``: the ``CALL``-th checkpoint write
* ``model``: the final ``model/`` write
* ``plots``: the curve's drawing, at the end
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Any


def _on_call(owner: Any, name: str, signum: int, at: int, *, step: bool = False) -> None:
    """Wrap ``owner.name``: the signal goes out on call ``at`` (or, with ``step``, when its first argument is ``at``)."""
    real: Callable[..., Any] = getattr(owner, name)
    calls = [0]

    @functools.wraps(real)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        hit = (args[0] == at) if step else calls[0] == at
        if hit:
            print(f"signal_at: sending {signal.Signals(signum).name} in {name}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    setattr(owner, name, wrapped)


def main() -> int:
    phase, signame, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    args = sys.argv[sys.argv.index("--") + 1 :]
    signum = int(getattr(signal, signame))

    from attnlab.cli import main as attnlab_main

    # the modules themselves: ``attnlab.lab.train`` as an attribute is the function the package exports
    lab_cli, head_scores, plots, train, saved_model = (
        importlib.import_module(f"attnlab.{name}")
        for name in ("lab.cli", "lab.head_scores", "lab.plots", "lab.train", "weight_files.saved_model")
    )

    if phase == "parse":
        parse, run = lab_cli.LAB_COMMANDS["train"]
        holder = type("Holder", (), {"parse": staticmethod(parse)})
        _on_call(holder, "parse", signum, at)
        lab_cli.LAB_COMMANDS["train"] = (holder.parse, run)
    else:
        owner, name, step = {
            "build": (train, "build_model", False),
            "step": (train, "lr_at", True),
            "eval": (train, "evaluate", False),
            "head-scores": (head_scores.HeadScorer, "__call__", False),
            "checkpoint": (train, "save_train_state", False),
            "model": (saved_model, "save_checkpoint", False),
            "plots": (plots, "plot_run", False),
        }[phase]
        _on_call(owner, name, signum, at, step=step)
    return attnlab_main(args)


if __name__ == "__main__":
    sys.exit(main())
