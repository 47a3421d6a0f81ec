"""What an interrupted benchmark keeps: the lengths it finished, written as JSON and Markdown marked partial.

The timing loops run inside :func:`carried_by_interrupts`, which hands the result so far up with the
interrupt; the command then writes it with :func:`save_partial` and re-raises, and the CLI's one
line says where the partial files are. A row is only appended once every runner at its length
was timed, so a partial file never holds half a comparison.

Partial files are ``<stem>.partial.json`` and ``<stem>.partial.md``, beside (never over) the last
complete ``<stem>.json``: an interrupted rerun does not cost the earlier full result. A complete
run removes a stale partial pair (:func:`drop_partial`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..runtime import INTERRUPTS, atomic_write_text, interrupt_exit, keep

__all__ = ["carried_by_interrupts", "drop_partial", "save_partial"]


@contextmanager
def carried_by_interrupts(result: Any) -> Iterator[None]:
    """Attach ``result`` (a dataclass with ``rows``, ``config`` and ``partial``) to an interrupt raised inside."""
    try:
        yield
    except INTERRUPTS as err:
        how, _ = interrupt_exit(err)
        done = len({row.T for row in result.rows})
        result.partial = f"interrupted ({how}) after {done} of {len(result.config['lengths'])} lengths"
        err.attnlab_result = result  # type: ignore[union-attr]
        raise


def save_partial(err: BaseException, out: Path, stem: str, markdown: Callable[[Any], str]) -> BaseException:
    """Write ``<stem>.partial.json`` and ``.partial.md`` of the result ``err`` carries; returns ``err``
    with what was kept recorded (:func:`attnlab.runtime.keep`). Nothing is written when no length finished."""
    result = getattr(err, "attnlab_result", None)
    if result is None or not result.rows:
        return err
    paths = [out / f"{stem}.partial.json", out / f"{stem}.partial.md"]
    atomic_write_text(paths[0], json.dumps(asdict(result), indent=2) + "\n")
    try:  # the table of the lengths that finished; the JSON above already holds every figure
        atomic_write_text(paths[1], f"PARTIAL: {result.partial}\n\n{markdown(result)}\n")
    except Exception:  # a summary that needs the missing lengths: the JSON is kept regardless
        paths[1].unlink(missing_ok=True)
        paths = paths[:1]
    return keep(err, f"{result.partial}, marked partial, in {', '.join(str(p) for p in paths)}")


def drop_partial(out: Path, stem: str) -> None:
    """Remove the partial files of an earlier interrupted run, once a complete result is written."""
    for suffix in (".partial.json", ".partial.md"):
        (out / f"{stem}{suffix}").unlink(missing_ok=True)
