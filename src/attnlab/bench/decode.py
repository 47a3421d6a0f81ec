"""``attnlab bench-decode``: greedy decode speed against context length, cache vs recompute vs HF.

One GPT-2-shaped model is shared by every runner: attnlab with the KV cache (eager, and the
compiled decode step with ``--compile``), attnlab recomputing the whole prefix for every token,
and Hugging Face ``GPT2LMHeadModel.generate`` on the same weights (via
:func:`attnlab.weight_files.hf_gpt2.to_hf_gpt2`). Each runner generates ``n`` tokens and 1 token from the
same prompt; the per-token decode latency is ``(t(n) - t(1)) / (n - 1)``, which removes the
prefill from every runner alike. Runners are interleaved inside each repeat; medians are reported.
"""

from __future__ import annotations

import copy
import json
import platform
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from ..core.kv_cache import kv_values_per_position, resolve_kv_dtype
from ..models.generation import generate
from ..models.gpt import GPTConfig, TinyGPT
from ..runtime import (
    INTERRUPTS,
    LimitError,
    UsageError,
    atomic_write_text,
    check_fits,
    check_range,
    check_writable_dir,
    cpu_info,
    gib,
    import_advice,
    interrupt_exit,
    keep,
    resolve_device,
    resolve_dtype,
)
from ..weight_files.file_checks import gpt_weight_count
from ..weight_files.gguf import open_gguf
from ..weight_files.precision import choose_weights, is_gguf_source, parse_weights, weights_name
from .decode_lengths import bench_decode_lengths, gguf_source, parse_lengths
from .decode_mla import DEFAULT_MLA_CONFIG, MLABenchConfig, bench_decode_mla
from .llama_cpp import llama_cpp_runner as _llama_cpp_runner  # tests stand in for it here
from .output import check_room, save_png
from .table import aligned, terminal_width, wrap
from .timing import copy_bandwidth
from .timing import timed as _time  # a module name of its own here: tests stand in for it


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
    model: str | None = None,
    batch_sizes: tuple[int, ...] = (1, 8),
    prompt_len: int = 32,
    prompt_lengths: tuple[str, ...] = (),
    contexts: tuple[int, ...] = (64, 128, 256, 512, 1024),
    max_new_tokens: int | None = None,
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
    mla: bool = False,
    mla_config: MLABenchConfig = DEFAULT_MLA_CONFIG,
    llama_python: str | None = None,
    kv_dtype: str = "auto",
    batch_size: int = 1,
) -> int:
    """Measure greedy decode ms/token and tokens/s per context length; print a table, write JSON and Markdown.

    Without ``--model``: a random GPT-2-shaped TinyGPT against HF ``GPT2LMHeadModel`` on the same
    weights, batch 1, one row per prompt length (``--contexts``). With ``--model``: a real
    checkpoint (``smollm2``, a ``.gguf`` file or a Hugging Face directory) loaded once by attnlab
    and once by HF ``AutoModelForCausalLM``, one row per dtype and batch size (``--batch-sizes``,
    prompt ``--prompt-len``): decode and prefill tokens/s and the share of the bandwidth limit,
    written to decode_model.json and decode_model.md.

    Args:
        model: a real model to measure: ``smollm2``, a ``.gguf`` path or a Hugging Face directory.
        batch_sizes: with --model, the batch sizes measured (rows of random prompt ids).
        prompt_len: with --model, the prompt length of every row.
        prompt_lengths: with --model (a GGUF file), instead one row per prompt length and runner, e.g.
            32,128,512,2048,7000: time to first token, prefill and decode tokens/s at that context, peak RSS and the
            share of the copy bandwidth a decode step reads, attnlab (the blocks as stored) against llama.cpp on the
            same file with flash attention off and on, each in a process of its own, alternated
            (:mod:`attnlab.bench.decode_lengths`); writes decode_lengths.json and .md. Takes --max-new-tokens
            (default 32), --repeats, --threads (default: auto, the decode's count chosen by timing steps),
            --kv-dtype (attnlab's cache, default auto as attnlab generate), --llama-python, --out-dir and --seed.
        llama_python: with --prompt-lengths, the Python interpreter whose llama_cpp runs llama.cpp (default: this one).
        batch_size: with --prompt-lengths, the prompts of each length decoded at once (default 1): attnlab's batched
            generate and llama.cpp's own multi-sequence batching (one context of that many sequences), greedy on
            each row; decode and prefill tokens/s then count all rows.
        contexts: prompt lengths to measure.
        max_new_tokens: tokens generated per cached run (HF and attnlab with cache); >= 2. Default
            32, and 128 with --model.
        recompute_max_new_tokens: tokens generated per recompute run (each costs a full forward); >= 2.
        repeats: timed repeats per runner and context (after one warm-up); medians are reported.
        num_layers: blocks of the benchmark model.
        num_heads: heads of the benchmark model.
        embed_dim: width of the benchmark model.
        vocab_size: 50257 (GPT-2's) so that the output projection has its real cost.
        hf: also run Hugging Face GPT2LMHeadModel.generate on the same weights (needs transformers).
        compile: also run attnlab's cached decode with the step under torch.compile(fullgraph=True);
            with --model also HF generate with a static cache and torch.compile (HF's fastest).
        device: auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.
        dtype: the weights, by the names every command takes: auto (float32 on cpu, bfloat16 on cuda;
            with --model both float32 and bfloat16 rows, and for a GGUF file on a CPU its blocks as stored
            and llama.cpp beside float32), gguf (with --model: only the blocks as stored and llama.cpp),
            float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64). One line says which ran and why.
        threads: torch.set_num_threads (default: torch's choice).
        out_dir: where decode.json and decode.md (decode_model.* with --model) are written
            (checked writable before anything runs).
        seed: seed of the random weights and prompts.
        mla: instead, one decode step of a multi-head latent attention model, naive and absorbed paths, beside a
            GQA model of the same width, and where the two paths cross (:mod:`attnlab.bench.decode_mla`); writes
            decode_mla.json and decode_mla.md. Takes --mla-config.*, --repeats, --threads, --device, --dtype,
            --out-dir and --seed.
        mla_config: with --mla, the models and cache lengths.
        kv_dtype: with --model, what the gguf runner's KV cache stores: auto (as attnlab generate: on a CPU
            with the fused decode step float16, int8 where the largest batch's cache would pass 32 MB), float32, float16, bfloat16 or int8 (see attnlab generate --kv-dtype).
    """
    try:
        resolve_kv_dtype(kv_dtype, torch.device("cpu"), fused=False)  # the name, checked before anything runs
    except ValueError as err:
        raise UsageError(str(err)) from None
    if kv_dtype != "auto" and model is None:
        raise UsageError(f"--kv-dtype {kv_dtype} sets the gguf runner's KV cache; pass it with --model (e.g. smollm2).")
    if batch_size != 1 and not prompt_lengths:
        raise UsageError(
            f"--batch-size {batch_size} sets the prompts each length decodes at once with --prompt-lengths; without it, "
            "pass --batch-sizes (e.g. --batch-sizes 1 8)."
        )
    if prompt_lengths:
        if model is None:
            raise UsageError("--prompt-lengths measures a GGUF model against llama.cpp: pass --model smollm2 with it.")
        lengths = parse_lengths(prompt_lengths)
        new = 32 if max_new_tokens is None else max_new_tokens
        return bench_decode_lengths(
            model, lengths, new, repeats, threads, out_dir, seed, llama_python, kv_dtype, batch_size
        )
    if mla:
        sweep_flags = {
            "--model": model is not None,
            "--batch-sizes": batch_sizes != (1, 8),
            "--prompt-len": prompt_len != 32,
            "--contexts": contexts != (64, 128, 256, 512, 1024),
            "--max-new-tokens": max_new_tokens is not None,
            "--recompute-max-new-tokens": recompute_max_new_tokens != 6,
            "--num-layers": num_layers != 4,
            "--num-heads": num_heads != 8,
            "--embed-dim": embed_dim != 256,
            "--vocab-size": vocab_size != 50257,
            "--no-hf": not hf,
            "--compile": compile,
        }
        given = [flag for flag, changed in sweep_flags.items() if changed]
        if given:
            raise UsageError(
                f"{', '.join(given)} shape(s) the GPT-2 sweep or --model runs, not --mla: drop {given[0]} "
                f"(the MLA model takes --mla-config.*, e.g. --mla-config.num-layers 2)."
            )
        return bench_decode_mla(
            mla_config, repeats=repeats, device=device, dtype=dtype, threads=threads, out_dir=out_dir, seed=seed,
            copy_bandwidth=copy_bandwidth, cpu_report=cpu_report,
        )  # fmt: skip
    if mla_config != DEFAULT_MLA_CONFIG:
        raise UsageError(
            "--mla-config.* flags shape the MLA benchmark; pass --mla with them (attnlab bench-decode --mla ...)."
        )
    if model is not None:
        return _bench_model_command(
            model, batch_sizes, prompt_len, contexts, max_new_tokens, recompute_max_new_tokens, repeats,
            num_layers, num_heads, embed_dim, vocab_size, hf, compile, device, dtype, threads, out_dir, seed, kv_dtype,
        )  # fmt: skip
    if batch_sizes != (1, 8) or prompt_len != 32:
        raise UsageError(
            "--batch-sizes and --prompt-len apply to --model runs; the GPT-2 sweep runs batch 1 at --contexts lengths."
        )
    max_new_tokens = 32 if max_new_tokens is None else max_new_tokens
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
    if parse_weights(dtype, "--dtype") == "gguf":
        raise UsageError(
            "--dtype gguf runs a GGUF file's blocks as stored, and the GPT-2 sweep's model is random float weights; "
            "pass --model smollm2 (or a .gguf file) with it, or a float --dtype such as float32."
        )
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    block_size = max(contexts) + max(max_new_tokens, recompute_max_new_tokens)
    config = GPTConfig(
        vocab_size=vocab_size, block_size=block_size, n_layer=num_layers, n_head=num_heads, n_embd=embed_dim
    )
    _check_sweep_fits(config, dt, hf, dev)  # before the model exists
    out_dir = check_writable_dir(out_dir, "--out-dir")
    check_room(out_dir, "bench-decode", "decode.json, decode.md")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    gpt = TinyGPT(config).to(device=dev, dtype=dt).eval()

    runners: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], int]] = {
        "attnlab cache": (lambda idx, n: generate(gpt, idx, n, temperature=0), max_new_tokens),
        "attnlab recompute": (
            lambda idx, n: generate(gpt, idx, n, temperature=0, use_cache=False),
            recompute_max_new_tokens,
        ),
    }
    if compile:
        runners["attnlab cache+compile"] = (
            lambda idx, n: generate(gpt, idx, n, temperature=0, compile=True),
            max_new_tokens,
        )
    if hf:
        from ..weight_files.hf_gpt2 import to_hf_gpt2

        hf_model = to_hf_gpt2(gpt)
        cast(torch.nn.Module, hf_model).to(device=dev, dtype=dt)  # in place; HF wraps .to in a decorator mypy misreads

        runners["HF generate"] = (_hf_runner(hf_model, best=False), max_new_tokens)

    width = terminal_width()
    dtype_name = str(dt).removeprefix("torch.")
    results: list[dict[str, Any]] = []  # one JSON row per context
    title = (
        f"decode benchmark: GPT-2 shape (layers {num_layers}, heads {num_heads}, width {embed_dim}, "
        f"vocab {vocab_size}; {gpt.num_params() / 1e6:.1f}M params), {dev} {dtype_name}, batch 1, greedy\n"
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
        f"KV cache {gpt.kv_cache_bytes_per_token} bytes/token for the whole model"
    )
    print(wrap(title, width), flush=True)

    def report(partial: str | None = None) -> dict[str, Any]:
        return {
            "config": vars(config)
            | {"params": gpt.num_params(), "kv_cache_bytes_per_token": gpt.kv_cache_bytes_per_token},
            "device": str(dev),
            "dtype": dtype_name,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu": cpu_report(),
            "repeats": repeats,
            "partial": partial,
            "results": results,
        }

    try:
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
                per_token, unresolved = _step_time(t1, tn, n, f"{name} (context {ctx})")
                row[name] = {
                    "ms_per_token": 1e3 * per_token,
                    "tokens_per_s": 1.0 / per_token,
                    "prefill_ms": 1e3 * t1,
                    "new_tokens": n,
                    "decode_unresolved": unresolved,
                }
            # A decode step reads every weight once plus the cached K/V of the context: its memory traffic.
            step_bytes = gpt.num_params() * dt.itemsize + ctx * gpt.kv_cache_bytes_per_token
            row["cache_GB_per_s"] = step_bytes / (row["attnlab cache"]["ms_per_token"] * 1e-3) / 1e9
            ref = outs["attnlab cache"]
            row["same_tokens"] = {
                name: bool(torch.equal(out[:, : ref.size(1)], ref[:, : out.size(1)])) for name, out in outs.items()
            }
            if compile_s is not None:
                row["compile_warmup_s"] = compile_s
            results.append(row)
            print(f"context {ctx}: done", flush=True)

    except INTERRUPTS as err:  # the contexts measured so far are kept, marked partial, beside the last full result
        how, _ = interrupt_exit(err)
        if not results:
            raise
        why = f"interrupted ({how}) after {len(results)} of {len(contexts)} contexts"
        atomic_write_text(out_dir / "decode.partial.json", json.dumps(report(why), indent=2) + "\n")
        kept = f"{len(results)} measured context(s), marked partial, in {out_dir / 'decode.partial.json'}"
        raise keep(err, kept) from None
    names = list(runners)
    mismatched = sorted({n for row in results for n, same in row["same_tokens"].items() if not same})
    same = f"greedy tokens identical across runners: {'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)}"
    atomic_write_text(out_dir / "decode.json", json.dumps(report(), indent=2) + "\n")
    atomic_write_text(out_dir / "decode.md", _markdown(results, names, hf) + "\n\n" + same + "\n")
    (out_dir / "decode.partial.json").unlink(missing_ok=True)
    print()
    print(_compact(results, names, hf))
    print(f"\n{same}")
    print(wrap(f"wrote {out_dir / 'decode.json'} and {out_dir / 'decode.md'} (every column, tokens/s too)", width))
    return 0


