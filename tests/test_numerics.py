"""Low precision and alignment: no overflow in fp16/bf16, errors within flash-attention's rule on
every backend ``auto`` can pick, and the two public attention functions agree on every input.

flash-attention's rule (tests/test_flash_attn.py there): in fp16/bf16 a kernel's error against
a float64 reference may be at most twice the error of plain PyTorch attention run in the same
low precision, plus a small floor so that two near-zero errors do not fail on noise.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import Tensor

import attnlab
from attnlab import MultiHeadAttention
from attnlab.core import functional as fn
from attnlab.core import variants
from attnlab.core.flex import FLEX_MIN_HEAD_DIM, flex_available
from attnlab.core.masks import Masks
from attnlab.core.variants import Structure, alibi_slopes
from conftest import assert_low_precision_close

LOW = [torch.bfloat16, torch.float16]
FLOOR = 1e-4  # absolute, on outputs and gradients of order 1


def plain_attention(q, k, v, keep, scale, *, bias=None, softcap=None, sinks=None):
    """Plain PyTorch in the inputs' precision, as flash-attention's reference: scale q, softmax,
    cast the probabilities to V's dtype, multiply. GQA by repeating K/V in that precision, so that
    autograd sums the query heads' K/V gradients as plain PyTorch does.

    The variants' terms, in that precision too: ``softcap`` C (``C tanh(s / C)``), ``bias`` (float,
    broadcastable to the scores: ALiBi), ``sinks`` ``(H,)`` (one more logit in each row's softmax).
    Masked scores are the dtype's minimum, not -inf, and a row with no visible key is zero-filled:
    finite in both directions (flash-attention zero-fills such rows in its reference too)."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q * scale) @ k.transpose(-2, -1)  # (B, H, T_q, T_k)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    if sinks is not None:  # the sink joins the softmax as one more column, dropped after it
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)  # (B, H, T_q, 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    else:
        p = torch.softmax(scores, dim=-1).to(v.dtype)
    if keep is not None:
        p = p.masked_fill(~keep.any(-1, keepdim=True), 0.0)
    return p @ v


