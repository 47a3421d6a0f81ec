"""What a real model's weights are computed in: one ``--dtype`` vocabulary, a default per task, and its reason.

Every command that loads a real model (``generate``, ``inspect``, ``bench-decode``, the demo) and
``attnlab.from_pretrained`` take the same names:

- ``gguf``: a GGUF file's quantized blocks (Q4_0/Q4_1/Q8_0) kept as the file stores them and computed on
  by attnlab's C++ kernels: the model the file holds, as llama.cpp runs it (a CPU only);
- ``float32``: every weight dequantized or converted to float32: the exact float model;
- ``bfloat16``, ``float16``: half the bytes of float32 (float16 only where the device computes in it);
- ``auto``: the task's default, below.

The defaults and why (each measured; the figures are in ``docs/howto/real-models.md``):

============================  ==================================  =========================================
task                          a GGUF file                         other sources (HF directory, checkpoint)
============================  ==================================  =========================================
generate, chat, the demo      CPU: ``gguf`` (kernels built) else  CPU: float32; CUDA: bfloat16 (float16
                              float32; CUDA: bfloat16             without bf16); MPS: float32
inspect                       float32                             float32
============================  ==================================  =========================================

- Generation on a CPU is bound by the bytes of weights read per token: the GGUF's blocks are 5.6x fewer
  than float32's for SmolLM2, and decode ran at 279 tokens/s as stored against 18 in float32 (AMD EPYC
  Zen 4, 2 threads). Without the compiled kernels (no C++ compiler) the blocks are dequantized by plain
  PyTorch at every step, slower than float32, so ``auto`` takes float32 then and says why.
- bfloat16 on a CPU is no faster than float32 there (SmolLM2, batch 1: 27.3 against 32.9 tokens/s on
  the same machine, ``docs/bench_decode_smollm2.json``): torch's CPU matmul converts it, so float32 stays.
- On CUDA the quantized kernels do not run (they are CPU code); bfloat16 is what cuDNN's and flash's
  attention kernels and the tensor cores take, with float32's range.
- ``inspect`` shows and compares attention weights, so it reads the float model exactly (float32);
  ``--dtype gguf`` shows the quantized model as it runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from ..runtime import UsageError

__all__ = [
    "WEIGHT_DTYPES",
    "WEIGHTS_HELP",
    "WeightChoice",
    "choose_weights",
    "is_gguf_source",
    "loaded_weights_detail",
    "parse_weights",
    "weights_name",
]

Task = Literal["generate", "inspect"]

# The names every command's --dtype takes, the default first; float64 is accepted too (the API's exact
# reference), but not advertised.
WEIGHT_DTYPES = ("auto", "gguf", "float32", "bfloat16", "float16")
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_SPELLINGS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp64": "float64"}
_SPELLINGS.update({"double": "float64", "float": "float32"})
WEIGHTS_HELP = "auto (the task's default), gguf (a GGUF file's blocks as stored), float32, bfloat16 or float16"


@dataclass(frozen=True)
class WeightChoice:
    """The weights a command runs: ``dtype`` for :func:`~attnlab.weight_files.pretrained.from_pretrained`, and why."""

    dtype: torch.dtype | Literal["gguf"]
    reason: str  # why this one: the task's default and its reason, or "--dtype asked for it"
    asked: bool  # the user named it (not "auto")

    @property
    def name(self) -> str:
        """``"gguf"``, ``"float32"``, ``"bfloat16"``...: the name ``--dtype`` takes for it."""
        return weights_name(self.dtype)

    def line(self, detail: str = "") -> str:
        """The one line a command prints on stderr: which weights ran and why (``detail``: what the loaded
        model adds, e.g. its blocks' formats and kernels)."""
        what = f"{self.name} ({detail})" if detail else self.name
        return f"attnlab: weights {what}: {self.reason}"


def weights_name(dtype: torch.dtype | str) -> str:
    """The ``--dtype`` name of ``dtype`` (``torch.bfloat16`` -> ``"bfloat16"``; ``"gguf"`` stays)."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def is_gguf_source(source: str | os.PathLike[str]) -> bool:
    """Whether ``source`` names a GGUF file, as ``from_pretrained`` reads it: ``"smollm2"`` (its package ships
    one), a ``.gguf`` path, or any other file (a directory is a checkpoint)."""
    text = os.fspath(source)
    path = Path(text)
    return text.lower() == "smollm2" or path.suffix.lower() == ".gguf" or path.is_file()


def parse_weights(dtype: str | torch.dtype, flag: str = "--dtype") -> str:
    """``dtype`` as one of :data:`WEIGHT_DTYPES` (or ``float64``); a :class:`UsageError` naming ``flag`` if not."""
    if isinstance(dtype, torch.dtype):
        name = weights_name(dtype)
    elif isinstance(dtype, str):
        name = _SPELLINGS.get(dtype.strip().lower(), dtype.strip().lower())
    else:
        name = repr(dtype)
    if name in WEIGHT_DTYPES or name in _FLOATS:
        return name
    shown = repr(dtype) if not isinstance(dtype, torch.dtype) else str(dtype)
    example = f"{flag} bfloat16" if flag.startswith("--") else f'{flag}="bfloat16"'
    raise UsageError(f"{flag} {shown} is not a weight dtype; use {WEIGHTS_HELP}, e.g. {example}.")


# SmolLM2's decode on a CPU (AMD EPYC Zen 4, 2 threads; the module docstring): the GGUF's blocks on attnlab's
# kernels against float32, what a machine without the kernels falls back to
GGUF_TOKENS_S, FLOAT32_TOKENS_S = 279.0, 18.0
GGUF_SPEEDUP = GGUF_TOKENS_S / FLOAT32_TOKENS_S


def _half(device: torch.device) -> torch.dtype:
    """bfloat16 where the GPU computes in it (Ampere and later), else float16."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.float16
    return torch.bfloat16


def _kernels() -> tuple[bool, str]:
    """Whether attnlab's quantized CPU kernels run here, and if not, why (built once per machine, then cached)."""
    from ..quant import kernel_status

    status = kernel_status()
    return status.available, status.reason


def choose_weights(
    dtype: str | torch.dtype = "auto",
    *,
    task: Task,
    source: str | os.PathLike[str],
    device: torch.device,
    flag: str = "--dtype",
) -> WeightChoice:
    """The weights ``task`` runs ``source`` in on ``device``: ``dtype`` when named, else the task's default.

    Args:
        dtype: one of :data:`WEIGHT_DTYPES` (``"auto"``: the default for ``task``), or a torch float dtype.
        task: ``"generate"`` (generation and chat: speed, the file's own model) or ``"inspect"`` (analyses
            that compare numbers: exactness).
        source: what :func:`~attnlab.weight_files.pretrained.from_pretrained` takes (``"smollm2"``, a ``.gguf``
            file, a directory).
        device: where the weights go (resolved: no ``"auto"``).
        flag: how the caller names the argument in errors (``--dtype`` on a command line, ``dtype`` in Python).

    Raises:
        UsageError: an unknown name; ``gguf`` for a source that is no GGUF file or a device that is no CPU;
            a float dtype this device cannot compute in.
    """
    name = parse_weights(dtype, flag)
    gguf_file = is_gguf_source(source)
    if name == "gguf":
        if not gguf_file:
            raise UsageError(
                f"{flag} gguf keeps a GGUF file's blocks as stored, but {os.fspath(source)!r} is not a .gguf file; "
                f"pass a float dtype for it, e.g. {flag} float32 (or {flag} auto)."
            )
        if device.type != "cpu":
            raise UsageError(
                f"{flag} gguf on {device}: attnlab's quantized kernels are CPU code; pass {flag} bfloat16 for "
                f"{device.type} (the blocks dequantized once at load), or run on the CPU (--device cpu)."
            )
        return WeightChoice("gguf", f"{flag} gguf asked for it (the file's blocks, as llama.cpp runs them)", True)
    if name != "auto":
        resolved = _FLOATS[name]
        if resolved == torch.float64 and device.type == "mps":
            raise UsageError(f"{flag} float64 on mps: MPS has no float64; pass {flag} float32.")
        return WeightChoice(resolved, f"{flag} {name} asked for it", True)
    return _default(task, gguf_file, device, flag)


def _default(task: Task, gguf_file: bool, device: torch.device, flag: str) -> WeightChoice:
    """``auto``: the task's default on ``device`` for this kind of source, with its reason (see the module's table)."""
    if task == "inspect":
        other = (
            f"{flag} gguf for the quantized model as it runs" if gguf_file else f"{flag} bfloat16 for half the memory"
        )
        return WeightChoice(
            torch.float32, f"inspect's default: attention weights read from the exact float model; {other}", False
        )
    if device.type == "cuda":
        half = _half(device)
        why = "what the GPU's attention kernels and tensor cores take" + (
            "" if half == torch.bfloat16 else " (this GPU has no bfloat16)"
        )
        if gguf_file:
            why += "; the GGUF's quantized kernels are CPU code, so its blocks are dequantized once at load"
        return WeightChoice(
            half, f"generate's default on {device.type}: {why}; {flag} float32 for the exact model", False
        )
    if device.type != "cpu":
        return WeightChoice(
            torch.float32,
            f"generate's default on {device.type}: float32 (attnlab has not measured half dtypes there)",
            False,
        )
    if gguf_file:
        built, why_not = _kernels()
        if built:
            return WeightChoice(
                "gguf",
                "generate's default for a GGUF file on a CPU: the model the file holds, as llama.cpp runs it, "
                f"5.6x fewer bytes per token than float32; {flag} float32 for the exact float model",
                False,
            )
        return WeightChoice(
            torch.float32,
            f"generate's default for a GGUF file on a CPU without attnlab's quantized kernels ({why_not}); "
            f"float32 is faster than the blocks in plain PyTorch, but about {GGUF_SPEEDUP:.0f}x slower than the "
            f"kernels ({FLOAT32_TOKENS_S:g} against {GGUF_TOKENS_S:g} tokens/s measured for SmolLM2's decode)",
            False,
        )
    return WeightChoice(
        torch.float32,
        f"generate's default on a CPU: bfloat16 is no faster there (torch's CPU matmul converts it); "
        f"{flag} bfloat16 for half the memory",
        False,
    )


def loaded_weights_detail(model: torch.nn.Module) -> str:
    """For a model whose blocks are kept as stored: ``"Q8_0 and Q4_1 blocks as stored, int8 tiles on AVX-512
    VNNI"`` (each format by its share of the weights, then the kernels in use, or the fallback and why);
    ``""`` for float weights."""
    from ..quant import QuantEmbedding, QuantLinear, kernel_status

    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and not getattr(module, "is_fusion", False):
            counts[module.fmt.name] = counts.get(module.fmt.name, 0) + module.rows * module.in_features
    if not counts:
        return ""
    formats = " and ".join(sorted(counts, key=lambda name: -counts[name]))
    status = kernel_status()
    kernels = (
        f"int8 tiles on {status.tiles_isa}"
        if status.available
        else f"plain PyTorch, slower than float32: the kernels were not built ({status.reason})"
    )
    return f"{formats} blocks as stored, {kernels}"
