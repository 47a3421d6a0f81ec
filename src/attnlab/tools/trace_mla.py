"""``attnlab trace --mla``: every stage of multi-head latent attention (DeepSeek-V2/V3), on both of its paths.

Notation (as :mod:`attnlab.core.mla`): B batch, T query positions, S key positions, E ``hidden_size``, H heads,
Q ``q_lora_rank``, C ``kv_lora_rank``, R ``qk_rope_head_dim``, N ``qk_nope_head_dim``, Dv ``v_head_dim``.

The module runs once per path on the same input and weights, under :func:`attnlab.check.capture.capture`: every op
it runs on its input is recorded with the tensor it produced, so each printed shape is read off a real tensor.
Each op is then named after the step of MLA it is (:func:`mla_rows`); the elementwise ops of a rotary
embedding are folded into one row. After the tables: whether the two paths agree, the cache one token costs in
MHA, GQA, MQA and MLA (read off real :class:`attnlab.KVCache` and :class:`attnlab.core.mla_cache.MLACache`
objects), and the path ``path="auto"`` takes for a decode step and for a prefill, with the module's reason.
"""

from __future__ import annotations

import json as _json
import re
import shutil
import textwrap
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch

from ..check.capture import Op, capture
from ..core.kv_cache import KVCache
from ..core.mla import MultiHeadLatentAttention
from ..core.mla_cache import MLACache
from ..core.rope import rope_cos_sin
from ..runtime import UsageError, check_range
from .trace_rows import AttentionTrace, TraceRow, aligned

__all__ = ["V3", "CacheRow", "cache_per_token", "mla_rows", "trace_mla", "trace_mla_command"]

# DeepSeek-V3's attention (its config.json), the sizes every width is also quoted at
V3 = {
    "hidden_size": 7168,  # E
    "num_heads": 128,  # H
    "q_lora_rank": 1536,  # Q
    "kv_lora_rank": 512,  # C
    "qk_nope_head_dim": 128,  # N
    "qk_rope_head_dim": 64,  # R
    "v_head_dim": 128,  # Dv
}
V3_KV_HEADS = 8  # G of the GQA row at V3's width: Llama 3 70B's 8 key/value heads
V3_DTYPE = torch.bfloat16  # what DeepSeek-V3's latent cache holds when served in bf16

# The elementwise ops of a rotary embedding (attnlab.core.rope's two layouts): folded into the row that ends it
_ROPE_OPS = ("getitem", "mul", "sub", "add", "neg", "chunk[0]", "chunk[1]", "cat")


def _src_names(op: Op, names: dict[int, str]) -> list[str]:
    """The names of the recorded tensors ``op`` read, in argument order (a ``cat``'s list included)."""
    out: list[str] = []
    for a in op.args:
        if isinstance(a, int):
            out.append(names.get(a, "?"))
        elif op.func == "cat" and isinstance(a, str) and re.fullmatch(r"\[-?\d+(, -?\d+)*\]", a):  # its tensors
            out += [names.get(int(i), "?") for i in a[1:-1].split(", ")]
    return out


