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

Decided for issue 39 ("nothing lost when the machine misbehaves"):

* A run folder belongs to one process (:func:`claim_out_dir`): the run takes the folder's lock
  (:class:`attnlab.runtime.RunLock`) *before* looking at what it holds, so two runs started at the
  same instant cannot both find it free; the second is refused at once, naming the first's PID and
  command. The lock file (``.attnlab.lock``) is no run file: it is never listed, and never blocks
  ``--resume``.
* Before writing, every run file the run will replace is proven writable (an immutable
  ``checkpoint.safetensors`` used to fail at the first save, after the training it was to keep).
* A run that fails before its first step removes what it wrote (:meth:`RunClaim.__exit__`), so the
  same command runs again as it is.
* Everything read back on ``--resume`` is read as a file attnlab wrote (:func:`read_run_config`,
  :func:`read_metrics`, :func:`attnlab.lab.train_state.read_meta`): damage is one error naming the
  file, the field or line, what it holds and what it should, and a fix that never changes the run.
  One repair is silent, as it always was: a last ``metrics.jsonl`` line torn by a kill mid-write
  (no newline at its end) is dropped. Lines lost otherwise (a power cut after the checkpoint was
  synced) are said in one note, and the resumed run goes on.

Every suggested command is printed so that it runs as it is (paths shell-quoted).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shlex
import shutil
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from ..runtime import RunLock, UsageError, check_writable_dir, missing_dirs, remove_if_empty
from .config import (
    RENAMED_KEYS,
    FieldError,
    TrainConfig,
    command_flags,
    config_from_dict,
    dataclass_from_dict,
    read_config_dict,
    read_json_file,
    shown,
)
from .stopping import TrainingInterrupted
from .train_state import CKPT_NAME, read_meta
from .validation import checking_file, validate_fields

__all__ = [
    "RUN_FILES",
    "RunClaim",
    "check_out_dir",
    "check_run_files_writable",
    "claim_out_dir",
    "clear_run",
    "free_sibling",
    "launcher",
    "listing",
    "missing_dirs",
    "read_metrics",
    "read_resumed_config",
    "read_run_config",
    "remove_if_empty",
    "resume_metrics",
    "train_command_line",
]

