"""The run directory's rules: a run there is never replaced, and ``--resume`` needs a checkpoint.

Decided for issue 12 ("nothing lost"):

* ``attnlab train`` into a directory that already holds a run (any of :data:`RUN_FILES`) refuses,
  with the exact command that continues that run (``--resume``) and one that starts a new run in
  a free directory next to it (``--out-dir NEW``). There is no flag to overwrite a run from the
  command line: delete the directory yourself if you mean to. A directory holding other files,
  or none, is used as it is.
* ``--resume`` where there is no checkpoint (a missing or misspelled directory, or a run stopped
  before its first checkpoint) refuses too, listing what is there, rather than starting afresh.
* Python callers that own a directory (``attnlab demo`` writing ``runs/demo`` each time) pass
  ``overwrite=True`` to :func:`attnlab.lab.train`, which deletes the run files listed here first.

Every suggested command is printed so that it runs as it is (paths shell-quoted).
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from ..runtime import UsageError
from .config import TrainConfig, command_flags, read_config_dict
from .train_state import CKPT_NAME, read_meta

__all__ = ["RUN_FILES", "check_out_dir", "clear_run", "free_sibling", "launcher", "listing", "train_command_line"]

RUN_FILES = ("config.json", "metrics.jsonl", CKPT_NAME, "summary.json", "curve.png", "model")


def launcher() -> str:
    """How this process was started, as the start of a command: ``attnlab`` or ``torchrun ... -m attnlab``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return "attnlab"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    nodes = f" --nnodes {world // local}" if world > local else ""
    return f"torchrun{nodes} --nproc_per_node {local} -m attnlab"


def train_command_line(cfg: TrainConfig, out_dir: Path, *, resume: bool = False, keep: bool = True) -> str:
    """``attnlab train`` with the flags that rebuild ``cfg`` (``keep=False``: none), in ``out_dir``."""
    flags = command_flags(cfg, TrainConfig(), skip=("out_dir", "resume")) if keep else []
    flags += ["--out-dir", shlex.quote(str(out_dir))] + (["--resume"] if resume else [])
    return " ".join([launcher(), "train", *flags])


def listing(directory: Path, limit: int = 8) -> str:
    """``"a.txt, b/, c.json"`` (directories marked with ``/``), at most ``limit`` names; ``"nothing"`` if empty."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir() if not p.name.startswith("."))
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def free_sibling(directory: Path) -> Path:
    """``runs/train-2`` (or -3, ...): the first name next to ``directory`` that does not exist yet."""
    n = 2
    while (candidate := directory.with_name(f"{directory.name}-{n}")).exists():
        n += 1
    return candidate


def run_files(directory: Path) -> list[str]:
    return [name for name in RUN_FILES if (directory / name).exists()]


def _describe(directory: Path) -> str:
    """``"config.json, metrics.jsonl, checkpoint.safetensors at step 120 of 400"``."""
    parts = []
    for name in run_files(directory):
        if (directory / name).is_dir():
            name += "/"
        elif name == CKPT_NAME:
            try:
                meta = read_meta(directory / CKPT_NAME)
                name += f" at step {meta['step']} of {meta['config']['steps']}"
            except (UsageError, KeyError, TypeError):
                name += " (unreadable)"
        parts.append(name)
    return ", ".join(parts)


def _saved_steps(directory: Path) -> object:
    try:
        return read_config_dict(directory / "config.json").get("steps")
    except UsageError:
        return None


def check_out_dir(cfg: TrainConfig, *, overwrite: bool = False) -> None:
    """Refuse, with runnable commands, a fresh run over an existing one and a ``--resume`` with nothing to resume."""
    out = Path(cfg.out_dir)
    if cfg.resume:
        if (out / CKPT_NAME).is_file():
            return
        if not out.exists():
            parent = out.parent if str(out.parent) else Path(".")
            resumable = (
                sorted(str(p) for p in parent.iterdir() if (p / CKPT_NAME).is_file())[:6] if parent.is_dir() else []
            )
            nearby = f" (runs that can be resumed next to it: {', '.join(resumable)})" if resumable else ""
            raise UsageError(
                f"--resume: --out-dir {str(out)!r} does not exist, so there is no run to resume{nearby}; check the "
                f"name, or start a new run there with `{train_command_line(cfg, out)}`."
            )
        fresh = free_sibling(out) if run_files(out) else out
        why = ": the run stopped before its first checkpoint" if run_files(out) else ""
        raise UsageError(
            f"--resume: --out-dir {str(out)!r} has no {CKPT_NAME} to resume from (it holds {listing(out)}{why}); "
            f"start the run afresh with `{train_command_line(cfg, fresh)}`."
        )
    present = run_files(out)
    if not present or overwrite:
        return
    resume = train_command_line(cfg, out, resume=True, keep=False)
    if _saved_steps(out) not in (None, cfg.steps):
        resume += f" --steps {cfg.steps}"
    raise UsageError(
        f"--out-dir {str(out)!r} already holds a run ({_describe(out)}), and attnlab never replaces a run; "
        f"continue it with `{resume}`, or start a new run with `{train_command_line(cfg, free_sibling(out))}`."
    )


def clear_run(directory: Path) -> None:
    """Delete the run files of :data:`RUN_FILES` in ``directory`` (and nothing else): ``overwrite=True``."""
    for name in RUN_FILES:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
