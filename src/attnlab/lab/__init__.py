"""The training lab: seed 002's minimal experiment, tasks only attention can solve, the head-count study.

* :mod:`.config`: the dataclasses the ``attnlab train`` / ``ablate-heads`` flags are derived from;
  :mod:`.validation`: every field of them checked before any work.
* :mod:`.data`: data sources, each a pure function of ``(seed, step, rank)``.
* :mod:`.models`: seed 002's ``MinimalFormerBlock``, its stack, and a ``TinyGPT`` builder.
* :mod:`.train`: the loop (single process or ``torchrun``/DDP); :mod:`.train_state`: the training state it saves and resumes.
* :mod:`.head_scores`: every head's previous-token/induction (and recall lookup) scores, logged at each evaluation.
* :mod:`.run_dir`: a run already in a directory is never replaced; ``--resume`` needs a checkpoint.
* :mod:`.stopping`: a stop signal (SIGINT, SIGTERM, SIGHUP, ...) stops a run with a checkpoint; a NaN loss
  stops it keeping the last good one.
* :mod:`.ablate`: the head-count experiment of seed 002 section 4.4.
"""

from .config import DataConfig, ModelConfig, OptimConfig, TrainConfig, demo_config
from .stopping import TrainingDiverged, TrainingInterrupted
from .train import RunResult, train

__all__ = [
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "RunResult",
    "TrainingDiverged",
    "TrainingInterrupted",
    "demo_config",
    "train",
]
