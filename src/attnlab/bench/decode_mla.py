"""``attnlab bench-decode --mla``: one decode step of a multi-head latent attention model, naive path against
absorbed path, beside a grouped-query model of the same width and about the same cache, and where the two MLA
paths cross on this machine.

Notation: S cached tokens a step reads (the new one included), T_q queries of one call, E hidden size, H heads,
C ``kv_lora_rank``, R ``qk_rope_head_dim``, N ``qk_nope_head_dim``, Dv ``v_head_dim``, L layers, G the GQA
model's K/V heads, D = E / H its head dim, s bytes per value. Batch 1 throughout.

The models are attention only: L pre-norm residual layers ``x = x + attn(RMSNorm(x))``, no MLP, no embedding, no
vocabulary. What the rows share (an MLP, a head) would add the same milliseconds to each; left out, the rows
differ only where the attentions do. The GQA model is :class:`attnlab.MultiHeadAttention` with ``num_kv_heads=G``
and RoPE over its whole head; by default G is the divisor of H whose cache ``2*G*D`` is nearest MLA's ``C + R``
(DeepSeek-V2's own comparison: MLA caches as much as GQA with 2.25 groups of its 128-wide heads), so the two
spend one memory budget per token and differ in what they do with it.

A step is timed at a cache holding S - 1 tokens: one new token is appended and attends to all S (the fill level
is reset before each call, so every call does the same work). Runners are interleaved inside each repeat, and
the medians reported. Bytes read per token (all layers), the floor under a step's time on a machine bound by
memory: every weight once, plus

* MLA naive: the latent rows ``S*(C+R)*s``, and the per-head keys and values that ``kv_b_proj`` expands them
  into, read back by attention, ``S*H*(N+R+Dv)*s``;
* MLA absorbed: the latent rows once, ``S*(C+R)*s`` (they are the keys; their first C channels the values);
* GQA: its K/V cache ``S*2*G*D*s``.

That over this run's ``copy_bandwidth()`` is the share of the bandwidth limit a row reaches.
"""

from __future__ import annotations

import itertools
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention
from ..core.kv_cache import KVCache
from ..core.mla import MultiHeadLatentAttention, path_costs
from ..core.mla_cache import MLACache
from ..core.rope import rope_cos_sin
from ..runtime import (
    UsageError,
    atomic_write_text,
    check_fits,
    check_range,
    check_writable_dir,
    gib,
    resolve_device,
    resolve_dtype,
)
from .output import check_room
from .table import aligned, terminal_width, wrap

__all__ = ["DEFAULT_MLA_CONFIG", "MLABenchConfig", "bench_decode_mla", "gqa_kv_heads"]


@dataclass(frozen=True)
class MLABenchConfig:
    """The models and lengths of ``bench-decode --mla`` (its ``--mla-config.*`` flags). The defaults are
    DeepSeek-V2-Lite's attention (H=16, C=512, R=64, N=128, Dv=128, no query latent) at half its width and 4 of
    its 27 layers, so that a step over 4096 cached tokens takes about a second on two shared CPU cores."""

    hidden_size: int = 1024
    """E, the width of both models (DeepSeek-V2-Lite: 2048)."""
    num_heads: int = 16
    """H, query heads of both models; the GQA model's head dim is E / H."""
    kv_lora_rank: int = 512
    """C, the latent every token caches (DeepSeek-V2 and V3: 512)."""
    qk_rope_head_dim: int = 64
    """R, the decoupled rotary key shared by all heads (V2, V3: 64); even."""
    qk_nope_head_dim: int = 128
    """N, per-head query/key channels without rotary (V2, V3: 128)."""
    v_head_dim: int = 128
    """Dv, per-head value channels (V2, V3: 128)."""
    num_layers: int = 4
    """L, layers of each model."""
    kv_heads: int | None = None
    """G, the GQA model's K/V heads; default: the divisor of H whose cache 2*G*D per token is nearest C + R."""
    cache_lens: tuple[int, ...] = (256, 4096)
    """S of the timed model rows: a short cache and a long one."""
    sweep_lens: tuple[int, ...] = (16, 64, 256, 1024, 4096)
    """S of the crossover sweep at T_q = 1 (one MLA layer, naive against absorbed)."""
    sweep_queries: tuple[int, ...] = (1, 16, 64, 256)
    """T_q of the crossover sweep over the longest of --mla-config.cache-lens (a chunked prefill's queries)."""
    check_steps: int = 4
    """Greedy steps run by both MLA paths from the same cache, whose outputs must agree."""


