"""Every public attnlab path under CPU models of the faulty fused kernels (tests/kernel_models.py): gradients
finite and exact, whatever the kernel makes of a row that sees no key.

What is modelled, and where it was measured: cuDNN's SDPA on an H200 (torch 2.11.0+cu130, bf16/fp16) returns
0 in the forward for a query row with no visible key and NaN in that row's dq in the backward (PyTorch
#196678); one fully padded sequence made ``q_proj.weight.grad`` NaN for the whole model (issue 36: 45 of the
58 failures of the first GPU run). Older math/memory-efficient kernels (torch < 2.5) gave NaN in the forward
too. attnlab opens such rows to every key before the kernel and zeroes them after it
(:func:`attnlab.core.functional.unmask_dead_rows`), so that no kernel sees them; these tests hold every
path that hands a mask to SDPA to that, on a CPU, in CI.

"Exact": each path's output and gradients under the model equal the same call on the math backend (no fused
kernel) in float64, to float32 rounding; the rows that see no key are exactly zero with zero gradient.
Notation: B batch, H query heads, G key/value heads, T_q queries, T_k keys, D head dim, E width.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnlab
from attnlab import MultiHeadAttention
from attnlab.compat import MultiheadAttention as CompatMHA
from attnlab.core import variants
from attnlab.core.masks import Masks
from attnlab.core.variants import Structure, alibi_slopes
from kernel_models import FAULTS, LSE_OVERFLOW, faulty_sdpa, modelled_sdpa

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
ATOL = 2e-5  # float32 against float64 on outputs and gradients of order 1


def _all_finite(named: dict[str, Tensor]) -> list[str]:
    return [
        f"{name}: {int((~torch.isfinite(g)).sum())} non-finite" for name, g in named.items() if not g.isfinite().all()
    ]


def _assert_exact(got: dict[str, Tensor], ref: dict[str, Tensor], atol: float = ATOL) -> None:
    """Every tensor of ``got`` finite and within ``atol`` of ``ref``'s (float64), relative to the reference's largest
    entry where it exceeds 1 (a parameter's gradient sums many terms): all misses in one message."""
    assert got.keys() == ref.keys()
    misses = _all_finite(got)
    for name, g in got.items():
        err = (g.double() - ref[name].double()).abs().max().item() if g.numel() else 0.0
        tol = atol * max(1.0, ref[name].abs().max().item() if g.numel() else 1.0)
        if err > tol:
            misses.append(f"{name}: error {err:.2e} > {tol:.2e}")
    assert not misses, "\n".join(misses)


# -- the models themselves ----------------------------------------------------------------------------------------
def _qkv(B=2, H=4, G=2, T_q=8, T_k=64, D=16, dtype=torch.float32, seed=0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, T_q, D), (B, G, T_k, D), (B, G, T_k, D))
    return tuple(torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes)  # type: ignore[return-value]


def _sdpa_grads(sdpa, q, k, v, **kw) -> dict[str, Tensor]:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = sdpa(q, k, v, enable_gqa=q.size(1) != k.size(1), **kw)
    out.backward(torch.ones_like(out))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_a_model_is_torch_sdpa_where_every_row_sees_a_key(fault, mask):
    """Where no row's log-sum-exp falls below -88.7, a model computes what torch's own SDPA computes, forward
    and backward (GQA, bool and float masks, SDPA's top-left is_causal): only the faults differ."""
    q, k, v = _qkv(T_q=12, T_k=12)
    kw: dict = {}
    if mask == "causal":
        kw["is_causal"] = True
    if mask in ("bool", "float"):
        keep = torch.rand(2, 1, 12, 12, generator=torch.Generator().manual_seed(3)) > 0.4
        keep[..., 0] = True
        kw["attn_mask"] = keep if mask == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -math.inf)
    _assert_exact(
        _sdpa_grads(faulty_sdpa(fault), q, k, v, **kw), _sdpa_grads(F.scaled_dot_product_attention, q, k, v, **kw)
    )


