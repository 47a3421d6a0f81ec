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


def _time(fn: Callable[[int], torch.Tensor], n: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = fn(n)
    return time.perf_counter() - start, out


def bench_decode(
    contexts: tuple[int, ...] = (64, 128, 256, 512, 1024),
    new_tokens: int = 32,
    recompute_new_tokens: int = 6,
    repeats: int = 5,
    n_layer: int = 4,
    n_head: int = 8,
    n_embd: int = 256,
    vocab_size: int = 50257,
    hf: bool = True,
    compile: bool = False,
    threads: int | None = None,
    out_dir: Path = Path("bench_results"),
    seed: int = 0,
) -> int:
    """Measure greedy decode ms/token and tokens/s per context length; print a Markdown table, write JSON.

    Args:
        contexts: prompt lengths to measure.
        new_tokens: tokens generated per cached run (HF and attnlab with cache).
        recompute_new_tokens: tokens generated per recompute run (each costs a full forward).
        repeats: timed repeats per runner and context (after one warm-up); medians are reported.
        n_layer: blocks of the benchmark model.
        n_head: heads of the benchmark model.
        n_embd: width of the benchmark model.
        vocab_size: 50257 (GPT-2's) so that the output projection has its real cost.
        hf: also run Hugging Face GPT2LMHeadModel.generate on the same weights (needs transformers).
        compile: also run attnlab's cached decode with the step under torch.compile(fullgraph=True).
        threads: torch.set_num_threads (default: torch's choice).
        out_dir: where decode.json is written.
        seed: seed of the random weights and prompts.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    block_size = max(contexts) + max(new_tokens, recompute_new_tokens)
    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    model = TinyGPT(config).eval()

    runners: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], int]] = {
        "attnlab cache": (lambda idx, n: generate(model, idx, n, temperature=0), new_tokens),
        "attnlab recompute": (
            lambda idx, n: generate(model, idx, n, temperature=0, use_cache=False),
            recompute_new_tokens,
        ),
    }
    if compile:
        runners["attnlab cache+compile"] = (
            lambda idx, n: generate(model, idx, n, temperature=0, compile=True),
            new_tokens,
        )
    if hf:
        from ..models.hf_gpt2 import to_hf_gpt2

        hf_model = to_hf_gpt2(model)

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

        runners["HF generate"] = (hf_generate, new_tokens)

    results: list[dict[str, Any]] = []  # one JSON row per context
    print(
        f"# decode benchmark: GPT-2 shape n_layer={n_layer} n_head={n_head} n_embd={n_embd} vocab={vocab_size}, "
        f"{model.num_params() / 1e6:.1f}M params, float32, batch 1, greedy; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}"
    )
    print(f"# KV cache: {model.kv_cache_bytes_per_token} bytes/token for the whole model")
    for ctx in contexts:
        idx = torch.randint(0, vocab_size, (1, ctx), generator=torch.Generator().manual_seed(seed + ctx))
        times: dict[str, dict[int, list[float]]] = {name: {1: [], n: []} for name, (_, n) in runners.items()}
        outs: dict[str, torch.Tensor] = {}
        compile_s = None
        for name, (fn, _n) in runners.items():  # warm-up (and, for compile, the compilation itself)
            t, _ = _time(partial(fn, idx), 2)
            if name == "attnlab cache+compile":
                compile_s = t
        for _ in range(repeats):
            for name, (fn, n) in runners.items():  # interleaved, so that drift hits every runner alike
                for k in (1, n):
                    t, out = _time(partial(fn, idx), k)
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
        step_bytes = model.num_params() * 4 + ctx * model.kv_cache_bytes_per_token
        row["cache_GB_per_s"] = step_bytes / (row["attnlab cache"]["ms_per_token"] * 1e-3) / 1e9
        ref = outs["attnlab cache"]
        row["same_tokens"] = {
            name: bool(torch.equal(out[:, : ref.size(1)], ref[:, : out.size(1)])) for name, out in outs.items()
        }
        if compile_s is not None:
            row["compile_warmup_s"] = compile_s
        results.append(row)

    names = list(runners)
    header = (
        "| context | "
        + " | ".join(f"{n} ms/tok (tok/s)" for n in names)
        + " | cache / recompute | cache GB/s |"
        + (" attnlab / HF |" if hf else "")
    )
    print()
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for row in results:
        cells = [f"{row[n]['ms_per_token']:.2f} ({row[n]['tokens_per_s']:.0f})" for n in names]
        speedup = row["attnlab cache"]["tokens_per_s"] / row["attnlab recompute"]["tokens_per_s"]
        line = f"| {row['context']} | " + " | ".join(cells) + f" | {speedup:.1f}x | {row['cache_GB_per_s']:.1f} |"
        if hf:
            line += f" {row['attnlab cache']['tokens_per_s'] / row['HF generate']['tokens_per_s']:.2f}x |"
        print(line)
    mismatched = sorted({n for row in results for n, same in row["same_tokens"].items() if not same})
    print(f"\ngreedy tokens identical across runners: {'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "config": vars(config)
        | {"params": model.num_params(), "kv_cache_bytes_per_token": model.kv_cache_bytes_per_token},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "repeats": repeats,
        "results": results,
    }
    (out_dir / "decode.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_dir / 'decode.json'}")
    return 0
