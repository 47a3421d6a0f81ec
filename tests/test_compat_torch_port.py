"""The cases of PyTorch's own test/nn/test_multihead_attention.py, re-derived for
attnlab.compat.MultiheadAttention: each compares it with torch.nn.MultiheadAttention holding the
same weights on the same inputs (float64: tight; float32: 1e-5), and the flag sweep also compares
both with an independent per-head reference written out with loops, as torch's test does with
its NumPy reference.

Not ported: `static_k`/`static_v` (arguments of F.multi_head_attention_forward only, not of the
module). NestedTensor input, which torch takes on its fast path only, has its own file,
test_compat_nested.py; one case here.

Letters: B batch, T query positions, S key positions, E embed_dim, H heads, D = E // H.
"""

from __future__ import annotations

import io
import itertools
import math
import re

import pytest
import torch
from torch import nn

from attnlab.compat import MultiheadAttention

E, H, B, T, S = 12, 4, 3, 4, 5
D = E // H
TOL32 = 1e-5
TOL64 = 1e-12


def _pair(*, dtype=torch.float64, seed=0, **kw) -> tuple[nn.MultiheadAttention, MultiheadAttention]:
    """torch's module with every parameter non-trivial (biases included), and ours with its state dict."""
    ref = nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=dtype))
    ours = MultiheadAttention(E, H, dtype=dtype, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _seq(m: nn.Module, length: int, width: int, *, batch: int = B, dtype=torch.float64) -> torch.Tensor:
    return torch.randn((batch, length, width) if m.batch_first else (length, batch, width), dtype=dtype)


def _padding(kind: str, *, dtype=torch.float64) -> torch.Tensor:
    """(B, S): batch 1 pads its last 2 keys, batch 2 its first; bool True = padding or float -inf."""
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    pad[2, 0] = True
    return pad if kind == "bool" else torch.zeros(B, S, dtype=dtype).masked_fill(pad, float("-inf"))


def _attn_mask(kind: str, *, dtype=torch.float64) -> torch.Tensor:
    """'bool2d' (T, S), 'bool3d' (B*H, T, S) with True = blocked, or their float forms; key 0 never blocked."""
    g = torch.Generator().manual_seed(3)
    shape = (T, S) if kind.endswith("2d") else (B * H, T, S)
    blocked = torch.rand(shape, generator=g) < 0.4
    blocked[..., 0] = False
    if kind.startswith("bool"):
        return blocked
    return torch.randn(shape, generator=g, dtype=dtype).masked_fill(blocked, float("-inf"))


def _both(ref, ours, *args, **kw):
    return ref(*args, **kw), ours(*args, **kw)


def _assert_close(a: torch.Tensor | None, b: torch.Tensor | None, tol: float) -> None:
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert (a - b).abs().max() <= tol, (a - b).abs().max()


# -- the flag sweep against an independent reference ----------------------------------------------


def _reference(sd: dict, q, k, v, *, key_padding_mask=None, attn_mask=None, bias_kv=False, zero_attn=False):
    """Per batch element and per head, written out: batch-first inputs, torch's masks; returns the
    output (B, T, E) and per-head weights (B, H, T, S')."""
    if "in_proj_weight" in sd:
        wq, wk, wv = sd["in_proj_weight"].chunk(3)
    else:
        wq, wk, wv = sd["q_proj_weight"], sd["k_proj_weight"], sd["v_proj_weight"]
    bq, bk, bv = sd["in_proj_bias"].chunk(3) if "in_proj_bias" in sd else (torch.zeros(E, dtype=q.dtype),) * 3
    outs, weights = [], []
    for b in range(q.size(0)):
        heads, head_weights = [], []
        for h in range(H):
            rows = slice(h * D, (h + 1) * D)
            qh = q[b] @ wq[rows].T + bq[rows]  # (T, D)
            kh = k[b] @ wk[rows].T + bk[rows]  # (S, D)
            vh = v[b] @ wv[rows].T + bv[rows]  # (S, D)
            bias = torch.zeros(q.size(1), k.size(1), dtype=q.dtype)  # (T, S)
            if attn_mask is not None:
                m = attn_mask if attn_mask.dim() == 2 else attn_mask[b * H + h]
                bias = bias + (torch.zeros_like(bias).masked_fill(m, float("-inf")) if m.dtype == torch.bool else m)
            if key_padding_mask is not None:
                p = key_padding_mask[b]
                bias = bias + (
                    torch.zeros(p.shape, dtype=q.dtype).masked_fill(p, float("-inf")) if p.dtype == torch.bool else p
                )
            if bias_kv:
                kh = torch.cat([kh, sd["bias_k"][0, 0, rows][None]])  # (S+1, D)
                vh = torch.cat([vh, sd["bias_v"][0, 0, rows][None]])
                bias = torch.cat([bias, torch.zeros(bias.size(0), 1, dtype=q.dtype)], dim=1)
            if zero_attn:
                kh = torch.cat([kh, torch.zeros(1, D, dtype=q.dtype)])  # (S', D)
                vh = torch.cat([vh, torch.zeros(1, D, dtype=q.dtype)])
                bias = torch.cat([bias, torch.zeros(bias.size(0), 1, dtype=q.dtype)], dim=1)
            scores = qh @ kh.T / math.sqrt(D) + bias  # (T, S')
            e = (scores - scores.max(dim=-1, keepdim=True).values).exp()
            w = e / e.sum(dim=-1, keepdim=True)
            heads.append(w @ vh)  # (T, D)
            head_weights.append(w)
        outs.append(torch.cat(heads, dim=-1) @ sd["out_proj.weight"].T + sd.get("out_proj.bias", 0.0))
        weights.append(torch.stack(head_weights))
    return torch.stack(outs), torch.stack(weights)


FLAGS = ("key_padding_mask", "bias_kv", "zero_attn", "same_embed_dim", "average")


@pytest.mark.parametrize(
    "flags", list(itertools.product([False, True], repeat=len(FLAGS))), ids=lambda f: "".join("01"[x] for x in f)
)
def test_flag_sweep_against_the_written_out_reference(flags):
    """torch's `_multihead_attn_test_helper`: every on/off combination of the module's features."""
    on = dict(zip(FLAGS, flags, strict=True))
    kdim, vdim = (E, E) if on["same_embed_dim"] else (7, 5)
    ref, ours = _pair(add_bias_kv=on["bias_kv"], add_zero_attn=on["zero_attn"], kdim=kdim, vdim=vdim, batch_first=True)
    q, k, v = _seq(ref, T, E), _seq(ref, S, kdim), _seq(ref, S, vdim)
    kw = {"key_padding_mask": _padding("bool")} if on["key_padding_mask"] else {}
    (ref_out, ref_w), (out, w) = _both(ref, ours, q, k, v, average_attn_weights=on["average"], **kw)
    expected_out, expected_w = _reference(
        ours.state_dict(), q, k, v, bias_kv=on["bias_kv"], zero_attn=on["zero_attn"], **kw
    )
    if on["average"]:
        expected_w = expected_w.mean(dim=1)
    _assert_close(out, expected_out, TOL64)
    _assert_close(w, expected_w, TOL64)
    _assert_close(ref_out, expected_out, TOL64)  # the reference is torch's semantics, not ours
    _assert_close(ref_w, w, TOL64)


# -- masks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["bool2d", "float2d", "bool3d", "float3d"])
@pytest.mark.parametrize("padding", ["none", "bool", "float"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask is deprecated")
def test_attn_mask_and_key_padding_mask_in_every_form(mask, padding, need_weights):
    ref, ours = _pair()
    x, ctx = _seq(ref, T, E), _seq(ref, S, E)
    kw = {"attn_mask": _attn_mask(mask)}
    if padding != "none":
        kw["key_padding_mask"] = _padding(padding)
    (ref_out, ref_w), (out, w) = _both(ref, ours, x, ctx, ctx, need_weights=need_weights, **kw)
    _assert_close(out, ref_out, TOL64)
    _assert_close(w, ref_w, TOL64)


@pytest.mark.parametrize("module", ["torch", "ours"])
def test_a_bool_mask_is_the_float_mask_with_minus_inf(module):
    ref, ours = _pair()
    m = ref if module == "torch" else ours
    x = _seq(m, T, E)
    blocked = torch.rand(T, T) < 0.4
    blocked[:, 0] = False
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[0, -1] = True
    as_float = {"attn_mask": torch.zeros(T, T, dtype=x.dtype).masked_fill(blocked, float("-inf")),
                "key_padding_mask": torch.zeros(B, T, dtype=x.dtype).masked_fill(pad, float("-inf"))}  # fmt: skip
    _assert_close(m(x, x, x, attn_mask=blocked, key_padding_mask=pad)[0], m(x, x, x, **as_float)[0], TOL64)


@pytest.mark.parametrize("module", ["torch", "ours"])
def test_a_3d_mask_is_one_2d_mask_per_batch_element_and_head(module):
    """torch's `test_multihead_attn_3d_attn_mask`: the (B*H, T, S) mask, row b*H + h, run one batch element at a time."""
    ref, ours = _pair()
    m = ref if module == "torch" else ours
    q, ctx = _seq(m, T, E), _seq(m, S, E)
    per_batch_head = _attn_mask("bool3d")
    out, w = m(q, ctx, ctx, attn_mask=per_batch_head, average_attn_weights=False)
    for b in range(B):
        mask_b = per_batch_head[b * H : (b + 1) * H]  # (H, T, S): the unbatched 3-D form
        out_b, w_b = m(q[:, b], ctx[:, b], ctx[:, b], attn_mask=mask_b, average_attn_weights=False)
        _assert_close(out[:, b], out_b, TOL64)
        _assert_close(w[b], w_b, TOL64)


# -- layouts: batched / unbatched, batch_first, kdim/vdim, projections without bias -----------


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kw", [{}, {"kdim": 7, "vdim": 5}, {"bias": False}, {"bias": False, "kdim": 7}], ids=str)
def test_batched_and_unbatched_forward(batch_first, kw):
    ref, ours = _pair(batch_first=batch_first, **kw)
    q, k, v = _seq(ref, T, E), _seq(ref, S, ref.kdim), _seq(ref, S, ref.vdim)
    for args in (
        (q, k, v),
        (q[0] if batch_first else q[:, 0], k[0] if batch_first else k[:, 0], v[0] if batch_first else v[:, 0]),
    ):
        (ref_out, ref_w), (out, w) = _both(ref, ours, *args)
        _assert_close(out, ref_out, TOL64)
        _assert_close(w, ref_w, TOL64)
    unbatched, _ = ours(q[:, 0], k[:, 0], v[:, 0]) if not batch_first else ours(q[0], k[0], v[0])
    batched = ours(q, k, v)[0]
    _assert_close(unbatched, batched[:, 0] if not batch_first else batched[0], TOL64)


def test_batch_first_is_only_a_transpose():
    seq_first = _pair(batch_first=False)[1]
    ours_bf = MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    ours_bf.load_state_dict(seq_first.state_dict())
    x = torch.randn(B, T, E, dtype=torch.float64)
    ctx = torch.randn(B, S, E, dtype=torch.float64)
    out_bf, w_bf = ours_bf(x, ctx, ctx)
    out_sf, w_sf = seq_first(x.transpose(0, 1), ctx.transpose(0, 1), ctx.transpose(0, 1))
    _assert_close(out_bf, out_sf.transpose(0, 1), TOL64)
    _assert_close(w_bf, w_sf, TOL64)


@pytest.mark.parametrize("batch_first", [False, True])
def test_self_attention_where_torch_takes_its_fused_fast_path(batch_first):
    """eval + no_grad + batch_first self-attention runs torch's `_native_multi_head_attention`."""
    ref, ours = _pair(dtype=torch.float32, batch_first=batch_first)
    ref.eval(), ours.eval()
    x = _seq(ref, T, E, dtype=torch.float32)
    pad = _padding("bool")[:, :T]
    with torch.no_grad():
        for kw in ({}, {"key_padding_mask": pad}):
            for need_weights in (False, True):
                (ref_out, ref_w), (out, w) = _both(ref, ours, x, x, x, need_weights=need_weights, **kw)
                # the fast path fills padded query rows with 0 in its output; compare the rest
                keep = ~pad.T if not batch_first and kw else ~pad if kw else torch.ones(out.shape[:2], dtype=torch.bool)
                _assert_close(out[keep], ref_out[keep], TOL32)
                if need_weights:
                    _assert_close(w, ref_w, TOL32)


# -- weights, is_causal, dropout ----------------------------------------------------------------


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("extra", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}], ids=str)
def test_returned_weights(average, extra):
    ref, ours = _pair(**extra)
    q, ctx = _seq(ref, T, E), _seq(ref, S, E)
    (ref_out, ref_w), (out, w) = _both(ref, ours, q, ctx, ctx, average_attn_weights=average)
    s_all = S + len(extra)
    assert w.shape == ((B, T, s_all) if average else (B, H, T, s_all))
    _assert_close(w, ref_w, TOL64)
    _assert_close(out, ref_out, TOL64)


@pytest.mark.parametrize("q_len,k_len", [(T, T), (3, 5), (5, 3)])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("extra", [{}, {"add_bias_kv": True, "add_zero_attn": True}], ids=str)
def test_is_causal_is_the_same_hint_as_in_torch(q_len, k_len, need_weights, padding, extra):
    """torch trusts the hint (SDPA's top-left causal mask replaces attn_mask) only when no padding
    mask is given and need_weights=False; otherwise attn_mask is applied as given. Ours does the same."""
    ref, ours = _pair(**extra)
    q, ctx = _seq(ref, q_len, E), _seq(ref, k_len, E)
    causal = torch.ones(q_len, k_len, dtype=torch.bool).triu(1)  # True = blocked
    kw = {"key_padding_mask": torch.zeros(B, k_len, dtype=torch.bool)} if padding else {}
    (ref_out, _), (out, _) = _both(
        ref, ours, q, ctx, ctx, attn_mask=causal, is_causal=True, need_weights=need_weights, **kw
    )
    _assert_close(out, ref_out, TOL64)


def test_is_causal_without_attn_mask_raises_in_both():
    ref, ours = _pair()
    x = _seq(ref, T, E)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        ref(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="is_causal=True was given without attn_mask"):
        ours(x, x, x, is_causal=True)


@pytest.mark.parametrize("module", ["torch", "ours"])
def test_dropout_acts_on_the_weights_in_training_only(module):
    p = 0.5
    ref, ours = _pair(dropout=p)
    m = ref if module == "torch" else ours
    x = _seq(m, T, E)
    m.eval()
    clean_out, clean_w = m(x, x, x, average_attn_weights=False)
    m.train()
    torch.manual_seed(0)
    _, dropped_w = m(x, x, x, average_attn_weights=False)
    kept = dropped_w != 0
    assert 0.35 < 1 - kept.double().mean() < 0.65  # about p of the weights zeroed
    _assert_close(dropped_w[kept], clean_w[kept] / (1 - p), TOL64)  # survivors rescaled by 1/(1-p)
    # the output is linear in the weights: its mean over many draws is the eval-mode output
    mean = torch.stack([m(x, x, x, need_weights=False)[0] for _ in range(400)]).mean(0)
    assert (mean - clean_out).abs().mean() < 0.1 * clean_out.abs().mean()
    assert not torch.equal(m(x, x, x)[0], clean_out)


# -- gradients, dtypes, devices, state dicts, strides ---------------------------------------------


@pytest.mark.parametrize("kw", [{}, {"kdim": 7, "vdim": 5, "add_bias_kv": True, "add_zero_attn": True}], ids=str)
@pytest.mark.parametrize("need_weights", [True, False])
def test_gradients_match_torch(kw, need_weights):
    ref, ours = _pair(**kw)
    q, k, v = _seq(ref, T, E), _seq(ref, S, ref.kdim), _seq(ref, S, ref.vdim)
    masks = {"attn_mask": _attn_mask("float3d"), "key_padding_mask": _padding("float")}
    grads = []
    for m in (ref, ours):
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, w = m(*inputs, need_weights=need_weights, **masks)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
        if w is not None:
            loss = loss + (w**2).sum()
        loss.backward()
        grads.append([t.grad for t in inputs] + [p.grad for p in m.parameters()])
    for g_ref, g_ours in zip(*grads, strict=True):
        _assert_close(g_ours, g_ref, 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtype_and_device_keywords(dtype):
    ours = MultiheadAttention(E, H, add_bias_kv=True, kdim=7, device="cpu", dtype=dtype)
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in ours.parameters())
    ref = nn.MultiheadAttention(E, H, add_bias_kv=True, kdim=7, device="cpu", dtype=dtype)
    ref.load_state_dict(ours.state_dict())
    q, k = torch.randn(T, B, E, dtype=dtype), torch.randn(S, B, 7, dtype=dtype)
    v = torch.randn(S, B, E, dtype=dtype)
    (ref_out, ref_w), (out, w) = _both(ref, ours, q, k, v)
    assert out.dtype == w.dtype == dtype
    tol = {torch.float32: TOL32, torch.float64: TOL64, torch.bfloat16: 5e-2}[dtype]
    _assert_close(out, ref_out, tol)
    _assert_close(w, ref_w, tol)
    on_meta = MultiheadAttention(E, H, kdim=7, device="meta")
    assert all(p.is_meta for p in on_meta.parameters())
    assert {n: p.shape for n, p in on_meta.state_dict().items()} == {
        n: p.shape for n, p in nn.MultiheadAttention(E, H, kdim=7, device="meta").state_dict().items()
    }


@pytest.mark.parametrize("kw", [{}, {"kdim": 7, "vdim": 5}, {"add_bias_kv": True, "bias": False}], ids=str)
def test_state_dict_round_trip_through_a_file(kw):
    ref, ours = _pair(**kw)
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    loaded = nn.MultiheadAttention(E, H, dtype=torch.float64, **kw)
    loaded.load_state_dict(torch.load(buf, weights_only=True))
    again = MultiheadAttention(E, H, dtype=torch.float64, **kw)
    again.load_state_dict(loaded.state_dict())
    q, k, v = _seq(ref, T, E), _seq(ref, S, ref.kdim), _seq(ref, S, ref.vdim)
    _assert_close(again(q, k, v)[0], ref(q, k, v)[0], TOL64)
    _assert_close(loaded(q, k, v)[0], ref(q, k, v)[0], 0.0)


def test_non_contiguous_inputs_and_masks():
    ref, ours = _pair()
    q = torch.randn(E, B, T, dtype=torch.float64).permute(2, 1, 0)  # (T, B, E), strided
    ctx = torch.randn(S, 2 * B, E, dtype=torch.float64)[:, ::2]  # (S, B, E), every other batch row
    mask = _attn_mask("float3d").transpose(1, 2).contiguous().transpose(1, 2)  # (B*H, T, S), strided
    pad = _padding("float").T.contiguous().T  # (B, S), strided
    assert not (q.is_contiguous() or ctx.is_contiguous() or mask.is_contiguous() or pad.is_contiguous())
    (ref_out, ref_w), (out, w) = _both(ref, ours, q, ctx, ctx, attn_mask=mask, key_padding_mask=pad)
    _assert_close(out, ref_out, TOL64)
    _assert_close(w, ref_w, TOL64)


# -- invalid inputs: torch's module and ours refuse the same ones ----------------------------------

INVALID = {
    "query 4-D": lambda x, c: ((x[None], c, c), {}),
    "query 1-D": lambda x, c: ((x[0, 0], c, c), {}),
    "key 2-D for a batched query": lambda x, c: ((x, c[:, 0], c[:, 0]), {}),
    "value 2-D for a batched query": lambda x, c: ((x, c, c[:, 0]), {}),
    "key 3-D for an unbatched query": lambda x, c: ((x[:, 0], c, c), {}),
    "query of the wrong width": lambda x, c: ((x[..., :-1], c, c), {}),
    "key of the wrong width": lambda x, c: ((x, c[..., :-1], c), {}),
    "key and value of different lengths": lambda x, c: ((x, c, c[:-1]), {}),
    "key_padding_mask 1-D for a batched query": lambda x, c: ((x, c, c), {"key_padding_mask": torch.zeros(S, dtype=torch.bool)}),
    "key_padding_mask 2-D for an unbatched query": lambda x, c: ((x[:, 0], c[:, 0], c[:, 0]), {"key_padding_mask": torch.zeros(1, S, dtype=torch.bool)}),
    "key_padding_mask of the wrong length": lambda x, c: ((x, c, c), {"key_padding_mask": torch.zeros(B, S + 1, dtype=torch.bool)}),
    "key_padding_mask of ints": lambda x, c: ((x, c, c), {"key_padding_mask": torch.zeros(B, S, dtype=torch.long)}),
    "attn_mask 1-D": lambda x, c: ((x, c, c), {"attn_mask": torch.zeros(S, dtype=torch.bool)}),
    "attn_mask 4-D": lambda x, c: ((x, c, c), {"attn_mask": torch.zeros(B, H, T, S, dtype=torch.bool)}),
    "attn_mask 2-D of the wrong shape": lambda x, c: ((x, c, c), {"attn_mask": torch.zeros(T, S + 1, dtype=torch.bool)}),
    "attn_mask 3-D per batch, not per batch and head": lambda x, c: ((x, c, c), {"attn_mask": torch.zeros(B, T, S, dtype=torch.bool)}),
    "attn_mask 3-D for an unbatched query, not per head": lambda x, c: ((x[:, 0], c[:, 0], c[:, 0]), {"attn_mask": torch.zeros(1, T, S, dtype=torch.bool)}),
    "attn_mask of ints": lambda x, c: ((x, c, c), {"attn_mask": torch.zeros(T, S, dtype=torch.long)}),
    "is_causal without attn_mask": lambda x, c: ((x, c, c), {"is_causal": True}),
    "query of another dtype": lambda x, c: ((x.float(), c, c), {}),
}  # fmt: skip


@pytest.mark.parametrize("case", INVALID)
def test_both_modules_refuse_the_same_invalid_inputs(case):
    ref, ours = _pair()
    x, ctx = torch.randn(T, B, E, dtype=torch.float64), torch.randn(S, B, E, dtype=torch.float64)
    args, kw = INVALID[case](x, ctx)
    with pytest.raises((AssertionError, RuntimeError)):
        ref(*args, **kw)
    with pytest.raises((ValueError, TypeError)) as err:  # ours: one clear sentence, never a raw internal error
        ours(*args, **kw)
    assert str(err.value).startswith(("query ", "key ", "value ", "key_padding_mask ", "attn_mask ", "is_causal=True "))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_torch_takes_on_its_fast_path_ours_in_training_too():
    ref, ours = _pair(dtype=torch.float32, batch_first=True)
    nested = torch.nested.nested_tensor([torch.randn(2, E), torch.randn(3, E)])
    with torch.no_grad():
        expected, _ = ref.eval()(nested, nested, nested, need_weights=False)  # torch's fast path
    with pytest.raises(AssertionError, match="does not support NestedTensor outside of its fast path"):
        ref.train()(nested, nested, nested)
    got, _ = ours.train()(nested, nested, nested, need_weights=False)  # dropout 0: only autograd differs
    assert got.is_nested and got.requires_grad
    assert max((g - e).abs().max() for g, e in zip(got.unbind(), expected.unbind(), strict=True)) <= TOL32
    # with a mask both still refuse (the nested lengths are the key padding); every case: test_compat_nested.py
    pad = torch.zeros(2, 3, dtype=torch.bool)
    with torch.no_grad(), pytest.raises(AssertionError, match="does not support NestedTensor outside of its fast path"):
        ref.eval()(nested, nested, nested, key_padding_mask=pad)
    message = (
        "key_padding_mask was given with NestedTensor inputs, whose lengths already say which keys exist "
        "(nn.MultiheadAttention refuses the pair too); drop it, or pass padded tensors "
        "(key.to_padded_tensor(0.0)) with it."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ours(nested, nested, nested, key_padding_mask=pad)
