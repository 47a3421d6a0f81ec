"""``attnlab bench``: attention forward and forward+backward, side by side, in one run.

Every runner computes the same function with the same weights (checked before timing):

* ``attnlab``          attnlab's module, backend "auto" (SDPA, causal passed as ``is_causal``)
* ``attnlab-math``     attnlab's explicit reference backend
* ``attnlab-compiled`` ``torch.compile(attnlab module)``
* ``torch-mha``        ``torch.nn.MultiheadAttention(need_weights=False)``
* ``floor``            three ``nn.Linear`` + SDPA + ``nn.Linear``: the least work possible
* ``seed-000``         the module exactly as seed 000 wrote it (``masked_fill`` + softmax)
* ``flash-attn``       the ``flash-attn`` package's kernel, on a GPU where it is installed

Timings are interleaved (each repeat runs every runner once, in a rotated order), after a
warm-up, with the device synchronised around each; the median is reported. Tokens per
batch are fixed, so ``B = tokens // T``. FLOPs count the four projections and only the causal
half of the two attention matmuls; forward+backward is counted as 3x forward.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import torch
import torch.nn.functional as F
import tyro
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention
from ..runtime import (
    INTERRUPTS,
    LOCK_NAME,
    RunLock,
    UsageError,
    atomic_write_text,
    check_fits,
    check_range,
    check_writable_dir,
    gib,
    resolve_device,
    resolve_dtype,
)
from .memory import PeakMemory
from .output import check_room, save_png
from .partial import PromptStop, carried_by_interrupts, drop_partial, save_partial
from .seed_module import SeedMultiHeadAttention
from .table import aligned, terminal_width, wrap
from .timing import copy_bandwidth

RUNNERS = ("attnlab", "attnlab-math", "attnlab-compiled", "torch-mha", "floor", "seed-000", "flash-attn")


@dataclass
class BenchConfig:
    """Attention benchmark settings (CPU fp32 by default, bf16 on a GPU)."""

    embed_dim: int = 512
    """E."""
    num_heads: int = 8
    """H."""
    lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    """sequence lengths T to run (8192 fits the fused runners; the math ones are capped by --math-max-len)."""
    tokens: int = 8192
    """tokens per batch: B = tokens // T (at least the longest length)."""
    repeats: int = 5
    """timed repeats per runner and length (median reported)."""
    warmup: int = 1
    """untimed runs first."""
    runners: tuple[str, ...] = RUNNERS
    """which runners (unavailable ones are skipped with the reason)."""
    math_max_len: int = 4096
    """longest T for runners that materialise (B, H, T, T) scores (attnlab-math, seed-000); with --variant
    window, the longest T at which the dense-mask runners also run forward+backward."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps."""
    dtype: str = "auto"
    """auto (float32 on cpu, bfloat16 on cuda), float32, bfloat16, float16 or float64 (or fp32, bf16, fp16, fp64)."""
    memory: bool = True
    """measure peak memory of one forward+backward per runner and length."""
    gemm_size: int = 4096
    """n of the (n, n) @ (n, n) matmul whose best rate is the run's large-GEMM rate."""
    train: bool = True
    """also measure training throughput of the lab's default model (attnlab vs torch attention)."""
    out_dir: Path = Path("bench_results")
    """directory for bench_attention.json, bench_attention.md and bench_attention.png (checked writable first)."""
    seed: int = 0
    variant: Literal["none", "window"] = "none"
    """none: causal attention, the runners above; window: sliding-window attention, flex vs dense-mask SDPA vs
    SDPA on key bands (bench/window.py; B=1, lengths default to 4096 8192 16384)."""
    window: int = 256
    """W of --variant window: query i sees keys i - W < j <= i."""
    context_parallel: int = 1
    """N > 1: context-parallel attention over N ranks, launched as `torchrun --nproc-per-node N -m attnlab bench
    --context-parallel N` (bench/context_parallel.py; lengths default to 4096 16384, --runners ignored)."""
    cp_methods: tuple[str, ...] = ("ring", "alltoall")
    """with --context-parallel: ring (K/V blocks pass around) and/or alltoall (heads exchanged for positions)."""
    cp_layouts: tuple[str, ...] = ("zigzag", "contiguous")
    """with --context-parallel: how the sequence is split over the ranks."""
    cp_causal: bool = True
    """with --context-parallel: causal attention (--no-cp-causal: every query sees every key)."""
    rank_timeout: float = 50.0
    """with --context-parallel: seconds the ranks wait for one that died or stopped answering before all stop."""


