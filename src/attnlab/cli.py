"""The ``attnlab`` command line. Every subcommand's flags are derived from a typed function
or dataclass by tyro: no hand-copied flag lists, unknown flags rejected."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import tyro

from .demo import demo


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``attnlab`` and ``python -m attnlab``; returns the exit code."""
    commands = {
        "demo": demo,
    }
    result = tyro.extras.subcommand_cli_from_dict(
        commands, prog="attnlab", description="attnlab: multi-head attention, readable, verified, fast.",
        args=argv,
    )
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