def _bench_model_command(
    source: str,
    batch_sizes: tuple[int, ...],
    prompt_len: int,
    contexts: tuple[int, ...],
    max_new_tokens: int | None,
    recompute_max_new_tokens: int,
    repeats: int,
    num_layers: int,
    num_heads: int,
    embed_dim: int,
    vocab_size: int,
    hf: bool,
    compile: bool,
    device: str,
    dtype: str,
    threads: int | None,
    out_dir: Path,
    seed: int,
    kv_dtype: str = "auto",
) -> int:
    """``--model``: every flag checked, then :func:`bench_decode_model`."""
    sweep_only = {
        "--contexts": contexts != (64, 128, 256, 512, 1024),
        "--recompute-max-new-tokens": recompute_max_new_tokens != 6,
        "--num-layers": num_layers != 4,
        "--num-heads": num_heads != 8,
        "--embed-dim": embed_dim != 256,
        "--vocab-size": vocab_size != 50257,
    }
    given = [flag for flag, changed in sweep_only.items() if changed]
    if given:
        raise UsageError(
            f"{', '.join(given)} shape(s) the random GPT-2 sweep; with --model {source} the checkpoint fixes the "
            f"model and --prompt-len/--batch-sizes the inputs: drop {given[0]}."
        )
    if not batch_sizes:
        raise UsageError("--batch-sizes got no size; pass e.g. --batch-sizes 1 8.")
    for b in batch_sizes:
        check_range("--batch-sizes", b, low=1, integer=True, hint="each is a number of prompts decoded together")
    check_range("--prompt-len", prompt_len, low=1, integer=True, hint="e.g. --prompt-len 32")
    new = 128 if max_new_tokens is None else max_new_tokens
    check_range("--max-new-tokens", new, low=2, integer=True, hint="the per-token latency is (t(n) - t(1)) / (n - 1)")
    check_range("--repeats", repeats, low=1, integer=True, hint="the median of the timed repeats is reported")
    if threads is not None:
        check_range("--threads", threads, low=1, integer=True, hint="or leave it out for torch's choice")
    dev = resolve_device(device)
    dtypes, why = _model_dtypes(source, dtype, dev)
    out = check_writable_dir(out_dir, "--out-dir")
    check_room(out, "bench-decode", "decode_model.json, .md, .png")
    hf = hf and dtypes != ("gguf",)  # Hugging Face has no runner for the blocks as stored
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return bench_decode_model(
        source,
        batch_sizes,
        dtypes,
        prompt_len,
        new,
        repeats,
        hf,
        compile,
        dev,
        out,
        seed,
        weights=why,
        kv_dtype=kv_dtype,
    )


