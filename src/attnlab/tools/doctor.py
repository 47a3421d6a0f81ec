"""``attnlab doctor``: what this machine can run, found by trying it, and a fix for each problem.

Seed 002 section 4.2's advice, made concrete: match the torch build to the Python version and
the CUDA driver, pin the version, and prefer ``F.scaled_dot_product_attention`` (whose flash
and memory-efficient kernels ship inside torch) to compiling FlashAttention from source.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..runtime import atomic_write_text


@dataclass
class Finding:
    topic: str
    status: str  # "ok", "info", "warn" or "fail"
    detail: str
    fix: str = ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices


SDPA_KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "memory-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def try_sdpa_kernel(kernel: str, device: str) -> tuple[bool, str]:
    """Run a tiny causal SDPA forward+backward restricted to one kernel; (ran, why not)."""
    dtype = torch.float16 if device.startswith("cuda") and kernel != "math" else torch.float32
    try:
        q, k, v = torch.randn(3, 1, 2, 16, 64, device=device, dtype=dtype, requires_grad=True).unbind(0)
        with sdpa_kernel([SDPA_KERNELS[kernel]]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
        return bool(torch.isfinite(out).all()), ""
    except Exception as err:
        return False, _first_line(err)


def try_attnlab() -> tuple[bool, str]:
    """attnlab's own module on both backends, forward and backward, masks included."""
    try:
        from ..core.attention import MultiHeadAttention

        mha = MultiHeadAttention(16, 4)
        x = torch.randn(2, 5, 16, requires_grad=True)
        pad = torch.tensor([[False] * 5, [False, False, False, True, True]])
        outs = []
        for backend in ("math", "sdpa"):
            mha.backend = backend
            outs.append(mha(x, key_padding_mask=pad, is_causal=True))
        outs[1].sum().backward()
        if not torch.allclose(outs[0], outs[1], atol=1e-5):
            return False, "the math and sdpa backends disagree on this machine"
        return True, ""
    except Exception as err:
        return False, _first_line(err)


def try_compile() -> tuple[bool, str]:
    """torch.compile a tiny function on the CPU (inductor needs a working C++ compiler)."""
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda a: torch.softmax(a @ a.T, dim=-1), fullgraph=True)
        a = torch.randn(8, 8)
        ok = torch.allclose(fn(a), torch.softmax(a @ a.T, dim=-1), atol=1e-6)
        return ok, "" if ok else "compiled result differs from eager"
    except Exception as err:
        return False, _first_line(err)