def _grads(run, q0, k0, v0, dout, dtype):
    q, k, v = (t.detach().to(dtype).clone().requires_grad_() for t in (q0, k0, v0))
    out = run(q, k, v)
    out.backward(dout.to(dtype))
    return [t.detach().double() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.usefixtures("one_thread")  # 10x faster on a shared 2-core CPU (conftest)
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("G", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_module_outputs_and_grads_meet_flash_attention_rule(dtype, G, mask, backend, device_with_float64):
    """Through the module's own backend choice (``auto`` picks one of these two per call)."""
    device = device_with_float64
    torch.manual_seed(0)
    B, H, T, D = 2, 4, 256, 32
    q0, k0, v0 = torch.randn(B, H, T, D), torch.randn(B, G, T, D), torch.randn(B, G, T, D)
    q0, k0, v0 = (t.to(dtype).double().to(device) for t in (q0, k0, v0))  # exactly representable in `dtype`
    dout = torch.randn(B, H, T, D).to(device)
    keep, causal = None, mask == "causal"
    if mask == "padding":
        pad = torch.zeros(B, T, dtype=torch.bool, device=device)
        pad[0, -T // 3 :] = True
        keep = (~pad)[:, None, None, :]
    full_keep = fn.causal_keep(T, T, device) if causal else keep
    scale = 1 / math.sqrt(D)

    def ours(q, k, v):
        if backend == "math":
            return fn.math_attention(q, k, v, keep=keep, causal=causal, scale=scale)[0]
        compute_dtype, _ = fn.sdpa_compute_dtype(q)  # what the module runs
        return fn.sdpa_attention(q, k, v, keep=keep, causal=causal, scale=scale, compute_dtype=compute_dtype)[0]

    ref = _grads(lambda q, k, v: plain_attention(q, k, v, full_keep, scale), q0, k0, v0, dout.double(), torch.float64)
    base = _grads(lambda q, k, v: plain_attention(q, k, v, full_keep, scale), q0, k0, v0, dout, dtype)
    got = _grads(ours, q0, k0, v0, dout, dtype)
    for name, g, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref, strict=True):
        assert_low_precision_close(g, b, r, floor=FLOOR, name=name)


@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
def test_large_scores_do_not_overflow(dtype, backend, device):
    """q, k ~ N(0, 40^2), D = 128: q . k reaches ~1e5 > fp16's 65504 before scaling."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 2, 64, 128) * 40).to(device, dtype), (torch.randn(2, 2, 64, 128) * 40).to(device, dtype)
    v = torch.randn(2, 2, 64, 128).to(device, dtype)
    assert ((q.float() @ k.float().transpose(-2, -1)).abs().max() > 65504).item()
    out, w = fn.math_attention(q, k, v, scale=128**-0.5, need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    mha = MultiHeadAttention(256, 2, backend=backend, dtype=dtype)
    x = (torch.randn(2, 64, 256) * 40).to(device, dtype)
    with torch.no_grad():
        mha.q_proj.weight.copy_(torch.eye(256) * 4)  # large q and k
        mha.k_proj.weight.copy_(torch.eye(256) * 4)
    mha = mha.to(device)
    assert torch.isfinite(mha(x)).all()
    if backend != "sdpa":
        _, w = mha(x, need_weights=True)
        assert torch.isfinite(w).all()


@pytest.mark.parametrize("T_q,T_k", [(3, 7), (7, 3), (5, 5)])
@pytest.mark.parametrize("with_keep", [False, True])
def test_math_and_sdpa_agree_on_causal_with_any_lengths(T_q, T_k, with_keep, device_with_float64):
    """Both bottom-right aligned; causal combines with ``keep`` instead of replacing it; a query
    that sees no key (T_q > T_k) gets zeros on both."""
    device = device_with_float64
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, T_q, 8), torch.randn(2, 2, T_k, 8), torch.randn(2, 2, T_k, 8)
    keep = (torch.rand(2, 1, T_q, T_k) > 0.3).to(device) if with_keep else None
    q, k, v = q.to(device), k.to(device), v.to(device)
    a, _ = fn.math_attention(q, k, v, keep=keep, causal=True, scale=0.3)
    b, _ = fn.sdpa_attention(q, k, v, keep=keep, causal=True, scale=0.3)
    assert torch.allclose(a, b, atol=1e-6)
    causal = fn.causal_keep(T_q, T_k, device)
    allowed = causal if keep is None else causal & keep
    ref = plain_attention(q.double(), k.double(), v.double(), allowed, 0.3).float()
    assert torch.allclose(a, ref, atol=1e-5)
    if T_q > T_k:
        assert torch.all(a[:, :, : T_q - T_k] == 0)


def test_causal_keeps_the_other_mask(device):
    """``math_attention(keep=..., causal=True)`` once dropped ``keep``: a blocked key must stay blocked."""
    q, k, v = (torch.randn(1, 1, 4, 8).to(device) for _ in range(3))
    keep = torch.ones(4, 4, dtype=torch.bool, device=device)
    keep[:, 0] = False  # nobody sees key 0
    v2 = v.clone()
    v2[..., 0, :] += 100.0
    for f in (fn.math_attention, fn.sdpa_attention):
        a, _ = f(q, k, v, keep=keep, causal=True, scale=0.3)
        b, _ = f(q, k, v2, keep=keep, causal=True, scale=0.3)
        assert torch.allclose(a, b), f.__name__


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_or_inf_in_padded_keys_never_reaches_the_output(backend, poison, device):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend).to(device)
    x, ctx = torch.randn(2, 5, 16).to(device), torch.randn(2, 7, 16).to(device)
    pad = torch.zeros(2, 7, dtype=torch.bool, device=device)
    pad[0, -2:] = True
    clean = mha(x, ctx, key_padding_mask=pad)
    dirty = ctx.clone()
    dirty[0, -2:] = poison
    out = mha(x, dirty, key_padding_mask=pad)
    assert torch.isfinite(out).all() and torch.allclose(out, clean, atol=1e-6)


@pytest.mark.cpu_only("fp16/bf16 SDPA computes in float32 on a CPU only (functional.sdpa_compute_dtype)")
def test_cpu_low_precision_says_how_sdpa_ran():
    mha = MultiHeadAttention(16, 4, dtype=torch.bfloat16)
    mha(torch.randn(1, 3, 16, dtype=torch.bfloat16))
    assert mha.last_backend == "sdpa" and "computed in float32" in mha.last_backend_reason
    mha32 = MultiHeadAttention(16, 4)
    mha32(torch.randn(1, 3, 16))
    assert mha32.last_backend == "sdpa" and mha32.last_backend_reason is None


def test_key_and_value_defaults_refuse_other_widths():
    """``value`` defaults to ``key`` and ``key`` to ``query``: with kdim/vdim that cannot hold, a clear error."""
    mha = MultiHeadAttention(64, 8, kdim=32)  # vdim defaults to 64
    with pytest.raises(ValueError, match=r"value was not given, so it defaulted to key, but .* vdim=64 != kdim=32"):
        mha(torch.randn(2, 5, 64), torch.randn(2, 7, 32))
    with pytest.raises(ValueError, match=r"key was not given, so it defaulted to query .* kdim=32 != embed_dim=64"):
        mha(torch.randn(2, 5, 64))
    ok = MultiHeadAttention(64, 8, kdim=32, vdim=32)
    assert ok(torch.randn(2, 5, 64), torch.randn(2, 7, 32)).shape == (2, 5, 64)


# -- every path's gradients in fp16/bf16, GQA and MQA included (issue 23) -------------------------------------------
#
# A K/V head's gradient sums the gradients of the R = H/G query heads that read it. Plain PyTorch rounds each head's
# gradient to the low precision once and sums them in a float32 accumulator; torch's CPU flash kernel, run in bf16 or
# fp16 with enable_gqa, accumulates them in the low precision itself and missed the rule (bf16 MQA 256x128 causal: dV
# error 9.4e-2 against a rule of 7.4e-2, 3.2e-2 once computed in float32). Notation: B batch, H = 8 query heads, G K/V
# heads, T_q queries (i), T_k keys (j), D head dim; a query's position is i' = i + T_k - T_q (bottom-right aligned).

HEADS = 8
KV_HEADS = {"mha": 8, "gqa": 2, "mqa": 1}  # G: 1, 4 and 8 query heads per K/V head
WINDOW = 12
FUNCTIONAL_MASKS = ["causal", "padding", "varlen", "documents", "window+padding"]


def _runs(total: int, g: torch.Generator) -> list[int]:
    """3 random lengths (a few may be 0 by chance: equal cuts) summing to ``total``."""
    cuts = sorted(torch.randint(1, total, (2,), generator=g).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]


def _lengths(total: int, zero_at: int, g: torch.Generator) -> list[int]:
    """4 lengths summing to ``total``: 3 random ones, and a 0 at ``zero_at`` (a document of no tokens on that side)."""
    lengths = _runs(total, g)
    return [*lengths[:zero_at], 0, *lengths[zero_at:]]


def _doc_ids(lengths: list[int], device: torch.device) -> Tensor:
    """``(T,)`` int64: the index of each token's document, for documents of these ``lengths``."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))


def functional_mask(kind: str, B: int, T_q: int, T_k: int, device: torch.device) -> tuple[Tensor | None, bool, Tensor]:
    """``(keep, causal, allowed)``: what the attnlab call takes, and the bool ``(B|1, 1, T_q, T_k)`` it means.

    * ``padding``: key lengths ``T_k``, random, 0 (a row with no key at all);
    * ``varlen``: flash-attention's varlen cases: sequence b has ``L_q[b]`` queries and ``L_k[b]`` keys (random,
      some 0), causal within it (key ``c`` <= query ``a + L_k - L_q``);
    * ``documents``: packed sequences (cu_seqlens on both sides), 4 documents, causal within each; one has keys but
      no query, one queries but no key;
    * ``window+padding``: sliding window ``i' - W < j <= i'`` and the padding above.
    """
    g = torch.Generator().manual_seed(23)
    i = torch.arange(T_q, device=device)[:, None]  # (T_q, 1)
    j = torch.arange(T_k, device=device)[None, :]  # (1, T_k)
    lengths_k = torch.tensor([T_k, int(torch.randint(1, T_k, (1,), generator=g)), 0][:B], device=device)
    key_keep = (j < lengths_k[:, None])[:, None, None, :]  # (B, 1, 1, T_k)
    if kind == "causal":
        return None, True, fn.causal_keep(T_q, T_k, device)
    if kind == "padding":
        return key_keep, False, key_keep
    if kind == "window+padding":
        near = (j <= i + T_k - T_q) & (i + T_k - T_q - j < WINDOW)  # (T_q, T_k)
        keep = near & key_keep  # (B, 1, T_q, T_k)
        return keep, False, keep
    if kind == "varlen":
        L_q = torch.tensor([T_q, int(torch.randint(1, T_q, (1,), generator=g)), 0][:B], device=device)[:, None, None]
        L_k = torch.tensor([int(torch.randint(1, T_k, (1,), generator=g)), 0, T_k][:B], device=device)[:, None, None]
        keep = (i < L_q) & (j < L_k) & (j <= i + L_k - L_q)  # (B, T_q, T_k)
        return keep[:, None], False, keep[:, None]
    if kind == "documents":
        rows = []
        for _ in range(B):
            lq, lk = _lengths(T_q, 1, g), _lengths(T_k, 2, g)  # document 1: keys, no query; document 2: the reverse
            dq, dk = _doc_ids(lq, device), _doc_ids(lk, device)  # (T_q,), (T_k,)
            start_q = torch.tensor([0, *lq], device=device).cumsum(0)[dq]  # (T_q,): where i's document starts
            start_k = torch.tensor([0, *lk], device=device).cumsum(0)[dk]
            len_q, len_k = torch.tensor(lq, device=device)[dq], torch.tensor(lk, device=device)[dk]
            a, c = i - start_q[:, None], j - start_k[None, :]  # local indices in the document
            rows.append((dq[:, None] == dk[None, :]) & (c <= a + len_k[None, :] - len_q[:, None]))
        keep = torch.stack(rows)[:, None]  # (B, 1, T_q, T_k)
        return keep, False, keep
    raise AssertionError(kind)


def _draw(B: int, G: int, T_q: int, T_k: int, D: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, ...]:
    """``q (B, H, T_q, D)``, ``k, v (B, G, T_k, D)`` exactly representable in ``dtype`` (as float64), ``dout``."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, D, generator=g) for n, T in ((HEADS, T_q), (G, T_k), (G, T_k)))
    return (*(t.to(dtype).double() for t in (q, k, v)), torch.randn(B, HEADS, T_q, D, generator=g))


def _misses(checks) -> list[str]:
    """The messages of the :func:`assert_low_precision_close` calls in ``checks`` (callables) that fail: every
    backend of a case is checked, and one failing does not hide another's result."""
    misses = []
    for check in checks:
        try:
            check()
        except AssertionError as err:
            misses.append(str(err).splitlines()[0])
    return misses


def _check_public(kind: str, G: int, T_q: int, T_k: int, D: int, dtype, device) -> None:
    """``attnlab.math_attention`` and ``attnlab.sdpa_attention`` called as a user would (no ``compute_dtype``) on one
    case: out, dq, dk and dv within the rule, against plain PyTorch in ``dtype`` and in float64."""
    q0, k0, v0, dout = (t.to(device) for t in _draw(3, G, T_q, T_k, D, dtype))
    keep, causal, allowed = functional_mask(kind, 3, T_q, T_k, device)
    scale = 1 / math.sqrt(D)

    def plain(q, k, v):
        return plain_attention(q, k, v, allowed, scale)

    ref = _grads(plain, q0, k0, v0, dout.double(), torch.float64)
    base = _grads(plain, q0, k0, v0, dout, dtype)
    checks = []
    for attention in (attnlab.math_attention, attnlab.sdpa_attention):
        run = functools.partial(lambda q, k, v, f: f(q, k, v, keep=keep, causal=causal, scale=scale)[0], f=attention)
        got = _grads(run, q0, k0, v0, dout, dtype)
        for name, g, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref, strict=True):
            label = f"{attention.__name__} {name}"
            checks.append(functools.partial(assert_low_precision_close, g, b, r, floor=FLOOR, name=label))
    assert not (misses := _misses(checks)), "\n".join(misses)


@pytest.mark.usefixtures("one_thread")  # 10x faster on a shared 2-core CPU (conftest)
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("T_q,T_k", [(64, 32), (32, 64)], ids=["64x32", "32x64"])
@pytest.mark.parametrize("mask", FUNCTIONAL_MASKS)
@pytest.mark.parametrize("heads", list(KV_HEADS))
def test_public_functions_grads_meet_flash_attention_rule(heads, mask, T_q, T_k, dtype, device_with_float64):
    """``attnlab.math_attention`` and ``attnlab.sdpa_attention`` called directly (no ``compute_dtype``): out, dq, dk, dv."""
    _check_public(mask, KV_HEADS[heads], T_q, T_k, 16, dtype, device_with_float64)


@pytest.mark.usefixtures("one_thread")  # 10x faster on a shared 2-core CPU (conftest)
@pytest.mark.parametrize(
    "heads,mask,T_q,T_k",
    [
        ("mqa", "causal", 256, 128),
        ("mqa", "causal", 128, 256),
        ("gqa", "varlen", 256, 128),
        ("mqa", "window+padding", 128, 256),
    ],
    ids=["mqa-causal-256x128", "mqa-causal-128x256", "gqa-varlen-256x128", "mqa-local-padding-128x256"],
)
def test_flash_attention_reference_cases(heads, mask, T_q, T_k, device_with_float64):
    """flash-attention's own sizes (D = 32, 256 x 128 and 128 x 256), in bf16, where the peer suites saw the failures."""
    _check_public(mask, KV_HEADS[heads], T_q, T_k, 32, torch.bfloat16, device_with_float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_sdpa_attention_follows_the_compute_dtype_policy_by_default(dtype, device):
    """``compute_dtype`` left out = :func:`sdpa_compute_dtype`'s choice, bit for bit; ``compute_dtype=q.dtype`` runs
    the inputs' dtype (on a CPU in fp16/bf16, another kernel: a different result)."""
    q, k, v = (torch.randn(2, n, 16, 8).to(device, dtype) for n in (4, 1, 1))
    policy, _ = fn.sdpa_compute_dtype(q)
    default = fn.sdpa_attention(q, k, v, causal=True, scale=0.3)[0]
    explicit = fn.sdpa_attention(q, k, v, causal=True, scale=0.3, compute_dtype=policy)[0]
    assert default.dtype == dtype and torch.equal(default, explicit)
    if policy is not None:  # a CPU in fp16/bf16: float32, which the inputs' own dtype does not reproduce
        raw = fn.sdpa_attention(q, k, v, causal=True, scale=0.3, compute_dtype=dtype)[0]
        assert not torch.equal(default, raw)


# The variants' own paths, called directly in low precision (as the flex fallback and attnlab.hf call them).
def _variant_inputs(variant: str, B: int, T_q: int, T_k: int, window: int | None, dtype, device) -> tuple:
    """``(masks, structure, allowed, bias, sinks)`` of a causal ``variant`` call with key padding (lengths T_k,
    random, 0): the attnlab inputs, and what they mean for the plain reference (bias and sinks in float64)."""
    g = torch.Generator().manual_seed(5)
    i = torch.arange(T_q, device=device)[:, None] + (T_k - T_q)  # (T_q, 1): the queries' positions i'
    j = torch.arange(T_k, device=device)[None, :]  # (1, T_k)
    lengths = torch.tensor([T_k, int(torch.randint(1, T_k, (1,), generator=g)), 0][:B], device=device)
    key_keep = (j < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T_k)
    allowed = (j <= i) & key_keep  # (B, 1, T_q, T_k)
    if window is not None:
        allowed = allowed & (i - j < window)
    extra: dict = {}
    bias = sinks = None
    if variant == "alibi":
        extra["alibi"] = alibi_slopes(HEADS).to(device)
        bias = -extra["alibi"].double()[:, None, None] * (i - j).abs().double()  # (H, T_q, T_k)
    if variant == "sinks":
        extra["sinks"] = torch.randn(HEADS, generator=g).to(device, dtype)
        sinks = extra["sinks"].double()
    if variant == "softcap":
        extra["softcap"] = 2.0  # small: scores of N(0, 1) inputs reach it
    if variant == "documents":  # 3 runs of random lengths, ids 0, 1, 2 along the key positions
        k_doc = torch.stack([_doc_ids(_runs(T_k, g), device) for _ in range(B)])  # (B, T_k)
        q_doc = k_doc[:, i.flatten().clamp(min=0)].masked_fill(i.flatten() < 0, -1)  # (B, T_q): -1 before position 0
        extra.update(q_doc=q_doc, k_doc=k_doc)
        allowed = allowed & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    st = Structure(q_pos=i.flatten(), k_pos=j.flatten(), causal=True, window=window, **extra)
    return Masks(keep=key_keep, empty_rows=True), st, allowed, bias, sinks


def _variant_cases() -> list:
    cases = []
    for shape in ((64, 32), (32, 64)):
        cases += [("variant_math", v, *shape) for v in ("window", "sinks", "alibi", "documents", "softcap")]
        cases += [("variant_sdpa", v, *shape) for v in ("window", "sinks", "alibi", "documents")]
    cases += [
        (run, v, 64, 64) for run in ("banded_sdpa", "banded_loop") for v in ("window", "sinks", "alibi", "documents")
    ]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]}x{c[3]}") for c in cases]