def _model_dtypes(source: str, dtype: str, device: torch.device) -> tuple[tuple[torch.dtype | str, ...], str]:
    """The rows ``--dtype`` asks of ``bench-decode --model`` (``"gguf"``: the file's blocks as stored and
    llama.cpp), and the line that says what they are and why."""
    name = parse_weights(dtype, "--dtype")
    if name == "auto":
        gguf_beside = is_gguf_source(source) and device.type == "cpu"
        also = ", with the GGUF's blocks as stored and llama.cpp beside float32" if gguf_beside else ""
        return (torch.float32, torch.bfloat16), (
            f"float32 and bfloat16{also}: bench-decode's default measures each way to run the model side by side; "
            f"--dtype names one"
        )
    if name == "gguf":
        choose_weights(name, task="generate", source=source, device=device)  # a GGUF file, on a CPU
        return (
            "gguf",
        ), "gguf (--dtype gguf asked for it): the file's blocks as stored, beside llama.cpp on the same file"
    return (resolve_dtype(name, device),), f"{name} (--dtype {name} asked for it)"


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
    """Every column, as docs/explanation/performance.md shows them: ms/token and tokens/s for each runner."""
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


# ---------------------------------------------------------------------------------------------
# --model: a real checkpoint (SmolLM2 and other Llama-family or GPT-2 models) against HF generate
# ---------------------------------------------------------------------------------------------