def _label(op: Op, srcs: list[str], mla: MultiHeadLatentAttention, path: str) -> tuple[str, str, str] | None:
    """(name of the result, stage, axes) of one op of an MLA forward; None: a step of a rotary embedding, folded."""
    func, src, dims = op.func, (srcs[0] if srcs else "?"), len(op.shape)
    C, R = mla.kv_lora_rank, mla.qk_rope_head_dim
    v3_cr = V3["kv_lora_rank"] + V3["qk_rope_head_dim"]
    weight = next((a for a in op.args if isinstance(a, str) and a.endswith(".weight")), "")
    if func == "linear":
        return {
            "q_proj.weight": ("q", "queries: q_proj", "(B, T, H*(N+R)): E -> H*(N+R)"),
            "q_a_proj.weight": ("c_Q", "query latent: q_a_proj", "(B, T, Q): E -> Q"),
            "q_b_proj.weight": ("q", "queries: q_b_proj", "(B, T, H*(N+R)): Q -> H*(N+R)"),
            "kv_a_proj_with_mqa.weight": ("kv_a", "kv_a_proj_with_mqa", "(B, T, C+R): E -> [c_KV | k_R]"),
            "kv_b_proj.weight": (
                "kv_b",
                "naive: kv_b_proj expands latents",
                "(B, S, H*(N+Dv)): every cached latent to k_C and v, all heads",
            ),
            "o_proj.weight": ("out", "output projection o_proj", "(B, T, E)"),
        }.get(weight, ("t", "linear", ""))
    if func == "rms_norm":
        if "q_a_layernorm" in op.kwargs.get("weight", ""):
            return "c_Q", "query latent norm (q_a_layernorm)", "(B, T, Q): RMSNorm"
        return "c_KV", "latent norm (kv_a_layernorm)", "(B, T, C): c_KV, RMSNorm"
    if src in ("q_R0", "k_R0", "k_R1") and func in _ROPE_OPS:
        if func == "cat" and src == "q_R0":
            return "q_R", "RoPE on q_R, per head", "(B, H, T, R): each channel pair turned by its position"
        if func == "getitem" and src in ("k_R0", "k_R1") and dims == 3:  # the head axis dropped again
            return "k_R", "RoPE on k_R, shared by all heads", "(B, T, R): one rotary key for all H heads"
        return None
    if func == "view":
        return src, "split heads (view)", "(B, T, H, N+R)" if src == "q" else "(B, S, H, N+Dv)"
    if func == "transpose" and tuple(op.args[1:]) == ("1", "2"):
        if src in ("q", "kv_b"):
            return src, "heads to dim 1 (transpose)", "(B, H, T, N+R)" if src == "q" else "(B, H, S, N+Dv)"
        return "context", "heads back (transpose)", "(B, T, H, Dv)"
    if func.startswith("split["):
        names_, stage, axes_ = {
            "q": (("q_C", "q_R0"), "q_C | q_R per head (split)", ("(B, H, T, N)", "(B, H, T, R), before RoPE")),
            "kv_a": (("c_KV0", "k_R0"), "c_KV | k_R (split)", ("(B, T, C)", "(B, T, R)")),
            "rows": (("c_KV", "k_R"), "naive: the rows split again", ("(B, S, C)", "(B, S, R)")),
            "kv_b": (("k_C", "v"), "naive: k_C | v per head (split)", ("(B, H, S, N)", "(B, H, S, Dv)")),
        }.get(src, ((src, src), "split", ("", "")))
        part = 1 if func == "split[1]" else 0
        return names_[part], stage, axes_[part]
    if func == "cat":
        return {
            ("c_KV", "k_R"): ("rows", "cache rows [c_KV | k_R]", "(B, T, C+R): what the cache keeps per token"),
            ("k_C", "k_R"): ("k", "naive: keys [k_C | k_R]", "(B, H, S, N+R)"),
            ("q_C", "q_R"): ("q", "naive: queries [q_C | q_R]", "(B, H, T, N+R)"),
            ("q_lat", "q_R"): (
                "q_abs",
                "query is C+R wide: [q_C W_UK | q_R]",
                f"(B, H, T, C+R): C+R = {C + R} here, {v3_cr} at V3's sizes",
            ),
        }.get((srcs[0], srcs[-1]), (src, "cat", ""))
    if func == "getitem" and src == "k_R":
        return "k_R", "naive: k_R gets a head axis", "(B, 1, S, R)"
    if func == "expand":
        return "k_R", "naive: k_R to every head (expand)", "(B, H, S, R): a view, no copy"
    if func == "getitem" and src == "rows":
        if op.shape[-1] == C + R:
            return "k_lat", "absorbed keys: the rows, 1 head", "(B, 1, S, C+R): the cache rows as they are"
        return "v_lat", "absorbed values: c_KV (a view)", "(B, 1, S, C): the rows' first C channels"
    if func == "matmul" and src == "q_C":
        return "q_lat", "absorbed: q_C W_UK (W_UK folded)", "(B, H, T, C): W_UK folded into the query, in latent space"
    if func == "reshape" and src == "q_abs":
        return "q_rows", "absorbed: H*T query rows (MQA)", "(B, 1, H*T, C+R): row h*T + t, all over one key head"
    if func == "transpose":
        return "kT", "K^T (transpose)", "(B, 1, C+R, S)" if src == "k_lat" else "(B, H, N+R, S)"
    if func == "matmul" and src in ("q", "q_rows"):
        return "scores", "scores = Q K^T", "(B, 1, H*T, S)" if src == "q_rows" else "(B, H, T, S)"
    if func in ("mul", "div") and src == "scores":
        return "scores", f"scale by 1/sqrt(N+R) = {mla.scale:.4g}", "the paper's N+R on both paths, never C+R"
    if func == "add" and src == "scores":
        return "scores", "add float mask", ""
    if func == "masked_fill" and src == "scores":
        return "scores", "mask (before softmax)", ""
    if func == "masked_fill" and src == "rows":
        return "rows", "zero padded rows (no NaN)", "(B, S, C+R): never attended; 0 * NaN is NaN"
    if func == "masked_fill" and src == "weights":
        return "weights", "zero fully-masked rows", "a query with no key gets zeros, not NaN"
    if func == "softmax":
        return "weights", "softmax over keys", "(B, 1, H*T, S)" if path == "absorbed" else "(B, H, T, S)"
    if func in ("matmul", "scaled_dot_product_attention") and (src == "weights" or func != "matmul"):
        if path == "absorbed":
            stage = "latent context = weights c_KV" if func == "matmul" else "fused SDPA: latent context"
            return "ctx_lat", stage, "(B, 1, H*T, C)"
        return "context", "context = weights v" if func == "matmul" else "fused SDPA: context", "(B, H, T, Dv)"
    if func == "masked_fill" and src in ("ctx_lat", "context"):
        return src, "zero fully-masked rows", "a query with no key gets zeros, not NaN"
    if func == "reshape" and src == "ctx_lat":
        return "ctx_lat", "absorbed: latent context per head", "(B, H, T, C)"
    if func == "matmul" and src == "ctx_lat":
        return "context", "absorbed: W_UV after attention", "(B, H, T, Dv)"
    if func == "reshape" and src == "context":
        return "context", "merge heads", "(B, T, H*Dv)"
    return src, func, ""  # an op this table has no name for: shown as it is


