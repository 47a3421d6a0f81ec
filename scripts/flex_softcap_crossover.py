"""Where flex overtakes the math reference for logit soft-capping (Gemma 2's softcap), CPU inference.

SDPA cannot apply ``C * tanh(s / C)`` inside its softmax, so without flex a softcap call runs the math
backend, which materialises the ``(B, H, T, T)`` scores. This times ``MultiHeadAttention(softcap=C)``
with ``backend="math"`` and ``backend="flex"`` (compiled; its first call per shape, the compilation, is
reported apart) under ``torch.no_grad()``, B=1, E=512, H=8, causal, and prints the speed-up per T:
the figures behind ``FLEX_CROSSOVERS[("cpu", False, "softcap")]`` in ``attnlab/core/flex.py``.

    python scripts/flex_softcap_crossover.py --lengths 128 256 512 1024 2048 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnlab import MultiHeadAttention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--softcap", type=float, default=50.0, help="Gemma 2's attention softcap")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mods = {b: MultiHeadAttention(512, 8, softcap=args.softcap, backend=b).eval() for b in ("math", "flex")}
    mods["flex"].load_state_dict(mods["math"].state_dict())
    print(
        f"softcap={args.softcap}, E=512, H=8, B=1, causal, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'T':>6} {'math ms':>9} {'flex ms':>9} {'speed-up':>9} {'flex 1st call s':>16}")
    with torch.no_grad():
        for T in args.lengths:
            x = torch.randn(1, T, 512)
            t0 = time.perf_counter()
            out = mods["flex"](x, is_causal=True)
            first = time.perf_counter() - t0
            torch.testing.assert_close(out, mods["math"](x, is_causal=True), atol=1e-4, rtol=1e-4)
            times: dict[str, list[float]] = {b: [] for b in mods}
            for rep in range(args.repeats + 1):  # interleaved; the first round is a warm-up
                for b, m in mods.items():
                    t0 = time.perf_counter()
                    m(x, is_causal=True)
                    if rep:
                        times[b].append(time.perf_counter() - t0)
            ms = {b: 1e3 * statistics.median(t) for b, t in times.items()}
            print(f"{T:>6} {ms['math']:>9.1f} {ms['flex']:>9.1f} {ms['math'] / ms['flex']:>8.2f}x {first:>16.2f}")


if __name__ == "__main__":
    main()
