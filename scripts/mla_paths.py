"""Milliseconds of one MLA layer call, naive vs absorbed path, and which one ``path="auto"`` picks.

    PYTHONPATH=src python scripts/mla_paths.py [--threads 1] [--repeats 20]

One :class:`attnlab.MultiHeadLatentAttention` at DeepSeek-V3's shapes scaled down (E=1024, H=16, C=256, R=32,
N=Dv=64, no query latent), fp32, eval, no grad. A case ``T_q x S`` is ``T_q`` new tokens appended to an
:class:`attnlab.core.mla_cache.MLACache` already holding ``S - T_q`` rows (random), causal: ``T_q=1`` is a decode
step, ``T_q=S`` a prefill. Each figure is the median of ``--repeats`` timed calls after 3 warm-up calls; the
cache's fill level is reset before every call, so each call does the same work. A CPU measurement (whatever
cores this machine lends, shared ones are noisy): rough figures, for the shape of the trade-off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnlab.core.mla import MultiHeadLatentAttention, path_costs
from attnlab.core.mla_cache import MLACache
from attnlab.core.rope import rope_cos_sin

SHAPE = {"kv_lora_rank": 256, "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64}
HIDDEN, HEADS = 1024, 16
CASES = [(1, 256), (1, 4096), (16, 4096), (64, 4096), (256, 4096), (256, 256), (1024, 1024)]


def time_call(mla: MultiHeadLatentAttention, cache: MLACache, x: torch.Tensor, start: int, repeats: int) -> float:
    """Median milliseconds of ``mla(x)`` appended at slot ``start`` of ``cache``."""
    T = x.size(1)
    rope = rope_cos_sin(torch.arange(start, start + T), mla.qk_rope_head_dim)
    times = []
    for i in range(3 + repeats):
        cache.length = start
        t0 = time.perf_counter()
        mla(x, rope=rope, kv_cache=cache, is_causal=True)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on shared cores)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(HIDDEN, HEADS, **SHAPE).eval()
    print(f"E={HIDDEN}, H={HEADS}, " + ", ".join(f"{k}={v}" for k, v in SHAPE.items()) + f"; {args.threads} thread(s)")
    print(f"{'T_q':>5} {'S':>5} {'naive ms':>9} {'absorbed ms':>12} {'faster':>9} {'auto picks':>10}")
    with torch.no_grad():
        for T, S in CASES:
            cache = MLACache.for_module(mla, 1, S)
            cache.kv.normal_()
            x = torch.randn(1, T, HIDDEN)
            ms = {}
            for path in ("naive", "absorbed"):
                mla.path = path
                ms[path] = time_call(mla, cache, x, S - T, args.repeats)
            naive, absorbed = path_costs(T, S, heads=HEADS, **SHAPE)
            pick = "absorbed" if absorbed <= naive else "naive"
            faster = min(ms, key=ms.__getitem__)
            print(f"{T:>5} {S:>5} {ms['naive']:>9.2f} {ms['absorbed']:>12.2f} {faster:>9} {pick:>10}")


if __name__ == "__main__":
    main()