_MODEL_RUNNERS = ("attnlab", "attnlab compiled", "attnlab gguf", "HF default", "HF static+compile", "llama.cpp")
_MODEL_SHORT = {
    "attnlab": "ours",
    "attnlab compiled": "ours+c",
    "attnlab gguf": "gguf",
    "HF default": "HF",
    "HF static+compile": "HF best",
    "llama.cpp": "l.cpp",
}
_OURS = ("attnlab", "attnlab compiled", "attnlab gguf")
_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16")


def cpu_report() -> dict[str, Any]:
    """The CPU's vendor and model, and the ISA flags that decide which kernels run."""
    info = cpu_info()
    flags = set(info["flags"])
    return info | {"flags": [f for f in _CPU_FLAGS if f in flags] + sorted(f for f in flags if f.startswith("amx"))}


def _llama_cpp_available() -> str | None:
    """None when ``llama_cpp`` (llama-cpp-python) imports, else why not (the note in the report)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as err:  # not installed, or a build that does not load
        return f"llama_cpp not importable ({type(err).__name__}); `pip install 'attnlab[bench]'` builds it (~15 min)"
    return None


def _load_hf(source: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The same checkpoint in Hugging Face transformers (``AutoModelForCausalLM``), the reference runner."""
    try:
        from transformers import AutoModelForCausalLM
    except Exception as err:  # not installed, or broken by a package it imports: the advice tells which
        need = "--model compares with Hugging Face generate (--no-hf leaves it out), which needs transformers"
        raise UsageError(import_advice("transformers", need, err)) from None
    from ..weight_files.pretrained import smollm2_path

    path = smollm2_path() if source.lower() == "smollm2" else Path(source)
    if path.suffix.lower() == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return cast(Any, model).to(device).eval()


