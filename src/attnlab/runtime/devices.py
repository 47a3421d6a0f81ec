"""Devices and dtypes as the user names them on a command line, checked against this torch build."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch

from .errors import UsageError

__all__ = ["DEVICE_HELP", "DTYPE_HELP", "resolve_device", "resolve_dtype", "cpu_info"]


def cpu_info() -> dict[str, Any]:
    """``{"vendor", "model", "family", "model_number", "flags"}`` of this machine's CPU from ``/proc/cpuinfo`` (as
    lscpu reads it), the flags sorted; where there is none, what ``platform`` knows and no flags. Family and model
    number name the generation where a VM hides the model name's tail (AMD family 25, model 1: Zen 3, Milan)."""
    info: dict[str, Any] = {
        "vendor": "",
        "model": platform.processor() or platform.machine() or "unknown",
        "family": "",
        "model_number": "",
        "flags": [],
    }
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields: dict[str, str] = {}
    for line in text.splitlines():  # the first processor's fields are enough: every core is the same model
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    info["vendor"] = fields.get("vendor_id", "")
    info["model"] = fields.get("model name") or info["model"]
    info["family"], info["model_number"] = fields.get("cpu family", ""), fields.get("model", "")
    info["flags"] = sorted(fields.get("flags", "").split())
    return info


DEVICE_HELP = "auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps"
DTYPE_HELP = "auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16 or float64"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
}


def resolve_device(name: str, flag: str = "--device") -> torch.device:
    """``"auto"`` or a device this torch build can use now; otherwise a :class:`UsageError` that says
    what this build has."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UsageError(f"{flag} {name!r} is not a device name; use {DEVICE_HELP}.") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"a CUDA {torch.version.cuda} build"
            raise UsageError(
                f"{flag} {name!r}, but this torch ({torch.__version__}, {build}) sees no CUDA GPU; "
                f"use {flag} cpu (or auto), or install a CUDA build of torch on a machine with a GPU."
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"{flag} {name!r}, but only {count} CUDA device(s) exist (cuda:0 .. cuda:{count - 1}).")
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise UsageError(f"{flag} 'mps', but this torch build or machine has no MPS; use {flag} cpu or auto.")
        return device
    raise UsageError(f"{flag} {name!r}: attnlab runs on cpu, cuda or mps; use {DEVICE_HELP}.")


def resolve_dtype(name: str, device: torch.device, flag: str = "--dtype") -> torch.dtype:
    """``"auto"`` (float32 on a CPU, bfloat16 on a GPU) or a floating dtype by name."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = _DTYPES.get(name.lower())
    if dtype is None:
        raise UsageError(f"{flag} {name!r} is not a dtype attnlab runs in; use {DTYPE_HELP}.")
    if dtype == torch.float64 and device.type == "mps":
        raise UsageError(f"{flag} float64 on mps: MPS has no float64; use float32.")
    return dtype
