"""``attnlab train`` and ``attnlab ablate-heads``: flags derived from the dataclasses by tyro.

Both accept ``--config FILE`` (a run's ``config.json``): the file becomes tyro's defaults, and any
other flag overrides it. ``attnlab train --run-dir R --resume`` reloads ``R/config.json`` the
same way, so a resumed run needs no flags repeated.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import tyro

from .ablate import AblateConfig, ablate
from .config import TrainConfig, load_config
from .train import train

__all__ = ["train_command", "ablate_command", "lab_main", "LAB_COMMANDS"]

CONFIG_HELP = (
    "--config FILE: start from a saved run's config.json (unknown keys are rejected); flags given after it override it."
)


def train_command(cfg: Annotated[TrainConfig, tyro.conf.arg(name="")]) -> int:
    """Train a model on a synthetic task, seed 002's random data or a text file (see attnlab.lab)."""
    result = train(cfg)
    if result.run_dir is not None:
        print(
            f"artifacts: {result.run_dir} (config.json, metrics.jsonl, checkpoint.safetensors, curve.png, summary.json"
            + (", model/)" if "model_dir" in result.final else ")")
        )
    return 0


def ablate_command(cfg: Annotated[AblateConfig, tyro.conf.arg(name="")]) -> int:
    """Seed 002 section 4.4: fixed d_model, 1/2/4/8 heads, several seeds; a table and a PNG of loss curves."""
    ablate(cfg)
    return 0


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
        description=f"{train_command.__doc__}\n\n{CONFIG_HELP}",
    )
    saved = Path(cfg.run_dir) / "config.json"
    if cfg.resume and path is None and saved.exists():  # resume a run with its own config; flags still override
        cfg = tyro.cli(TrainConfig, args=rest, default=load_config(saved), prog="attnlab train")
        cfg.resume = True
    return cfg


def _parse_ablate(args: list[str]) -> AblateConfig:
    path, rest = _split_config_flag(args)
    base = AblateConfig(train=load_config(path)) if path else AblateConfig()
    return tyro.cli(
        AblateConfig,
        args=rest,
        default=base,
        prog="attnlab ablate-heads",
        description=f"{ablate_command.__doc__}\n\n--config FILE: a run's config.json as the base training run.",
    )


# subcommand -> (parse its flags into a config, run it)
LAB_COMMANDS: dict[str, tuple[Callable[[list[str]], TrainConfig | AblateConfig], Callable[..., object]]] = {
    "train": (_parse_train, train),
    "ablate-heads": (_parse_ablate, ablate),
}


def lab_main(argv: Sequence[str]) -> int:
    """Run ``train``/``ablate-heads`` from ``argv`` (the subcommand first); tyro exits 2 on bad flags."""
    parse, _ = LAB_COMMANDS[argv[0]]
    cfg = parse(list(argv[1:]))
    return train_command(cfg) if isinstance(cfg, TrainConfig) else ablate_command(cfg)


if __name__ == "__main__":
    sys.exit(lab_main(sys.argv[1:]))
