"""The decode step of SmolLM2 (its GGUF, the fused C++ step) at long contexts, per KV-cache dtype, against a baseline.

For each context (default 512, 2048, 7000, 8192) and cache dtype (float32, float16, bfloat16, int8) the caches are
filled with random keys and values (the step's cost does not depend on them) and the step at slot ``context - 1``
is timed, repeated (median). Per row: the step in ms, the bytes it reads (weights as held + the cache's filled
slots), the rate that makes, and its share of the copy bandwidth measured in the same process (a 512 MiB torch
copy; bytes read + written over time, median of 5). The attention alone (the kernel over the 30 layers'
caches, ``attnlab_quant::decode_attention``) is timed too.

``--baseline-src DIR`` (a ``src`` folder of another attnlab, e.g. the commit before the kernel, exported with
``git archive BASE src | tar -x -C DIR/..``) runs the same contexts over ``--baseline-kv-dtypes`` (default float32,
the only cache the first kernel had) in a child process, alternating with this tree's child, ``--repeats`` times:
a same-run A/B.

    python scripts/bench_decode_attention.py [--contexts 512 2048 7000 8192] [--baseline-src /tmp/base/src]
        [--repeats 2] [--threads 2] [--out bench_decode_attention.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

DTYPES = ("float32", "float16", "bfloat16", "int8")


def cpu_copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """copy_bandwidth's rate over the process's CPU time (one thread: ``--threads 1``), best of ``repeats``."""
    src = torch.ones(megabytes * 2**18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy faults the pages in
        c0 = time.process_time()
        dst.copy_(src)
        best = min(best, time.process_time() - c0)
    return 2 * src.nbytes / best


def child(contexts: list[int], dtypes: list[str], steps: int) -> list[dict[str, object]]:
    """The rows of this process's attnlab (whatever ``import attnlab`` finds)."""
    import attnlab
    from attnlab.bench.decode import copy_bandwidth  # reads + writes of a torch copy, best of 5

    model, _ = attnlab.from_pretrained("smollm2", dtype="gguf")
    assert model.has_fused_decode, "the fused C++ decode step did not load: nothing to time"
    a = model.config
    G, D = a.n_kv_head, a.head_dim
    kernel = getattr(torch.ops.attnlab_quant, "decode_attention", None) if hasattr(torch.ops, "attnlab_quant") else None
    rows = []
    bandwidth = copy_bandwidth(torch.device("cpu"), megabytes=512)
    cpu_bandwidth = cpu_copy_bandwidth()
    for ctx in contexts:
        for kv in dtypes:
            S = ctx  # slots 0..ctx-2 filled, the step writes slot ctx-1 and attends over all ctx
            caches = model.setup_caches(1, S) if kv == "float32" else model.setup_caches(1, S, kv)
            gen = torch.Generator().manual_seed(0)
            for c in caches:
                c.update(torch.randn(1, G, ctx - 1, D, generator=gen), torch.randn(1, G, ctx - 1, D, generator=gen))
            idx, pos = torch.tensor([[17]]), torch.tensor([[ctx - 1]])
            times, cpu = [], []
            with torch.no_grad():
                for _ in range(steps + 1):  # the first warms up
                    t0, c0 = time.perf_counter(), time.process_time()
                    model(idx, positions=pos, caches=caches, cache_positions=torch.tensor([ctx - 1]), only_last=True)
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
            step = statistics.median(times[1:])
            step_cpu = statistics.median(cpu[1:])
            cache_bytes = sum(c.bytes_per_token for c in caches) * S  # the step reads slots 0..ctx-1
            read = model.weight_bytes() + cache_bytes
            row: dict[str, object] = {
                "context": ctx,
                "kv_dtype": kv,
                "step_ms": 1e3 * step,
                "step_cpu_ms": 1e3 * step_cpu,  # the process's CPU time: what a busy machine's waits do not inflate
                "cache_mb": cache_bytes / 1e6,
                "read_mb": read / 1e6,
                "gb_per_s": read / step / 1e9,
                "copy_gb_per_s": bandwidth / 1e9,
                "share_of_copy": read / step / bandwidth,
                "cpu_copy_gb_per_s": cpu_bandwidth / 1e9,
                "cpu_share_of_copy": read / step_cpu / cpu_bandwidth,
            }
            if kernel is not None:  # the attention alone: one call per layer over its cache
                q = torch.randn(1, a.n_head, D)
                att = []
                for _ in range(steps + 1):
                    c0 = time.process_time()
                    for c in caches:
                        kernel(q, c.k, c.v, c.k_scale, c.v_scale, None, S, D**-0.5, -1)
                    att.append(time.process_time() - c0)
                row["attention_cpu_ms"] = 1e3 * statistics.median(att[1:])
                row["attention_cpu_share_of_copy"] = cache_bytes / statistics.median(att[1:]) / cpu_bandwidth
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            del caches
    return rows


