"""``attnlab bench-decode --model smollm2 --prompt-lengths 32,128,512,2048,7000``: what a user meets at each prompt
length, attnlab (the GGUF as stored) against llama.cpp on the same file with its flash attention off and on.

Each runner is a process of its own (:mod:`attnlab.bench.lengths_worker`), kept for the whole run and sent the
same prompt ids; runners take turns inside each repeat (the order rotating), so that a change of load hits every
runner alike. Per length and runner:

* time to first token: a generation of 1 token, the prefill and the sampling of its last logits (``t(1)``);
  prefill tokens/s is the length over it;
* decode tokens/s at that context: ``(n - 1) / (t(n) - t(1))``, the prefill cancelled;
* peak RSS: the runner process's peak resident set during that length's runs (the model, the K/V cache, the
  prefill's work memory; an attnlab process also holds torch, a llama.cpp process neither torch nor attnlab);
* the bytes a decode step reads (the weights as stored, plus the K/V cache at the mean context of the decode:
  attnlab's cache at its dtype, llama.cpp's in float16) over the step time, as a share of the copy rate of a
  256 MB tensor measured just before that length (:func:`attnlab.bench.timing.copy_bandwidth`);
* greedy agreement with attnlab: the share of new tokens equal to attnlab's, position by position.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import torch

from ..runtime import UsageError, atomic_write_text, check_range, check_writable_dir, cpu_info
from .table import terminal_width, wrap
from .timing import copy_bandwidth

__all__ = ["RUNNERS", "Worker", "bench_decode_lengths", "parse_lengths"]

RUNNERS = ("attnlab", "llama.cpp", "llama.cpp-fa")
_LABEL = {"attnlab": "attnlab", "llama.cpp": "llama.cpp", "llama.cpp-fa": "llama.cpp FA"}
_LLAMA_KV_BYTES = 2  # llama.cpp's default K/V cache type is float16


def parse_lengths(values: tuple[str, ...]) -> tuple[int, ...]:
    """``("32,128", "512")`` -> ``(32, 128, 512)``: lengths separated by commas, spaces or both."""
    out: list[int] = []
    for value in values:
        for part in value.replace(",", " ").split():
            if not part.isdigit() or int(part) < 1:
                raise UsageError(
                    f"--prompt-lengths takes prompt lengths >= 1 separated by commas, got {part!r} in {value!r}; "
                    f"e.g. --prompt-lengths 32,128,512,2048,7000."
                )
            out.append(int(part))
    return tuple(out)


def gguf_source(source: str) -> Path | None:
    """The GGUF file ``source`` names ("smollm2" or a .gguf path), or None for another kind of source."""
    from ..weight_files.pretrained import smollm2_path

    if source.lower() == "smollm2":
        return smollm2_path()
    return Path(source) if source.lower().endswith(".gguf") else None


class Worker:
    """A runner's process: one JSON command a line in, one answer a line out (see :mod:`lengths_worker`)."""

    def __init__(self, name: str, python: str, model: Path, threads: str, n_ctx: int) -> None:
        script = Path(__file__).with_name("lengths_worker.py")
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # where this attnlab is imported from (src/attnlab/bench/..)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.name = name
        self.proc = subprocess.Popen(
            [python, str(script), name, str(model), threads, str(n_ctx)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        first = self._read()
        self.error: str | None = first.get("error") if not first.get("ready") else None

    def _read(self) -> dict[str, Any]:
        line = cast_io(self.proc.stdout).readline()
        if not line:
            return {"error": f"the {self.name} process ended (exit code {self.proc.wait()})"}
        return dict(json.loads(line))

    def ask(self, **cmd: Any) -> dict[str, Any]:
        stdin = cast_io(self.proc.stdin)
        stdin.write(json.dumps(cmd) + "\n")
        stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def cast_io(stream: IO[str] | None) -> IO[str]:
    assert stream is not None  # Popen was given PIPE
    return stream


def bench_decode_lengths(
    source: str,
    lengths: tuple[int, ...],
    max_new_tokens: int,
    repeats: int,
    threads: int | None,
    out_dir: Path,
    seed: int,
    llama_python: str | None = None,
) -> int:
    """Measure every length of ``lengths`` for attnlab and llama.cpp (FA off, on); print the table, write
    decode_lengths.json and decode_lengths.md in ``out_dir``."""
    from ..weight_files.gguf import open_gguf
    from ..weight_files.pretrained import from_pretrained

    path = gguf_source(source)
    if path is None:
        raise UsageError(
            f"--prompt-lengths compares with llama.cpp on the same GGUF file; --model {source!r} is not one: pass "
            f"--model smollm2 or a .gguf path."
        )
    for length in lengths:
        check_range("--prompt-lengths", length, low=1, integer=True)
    check_range("--max-new-tokens", max_new_tokens, low=2, integer=True, hint="decode tokens/s needs t(n) - t(1)")
    check_range("--repeats", repeats, low=1, integer=True)
    if threads is not None:
        check_range("--threads", threads, low=1, integer=True, hint="or leave it out: auto, chosen by timing steps")
    out_dir = check_writable_dir(out_dir, "--out-dir")
    meta: Any
    meta, _ = from_pretrained(path, dtype="gguf")  # sizes only; the runners load their own
    block = int(meta.config.block_size)
    if max(lengths) + max_new_tokens > block:
        raise UsageError(
            f"--prompt-lengths up to {max(lengths)} + --max-new-tokens {max_new_tokens} exceeds the model's "
            f"{block} positions; pass lengths of at most {block - max_new_tokens}."
        )
    weight_bytes = {"attnlab": meta.weight_bytes(), "llama": sum(int(t.n_bytes) for t in open_gguf(path).tensors)}
    per_value = meta.kv_cache_bytes_per_token // meta._kv_dtype().itemsize  # K/V values one token caches
    kv_token = {"attnlab": meta.kv_cache_bytes_per_token, "llama": per_value * _LLAMA_KV_BYTES}
    vocab = int(meta.config.vocab_size)
    del meta
    width = terminal_width()
    thread_arg = "auto" if threads is None else str(threads)
    n_ctx = max(lengths) + max_new_tokens + 8
    workers: dict[str, Worker] = {}
    failures: dict[str, str] = {}
    for name in RUNNERS:
        python = sys.executable if name == "attnlab" else (llama_python or sys.executable)
        print(f"starting {_LABEL[name]} ...", flush=True)
        w = Worker(name, python, path, thread_arg, n_ctx)
        if w.error is None:
            workers[name] = w
        else:
            failures[name] = w.error
            w.close()
    if "attnlab" not in workers:
        raise UsageError(f"bench-decode --prompt-lengths: attnlab's runner did not start: {failures['attnlab']}")
    for w in workers.values():  # warm-up: the first call of each runner pays for its first allocations
        w.ask(cmd="generate", ids=list(range(1, 17)), n=2)
    results: list[dict[str, Any]] = []
    try:
        for length in lengths:
            ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed + length)).tolist()
            bandwidth = copy_bandwidth(torch.device("cpu"))
            times: dict[str, dict[int, list[float]]] = {n: {1: [], max_new_tokens: []} for n in workers}
            tokens: dict[str, list[int]] = {}
            for w in workers.values():
                w.ask(cmd="reset_peak")
            order = list(workers)
            for r in range(repeats):
                for name in order[r % len(order) :] + order[: r % len(order)]:  # rotated each repeat
                    for n in (1, max_new_tokens):
                        answer = workers[name].ask(cmd="generate", ids=ids, n=n)
                        times[name][n].append(answer["seconds"])
                        if n == max_new_tokens:
                            tokens[name] = answer["tokens"]
            row: dict[str, Any] = {"length": length, "copy_GB_per_s": bandwidth / 1e9}
            mean_ctx = length + max_new_tokens / 2
            for name, w in workers.items():
                t1, tn = statistics.median(times[name][1]), statistics.median(times[name][max_new_tokens])
                step = (tn - t1) / (max_new_tokens - 1)
                kind = "attnlab" if name == "attnlab" else "llama"
                step_bytes = weight_bytes[kind] + mean_ctx * kv_token[kind]
                ref = tokens["attnlab"]
                same = sum(a == b for a, b in zip(tokens[name], ref, strict=False)) / max(1, len(ref))
                row[name] = {
                    "ttft_s": t1,
                    "prefill_tokens_per_s": length / t1,
                    # None where noise made t(n) <= t(1): no rate to report
                    "decode_tokens_per_s": 1 / step if step > 0 else None,
                    "decode_ms": 1e3 * step,
                    "peak_rss_bytes": w.ask(cmd="peak")["rss_peak"],
                    "step_bytes": step_bytes,
                    "bandwidth_fraction": step_bytes / step / bandwidth if step > 0 else None,
                    "same_tokens": same,
                    "times": times[name],
                }
            results.append(row)
            print(f"{length} tokens: done", flush=True)
    finally:
        for w in workers.values():
            w.close()
    report = {
        "model": source,
        "path": str(path),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "threads": thread_arg,
        "torch": torch.__version__,
        "cpu": cpu_info(),
        "load_average": os.getloadavg(),
        "failed": failures,
        "results": results,
    }
    atomic_write_text(out_dir / "decode_lengths.json", json.dumps(report, indent=2) + "\n")
    table = lengths_markdown(results, list(workers))
    notes = "".join(f"\n{_LABEL[n]} left out: {why}" for n, why in failures.items())
    atomic_write_text(out_dir / "decode_lengths.md", table + "\n" + notes + "\n")
    print()
    print(table)
    if notes:
        print(wrap(notes.strip(), width))
    print(wrap(f"wrote {out_dir / 'decode_lengths.json'} and {out_dir / 'decode_lengths.md'}", width))
    return 0


def lengths_markdown(results: list[dict[str, Any]], names: list[str]) -> str:
    """One row per (length, runner): the columns docs/explanation/performance.md shows."""
    header = (
        "prompt",
        "runner",
        "TTFT s",
        "prefill tok/s",
        "decode tok/s",
        "peak RSS MB",
        "% copy BW",
        "same tokens",
    )
    rows = []
    for row in results:
        for name in names:
            r = row[name]
            rows.append(
                [
                    str(row["length"]),
                    _LABEL[name],
                    f"{r['ttft_s']:.2f}",
                    f"{r['prefill_tokens_per_s']:.0f}",
                    "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}",
                    f"{r['peak_rss_bytes'] / 1e6:.0f}",
                    "-" if r["bandwidth_fraction"] is None else f"{100 * r['bandwidth_fraction']:.0f}%",
                    f"{100 * r['same_tokens']:.0f}%",
                ]
            )
    lines = ["| " + " | ".join(header) + " |", "|---:|---|" + "---:|" * (len(header) - 2)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