DEFAULT_MLA_CONFIG = MLABenchConfig()  # bench-decode's default, and how it tells that no --mla-config flag was given


def gqa_kv_heads(config: MLABenchConfig) -> int:
    """G: the divisor of H whose cache per token and layer, ``2*G*D``, is nearest MLA's ``C + R`` (the smaller
    on a tie), unless ``kv_heads`` names one."""
    if config.kv_heads is not None:
        return config.kv_heads
    H, D = config.num_heads, config.hidden_size // config.num_heads
    target = config.kv_lora_rank + config.qk_rope_head_dim
    return min((g for g in range(1, H + 1) if H % g == 0), key=lambda g: (abs(2 * g * D - target), g))


def _check_config(config: MLABenchConfig) -> None:
    """Every ``--mla-config`` number checked before a model is built; raises :class:`UsageError`."""
    flag = "--mla-config."
    for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        check_range(flag + name.replace("_", "-"), getattr(config, name), low=1, integer=True)
    check_range(f"{flag}num-layers", config.num_layers, low=1, integer=True)
    check_range(f"{flag}check-steps", config.check_steps, low=1, integer=True, hint="naive and absorbed are compared")
    E, H, R = config.hidden_size, config.num_heads, config.qk_rope_head_dim
    if R % 2:
        raise UsageError(
            f"{flag}qk-rope-head-dim {R} is odd; rotary embeddings turn channel pairs: pass {R - 1} or {R + 1}."
        )
    if E % H or (E // H) % 2:
        raise UsageError(
            f"{flag}hidden-size {E} over {flag}num-heads {H} must give an even head dim for the GQA model "
            f"(RoPE turns its channel pairs), got {E / H:g}; pass e.g. {flag}hidden-size {H * 2 * max(1, E // (2 * H))}."
        )
    if config.kv_heads is not None:
        check_range(f"{flag}kv-heads", config.kv_heads, low=1, integer=True, hint="or leave it out for the default")
        if H % config.kv_heads:
            divisors = [g for g in range(1, H + 1) if H % g == 0]
            raise UsageError(
                f"{flag}kv-heads {config.kv_heads} does not divide {flag}num-heads {H}; pass one of {divisors}."
            )
    if not config.cache_lens:
        raise UsageError(f"{flag}cache-lens got no length; pass e.g. {flag}cache-lens 256 4096.")
    for name in ("cache_lens", "sweep_lens", "sweep_queries"):
        for value in getattr(config, name):
            check_range(flag + name.replace("_", "-"), value, low=1, integer=True)
    longest = max(config.cache_lens)
    if config.sweep_queries and max(config.sweep_queries) > longest:
        raise UsageError(
            f"{flag}sweep-queries {max(config.sweep_queries)} exceeds the longest {flag}cache-lens {longest}; "
            f"T_q queries are the last T_q of S cached tokens: pass at most {longest}."
        )


class _Stack(nn.Module):
    """L pre-norm residual attention layers, ``x = x + attn(RMSNorm(x))``: the benchmark's model."""

    def __init__(self, layers: list[nn.Module], width: int, rope_dim: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(width) for _ in layers)
        self.layers = nn.ModuleList(layers)
        self.rope_dim = rope_dim  # R for MLA (its shared rotary key), D for GQA (the whole head)

    def forward(self, x: Tensor, caches: list[Any], start: int) -> Tensor:
        """``x (1, T, E)`` at positions ``start ..``, appended to ``caches`` (one per layer); returns (1, T, E)."""
        positions = torch.arange(start, start + x.size(1), device=x.device)  # (T,)
        rope = rope_cos_sin(positions, self.rope_dim, dtype=x.dtype)  # cos, sin (T, rope_dim)
        for norm, attn, cache in zip(self.norms, self.layers, caches, strict=True):
            x = x + attn(norm(x), rope=rope, kv_cache=cache, is_causal=True)  # (1, T, E)
        return x


def _mla_layer(config: MLABenchConfig) -> MultiHeadLatentAttention:
    return MultiHeadLatentAttention(
        config.hidden_size,
        config.num_heads,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
    )


def _fill(caches: list[Any], length: int, seed: int) -> None:
    """Random rows in every slot (a stand-in for a prompt's), and ``length`` of them counted as filled."""
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        for buf in (cache.kv,) if isinstance(cache, MLACache) else (cache.k, cache.v):
            buf.copy_(torch.randn(buf.shape, generator=gen))  # (1, S, C+R) or (1, G, S, D)
        cache.length = length


def _timed(fn: Callable[[], Tensor], device: torch.device) -> tuple[float, Tensor]:
    """Seconds of one call of ``fn``, the device synchronised on both sides, and what it returned."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, out


def _interleaved(runners: dict[str, Callable[[], Tensor]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median milliseconds of each runner: one warm-up call each, then ``repeats`` rounds of one call each."""
    for fn in runners.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():  # interleaved, so that drift (the other users of the cores) hits all alike
            times[name].append(_timed(fn, device)[0])
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def bench_decode_mla(
    config: MLABenchConfig,
    *,
    repeats: int,
    device: str,
    dtype: str,
    threads: int | None,
    out_dir: Path,
    seed: int,
    copy_bandwidth: Callable[[torch.device], float],
    cpu_report: Callable[[], dict[str, Any]],
) -> int:
    """Time the decode rows and the crossover sweep; print the table, write decode_mla.json and decode_mla.md.

    ``copy_bandwidth`` and ``cpu_report`` are bench/decode.py's (this run's copy rate, and the CPU's model and
    flags), passed in because that module wires this one into ``bench-decode`` and may not be imported back.
    """
    _check_config(config)
    check_range("--repeats", repeats, low=1, integer=True, hint="the median of the timed repeats is reported")
    if threads is not None:
        check_range("--threads", threads, low=1, integer=True, hint="or leave it out for torch's choice")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    _check_fits(config, dt, dev)
    out_dir = check_writable_dir(out_dir, "--out-dir")
    check_room(out_dir, "bench-decode --mla", "decode_mla.json, decode_mla.md")
    if threads is not None:
        torch.set_num_threads(threads)

    E, H, L = config.hidden_size, config.num_heads, config.num_layers
    C, R, N, Dv = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    G, D = gqa_kv_heads(config), E // H
    s = dt.itemsize
    torch.manual_seed(seed)
    mla = _Stack([_mla_layer(config) for _ in range(L)], E, R).to(device=dev, dtype=dt).eval()
    gqa_layers: list[nn.Module] = [MultiHeadAttention(E, H, num_kv_heads=G, bias=False) for _ in range(L)]
    gqa = _Stack(gqa_layers, E, D).to(device=dev, dtype=dt).eval()
    gqa_name = f"GQA G={G}"
    width = terminal_width()
    print(
        wrap(
            f"decode benchmark, MLA model: {L} layers of attention only (pre-norm residual), E={E}, H={H}, C={C}, "
            f"R={R}, N={N}, Dv={Dv}; {gqa_name} (D={D}, nearest cache to MLA's) of the same width; {dev} "
            f"{str(dt).removeprefix('torch.')}, batch 1, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads",
            width,
        ),
        flush=True,
    )
    bandwidth = copy_bandwidth(dev)
    weight_bytes = {
        "MLA naive": _param_bytes(mla),
        "MLA absorbed": _param_bytes(mla),
        gqa_name: _param_bytes(gqa),
    }
    results: list[dict[str, Any]] = []
    with torch.no_grad():
        for S in config.cache_lens:
            mla_caches = [MLACache.for_module(layer, 1, S + config.check_steps) for layer in mla.layers]
            gqa_caches = [KVCache.for_module(layer, 1, S) for layer in gqa.layers]
            _fill(mla_caches, S - 1, seed + S)
            _fill(gqa_caches, S - 1, seed + S)
            x = torch.randn(1, 1, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
            x = x.to(device=dev, dtype=dt)  # (1, 1, E): the new token's hidden state

            ms = _interleaved(
                {
                    "MLA naive": partial(_decode_step, mla, mla_caches, x, S, "naive"),
                    "MLA absorbed": partial(_decode_step, mla, mla_caches, x, S, "absorbed"),
                    gqa_name: partial(_decode_step, gqa, gqa_caches, x, S, None),
                },
                repeats,
                dev,
            )
            cache_read = {"MLA naive": S * (C + R) * s * L, "MLA absorbed": S * (C + R) * s * L}
            cache_read[gqa_name] = S * 2 * G * D * s * L
            expanded = {"MLA naive": S * H * (N + R + Dv) * s * L, "MLA absorbed": 0, gqa_name: 0}
            per_token = {
                "MLA naive": sum(c.bytes_per_token for c in mla_caches),
                "MLA absorbed": sum(c.bytes_per_token for c in mla_caches),
                gqa_name: sum(c.bytes_per_token for c in gqa_caches),
            }
            row: dict[str, Any] = {"cache_len": S}
            for name, t in ms.items():
                read = weight_bytes[name] + cache_read[name] + expanded[name]
                row[name] = {
                    "ms_per_token": t,
                    "tokens_per_s": 1e3 / t,
                    "cache_bytes_per_token": per_token[name],
                    "weight_bytes": weight_bytes[name],
                    "cache_bytes_read": cache_read[name],
                    "expanded_bytes_read": expanded[name],
                    "bytes_read_per_token": read,
                    "bandwidth_fraction": read / bandwidth / (t / 1e3),
                }
            row["naive_absorbed_max_abs_diff"] = _greedy_diff(mla, mla_caches, x, S, config.check_steps, seed)
            results.append(row)
            print(f"cache {S}: done", flush=True)
        sweep = _sweep(config, mla.layers[0], repeats, dev, seed)

    crossover = _crossover_lines(config, sweep)
    cpu = cpu_report()
    report = {
        "config": asdict(config) | {"kv_heads": G, "gqa_head_dim": D},
        "model": "attention only: L pre-norm residual layers x = x + attn(RMSNorm(x)), no MLP",
        "device": str(dev),
        "dtype": str(dt).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "cpu": cpu,
        "copy_GB_per_s": bandwidth / 1e9,
        "repeats": repeats,
        "runners": list(weight_bytes),
        "results": results,
        "sweep": sweep,
        "crossover": crossover,
    }
    names = list(weight_bytes)
    atomic_write_text(out_dir / "decode_mla.json", json.dumps(report, indent=2) + "\n")
    head = f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {cpu.get('model') or platform.machine()}"
    markdown = [head, "", _markdown(results, names), "", _sweep_markdown(sweep), "", *crossover]
    atomic_write_text(out_dir / "decode_mla.md", "\n".join(markdown) + "\n")
    print()
    print(wrap(head, width))
    print(_compact(results, names))
    print()
    print(_sweep_compact(sweep))
    for line in crossover:
        print(wrap(line, width))
    print(wrap(f"wrote {out_dir / 'decode_mla.json'} and {out_dir / 'decode_mla.md'}", width))
    return 0


def _decode_step(model: _Stack, caches: list[Any], x: Tensor, S: int, path: str | None) -> Tensor:
    """One decode step of ``x (1, 1, E)`` over ``S - 1`` cached tokens; ``path``: the MLA layers' (None for GQA)."""
    for cache in caches:
        cache.length = S - 1  # every call appends the same token at the same slot: each does the same work
    if path is not None:
        _set_path(model, path)
    out: Tensor = model(x, caches, S - 1)  # (1, 1, E)
    return out


def _set_path(model: _Stack, path: str) -> None:
    for layer in model.layers:
        if isinstance(layer, MultiHeadLatentAttention):
            layer.path = path


def _layer_call(
    layer: MultiHeadLatentAttention, x: Tensor, rope: tuple[Tensor, Tensor], cache: MLACache, path: str
) -> Tensor:
    """``x (1, T, E)`` appended after ``S - T`` cached tokens (the fill level reset first), along ``path``."""
    cache.length = cache.max_len - x.size(1)
    layer.path = path
    out: Tensor = layer(x, rope=rope, kv_cache=cache, is_causal=True)  # (1, T, E)
    return out


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _check_fits(config: MLABenchConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Both models, their longest caches and the largest naive expansion within this machine's memory."""
    E, H, L, s = config.hidden_size, config.num_heads, config.num_layers, dtype.itemsize
    C, R, N, Dv = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    G, D = gqa_kv_heads(config), E // H
    S = max(config.cache_lens + config.sweep_lens) + config.check_steps
    T = max(config.sweep_queries, default=1)
    mla_weights = E * H * (N + R) + E * (C + R) + C * H * (N + Dv) + H * Dv * E
    weights = L * (mla_weights + 2 * E * H * D + 2 * E * G * D) * s
    caches = L * S * ((C + R) + 2 * G * D) * s
    work = (2 * S * H * (2 * N + R + Dv) + 2 * T * H * S) * s  # naive's keys and values, and the scores
    check_fits(
        weights + caches + work,
        f"bench-decode --mla (weights {gib(weights)}, caches {gib(caches)}, one layer's naive keys, values and "
        f"scores {gib(work)})",
        "pass smaller --mla-config.cache-lens / --mla-config.sweep-lens, or a smaller --mla-config.hidden-size",
        device,
    )


def _greedy_diff(mla: _Stack, caches: list[MLACache], x: Tensor, S: int, steps: int, seed: int) -> float:
    """Largest ``|naive - absorbed|`` over ``steps`` decode steps, each step's output the next step's input, both
    paths from the same cache (refilled before each)."""
    outs: dict[str, list[Tensor]] = {}
    for path in ("naive", "absorbed"):
        _fill(caches, S - 1, seed + S)
        _set_path(mla, path)
        h, outs[path] = x, []
        for k in range(steps):
            h = mla(h, caches, S - 1 + k)  # (1, 1, E), appended at slot S - 1 + k
            outs[path].append(h)
    return max((a - b).abs().max().item() for a, b in zip(outs["naive"], outs["absorbed"], strict=True))


def _path_shape(config: MLABenchConfig) -> dict[str, int]:
    """The sizes :func:`attnlab.core.mla.path_costs` counts with, from the benchmark's config."""
    return {
        "heads": config.num_heads,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
    }


def _sweep(
    config: MLABenchConfig, layer: nn.Module, repeats: int, device: torch.device, seed: int
) -> dict[str, list[dict[str, Any]]]:
    """One MLA layer, naive against absorbed: T_q = 1 over each of ``sweep_lens``, and each of ``sweep_queries``
    over the longest cache length; ms and the path ``path_costs`` would pick, per point."""
    assert isinstance(layer, MultiHeadLatentAttention)
    dtype = next(layer.parameters()).dtype
    points = [(1, S) for S in config.sweep_lens] + [(T, max(config.cache_lens)) for T in config.sweep_queries]
    shape = _path_shape(config)
    measured: list[dict[str, Any]] = []
    for T, S in points:
        cache = MLACache.for_module(layer, 1, S)
        _fill([cache], S - T, seed + S)
        x = torch.randn(1, T, config.hidden_size, generator=torch.Generator().manual_seed(seed))
        x = x.to(device=device, dtype=dtype)  # (1, T, E)
        rope = rope_cos_sin(torch.arange(S - T, S, device=device), config.qk_rope_head_dim, dtype=dtype)

        paths = ("naive", "absorbed")
        ms = _interleaved({p: partial(_layer_call, layer, x, rope, cache, p) for p in paths}, repeats, device)
        naive, absorbed = path_costs(T, S, **shape)
        measured.append(
            {
                "queries": T,
                "cache_len": S,
                "naive_ms": ms["naive"],
                "absorbed_ms": ms["absorbed"],
                "faster": "absorbed" if ms["absorbed"] <= ms["naive"] else "naive",
                "count_picks": "absorbed" if absorbed <= naive else "naive",
            }
        )
    n_lens = len(config.sweep_lens)
    return {"lengths": measured[:n_lens], "queries": measured[n_lens:]}


def _crossing(points: list[dict[str, Any]], key: str, what: str) -> str:
    """Where ``faster`` changes along ``points`` (ordered by ``key``), in words."""
    points = sorted(points, key=lambda p: p[key])
    first = points[0]["faster"]
    for before, after in itertools.pairwise(points):
        if after["faster"] != before["faster"]:
            return (
                f"{before['faster']} is faster up to {what}={before[key]}, {after['faster']} from {what}={after[key]}"
                + ("" if all(p["faster"] == after["faster"] for p in points[points.index(after) :]) else " (and back)")
            )
    return f"{first} is faster at every {what} measured ({points[0][key]} to {points[-1][key]})"


def _crossover_lines(config: MLABenchConfig, sweep: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The crossover, measured and counted (by :func:`attnlab.core.mla.path_costs`), one line per sweep."""
    shape = _path_shape(config)
    lines = []
    if sweep["lengths"]:
        longest = max(p["cache_len"] for p in sweep["lengths"])
        counted = next((S for S in range(1, longest + 1) if _absorbed_cheaper(1, S, shape)), None)
        count = f"from S={counted}" if counted is not None else f"nowhere up to S={longest}"
        lines.append(
            f"crossover at T_q=1 (decode): {_crossing(sweep['lengths'], 'cache_len', 'S')} on this machine; "
            f"the multiply-add count makes absorbed cheaper {count}."
        )
    if sweep["queries"]:
        S = sweep["queries"][0]["cache_len"]
        counted = next((T for T in range(1, S + 1) if not _absorbed_cheaper(T, S, shape)), None)
        count = f"from T_q={counted}" if counted is not None else f"nowhere up to T_q={S}"
        lines.append(
            f"crossover at S={S} (queries per call): {_crossing(sweep['queries'], 'queries', 'T_q')} on this "
            f"machine; the multiply-add count makes naive cheaper {count}."
        )
    return lines


def _absorbed_cheaper(q_len: int, k_len: int, shape: dict[str, int]) -> bool:
    naive, absorbed = path_costs(q_len, k_len, **shape)
    return absorbed <= naive


def _compact(results: list[dict[str, Any]], names: list[str]) -> str:
    """The decode rows for a terminal (80 columns)."""
    header = ("S", "model", "ms/tok", "cache B/tok", "MB read/tok", "%BW", "naive-abs")
    rows = []
    for row in results:
        for k, name in enumerate(names):
            r = row[name]
            cells = [str(row["cache_len"]) if k == 0 else "", name, f"{r['ms_per_token']:.2f}"]
            cells += [str(r["cache_bytes_per_token"]), f"{r['bytes_read_per_token'] / 1e6:.1f}"]
            cells += [f"{100 * r['bandwidth_fraction']:.0f}%"]
            cells.append(f"{row['naive_absorbed_max_abs_diff']:.1e}" if k == 0 else "")
            rows.append(cells)
    legend = (
        "ms per decode step (median, runners interleaved); cache B/tok: bytes one token adds to the cache, all "
        "layers; MB read/tok: weights + cache (+ naive's expanded K/V) a step reads; %BW: that over the copy "
        "rate; naive-abs: max |naive - absorbed| over the greedy steps"
    )
    right = [True, False, True, True, True, True, True]
    return wrap(legend) + "\n" + "\n".join(aligned(header, rows, right=right))


def _markdown(results: list[dict[str, Any]], names: list[str]) -> str:
    header = (
        "| S | model | ms/token | cache bytes/token (all layers) | weights MB | cache MB read | expanded MB read "
        "| MB read/token | % of copy bandwidth | max abs naive - absorbed |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for row in results:
        for name in names:
            r = row[name]
            lines.append(
                f"| {row['cache_len']} | {name} | {r['ms_per_token']:.2f} | {r['cache_bytes_per_token']} | "
                f"{r['weight_bytes'] / 1e6:.1f} | {r['cache_bytes_read'] / 1e6:.1f} | "
                f"{r['expanded_bytes_read'] / 1e6:.1f} | {r['bytes_read_per_token'] / 1e6:.1f} | "
                f"{100 * r['bandwidth_fraction']:.1f}% | {row['naive_absorbed_max_abs_diff']:.1e} |"
            )
    return "\n".join(lines)


def _sweep_rows(sweep: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    return [
        [
            str(p["queries"]),
            str(p["cache_len"]),
            f"{p['naive_ms']:.2f}",
            f"{p['absorbed_ms']:.2f}",
            p["faster"],
            p["count_picks"],
        ]
        for p in sweep["lengths"] + sweep["queries"]
    ]


def _sweep_compact(sweep: dict[str, list[dict[str, Any]]]) -> str:
    header = ("T_q", "S", "naive ms", "absorbed ms", "faster", "count picks")
    title = "crossover sweep: one MLA layer, T_q new tokens over S cached (median ms)"
    return title + "\n" + "\n".join(aligned(header, _sweep_rows(sweep), right=[True] * 4 + [False] * 2))


def _sweep_markdown(sweep: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| T_q | S | naive ms | absorbed ms | faster | path_costs picks |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in _sweep_rows(sweep)]
    return "\n".join(lines)
