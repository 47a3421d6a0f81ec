"""``attnlab bench-decode``: greedy decode speed against context length, cache vs recompute vs HF.

One GPT-2-shaped model is shared by every runner: attnlab with the KV cache (eager, and the
compiled decode step with ``--compile``), attnlab recomputing the whole prefix for every token,
and Hugging Face ``GPT2LMHeadModel.generate`` on the same weights (via
:func:`attnlab.models.hf_gpt2.to_hf_gpt2`). Each runner generates ``n`` tokens and 1 token from the
same prompt; the per-token decode latency is ``(t(n) - t(1)) / (n - 1)``, which removes the
prefill from every runner alike. Runners are interleaved inside each repeat; medians are reported.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from ..models.generation import generate
from ..models.gpt import GPTConfig, TinyGPT
from ..runtime import UsageError, check_range, check_writable_dir, resolve_device, resolve_dtype
from .table import aligned, terminal_width, wrap


def _time(fn: Callable[[int], torch.Tensor], n: int, device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn(n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def _validate(
    contexts: tuple[int, ...],
    max_new_tokens: int,
    recompute_max_new_tokens: int,
    repeats: int,
    num_layers: int,
    num_heads: int,
    embed_dim: int,
    vocab_size: int,
    threads: int | None,
) -> None:
    """Every number checked before the model is built; raises :class:`UsageError`."""
    if not contexts:
        raise UsageError("--contexts got no length; pass prompt lengths, e.g. --contexts 64 256 1024.")
    for ctx in contexts:
        check_range("--contexts", ctx, low=1, integer=True, hint="each is a prompt length, e.g. --contexts 64 256")
    # The latency is (t(n) - t(1)) / (n - 1): the prefill cancels out only with a second generated token.
    why_two = "the per-token latency is (t(n) - t(1)) / (n - 1), which needs n >= 2"
    check_range("--max-new-tokens", max_new_tokens, low=2, integer=True, hint=f"{why_two}; pass --max-new-tokens 2")
    check_range(
        "--recompute-max-new-tokens",
        recompute_max_new_tokens,
        low=2,
        integer=True,
        hint=f"{why_two}; pass --recompute-max-new-tokens 2",
    )
    check_range("--repeats", repeats, low=1, integer=True, hint="the median of the timed repeats is reported")
    check_range("--num-layers", num_layers, low=1, integer=True)
    check_range("--num-heads", num_heads, low=1, integer=True)
    check_range("--embed-dim", embed_dim, low=1, integer=True)
    if embed_dim % num_heads:
        divisors = [h for h in range(1, embed_dim + 1) if embed_dim % h == 0]
        nearest = sorted(sorted(divisors, key=lambda h: abs(h - num_heads))[:2])
        raise UsageError(
            f"--embed-dim {embed_dim} is not divisible by --num-heads {num_heads}; "
            f"pass --num-heads among its divisors (nearest: {nearest})."
        )
    check_range("--vocab-size", vocab_size, low=2, integer=True, hint="GPT-2's is 50257")
    if threads is not None:
        check_range("--threads", threads, low=1, integer=True, hint="or leave it out for torch's choice")


def bench_decode(
    contexts: tuple[int, ...] = (64, 128, 256, 512, 1024),
    max_new_tokens: int = 32,
    recompute_max_new_tokens: int = 6,
    repeats: int = 5,
    num_layers: int = 4,
    num_heads: int = 8,
    embed_dim: int = 256,
    vocab_size: int = 50257,
    hf: bool = True,
    compile: bool = False,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    out_dir: Path = Path("bench_results"),
    seed: int = 0,
) -> int:
    """Measure greedy decode ms/token and tokens/s per context length; print a table, write JSON and Markdown.

    Args:
        contexts: prompt lengths to measure.
        max_new_tokens: tokens generated per cached run (HF and attnlab with cache); >= 2.
        recompute_max_new_tokens: tokens generated per recompute run (each costs a full forward); >= 2.
        repeats: timed repeats per runner and context (after one warm-up); medians are reported.
        num_layers: blocks of the benchmark model.
        num_heads: heads of the benchmark model.
        embed_dim: width of the benchmark model.
        vocab_size: 50257 (GPT-2's) so that the output projection has its real cost.
        hf: also run Hugging Face GPT2LMHeadModel.generate on the same weights (needs transformers).
        compile: also run attnlab's cached decode with the step under torch.compile(fullgraph=True).
        device: auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.
        dtype: auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64).
        threads: torch.set_num_threads (default: torch's choice).
        out_dir: where decode.json and decode.md are written (checked writable before anything runs).
        seed: seed of the random weights and prompts.
    """
    _validate(
        contexts,
        max_new_tokens,
        recompute_max_new_tokens,
        repeats,
        num_layers,
        num_heads,
        embed_dim,
        vocab_size,
        threads,
    )
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    out_dir = check_writable_dir(out_dir, "--out-dir")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    block_size = max(contexts) + max(max_new_tokens, recompute_max_new_tokens)
    config = GPTConfig(
        vocab_size=vocab_size, block_size=block_size, n_layer=num_layers, n_head=num_heads, n_embd=embed_dim
    )
    model = TinyGPT(config).to(device=dev, dtype=dt).eval()

    runners: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], int]] = {
        "attnlab cache": (lambda idx, n: generate(model, idx, n, temperature=0), max_new_tokens),
        "attnlab recompute": (
            lambda idx, n: generate(model, idx, n, temperature=0, use_cache=False),
            recompute_max_new_tokens,
        ),
    }
    if compile:
        runners["attnlab cache+compile"] = (
            lambda idx, n: generate(model, idx, n, temperature=0, compile=True),
            max_new_tokens,
        )
    if hf:
        from ..models.hf_gpt2 import to_hf_gpt2

        hf_model = to_hf_gpt2(model)
        cast(torch.nn.Module, hf_model).to(device=dev, dtype=dt)  # in place; HF wraps .to in a decorator mypy misreads

        def hf_generate(idx: torch.Tensor, n: int) -> torch.Tensor:
            with torch.no_grad():
                out = hf_model.generate(
                    idx,
                    attention_mask=torch.ones_like(idx),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    use_cache=True,
                    pad_token_id=0,
                )
            return cast(torch.Tensor, out)  # token ids: return_dict_in_generate is off

        runners["HF generate"] = (hf_generate, max_new_tokens)

    width = terminal_width()
    dtype_name = str(dt).removeprefix("torch.")
    results: list[dict[str, Any]] = []  # one JSON row per context
    title = (
        f"decode benchmark: GPT-2 shape (layers {num_layers}, heads {num_heads}, width {embed_dim}, "
        f"vocab {vocab_size}; {model.num_params() / 1e6:.1f}M params), {dev} {dtype_name}, batch 1, greedy\n"
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
        f"KV cache {model.kv_cache_bytes_per_token} bytes/token for the whole model"
    )
    print(wrap(title, width), flush=True)
    for ctx in contexts:
        idx = torch.randint(0, vocab_size, (1, ctx), generator=torch.Generator().manual_seed(seed + ctx)).to(dev)
        times: dict[str, dict[int, list[float]]] = {name: {1: [], n: []} for name, (_, n) in runners.items()}
        outs: dict[str, torch.Tensor] = {}
        compile_s = None
        for name, (fn, _n) in runners.items():  # warm-up (and, for compile, the compilation itself)
            t, _ = _time(partial(fn, idx), 2, dev)
            if name == "attnlab cache+compile":
                compile_s = t
        for _ in range(repeats):
            for name, (fn, n) in runners.items():  # interleaved, so that drift hits every runner alike
                for k in (1, n):
                    t, out = _time(partial(fn, idx), k, dev)
                    times[name][k].append(t)
                    outs[name] = out
        row: dict[str, Any] = {"context": ctx}
        for name, (_, n) in runners.items():
            t1, tn = statistics.median(times[name][1]), statistics.median(times[name][n])
            per_token = (tn - t1) / (n - 1)
            row[name] = {
                "ms_per_token": 1e3 * per_token,
                "tokens_per_s": 1.0 / per_token,
                "prefill_ms": 1e3 * t1,
                "new_tokens": n,
            }
        # A decode step reads every weight once plus the cached K/V of the context: its memory traffic.
        step_bytes = model.num_params() * dt.itemsize + ctx * model.kv_cache_bytes_per_token
        row["cache_GB_per_s"] = step_bytes / (row["attnlab cache"]["ms_per_token"] * 1e-3) / 1e9
        ref = outs["attnlab cache"]
        row["same_tokens"] = {
            name: bool(torch.equal(out[:, : ref.size(1)], ref[:, : out.size(1)])) for name, out in outs.items()
        }
        if compile_s is not None:
            row["compile_warmup_s"] = compile_s
        results.append(row)
        print(f"context {ctx}: done", flush=True)

    names = list(runners)
    mismatched = sorted({n for row in results for n, same in row["same_tokens"].items() if not same})
    same = f"greedy tokens identical across runners: {'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)}"
    report = {
        "config": vars(config)
        | {"params": model.num_params(), "kv_cache_bytes_per_token": model.kv_cache_bytes_per_token},
        "device": str(dev),
        "dtype": dtype_name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "repeats": repeats,
        "results": results,
    }
    (out_dir / "decode.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "decode.md").write_text(_markdown(results, names, hf) + "\n\n" + same + "\n")
    print()
    print(_compact(results, names, hf))
    print(f"\n{same}")
    print(wrap(f"wrote {out_dir / 'decode.json'} and {out_dir / 'decode.md'} (every column, tokens/s too)", width))
    return 0


_SHORT = {
    "attnlab cache": "cache",
    "attnlab recompute": "recompute",
    "attnlab cache+compile": "compiled",
    "HF generate": "HF",
}


def _compact(results: list[dict[str, Any]], names: list[str], hf: bool) -> str:
    """The table for a terminal (fits 80 columns): ms per token only; tokens/s = 1000 / ms."""
    header = ("context", *(_SHORT[n] for n in names), "speedup", "GB/s", *(("vs HF",) if hf else ()))
    rows = []
    for row in results:
        speedup = row["attnlab cache"]["tokens_per_s"] / row["attnlab recompute"]["tokens_per_s"]
        cells = [str(row["context"]), *(f"{row[n]['ms_per_token']:.2f}" for n in names)]
        cells += [f"{speedup:.1f}x", f"{row['cache_GB_per_s']:.1f}"]
        if hf:
            cells.append(f"{row['attnlab cache']['tokens_per_s'] / row['HF generate']['tokens_per_s']:.2f}x")
        rows.append(cells)
    lines = aligned(header, rows, right=[True] * len(header))
    legend = (
        "ms per generated token; speedup: cache's tokens/s over recompute's; vs HF: cache's over HF generate's; "
        "GB/s: weights and cached K/V read per cached step"
    )
    return wrap(legend) + "\n" + "\n".join(lines)


def _markdown(results: list[dict[str, Any]], names: list[str], hf: bool) -> str:
    """Every column, as in the README: ms/token and tokens/s for each runner."""
    header = (
        "| context | "
        + " | ".join(f"{n} ms/tok (tok/s)" for n in names)
        + " | cache / recompute | cache GB/s |"
        + (" attnlab / HF |" if hf else "")
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in results:
        cells = [f"{row[n]['ms_per_token']:.2f} ({row[n]['tokens_per_s']:.0f})" for n in names]
        speedup = row["attnlab cache"]["tokens_per_s"] / row["attnlab recompute"]["tokens_per_s"]
        line = f"| {row['context']} | " + " | ".join(cells) + f" | {speedup:.1f}x | {row['cache_GB_per_s']:.1f} |"
        if hf:
            line += f" {row['attnlab cache']['tokens_per_s'] / row['HF generate']['tokens_per_s']:.2f}x |"
        lines.append(line)
    return "\n".join(lines)