def mla_rows(
    ops: list[Op], mla: MultiHeadLatentAttention, path: str, inputs: dict[str, torch.Tensor]
) -> list[TraceRow]:
    """The trace's rows for the ops of one MLA forward (:func:`attnlab.check.capture.capture`), each named.

    A ``split`` is one row with the shapes of its parts; the ops of a rotary embedding are one row, the last
    op's, with how many there were.
    """
    names: dict[int, str] = {-1 - i: n for i, n in enumerate(inputs)}
    rows = [TraceRow("input", n, list(t.shape), "(B, T, E)", "input") for n, t in inputs.items()]
    folded: list[str] = []
    for i, op in enumerate(ops):
        srcs = _src_names(op, names)
        label = _label(op, srcs, mla, path)
        if label is None:
            names[i] = srcs[0] if op.func != "cat" else "k_R1"  # the rotated key, still with its head axis
            folded.append(op.func)
            continue
        name, stage, axes = label
        names[i] = name
        call = _call(op, name, names)
        if folded:
            funcs = ", ".join(dict.fromkeys(f.split("[")[0] for f in [*folded, op.func]))
            call = f"{_shown(name)} = rotate({_shown(srcs[0])}, cos, sin): {len(folded) + 1} ops ({funcs})"
            folded = []
        if op.func == "split[1]":  # the second part of a split joins the first's row
            first = rows[-1]
            first.operation = first.operation.replace(" = ", f", {_shown(name)} = ", 1)
            first.shape = [list(cast(list[int], first.shape)), op.shape]
            first.axes = f"{first.axes} + {axes}"
            continue
        rows.append(TraceRow(stage, call, op.shape, axes, op.memory))
    return rows


