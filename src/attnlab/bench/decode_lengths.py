"""``attnlab bench-decode --model smollm2 --prompt-lengths 32,128,512,2048,7000``: what a user meets at each prompt
length, attnlab (the GGUF as stored) against llama.cpp on the same file with its flash attention off and on.

Each runner is a process of its own (:mod:`attnlab.bench.lengths_worker`), kept for the whole run and sent the
same prompt ids; runners take turns inside each repeat (the order rotating), so that a change of load hits every
runner alike. attnlab runs what ``attnlab generate`` runs: its KV cache as ``--kv-dtype`` chooses for each length's
prompt and new tokens (auto: on a CPU with the fused decode step float16, int8 where float16 would pass 32 MB), named
in the header and in each row of the JSON. Each repeat is one run of ``--max-new-tokens`` tokens
whose every token is timed as the runner's iterator yields it (attnlab's ``generate_steps``, llama.cpp's
``generate``). Per length and runner, medians over the repeats:

* time to first token: from the call to the first token, the prefill and the sampling of its last logits
  (``t_first``); prefill tokens/s is the length over it;
* decode tokens/s at that context: ``(n - 1) / (t_last - t_first)`` within the same run, ``n`` the tokens it
  actually produced, so that the prefill's noise (seconds at 7000 tokens) never enters the decode's rate;
* peak RSS: the runner process's peak resident set during that length's runs (the model, the K/V cache, the
  prefill's work memory; an attnlab process also holds torch, a llama.cpp process neither torch nor attnlab);
* the bytes a decode step reads (the weights as stored, plus the K/V cache at the mean context of the decode:
  attnlab's cache at its dtype, llama.cpp's in float16) over the step time, as a share of the copy rate of a
  256 MB tensor measured just before that length (:func:`attnlab.bench.timing.copy_bandwidth`);
* greedy agreement with attnlab: the share of new tokens equal to attnlab's, position by position.

With ``--batch-size N`` every runner decodes N prompts of that length at once (N rows of random ids, a different row
each): attnlab its batched ``generate_steps``, llama.cpp its own multi-sequence batching (one context of N
sequences: :class:`attnlab.bench.lengths_worker.LlamaCppBatch`), greedy on every row. Decode tokens/s is then
aggregate, N tokens a step; prefill tokens/s is ``N * length`` over the time to the first step's N tokens; the
bytes of a step hold the K/V of all N rows; agreement is over every row. Below the table, per length, attnlab's
decode and prefill rates over llama.cpp's better setting (:func:`ratios_markdown`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

import torch

from ..core.kv_cache import kv_values_per_position, resolve_kv_dtype
from ..runtime import UsageError, atomic_write_text, check_range, check_writable_dir, cpu_info
from .table import terminal_width, wrap
from .timing import copy_bandwidth

__all__ = [
    "RUNNERS",
    "Worker",
    "bench_decode_lengths",
    "parse_lengths",
    "prompt_rows",
    "ratios_markdown",
    "run_repeats",
    "summarize_runs",
]

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

    def __init__(
        self,
        name: str,
        python: str,
        model: Path,
        threads: str,
        n_ctx: int,
        kv_dtype: str | None = None,
        batch: int = 1,
    ) -> None:
        script = Path(__file__).with_name("lengths_worker.py")
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[2])  # where this attnlab is imported from (src/attnlab/bench/..)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.name = name
        self.proc = subprocess.Popen(
            [python, str(script), name, str(model), threads, str(n_ctx), str(batch)] + ([kv_dtype] if kv_dtype else []),
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


class Asks(Protocol):
    """What :func:`run_repeats` needs of a runner: :meth:`Worker.ask`."""

    def ask(self, **cmd: Any) -> dict[str, Any]: ...


def run_repeats(
    workers: Mapping[str, Asks],
    ids: list[int] | list[list[int]],
    new_tokens: int,
    repeats: int,
    extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` timed runs of ``new_tokens`` tokens after ``ids`` (a prompt, or rows of prompts for a batch) for
    every runner, the runners taking turns (their order rotated each repeat); ``{runner: [each run's answer:
    first_s, last_s, tokens]}``. ``extra``: more fields of a runner's command (attnlab's ``kv``)."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in workers}
    order = list(workers)
    for r in range(repeats):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            runs[name].append(workers[name].ask(cmd="generate", ids=ids, n=new_tokens, **(extra or {}).get(name, {})))
    return runs


def summarize_runs(runs: list[dict[str, Any]], batch: int = 1) -> dict[str, Any]:
    """One runner's figures at one length from its runs (:func:`run_repeats`): the medians over the runs of the time
    to first token (``first_s``) and of the decode rate ``batch * (n - 1) / (last_s - first_s)`` tokens a second,
    ``n`` the steps that run produced (``batch`` tokens each); a run of fewer than 2 steps has no rate (None where
    no run has one)."""
    firsts = [r["first_s"] for r in runs if r["first_s"] is not None]
    rates = [
        batch * (len(r["tokens"]) - 1) / (r["last_s"] - r["first_s"])
        for r in runs
        if len(r["tokens"]) >= 2 and r["last_s"] > r["first_s"]
    ]
    return {
        "ttft_s": statistics.median(firsts) if firsts else None,
        "decode_tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_produced": [len(r["tokens"]) for r in runs],
    }


def prompt_rows(vocab: int, length: int, batch: int, seed: int) -> list[list[int]]:
    """``batch`` rows of ``length`` random token ids below ``vocab``, each its own, the same for a seed and length
    (row 0 is the prompt a batch of 1 gets)."""
    generator = torch.Generator().manual_seed(seed + length)
    return [row.tolist() for row in torch.randint(0, vocab, (batch, length), generator=generator)]


def same_share(tokens: list[Any], ref: list[Any]) -> float:
    """The share of ``ref``'s new tokens that ``tokens`` has at the same position (and row, for a batch's steps)."""
    flat = [t for step in tokens for t in (step if isinstance(step, list) else [step])]
    flat_ref = [t for step in ref for t in (step if isinstance(step, list) else [step])]
    return sum(a == b for a, b in zip(flat, flat_ref, strict=False)) / max(1, len(flat_ref))


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
    kv_dtype: str = "auto",
    batch: int = 1,
) -> int:
    """Measure every length of ``lengths`` for attnlab and llama.cpp (FA off, on); print the table, write
    decode_lengths.json and decode_lengths.md in ``out_dir``. ``kv_dtype``: attnlab's KV cache, as ``attnlab
    generate --kv-dtype`` takes it (auto: what a user gets by default); ``batch``: the prompts of each length
    decoded at once."""
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
    check_range("--max-new-tokens", max_new_tokens, low=2, integer=True, hint="decode tokens/s needs t_last - t_first")
    check_range("--repeats", repeats, low=1, integer=True)
    check_range("--batch-size", batch, low=1, integer=True, hint="the prompts of each length decoded at once")
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
    per_value = kv_values_per_position(meta)  # K/V values one token caches
    try:  # per length, as generate chooses for that prompt and its new tokens (every row's)
        chosen = {
            n: resolve_kv_dtype(
                kv_dtype,
                torch.device("cpu"),
                bool(meta.has_fused_decode),
                slots=batch * (n + max_new_tokens),
                per_slot=per_value,
            )
            for n in lengths
        }
    except ValueError as err:
        raise UsageError(str(err)) from None
    weight_bytes = {"attnlab": meta.weight_bytes(), "llama": sum(int(t.n_bytes) for t in open_gguf(path).tensors)}
    kv_token = {  # bytes a token caches: attnlab's at each length's storage (int8 scales too), llama.cpp's float16
        n: {
            "attnlab": sum(c.bytes_per_token for c in meta.setup_caches(1, 1, storage)),
            "llama": per_value * _LLAMA_KV_BYTES,
        }
        for n, (storage, _) in chosen.items()
    }
    compute = str(meta._kv_dtype()).removeprefix("torch.")
    kv_names = {n: storage or compute for n, (storage, _) in chosen.items()}
    whys = list(dict.fromkeys(f"{kv_names[n]} ({why})" for n, (_, why) in chosen.items()))
    vocab = int(meta.config.vocab_size)
    del meta
    width = terminal_width()
    thread_arg = "auto" if threads is None else str(threads)
    n_ctx = max(lengths) + max_new_tokens + 8
    print(
        wrap(f"KV cache: attnlab {'; '.join(whys)}, llama.cpp float16 (its default)", width),
        flush=True,
    )
    workers: dict[str, Worker] = {}
    failures: dict[str, str] = {}
    for name in RUNNERS:
        python = sys.executable if name == "attnlab" else (llama_python or sys.executable)
        print(f"starting {_LABEL[name]} ...", flush=True)
        w = Worker(name, python, path, thread_arg, n_ctx, None, batch)
        if w.error is None:
            workers[name] = w
        else:
            failures[name] = w.error
            w.close()
    if "attnlab" not in workers:
        raise UsageError(f"bench-decode --prompt-lengths: attnlab's runner did not start: {failures['attnlab']}")
    for w in workers.values():  # warm-up: the first call of each runner pays for its first allocations
        warm = [list(range(1 + r, 17 + r)) for r in range(batch)]
        w.ask(cmd="generate", ids=warm if batch > 1 else warm[0], n=2)
    results: list[dict[str, Any]] = []
    try:
        for length in lengths:
            rows = prompt_rows(vocab, length, batch, seed)
            ids: list[int] | list[list[int]] = rows if batch > 1 else rows[0]
            bandwidth = copy_bandwidth(torch.device("cpu"))
            for w in workers.values():
                w.ask(cmd="reset_peak")
            runs = run_repeats(workers, ids, max_new_tokens, repeats, {"attnlab": {"kv": chosen[length][0]}})
            row: dict[str, Any] = {"length": length, "copy_GB_per_s": bandwidth / 1e9, "kv_dtype": kv_names[length]}
            mean_ctx = length + max_new_tokens / 2
            ref = runs["attnlab"][-1]["tokens"]
            for name, w in workers.items():
                figures = summarize_runs(runs[name], batch)
                rate = figures["decode_tokens_per_s"]  # all rows: batch tokens a step
                kind = "attnlab" if name == "attnlab" else "llama"
                step_bytes = weight_bytes[kind] + batch * mean_ctx * kv_token[length][kind]
                ttft = figures["ttft_s"]
                row[name] = {
                    "ttft_s": ttft,
                    "prefill_tokens_per_s": batch * length / ttft if ttft else None,
                    "decode_tokens_per_s": rate,  # None where no run produced 2 steps
                    "decode_ms": 1e3 * batch / rate if rate else None,  # one step, all rows
                    "tokens_produced": figures["tokens_produced"],
                    "peak_rss_bytes": w.ask(cmd="peak")["rss_peak"],
                    "step_bytes": step_bytes,
                    "bandwidth_fraction": step_bytes * rate / batch / bandwidth if rate else None,
                    "same_tokens": same_share(runs[name][-1]["tokens"], ref),
                    "runs": [{"first_s": r["first_s"], "last_s": r["last_s"]} for r in runs[name]],
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
        "batch": batch,
        "repeats": repeats,
        "threads": thread_arg,
        "kv_dtype": {
            "attnlab": "/".join(dict.fromkeys(kv_names.values())),
            "asked": kv_dtype,
            "why": "; ".join(whys),
            "llama.cpp": "float16",
        },
        "torch": torch.__version__,
        "cpu": cpu_info(),
        "load_average": os.getloadavg(),
        "failed": failures,
        "results": results,
    }
    atomic_write_text(out_dir / "decode_lengths.json", json.dumps(report, indent=2) + "\n")
    table = lengths_markdown(results, list(workers), batch)
    ratios = ratios_markdown(results, list(workers))
    table += "\n\n" + ratios if ratios else ""
    notes = "".join(f"\n{_LABEL[n]} left out: {why}" for n, why in failures.items())
    atomic_write_text(out_dir / "decode_lengths.md", table + "\n" + notes + "\n")
    print()
    print(table)
    if notes:
        print(wrap(notes.strip(), width))
    print(wrap(f"wrote {out_dir / 'decode_lengths.json'} and {out_dir / 'decode_lengths.md'}", width))
    return 0


def lengths_markdown(results: list[dict[str, Any]], names: list[str], batch: int = 1) -> str:
    """One row per (length, runner): the columns docs/explanation/performance.md shows; with ``batch`` > 1 a line
    above says the rates count every row."""
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
                    "-" if r["ttft_s"] is None else f"{r['ttft_s']:.2f}",
                    "-" if r["prefill_tokens_per_s"] is None else f"{r['prefill_tokens_per_s']:.0f}",
                    "-" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:.1f}",
                    f"{r['peak_rss_bytes'] / 1e6:.0f}",
                    "-" if r["bandwidth_fraction"] is None else f"{100 * r['bandwidth_fraction']:.0f}%",
                    f"{100 * r['same_tokens']:.0f}%",
                ]
            )
    lines = ["| " + " | ".join(header) + " |", "|---:|---|" + "---:|" * (len(header) - 2)]
    if batch > 1:
        lines.insert(0, f"batch {batch}: prefill and decode tokens/s count all {batch} rows\n")
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def ratios_markdown(results: list[dict[str, Any]], names: list[str]) -> str:
    """Per length, attnlab's decode and prefill tokens/s over those of llama.cpp's faster setting at that length
    (FA off or on, named; chosen for each rate apart); "" where attnlab or no llama.cpp runner ran."""
    peers = [n for n in names if n != "attnlab"]
    if "attnlab" not in names or not peers:
        return ""

    def ratio(row: dict[str, Any], key: str) -> str:
        ours = row["attnlab"][key]
        ran = [n for n in peers if row[n][key]]
        if not ours or not ran:
            return "-"
        best = max(ran, key=lambda n: row[n][key])
        return f"{ours / row[best][key]:.2f}x ({_LABEL[best]})"

    header = "| prompt | decode: attnlab / llama.cpp's best | prefill: attnlab / llama.cpp's best |"
    lines = [header, "|---:|---:|---:|"]
    lines += [
        f"| {row['length']} | {ratio(row, 'decode_tokens_per_s')} | {ratio(row, 'prefill_tokens_per_s')} |"
        for row in results
    ]
    return "\n".join(lines)
