"""The ``attnlab`` command line. Every subcommand's flags are derived from a typed function
or dataclass by tyro: no hand-copied flag lists, unknown flags rejected."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import tyro

from .bench.attention import bench
from .bench.decode import bench_decode
from .check.cli import check
from .lab.cli import ablate_command, lab_main, train_command
from .models.generate_cli import generate_command
from .tools.demo import demo
from .tools.doctor import doctor
from .tools.trace import trace_command


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``attnlab`` and ``python -m attnlab``; returns the exit code."""
    commands: dict[str, Callable[..., int]] = {
        "demo": demo,
        "check": check,
        "trace": trace_command,
        "doctor": doctor,
        "bench": bench,
        "generate": generate_command,
        "bench-decode": bench_decode,
        "train": train_command,
        "ablate-heads": ablate_command,
    }
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args and args[0] in (
            "train",
            "ablate-heads",
        ):  # they also take --config FILE as tyro defaults: see lab/cli.py
            return lab_main(args)
        result = tyro.extras.subcommand_cli_from_dict(
            commands,
            prog="attnlab",
            description="attnlab: multi-head attention, readable, verified, fast.",
            args=argv,
        )
    except (ValueError, TypeError) as err:  # attnlab's own input errors: one sentence, no traceback
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        print(f"attnlab: error: {err}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