RUN_FILES = ("config.json", "metrics.jsonl", CKPT_NAME, "summary.json", "curve.png", "model")
# the numbers a metrics.jsonl record may hold, which resume, the summary and the plots read as numbers
METRIC_NUMBERS = ("loss", "acc", "lr", "grad_norm", "tokens_per_s", "eval_loss", "eval_acc", "wall_s")


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
        steps = read_config_dict(directory / "config.json").get("steps")
    except UsageError:
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None  # damage: --resume says so


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
        if (out / CKPT_NAME).is_dir():
            raise UsageError(
                f"--resume: {str(out / CKPT_NAME)!r} is a directory, expected the run's checkpoint file, so there is "
                f"nothing to resume from; start the run afresh with `{train_command_line(cfg, free_sibling(out))}`."
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
    elsewhere = train_command_line(cfg, free_sibling(out))
    if not (out / CKPT_NAME).is_file():  # nothing to resume: --resume would refuse too
        raise UsageError(
            f"--out-dir {str(out)!r} already holds a run that stopped before its first checkpoint ({_describe(out)}), "
            f"and attnlab never replaces a run; start a new run with `{elsewhere}`, or delete those files to run "
            f"in this folder again."
        )
    resume = train_command_line(cfg, out, resume=True, keep=False)
    if _saved_steps(out) not in (None, cfg.steps):
        resume += f" --steps {cfg.steps}"
    raise UsageError(
        f"--out-dir {str(out)!r} already holds a run ({_describe(out)}), and attnlab never replaces a run; "
        f"continue it with `{resume}`, or start a new run with `{elsewhere}`."
    )


def clear_run(directory: Path) -> None:
    """Delete the run files of :data:`RUN_FILES` in ``directory`` (and nothing else): ``overwrite=True``."""
    for name in RUN_FILES:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


# --- one process per run folder ---------------------------------------------------------------------------------


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _quiet(line: str) -> None:
    pass


def check_run_files_writable(directory: Path) -> None:
    """Every run file a run will replace or delete can be, before any work (issue 39: an immutable checkpoint
    failed at the first save, after the steps it was to keep). A file that cannot be opened for writing is
    refused; ``model/`` and its files too."""
    paths = [directory / name for name in RUN_FILES]
    paths += [p for p in (directory / "model").iterdir()] if (directory / "model").is_dir() else []
    for path in paths:
        if not path.exists() or path.is_symlink():
            continue
        try:
            if path.is_dir():
                if not os.access(path, os.W_OK | os.X_OK):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
                continue
            os.close(os.open(path, os.O_WRONLY | os.O_CLOEXEC))  # no O_TRUNC, no O_CREAT: nothing changes
        except OSError as err:
            q = shlex.quote(str(path))
            if err.errno == errno.EPERM:  # chattr +i (immutable) or +a (append-only): even root cannot replace it
                fix = f"clear it with `chattr -i -a {q}` (as root)"
                why = "it is immutable or append-only"
            else:
                fix = f"make it writable with `chmod u+w {q}`"
                why = "it is read-only"
            raise UsageError(
                f"{str(path)!r} cannot be replaced ({why}: {err.strerror or err}), so this run could not save into "
                f"{str(directory)!r}; {fix}, then run the command again."
            ) from None


class RunClaim:
    """``cfg.out_dir`` held by this process for one run (:func:`claim_out_dir`); a context manager.

    ``refusal``: under torchrun, rank 0's refusal, kept for the other ranks to hear (``train`` shares it
    after the process group forms) instead of raised before they could. On exit with an error (not an
    interrupt, which saves a resumable checkpoint) before the run's first step, the run files it wrote and
    the folders it made are removed: the same command then runs again as it is.
    """

    def __init__(
        self,
        out: Path | None = None,
        lock: RunLock | None = None,
        *,
        fresh: bool = False,
        created: list[Path] | None = None,
        refusal: UsageError | None = None,
    ) -> None:
        self.out, self.lock, self.fresh = out, lock, fresh
        self.created = created or []
        self.refusal = refusal

    def __enter__(self) -> RunClaim:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc is not None and not isinstance(exc, TrainingInterrupted):
                self._abandon()
        finally:
            if self.lock is not None:
                self.lock.release()
            if exc is not None and not isinstance(exc, TrainingInterrupted):
                remove_if_empty(self.created)

    def _abandon(self) -> None:
        """A fresh run that failed before its first step: remove the run files (all this process's own)."""
        out = self.out
        if out is None or not self.fresh or (out / CKPT_NAME).exists():
            return
        try:
            if any(r["step"] >= 1 for r in read_metrics(out / "metrics.jsonl")):
                return  # it trained: the lines are the record of what happened
        except UsageError:
            return
        clear_run(out)


def claim_out_dir(cfg: TrainConfig, *, overwrite: bool = False, quiet: bool = False, defer: bool = False) -> RunClaim:
    """Lock ``cfg.out_dir`` for this run, then check it (:func:`check_out_dir`) and its files; returns the claim.

    The lock comes first: two runs started together are then decided by the kernel, not by which of them
    looked first. ``defer`` (rank 0 under torchrun): a refusal is returned in the claim, not raised, so that
    the other ranks hear it too. Notes (a stale lock taken over, temp files removed) go to stderr unless
    ``quiet``.
    """
    out = Path(cfg.out_dir)
    try:
        if cfg.resume and not out.exists():
            check_out_dir(cfg)  # refuses: nothing to resume, and nothing to create
        created = missing_dirs(out)
        check_writable_dir(out, "--out-dir")
        if cfg.resume:
            fix = "wait for it to finish: --resume continues a run that has stopped, and this one is still running"
        else:
            fix = f"wait for it to finish, or start this run in another folder with `{train_command_line(cfg, free_sibling(out))}`"
        lock = RunLock(out, fix=fix, note=_quiet if quiet else _stderr)
        try:
            lock.acquire()
        except BaseException:
            remove_if_empty(created)
            raise
        try:
            check_out_dir(cfg, overwrite=overwrite)
            check_run_files_writable(out)
            if overwrite and not cfg.resume:
                clear_run(out)
        except BaseException:
            lock.release()
            remove_if_empty(created)
            raise
    except UsageError as err:
        if not defer:
            raise
        return RunClaim(refusal=err)
    return RunClaim(out, lock, fresh=not cfg.resume, created=created)


# --- what --resume reads back ------------------------------------------------------------------------------------


def _config_fix(path: Path) -> str:
    """What to do with a damaged ``config.json``: the checkpoint's copy of the config, when it has a good one."""
    ckpt = path.parent / CKPT_NAME
    try:
        read_meta(ckpt)
    except UsageError:
        return f"restore it from a copy, or start a new run in another --out-dir (its {CKPT_NAME} cannot stand in)"
    rm = "rm -r" if path.is_dir() else "rm"
    resume = f"attnlab train --out-dir {shlex.quote(str(path.parent))} --resume"
    return (
        f"the run's {CKPT_NAME} holds its config too: remove the file (`{rm} {shlex.quote(str(path))}`) and run "
        f"`{resume}` again, which then reads it from there"
    )


_ABSENT = object()


def _missing_fields(saved: dict[str, Any], data: dict[str, Any], cls: type, where: str = "") -> list[str]:
    """Fields of ``cls`` (dotted) that ``saved`` (the checkpoint's config) has and ``data`` (config.json) lacks."""
    hints = typing.get_type_hints(cls)
    old = {new: name for name, new in RENAMED_KEYS.get(cls.__name__, {}).items()}
    out: list[str] = []
    for f in dataclasses.fields(cls):
        names = (f.name, old.get(f.name, f.name))
        a = next((saved[n] for n in names if n in saved), _ABSENT)
        b = next((data[n] for n in names if n in data), _ABSENT)
        if a is _ABSENT:
            continue
        if b is _ABSENT:
            out.append(where + f.name)
        elif dataclasses.is_dataclass(hints[f.name]) and isinstance(a, dict) and isinstance(b, dict):
            out += _missing_fields(a, b, hints[f.name], f"{where}{f.name}.")
    return out


def _first_difference(a: Any, b: Any, where: str) -> tuple[str, Any, Any] | None:
    """The first field (dotted) where dataclasses ``a`` and ``b`` differ, with both values; None if equal."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            found = _first_difference(getattr(a, f.name), getattr(b, f.name), f"{where}{f.name}.")
            if found:
                return found
        return None
    return None if a == b else (where.rstrip("."), a, b)


C = TypeVar("C")


def read_resumed_config(
    cls: type[C], path: Path, fix: str, validate: Callable[[C], None], check_data: Callable[[Any], None] | None = None
) -> tuple[C, Any]:
    """A ``config.json`` attnlab wrote, read back by ``--resume`` as ``cls`` and checked field by field
    (``validate``; ``check_data`` first sees the JSON and may raise :class:`FieldError`): absent or damaged, one
    :class:`UsageError` naming the file and the field, and ``fix``. Returns the config and the JSON it came from."""
    where = f"--resume: {str(path)!r}"
    try:
        data = read_json_file(path)
        if check_data is not None:
            check_data(data)
        cfg = dataclass_from_dict(cls, data, strict=True)
    except FileNotFoundError:
        raise UsageError(f"{where} does not exist; {fix}.") from None
    except FieldError as e:
        raise UsageError(f"{where} is damaged: {e}; {fix}.") from None
    with checking_file(where, fix):
        validate(cfg)
    return cfg, data


def read_run_config(path: Path) -> TrainConfig:
    """A run's own ``config.json`` read back by ``--resume``: as a file attnlab wrote, checked against the
    config its checkpoint carries. Every damage is one :class:`UsageError` naming the file and the field."""
    where = f"--resume: {str(path)!r}"
    fix = _config_fix(path)
    cfg, data = read_resumed_config(TrainConfig, path, fix, validate_fields)
    ckpt = path.parent / CKPT_NAME
    try:
        meta = read_meta(ckpt)
    except UsageError:
        return cfg  # no checkpoint to check against (check_out_dir and train say what that means)
    missing = _missing_fields(meta["config"], data, TrainConfig)
    if missing:
        raise UsageError(f"{where} is damaged: field {missing[0]} is missing (its {CKPT_NAME} has it); {fix}.")
    saved = config_from_dict(meta["config"])
    for name in ("data", "model", "optim", "seed"):  # what makes a run this run; the rest may change on resume
        found = _first_difference(getattr(cfg, name), getattr(saved, name), f"{name}.")
        if found:
            field, mine, theirs = found
            raise UsageError(
                f"{where} is damaged: field {field} holds {shown(_jsonable(mine))}, but the run's {CKPT_NAME} was "
                f"saved with {shown(_jsonable(theirs))}; {fix}."
            )
    return cfg


def _jsonable(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _metrics_damaged(path: Path, line: int, what: str) -> UsageError:
    q = shlex.quote(str(path))
    return UsageError(
        f"{str(path)!r} line {line} is damaged: {what}; attnlab writes one JSON object per step there, so the file "
        f"was changed since: delete that line (`sed -i '{line}d' {q}`) or restore the file, then run the command again."
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl``, each checked (an object, an integer ``step`` above the line
    before's, numbers where :data:`METRIC_NUMBERS` are); ``[]`` if there is no file.

    A last line torn by a kill mid-write (no newline at its end, not JSON) is dropped without a word: the
    step it was writing is written again on resume. Any other damage is a :class:`UsageError` naming the line.
    """
    if path.is_dir():
        raise UsageError(
            f"{str(path)!r} is a directory, expected the run's metrics (a file of JSON lines); remove it "
            f"(`rm -r {shlex.quote(str(path))}`) and run the command again: the resumed run starts a new one."
        )
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise UsageError(
            f"{str(path)!r} cannot be read ({e.strerror or e}); make it readable with "
            f"`chmod u+r {shlex.quote(str(path))}`, then run the command again."
        ) from None
    lines = raw.split(b"\n")
    torn = lines.pop()  # b"" after a final newline; else a line a kill cut short
    records: list[dict[str, Any]] = []
    for n, line in enumerate(lines + ([torn] if torn else []), start=1):
        last_torn = bool(torn) and n == len(lines) + 1
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            if last_torn:
                break
            raise _metrics_damaged(path, n, f"byte 0x{line[e.start]:02x} is not UTF-8 text") from None
        except json.JSONDecodeError as e:
            if last_torn:
                break
            text = line.decode("utf-8")
            raise _metrics_damaged(path, n, f"{shown(text)} is not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise _metrics_damaged(path, n, f"it holds {shown(record)}, expected an object with a step")
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            what = "it has no step" if "step" not in record else f"step holds {shown(step)}"
            raise _metrics_damaged(path, n, f"{what}, expected an integer >= 0")
        if records and step <= records[-1]["step"]:
            raise _metrics_damaged(
                path, n, f"step {step} follows step {records[-1]['step']}, expected steps in increasing order"
            )
        for key in METRIC_NUMBERS:
            value = record.get(key, 0.0)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise _metrics_damaged(path, n, f"{key} holds {shown(value)}, expected a number")
        if "eval_acc" in record and "wall_s" not in record:
            raise _metrics_damaged(path, n, "an evaluation without its wall_s, expected both")
        records.append(record)
    return records


def resume_metrics(path: Path, through: int, *, quiet: bool = False) -> list[dict[str, Any]]:
    """The records of steps ``0 .. through`` (the checkpoint's step): what a resumed run keeps.

    Lines lost after they were written (a power cut once the checkpoint was synced, a file deleted) do not
    stop a resume: one note on stderr (unless ``quiet``) says which steps are missing, and the run goes on.
    """
    exists = path.exists()
    kept = [r for r in read_metrics(path) if r["step"] <= through]
    missing = sorted(set(range(through + 1)) - {r["step"] for r in kept})
    if missing and not quiet:
        span = f"{missing[0]}" if len(missing) == 1 else f"{missing[0]}-{missing[-1]}"
        span += "" if len(missing) in (1, missing[-1] - missing[0] + 1) else f" ({len(missing)} of them)"
        where = (
            f"{str(path)!r} has no line for step{'s' if len(missing) > 1 else ''} {span}"
            if exists
            else (f"{str(path)!r} is missing, so steps {span} have no line")
        )
        _stderr(
            f"attnlab: note: {where} (lost after the checkpoint at step {through} was written); the resumed run "
            f"appends from step {through + 1}."
        )
    return kept
