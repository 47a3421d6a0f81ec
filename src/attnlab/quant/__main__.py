"""``python -m attnlab.quant build``: compile the kernels now (set-up calls it), and say what this CPU runs."""

from __future__ import annotations

import sys

from .kernels import build_kernels


def main(argv: list[str]) -> int:
    if argv not in ([], ["build"], ["status"]):
        print("usage: python -m attnlab.quant [build|status]", file=sys.stderr)
        return 2
    status = build_kernels()
    print(status.describe())
    return 0 if status.available or argv == ["status"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
