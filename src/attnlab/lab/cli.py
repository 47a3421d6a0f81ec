"""``attnlab train`` and ``attnlab ablate-heads``: flags derived from the dataclasses by tyro.

Both accept ``--config FILE`` (a run's ``config.json``): the file becomes tyro's defaults, and any
other flag overrides it. ``attnlab train --out-dir R --resume`` reloads ``R/config.json`` the
same way, so a resumed run needs no flags repeated; ``attnlab ablate-heads --out-dir D --resume``
likewise reloads the study's ``D/config.json``.

Exit codes: 0 done; 2 a usage error (raised as :class:`attnlab.runtime.UsageError`, printed as
``attnlab: error: ...`` by :func:`attnlab.cli.main`); 1 training diverged (NaN/inf loss); 128 + the
signal's number (130 SIGINT, 143 SIGTERM, 129 SIGHUP, ...) stopped by a signal after saving a
checkpoint, with one line naming the signal and saying how to resume; 75 under torchrun, another rank
died or stopped answering for ``--rank-timeout`` seconds, with one line naming it and the command that
resumes (:mod:`attnlab.distributed.failures`).

The stop signals (:data:`attnlab.runtime.signals.STOP_SIGNALS`) are caught from the first line of
:func:`lab_main` to its last: while flags are parsed (nothing written yet: one line, and the exit code),
while the run trains (the checkpoint is saved, :mod:`.stopping`), and while it writes its last files
(they are finished; the line says the run is complete).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import tyro

from .ablate import AblateConfig, ablate, load_ablate_config
from .config import TrainConfig, config_from_dict, load_config
from .run_dir import read_run_config
from .stopping import StopSignals, TrainingDiverged, TrainingInterrupted, exit_code, print_line
from .train import train
from .train_state import CKPT_NAME, read_meta

__all__ = ["train_command", "ablate_command", "lab_main", "LAB_COMMANDS"]

CONFIG_HELP = (
    "--config FILE: start from a saved run's config.json (unknown keys are rejected); flags given after it override it."
)
STOP_HELP = (
    "A stop signal (Ctrl-C, SIGTERM, SIGHUP from a closed terminal, SIGQUIT, SIGUSR1/2 as Slurm's warning, SIGXCPU) "
    "ends the step under way, saves a checkpoint and prints the command that resumes. Under torchrun, a rank that "
    "dies or stops answering for --rank-timeout seconds (default 50) ends every rank, with that command too."
)


def _stopped(run: Callable[[], int]) -> int:
    """Run ``run``; an interrupt or a divergence becomes its line on stderr and its exit code."""
    try:
        return run()
    except TrainingInterrupted as e:
        if e.announce:
            print_line(e.line)  # a hung-up terminal loses the line, not the exit code
        return e.exit_code
    except TrainingDiverged as e:
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        if e.announce:
            print(f"attnlab: error: {e}", file=sys.stderr, flush=True)
        return 1


def _speaks() -> bool:
    """Rank 0 (or a single process) prints the run's lines: one per run, not one per rank."""
    return int(os.environ.get("RANK", "0")) == 0


def _finished(signals: StopSignals, what: str) -> TrainingInterrupted:
    """A signal that came once the work was done (its last files were being written): they were finished."""
    return TrainingInterrupted(
        f"attnlab: {signals.name} received{signals.sender} as the {what}; nothing to resume.",
        signum=signals.signum,
        step=-1,
        announce=_speaks(),
    )


def train_command(
    cfg: Annotated[TrainConfig, tyro.conf.arg(name="")], stop: tyro.conf.Suppress[StopSignals | None] = None
) -> int:
    """Train a model on a synthetic task, seed 002's random data or a text file (see attnlab.lab)."""
    signals = stop or StopSignals()

    def run() -> int:
        with signals:
            result = train(cfg, stop=signals)
            if result.run_dir is not None:
                print(
                    f"artifacts: {result.run_dir} (config.json, metrics.jsonl, checkpoint.safetensors, curve.png, "
                    "summary.json" + (", model/)" if "model_dir" in result.final else ")")
                )
            if signals.requested:
                steps = result.final["steps"]
                raise _finished(signals, f"run finished: its {steps} steps are done and every file is written")
        return 0

    return _stopped(run)