@pytest.mark.usefixtures("one_thread")  # 10x faster on a shared 2-core CPU (conftest)
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("run,variant,T_q,T_k", _variant_cases())
def test_variant_paths_grads_meet_flash_attention_rule(run, variant, T_q, T_k, heads, dtype, device_with_float64):
    """variant_math, variant_sdpa (dense mask) and banded_sdpa (key bands; the block loop when a mask covers
    (query, key) pairs), each with causal masking, key padding (a row of no key) and one variant; the banded ones
    always with a window."""
    device = device_with_float64
    window = WINDOW if variant == "window" or run.startswith("banded") else None
    masks, st, allowed, bias, sinks = _variant_inputs(variant, 3, T_q, T_k, window, dtype, device)
    q0, k0, v0, dout = (t.to(device) for t in _draw(3, KV_HEADS[heads], T_q, T_k, 16, dtype))
    scale = 0.25

    def plain(q, k, v):
        s = None if sinks is None else sinks.to(q.dtype)
        return plain_attention(q, k, v, allowed, scale, bias=bias, softcap=st.softcap, sinks=s)

    def ours(q, k, v):
        if run == "variant_math":
            return variants.variant_math(q, k, v, masks, st, scale=scale)[0]
        if run == "variant_sdpa":
            return variants.variant_sdpa(q, k, v, masks, st, scale=scale)
        pairs = Masks(keep=masks.keep.expand(-1, -1, T_q, -1), empty_rows=True)  # (B, 1, T_q, T_k): block by block
        return variants.banded_sdpa(q, k, v, masks if run == "banded_sdpa" else pairs, st, scale=scale, block=16)

    ref = _grads(plain, q0, k0, v0, dout.double(), torch.float64)
    base = _grads(plain, q0, k0, v0, dout, dtype)
    got = _grads(ours, q0, k0, v0, dout, dtype)
    for name, g, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref, strict=True):
        assert_low_precision_close(g, b, r, floor=FLOOR, name=f"{run} {variant} {name}")


