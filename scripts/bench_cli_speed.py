"""The decode speed users meet, against the speed the benchmark claims: one run, one machine, the same GGUF.

Three measurements of SmolLM2-135M-Instruct at batch 1, each in its own process as a user would start it:

1. ``attnlab bench-decode --model smollm2 --dtype gguf --batch-sizes 1 --max-new-tokens 64 --repeats 3``: the
   README's figure (attnlab's GGUF path, and llama.cpp on the same file when ``llama_cpp`` imports);
2. ``attnlab generate --model smollm2 --chat --prompt 'Explain attention in one paragraph.' --temperature 0
   --max-new-tokens 100`` on its defaults, ``--repeats`` times: the rate its ``attnlab: prefill ...; decode ...``
   line prints, and its prefill (the model loaded -> the first token);
3. the demo's SmolLM2 step (``attnlab.tools.demo._real_model_answer``): the rate its ``speed:`` line prints, and
   its prefill.

Prints each rate and its share of the benchmark's; writes them with the CPU to ``--out`` as JSON.

    python scripts/bench_cli_speed.py [--out docs/bench/cli_speed.json] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from attnlab.runtime import cpu_info
from attnlab.tools.demo import QUESTION, REAL_MODEL_TOKENS

ATTNLAB = [sys.executable, "-m", "attnlab"]
GENERATE = [
    "generate", "--model", "smollm2", "--chat", "--prompt", QUESTION, "--temperature", "0",
    "--max-new-tokens", str(REAL_MODEL_TOKENS),
]  # fmt: skip
BENCH = ["bench-decode", "--model", "smollm2", "--dtype", "gguf", "--batch-sizes", "1", "--max-new-tokens", "64"]
BENCH += ["--repeats", "3"]
RATE = re.compile(
    r"^attnlab: prefill (\d+) tokens? in ([\d.]+) s .*; decode (\d+) tokens? in ([\d.]+) s \(([\d.]+) tokens/s\)$",
    re.M,
)
DEMO_SPEED = re.compile(r"^speed: attnlab decoded (\d+) tokens at ([\d.]+) tokens/s", re.M)


def run(argv: list[str], threads: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{shlex.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return done


def bench(threads: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        run([*ATTNLAB, *BENCH, "--threads", str(threads), "--out-dir", out], threads)
        (row,) = json.loads((Path(out) / "decode_model.json").read_text())["results"]
    return {name: row[name]["tokens_per_s"] for name in ("attnlab gguf", "llama.cpp") if name in row}


def generate(threads: int) -> dict[str, float]:
    err = run([*ATTNLAB, *GENERATE], threads).stderr
    m = RATE.search(err)
    if m is None:
        sys.exit(f"no rate line in attnlab generate's stderr:\n{err}")
    weights = next(ln for ln in err.splitlines() if ln.startswith("attnlab: weights "))
    return {"tokens_per_s": float(m[5]), "decoded": int(m[3]), "prefill_s": float(m[2]), "weights": weights}


def demo(threads: int) -> dict[str, float]:
    code = "from attnlab.tools.demo import _real_model_answer; _real_model_answer()"
    done = run([sys.executable, "-c", code], threads)
    m, rate = DEMO_SPEED.search(done.stdout), RATE.search(done.stderr)
    if m is None or rate is None:
        sys.exit(f"no speed line in the demo's step:\n{done.stdout}\n{done.stderr}")
    line = m.string[m.start() :].splitlines()[0]
    return {"tokens_per_s": float(m[2]), "decoded": int(m[1]), "prefill_s": float(rate[2]), "line": line}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/bench/cli_speed.json"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="generate and demo runs (the median is kept)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print("bench-decode ...", flush=True)
    ref = bench(a.threads)
    runs = {"generate": [], "demo": []}
    for i in range(a.repeats):
        print(f"generate and demo, run {i + 1} of {a.repeats} ...", flush=True)
        runs["generate"].append(generate(a.threads))
        runs["demo"].append(demo(a.threads))
    ours = ref["attnlab gguf"]
    result = {
        "cpu": cpu_info(),
        "threads": a.threads,
        "torch": torch.__version__,
        "bench_decode": ref,
        "generate_command": ["attnlab", *GENERATE],
        "generate": runs["generate"],
        "demo": runs["demo"],
    }
    for name in ("generate", "demo"):
        median = statistics.median(r["tokens_per_s"] for r in runs[name])
        result[f"{name}_median_tokens_per_s"] = median
        result[f"{name}_share_of_bench"] = median / ours
    result["max_prefill_s"] = max(r["prefill_s"] for name in runs for r in runs[name])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{cpu_info()['model']}, {a.threads} threads, SmolLM2 GGUF, batch 1, tokens/s (median of {a.repeats})")
    print(f"  bench-decode, attnlab gguf      {ours:7.1f}")
    if "llama.cpp" in ref:
        print(f"  bench-decode, llama.cpp         {ref['llama.cpp']:7.1f}  ({ours / ref['llama.cpp']:.2f}x)")
    for name in ("generate", "demo"):
        print(
            f"  {name:<31} {result[f'{name}_median_tokens_per_s']:7.1f}  "
            f"({100 * result[f'{name}_share_of_bench']:.0f}% of bench-decode)"
        )
    print(f"  the first token after the model loaded (generate and demo): at most {result['max_prefill_s']:.2f} s")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
