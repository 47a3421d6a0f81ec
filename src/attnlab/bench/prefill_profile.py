"""Where a prefill's time and memory go: ``python -m attnlab.bench.prefill_profile [--lengths 512 2048 7000]``.

For each prompt length it runs SmolLM2's prefill (the GGUF as stored, batch 1) two ways and prints one row each:

* ``position``: every slot of the cache buffer attended through a mask, as :func:`attnlab.generate` prefilled
  before issue 51 (``cache_positions = 0 .. T-1`` over a ``T + 64``-slot cache, with the padding mask of every
  slot: a ``(1, 1, T, T + 64)`` bool mask and its float copy shared by the layers);
* ``append`` (chunk C): :func:`attnlab.models.generation.prefill` as it is now, C queries a call over the
  slots filled so far.

Each row: the wall time, the share of it per op class under ``torch.profiler`` (attention: SDPA; matmuls: the
quantized and float matmuls; norms: RMSNorm; masks: building the masks; other: everything else, RoPE, SwiGLU's
product, copies, the embedding), and the process's peak resident set above its level before the call.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..models import decoder as decoder_module
from ..models.blocks import RMSNorm
from ..models.generation import positions_from_padding, prefill
from ..quant.layers import QuantLinear
from .memory import PeakMemory

__all__ = ["CLASSES", "classify", "profile_prefill"]

CLASSES = ("attention", "matmuls", "norms", "masks", "other")
_ATTENTION = ("scaled_dot_product", "flash_attention", "attnlab::attention")


def _scope(name: str) -> Callable[..., Any]:
    """A forward pre-hook and hook pair opening a ``record_function(name)`` scope around a module's forward."""
    scopes: list[Any] = []

    def enter(module: nn.Module, args: Any) -> None:
        scopes.append(torch.autograd.profiler.record_function(name).__enter__())

    def leave(module: nn.Module, args: Any, out: Any) -> None:
        scopes.pop().__exit__(None, None, None)

    return lambda m: (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))


def classify(events: Any) -> dict[str, float]:
    """Seconds of self CPU time per class in :data:`CLASSES`, from a profile's ``events()``: an op belongs to the
    nearest enclosing scope among ``attnlab::norm``, ``attnlab::matmul`` and ``attnlab::masks``, or to attention
    when it or an enclosing op is SDPA's, else to other."""
    totals = dict.fromkeys(CLASSES, 0.0)
    for ev in events:
        kind, node = "other", ev
        while node is not None:
            name = node.name
            if name == "attnlab::norm":
                kind = "norms"
            elif name == "attnlab::matmul" or name.startswith("attnlab_quant::"):
                kind = "matmuls"
            elif name == "attnlab::masks":
                kind = "masks"
            elif any(a in name for a in _ATTENTION):
                kind = "attention"
            if kind != "other":
                break
            node = node.cpu_parent
        if not ev.name.startswith("attnlab::"):  # scopes' own time is their ops'
            totals[kind] += ev.self_cpu_time_total / 1e6
    return totals


def _run(model: Any, idx: torch.Tensor, mode: str, chunk: int | None) -> None:
    T = idx.size(1)
    S = min(T + 64, model.arch.block_size)  # 64 slots for new tokens, as far as the model's context allows
    pad = torch.zeros(1, S, dtype=torch.bool)
    positions = positions_from_padding(pad)
    caches = model.setup_caches(1, S)
    with torch.no_grad():
        if mode == "position":  # the prefill of before issue 51
            model(
                idx,
                positions=positions[:, :T],
                key_padding_mask=pad,
                caches=caches,
                cache_positions=torch.arange(T),
                only_last=True,
            )
        else:
            prefill(model, idx, positions[:, :T], pad, caches, chunk=chunk)


def profile_prefill(model: Any, length: int, mode: str, chunk: int | None, seed: int = 0) -> dict[str, Any]:
    """One prefill of ``length`` random ids timed under the profiler (its ops are long: the profiler adds
    little), then run again for its peak memory."""
    idx = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    _run(model, idx[:, :64], mode, chunk)  # warm-up
    hooks = []
    for m in model.modules():
        if isinstance(m, RMSNorm | nn.RMSNorm | nn.LayerNorm):
            hooks += _scope("attnlab::norm")(m)
        elif isinstance(m, QuantLinear | nn.Linear):
            hooks += _scope("attnlab::matmul")(m)
    real_masks = decoder_module.decoder_masks

    def masks(*a: Any, **k: Any) -> Any:
        with torch.autograd.profiler.record_function("attnlab::masks"):
            return real_masks(*a, **k)

    decoder_module.decoder_masks = masks
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            _run(model, idx, mode, chunk)
            seconds = time.perf_counter() - start
    finally:
        decoder_module.decoder_masks = real_masks
        for h in hooks:
            h.remove()
    shares = classify(prof.events())
    peak = PeakMemory(torch.device("cpu")).measure(lambda: _run(model, idx, mode, chunk))
    return {"length": length, "mode": mode, "chunk": chunk, "seconds": seconds, "classes": shares, "peak_bytes": peak}


def _row(r: dict[str, Any]) -> str:
    total = sum(r["classes"].values()) or 1.0
    mode = r["mode"] if r["mode"] == "position" else f"append, chunk {r['chunk'] or 'none'}"
    cells = [f"{100 * r['classes'][c] / total:.0f}%" for c in CLASSES]
    peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
    return (
        f"| {r['length']} | {mode} | {r['seconds']:.2f} | {r['length'] / r['seconds']:.0f} | "
        + " | ".join(cells)
        + f" | {peak} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 7000])
    parser.add_argument("--chunks", type=str, nargs="+", default=["none", "2048"], help="append-mode chunk sizes")
    parser.add_argument("--no-position", action="store_true", help="leave out the position-mode rows")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--layers", type=int, default=None, help="keep the first N blocks: a layer's share, in 1/30 of the time"
    )
    args = parser.parse_args(argv)
    from ..runtime import release_freed_heap
    from ..weight_files.pretrained import from_pretrained, smollm2_path

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model: Any
    model, _ = from_pretrained(smollm2_path(), dtype="gguf")
    if args.layers is not None:  # the first N blocks: every block is alike, so each class's share is a block's
        del model.blocks[args.layers :]
        model.arch = dataclasses.replace(model.arch, n_layer=args.layers)
    release_freed_heap()
    layers = f"{len(model.blocks)} of {model.config.n_layer} layers"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {layers}, load average {os.getloadavg()}")
    print("| tokens | prefill | seconds | tokens/s | " + " | ".join(CLASSES) + " | peak MiB above start |")
    print("|---:|---|---:|---:|" + "---:|" * len(CLASSES) + "---:|", flush=True)
    chunks = [None if c == "none" else int(c) for c in args.chunks]
    for length in args.lengths:
        modes = ([("position", None)] if not args.no_position else []) + [("append", c) for c in chunks]
        for mode, chunk in modes:
            print(_row(profile_prefill(model, length, mode, chunk)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