# Through the module: its own backend choice, and the parameters' gradients.
E_MODULE = HEADS * 8  # D = 8
MODULE_VARIANTS = {"none": {}, "window": {"window": WINDOW}, "sinks": {"sinks": True}, "alibi": {"alibi": True}}
MODULE_VARIANTS |= {"softcap": {"softcap": 2.0}, "documents": {}}


def _module_call(variant: str, mask: str, device: torch.device) -> tuple[int, int, dict, Tensor]:
    """``(T_q, T_k, forward kwargs, allowed (B, 1, T_q, T_k))`` of a module case with B = 3.

    ``causal``: 32 queries, the last of a 64-key context (bottom-right). ``padding``: key padding (lengths T_k,
    random, 0), non-causal cross-attention from 64 queries to 32 keys; causal at 32 x 64 for a window, which needs
    it. ``documents``: self-attention over a packed row of 48 tokens (3 random runs per sequence), plus the mask.
    """
    g = torch.Generator().manual_seed(9)
    causal = mask == "causal" or variant == "window"
    T_q, T_k = (48, 48) if variant == "documents" else ((32, 64) if causal else (64, 32))
    i = torch.arange(T_q, device=device)[:, None] + (T_k - T_q)  # (T_q, 1): positions i'
    j = torch.arange(T_k, device=device)[None, :]  # (1, T_k)
    allowed = torch.ones(3, 1, T_q, T_k, dtype=torch.bool, device=device)
    kw: dict = {"is_causal": causal}
    if causal:
        allowed = allowed & (j <= i)
    if variant == "window":
        allowed = allowed & (i - j < WINDOW)
    if mask == "padding":
        lengths = torch.tensor([T_k, int(torch.randint(1, T_k, (1,), generator=g)), 0], device=device)
        kw["key_padding_mask"] = j >= lengths[:, None]  # (B, T_k), True = padding
        allowed = allowed & ~kw["key_padding_mask"][:, None, None, :]
    if variant == "documents":
        ids = torch.stack([_doc_ids(_runs(T_q, g), device) for _ in range(3)])  # (B, T)
        kw["document_ids"] = ids * 7 + 3  # any ids: a run of equal ids is a document
        allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
    return T_q, T_k, kw, allowed


