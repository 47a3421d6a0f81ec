"""``run_checks``: the rows of :mod:`attnlab.check.suite`, then, when one fails, the diagnosis."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .diagnose import diagnose as find_causes
from .result import Report
from .suite import run_rows

__all__ = ["run_checks"]


def run_checks(
    target: object,
    *,
    checks: Iterable[str] | None = None,
    seed: int = 0,
    batch: int = 2,
    seq_len: int = 8,
    scale: float | None = None,
    diagnose: bool = True,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> Report:
    """Audit an attention module against attnlab's float64 reference.

    Args:
        target: an :class:`~attnlab.check.adapters.AttentionAdapter` (or any object following
            its protocol), a ``torch.nn.MultiheadAttention``, attnlab's ``MultiHeadAttention``, or
            any attention ``nn.Module``, called as it is written (:class:`attnlab.check.ProbedAdapter`).
        checks: names from :data:`attnlab.check.CHECKS` to run (default: all, in that order).
        seed: seeds every input; the same seed gives the same figures.
        batch, seq_len: B and T of the inputs (seq_len >= 4).
        scale: the expected multiplier of the scores; default ``1/sqrt(head_dim)``. The module's own
            ``scale`` attribute is never taken as the truth (``scale_attribute`` reports on it).
        diagnose: when a check fails, test the catalogue of known mistakes and fill
            ``report.diagnosis`` (:func:`attnlab.check.diagnose.diagnose`).
        device: where to check it: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``... (default: where its
            weights are). A module elsewhere is checked as a copy moved there (yours stays where it
            is); every input and the float64 reference are made there, and the diagnosis runs there.
        dtype: what to check it in: float32, float64, bfloat16 or float16 (``torch.bfloat16`` or
            ``"bfloat16"``; default: its weights' dtype). In bfloat16/float16 each comparison is held
            to flash-attention's rule, 2x plain PyTorch's error in that dtype
            (:meth:`attnlab.check.suite.Context.tol`). A device or dtype this machine cannot check
            on raises :class:`attnlab.runtime.UsageError` (a ``ValueError``) saying what it has.

    Returns:
        A :class:`Report`; ``report.ok`` is False when a check failed, and ``report.diagnosis``
        names the likely causes, most likely first. The target is left in eval mode, and the
        global RNG state is untouched.
    """
    adapter, report = run_rows(
        target, checks=checks, seed=seed, batch=batch, seq_len=seq_len, scale=scale, device=device, dtype=dtype
    )
    if diagnose and not report.ok:
        with torch.random.fork_rng(devices=[]):  # the diagnosis draws too: leave the caller's RNG alone
            report.diagnosis = find_causes(adapter, report, seed=seed, batch=batch, seq_len=seq_len)
        adapter.set_training(False)
    return report