def _call(op: Op, name: str, names: dict[int, str]) -> str:
    """``op`` as a line of code over the names of its tensors: ``rows = cat([c_KV, k_R], dim=-1)``."""

    def arg(a: int | str) -> str:
        if isinstance(a, int):
            return _shown(names.get(a, "?"))
        if op.func == "cat" and re.fullmatch(r"\[-?\d+(, -?\d+)*\]", a):  # the list of tensors it joins
            return "[" + ", ".join(_shown(names.get(int(i), "?")) for i in a[1:-1].split(", ")) + "]"
        if a.startswith("<tensor"):  # kv_b_proj's weight, cut per head: the only other tensor MLA multiplies by
            return "W_UK" if name == "q_lat" else "W_UV^T"
        return a

    args = [arg(a) for a in op.args]
    if op.func == "getitem":  # rows[:, None, :, :64], as the code writes it
        index = args[1].replace("slice(None, None, None)", ":").replace("Ellipsis", "...")
        index = re.sub(r"slice\((\w+), (\w+), (\w+)\)", lambda m: _slice(*m.groups()), index)
        return f"{_shown(name)} = {args[0]}{index}"
    kwargs = "".join(f", {k}={v}" for k, v in op.kwargs.items())
    return f"{_shown(name)} = {op.func.split('[')[0]}({', '.join(args)}{kwargs})"


def _slice(start: str, stop: str, step: str) -> str:
    """``slice(None, 64, None)`` as ``:64``."""
    text = f"{'' if start == 'None' else start}:{'' if stop == 'None' else stop}"
    return text if step == "None" else f"{text}:{step}"


def _shown(name: str) -> str:
    """An internal name as the table shows it: q_R0 (before RoPE) and k_R1 (mid-RoPE) are q_R and k_R."""
    return name.rstrip("01")


