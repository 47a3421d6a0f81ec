"""Where ``attnlab check`` runs: ``--device`` and ``--dtype`` checked against this torch build, and the
target moved there.

Why check where the module runs: a GPU runs other kernels than a CPU (cuDNN's or flash's SDPA, TF32
where enabled, other reduction orders), and code that is right on a CPU can fail there: a tensor
built inside ``forward`` without ``device=`` lands on the CPU next to inputs on the GPU
(``device_mismatch``). So every check can run on any device this torch sees: the target is moved
there, every input is moved there (drawn on the CPU from the row's seed, so the numbers are the
same everywhere), and the float64 reference and the diagnosis run there too.

- **device**: ``cpu`` (default), ``cuda``, ``cuda:N``, ``mps``, ``xpu``: any device this torch build
  sees now. Refused, with what this machine has: a name that is no torch device, a device this
  machine lacks, ``meta`` (it holds no values, and every check measures one), and a device without
  float64 (``mps``): the reference and ``gradcheck`` compute in float64 next to the target, and
  a reference moved to the CPU would leave half the suite (the variant formulas, the diagnosis'
  recomputations) to port; run such a device's checks on the CPU for now.
- **dtype**: what the target's weights and the inputs are in: ``float32`` (default), ``float64``,
  ``bfloat16``, ``float16``. In a half dtype each comparison with the float64 reference is held to
  flash-attention's rule (see :meth:`attnlab.check.suite.Context.tol`), and the diagnosis recomputes
  its hypotheses on a float32 copy of the target, on the same device.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..runtime import UsageError

__all__ = ["DTYPES", "available_devices", "place", "resolve_device", "resolve_dtype", "where"]

# The dtypes the suite runs a target in, by the names --dtype takes; float32 first: the default.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Other names people type for them, as runtime's --dtype takes them.
_SPELLINGS = {
    "fp32": "float32",
    "fp64": "float64",
    "double": "float64",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def available_devices() -> list[str]:
    """The device names this torch build can run on now: ``cpu``, then the accelerator's (``cuda``,
    ``cuda:0`` ..., or ``mps``, ``xpu`` ...)."""
    names = ["cpu"]
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: cuda, mps, xpu ... alike
    if accelerator is not None and accelerator.is_available():
        kind = accelerator.current_accelerator()
        if kind is not None:
            count = accelerator.device_count()
            names += [kind.type, *(f"{kind.type}:{i}" for i in range(count))] if count else [kind.type]
    else:
        if torch.cuda.is_available():
            names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
        if torch.backends.mps.is_available():
            names.append("mps")
    return names


def _machine() -> str:
    """``this machine's torch 2.13.0+cpu (a CPU-only build) has cpu``: what a refusal says is here."""
    if torch.version.cuda is not None:
        build = f"a CUDA {torch.version.cuda} build"
    elif getattr(torch.version, "hip", None):
        build = f"a ROCm {torch.version.hip} build"
    else:
        build = "a CPU-only build" if not torch.backends.mps.is_built() else "an MPS build"
    return f"this machine's torch {torch.__version__} ({build}) has {', '.join(available_devices())}"


def resolve_device(device: str | torch.device | None, flag: str = "--device") -> torch.device:
    """``device`` as a :class:`torch.device` this machine can check a target on (None: the CPU).

    Raises:
        UsageError: one sentence naming ``flag``, what was given, what this machine has and the fix,
            for a name that is no torch device, a device this machine lacks, ``meta``, or a device
            without float64.
    """
    if device is None:
        return torch.device("cpu")
    given = _setting(flag, str(device), quoted=True)
    cpu = _setting(flag, "cpu")
    default = " (the default)" if flag.startswith("--") else ""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(
            f"{given} is not a torch device name; {_machine()}: pass one of those, e.g. {cpu}{default}."
        ) from None
    if dev.type == "meta":
        raise UsageError(
            f"{given} holds no values, and every check measures an error on real numbers, so none "
            f"can run on meta; {_machine()}: pass one of those, e.g. {cpu}."
        )
    have = available_devices()
    if dev.type != "cpu" and str(dev) not in have:
        if dev.type in have:  # an index past the last device of a kind this machine has
            fix = f"pass one of those, e.g. {_setting(flag, f'{dev.type}:0')}"
        elif dev.type == "cuda" and torch.version.cuda is None:
            fix = f"pass {cpu}, or install a CUDA build of torch on a machine with an NVIDIA GPU and check there"
        elif dev.type == "cuda":
            fix = f"pass {cpu}, or make the GPU visible to torch (nvidia-smi lists it; check CUDA_VISIBLE_DEVICES)"
        else:
            fix = f"pass {cpu}, or check on a machine where torch can use {dev.type}"
        raise UsageError(f"{given} names a device this machine does not have: {_machine()}; {fix}.")
    if dev.type != "cpu" and not _computes_in(dev, torch.float64):
        raise UsageError(
            f"{given} has no float64, in which the checks' reference and gradcheck run next to the "
            f"target; pass {cpu} (attnlab check cannot run on a device without float64 yet)."
        )
    return dev