def plain_module(m: MultiHeadAttention, query: Tensor, key: Tensor, allowed: Tensor) -> Tensor:
    """The module's function in plain PyTorch, in the precision of ``m`` and its inputs: its own projections, the
    heads split, :func:`plain_attention` with the variant's terms, the heads merged, the output projection."""
    B, T_q, _ = query.shape
    T_k, H, G, D = key.size(1), m.num_heads, m.num_kv_heads, m.head_dim
    q = m.q_proj(query).view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D)
    k = m.k_proj(key).view(B, T_k, G, D).transpose(1, 2)  # (B, G, T_k, D)
    v = m.v_proj(key).view(B, T_k, G, D).transpose(1, 2)  # (B, G, T_k, D)
    bias = None
    if m.alibi_slopes is not None:
        i = torch.arange(T_q, device=q.device)[:, None] + (T_k - T_q)  # (T_q, 1)
        j = torch.arange(T_k, device=q.device)[None, :]
        bias = -m.alibi_slopes.double()[:, None, None] * (i - j).abs().double()  # (H, T_q, T_k)
    context = plain_attention(q, k, v, allowed, m.scale, bias=bias, softcap=m.softcap, sinks=m.sinks)
    return m.out_proj(context.transpose(1, 2).reshape(B, T_q, H * D))  # (B, T_q, E)