def compile_cache_path() -> Path:
    """Where the last successful torch.compile probe is remembered: ``$XDG_CACHE_HOME/attnlab/doctor.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "attnlab" / "doctor.json"


def _compile_key() -> str:
    """What a cached probe result depends on: torch and Python builds, the machine, the GPUs."""
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    return f"torch {torch.__version__} | python {sys.version.split()[0]} | {platform.machine()} | gpus {gpus}"


def cached_compile() -> dict[str, object] | None:
    """The remembered successful probe for this torch/Python/machine, or None."""
    try:
        data = json.loads(compile_cache_path().read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(_compile_key()) if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else None


def remember_compile(seconds: float) -> None:
    """Record a successful probe (best effort: an unwritable cache only means the next run probes again)."""
    path = compile_cache_path()
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        data = data if isinstance(data, dict) else {}
        data[_compile_key()] = {"seconds": round(seconds, 1), "when": time.strftime("%Y-%m-%d %H:%M")}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data, indent=1) + "\n")
    except OSError:
        pass


def diagnose(*, compile_check: bool = True) -> list[Finding]:
    """Every finding, in the order the report prints them."""
    return list(iter_findings(compile_check=compile_check))


def iter_findings(
    *,
    compile_check: bool = True,
    recheck: bool = False,
    announce: Callable[[str, str], None] = lambda topic, what: None,
) -> Iterator[Finding]:
    """Each finding as soon as it is known, so that a report can show them live.

    ``announce(topic, what)`` is called before a step that takes seconds (the torch.compile probe).
    """
    py = sys.version_info
    yield Finding(
        "python",
        "ok" if py >= (3, 10) else "fail",
        platform.python_version(),
        "" if py >= (3, 10) else "attnlab needs Python >= 3.10; create a venv with a newer Python.",
    )
    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else ("ROCm " + hip if hip else "CPU-only")
    yield Finding("torch", "ok", f"{torch.__version__} ({build} build)")

    has_nvidia = shutil.which("nvidia-smi") is not None
    if cuda and not torch.cuda.is_available():
        yield Finding(
            "cuda",
            "warn",
            f"torch is a CUDA {cuda} build but no GPU is usable",
            "Check the driver with nvidia-smi; the driver must support CUDA "
            f"{cuda} (or install the torch wheel built for the driver's CUDA).",
        )
    elif not cuda and has_nvidia:
        yield Finding(
            "cuda",
            "warn",
            "an NVIDIA GPU is present but torch is a CPU-only build",
            f"Install the CUDA build for this Python ({platform.python_version()}) from the "
            f"command on pytorch.org's install page, pinned: pip install torch=={torch.__version__.split('+')[0]}.",
        )
    devices = _devices()
    names = [torch.cuda.get_device_name(int(d.split(":")[1])) if d.startswith("cuda") else d for d in devices]
    yield Finding(
        "devices", "ok", ", ".join(f"{d} ({n})" if n != d else d for d, n in zip(devices, names, strict=True))
    )

    for device in devices:
        for kernel in SDPA_KERNELS:
            if device == "cpu" and kernel in ("memory-efficient", "cudnn"):
                yield Finding(f"sdpa {kernel} @ {device}", "info", "CUDA-only kernel")
                continue
            ran, why = try_sdpa_kernel(kernel, device)
            label = "CPU flash" if (device == "cpu" and kernel == "flash") else kernel
            yield Finding(
                f"sdpa {label} @ {device}", "ok" if ran else "info", "runs" if ran else f"not available: {why}"
            )

    spec = importlib.util.find_spec("flash_attn")
    if spec is None:
        yield Finding(
            "flash-attn package",
            "info",
            "not installed",
            "Not needed: SDPA's flash kernel ships inside torch. If you want the package, "
            "install a prebuilt wheel matching your torch, CUDA and Python versions; do not "
            "compile it from source (ninja/gcc/CUDA-toolkit mismatches).",
        )
    else:
        try:
            mod = importlib.import_module("flash_attn")
            found = Finding("flash-attn package", "ok", f"importable, version {getattr(mod, '__version__', '?')}")
        except Exception as err:
            found = Finding(
                "flash-attn package",
                "warn",
                f"installed but fails to import: {_first_line(err)}",
                "Its binary does not match this torch/CUDA/Python: reinstall the wheel built for "
                f"torch {torch.__version__.split('+')[0]}, or uninstall it and use attnlab's SDPA backend.",
            )
        yield found

    cached = cached_compile() if compile_check and not recheck else None
    if cached is not None:
        yield Finding(
            "torch.compile",
            "ok",
            f"works (remembered: {cached.get('seconds')} s on {cached.get('when')}; --recheck-compile)",
            "",
        )
    elif compile_check:
        announce("torch.compile", "running (compiles a tiny function) ...")
        start = time.perf_counter()
        ok, why = try_compile()
        took = time.perf_counter() - start
        if ok:
            remember_compile(took)
        yield Finding(
            "torch.compile",
            "ok" if ok else "warn",
            f"works ({took:.1f} s for a tiny function)" if ok else f"fails: {why}",
            ""
            if ok
            else "Install a C++ compiler (e.g. apt-get install g++) for inductor, or run "
            "eager: attnlab does not need torch.compile.",
        )

    from ..quant import kernel_status
    from ..quant.kernel_build import checks
    from ..quant.kernels import _build_dir
    from ..weight_files.precision import GGUF_SPEEDUP

    for topic, seen, problem in checks(_build_dir()):  # what a build of the kernels needs, each named
        yield Finding(
            topic,
            "ok" if problem is None else "warn",
            seen if problem is None else problem.cause,
            "" if problem is None else problem.fix[0].upper() + problem.fix[1:] + ".",
        )
    status = kernel_status()  # builds them if this environment has not yet (about 20 s, said on stderr)
    yield Finding(
        "quantized kernels",
        "ok" if status.available else "warn",
        status.describe()
        .removeprefix("attnlab's quantized kernels: ")
        .removeprefix("attnlab's quantized kernels are not in use: "),
        ""
        if status.available
        else f"dtype='gguf' models run the slower pure-PyTorch path (about {GGUF_SPEEDUP:.0f}x slower); {status.fix}.",
    )

    ok, why = try_attnlab()
    yield Finding(
        "attnlab",
        "ok" if ok else "fail",
        "forward+backward runs; math and sdpa agree" if ok else why,
        ""
        if ok
        else f"Reinstall with the pinned torch: pip install torch=={torch.__version__.split('+')[0]}, "
        "then pip install -e . (make test does both).",
    )


def doctor(compile: bool = True, recheck_compile: bool = False) -> int:
    """Report Python, torch build, devices, the SDPA kernels that actually run here, flash-attn,
    torch.compile and attnlab itself, with a fix for each problem. Exit code 1 if attnlab cannot run.

    Args:
        compile: probe torch.compile (seconds; a minute on a cold GPU machine), once per torch build and machine: a success is remembered in ~/.cache/attnlab/doctor.json; --no-compile skips it.
        recheck_compile: probe torch.compile again even if a success is remembered.
    """
    live = sys.stdout.isatty()  # on a terminal the "running" line is replaced by the finding
    columns = max(60, shutil.get_terminal_size((80, 24)).columns)
    width = max(len("flash-attn package"), *(len(f"sdpa memory-efficient @ {d}") for d in _devices()))
    indent = " " * (7 + width + 2)
    pending = False

    def show(text: str) -> None:
        nonlocal pending
        print(("\r\x1b[K" if pending else "") + text, flush=True)
        pending = False

    def announce(topic: str, what: str) -> None:
        nonlocal pending
        line = f"[ .. ] {topic.ljust(width)}  {what}"
        line = line if len(line) < columns else line[: columns - 5] + " ..."
        if live:
            print(line, end="", flush=True)
            pending = True
        else:
            show(line)

    failed = 0
    try:
        for f in iter_findings(compile_check=compile, recheck=recheck_compile, announce=announce):
            line = f"[{f.status:>4}] {f.topic.ljust(width)}  {f.detail}"
            show(textwrap.fill(line, columns, subsequent_indent=indent, break_on_hyphens=False))
            if f.fix:  # under the status, not the detail: a fix is prose and needs the width
                fix = f"fix: {f.fix}"
                print(
                    textwrap.fill(
                        fix, columns, initial_indent=" " * 7, subsequent_indent=" " * 12, break_on_hyphens=False
                    )
                )
            failed += f.status == "fail"
    finally:
        if pending:  # interrupted during a "running" line: end it, so that what follows starts a line of its own
            print(flush=True)
    print("\nattnlab can run here." if not failed else f"\nattnlab cannot run here: {failed} problem(s) above.")
    return 1 if failed else 0
