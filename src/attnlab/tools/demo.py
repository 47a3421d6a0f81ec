"""``attnlab demo``: the end-to-end tour, in under 3 minutes on 2 CPU cores.

1. Seed 000's test case (batch 2, seq 10, dim 64, heads 8), run for real, every stage traced.
2. A short verification: ``attnlab check`` on the module.
3. A training run on the lab's default task, with its progress bar and curve.
4. A few held-out prompts completed by the trained model with the KV cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..core.attention import MultiHeadAttention
from .trace import trace


def _section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 70 - len(title)))


def demo(out: Path = Path("runs/demo"), seed: int = 0, train: bool = True) -> int:
    """The tour: seed-000 trace, verification, training on the default task, KV-cache samples.

    Args:
        out: directory for the training run's artifacts.
        seed: torch.manual_seed for the seed-000 case and the training run.
        train: run steps 3 and 4 (training and generation); --no-train stops after the verification.
    """
    start = time.perf_counter()
    _section("1. seed 000: MultiHeadAttention(64, 8) on x of shape (2, 10, 64)")
    torch.manual_seed(seed)
    x = torch.randn(2, 10, 64)
    mha = MultiHeadAttention(64, 8).eval()
    out_t = mha(x, x)  # seed 000: mha(x, x) is self-attention
    print(f"input  x: {list(x.shape)}  (batch, seq, model_dim)")
    print(f"output  : {list(out_t.shape)}  (batch, seq, model_dim), head_dim = {mha.head_dim}")
    print(f"backend : {mha.last_backend}" + (f" ({mha.last_backend_reason})" if mha.last_backend_reason else ""))
    _, weights = mha(x, need_weights=True)
    print(
        f"weights : {list(weights.shape)}  (batch, heads, query, key) via backend "
        f"{mha.last_backend!r}: {mha.last_backend_reason}"
    )
    print("\nEvery stage of the same call on the math backend, shapes read off the real tensors:\n")
    mha.backend = "math"
    with trace(mha) as calls:
        mha(x, x)
    print(calls[0].to_text())

    _section("2. verification: attnlab check against the float64 reference")
    from ..check import run_checks

    report = run_checks(MultiHeadAttention(32, 4, num_kv_heads=2, dropout=0.1), seed=seed)
    fmt = lambda v: f"{v:.2e}" if isinstance(v, float) else str(v)
    for r in report.results:
        print(f"  {r.status.upper():4s}  {r.name:26s} measured {fmt(r.measured):>18}   allowed {fmt(r.tolerance)}")
    print(
        f"{sum(r.status == 'pass' for r in report.results)} passed, {len(report.failures)} failed "
        f"(GQA module, backend 'auto'; `attnlab check` runs every backend)"
    )
    if report.failures:
        return 1
    if not train:
        print(f"\ndone in {time.perf_counter() - start:.0f}s (training skipped).")
        return 0

    _section("3. training: TinyGPT on the copy task (attention must read 13 positions back)")
    from ..lab.config import demo_config
    from ..lab.samples import heldout_samples, print_samples
    from ..lab.train import train as run_training

    cfg = demo_config(run_dir=out)
    cfg.seed = cfg.data.seed = seed
    result = run_training(cfg)

    _section("4. held-out prompts completed greedily with the KV cache")
    print_samples(heldout_samples(result, n=4))

    _section("artifacts")
    run_dir = result.run_dir
    assert run_dir is not None
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