def _module_grads(run, m: torch.nn.Module, query: Tensor, key: Tensor, dout: Tensor, dtype) -> dict[str, Tensor]:
    """``run(m, query, key)``'s output and the gradients of its inputs and of every parameter of ``m``, in float64."""
    m = copy.deepcopy(m).to(dtype)
    query, key = (t.detach().to(dtype).requires_grad_() for t in (query, key))
    out = run(m, query, key)
    out.backward(dout.to(dtype))
    grads = {"out": out, "query.grad": query.grad, "key.grad": key.grad}
    grads |= {f"{name}.grad": p.grad for name, p in m.named_parameters()}
    return {name: g.detach().double() for name, g in grads.items() if g is not None}  # key.grad: None if unused


def cancelling_sum_floors(m: MultiHeadAttention, query: Tensor, key: Tensor, allowed: Tensor, dout: Tensor, dtype):
    """``{"k_proj.bias.grad": (G*D,), "sinks.grad": (H,)}``: for each entry of these two gradients, half the
    machine epsilon of ``dtype`` times the L1 norm of the terms it sums (:func:`cancelling_sum_terms`)."""
    eps = torch.finfo(dtype).eps
    return {
        name: eps / 2 * terms.abs().sum(0) for name, terms in cancelling_sum_terms(m, query, key, allowed, dout).items()
    }


