"""Forward (and forward+backward) time of the plain attention paths, this tree against an earlier
commit, measured in one run: the two trees alternate, round by round, in fresh processes.

    .venv/bin/python scripts/ab_forward.py --base 020c00c [--rounds 5]

What it answers: did a change cost the plain path anything? Each round runs every workload once
per tree (order alternating per round), each workload timed as the median of ``--reps`` calls
after a warm-up; the table shows the median over rounds and this tree's time over the base's.
``--base HEAD`` compares the tree with itself: the spread it shows is the machine's noise.
The base is checked out with ``git worktree`` into a temporary folder and removed afterwards.
Workloads are the calls most code makes: ``attnlab.MultiHeadAttention`` (fp32, eval, no_grad:
self-attention, key padding, causal), ``attnlab.compat.MultiheadAttention`` as torch's drop-in
(``need_weights=False`` and the default ``True``), and a bf16 GQA forward+backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs inside each tree's process; prints one JSON object {workload: median seconds}.
WORKER = r"""
import json, sys, time
import torch
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[2]))
from attnlab import MultiHeadAttention
from attnlab.compat import MultiheadAttention

REPS = int(sys.argv[1])
B, T, E, H = 8, 128, 256, 8
x = torch.randn(B, T, E)
pad = torch.zeros(B, T, dtype=torch.bool)
pad[::2, -T // 4 :] = True

def timed(f):
    for _ in range(3):
        f()
    ts = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]

mha = MultiHeadAttention(E, H).eval()
compat = MultiheadAttention(E, H, batch_first=True).eval()
gqa = MultiHeadAttention(E, H, num_kv_heads=2, dtype=torch.bfloat16)
xb = x.to(torch.bfloat16).requires_grad_()

def fwd_bwd():
    gqa(xb, is_causal=True).sum().backward()

out = {}
with torch.no_grad():
    out["MultiHeadAttention self"] = timed(lambda: mha(x))
    out["MultiHeadAttention padding"] = timed(lambda: mha(x, key_padding_mask=pad))
    out["MultiHeadAttention causal"] = timed(lambda: mha(x, is_causal=True))
    out["compat need_weights=False"] = timed(lambda: compat(x, x, x, key_padding_mask=pad, need_weights=False))
    out["compat need_weights=True"] = timed(lambda: compat(x, x, x, key_padding_mask=pad))
out["bf16 GQA causal fwd+bwd"] = timed(fwd_bwd)
# tiny sizes: what is left is the Python of the call path itself, where a change's overhead would show
xt = torch.randn(1, 8, 64)
mha_t, compat_t = MultiHeadAttention(64, 4).eval(), MultiheadAttention(64, 4, batch_first=True).eval()
with torch.no_grad():
    out["tiny MultiHeadAttention (1x8x64)"] = timed(lambda: mha_t(xt))
    out["tiny compat need_weights=False"] = timed(lambda: compat_t(xt, xt, xt, need_weights=False))
print(json.dumps(out))
"""


def run_tree(src: Path, reps: int, threads: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run(
        [sys.executable, "-c", WORKER, str(reps), str(threads)], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"the worker failed in {src}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against, e.g. 020c00c")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="attnlab-ab-") as tmp:
        base_dir = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base_dir), args.base],
            check=True,
            capture_output=True,
        )
        try:
            trees = {"base": base_dir / "src", "this": ROOT / "src"}
            times: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
            for r in range(args.rounds):
                order = ["base", "this"] if r % 2 == 0 else ["this", "base"]
                for name in order:
                    for work, t in run_tree(trees[name], args.reps, args.threads).items():
                        times[name].setdefault(work, []).append(t)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)], check=False)
    print(f"{cpu_name()}, {args.threads} threads, {args.rounds} rounds x {args.reps} calls; base = {args.base}")
    print("| workload | base ms | this ms | this / base |\n|---|---:|---:|---:|")
    for work in times["base"]:
        b, t = statistics.median(times["base"][work]), statistics.median(times["this"][work])
        print(f"| {work} | {b * 1e3:.3f} | {t * 1e3:.3f} | {t / b:.3f} |")


if __name__ == "__main__":
    main()
