"""``run_checks``: the rows of :mod:`attnlab.check.suite`, then, when one fails, the diagnosis."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .adapters import AttentionAdapter
from .diagnose import diagnose as find_causes
from .result import Cause, CheckError, Report
from .suite import SEQ_LEN, raised_at, raised_in_target, run_rows

__all__ = ["diagnosed", "run_checks"]


def run_checks(
    target: object,
    *,
    checks: Iterable[str] | None = None,
    seed: int = 0,
    batch: int = 2,
    seq_len: int = SEQ_LEN,
    scale: float | None = None,
    diagnose: bool = True,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    strict: bool = False,
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
        strict: count hardening notes as failures, as ``attnlab check --strict`` does: their rows get
            status ``"fail"`` (not ``"note"``), ``report.ok`` is False and ``report.raise_if_failed()``
            raises on them. Without it they are rows of status ``"note"``, listed in ``report.notes``;
            ``report.raise_if_failed(strict=True)`` fails on them later all the same.

    Returns:
        A :class:`Report`; ``report.ok`` is False when the module does not compute attention
        correctly; a row that missed its bound where only hardening causes explain it (NaN in padded
        values, fully masked rows, a fill float16 cannot hold, float32 inside float64) has status
        ``"note"`` and is in ``report.notes`` instead, unless ``strict``. ``report.diagnosis`` names the likely causes,
        most likely first. The target is left in eval mode, and the global RNG state is untouched.

    Raises:
        CheckError: attnlab check's own code failed (not the target's): ``error.phase`` says where.
    """
    adapter, report = run_rows(target, checks, seed, batch, seq_len, scale, device, dtype)
    report.strict = strict
    call = getattr(adapter, "describe_call", lambda: None)()
    if call:
        report.config["call_form"] = call
    if diagnose and report.failing:
        diagnosed(adapter, report, seed=seed, batch=batch, seq_len=seq_len)
    return report


def diagnosed(adapter: AttentionAdapter, report: Report, *, seed: int, batch: int, seq_len: int) -> Report:
    """``report`` with its diagnosis, and its rows that only hardening causes explain marked as notes.

    A crash of check's own code while diagnosing is a :class:`CheckError`; one of the target's that the
    diagnosis did not expect is a cause of its own (the rows stay failures)."""
    try:
        with torch.random.fork_rng(devices=[]):  # the diagnosis draws too: leave the caller's RNG alone
            causes = find_causes(adapter, report, seed=seed, batch=batch, seq_len=seq_len)
    except CheckError:
        raise
    except Exception as e:
        if not raised_in_target(e):
            raise CheckError("diagnosing the failing rows", e) from e
        at = raised_at(e)
        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        causes = [
            Cause(
                "crash",
                f"the module raises {type(e).__name__} on the diagnosis's probe inputs",
                message + (f"; raised at {at}" if at else ""),
                "run the module alone on those inputs (attnlab check --debug shows the traceback)",
                "seed 002, section 4.1",
            )
        ]
    finally:
        adapter.set_training(False)
    report.apply_diagnosis(causes)
    return report