def run_child(src: Path, contexts: list[int], dtypes: list[str], steps: int, threads: int) -> list[dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, __file__, "--child", "--steps", str(steps), "--threads", str(threads), "--contexts",
           *map(str, contexts), "--kv-dtypes", *dtypes]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the child for {src} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 7000, 8192])
    p.add_argument("--kv-dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--baseline-src", type=Path, default=None, help="another attnlab's src folder, run alternated")
    p.add_argument("--baseline-kv-dtypes", nargs="+", default=["float32"], choices=DTYPES, help="the baseline's caches")
    p.add_argument("--repeats", type=int, default=2, help="child runs per side, alternated")
    p.add_argument("--steps", type=int, default=9, help="timed steps per row (median)")
    p.add_argument("--threads", type=int, default=1, help="1: CPU time measures the step on a busy machine")
    p.add_argument("--out", default="bench_decode_attention.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.contexts, args.kv_dtypes, args.steps)))
        return 0
    ours = Path(__file__).resolve().parents[1] / "src"
    sides = [("this tree", ours, args.kv_dtypes)]
    if args.baseline_src is not None:
        sides.insert(0, ("baseline", args.baseline_src.resolve(), args.baseline_kv_dtypes))
    runs: dict[str, list[list[dict[str, object]]]] = {name: [] for name, _, _ in sides}
    for r in range(args.repeats):
        for name, src, dtypes in sides:
            print(f"repeat {r + 1}/{args.repeats}: {name} ({src})", file=sys.stderr, flush=True)
            runs[name].append(run_child(src, args.contexts, dtypes, args.steps, args.threads))
    table = []
    for name, _, _ in sides:
        for i, first in enumerate(runs[name][0]):
            cells = [run[i] for run in runs[name]]
            row = {"side": name, "context": first["context"], "kv_dtype": first["kv_dtype"]}
            for key in ("step_ms", "step_cpu_ms", "attention_cpu_ms", "read_mb", "gb_per_s", "copy_gb_per_s",
                        "share_of_copy", "cpu_copy_gb_per_s", "cpu_share_of_copy", "attention_cpu_share_of_copy"):  # fmt: skip
                if key in first:
                    row[key] = statistics.median(float(c[key]) for c in cells)  # type: ignore[arg-type]
            table.append(row)
    print("cpu columns: the process's CPU time (robust to a busy machine with --threads 1); share: of the copy rate")
    print(f"{'side':<10} {'ctx':>5} {'kv':<9} {'wall ms':>8} {'cpu ms':>8} {'attn cpu':>8} {'MB read':>8} "
          f"{'copy GB/s':>9} {'share':>6} {'attn share':>10}")  # fmt: skip
    for row in table:
        attn = f"{row['attention_cpu_ms']:8.2f}" if "attention_cpu_ms" in row else "       -"
        attn_share = f"{row['attention_cpu_share_of_copy']:10.2f}" if "attention_cpu_ms" in row else "         -"
        print(f"{row['side']:<10} {row['context']:>5} {row['kv_dtype']:<9} {row['step_ms']:8.2f} {row['step_cpu_ms']:8.2f} "
              f"{attn} {row['read_mb']:8.1f} {row['cpu_copy_gb_per_s']:9.1f} {row['cpu_share_of_copy']:6.2f} {attn_share}")  # fmt: skip
    Path(args.out).write_text(json.dumps({"threads": args.threads, "rows": table, "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