def _setting(flag: str, value: str, *, quoted: bool = False) -> str:
    """How the user writes ``value`` for ``flag``: ``--device cpu`` on the command line (``quoted``: as
    received, ``--device 'gpu'``), ``device='cpu'`` in Python."""
    if flag.startswith("--"):
        return f"{flag} {value!r}" if quoted else f"{flag} {value}"
    return f"{flag}={value!r}"


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device | None = None, flag: str = "--dtype"
) -> torch.dtype:
    """``dtype`` as one of :data:`DTYPES` that ``device`` computes in (None: float32).

    Raises:
        UsageError: naming ``flag``, what was given, the dtypes the suite runs in and the fix.
    """
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = _SPELLINGS.get(str(dtype).lower(), str(dtype).lower())
    if name not in DTYPES:
        raise UsageError(
            f"{_setting(flag, str(dtype), quoted=True)} is not a dtype attnlab check runs in; expected one of "
            f"{', '.join(DTYPES)}{' (float32 is the default)' if flag.startswith('--') else ''}: pass one of "
            f"those, e.g. {_setting(flag, 'bfloat16')}."
        )
    resolved = DTYPES[name]
    dev = torch.device("cpu") if device is None else device
    if not _computes_in(dev, resolved):
        raise UsageError(
            f"{_setting(flag, name, quoted=True)} on {dev}: this device cannot compute in {name} with this torch "
            f"({torch.__version__}); pass {_setting(flag, 'float32')}, or check on another device."
        )
    return resolved


def _computes_in(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a small matmul in ``dtype`` runs on ``device`` (mps has no float64, some GPUs no bfloat16)."""
    try:
        x = torch.ones(2, 2, dtype=dtype, device=device)
        (x @ x).sum().item()
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def where(target: object) -> tuple[torch.device, torch.dtype] | None:
    """``(device, dtype)`` of ``target``'s first floating weight (a module's, or an adapter's
    ``projections().q_weight``); None when it has none to read."""
    if isinstance(target, nn.Module):
        t = next((p for p in target.parameters() if p.is_floating_point()), None)
        return None if t is None else (t.device, t.dtype)
    projections = getattr(target, "projections", None)
    if callable(projections):
        w = projections().q_weight
        return w.device, w.dtype
    return None


def _same(device: torch.device, other: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are the same device when 0 is the current one."""
    if device.type != other.type:
        return False
    if device.index is None or other.index is None:
        return True
    return device.index == other.index


def place(
    target: object, device: torch.device | None, dtype: torch.dtype | None, *, copy_module: bool = True
) -> object:
    """``target`` on ``device`` in ``dtype`` (None: where and as it is already).

    An ``nn.Module`` is moved as ``module.to`` moves it: a deep copy, so that the caller's module stays
    where it was (``copy_module=False``: the module itself, for one the caller built just for the
    check). An adapter answers its ``to(device, dtype)`` (see :mod:`attnlab.check.adapters`). A target
    already there is returned as it is.

    Raises:
        ValueError: the target is elsewhere and cannot be moved (an adapter without ``to``).
    """
    if device is None and dtype is None:
        return target
    now = where(target)
    if now is None:
        return target
    want_device = now[0] if device is None else device
    want_dtype = now[1] if dtype is None else dtype
    if _same(now[0], want_device) and now[1] == want_dtype:
        return target
    if isinstance(target, nn.Module):
        module = copy.deepcopy(target) if copy_module else target
        return module.to(device=want_device, dtype=want_dtype)
    to = getattr(target, "to", None)
    if not callable(to):
        name = getattr(target, "name", type(target).__name__)
        raise ValueError(
            f"device={str(want_device)!r}, dtype={str(want_dtype).removeprefix('torch.')}: the target {name} is on "
            f"{now[0]} in {str(now[1]).removeprefix('torch.')} and its adapter has no to(device, dtype); move the "
            f"module it wraps there before wrapping it, or give the adapter a to() (see attnlab.check.adapters)."
        )
    return to(want_device, want_dtype)
