"""A Gemma-2-shaped model at T=4096: Hugging Face's eager attention against ``attn_implementation="attnlab"``.

transformers refuses ``attn_implementation="sdpa"`` for Gemma 2 (its soft-capping is not expressible
in SDPA), so on a machine without flash/flex kernels its users run eager attention, which holds
every ``H x T x T`` score, several times over (scores, /cap, tanh, *cap, +mask, softmax). attnlab's
attention computes the same function in blocks of queries, each over the keys it may see.

The attention is Gemma-2-2B's: 8 query heads, 4 K/V heads, head_dim 256, query_pre_attn_scalar 256,
attention soft-capping 50, final logit soft-capping 30, sliding and full layers alternating; the
window is 2048 rather than 4096 so that it bites at T=4096. The rest is reduced (hidden 512, MLP
1024, vocab 1000, 2 layers: one sliding, one full) so that on a small CPU the shared work does not
hide the attention. Random init; fp32; one prompt of T tokens, inference (``torch.no_grad``).

Time: median of ``--repeats`` forwards per implementation, their order alternating so that all see
the same machine load. A third row, ``none``, skips attention (HF's masks still built): the rest of
the model, subtracted to give attention's own share. Peak memory: the process's peak resident set above the start of one forward
(:class:`attnlab.bench.memory.PeakMemory`: VmHWM reset through /proc/self/clear_refs, every
allocation of 64 KiB or more its own mmap, so that freed tensors leave the resident set); measured
after the timings. tracemalloc does not see torch's allocations.

    python scripts/gemma2_eager_vs_attnlab.py --seq-len 4096 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import Tensor, nn
from transformers import AttentionInterface, AutoModelForCausalLM, Gemma2Config
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import attnlab.hf
from attnlab.bench.memory import PeakMemory

# "none": attention skipped (each layer's output is its query), HF's masks still built: the rest of the
# model, so that eager's and attnlab's own share of the time and memory can be read off
IMPLEMENTATIONS = ("eager", "attnlab", "none")


def no_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: object, **kwargs: object):
    return query.transpose(1, 2).contiguous(), None  # (B, T, H, D)


def gemma2_shaped(window: int) -> Gemma2Config:
    return Gemma2Config(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,  # layer 0 sliding, layer 1 full
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=window,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096, help="prompt length T")
    ap.add_argument("--window", type=int, default=2048, help="sliding window of the sliding layers")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per implementation")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    attnlab.hf.register()
    AttentionInterface.register("none", no_attention)
    AttentionMaskInterface.register("none", sdpa_mask)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma2_shaped(a.window), attn_implementation="eager").eval()
    ids = torch.randint(1, 1000, (1, a.seq_len), generator=torch.Generator().manual_seed(1))  # (1, T)

    def forward(implementation: str) -> torch.Tensor:
        model.set_attn_implementation(implementation)
        with torch.no_grad():
            return model(ids).logits  # (1, T, V)

    logits = {name: forward(name) for name in IMPLEMENTATIONS}  # also the warm-up
    diff = (logits["attnlab"] - logits["eager"]).abs().max().item()
    del logits
    times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for r in range(a.repeats):  # order alternating, so that a spell of load does not fall on one only
        for name in IMPLEMENTATIONS if r % 2 == 0 else IMPLEMENTATIONS[::-1]:
            t0 = time.perf_counter()
            forward(name)
            times[name].append(time.perf_counter() - t0)
    mem = PeakMemory(torch.device("cpu"))
    peaks: dict[str, float | None] = {}
    if mem.available:
        mem.exact_mode()
        for name in IMPLEMENTATIONS:
            peaks[name] = mem.measure(lambda name=name: forward(name))

    print(
        f"Gemma-2-shaped forward, T={a.seq_len}, B=1, fp32, torch {torch.__version__}, {a.threads} thread(s), "
        f"load average {os.getloadavg()[0]:.1f}; max |logits diff| attnlab vs eager: {diff:.2e}"
    )
    print()
    print("| attention | median s | runs (s) | peak MiB above start | attention's own s | attention's own MiB |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    median = {name: statistics.median(times[name]) for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:
        peak, floor = peaks.get(name), peaks.get("none")
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        mib = "n/a" if peak is None else f"{peak / 2**20:.0f}"
        own_mib = "n/a" if peak is None or floor is None else f"{(peak - floor) / 2**20:.0f}"
        own_s = median[name] - median["none"]
        print(f"| {name} | {median[name]:.2f} | {runs} | {mib} | {own_s:.2f} | {own_mib} |")
    e, o = median["eager"], median["attnlab"]
    pe, po = peaks.get("eager"), peaks.get("attnlab")
    ratio = "" if not (pe and po) else f", peak memory {pe / po:.1f}x lower"
    print(f"\nwhole forward: attnlab {e / o:.2f}x faster than eager{ratio}")


if __name__ == "__main__":
    main()