# -- runners ---------------------------------------------------------------------------------
class Floor(nn.Module):
    """The least work possible: three Linear, SDPA with is_causal, one Linear."""

    def __init__(self, E: int, H: int) -> None:
        super().__init__()
        self.H = H
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        B, T, E = x.shape
        q = self.q(x).view(B, T, self.H, -1).transpose(1, 2)  # (B, H, T, D)
        k = self.k(x).view(B, T, self.H, -1).transpose(1, 2)  # (B, H, T, D)
        v = self.v(x).view(B, T, self.H, -1).transpose(1, 2)  # (B, H, T, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.o(o.transpose(1, 2).reshape(B, T, E))  # (B, T, E)


class FlashAttnPeer(Floor):
    """Same projections, the flash-attn package's kernel in the middle (GPU only)."""

    def forward(self, x: Tensor) -> Tensor:
        from flash_attn import flash_attn_func

        B, T, E = x.shape
        q = self.q(x).view(B, T, self.H, -1)  # (B, T, H, D): flash-attn's layout, no transpose
        k = self.k(x).view(B, T, self.H, -1)
        v = self.v(x).view(B, T, self.H, -1)
        return self.o(flash_attn_func(q, k, v, causal=True).reshape(B, T, E))  # (B, T, E)


def _copy_weights(ours: MultiHeadAttention, linears: tuple[nn.Linear, ...]) -> None:
    with torch.no_grad():
        for src, dst in zip((ours.q_proj, ours.k_proj, ours.v_proj, ours.out_proj), linears, strict=True):
            dst.weight.copy_(cast(Tensor, src.weight))  # q/k/v_proj are typed nn.Module (a user may swap one)
            dst.bias.copy_(cast(Tensor, src.bias))


def build_runners(
    cfg: BenchConfig, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, Callable[[Tensor, int], Tensor]], dict[str, str]]:
    """name -> fn(x, T) computing causal self-attention; plus name -> why skipped."""
    E, H = cfg.embed_dim, cfg.num_heads
    ours = MultiHeadAttention(E, H, device=device, dtype=dtype)
    with torch.no_grad():
        for p in ours.parameters():  # nonzero biases, so that every runner must really use them
            p.add_(0.02 * torch.randn_like(p))
    runners: dict[str, Callable[[Tensor, int], Tensor]] = {}
    skipped: dict[str, str] = {}
    masks: dict[int, Tensor] = {}

    def causal_float(T: int) -> Tensor:
        if T not in masks:
            masks[T] = torch.ones(1, 1, T, T, device=device, dtype=dtype).tril()  # seed 000: 1 = keep
        return masks[T]

    for name in cfg.runners:
        if name == "attnlab":
            runners[name] = lambda x, T: ours(x, is_causal=True)
        elif name == "attnlab-math":
            math_m = MultiHeadAttention(E, H, backend="math", device=device, dtype=dtype)
            math_m.load_state_dict(ours.state_dict())

            def run_math(x: Tensor, T: int, m: MultiHeadAttention = math_m) -> Tensor:
                return m(x, is_causal=True)

            runners[name] = run_math
        elif name == "attnlab-compiled":
            comp_m = MultiHeadAttention(E, H, device=device, dtype=dtype)
            comp_m.load_state_dict(ours.state_dict())
            compiled = torch.compile(comp_m)

            def run_compiled(x: Tensor, T: int, m: Callable[..., Tensor] = compiled) -> Tensor:
                return m(x, is_causal=True)

            runners[name] = run_compiled
        elif name == "torch-mha":
            t = ours.to_torch(batch_first=True)
            sq: dict[int, Tensor] = {}

            def run_torch(x: Tensor, T: int, t: nn.MultiheadAttention = t, sq: dict[int, Tensor] = sq) -> Tensor:
                if T not in sq:  # torch wants the mask too; with need_weights=False it takes SDPA's is_causal path
                    sq[T] = nn.Transformer.generate_square_subsequent_mask(T, device=device, dtype=dtype)
                return t(x, x, x, attn_mask=sq[T], is_causal=True, need_weights=False)[0]

            runners[name] = run_torch
        elif name == "floor":
            floor = Floor(E, H).to(device=device, dtype=dtype)
            _copy_weights(ours, (floor.q, floor.k, floor.v, floor.o))

            def run_floor(x: Tensor, T: int, m: Floor = floor) -> Tensor:
                return m(x)

            runners[name] = run_floor
        elif name == "seed-000":
            if dtype == torch.float16:  # tried: masked_fill(mask == 0, -1e9) raises, -1e9 overflows float16
                skipped[name] = "seed 000 fills masked scores with -1e9, which float16 cannot hold (its max is 65504)"
                continue
            seed = SeedMultiHeadAttention(E, H).to(device=device, dtype=dtype)
            _copy_weights(ours, (seed.w_q, seed.w_k, seed.w_v, seed.w_o))

            def run_seed(x: Tensor, T: int, m: SeedMultiHeadAttention = seed) -> Tensor:
                return m(x, None, causal_float(T))

            runners[name] = run_seed
        elif name == "flash-attn":
            try:
                import flash_attn  # noqa: F401
            except Exception as err:
                skipped[name] = f"flash-attn not importable ({type(err).__name__})"
                continue
            if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
                skipped[name] = "flash-attn runs on CUDA in fp16/bf16 only"
                continue
            peer = FlashAttnPeer(E, H).to(device=device, dtype=dtype)
            _copy_weights(ours, (peer.q, peer.k, peer.v, peer.o))

            def run_peer(x: Tensor, T: int, m: FlashAttnPeer = peer) -> Tensor:
                return m(x)

            runners[name] = run_peer
        else:
            raise UsageError(f"--runners got {name!r}, expected names among {', '.join(RUNNERS)}.")
    return runners, skipped