@torch.no_grad()
def trace_mla(
    mla: MultiHeadLatentAttention,
    hidden_states: torch.Tensor,
    *,
    paths: tuple[str, ...] = ("naive", "absorbed"),
    is_causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[list[AttentionTrace], dict[str, torch.Tensor]]:
    """Run ``mla`` once per path on ``hidden_states (B, T, E)`` (RoPE on positions 0 .. T-1), recording each stage.

    Returns one :class:`~attnlab.tools.trace_rows.AttentionTrace` per path and each path's output ``(B, T, E)``.
    ``mla.path`` is restored afterwards.
    """
    T = hidden_states.size(1)
    rope = rope_cos_sin(torch.arange(T, device=hidden_states.device), mla.qk_rope_head_dim)  # (T, R) each
    rope = (rope[0].to(hidden_states.dtype), rope[1].to(hidden_states.dtype))
    inputs = {"x": hidden_states}
    traces: list[AttentionTrace] = []
    outputs: dict[str, torch.Tensor] = {}
    saved = mla.path
    try:
        for path in paths:
            mla.path = path
            run = lambda: mla(hidden_states, rope=rope, is_causal=is_causal, key_padding_mask=key_padding_mask)
            ops = capture(lambda: outputs.setdefault(path, run()), inputs, mla)  # noqa: B023 (called at once)
            call = AttentionTrace(f"MultiHeadLatentAttention, path={path!r}", mla.last_backend)
            call.rows = mla_rows(ops, mla, path, inputs)
            traces.append(call)
    finally:
        mla.path = saved
    return traces, outputs


@dataclass
class CacheRow:
    """What one token costs in one layer's cache, for one sequence, in one attention kind."""

    kind: str  # "MHA", "GQA", "MQA" or "MLA"
    formula: str  # values per token, in the letters of the module docstring
    values: int  # the formula, evaluated
    bytes: int  # the cache object's bytes_per_token (its values times the bytes of one)
    dtype: str  # of the cache


def cache_per_token(
    *, num_heads: int, num_kv_heads: int, head_dim: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype
) -> list[CacheRow]:
    """MHA, GQA, MQA and MLA at one width: H heads of D, G key/value heads, MLA's C + R; bytes from real caches.

    Each cache is built for one sequence of one slot and asked its ``bytes_per_token``; ``values`` is the
    formula, which a test holds equal to ``bytes / itemsize``.
    """
    H, G, D, C, R = num_heads, num_kv_heads, head_dim, kv_lora_rank, qk_rope_head_dim
    caches: list[tuple[str, str, int, KVCache | MLACache]] = [
        ("MHA", "2*H*D", 2 * H * D, KVCache(1, 1, H, D, dtype=dtype)),
        ("GQA", "2*G*D", 2 * G * D, KVCache(1, 1, G, D, dtype=dtype)),
        ("MQA", "2*D", 2 * D, KVCache(1, 1, 1, D, dtype=dtype)),
        ("MLA", "C+R", C + R, MLACache(1, 1, C, R, dtype=dtype)),
    ]
    kind = str(dtype).removeprefix("torch.")
    return [CacheRow(name, formula, values, cache.bytes_per_token, kind) for name, formula, values, cache in caches]


def _cache_table(here: list[CacheRow], v3: list[CacheRow], sizes: dict[str, Any], g: int, width: int) -> list[str]:
    """The two cache comparisons side by side, one line per attention kind."""
    head = ("kind", "values", "here", "bytes", "of MHA", "V3", "V3 bytes", "of MHA")
    body = [
        (
            a.kind,
            a.formula,
            str(a.values),
            str(a.bytes),
            f"{a.bytes / here[0].bytes:.3g}",
            str(b.values),
            str(b.bytes),
            f"{b.bytes / v3[0].bytes:.3g}",
        )
        for a, b in zip(here, v3, strict=True)
    ]
    H, D, C, R = sizes["num_heads"], sizes["v_head_dim"], sizes["kv_lora_rank"], sizes["qk_rope_head_dim"]
    return [
        *textwrap.wrap(
            f"KV cache per token and layer, one sequence, at the same width: values and bytes here (H={H}, "
            f"G={g}, D=Dv={D}, C={C}, R={R}, {here[0].dtype}) and at DeepSeek-V3's (H=128, G={V3_KV_HEADS}, "
            f"D=128, C=512, R=64, {v3[0].dtype}), from the caches' bytes_per_token:",
            width,
        ),
        *aligned(head, body),
    ]


def _auto_lines(mla: MultiHeadLatentAttention, seq_len: int) -> list[str]:
    """The path ``path="auto"`` takes for one decode step over ``seq_len`` cached tokens and for their prefill."""
    saved = mla.path
    mla.path = "auto"
    try:
        decode, prefill = mla.choose_path(1, seq_len), mla.choose_path(seq_len, seq_len)
    finally:
        mla.path = saved
    return [
        "path='auto' at these sizes (MultiHeadLatentAttention.choose_path):",
        f"  a decode step, 1 query over {seq_len} cached keys: {decode[1]}",
        f"  a prefill of {seq_len} tokens: {prefill[1]}",
    ]


def _default_kv_heads(num_heads: int) -> int:
    """G of the GQA row when none is given: the largest divisor of H up to H/4 (8 heads: 2)."""
    return next(g for g in range(max(1, num_heads // 4), 0, -1) if num_heads % g == 0)


def _as_flags(message: str) -> str:
    """The constructor's message about ``qk_rope_head_dim=7`` in the flags' words (``--qk-rope-head-dim 7``)."""
    names = "|".join(V3)
    message = re.sub(rf"\b({names})=", lambda m: "--" + m.group(1).replace("_", "-") + " ", message)
    return re.sub(rf"^({names}) must", lambda m: "--" + m.group(1).replace("_", "-") + " must", message)


def trace_mla_command(
    *,
    sizes: dict[str, Any],
    batch_size: int,
    seq_len: int,
    num_kv_heads: int | None,
    causal: bool,
    pad: int,
    backend: str,
    path: str,
    json: bool,
    seed: int,
) -> int:
    """``attnlab trace --mla``: build MLA at ``sizes`` (DeepSeek's names), trace ``path``, print the notes."""
    for name, value in sizes.items():
        if value is not None or name != "q_lora_rank":
            flag = "--" + name.replace("_", "-")
            check_range(flag, value, low=1, integer=True, hint=f"DeepSeek-V3 uses {V3[name]}")
    H = sizes["num_heads"]
    if backend not in ("math", "sdpa", "auto"):
        raise UsageError(
            f"--backend {backend} is not one of MultiHeadLatentAttention's backends (math, sdpa, auto); "
            f"pass --backend math to see every stage, or sdpa for the fused kernel."
        )
    if num_kv_heads is not None and H % num_kv_heads:
        raise UsageError(
            f"--num-kv-heads {num_kv_heads} does not divide --num-heads {H}; with --mla it is G of the cache "
            f"table's GQA row, each of G key/value heads serving H/G query heads: pass a divisor of {H}."
        )
    check_range("--pad", pad, low=0, high=seq_len - 1, integer=True, hint="a sequence keeps one real token")
    torch.manual_seed(seed)
    try:
        mla = MultiHeadLatentAttention(**sizes, backend=backend)  # type: ignore[arg-type]
    except ValueError as err:  # the module names its arguments; the user typed flags
        raise UsageError(_as_flags(str(err))) from None
    x = torch.randn(batch_size, seq_len, sizes["hidden_size"])  # (B, T, E)
    kpm = None
    if pad:
        kpm = torch.zeros(batch_size, seq_len, dtype=torch.bool)  # (B, T), True = padding
        kpm[0, seq_len - pad :] = True  # the first sequence ends with `pad` padding tokens
    paths = ("naive", "absorbed") if path == "both" else (path,)
    traces, outputs = trace_mla(mla, x, paths=paths, is_causal=causal, key_padding_mask=kpm)
    g = num_kv_heads or _default_kv_heads(H)
    here = cache_per_token(
        num_heads=H, num_kv_heads=g, head_dim=mla.v_head_dim, kv_lora_rank=mla.kv_lora_rank,
        qk_rope_head_dim=mla.qk_rope_head_dim, dtype=torch.float32,
    )  # fmt: skip
    v3 = cache_per_token(
        num_heads=V3["num_heads"], num_kv_heads=V3_KV_HEADS, head_dim=V3["v_head_dim"],
        kv_lora_rank=V3["kv_lora_rank"], qk_rope_head_dim=V3["qk_rope_head_dim"], dtype=V3_DTYPE,
    )  # fmt: skip
    diff = (outputs["naive"] - outputs["absorbed"]).abs().max().item() if len(outputs) == 2 else None
    if json:
        print(
            _json.dumps(
                {
                    "sizes": sizes,
                    "traces": [t.to_dict() for t in traces],
                    "max_abs_difference": diff,
                    "cache_per_token": {"here": [asdict(r) for r in here], "deepseek_v3": [asdict(r) for r in v3]},
                    "auto": _auto_lines(mla, seq_len)[1:],
                },
                indent=2,
            )
        )
        return 0
    width = shutil.get_terminal_size((80, 24)).columns
    wrap = lambda text: textwrap.wrap(text, width, subsequent_indent="    ", break_on_hyphens=False) or [""]
    given = ", ".join(f"{k}={v}" for k, v in sizes.items())
    v3_text = ", ".join(f"{V3[k]}" for k in sizes)
    lines = [*wrap(f"MLA at {given} (DeepSeek-V3: {v3_text}); x {list(x.shape)}, RoPE on positions 0..{seq_len - 1}")]
    for t in traces:
        lines += ["", t.to_text(width=width)]
    C, R, NR = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_head_dim
    lines.append("")
    if diff is not None:
        lines += wrap(f"naive and absorbed give the same output: max |difference| = {diff:.2g}")
    lines += wrap(
        f"widths: naive attends N+R = {NR} channels per head (V3: 192); absorbed attends C+R = {C + R} "
        f"(V3: 576), one key head for all H; both scale the scores by 1/sqrt(N+R)"
    )
    lines += ["", *_cache_table(here, v3, sizes, g, width), ""]
    lines += [part for line in _auto_lines(mla, seq_len) for part in wrap(line)]
    print("\n".join(lines))
    return 0