def test_the_cudnn_model_reproduces_the_h200_measurement():
    """cuDNN on the H200: a row with no visible key is 0 in the forward and NaN in dq (and only there); dk, dv
    finite. Also a row that sees keys but whose log-sum-exp is below -88.7 (every key at a large negative bias):
    the fault is the log-sum-exp's, not the mask's. No mask tensor (is_causal alone): no fault."""
    q, k, v = _qkv(T_q=8, T_k=64)
    keep = torch.ones(2, 1, 8, 64, dtype=torch.bool)
    keep[0, :, :4] = False  # 4 rows of sequence 0 see no key: 4 rows x 4 heads x 16 dims = 256 values of dq
    got = _sdpa_grads(faulty_sdpa("cudnn"), q, k, v, attn_mask=keep)
    assert torch.equal(got["out"][0, :, :4], torch.zeros(4, 4, 16))
    assert int(got["dq"].isnan().sum()) == 256 and got["dq"][0, :, :4].isnan().all()
    assert got["dk"].isfinite().all() and got["dv"].isfinite().all()
    bias = torch.zeros(2, 1, 8, 64)
    bias[1, :, 2] = -200.0  # row 2 of sequence 1: lse about -200 + log(64) < -88.7
    got = _sdpa_grads(faulty_sdpa("cudnn"), q, k, v, attn_mask=bias)
    assert got["dq"][1, :, 2].isnan().all() and int(got["dq"].isnan().sum()) == 4 * 16
    assert LSE_OVERFLOW == pytest.approx(-88.72, abs=0.01)
    q2, k2, v2 = _qkv(T_q=64, T_k=64)
    assert _all_finite(_sdpa_grads(faulty_sdpa("cudnn"), q2, k2, v2, is_causal=True)) == []


def test_the_nan_rows_model_reproduces_torch_before_2_5():
    """The math and memory-efficient kernels before torch 2.5: NaN in the forward for a row with no visible key,
    and in the backward NaN dq in the row and NaN dk, dv for every key of its sequence and K/V head."""
    q, k, v = _qkv(T_q=8, T_k=64)
    keep = torch.ones(2, 1, 8, 64, dtype=torch.bool)
    keep[0, :, 3] = False
    got = _sdpa_grads(faulty_sdpa("nan_rows"), q, k, v, attn_mask=keep)
    assert got["out"][0, :, 3].isnan().all() and int(got["out"].isnan().sum()) == 4 * 16
    assert got["dk"][0].isnan().all() and got["dk"][1].isfinite().all()


# -- the public functions -----------------------------------------------------------------------------------------
FUNCTION_MASKS = ["padding", "varlen", "documents", "window+padding", "causal T_q>T_k", "float -inf rows"]


