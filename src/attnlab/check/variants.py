"""One check per attention variant: the target (or, for attnlab's own module, a copy of it with the
variant switched on, on the target's weights) against a float64 formula written out here.

A module of another library is checked on a variant when it exposes the same attribute with a value
(``window``, ``softcap``, ``alibi_slopes``, ``sinks``); otherwise the row is skipped, saying so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention
from ..core.functional import causal_keep
from ..core.kv_cache import RollingKVCache
from .result import CheckResult

__all__ = ["VARIANT_CHECKS"]

VARIANT_TOL = 2e-5  # float32 against float64, as the parity rows (a half dtype: the context's rule, ctx.tol)
WINDOW, SOFTCAP = 3, 2.0


def _row(ctx: Any, measured: float, detail: str) -> CheckResult:
    """Pass when ``measured`` is within the variant tolerance for the target's dtype."""
    tol = ctx.tol(VARIANT_TOL)
    return CheckResult("", "pass" if measured <= tol else "fail", measured, tol, detail)


def _skip(reason: str) -> CheckResult:
    return CheckResult("", "skip", None, None, reason)


def _variant_module(ctx: Any, attribute: str, **options: Any) -> MultiHeadAttention | nn.Module | str:
    """The module to check: the target itself if it has ``attribute`` set; attnlab's module rebuilt with
    ``options`` on the target's weights; else the reason to skip."""
    module = getattr(ctx.adapter, "module", None)
    if module is None:
        return "the target is not an nn.Module (an adapter): variants are checked on modules"
    if getattr(module, attribute, None) is not None:
        return module
    if type(module) is not MultiHeadAttention:
        return f"{type(module).__name__} is not attnlab's MultiHeadAttention and sets no {attribute!r}: it does not implement this variant"
    copy = MultiHeadAttention(
        module.embed_dim,
        module.num_heads,
        num_kv_heads=module.num_kv_heads,
        bias=getattr(module.q_proj, "bias", None) is not None,
        scale=module.scale,
        **options,
    ).to(next(module.parameters()))
    copy.load_state_dict(module.state_dict(), strict=False)  # projections; the variant's own tensors stay
    if copy.sinks is not None:
        with torch.no_grad():
            copy.sinks.copy_(torch.linspace(-1.0, 1.0, module.num_heads))  # nonzero sinks, one per head
    return copy.eval()


