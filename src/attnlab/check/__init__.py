"""``attnlab check``: audit any attention module against attnlab's float64 reference.

Library use, e.g. in a pytest suite::

    from attnlab.check import run_checks
    run_checks(my_attention_module).raise_if_failed()

``run_checks`` takes an adapter (see :mod:`attnlab.check.adapters` for the protocol), a
``torch.nn.MultiheadAttention``, attnlab's ``MultiHeadAttention``, or any attention
``nn.Module`` as it is written (:class:`ProbedAdapter` reads its weights, call form and mask
convention off the module), and returns a :class:`Report` of :class:`CheckResult` rows (pass /
fail / skip, the measured figure, the tolerance, and how it was measured or why it was skipped).
When a row fails, ``report.diagnosis`` names the likely causes from the catalogue of known
mistakes (:mod:`attnlab.check.catalogue`, :mod:`attnlab.check.diagnose`), most likely first.
``run_checks(module, device="cuda", dtype=torch.bfloat16)`` checks a copy where it runs
(:mod:`attnlab.check.device`).
"""

from .adapters import AttentionAdapter, ModuleAdapter, Projections, TorchMHAAdapter, Unsupported
from .probe import ProbedAdapter, as_adapter
from .reference import plain_attention, reference_attention
from .result import CheckResult, Report
from .runner import run_checks
from .suite import CHECKS

__all__ = [
    "CHECKS",
    "AttentionAdapter",
    "CheckResult",
    "ModuleAdapter",
    "ProbedAdapter",
    "Projections",
    "Report",
    "TorchMHAAdapter",
    "Unsupported",
    "as_adapter",
    "plain_attention",
    "reference_attention",
    "run_checks",
]