def _hf_runner(hf_model: Any, best: bool) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """HF ``generate``, greedy, exactly ``n`` new tokens: its default (dynamic) cache, or a static cache
    with the forward under ``torch.compile`` (what HF documents as its fastest generate)."""
    extra: dict[str, Any] = {}
    if best:
        from transformers import CompileConfig

        compile_config = CompileConfig(fullgraph=True, mode="default")  # "reduce-overhead" means CUDA graphs
        compile_config._compile_all_devices = True  # type: ignore[assignment]  # HF compiles on CUDA only unless asked
        extra = {"cache_implementation": "static", "compile_config": compile_config}

    def run(idx: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            out = hf_model.generate(
                idx,
                attention_mask=torch.ones_like(idx),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,  # eos never ends a timed run early
                use_cache=True,
                pad_token_id=0,
                **extra,
            )
        return cast(torch.Tensor, out)

    return run


def bench_decode_model(
    source: str,
    batch_sizes: tuple[int, ...],
    dtypes: tuple[torch.dtype | str, ...],
    prompt_len: int,
    max_new_tokens: int,
    repeats: int,
    hf: bool,
    compile: bool,
    device: torch.device,
    out_dir: Path,
    seed: int,
    weights: str = "",
    kv_dtype: str = "auto",
) -> int:
    """``bench-decode --model``: decode tokens/s, prefill tokens/s and bandwidth fraction per batch and dtype.

    ``weights``: which weights the rows run and why, printed (``weights: ...``) once the model has loaded and
    the run fits, beside the progress lines on stdout (stderr stays for errors)."""
    from ..weight_files.pretrained import from_pretrained, locate

    locate(source)  # a missing file is refused before the line that says it is loading
    width = terminal_width()
    print(
        wrap(f"loading {source} (attnlab{', and Hugging Face' if hf else ''}), once for the whole run ...", width),
        flush=True,
    )
    base: Any  # a Llama or a TinyGPT: num_params, kv_cache_bytes_per_token, config.vocab_size
    base, _ = from_pretrained(source, dtype=torch.float32, device=device)
    _check_fits(source, base, batch_sizes, dtypes, prompt_len, max_new_tokens, hf, device)  # before HF loads
    if weights:
        print(wrap(f"weights {weights}", width), flush=True)
    hf_base = _load_hf(source, torch.float32, device) if hf else None
    failures: dict[str, str] = {}  # runner -> why it did not run
    # The same GGUF as stored (dtype="gguf") and llama.cpp on it, beside the float32 runners
    gguf_path = gguf_source(source) if device.type == "cpu" else None
    extra: dict[str, Any] = {}
    if gguf_path is not None:
        extra["gguf_model"], _ = from_pretrained(gguf_path, dtype="gguf", device=device)
        storage, kv_why = resolve_kv_dtype(  # as generate chooses for its largest run: every row's prompt and tokens
            kv_dtype,
            device,
            extra["gguf_model"].has_fused_decode,
            slots=max(batch_sizes) * (prompt_len + max_new_tokens),
            per_slot=kv_values_per_position(extra["gguf_model"]),
        )
        extra["gguf_kv_dtype"] = storage
        print(wrap(f"gguf runner: KV cache {storage or 'in the compute dtype'} ({kv_why})", width), flush=True)
        missing = _llama_cpp_available()
        if missing is None:
            n_ctx = prompt_len + max_new_tokens + 8
            extra["llama_cpp"] = _llama_cpp_runner(gguf_path, n_ctx, torch.get_num_threads())
            extra["llama_cpp_bytes"] = sum(int(t.n_bytes) for t in open_gguf(gguf_path).tensors)
        else:
            failures["llama.cpp"] = missing
    bandwidth = copy_bandwidth(device)
    config = base.config
    vocab = config.vocab_size
    results: list[dict[str, Any]] = []

    def write(partial: str | None = None) -> tuple[str, list[str], str]:
        """decode_model.json, .md and .png with every row; ``partial``: the rows so far, as decode_model.partial.*,
        beside (never over) the last complete result."""
        names = [n for n in _MODEL_RUNNERS if any(n in row for row in results)]
        title = (
            f"decode benchmark: {source} ({base.num_params() / 1e6:.1f}M params), prompt {prompt_len}, "
            f"{max_new_tokens} new tokens, greedy, {device}; torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads, {cpu_info()['model']}; copy bandwidth "
            f"{bandwidth / 1e9:.1f} GB/s"
        )
        report = {
            "model": source,
            "params": base.num_params(),
            "kv_cache_bytes_per_token_fp32": base.kv_cache_bytes_per_token,
            "prompt_len": prompt_len,
            "max_new_tokens": max_new_tokens,
            "copy_GB_per_s": bandwidth / 1e9,
            "device": str(device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu": cpu_report(),
            "repeats": repeats,
            "failed": failures,
            "partial": partial,
            "results": results,
        }
        failed = "".join(f"\n{name} left out: {why}" for name, why in failures.items())
        stem = "decode_model.partial" if partial else "decode_model"
        head = f"PARTIAL: {partial}\n\n" if partial else ""
        atomic_write_text(out_dir / f"{stem}.json", json.dumps(report, indent=2) + "\n")
        atomic_write_text(
            out_dir / f"{stem}.md", head + title + "\n\n" + _model_markdown(results, names) + "\n" + failed + "\n"
        )
        if not partial:
            plot_decode_model(report, out_dir / "decode_model.png")
            for suffix in (".json", ".md"):  # a complete result replaces an interrupted run's rows
                (out_dir / f"decode_model.partial{suffix}").unlink(missing_ok=True)
        return title, names, failed

    def failed_runner(name: str, err: Exception, when: str) -> None:
        """A runner that raises is a result to report (a compiler failure, HF refusing a shape), not a crash."""
        failures[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
        print(wrap(f"{name} failed ({when}), left out: {failures[name]}", width), flush=True)

    try:
        for dt in dtypes:
            if isinstance(dt, str):  # "gguf": only the blocks as stored, and llama.cpp
                model, hf_model, row_extra = None, None, extra
            else:
                model = base if dt == torch.float32 else copy.deepcopy(base).to(dtype=dt)  # .to keeps the head's layout
                hf_model = (
                    None if hf_base is None else hf_base if dt == torch.float32 else copy.deepcopy(hf_base).to(dt)
                )
                row_extra = extra if dt == torch.float32 else {}
            dtype_name = weights_name(dt)
            for batch in batch_sizes:
                row = _measure_model_row(
                    model, hf_model, dt, batch, vocab, prompt_len, max_new_tokens, repeats, compile, device,
                    seed, bandwidth, failed_runner, row_extra, base.kv_cache_bytes_per_token,
                )  # fmt: skip
                if row is not None:
                    results.append(row)
                    write(partial=f"{len(results)} of {len(dtypes) * len(batch_sizes)} rows measured")
                print(f"{dtype_name} batch {batch}: {'done' if row is not None else 'every runner failed'}", flush=True)
    except INTERRUPTS as err:  # the rows measured so far are kept, marked partial
        how, _ = interrupt_exit(err)
        if not results:
            raise
        write(partial=f"interrupted ({how}) after {len(results)} of {len(dtypes) * len(batch_sizes)} rows")
        kept = f"{len(results)} measured row(s), marked partial, in {out_dir / 'decode_model.partial.json'}"
        raise keep(err, kept) from None
    if not results:
        raise UsageError(
            f"bench-decode --model {source}: every runner failed, so nothing was measured ("
            + "; ".join(f"{n}: {why}" for n, why in failures.items())
            + "); rerun with ATTNLAB_DEBUG=1 to see the first failure in full."
        )

    title, names, failed = write()

    print()
    print(wrap(title, width))
    print(_model_compact(results, names))
    if failed:
        print(wrap(failed.strip(), width))
    print(
        wrap(
            f"wrote {out_dir / 'decode_model.json'}, {out_dir / 'decode_model.md'} (every column) and {out_dir / 'decode_model.png'}",
            width,
        )
    )
    return 0


def _check_fits(
    source: str,
    model: Any,
    batch_sizes: tuple[int, ...],
    dtypes: tuple[torch.dtype | str, ...],
    prompt_len: int,
    max_new_tokens: int,
    hf: bool,
    device: torch.device,
) -> None:
    """Prompt plus new tokens within the model's context, and the largest batch's cache and logits within this
    machine's memory: a :class:`LimitError` with the number that fits, before HF loads or anything is timed."""
    block = int(model.config.block_size)
    if prompt_len + max_new_tokens > block:
        raise LimitError(
            f"--prompt-len {prompt_len} + --max-new-tokens {max_new_tokens} = {prompt_len + max_new_tokens} tokens "
            f"exceeds the context of {source} ({block} tokens); {_context_fix(block, prompt_len, max_new_tokens)}."
        )
    batch, length = max(batch_sizes), prompt_len + max_new_tokens
    runners = 2 if hf else 1  # HF holds its own weights, cache and logits
    itemsizes = [dt.itemsize for dt in dtypes if isinstance(dt, torch.dtype) and dt != torch.float32]
    weights = model.num_params() * (4 + sum(itemsizes)) * runners  # "gguf": its blocks are fewer than float32's
    per_row = length * (model.kv_cache_bytes_per_token + 4 * model.config.vocab_size)  # fp32 K/V + a logits row
    check_fits(
        weights + runners * batch * per_row,
        f"--batch-sizes {batch} at {length} tokens (weights, K/V cache and logits{', twice for HF' if hf else ''})",
        lambda free: (
            f"pass --batch-sizes at most {max(0, int((free - weights) // (runners * per_row)))}"
            + (" or --no-hf" if hf else "")
        ),
        device,
    )


def _check_sweep_fits(config: GPTConfig, dtype: torch.dtype, hf: bool, device: torch.device) -> None:
    """The GPT-2 sweep's model (and HF's copy of it), its K/V cache and a recompute's logits within this machine's
    memory: a :class:`LimitError` naming the flag, before the model is built."""
    runners = 2 if hf else 1
    weights = gpt_weight_count(config) * dtype.itemsize * runners
    cache = runners * 2 * config.n_layer * config.block_size * config.n_embd * dtype.itemsize  # K and V, batch 1
    logits = runners * config.block_size * config.vocab_size * 4  # a recompute's forward over the whole context
    fix = "pass a smaller --embed-dim, --num-layers or --vocab-size"
    if cache + logits > weights:
        fix = "pass shorter --contexts or fewer --max-new-tokens"
    check_fits(
        weights + cache + logits,
        f"the sweep's model ({config.n_layer} layers, --embed-dim {config.n_embd}, --vocab-size {config.vocab_size}"
        f"{', and HF its copy' if hf else ''}: weights {gib(weights)}, K/V cache {gib(cache)}, logits {gib(logits)})",
        fix + (", or --no-hf" if hf else ""),
        device,
    )


def _context_fix(block: int, prompt_len: int, max_new_tokens: int) -> str:
    """The flags that bring prompt plus new tokens within ``block``: each one that works alone, else both."""
    fixes = []
    if block - max_new_tokens >= 1:
        fixes.append(f"pass --prompt-len at most {block - max_new_tokens}")
    if block - prompt_len >= 2:  # the latency needs two new tokens
        fixes.append(f"pass --max-new-tokens at most {block - prompt_len}")
    return " or ".join(fixes) or f"pass e.g. --prompt-len {block // 2} --max-new-tokens {block - block // 2}"


def _measure_model_row(
    model: Any,
    hf_model: Any,
    dt: torch.dtype | str,
    batch: int,
    vocab: int,
    prompt_len: int,
    max_new_tokens: int,
    repeats: int,
    compile: bool,
    device: torch.device,
    seed: int,
    bandwidth: float,
    failed_runner: Callable[[str, Exception, str], None],
    extra: dict[str, Any] | None = None,
    kv_bytes_per_token: int = 0,
) -> dict[str, Any] | None:
    """One (dtype, batch) row: every runner warmed up, then timed interleaved; None when every runner failed.

    ``extra`` (float32 and gguf rows of a GGUF source): ``gguf_model`` (the file's blocks as stored) and
    ``llama_cpp`` (a runner, batch 1 only) with ``llama_cpp_bytes``, the file's tensor bytes. ``model`` is None
    in a ``"gguf"`` row (``--dtype gguf``), which runs those two only; ``kv_bytes_per_token``: the float32
    K/V cache's, for the bytes a step reads."""
    extra = extra or {}
    dtype_name = weights_name(dt)
    gen = torch.Generator().manual_seed(seed + batch)
    idx = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(device)
    runners: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {}
    if model is not None:
        runners["attnlab"] = partial(generate, model, temperature=0)
    if compile and model is not None:
        runners["attnlab compiled"] = partial(generate, model, temperature=0, compile=True)
    gguf_model = extra.get("gguf_model")
    if gguf_model is not None:
        runners["attnlab gguf"] = partial(generate, gguf_model, temperature=0, kv_dtype=extra.get("gguf_kv_dtype"))
    if hf_model is not None:
        runners["HF default"] = _hf_runner(hf_model, best=False)
        if compile:
            runners["HF static+compile"] = _hf_runner(hf_model, best=True)
    if "llama_cpp" in extra and batch == 1:  # llama-cpp-python decodes one sequence at a time
        runners["llama.cpp"] = extra["llama_cpp"]
    warmup_s: dict[str, float] = {}
    for name, fn in list(runners.items()):  # warm-up; for the compiled runners the compilation itself
        try:
            warmup_s[name], _ = _time(partial(fn, idx), max_new_tokens, device)  # the timed cache sizes
        except Exception as err:  # the runner's failure; an interrupt (a BaseException) goes through
            failed_runner(name, err, f"{dtype_name}, batch {batch}")
            del runners[name]
    if not runners:
        return None
    times: dict[str, dict[int, list[float]]] = {name: {1: [], max_new_tokens: []} for name in runners}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, fn in list(runners.items()):  # interleaved, so that drift hits every runner alike
            try:
                for k in (1, max_new_tokens):
                    t, out = _time(partial(fn, idx), k, device)
                    times[name][k].append(t)
                    outs[name] = out
            except Exception as err:  # failed after warming up (memory, a recompilation): left out of the row
                failed_runner(name, err, f"{dtype_name}, batch {batch}, timed run")
                del runners[name]
                outs.pop(name, None)
    if not runners:
        return None
    # Bytes one decode step must read: every weight once, plus each row's cached K/V at the
    # mean context of the run (the prompt and half the new tokens).
    # Each runner's own bytes: float weights at their itemsize; the GGUF's blocks as stored (attnlab gguf, and
    # llama.cpp, whose K/V cache is float16).
    mean_context = prompt_len + max_new_tokens / 2
    kv = batch * mean_context * kv_bytes_per_token  # float32 K/V (bf16 rows: at that itemsize)
    if isinstance(dt, torch.dtype):
        kv = kv * dt.itemsize / 4
        step_bytes = model.num_params() * dt.itemsize + kv
    else:  # a gguf row: the blocks' bytes are its floor
        assert gguf_model is not None  # a gguf row comes with the file's model
        step_bytes = gguf_model.weight_bytes() + kv
    own_bytes = {name: step_bytes for name in runners}
    if gguf_model is not None:
        own_bytes["attnlab gguf"] = gguf_model.weight_bytes() + kv
    if "llama.cpp" in runners:
        own_bytes["llama.cpp"] = extra["llama_cpp_bytes"] + kv / 2
    limit_s = step_bytes / bandwidth
    row: dict[str, Any] = {"dtype": dtype_name, "batch": batch, "step_bytes": step_bytes, "limit_ms": 1e3 * limit_s}
    for name in runners:
        t1, tn = statistics.median(times[name][1]), statistics.median(times[name][max_new_tokens])
        per_token, unresolved = _step_time(t1, tn, max_new_tokens, f"{name} ({dtype_name}, batch {batch})")
        row[name] = {
            "ms_per_token": 1e3 * per_token,
            "tokens_per_s": batch / per_token,  # every row of the batch gains a token per step
            "prefill_tokens_per_s": batch * prompt_len / t1,  # t(1): the prefill and one token
            "bytes_per_token": own_bytes[name],
            "bandwidth_fraction": own_bytes[name] / bandwidth / per_token,
            "warmup_s": warmup_s[name],
            "decode_unresolved": unresolved,  # True: the rates are the whole run's (see above)
        }
    ref_name = "attnlab" if "attnlab" in outs else next(iter(outs))  # attnlab's tokens, or the first that ran
    row["same_tokens"] = {name: bool(torch.equal(out, outs[ref_name])) for name, out in outs.items()}
    row["same_tokens_reference"] = ref_name
    return row


def _step_time(t1: float, tn: float, n: int, label: str) -> tuple[float, bool]:
    """Seconds a decode step takes, from the (median) times of runs of 1 and of ``n`` new tokens (their difference
    over n - 1), and whether that difference failed to resolve it.

    Where the prefill's run-to-run noise is larger than the decode itself (a tiny model, few new tokens, a busy
    machine) the difference is no measure: it was read as a negative rate (-1051.8 tokens/s in a loaded test run).
    The ``n``-token run's whole time per token then stands in, prefill included (a floor of the rate), said on
    stdout and flagged ``decode_unresolved`` in the row."""
    per_token = (tn - t1) / (n - 1)
    if per_token > 0:
        return per_token, False
    note = (
        f"{label}: the decode took less than the prefill's run-to-run noise; its rate is the whole run's ({n} "
        "tokens, prefill included), a floor; raise --max-new-tokens to time the steps"
    )
    print(wrap(note), flush=True)
    return tn / n, True


def _best(row: dict[str, Any]) -> str | None:
    """Our fastest runner in the row (tokens/s), or None when none of ours ran."""
    ours = [n for n in _OURS if n in row]
    return max(ours, key=lambda n: row[n]["tokens_per_s"]) if ours else None


def _ratio(row: dict[str, Any], name: str) -> str:
    best = _best(row)
    return f"{row[best]['tokens_per_s'] / row[name]['tokens_per_s']:.2f}x" if name in row and best else "-"


def _model_compact(results: list[dict[str, Any]], names: list[str]) -> str:
    """Decode tokens/s per runner, our best over HF's, and our bandwidth fraction: 80 columns."""
    hf_names = [n for n in ("HF default", "HF static+compile", "llama.cpp") if n in names]
    header = ("dtype", "B", *(_MODEL_SHORT[n] for n in names), *(f"/{_MODEL_SHORT[n]}" for n in hf_names), "%BW")
    rows = []
    for row in results:
        best = _best(row)
        cells = [row["dtype"].replace("bfloat", "bf").replace("float", "fp"), str(row["batch"])]
        cells += [f"{row[n]['tokens_per_s']:.1f}" if n in row else "-" for n in names]
        cells += [_ratio(row, n) for n in hf_names]
        cells.append(f"{100 * row[best]['bandwidth_fraction']:.0f}%" if best else "-")
        rows.append(cells)
    legend = (
        "decode tokens/s (all rows of the batch); /HF, /l.cpp: our fastest over HF's and llama.cpp's (same GGUF, "
        "batch 1); %BW: our fastest's share of the bandwidth limit for the bytes it reads per step "
        "(weights as held + K/V, over the copy rate)"
    )
    return wrap(legend) + "\n" + "\n".join(aligned(header, rows, right=[False] + [True] * (len(header) - 1)))


def plot_decode_model(report: dict[str, Any], path: Path) -> Path:
    """Bars of decode tokens/s per runner, grouped by (dtype, batch), each labelled with its share of the bandwidth limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    names = [n for n in _MODEL_RUNNERS if any(n in r for r in results)]
    fig, ax = plt.subplots(figsize=(8.5, 3.6))
    width = 0.8 / max(len(names), 1)
    for k, name in enumerate(names):
        xs, ys, labels = [], [], []
        for i, row in enumerate(results):
            if name in row:
                xs.append(i + (k - (len(names) - 1) / 2) * width)
                ys.append(row[name]["tokens_per_s"])
                labels.append(f"{row[name]['bandwidth_fraction']:.0%}")
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, labels, fontsize=6, padding=1)
    groups = [f"{r['dtype'].replace('bfloat', 'bf').replace('float', 'fp')}, batch {r['batch']}" for r in results]
    ax.set_xticks(range(len(results)), groups)
    ax.set_ylabel("decode tokens/s (all rows)")
    cpu = report.get("cpu") or {}
    generation = f"family {cpu['family']} model {cpu['model_number']}; " if cpu.get("family") else ""
    machine = f"{cpu.get('model') or report['device']} ({generation}{', '.join(cpu.get('flags', [])[:8])})"
    ax.set_title(
        f"{report['model']}: greedy decode, prompt {report['prompt_len']}, {report['max_new_tokens']} new tokens, "
        f"{report['threads']} threads (labels: share of the bandwidth limit)\n{machine}, copy bandwidth "
        f"{report.get('copy_GB_per_s', 0):.1f} GB/s",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    return path


def _model_markdown(results: list[dict[str, Any]], names: list[str]) -> str:
    """Every column: decode tokens/s (ms/step), prefill tokens/s, bandwidth fraction, per runner."""
    header = "| dtype | batch | " + " | ".join(f"{n}: tok/s (ms/step), prefill tok/s, % BW" for n in names) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in results:
        cells = [
            f"{row[n]['tokens_per_s']:.1f} ({row[n]['ms_per_token']:.1f}), {row[n]['prefill_tokens_per_s']:.0f}, "
            f"{100 * row[n]['bandwidth_fraction']:.0f}%"
            if n in row
            else "-"
            for n in names
        ]
        lines.append(f"| {row['dtype']} | {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
