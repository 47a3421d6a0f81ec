"""See what the heads do: capture every layer's attention weights, score and classify each head, and
write ``heads.json``, ``heads.png`` and a self-contained ``index.html``.

Entry points: :func:`attnlab.inspect` (this package's :func:`~attnlab.heads.report.inspect`) and
``attnlab inspect`` on the command line.
"""

from .capture import attention_layers, capture_attention, run_and_capture
from .report import HeadReport, inspect
from .scores import KINDS, SCORE_NAMES, THRESHOLDS, classify, make_probe, probe_scores, text_scores

__all__ = [
    "inspect",
    "HeadReport",
    "capture_attention",
    "run_and_capture",
    "attention_layers",
    "text_scores",
    "probe_scores",
    "classify",
    "make_probe",
    "KINDS",
    "SCORE_NAMES",
    "THRESHOLDS",
]