def cancelling_sum_terms(m: MultiHeadAttention, query: Tensor, key: Tensor, allowed: Tensor, dout: Tensor):
    """``{"k_proj.bias.grad": (B*T_k, G*D), "sinks.grad": (B*T_q, H)}`` (sinks: when the module has them): the
    terms that autograd sums into these two gradients, computed in float64.

    Both gradients are sums whose terms cancel. ``k_proj.bias.grad[c]`` is ``sum_{b,j} dK[b, j, c]``, and
    without sinks or softcap ``sum_j dK[b, j] = scale * sum_i (sum_j dS[b, i, j]) q_i = 0`` (a softmax ignores a constant
    added to its row, and a key bias adds ``q_i . bias`` to every key of row i): its exact value is 0. ``sinks.grad[h]`` is
    ``-sum_{b,i} p_sink[b, h, i] * (dO . O)[b, h, i]``, terms of both signs. What a kernel returns for such a
    sum is rounding noise: each term is rounded once to ``dtype`` (relative error at most eps/2) before a float32
    accumulator adds them, so its error is bounded by ``eps/2 * sum |term|``, whatever the kernel, and two
    kernels' noises have no order (on an H200, cuDNN's k_proj.bias error was 2.1-2.6x plain PyTorch's and
    mem-efficient's sinks error 2.25x, with both far inside this bound). flash-attention's 2x rule compares
    errors of values, not of noise about a cancelled sum: these two entries get this floor on top of it."""
    with torch.no_grad():
        m = copy.deepcopy(m).double()
        B, T_q, _ = query.shape
        T_k, H, G, D = key.size(1), m.num_heads, m.num_kv_heads, m.head_dim
        q = m.q_proj(query.double()).view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D)
        k = m.k_proj(key.double()).view(B, T_k, G, D).transpose(1, 2).repeat_interleave(H // G, 1)  # (B, H, T_k, D)
        v = m.v_proj(key.double()).view(B, T_k, G, D).transpose(1, 2).repeat_interleave(H // G, 1)
        raw = (q @ k.transpose(-2, -1)) * m.scale  # (B, H, T_q, T_k)
        scores = raw if m.softcap is None else m.softcap * torch.tanh(raw / m.softcap)
        if m.alibi_slopes is not None:
            i = torch.arange(T_q, device=q.device)[:, None] + (T_k - T_q)
            j = torch.arange(T_k, device=q.device)[None, :]
            scores = scores - m.alibi_slopes.double()[:, None, None] * (i - j).abs()
        scores = scores.masked_fill(~allowed, -math.inf)
        sink = None if m.sinks is None else m.sinks.double()[None, :, None, None].expand(B, H, T_q, 1)
        full = scores if sink is None else torch.cat([scores, sink], dim=-1)
        dead = ~allowed.any(-1, keepdim=True)  # (B, 1, T_q, 1): rows that see no key (and, with sinks, the sink only)
        p_all = torch.softmax(full.masked_fill(dead & (sink is None), 0.0), dim=-1)
        p = p_all[..., :T_k].masked_fill(dead, 0.0)  # (B, H, T_q, T_k)
        context = p @ v  # (B, H, T_q, D)
        d_context = (dout.double() @ m.out_proj.weight.double()).view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D)
        delta = (d_context * context).sum(-1, keepdim=True)  # (B, H, T_q, 1)
        ds = p * (d_context @ v.transpose(-2, -1) - delta)  # (B, H, T_q, T_k)
        if m.softcap is not None:
            ds = ds * (1 - torch.tanh(raw / m.softcap) ** 2)
        dk = (ds.transpose(-2, -1) @ q) * m.scale  # (B, H, T_k, D): each query head's share
        dk = dk.view(B, G, H // G, T_k, D).sum(2).transpose(1, 2).reshape(B, T_k, G * D)  # (B, T_k, G*D)
        terms = {"k_proj.bias.grad": dk.reshape(B * T_k, G * D)}
        if sink is not None:  # d loss / d sink logit of row (b, h, i) = p_sink (dP_sink - delta) with dP_sink = 0
            p_sink = p_all[..., T_k]  # (B, H, T_q)
            terms["sinks.grad"] = (-p_sink * delta[..., 0]).transpose(1, 2).reshape(B * T_q, H)
    return terms


def _assert_within_cancelling_floor(got: Tensor, plain: Tensor, reference: Tensor, floor: Tensor, name: str) -> None:
    """flash-attention's rule entry by entry, with :func:`cancelling_sum_floors`'s floor for that entry."""
    err, plain_err = (got - reference).abs(), (plain - reference).abs().max()
    tol = 2 * plain_err + floor.to(err.device) + FLOOR
    worst = int((err / tol).argmax())
    assert bool((err <= tol).all()), (
        f"{name}[{worst}]: error {err.flatten()[worst]:.2e} > 2 x plain {plain_err:.2e} + eps/2 x L1 of its terms "
        f"{floor.flatten()[worst]:.2e} + {FLOOR:g}"
    )


def test_cancelling_sum_floors_are_the_terms_of_the_gradients():
    """The floors' terms are the gradients' own: summed in float64 (signs kept) they give autograd's k_proj.bias
    and sinks gradients, so the floor bounds the rounding of exactly what the kernel adds up."""
    query, key = torch.randn(2, 6, 32, dtype=torch.float64), torch.randn(2, 9, 32, dtype=torch.float64)
    allowed = torch.ones(2, 1, 6, 9, dtype=torch.bool)
    allowed[0, :, 2] = False  # a row that sees no key (with sinks: the sink only)
    dout = torch.randn(2, 6, 32, dtype=torch.float64)
    for options in ({"softcap": 3.0}, {"alibi": True}, {"sinks": True}):
        torch.manual_seed(0)
        m = MultiHeadAttention(32, 4, num_kv_heads=2, **options).double()
        with torch.no_grad():
            m.k_proj.bias.normal_()
            if m.sinks is not None:
                m.sinks.normal_()
        grads = _module_grads(lambda m, q, k: plain_module(m, q, k, allowed), m, query, key, dout, torch.float64)
        terms = cancelling_sum_terms(m, query, key, allowed, dout)
        assert terms.keys() == ({"k_proj.bias.grad", "sinks.grad"} if m.sinks is not None else {"k_proj.bias.grad"})
        for name, t in terms.items():
            assert torch.allclose(t.sum(0), grads[name], atol=1e-12), (options, name)
        if "alibi" in options:  # a bias on the scores leaves the shift-invariance: exactly 0 (softcap and sinks do not)
            assert grads["k_proj.bias.grad"].abs().max() < 1e-12 < terms["k_proj.bias.grad"].abs().sum(0).min()


def _check_module(backends: tuple[str, ...], variant: str, mask: str, heads: str, dtype, device) -> None:
    """One module case on each of ``backends``: the output and the gradients of the inputs and of every parameter
    within the rule, against :func:`plain_module` on the same weights in ``dtype`` and in float64; the two
    gradients that are sums of cancelling terms (``k_proj.bias``, ``sinks``) with :func:`cancelling_sum_floors`."""
    T_q, T_k, kw, allowed = _module_call(variant, mask, device)
    torch.manual_seed(0)
    m = MultiHeadAttention(E_MODULE, HEADS, num_kv_heads=KV_HEADS[heads], **MODULE_VARIANTS[variant])
    if m.sinks is not None:
        with torch.no_grad():
            m.sinks.normal_()  # zeros at init would leave the sinks' gradient trivial
    m = m.to(device, dtype)  # the weights, exactly representable in `dtype`, are those of every copy below
    g = torch.Generator().manual_seed(1)
    query = torch.randn(3, T_q, E_MODULE, generator=g).to(dtype).double().to(device)
    key = query if variant == "documents" else torch.randn(3, T_k, E_MODULE, generator=g).to(dtype).double().to(device)
    dout = torch.randn(3, T_q, E_MODULE, generator=g).to(device)

    def plain(m, q, k):
        return plain_module(m, q, q if variant == "documents" else k, allowed)

    ref = _module_grads(plain, m, query, key, dout.double(), torch.float64)
    base = _module_grads(plain, m, query, key, dout, dtype)
    floors = cancelling_sum_floors(m, query, query if variant == "documents" else key, allowed, dout, dtype)
    checks = []
    for backend in backends:
        ours = copy.deepcopy(m)
        ours.backend = backend
        got = _module_grads(
            lambda m, q, k: m(q, None if variant == "documents" else k, **kw), ours, query, key, dout, dtype
        )
        assert got.keys() == ref.keys()  # self-attention (documents): key is query, no key.grad on either side
        for name, r in ref.items():
            label = f"{backend} {name}"
            if name in floors:
                check = functools.partial(
                    _assert_within_cancelling_floor, got[name], base[name], r, floors[name], label
                )
            else:
                check = functools.partial(assert_low_precision_close, got[name], base[name], r, floor=FLOOR, name=label)
            checks.append(check)
    assert not (misses := _misses(checks)), "\n".join(misses)


@pytest.mark.usefixtures("one_thread")  # 10x faster on a shared 2-core CPU (conftest)
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", list(KV_HEADS))
@pytest.mark.parametrize("mask", ["causal", "padding"])
@pytest.mark.parametrize("variant", list(MODULE_VARIANTS))
def test_module_parameter_grads_meet_flash_attention_rule(variant, mask, heads, dtype, device_with_float64):
    """MultiHeadAttention in fp16/bf16 with each variant, on the math and SDPA backends (softcap: math; SDPA cannot
    express it): the output and the gradients of the inputs and of every parameter (projections, biases, sinks)
    within the rule of plain PyTorch on the same weights. ``auto`` picks one of the two in training (test_backends)."""
    backends = ("math",) if variant == "softcap" else ("math", "sdpa")
    _check_module(backends, variant, mask, heads, dtype, device_with_float64)


@pytest.mark.usefixtures("one_thread")  # 10x faster on a shared 2-core CPU (conftest)
@pytest.mark.parametrize("dtype", LOW, ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", list(KV_HEADS))
def test_flex_backend_parameter_grads_meet_flash_attention_rule(heads, dtype, device_with_float64, monkeypatch):
    """The same on backend='flex', every variant, where it can be backpropagated (not on a CPU: torch has no CPU
    flex backward, so this runs with --device cuda), at D = 16: flex's Triton kernel refuses a head dim below
    16 (FLEX_MIN_HEAD_DIM; an InductorError at D = 8 on an H200)."""
    monkeypatch.setitem(globals(), "E_MODULE", HEADS * FLEX_MIN_HEAD_DIM)
    ok, why = flex_available(device_with_float64, True, dtype, head_dim=FLEX_MIN_HEAD_DIM)
    if not ok:
        pytest.skip(why)
    for variant in MODULE_VARIANTS:
        _check_module(
            ("flex",), variant, "padding" if variant != "documents" else "causal", heads, dtype, device_with_float64
        )
