"""Everything attnlab checks on a GPU, in one run of at most 10 minutes: the device test suite and every GPU figure
attnlab reports (README, docs/howto/gpu.md).

    python scripts/gpu_check.py --out "$OUT"            # on a GPU machine: writes *.md / *.json there
    python scripts/gpu_check.py --out /tmp/g --smoke    # the same steps at toy sizes, on any device (tested on CPU)

Steps (each bounded by its own timeout and by what is left of --deadline, each writing its own files, so that a
step that fails or runs out of time leaves the others' results and a line in summary.md), the most needed first:

1. ``env``: device, torch, CUDA, and a copy bandwidth (``dst.copy_(src)`` on 1 GiB, reads + writes).
2. ``suite``: the device-parametrised test files (:data:`SUITE_FILES`) with ``ATTNLAB_TEST_DEVICE`` set to the
   device, on 8 pytest workers: ``suite.md`` (counts per file, every failure with its first line) and the junit XML.
3. ``attention``: ``attnlab bench`` at GPU sizes (bf16, E=2048, H=16, 65,536 tokens a batch, causal,
   fwd+bwd): attnlab auto vs the bare SDPA floor vs ``nn.MultiheadAttention``, with peak memory.
4. ``decode``: a GPT-2-small-shaped TinyGPT (124M, bf16, prompt 128): attnlab eager, compiled
   (CUDA graphs) and HF ``generate``, ms per token (``attnlab bench-decode``).
5. ``kernels``: the compiled decode step of a GPT-2-small and a SmolLM2-135M shape (bf16, batch 1 and 8): kernels
   per step and their GPU time (profiler), ms per step in a loop, bytes read and the share of the bandwidth floor.
6. ``window``: ``attnlab bench --variant window`` at T = 8192 and 32768.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The test files whose tests take the `device` fixture (tests/conftest.py): run on the GPU.
DEVICE_FILES = (
    "test_torch_parity.py",
    "test_backends.py",
    "test_module.py",
    "test_kv_cache.py",
    "test_generate.py",
    "test_check.py",
    "test_compat_mha.py",
    "test_variants.py",
    "test_masks.py",
    "test_numerics.py",
)
# Files that run on the CPU wherever they run, listed for the GPU machine's torch release (2.11 on the H200, where CI
# has 2.13): its dynamo and inductor on attnlab's compiled paths, the CPU models of its kernels, and the GPU-only
# branches driven through their device checks.
RELEASE_FILES = ("test_compile.py", "test_flex.py", "test_kernel_models.py", "test_gpu_paths.py")
SUITE_FILES = DEVICE_FILES + RELEASE_FILES
SMOKE_FILES = ("test_masks.py",)


def _run_cli(args: list[str]) -> str:
    from attnlab.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(args)
    if code:
        raise RuntimeError(f"attnlab {' '.join(args)} exited {code}:\n{out.getvalue()[-2000:]}")
    return out.getvalue()


def step_env(out: Path, smoke: bool, device: str) -> str:
    import torch

    n = (1 << 20) if smoke else (1 << 28)  # float32 elements: 4 MiB or 1 GiB
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    gbps = 2 * n * 4 / min(times) / 1e9
    env = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_GB_per_s": round(gbps, 1),
    }
    (out / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    return f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, copy {gbps:.0f} GB/s"


def step_suite(out: Path, smoke: bool, device: str) -> str:
    """The device suite in a pytest subprocess (8 workers on a GPU machine, 1 in a smoke run), its results read
    back from the junit XML into ``suite.md``."""
    files = [f for f in (SMOKE_FILES if smoke else SUITE_FILES) if (REPO / "tests" / f).is_file()]
    xml = out / "suite.xml"
    workers = ["-n", "1"] if smoke else ["-n", "8"]
    env = {**os.environ, "ATTNLAB_TEST_DEVICE": device, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", *workers, "-p", "no:cacheprovider", f"--junitxml={xml}"]
    run = subprocess.run([*cmd, *(f"tests/{f}" for f in files)], cwd=REPO, env=env, capture_output=True, text=True)
    (out / "suite.log").write_text(run.stdout[-200_000:] + run.stderr[-50_000:])
    if not xml.is_file():
        raise RuntimeError(f"pytest wrote no junit XML (exit code {run.returncode}): {run.stdout[-500:]}")
    table, summary = suite_table(xml, device)
    (out / "suite.md").write_text(table)
    return summary


def suite_table(xml: Path, device: str) -> tuple[str, str]:
    """``(markdown, one line)`` of a pytest junit XML: passed / failed / skipped per test file, then every failure
    and error with the first line of its message."""
    per_file: dict[str, dict[str, int]] = {}
    failures: list[str] = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")[-1] + ".py"
        counts = per_file.setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            first = (bad.get("message") or "").strip().splitlines()
            failures.append(f"- `{name}::{case.get('name')}`: {first[0][:300] if first else ''}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    total = {k: sum(c[k] for c in per_file.values()) for k in ("passed", "failed", "skipped")}
    lines = [f"# The device suite on {device}", "", "| file | passed | failed | skipped |", "|---|---:|---:|---:|"]
    lines += [f"| {f} | {c['passed']} | {c['failed']} | {c['skipped']} |" for f, c in sorted(per_file.items())]
    lines += [f"| **all** | {total['passed']} | {total['failed']} | {total['skipped']} |", ""]
    if failures:
        lines += ["## Failures", "", *failures, ""]
    return "\n".join(lines), f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped"


def step_attention(out: Path, smoke: bool, device: str) -> str:
    sizes = ["--embed-dim", "64", "--num-heads", "4", "--tokens", "512", "--lengths", "64", "128"] if smoke else [
        "--embed-dim", "2048", "--num-heads", "16", "--tokens", "65536", "--lengths", "1024", "4096", "8192", "16384"
    ]  # fmt: skip
    dtype = "float32" if device == "cpu" else "bfloat16"
    args = ["bench", "--device", device, "--dtype", dtype, *sizes, "--runners", "attnlab", "floor", "torch-mha"]
    _run_cli([*args, "--repeats", "2" if smoke else "5", "--out-dir", str(out / "attention")])
    return "attention/bench_attention.md"


def step_decode(out: Path, smoke: bool, device: str) -> str:
    size = ["--embed-dim", "64", "--num-layers", "2", "--num-heads", "4", "--contexts", "16"] if smoke else [
        "--embed-dim", "768", "--num-layers", "12", "--num-heads", "12", "--contexts", "128"
    ]  # fmt: skip
    dtype = "float32" if device == "cpu" else "bfloat16"
    args = [
        "bench-decode",
        "--device",
        device,
        "--dtype",
        dtype,
        *size,
        "--compile",
        "--repeats",
        "2" if smoke else "5",
    ]
    _run_cli([*args, "--max-new-tokens", "8" if smoke else "64", "--out-dir", str(out / "decode")])
    return "decode/decode.md"


def _copy_bandwidth(device: str) -> float:
    """Bytes per second of ``dst.copy_(src)`` on 256 MiB (reads + writes), the floor's yardstick."""
    import torch

    n = (8 if device == "cpu" else 256) * 2**20 // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_kernels(out: Path, smoke: bool, device: str) -> str:
    """The decode step's structure and speed, per model shape and batch: kernels per step, GPU time per step,
    ms per step in a loop of 50, bytes read per step and the share of the bandwidth floor (issue 42)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from attnlab import GPTConfig, Llama, LlamaConfig, TinyGPT
    from attnlab.models import generation

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if smoke:
        shapes = {
            "gpt2-small": TinyGPT(GPTConfig(vocab_size=512, block_size=256, n_embd=64, n_layer=2, n_head=4)),
            "smollm2-135m": Llama(LlamaConfig(vocab_size=512, block_size=256, n_layer=2, n_embd=64, n_head=4,
                                              n_kv_head=2, intermediate_size=96)),
        }  # fmt: skip
    else:
        shapes = {
            "gpt2-small": TinyGPT(GPTConfig(vocab_size=50257, block_size=1024, n_embd=768, n_layer=12, n_head=12)),
            "smollm2-135m": Llama(LlamaConfig()),  # 30 layers, GQA 9/3, E 576, SwiGLU 1536, RMSNorm, RoPE
        }
    bandwidth = _copy_bandwidth(device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    activity = [ProfilerActivity.CUDA] if kind == "cuda" else [ProfilerActivity.CPU]
    S, context = 256, 128  # cache slots, tokens already in it
    rows: list[dict[str, Any]] = []
    for name, model in shapes.items():
        model = model.to(device, dtype).eval()
        skipped = model.fuse_projections()  # what generate(compile=True) does: Q|K|V and gate|up as one GEMM each
        step = generation.compiled_decode_step(torch.device(device))
        weight_bytes = model.weight_bytes()
        for B in (1, 8):
            caches = model.setup_caches(B, S)
            tok = torch.zeros(B, 1, dtype=torch.long, device=device)
            pos = torch.full((B, 1), context, dtype=torch.long, device=device)
            slot = torch.tensor([context], device=device)
            pad = torch.zeros(B, S, dtype=torch.bool, device=device)
            with torch.no_grad():
                for _ in range(3):  # compilation, graph capture
                    step(model, tok, pos, slot, pad, caches)
                _sync(device)
                with profile(activities=activity) as prof:
                    step(model, tok, pos, slot, pad, caches)
                    _sync(device)
                events = [e for e in prof.events() if str(getattr(e, "device_type", "")).lower().endswith(kind)]
                busy = sum(float(getattr(e, "self_device_time_total", 0.0) or 0.0) for e in events)
                n = 5 if smoke else 50
                _sync(device)
                t = time.perf_counter()
                for _ in range(n):
                    step(model, tok, pos, slot, pad, caches)
                _sync(device)
                ms = (time.perf_counter() - t) / n * 1e3
            # bytes a step must read: every weight once, and the K/V of every slot attended (all S: position mode)
            cache_bytes = B * model.kv_cache_bytes_per_token * S
            read = weight_bytes + cache_bytes
            floor_ms = read / bandwidth * 1e3
            rows.append(
                {
                    "model": name, "batch": B, "kernels_per_step": len(events), "gpu_us_per_step": busy,
                    "ms_per_step": ms, "bytes_read": read, "floor_ms": floor_ms, "of_floor": floor_ms / ms,
                    "unfused": skipped,
                }
            )  # fmt: skip
    what = "kernels" if kind == "cuda" else "CPU ops"
    lines = [
        f"Decode step, compiled, {dtype}, cache of {S} slots with {context} tokens, copy bandwidth "
        f"{bandwidth / 1e9:.2f} GB/s ({device}):",
        "",
        f"| model | batch | {what} per step | device us per step | ms per step | MB read | floor ms | of floor |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['kernels_per_step']} | {r['gpu_us_per_step']:.0f} | "
            f"{r['ms_per_step']:.3f} | {r['bytes_read'] / 1e6:.1f} | {r['floor_ms']:.3f} | {r['of_floor']:.0%} |"
        )
    (out / "kernels.md").write_text("\n".join(lines) + "\n")
    (out / "kernels.json").write_text(json.dumps({"bandwidth": bandwidth, "rows": rows}, indent=2) + "\n")
    return "; ".join(
        f"{r['model']} b{r['batch']}: {r['kernels_per_step']} {what}, {r['ms_per_step']:.3f} ms" for r in rows
    )


def step_window(out: Path, smoke: bool, device: str) -> str:
    lengths = ["256", "512"] if smoke else ["8192", "32768"]
    window = "32" if smoke else "256"
    args = ["bench", "--variant", "window", "--window", window, "--device", device, "--lengths", *lengths]
    # the GPU figures: H=16, D=64; dense-mask fwd+bwd up to the longest length (60 ms there on an H200)
    args += ["--embed-dim", "64", "--num-heads", "4"] if smoke else ["--embed-dim", "1024", "--num-heads", "16"]
    args += ["--math-max-len", lengths[-1]]
    _run_cli([*args, "--out-dir", str(out / "window")])
    return "window/"


STEPS = {
    "env": step_env,
    "suite": step_suite,
    "window": step_window,
    "attention": step_attention,
    "decode": step_decode,
    "kernels": step_kernels,
}
# Seconds each step may take at most on a GPU machine (the suite ran 92 s on 8 workers on the H200).
STEP_TIMEOUTS = {"env": 30, "suite": 240, "window": 120, "attention": 120, "decode": 120, "kernels": 150}


def _kill_tree(proc: Any) -> None:
    """Kill a step's process and what it started (the suite's pytest and its workers)."""
    try:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
    except Exception:  # psutil missing or the processes gone: the step's own process is killed below
        pass
    proc.kill()


def _child(name: str, out: str, smoke: bool, device: str, queue: Any) -> None:
    try:
        queue.put(("ok", STEPS[name](Path(out), smoke, device)))
    except BaseException as err:  # reported in summary.md, never lost
        queue.put(("failed", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the tables and summary.md")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: check the script itself on any device")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--steps", nargs="*", default=list(STEPS), choices=list(STEPS))
    parser.add_argument(
        "--step-timeout", type=float, default=None, help="seconds each step may take (default: per step)"
    )
    parser.add_argument("--deadline", type=float, default=570.0, help="seconds the whole run may take (default 570)")
    args = parser.parse_args()
    began = time.perf_counter()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# attnlab on {device}", ""]
    ctx = mp.get_context("spawn")  # a fresh process per step: a hung step is killed without the others
    for name in args.steps:
        start = time.perf_counter()
        left = args.deadline - (start - began)
        timeout = min(args.step_timeout or STEP_TIMEOUTS[name], left)
        if timeout < 10:
            line = f"- {name}: not run: {left:.0f} s of the --deadline left"
            print(line, flush=True)
            lines.append(line)
            continue
        queue = ctx.Queue()
        proc = ctx.Process(target=_child, args=(name, str(args.out), args.smoke, device, queue))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            _kill_tree(proc)
            status, what = "timeout", f"stopped after {timeout:.0f} s"
        else:
            status, what = queue.get() if not queue.empty() else ("failed", f"exit code {proc.exitcode}")
        line = f"- {name}: {status} in {time.perf_counter() - start:.0f} s: {what}"
        print(line, flush=True)
        lines.append(line)
        (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