def _function_case(kind: str, B: int, T_q: int, T_k: int) -> dict:
    """Keyword arguments of ``attnlab.sdpa_attention``/``math_attention`` with rows that see no key."""
    i = torch.arange(T_q)[:, None] + (T_k - T_q)  # (T_q, 1): positions, bottom-right aligned
    j = torch.arange(T_k)[None, :]  # (1, T_k)
    lengths = torch.tensor([T_k, T_k // 3, 0][:B])  # the last sequence is all padding
    key_keep = (j < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T_k)
    if kind == "padding":
        return {"keep": key_keep}
    if kind == "window+padding":
        return {"keep": key_keep & (j <= i) & (i - j < 5)}
    if kind == "varlen":  # sequence b: its last L_q[b] queries over its first L_k[b] keys, causal within it
        L_q, L_k = torch.tensor([T_q, 3, 0][:B]), torch.tensor([T_k // 2, 0, T_k][:B])
        a = torch.arange(T_q)[None, :, None] - (T_q - L_q[:, None, None])  # (B, T_q, 1): local query index
        keep = (a >= 0) & (j[None] < L_k[:, None, None]) & (j[None] <= a + L_k[:, None, None] - L_q[:, None, None])
        return {"keep": keep[:, None]}
    if kind == "documents":  # query documents 0, 1, 2 against key documents 0, 2 (document 1 has no key)
        q_doc = torch.arange(T_q) * 3 // T_q  # (T_q,)
        k_doc = torch.where(torch.arange(T_k) < T_k // 2, 0, 2)  # (T_k,)
        return {"keep": (q_doc[:, None] == k_doc[None, :]) & (j <= i)}
    if kind == "causal T_q>T_k":  # the first T_q - T_k queries see no key
        return {"causal": True, "T_swap": True}
    if kind == "float -inf rows":
        bias = torch.randn(B, 1, T_q, T_k, generator=torch.Generator().manual_seed(4))
        bias[0, :, ::3] = -math.inf  # every third query of sequence 0 sees no key
        return {"bias": bias}
    raise AssertionError(kind)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("kind", FUNCTION_MASKS)
def test_sdpa_attention_gradients_are_exact_under_faulty_kernels(kind, heads, fault):
    """``attnlab.sdpa_attention`` as a user calls it, T_q = 32 < T_k = 64 (the H200 shape, 64 = 64 mod 128)."""
    H, G = heads
    T_q, T_k = 32, 64
    case = _function_case(kind, 3, T_q, T_k)
    if case.pop("T_swap", False):
        T_q, T_k = T_k, T_q
    q, k, v = _qkv(B=3, H=H, G=G, T_q=T_q, T_k=T_k)

    def run(f, q, k, v):
        out = f(q, k, v, scale=0.25, **case)[0]
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype))
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    ref = run(attnlab.math_attention, *(t.detach().double().requires_grad_() for t in (q, k, v)))
    with modelled_sdpa(fault):
        got = run(attnlab.sdpa_attention, q, k, v)
    _assert_exact(got, ref)


# -- the variants' own paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("variant", ["window", "documents", "alibi", "sinks"])
@pytest.mark.parametrize("run", ["variant_sdpa", "banded_sdpa", "banded_loop"])
def test_variant_paths_gradients_are_exact_under_faulty_kernels(run, variant, fault):
    """variant_sdpa (dense mask), banded_sdpa (key bands) and its block loop, causal with key padding where one
    sequence is all padding, against variant_math in float64."""
    B, H, G, T, D = 3, 4, 2, 48, 16
    j = torch.arange(T)[None, :]
    key_keep = (j < torch.tensor([T, 17, 0])[:, None])[:, None, None, :]  # (B, 1, 1, T)
    extra: dict = {}
    if variant == "alibi":
        extra["alibi"] = alibi_slopes(H)
    if variant == "sinks":
        extra["sinks"] = torch.randn(H, generator=torch.Generator().manual_seed(2))
    if variant == "documents":
        ids = (torch.arange(T) * 3 // T)[None].expand(B, T)
        extra.update(q_doc=ids, k_doc=ids)
    window = 6 if variant == "window" or run != "variant_sdpa" else None
    st = Structure(q_pos=torch.arange(T), k_pos=torch.arange(T), causal=True, window=window, **extra)
    masks = Masks(keep=key_keep, empty_rows=True)
    if run == "banded_loop":  # a mask over (query, key) pairs: the block-by-block path
        masks = Masks(keep=key_keep.expand(B, 1, T, T), empty_rows=True)
    q, k, v = _qkv(B=B, H=H, G=G, T_q=T, T_k=T, D=D)

    def go(f, q, k, v, st):
        out = f(q, k, v, masks, st)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype))
        grads = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        if st.sinks is not None:
            grads["dsinks"] = st.sinks.grad
        return grads

    def with_sinks(dtype):
        if variant != "sinks":
            return st
        return Structure(**{**st.__dict__, "sinks": extra["sinks"].to(dtype).requires_grad_()})

    reference = lambda q, k, v, m, s: variants.variant_math(q, k, v, m, s, scale=0.3)[0]
    ref = go(reference, *(t.detach().double().requires_grad_() for t in (q, k, v)), with_sinks(torch.float64))
    if run == "variant_sdpa":
        ours = lambda q, k, v, m, s: variants.variant_sdpa(q, k, v, m, s, scale=0.3)
    else:
        ours = lambda q, k, v, m, s: variants.banded_sdpa(q, k, v, m, s, scale=0.3, block=16)
    with modelled_sdpa(fault):
        got = go(ours, q, k, v, with_sinks(torch.float32))
    _assert_exact(got, ref)


# -- the module, its compat twin, the models -----------------------------------------------------------------------
def _module_grads(m: nn.Module, call, inputs: list[Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    m = copy.deepcopy(m).to(dtype)
    inputs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = call(m, *inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(dtype))
    grads = {"out": out.detach()} | {f"input{n}.grad": t.grad for n, t in enumerate(inputs) if t.grad is not None}
    return grads | {f"{name}.grad": p.grad for name, p in m.named_parameters() if p.grad is not None}


MODULE_CASES = {
    # the H200 case: bf16 cross-attention, 32 queries over 64 keys, one sequence all padding
    "cross, a sequence all padding": ({}, "cross", lambda B, T_q, T_k: {"key_padding_mask": _pad(B, T_k)}),
    "self, causal, left padding": (
        {},
        "self",
        lambda B, T_q, T_k: {"key_padding_mask": _left(B, T_k), "is_causal": True},
    ),
    "bool attn_mask with empty rows": ({}, "cross", lambda B, T_q, T_k: {"attn_mask": _rows(B, T_q, T_k)}),
    "float attn_mask with -inf rows": (
        {},
        "cross",
        lambda B, T_q, T_k: {"attn_mask": torch.zeros(B, T_q, T_k).masked_fill(~_rows(B, T_q, T_k), -math.inf)},
    ),
    "gqa, causal, left padding": (
        {"num_kv_heads": 2},
        "self",
        lambda B, T_q, T_k: {"key_padding_mask": _left(B, T_k), "is_causal": True},
    ),
    "window, left padding": (
        {"window": 5},
        "self",
        lambda B, T_q, T_k: {"key_padding_mask": _left(B, T_k), "is_causal": True},
    ),
    "alibi, left padding": (
        {"alibi": True},
        "self",
        lambda B, T_q, T_k: {"key_padding_mask": _left(B, T_k), "is_causal": True},
    ),
    "sinks, a sequence all padding": ({"sinks": True}, "cross", lambda B, T_q, T_k: {"key_padding_mask": _pad(B, T_k)}),
    "documents, left padding": (
        {},
        "self",
        lambda B, T_q, T_k: {
            "key_padding_mask": _left(B, T_k),
            "is_causal": True,
            "document_ids": (torch.arange(T_k) * 3 // T_k)[None].expand(B, T_k),
        },
    ),
}


def _pad(B: int, T_k: int) -> Tensor:
    """``(B, T_k)`` True = padding: sequence 1 ends with 5 pad tokens, the last sequence is all padding."""
    pad = torch.zeros(B, T_k, dtype=torch.bool)
    pad[1, -5:] = True
    pad[-1] = True
    return pad


def _left(B: int, T: int) -> Tensor:
    """``(B, T)`` True = padding: sequence 0 left-padded by 7, so its first 7 queries (causal) see no key."""
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, :7] = True
    return pad


def _rows(B: int, T_q: int, T_k: int) -> Tensor:
    """``(B, T_q, T_k)`` True = may attend, random, with every fourth query of sequence 0 seeing no key."""
    keep = torch.rand(B, T_q, T_k, generator=torch.Generator().manual_seed(6)) > 0.5
    keep[..., 0] = True
    keep[0, ::4] = False
    return keep


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_module_gradients_are_finite_and_exact_under_faulty_kernels(case, dtype, fault):
    """MultiHeadAttention on ``auto`` (the fused path in training) in fp32 and bf16: the output and the gradients
    of the inputs and of every parameter finite; in fp32 equal to backend='math' in float64. In bf16 (the H200's
    dtype, where one padded sequence made dx and q_proj's gradients NaN) finite and within bf16's rounding of
    the fp32 result."""
    options, kind, make = MODULE_CASES[case]
    B, E, H = 3, 64, 4
    T_q, T_k = (32, 64) if kind == "cross" else (48, 48)
    torch.manual_seed(0)
    m = MultiHeadAttention(E, H, **options)
    if m.sinks is not None:
        with torch.no_grad():
            m.sinks.normal_()
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(B, T_q, E, generator=g), torch.randn(B, T_k, E, generator=g)
    kw = make(B, T_q, T_k)

    def call(m, x, *rest):
        return m(x, rest[0], **kw) if rest else m(x, **kw)

    inputs = [x, ctx] if kind == "cross" else [x]
    reference = copy.deepcopy(m)
    reference.backend = "math"
    ref = _module_grads(reference, call, inputs, torch.float64)
    with modelled_sdpa(fault):
        got = _module_grads(m, call, inputs, dtype)
        probe = copy.deepcopy(m).to(dtype)
        call(probe, *(t.to(dtype) for t in inputs))
    assert probe.last_backend != "math", probe.last_backend_reason  # the fused path ran
    _assert_exact(got, ref, atol=ATOL if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("fault", FAULTS)
def test_compat_multihead_attention_gradients_are_exact_under_faulty_kernels(fault):
    """``attnlab.compat.MultiheadAttention`` (torch's API: key_padding_mask True = padding, batch_first), a
    sequence all padding, against its math path (need_weights) in float64."""
    torch.manual_seed(0)
    m = CompatMHA(32, 4, batch_first=True)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(3, 8, 32, generator=g), torch.randn(3, 64, 32, generator=g)
    pad = _pad(3, 64)

    def call(m, x, c, need_weights):
        return m(x, c, c, key_padding_mask=pad, need_weights=need_weights)[0]

    ref = _module_grads(m, lambda m, x, c: call(m, x, c, True), [x, ctx], torch.float64)
    with modelled_sdpa(fault):
        got = _module_grads(m, lambda m, x, c: call(m, x, c, False), [x, ctx], torch.float32)
    _assert_exact(got, ref)


@pytest.mark.parametrize("fault", FAULTS)
def test_compat_scripted_sdpa_gradients_are_exact_under_faulty_kernels(fault):
    """The SDPA function that ``torch.jit.script`` compiles into the scripted twin
    (:func:`attnlab.compat.scripted._sdpa_attention`), run as Python under the model: TorchScript binds SDPA's
    aten op when it compiles, so a Python stand-in cannot reach the scripted graph itself; the scripted and eager
    modules' equality is tests/test_compat_script.py's."""
    from attnlab.compat.scripted import _sdpa_attention

    q, k, v = _qkv(B=3, H=4, G=2, T_q=8, T_k=64)
    keep = ~_pad(3, 64)[:, None, None, :]  # (B, 1, 1, T_k), the last sequence all padding
    bias = torch.randn(3, 1, 8, 64, generator=torch.Generator().manual_seed(8))

    def run(f, q, k, v):
        out = f(q, k, v, keep, bias.to(q.dtype))
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype))
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    reference = lambda q, k, v, keep, bias: attnlab.math_attention(q, k, v, keep=keep, bias=bias, scale=0.25)[0]
    ref = run(reference, *(t.detach().double().requires_grad_() for t in (q, k, v)))
    with modelled_sdpa(fault):
        got = run(lambda q, k, v, keep, bias: _sdpa_attention(q, k, v, keep, bias, False, True, 0.25, 0.0), q, k, v)
    _assert_exact(got, ref)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_models_train_on_left_padded_batches_under_faulty_kernels(family, fault):
    """TinyGPT and Llama (random init), a left-padded batch in training mode: the loss's gradients finite and
    equal to those of the same model on the math backend in float64."""
    torch.manual_seed(0)
    if family == "gpt":
        model: nn.Module = attnlab.TinyGPT(
            attnlab.GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32)
        )
    else:
        config = attnlab.LlamaConfig(
            vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64
        )
        model = attnlab.Llama(config)
    ids = torch.randint(1, 50, (2, 24), generator=torch.Generator().manual_seed(2))
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[0, :9] = True

    def grads(model: nn.Module, dtype: torch.dtype, backend: str) -> dict[str, Tensor]:
        model = copy.deepcopy(model).to(dtype).train()
        for mod in model.modules():
            if isinstance(mod, MultiHeadAttention):
                mod.backend = backend
        logits = model(ids, key_padding_mask=pad)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = F.cross_entropy(logits[:, :-1][~pad[:, 1:]].float(), ids[:, 1:][~pad[:, 1:]])
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    ref = grads(model, torch.float64, "math")
    with modelled_sdpa(fault):
        got = grads(model, torch.float32, "auto")
    _assert_exact(got, ref)


# -- Hugging Face -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("mask_kind", ["bool", "float-min"])
@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_hf_attention_function_gradients_are_exact_under_faulty_kernels(mask_kind, sinks, fault):
    """``attnlab.hf.attnlab_attention_forward`` with HF's 4-D masks (bool, or float with the dtype's minimum as
    HF's eager masks): left padding, so the pad queries see no key; with ``s_aux`` (gpt-oss's sinks) too."""
    pytest.importorskip("transformers")
    from attnlab.hf import attnlab_attention_forward

    B, H, G, T, D = 2, 4, 2, 20, 16
    q, k, v = _qkv(B=B, H=H, G=G, T_q=T, T_k=T, D=D)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, :6] = True
    keep = (torch.ones(T, T, dtype=torch.bool).tril() & ~pad[:, None, :])[:, None]  # (B, 1, T, T)
    layer = nn.Module()
    layer.is_causal = True

    def run(q, k, v, dtype):
        mask = (
            keep
            if mask_kind == "bool"
            else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
        )
        kw = {"s_aux": torch.linspace(-1, 1, H, dtype=dtype)} if sinks else {}
        out, _ = attnlab_attention_forward(layer, q, k, v, mask, scaling=0.25, **kw)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(dtype))
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    ref = run(*(t.detach().double().requires_grad_() for t in (q, k, v)), torch.float64)
    with modelled_sdpa(fault):
        got = run(q, k, v, torch.float32)
    _assert_exact(got, ref)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_hf_llama_trains_on_left_padding_under_faulty_kernels(fault):
    """A tiny random-init transformers Llama with ``attn_implementation="attnlab"``, left-padded, in training mode
    (TRL's case: PyTorch #196678 was found through a DPO run): its parameters' gradients finite and equal to those
    of transformers' own "sdpa" attention on torch's CPU kernel (no fault) and the same weights. Not "eager": its
    pad queries attend uniformly (every key at the dtype's minimum), and the last pad position's logits predict
    the first real token, so its loss differs (4.1026 against 4.1047 here); in float64 its mask overflows to NaN."""
    transformers = pytest.importorskip("transformers")
    import attnlab.hf

    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attnlab.hf.register())
    ids = torch.randint(1, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def grads(implementation: str) -> dict[str, Tensor]:
        m = copy.deepcopy(model).train()
        m.set_attn_implementation(implementation)
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return {name: p.grad for name, p in m.named_parameters() if p.grad is not None}

    ref = grads("sdpa")
    with modelled_sdpa(fault):
        got = grads(attnlab.hf.ATTENTION_NAME)
    _assert_exact(got, ref, atol=1e-5)


# -- flex ---------------------------------------------------------------------------------------------------------
def _flex_case(case: str, B: int = 3, T: int = 40) -> tuple[Masks, Structure]:
    """Masks and structure of a flex call with rows that see no key; T = 40 < one 128-key tile, so that the tile
    verdicts and mask_mod both matter."""
    from attnlab.core.variants import document_runs

    j = torch.arange(T)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, :7] = True  # left padding: sequence 0's first 7 queries see no key under causal masking
    pad[-1] = True  # the last sequence is all padding
    key_keep = (~pad)[:, None, None, :]  # (B, 1, 1, T)
    st: dict = {"q_pos": j, "k_pos": j, "causal": True}
    keep = key_keep
    if case == "window":
        st["window"] = 5
    if case == "documents":
        ids = document_runs(torch.stack([(j * 3 // T + b) % 2 for b in range(B)]))
        st.update(q_doc=ids, k_doc=ids)
    if case == "alibi":
        st["alibi"] = alibi_slopes(4)
    if case == "softcap":
        st["softcap"] = 2.0
    if case == "sinks":
        st["sinks"] = torch.linspace(-1, 1, 4)
    if case == "pairs":  # a user mask over (query, key) pairs: the general route
        keep = torch.rand(B, 1, T, T, generator=torch.Generator().manual_seed(3)) > 0.5
        keep[0, :, ::4] = False
    if case == "cache":  # decode-like: 4 queries at positions 30..33 over 40 slots, the last sequence all padding
        st["q_pos"] = torch.arange(30, 34)
    return Masks(keep=keep, empty_rows=True), Structure(**st)


FLEX_CASES = ["padding", "window", "documents", "alibi", "softcap", "sinks", "pairs", "cache"]


@pytest.mark.parametrize("case", [*FLEX_CASES, "window, no padding", "documents, no padding"])
def test_flex_finds_every_row_without_a_key(case):
    """``_dead_rows`` (cumulative counts for key padding, pairs in slabs otherwise, None when each query sees itself)
    equals the dense truth: the rows of ``st.keep() & keep`` with no True."""
    from attnlab.core.flex import _dead_rows

    masks, st = _flex_case(case.split(",")[0])
    if "no padding" in case:
        masks = Masks()
    T_q, T_k = st.q_pos.numel(), st.k_pos.numel()
    truth = st.keep()
    if masks.keep is not None:
        truth = truth & masks.keep
    truth = ~truth.any(-1)  # (B|1, 1, T_q)
    found = _dead_rows(st, masks.keep, T_q, T_k)
    if found is None:
        assert not truth.any(), case
    else:
        assert torch.equal(found.expand_as(truth), truth), case
        assert truth.any() or case == "window, no padding", case


@pytest.mark.parametrize("sinks_by_lse", [True, False], ids=["lse-gate", "sink-key"])
@pytest.mark.parametrize("case", FLEX_CASES)
def test_flex_gradients_are_exact_and_no_row_without_a_key_reaches_the_kernel(case, sinks_by_lse, monkeypatch):
    """attnlab's flex path (block mask, mask_mod, score_mod, the sinks' gate on the log-sum-exp or their extra key)
    differentiated through :class:`FlexModel` on the CPU: output and dq, dk, dv equal variant_math's in float64,
    and the kernel is handed no row that sees no key."""
    from attnlab.core import flex
    from kernel_models import modelled_flex

    if not sinks_by_lse and case != "sinks":
        pytest.skip("the sink-key route differs only with sinks")
    masks, st = _flex_case(case)
    T_q, T_k = st.q_pos.numel(), st.k_pos.numel()
    q, k, v = _qkv(B=3, H=4, G=2, T_q=T_q, T_k=T_k, D=16)

    def run(f, q, k, v):
        out = f(q, k, v)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape).to(out.dtype))
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}

    ref = run(
        lambda q, k, v: variants.variant_math(q, k, v, masks, st, scale=0.3)[0],
        *(t.detach().double().requires_grad_() for t in (q, k, v)),
    )
    with modelled_flex(monkeypatch, sinks_by_lse=sinks_by_lse) as model:
        got = run(lambda q, k, v: flex._flex(q, k, v, masks, st, scale=0.3, compiled=True), q, k, v)
    assert model.calls == 1 and model.rows_without_key == 0
    _assert_exact(got, ref)


@pytest.mark.parametrize("case", ["padding", "documents", "pairs", "cache"])
def test_torch_flex_itself_agrees_on_rows_without_a_key(case):
    """The same calls through torch's own flex_attention (uncompiled, forward: the CPU has no flex backward), the
    block mask and mods as attnlab builds them: equal to variant_math, zeros in the rows that see no key."""
    from attnlab.core import flex

    masks, st = _flex_case(case)
    T_q, T_k = st.q_pos.numel(), st.k_pos.numel()
    q, k, v = (t.detach() for t in _qkv(B=3, H=4, G=2, T_q=T_q, T_k=T_k, D=16))
    with torch.no_grad():
        got = flex._flex(q, k, v, masks, st, scale=0.3, compiled=False)
        ref = variants.variant_math(q.double(), k.double(), v.double(), masks, st, scale=0.3)[0]
    assert torch.allclose(got.double(), ref, atol=2e-6)