def ablate_command(
    cfg: Annotated[AblateConfig, tyro.conf.arg(name="")], stop: tyro.conf.Suppress[StopSignals | None] = None
) -> int:
    """Seed 002 section 4.4: fixed d_model, several head counts and seeds; a table and a PNG of loss curves."""
    signals = stop or StopSignals()

    def run() -> int:
        with signals:
            ablate(cfg, stop=signals)
            if signals.requested:
                raise _finished(signals, "study finished: every run is done and the table is written")
        return 0

    return _stopped(run)


def _split_config_flag(args: list[str]) -> tuple[Path | None, list[str]]:
    """Take ``--config PATH`` (or ``--config=PATH``) out of ``args``."""
    rest, path = [], None
    it = iter(args)
    for a in it:
        if a == "--config":
            path = next(it, None)
            if path is None:
                raise ValueError(
                    "--config needs a path, got none; pass a run's config.json, e.g. --config runs/train/config.json."
                )
        elif a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    return (Path(path) if path else None), rest


def _parse_train(args: list[str]) -> TrainConfig:
    path, rest = _split_config_flag(args)
    base = load_config(path) if path else TrainConfig()
    cfg = tyro.cli(
        TrainConfig,
        args=rest,
        default=base,
        prog="attnlab train",
        description=f"{train_command.__doc__}\n\n{CONFIG_HELP}\n\n{STOP_HELP}",
    )
    saved, ckpt = Path(cfg.out_dir) / "config.json", Path(cfg.out_dir) / CKPT_NAME
    if cfg.resume and path is None and (saved.exists() or ckpt.exists()):
        # resume a run with its own config (config.json, else the copy inside the checkpoint); flags still override
        own = read_run_config(saved) if saved.exists() else config_from_dict(read_meta(ckpt)["config"])
        cfg = tyro.cli(TrainConfig, args=rest, default=own, prog="attnlab train")
        cfg.resume = True
    return cfg


def _parse_ablate(args: list[str]) -> AblateConfig:
    path, rest = _split_config_flag(args)
    base = load_ablate_config(path) if path else AblateConfig()
    description = (
        f"{ablate_command.__doc__}\n\n--config FILE: a study's config.json, or a training run's config.json as the "
        "base run; flags given after it override it."
    )
    cfg = tyro.cli(AblateConfig, args=rest, default=base, prog="attnlab ablate-heads", description=description)
    saved = Path(cfg.out_dir) / "config.json"
    if cfg.resume and path is None and saved.exists():  # resume a study with its own config; flags still override
        cfg = tyro.cli(
            AblateConfig, args=rest, default=load_ablate_config(saved, "--resume"), prog="attnlab ablate-heads"
        )
        cfg.resume = True
    return cfg


# subcommand -> (parse its flags into a config, run it)
LAB_COMMANDS: dict[str, tuple[Callable[[list[str]], TrainConfig | AblateConfig], Callable[..., object]]] = {
    "train": (_parse_train, train),
    "ablate-heads": (_parse_ablate, ablate),
}


def lab_main(argv: Sequence[str]) -> int:
    """Run ``train``/``ablate-heads`` from ``argv`` (the subcommand first); tyro exits 2 on bad flags.

    A :class:`attnlab.runtime.UsageError` propagates to :func:`attnlab.cli.main`, which prints it and
    returns 2. A stop signal while the flags are parsed ends with one line naming it and ``128 +`` its
    number once they are: nothing has been written then.
    """
    with StopSignals() as signals:
        try:
            parse, _ = LAB_COMMANDS[argv[0]]
            cfg = parse(list(argv[1:]))
            if signals.requested:
                print_line(f"attnlab: {signals.name} received before {argv[0]} started; nothing was written.")
                return exit_code(signals.signum)
            return train_command(cfg, signals) if isinstance(cfg, TrainConfig) else ablate_command(cfg, signals)
        except TrainingInterrupted:
            raise  # handled in train_command/ablate_command; never reaches here
        except KeyboardInterrupt:  # outside the main thread, where no handler could be installed
            print_line(f"attnlab: interrupted before {argv[0]} started; nothing was written.")
            return exit_code(2)


if __name__ == "__main__":
    sys.exit(lab_main(sys.argv[1:]))