def _formula(
    m: nn.Module,
    x: Tensor,
    *,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention in float64, written out from ``m``'s projections (``q_proj``...): the variant's formula."""
    x = x.double()
    H, G = int(m.num_heads), int(m.num_kv_heads)  # type: ignore[arg-type]
    B, T, _ = x.shape

    def proj(name: str, t: Tensor) -> Tensor:
        layer = getattr(m, name)
        return F.linear(t, layer.weight.double(), None if layer.bias is None else layer.bias.double())

    D = proj("q_proj", x).size(-1) // H
    q = proj("q_proj", x).view(B, T, H, D).transpose(1, 2)
    k = proj("k_proj", x).view(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    v = proj("v_proj", x).view(B, T, G, D).transpose(1, 2).repeat_interleave(H // G, dim=1)
    s = (q @ k.transpose(-1, -2)) * float(getattr(m, "scale", 1.0 / math.sqrt(D)))
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    top = s.amax(-1, keepdim=True)
    e = torch.exp(s - top)
    denominator = e.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks.double()[None, :, None, None] - top)
    context = ((e / denominator) @ v).transpose(1, 2).reshape(B, T, H * D)
    return proj("out_proj", context)


def _rel(got: Tensor, want: Tensor) -> float:
    got, want = got.detach().double(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _band(T: int, W: int) -> Tensor:
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (j <= i) & (i - j < W)


def _input(ctx: Any, name: str, m: nn.Module) -> Tensor:
    g = ctx.generator(name)
    w = next(m.parameters())
    return torch.randn(ctx.batch, ctx.seq_len, int(m.embed_dim), generator=g).to(w)  # type: ignore[arg-type]  # as the parity rows


def check_window(ctx: Any) -> CheckResult:
    m = _variant_module(ctx, "window", window=WINDOW)
    if isinstance(m, str):
        return _skip(m)
    x, W = _input(ctx, "variant_window", m), int(m.window)  # type: ignore[arg-type]
    err = _rel(m(x, is_causal=True), _formula(m, x, keep=_band(x.size(1), W).to(x.device)))
    return _row(ctx, err, f"window={W}: query i sees keys i-{W} < j <= i (explicit band mask)")


def check_softcap(ctx: Any) -> CheckResult:
    m = _variant_module(ctx, "softcap", softcap=SOFTCAP)
    if isinstance(m, str):
        return _skip(m)
    x, C = _input(ctx, "variant_softcap", m), float(m.softcap)  # type: ignore[arg-type]
    keep = causal_keep(x.size(1), x.size(1), x.device)
    err = _rel(m(x, is_causal=True), _formula(m, x, keep=keep, softcap=C))
    return _row(ctx, err, f"softcap={C:g}: C * tanh(scores / C), causal")


def check_alibi(ctx: Any) -> CheckResult:
    m = _variant_module(ctx, "alibi_slopes", alibi=True)
    if isinstance(m, str):
        return _skip(m)
    H = int(m.num_heads)  # type: ignore[arg-type]
    n = 2 ** math.floor(math.log2(H))  # the standard slopes, written out again: 2^(-8k/n), then odd ones of 2n
    slopes = [2.0 ** (-8.0 * (k + 1) / n) for k in range(n)] + [2.0 ** (-4.0 * (2 * k + 1) / n) for k in range(H - n)]
    x = _input(ctx, "variant_alibi", m)
    T = x.size(1)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    bias = (-torch.tensor(slopes, dtype=torch.float64)[:, None, None] * (i - j).abs()).to(x.device)
    keep = (j <= i).to(x.device)
    err = _rel(m(x, is_causal=True), _formula(m, x, keep=keep, bias=bias[None]))
    return _row(ctx, err, f"ALiBi: -m_h |i - j|, slopes {slopes[0]:g} .. {slopes[-1]:g}, causal")


def check_sinks(ctx: Any) -> CheckResult:
    m = _variant_module(ctx, "sinks", sinks=True)
    if isinstance(m, str):
        return _skip(m)
    x = _input(ctx, "variant_sinks", m)
    keep = causal_keep(x.size(1), x.size(1), x.device)
    err = _rel(m(x, is_causal=True), _formula(m, x, keep=keep, sinks=torch.as_tensor(m.sinks).detach()))
    return _row(ctx, err, "sinks: exp(s_h) added to every row's softmax denominator, causal")


def check_documents(ctx: Any) -> CheckResult:
    m = _variant_module(ctx, "window", window=ctx.seq_len)  # a window as wide as the input: documents alone bite
    if isinstance(m, str) or not isinstance(m, MultiHeadAttention):
        return _skip(m if isinstance(m, str) else "document_ids is attnlab's forward argument")
    x = _input(ctx, "variant_documents", m)
    T, cut = x.size(1), x.size(1) // 3
    ids = torch.zeros(x.size(0), T, dtype=torch.long, device=x.device)
    ids[:, cut:] = 1
    packed = m(x, is_causal=True, document_ids=ids)
    alone = torch.cat(
        [_formula(m, part, keep=_band(part.size(1), T).to(x.device)) for part in (x[:, :cut], x[:, cut:])], 1
    )
    err = _rel(packed, alone)
    return _row(ctx, err, f"document_ids: a row packing {cut} + {T - cut} tokens equals each alone")


def check_rolling_cache(ctx: Any) -> CheckResult:
    m = _variant_module(ctx, "window", window=WINDOW)
    if isinstance(m, str) or not isinstance(m, MultiHeadAttention):
        return _skip(m if isinstance(m, str) else "RollingKVCache is attnlab's")
    x = _input(ctx, "variant_rolling_cache", m)
    T, W = x.size(1), int(m.window or WINDOW)
    cache = RollingKVCache.for_module(m, x.size(0))
    first = max(1, T // 2)
    outs = [m(x[:, :first], is_causal=True, kv_cache=cache, cache_positions=torch.arange(first, device=x.device))]
    for t in range(first, T):
        outs.append(
            m(x[:, t : t + 1], is_causal=True, kv_cache=cache, cache_positions=torch.tensor([t], device=x.device))
        )
    err = _rel(torch.cat(outs, 1), _formula(m, x, keep=_band(T, W).to(x.device)))
    return _row(ctx, err, f"window={W}, a {W}-slot rolling cache: prefill {first} then decode token by token")


VARIANT_CHECKS: dict[str, Callable[[Any], CheckResult]] = {
    "variant[window]": check_window,
    "variant[softcap]": check_softcap,
    "variant[alibi]": check_alibi,
    "variant[sinks]": check_sinks,
    "variant[documents]": check_documents,
    "variant[rolling_cache]": check_rolling_cache,
}