# -- measuring -------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(fn: Callable[[Tensor, int], Tensor], x: Tensor, T: int, grad_out: Tensor) -> None:
    fn(x, T).backward(grad_out)


def _zero_grads(x: Tensor) -> None:
    x.grad = None
    gc.collect()


def gemm_gflops(device: torch.device, dtype: torch.dtype, n: int = 4096, repeats: int = 5) -> float:
    """This run's large-GEMM rate: the *best* of a few square (n, n) matmuls, so that a share of
    it is never flattered by one slow GEMM run."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times[1:]) / 1e9


def attention_flops(B: int, T: int, E: int) -> float:
    """Forward FLOPs: 4 projections (2*B*T*E*E each) + causal half of QK^T and PV (B*T*T*E each)."""
    return 8 * B * T * E * E + 2 * B * T * T * E


@dataclass
class Row:
    T: int
    B: int
    runner: str
    fwd_ms: float | None = None
    fwd_bwd_ms: float | None = None
    fwd_gflops: float | None = None
    peak_mib: float | None = None
    note: str = ""


@dataclass
class BenchResult:
    config: dict
    device: str
    dtype: str
    torch: str
    gemm_gflops: float
    cuda: str | None = None  # torch.version.cuda on a GPU
    copy_GB_per_s: float | None = None  # dst.copy_(src) on 256 MB, reads + writes, in the same run
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    train_throughput: dict | None = None
    partial: str | None = None  # why the run stopped early (the rows are the lengths it finished), or None


# On a GPU the CPU-sized defaults measure kernel launches, not attention: at E=512 and 8192 tokens every
# runner took ~2 ms on an H200 and "fwd % of GEMM" read 8-24%. These sizes make the largest GEMM run
# near the device's rate (E >= 1024 gave equal peak memory for attnlab and the floor there).
GPU_SIZES: dict[str, Any] = {
    "embed_dim": 2048,
    "num_heads": 16,
    "tokens": 65536,
    "lengths": (1024, 2048, 4096, 8192, 16384),
}


def gpu_sizes(cfg: BenchConfig) -> BenchConfig:
    """``cfg`` with :data:`GPU_SIZES` when it runs on CUDA and none of those sizes was given (``--variant none``)."""
    if cfg.variant != "none" or not str(resolve_device(cfg.device)).startswith("cuda"):
        return cfg
    if any(getattr(cfg, name) != getattr(BenchConfig, name) for name in GPU_SIZES):
        return cfg  # the user chose sizes: keep them all
    return replace(cfg, **GPU_SIZES)


def validate(cfg: BenchConfig) -> tuple[torch.device, torch.dtype]:
    """Every flag checked before any work; the device and dtype to run in. Raises :class:`UsageError`."""
    if not cfg.lengths:
        raise UsageError("--lengths got no length; pass sequence lengths, e.g. --lengths 128 256 512.")
    for T in cfg.lengths:
        check_range("--lengths", T, low=1, integer=True, hint="each is a sequence length T, e.g. --lengths 128 256")
    longest = max(cfg.lengths)
    check_range(
        "--tokens",
        cfg.tokens,
        low=longest,
        integer=True,
        hint=f"B = tokens // T needs at least one sequence of the longest length {longest}; pass --tokens {longest}",
    )
    check_range("--embed-dim", cfg.embed_dim, low=1, integer=True)
    check_range("--num-heads", cfg.num_heads, low=1, integer=True)
    if cfg.embed_dim % cfg.num_heads:
        divisors = [h for h in range(1, cfg.embed_dim + 1) if cfg.embed_dim % h == 0]
        nearest = sorted(divisors, key=lambda h: abs(h - cfg.num_heads))[:2]
        raise UsageError(
            f"--embed-dim {cfg.embed_dim} is not divisible by --num-heads {cfg.num_heads}; "
            f"pass --num-heads among its divisors (nearest: {sorted(nearest)})."
        )
    check_range("--repeats", cfg.repeats, low=1, integer=True, hint="the median of the timed repeats is reported")
    check_range("--warmup", cfg.warmup, low=0, integer=True)
    check_range("--math-max-len", cfg.math_max_len, low=1, integer=True)
    check_range("--gemm-size", cfg.gemm_size, low=1, integer=True)
    unknown = [n for n in cfg.runners if n not in RUNNERS]
    if unknown or not cfg.runners:
        raise UsageError(
            f"--runners got {list(cfg.runners)}, expected one or more of {', '.join(RUNNERS)}; "
            f"e.g. --runners attnlab floor torch-mha."
        )
    check_range("--window", cfg.window, low=1, integer=True, hint="query i sees keys i - W < j <= i")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    check_memory(cfg, device, dtype)
    check_writable_dir(cfg.out_dir, "--out-dir")
    check_room(cfg.out_dir, "bench", f"bench_{'window' if cfg.variant == 'window' else 'attention'}.json, .md, .png")
    return device, dtype


# -- memory, estimated before anything is allocated -----------------------------------------
# What one length holds at once, counted from the flags. The constants are tensors of the shape named, in the
# run's dtype; they are rounded up from what forward+backward keeps (x, grad_out, the projections' inputs and
# outputs, q/k/v/context and their gradients), so that a run refused is one that could not have fitted.
ACTIVATION_COPIES = 16  # (B, T, E): one fused runner's forward+backward, x and grad_out included
SCORE_COPIES = 4  # (B, H, T, T): a math runner's scores, softmax weights and both their gradients
COPY_BYTES = 2 * 256 * 2**20  # copy_bandwidth's two 256 MiB buffers


def memory_parts(cfg: BenchConfig, itemsize: int) -> tuple[int, dict[str, int]]:
    """``(T, bytes by part)`` at the length that holds the most at once: weights, activations, the ``(T, T)``
    masks torch-mha and seed-000 keep per length, the math runners' ``(B, H, T, T)`` scores, and the GEMM
    and copy probes (which run alone, beside the weights)."""
    E, H, runners = cfg.embed_dim, cfg.num_heads, set(cfg.runners)
    if cfg.variant == "window":  # B = 1; attnlab-auto/flex/dense share weights with the projections runner
        weights = 3 * 4 * E * E * itemsize * 2  # weights and their gradients
        T = max(cfg.lengths)
        return T, {
            "weights": weights,
            "activations": ACTIVATION_COPIES * T * E * itemsize,
            "the (T, T) window mask": T * T,
            "sdpa-dense's (H, T, T) scores": SCORE_COPIES * H * T * T * itemsize,
        }
    weights = (len(runners) + 1) * 4 * E * E * itemsize * 2  # each runner's module and attnlab's, weights and grads
    probes = max(3 * cfg.gemm_size**2 * itemsize, COPY_BYTES)
    worst: tuple[int, dict[str, int]] = (0, {})
    masks = 0  # torch-mha's and seed-000's cached (T, T) masks of every length so far
    for T in cfg.lengths:
        B = max(1, cfg.tokens // T)
        math_len = T <= cfg.math_max_len
        masks += T * T * itemsize * (("torch-mha" in runners) + ("seed-000" in runners and math_len))
        parts = {
            "weights": weights,
            "activations": ACTIVATION_COPIES * B * T * E * itemsize,
            "(T, T) masks": masks,
            "math runners' (B, H, T, T) scores": (
                SCORE_COPIES * B * H * T * T * itemsize if math_len and runners & {"attnlab-math", "seed-000"} else 0
            ),
        }
        if sum(parts.values()) > sum(worst[1].values()):
            worst = (T, parts)
    T, parts = worst
    if probes > sum(parts.values()) - weights:
        return T, {"weights": weights, "GEMM and copy probes": probes}
    return T, parts


def _need(cfg: BenchConfig, itemsize: int) -> int:
    return sum(memory_parts(cfg, itemsize)[1].values())


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest ``x`` in ``low .. high`` with ``fits(x)`` (true up to some point), or ``low - 1``."""
    if high < low or not fits(low):
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def check_memory(cfg: BenchConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before anything is allocated, a bench whose largest length needs more memory than ``device`` has;
    the :class:`attnlab.runtime.LimitError` names the part that is too large and the flag value that fits."""
    size = dtype.itemsize
    T, parts = memory_parts(cfg, size)
    B = 1 if cfg.variant == "window" else max(1, cfg.tokens // T)

    def fix(free: int) -> str:
        """The change of one flag that fits, trying the flag behind the largest part first."""

        def fits(**changes: Any) -> bool:
            return _need(replace(cfg, **changes), size) <= free

        def shorter(t: int, **more: Any) -> dict[str, Any]:
            return {"lengths": (*[x for x in cfg.lengths if x < t], t), **more}

        H, longest = cfg.num_heads, max(cfg.lengths)
        tries: dict[str, Callable[[], str | None]] = {
            "weights": lambda: (
                f"pass --embed-dim {e * H} or less (a multiple of --num-heads {H})"
                if (e := _largest(lambda e: fits(embed_dim=e * H), 1, cfg.embed_dim // H)) >= 1
                else None
            ),
            "GEMM and copy probes": lambda: (
                f"pass --gemm-size {n} or less"
                if (n := _largest(lambda g: fits(gemm_size=g), 1, cfg.gemm_size))
                else None
            ),
            "activations": lambda: (
                f"pass --tokens {n} or less (B = tokens // T)"
                if (n := _largest(lambda t: fits(tokens=t), longest, cfg.tokens)) >= longest
                else None
            ),
            "math runners' (B, H, T, T) scores": lambda: (
                f"pass --math-max-len {n} or less (the math runners materialise the scores up to it)"
                if (n := _largest(lambda t: fits(math_max_len=t), 1, cfg.math_max_len)) >= 1
                else None
            ),
        }
        for part in sorted(parts, key=lambda k: -parts[k]):
            line = tries[part]() if part in tries and cfg.variant != "window" else None
            if line is not None:
                return line
        masks = (
            ", or leave torch-mha out of --runners" if "(T, T) masks" in parts and "torch-mha" in cfg.runners else ""
        )
        n = _largest(lambda t: fits(**shorter(t)), 1, T)
        if n >= 1:
            return f"pass --lengths no longer than {n}{masks}"
        n = _largest(lambda t: fits(**shorter(t, tokens=t)), 1, T)  # B = 1 at the longest length
        return f"pass --lengths no longer than {max(n, 1)} and --tokens {max(n, 1)}{masks}"

    listed = ", ".join(f"{name} {gib(n)}" for name, n in parts.items() if n)
    check_fits(
        sum(parts.values()),
        f"bench at T={T} (B={B}, --embed-dim {cfg.embed_dim}, {str(dtype).removeprefix('torch.')}: {listed})",
        fix,
        device,
    )


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print, watch: PromptStop | None = None) -> BenchResult:
    """Time every runner at every length (after :func:`validate`, which ``bench`` calls first); ``watch`` is
    handed the result as it grows, to keep it on a stop signal that arrives inside one long call."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    dtype_name = str(dtype).removeprefix("torch.")
    torch.manual_seed(cfg.seed)
    runners, skipped = build_runners(cfg, device, dtype)
    mem = PeakMemory(device)
    gemm = gemm_gflops(device, dtype, cfg.gemm_size)  # measured again at the end; the higher one is used
    log(
        f"device {device}, {dtype_name}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"large-GEMM rate {gemm:.1f} GFLOP/s"
    )
    for name, why in skipped.items():
        log(f"{name}: skipped, {why}")
    copy_rate = copy_bandwidth(device) / 1e9
    log(f"copy bandwidth {copy_rate:.1f} GB/s" + (f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""))
    result = BenchResult(
        asdict(cfg) | {"out_dir": str(cfg.out_dir)},
        str(device),
        dtype_name,
        torch.__version__,
        gemm,
        cuda=torch.version.cuda if device.type == "cuda" else None,
        copy_GB_per_s=round(copy_rate, 2),
        skipped=dict(skipped),
    )
    if watch is not None:
        watch.result = result
    with carried_by_interrupts(result):  # an interrupt hands up the lengths measured so far
        E = cfg.embed_dim
        checked = False
        for T in cfg.lengths:
            B = max(1, cfg.tokens // T)
            x = torch.randn(B, T, E, device=device, dtype=dtype)
            grad_out = torch.randn(B, T, E, device=device, dtype=dtype)
            active = {
                n: fn for n, fn in runners.items() if not (n in ("attnlab-math", "seed-000") and T > cfg.math_max_len)
            }
            rows = {n: Row(T, B, n) for n in runners}
            for n in runners.keys() - active.keys():
                rows[n].note = f"skipped: materialises (B, H, T, T) scores, T > math_max_len={cfg.math_max_len}"
            if not checked:  # every runner computes the same function, or the timings mean nothing
                with torch.no_grad():
                    ref = active["attnlab"](x, T) if "attnlab" in active else next(iter(active.values()))(x, T)
                    for n, fn in active.items():
                        err = (fn(x, T).float() - ref.float()).abs().max().item()
                        tol = 1e-4 if dtype == torch.float32 else 5e-2
                        if err > tol:
                            raise RuntimeError(
                                f"runner {n} disagrees with attnlab by {err:.2e} (> {tol}); the benchmark would compare different functions."
                            )
                checked = True
            fwd: dict[str, list[float]] = {n: [] for n in active}
            fb: dict[str, list[float]] = {n: [] for n in active}
            names = list(active)
            for rep in range(cfg.warmup + cfg.repeats):
                order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate: no runner always first
                for n in order:
                    _sync(device)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        active[n](x, T)
                    _sync(device)
                    if rep >= cfg.warmup:
                        fwd[n].append(time.perf_counter() - t0)
                for n in order:
                    xg = x.detach().requires_grad_()
                    _sync(device)
                    t0 = time.perf_counter()
                    active[n](xg, T).backward(grad_out)
                    _sync(device)
                    if rep >= cfg.warmup:
                        fb[n].append(time.perf_counter() - t0)
                    _zero_grads(xg)
            flops = attention_flops(B, T, E)
            for n in active:
                r = rows[n]
                r.fwd_ms = 1e3 * statistics.median(fwd[n])
                r.fwd_bwd_ms = 1e3 * statistics.median(fb[n])
                r.fwd_gflops = flops / (r.fwd_ms / 1e3) / 1e9
            result.rows.extend(rows.values())
            log(f"T={T} B={B}: fwd+bwd ms " + ", ".join(f"{n} {rows[n].fwd_bwd_ms:.1f}" for n in active))

        result.gemm_gflops = max(result.gemm_gflops, gemm_gflops(device, dtype, cfg.gemm_size))
        if cfg.memory and mem.available:  # after all timings: the allocator setting below slows allocation
            mem.exact_mode()
            for r in result.rows:
                if r.fwd_ms is None:
                    continue
                x = torch.randn(r.B, r.T, E, device=device, dtype=dtype, requires_grad=True)
                grad_out = torch.randn_like(x)
                peak = mem.measure(partial(_fwd_bwd, runners[r.runner], x, r.T, grad_out))
                r.peak_mib = None if peak is None else peak / 2**20
                _zero_grads(x)
            log("peak memory measured")
    return result


# -- reporting -------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def markdown(res: BenchResult) -> str:
    by = {(r.T, r.runner): r for r in res.rows}
    lines = [
        f"Device {res.device}, {res.dtype}, torch {res.torch}; large-GEMM rate {res.gemm_gflops:.1f} GFLOP/s. "
        f"Ratios < 1 are faster / smaller than the peer.",
        "",
        "| T | B | runner | fwd ms | fwd+bwd ms | fwd+bwd / floor | fwd+bwd / torch-mha | fwd GFLOP/s | fwd % of GEMM | peak MiB | peak / floor |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res.rows:
        if r.fwd_ms is None:
            lines.append(f"| {r.T} | {r.B} | {r.runner} | {r.note} | | | | | | | |")
            continue
        assert r.fwd_gflops is not None  # a timed row has all its timings
        floor, tm = by.get((r.T, "floor")), by.get((r.T, "torch-mha"))
        lines.append(
            f"| {r.T} | {r.B} | {r.runner} | {r.fwd_ms:.1f} | {r.fwd_bwd_ms:.1f} | "
            f"{_ratio(r.fwd_bwd_ms, floor.fwd_bwd_ms if floor else None)} | "
            f"{_ratio(r.fwd_bwd_ms, tm.fwd_bwd_ms if tm else None)} | "
            f"{r.fwd_gflops:.1f} | {100 * r.fwd_gflops / res.gemm_gflops:.0f}% | "
            f"{'' if r.peak_mib is None else f'{r.peak_mib:.0f}'} | {_ratio(r.peak_mib, floor.peak_mib if floor else None)} |"
        )
    for name, why in res.skipped.items():
        lines.append(f"\n{name}: skipped, {why}.")
    return "\n".join(lines)


def compact_table(res: BenchResult) -> str:
    """The table for a terminal (fits 80 columns): one group per length, the runners under it.

    The same figures as :func:`markdown`, B moved into the group's title; the Markdown file and the
    JSON keep every column.
    """
    by = {(r.T, r.runner): r for r in res.rows}
    header = ("runner", "fwd ms", "f+b ms", "/floor", "/mha", "GFLOP/s", "%GEMM", "MiB", "/floor")
    rows: list[tuple[str, ...]] = []
    for T in dict.fromkeys(r.T for r in res.rows):
        group = [r for r in res.rows if r.T == T]
        rows.append((f"T={T}, B={group[0].B}:",))
        for r in group:
            if r.fwd_ms is None:
                rows.append((f"{r.runner}: skipped, {r.note.rsplit(', ', 1)[-1]}",))
                continue
            assert r.fwd_gflops is not None and r.fwd_bwd_ms is not None  # a timed row has all its timings
            floor, tm = by.get((T, "floor")), by.get((T, "torch-mha"))
            rows.append(
                (
                    r.runner,
                    f"{r.fwd_ms:.1f}",
                    f"{r.fwd_bwd_ms:.1f}",
                    _ratio(r.fwd_bwd_ms, floor.fwd_bwd_ms if floor else None),
                    _ratio(r.fwd_bwd_ms, tm.fwd_bwd_ms if tm else None),
                    f"{r.fwd_gflops:.0f}" if r.fwd_gflops >= 1000 else f"{r.fwd_gflops:.1f}",
                    f"{100 * r.fwd_gflops / res.gemm_gflops:.0f}%",
                    "" if r.peak_mib is None else f"{r.peak_mib:.0f}",
                    _ratio(r.peak_mib, floor.peak_mib if floor else None),
                )
            )
    lines = [
        f"{res.device} {res.dtype}, torch {res.torch}; large GEMM {res.gemm_gflops:.1f} GFLOP/s",
        "f+b = forward+backward; /floor, /mha: f+b time (or peak MiB) over the floor's",
        "and torch.nn.MultiheadAttention's; MiB: peak memory of one f+b",
        "",
        *aligned(header, rows, right=(False, *([True] * 8))),
    ]
    lines += [wrap(f"{name}: skipped, {why}.") for name, why in res.skipped.items()]
    return "\n".join(lines)


def goals(res: BenchResult) -> str:
    """The performance issue's goals, each with the figure measured in this run."""
    by = {(r.T, r.runner): r for r in res.rows}
    out = []
    for T in sorted({r.T for r in res.rows}):
        a, fl, tm = by.get((T, "attnlab")), by.get((T, "floor")), by.get((T, "torch-mha"))
        if T < 256 or not (a and fl and tm and a.fwd_bwd_ms):
            continue
        assert fl.fwd_bwd_ms is not None and tm.fwd_bwd_ms is not None  # floor and torch-mha are timed at every T
        rf, rt = a.fwd_bwd_ms / fl.fwd_bwd_ms, a.fwd_bwd_ms / tm.fwd_bwd_ms
        out.append(
            f"T={T}: attnlab fwd+bwd = {rf:.3f}x floor (goal <= 1.05: {'met' if rf <= 1.05 else 'MISSED'}), "
            f"{rt:.3f}x torch-mha (goal <= 1.0: {'met' if rt <= 1.0 else 'MISSED'})"
        )
    a2048 = by.get((2048, "attnlab"))
    if a2048 and a2048.fwd_gflops:
        share = a2048.fwd_gflops / res.gemm_gflops
        out.append(
            f"T=2048: attnlab forward {a2048.fwd_gflops:.1f} GFLOP/s = {100 * share:.0f}% of this run's GEMM rate "
            f"(goal >= 85%: {'met' if share >= 0.85 else 'MISSED'})"
        )
    longest = max(r.T for r in res.rows)
    a, fl = by.get((longest, "attnlab")), by.get((longest, "floor"))
    if a and fl and a.peak_mib and fl.peak_mib:
        rm = a.peak_mib / fl.peak_mib
        out.append(
            f"T={longest}: attnlab peak memory = {rm:.3f}x floor (goal <= 1.1: {'met' if rm <= 1.1 else 'MISSED'})"
        )
    return "\n".join(out)


def plot(res: BenchResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in dict.fromkeys(r.runner for r in res.rows):
        pts = [(r.T, r.fwd_bwd_ms, r.peak_mib) for r in res.rows if r.runner == name and r.fwd_bwd_ms]
        if not pts:
            continue
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if all(p[2] is not None for p in pts):
            axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
    for ax, title in zip(axes, ("forward+backward time (ms)", "peak memory (MiB)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T (tokens per batch fixed)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"causal self-attention, E={res.config['embed_dim']}, H={res.config['num_heads']}, {res.device} {res.dtype}"
    )
    fig.tight_layout()
    save_png(fig, path)


def bench(cfg: Annotated[BenchConfig, tyro.conf.arg(name="")]) -> int:
    """Benchmark attention: attnlab (auto, math, compiled) vs torch.nn.MultiheadAttention, the
    SDPA floor and the seed-000 module; prints a table, writes Markdown, JSON and a PNG to --out-dir.
    With --variant window: sliding-window attention, FlexAttention vs dense-mask SDPA vs key-band SDPA.
    With --context-parallel N (under torchrun): one sequence split over N ranks, per-rank figures."""
    if cfg.context_parallel != 1:  # its own checks, defaults and files: bench/context_parallel.py
        from .context_parallel import bench_context_parallel, cp_defaults

        return bench_context_parallel(cp_defaults(cfg, BenchConfig))
    if cfg.variant == "window":  # B=1 at every length; the lengths unless --lengths says otherwise
        from .window import WINDOW_LENGTHS

        lengths = WINDOW_LENGTHS if cfg.lengths == BenchConfig.lengths else cfg.lengths
        cfg = replace(cfg, lengths=lengths, tokens=max(lengths, default=1))
    cfg = gpu_sizes(cfg)
    validate(cfg)  # flags, device, dtype and --out-dir: a mistake fails now, not after minutes of timing
    with RunLock(cfg.out_dir):  # one command writes --out-dir at a time (issue 39)
        return _bench(cfg)


def _lock_gone(out: Path) -> Callable[[], None]:
    """What ``RunLock``'s release does (delete the lock file while holding it), for a :class:`PromptStop` that ends
    the process with ``os._exit``, past the ``with RunLock`` that would."""
    return lambda: (out / LOCK_NAME).unlink(missing_ok=True)


def _bench(cfg: BenchConfig) -> int:
    """``bench`` once its flags are checked and its --out-dir is this process's."""
    if cfg.variant == "window":
        return bench_window(cfg)
    width = terminal_width()
    log = lambda text: print(wrap(text, width), flush=True)
    watch = PromptStop("bench", cfg.out_dir, "bench_attention", markdown, cleanup=_lock_gone(cfg.out_dir))
    with watch:  # a stop signal ends the process within a second, even inside one long torch call
        try:
            res = run_bench(cfg, log=log, watch=watch)
        except INTERRUPTS as err:  # the lengths timed so far are kept, marked partial
            raise save_partial(err, cfg.out_dir, "bench_attention", markdown) from None
        summary = goals(res)
        if cfg.train:
            from .train import train_throughput

            tp = train_throughput()
            res.train_throughput = asdict(tp) | {"ratio": tp.ratio}
            summary += (
                f"\ntraining throughput ({tp.model}): attnlab {tp.attnlab_tok_s:,.0f} tok/s, "
                f"torch.nn.MultiheadAttention {tp.torch_tok_s:,.0f} tok/s, ratio {tp.ratio:.2f}x"
            )
    out = cfg.out_dir
    paths = [out / "bench_attention.json", out / "bench_attention.md", out / "bench_attention.png"]
    atomic_write_text(paths[0], json.dumps(asdict(res), indent=2))
    atomic_write_text(paths[1], markdown(res) + "\n\n" + summary + "\n")
    plot(res, paths[2])
    drop_partial(out, "bench_attention")
    print("\n" + compact_table(res) + "\n\n" + wrap(summary, width))
    print("\nwrote (the Markdown table has every column):\n" + "\n".join(f"  {p}" for p in paths))
    return 0


def bench_window(cfg: BenchConfig) -> int:
    """``bench --variant window``: the sliding-window table, its goals, JSON, Markdown and a PNG (bench/window.py)."""
    from .window import run_window_bench, window_goals, window_markdown, window_plot, window_table

    width = terminal_width()
    watch = PromptStop("bench", cfg.out_dir, "bench_window", window_markdown, cleanup=_lock_gone(cfg.out_dir))
    with watch:  # a stop signal ends the process within a second, even inside one long torch call
        try:
            res = run_window_bench(cfg, log=lambda text: print(wrap(text, width), flush=True), watch=watch)
        except INTERRUPTS as err:  # the lengths timed so far are kept, marked partial
            raise save_partial(err, cfg.out_dir, "bench_window", window_markdown) from None
    summary = window_goals(res)
    out = cfg.out_dir
    paths = [out / "bench_window.json", out / "bench_window.md", out / "bench_window.png"]
    atomic_write_text(paths[0], json.dumps(asdict(res) | {"goals": summary.splitlines()}, indent=2))
    atomic_write_text(paths[1], window_markdown(res) + "\n\n" + summary + "\n")
    window_plot(res, paths[2])
    drop_partial(out, "bench_window")
    print("\n" + window_table(res) + "\n\n" + wrap(summary, width))
    print("\nwrote (the Markdown table has every column):\n" + "\n".join(f"  {p}" for p in paths))
    return 0
