"""attnlab.compat.MultiheadAttention as a drop-in for torch.nn.MultiheadAttention: its parameters
and state dicts, GQA, the one deliberate difference (zeros, not NaN, for fully masked rows), its
place inside nn.TransformerEncoderLayer / nn.TransformerDecoderLayer, and its error messages.

Letters: B batch, T query positions, S key positions, E embed_dim, H heads, G K/V heads.
The case-by-case parity with torch's module lives in test_compat_torch_port.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab.compat import MultiheadAttention

E, H, B, T, S = 12, 4, 2, 5, 6  # head dim 3: a scale that is not a power of two
TOL = 1e-5

LAYOUTS = {
    "packed": {},
    "kdim_vdim": {"kdim": 7, "vdim": 5},
    "no_bias": {"bias": False},
    "bias_kv": {"add_bias_kv": True},
    "zero_attn": {"add_zero_attn": True},
    "everything": {"add_bias_kv": True, "add_zero_attn": True, "kdim": 7, "vdim": 5, "batch_first": True},
}


def _pair(
    seed: int = 0, *, device: torch.device | str = "cpu", **kw
) -> tuple[nn.MultiheadAttention, MultiheadAttention]:
    """torch's module with every parameter made non-trivial, and ours loaded from its state dict."""
    ref = nn.MultiheadAttention(E, H, device=device, **kw)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in ref.parameters():  # torch zeroes the biases: make them matter
            p.add_(0.3 * torch.randn(p.shape, generator=g).to(device))
    ours = MultiheadAttention(E, H, device=device, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _inputs(m: nn.Module, *, batch: int = B) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value drawn on the CPU (the same numbers on every device), on ``m``'s device."""
    device = next(m.parameters()).device

    def seq(length: int, width: int) -> torch.Tensor:
        shape = (batch, length, width) if m.batch_first else (length, batch, width)
        return torch.randn(shape).to(device)

    return seq(T, E), seq(S, m.kdim), seq(S, m.vdim)


# -- parameters, init, state dicts ------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_parameters_and_initial_values_as_torch_under_one_seed(layout):
    torch.manual_seed(7)
    ref = nn.MultiheadAttention(E, H, **LAYOUTS[layout])
    torch.manual_seed(7)
    ours = MultiheadAttention(E, H, **LAYOUTS[layout])
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert list(our_sd) == list(ref_sd)
    for name in ref_sd:
        assert torch.equal(our_sd[name], ref_sd[name]), name
    assert (ours.in_proj_weight is None) == (ref.in_proj_weight is None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_dicts_load_both_ways_and_compute_the_same(layout, device):
    kw = LAYOUTS[layout]
    ref, ours = _pair(device=device, **kw)  # torch -> ours
    back = nn.MultiheadAttention(E, H, **kw).to(device)
    back.load_state_dict(ours.state_dict())  # ours -> torch
    q, k, v = _inputs(ref)
    expected, _ = ref(q, k, v)
    assert (ours(q, k, v)[0] - expected).abs().max() <= TOL
    assert torch.equal(back(q, k, v)[0], expected)


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa_into_packed", "kdim_into_packed"])
def test_a_layout_mismatch_in_the_state_dict_says_why(gqa):
    kw = {"num_kv_heads": 2} if gqa else {"kdim": 7}
    ours = MultiheadAttention(E, H, **kw)
    with pytest.raises(RuntimeError, match="holds a packed 'in_proj_weight'") as err:
        ours.load_state_dict(nn.MultiheadAttention(E, H).state_dict())
    assert ("num_kv_heads=2 differs from num_heads=4" if gqa else "kdim=7") in str(err.value)
    with pytest.raises(RuntimeError, match="holds separate 'q_proj_weight'"):
        MultiheadAttention(E, H).load_state_dict(nn.MultiheadAttention(E, H, kdim=7).state_dict())


# -- GQA ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("extras", [{}, {"add_bias_kv": True, "add_zero_attn": True, "kdim": 7}])
def test_gqa_equals_torch_with_each_kv_head_repeated(G, extras, device):
    ours = MultiheadAttention(E, H, num_kv_heads=G, **extras)
    D, rep = E // H, H // G
    assert ours.in_proj_weight is None  # GQA always takes the separate layout
    assert ours.k_proj_weight.shape == (G * D, ours.kdim) and ours.in_proj_bias.shape == (E + 2 * G * D,)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.3 * torch.randn_like(p))

    def per_query_head(t):  # (G*D, ...) -> (H*D, ...): K/V head g serves query heads g*rep ... g*rep+rep-1
        return t.reshape(G, D, *t.shape[1:]).repeat_interleave(rep, dim=0).flatten(0, 1)

    ref = nn.MultiheadAttention(E, H, **extras)
    b_q, b_k, b_v = ours.in_proj_bias.split([E, G * D, G * D])
    sd = {
        "q_proj_weight": ours.q_proj_weight,
        "k_proj_weight": per_query_head(ours.k_proj_weight),
        "v_proj_weight": per_query_head(ours.v_proj_weight),
        "in_proj_bias": torch.cat([b_q, per_query_head(b_k), per_query_head(b_v)]),
        "out_proj.weight": ours.out_proj.weight,
        "out_proj.bias": ours.out_proj.bias,
    }
    if "add_bias_kv" in extras:
        sd["bias_k"] = per_query_head(ours.bias_k[0, 0])[None, None]
        sd["bias_v"] = per_query_head(ours.bias_v[0, 0])[None, None]
    if ref.in_proj_weight is not None:  # kdim == vdim == E: torch packs the three
        sd["in_proj_weight"] = torch.cat([sd.pop("q_proj_weight"), sd.pop("k_proj_weight"), sd.pop("v_proj_weight")])
    ref.load_state_dict(sd)
    ours, ref = ours.to(device), ref.to(device)
    q, k, v = _inputs(ours)
    pad = torch.zeros(B, S, dtype=torch.bool, device=device)
    pad[1, :2] = True
    out, w = ours(q, k, v, key_padding_mask=pad, average_attn_weights=False)
    ref_out, ref_w = ref(q, k, v, key_padding_mask=pad, average_attn_weights=False)
    assert (out - ref_out).abs().max() <= TOL and (w - ref_w).abs().max() <= TOL


# -- the one deliberate difference: fully masked rows ------------------------------------------


def _fully_masking(kind: str) -> dict:
    """Masks under which query 1 of batch 0 sees no key at all (every other row sees some)."""
    if kind == "key_padding_bool":
        pad = torch.zeros(B, S, dtype=torch.bool)
        pad[0] = True  # batch 0 is all padding: all its queries are fully masked
        return {"key_padding_mask": pad}
    if kind == "key_padding_float":
        return {"key_padding_mask": torch.zeros(B, S).index_fill(0, torch.tensor([0]), float("-inf"))}
    if kind == "attn_mask_bool_3d":
        blocked = torch.zeros(B * H, T, S, dtype=torch.bool)
        blocked[:H, 1] = True  # batch 0 (rows 0..H-1), query 1, every head
        return {"attn_mask": blocked}
    if kind == "attn_mask_float_plus_padding":
        bias = torch.zeros(T, S)
        bias[1, 2:] = float("-inf")  # query 1 sees keys 0 and 1 only ...
        pad = torch.zeros(B, S)
        pad[0, :2] = float("-inf")  # ... which batch 0 pads
        return {"attn_mask": bias, "key_padding_mask": pad}
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["key_padding_bool", "key_padding_float", "attn_mask_bool_3d", "attn_mask_float_plus_padding"]
)
@pytest.mark.parametrize("need_weights", [True, False])
def test_fully_masked_rows_give_zeros_where_torch_gives_nan(kind, need_weights, device):
    ref, ours = _pair(device=device)
    q, k, v = _inputs(ref)
    masks = {n: m.to(device) for n, m in _fully_masking(kind).items()}
    q.requires_grad_(True)
    ref_out, _ = ref(q, k, v, need_weights=need_weights, **masks)
    out, w = ours(q, k, v, need_weights=need_weights, **masks)

    empty = torch.zeros(T, B, dtype=torch.bool, device=device)  # (T, B): the rows with no visible key
    empty[:, 0] = kind.startswith("key_padding")
    empty[1, 0] = True
    bias = ours.out_proj.bias.detach().expand_as(out[empty])
    if need_weights:  # torch's default path: its own softmax over a row of -inf
        assert ref_out[empty].isnan().all(), "torch no longer gives NaN there: update the docstring"
    else:  # torch's SDPA path: NaN or zeros, as the kernel decides
        assert ref_out[empty].isnan().all() or torch.allclose(ref_out[empty], bias)
    assert torch.equal(out[empty], bias)  # ours: a context of zeros, on every path
    assert (out[~empty] - ref_out[~empty]).abs().max() <= TOL  # every other row as torch
    if need_weights:
        assert torch.equal(w.transpose(0, 1)[empty], torch.zeros_like(w.transpose(0, 1)[empty]))
    out.sum().backward()
    assert q.grad.isfinite().all() and all(p.grad.isfinite().all() for p in ours.parameters())


# -- inside torch's transformer layers ------------------------------------------------------------


class CountingMHA(MultiheadAttention):
    """Counts forward calls without a hook (a hook alone would switch torch's fast path off)."""

    calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)


class PackedLookingMHA(CountingMHA):
    """What happens without the deliberate `_qkv_same_embed_dim = False` (torch's fast path also
    needs `merge_masks`, which ours has no use for)."""

    merge_masks = nn.MultiheadAttention.merge_masks

    @property
    def _qkv_same_embed_dim(self) -> bool:
        return True


def _swap_attention(attn: nn.MultiheadAttention, cls=CountingMHA) -> MultiheadAttention:
    ours = cls(attn.embed_dim, attn.num_heads, dropout=attn.dropout, batch_first=attn.batch_first)
    ours.load_state_dict(attn.state_dict())
    return ours


def _run(layer: nn.Module, mode: str, *args, **kwargs) -> torch.Tensor:
    layer.train(mode == "train")
    with torch.set_grad_enabled(mode != "eval+no_grad"):
        return layer(*args, **kwargs)


@pytest.mark.parametrize("mode", ["train", "eval", "eval+no_grad"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "padding", "causal+padding"])
def test_encoder_layer_runs_our_forward_and_matches_torch(mode, batch_first, masks, device):
    ref = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first, device=device)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first, device=device)
    layer.load_state_dict(ref.state_dict())
    layer.self_attn = _swap_attention(ref.self_attn).to(device)
    x = torch.randn(B, T, E, device=device) if batch_first else torch.randn(T, B, E, device=device)
    kw = {}
    if "padding" in masks:
        kw["src_key_padding_mask"] = torch.zeros(B, T, dtype=torch.bool, device=device)
        kw["src_key_padding_mask"][:, T - 1] = True
    if "causal" in masks:  # bool, like the padding
        kw.update(src_mask=torch.ones(T, T, dtype=torch.bool, device=device).triu(1), is_causal=True)
    expected = _run(ref, mode, x, **kw)
    got = _run(layer, mode, x, **kw)
    assert layer.self_attn.calls == 1  # attnlab ran: the fast path did not bypass it
    assert (got - expected).abs().max() <= TOL


def test_the_fast_path_check_is_what_keeps_our_forward_running():
    """The control: a module answering `_qkv_same_embed_dim = True` is skipped in eval + no_grad."""
    ref = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True).eval()
    x = torch.randn(B, T, E)
    for cls, expected_calls in ((PackedLookingMHA, 0), (CountingMHA, 1)):
        ref.self_attn = _swap_attention(nn.MultiheadAttention(E, H, batch_first=True), cls)
        with torch.no_grad():
            ref(x)
        assert ref.self_attn.calls == expected_calls, cls.__name__


@pytest.mark.parametrize("mode", ["train", "eval", "eval+no_grad"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_decoder_layer_with_both_attentions_swapped_matches_torch(mode, batch_first, device):
    ref = nn.TransformerDecoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first)
    layer = nn.TransformerDecoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first)
    layer.load_state_dict(ref.state_dict())
    layer.self_attn = _swap_attention(ref.self_attn)
    layer.multihead_attn = _swap_attention(ref.multihead_attn)
    ref, layer = ref.to(device), layer.to(device)
    tgt = (torch.randn(B, T, E) if batch_first else torch.randn(T, B, E)).to(device)
    memory = (torch.randn(B, S, E) if batch_first else torch.randn(S, B, E)).to(device)
    memory_pad = torch.zeros(B, S, dtype=torch.bool, device=device)
    memory_pad[1, -2:] = True
    kw = {
        "tgt_mask": nn.Transformer.generate_square_subsequent_mask(T, device=device),
        "tgt_is_causal": True,
        "memory_key_padding_mask": memory_pad,
    }
    expected = _run(ref, mode, tgt, memory, **kw)
    got = _run(layer, mode, tgt, memory, **kw)
    assert layer.self_attn.calls == 1 and layer.multihead_attn.calls == 1
    assert (got - expected).abs().max() <= TOL


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_an_encoder_built_around_our_layer_keeps_padded_tensors(device):
    """nn.TransformerEncoder reads `_qkv_same_embed_dim` too: it must not make nested tensors for us."""
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    layer.self_attn = _swap_attention(layer.self_attn)
    with pytest.warns(UserWarning, match="_qkv_same_embed_dim was not True"):
        ours = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    ours.load_state_dict(ref.state_dict())
    assert ref.use_nested_tensor and not ours.use_nested_tensor
    ref, ours = ref.to(device), ours.to(device)
    x = torch.randn(B, T, E).to(device)
    pad = torch.zeros(B, T, dtype=torch.bool, device=device)
    pad[1, -2:] = True
    with torch.no_grad():
        expected, got = ref(x, src_key_padding_mask=pad), ours(x, src_key_padding_mask=pad)
    # torch's nested path writes 0 at padded positions; both agree everywhere else
    assert (got[~pad] - expected[~pad]).abs().max() <= TOL
    assert all(m.self_attn.calls == 1 for m in ours.layers)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_an_encoder_that_decided_on_nested_tensors_before_the_swap_gets_our_answer(device):
    """Built around torch's attention, the encoder sends nested tensors to the swapped-in self_attn
    (eval, no_grad, src_key_padding_mask): ours takes them and gives torch's answer.
    Every case of this is in test_compat_nested.py."""
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=True).eval()
    encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=True).eval()
    encoder.load_state_dict(ref.state_dict())
    encoder.layers[0].self_attn = _swap_attention(encoder.layers[0].self_attn)  # after the encoder decided
    assert encoder.use_nested_tensor
    ref, encoder = ref.to(device), encoder.to(device)
    x = torch.randn(B, T, E).to(device)
    pad = torch.zeros(B, T, dtype=torch.bool, device=device)
    pad[1, -2:] = True
    nested = []
    encoder.layers[0].self_attn.register_forward_pre_hook(lambda m, args: nested.append(args[0].is_nested))
    with torch.no_grad():
        expected, got = ref(x, src_key_padding_mask=pad), encoder(x, src_key_padding_mask=pad)
    assert nested == [True] and encoder.layers[0].self_attn.calls == 1
    assert (got - expected).abs().max() <= TOL  # both zero at the padding


# -- backends, shapes, bookkeeping ------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backends_agree_and_say_which_ran(layout, device):
    _, ours = _pair(device=device, **LAYOUTS[layout])
    q, k, v = _inputs(ours)
    pad = torch.zeros(B, S, dtype=torch.bool, device=device)
    pad[0, -3:] = True
    ours.backend = "sdpa"
    fused, none = ours(q, k, v, key_padding_mask=pad, need_weights=False)
    assert none is None and ours.last_backend == "sdpa"
    ours.backend = "auto"
    with_weights, _ = ours(q, k, v, key_padding_mask=pad)
    assert ours.last_backend == "math"
    assert (fused - with_weights).abs().max() <= TOL


def test_output_and_weight_shapes_in_every_layout():
    for batch_first in (False, True):
        m = MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True, kdim=7, vdim=5, batch_first=batch_first)
        q, k, v = _inputs(m)
        out, w = m(q, k, v)
        assert out.shape == q.shape and out.is_contiguous()  # torch's seq-first output is contiguous too
        assert w.shape == (B, T, S + 2)  # S + bias_k row + zero row
        assert m(q, k, v, average_attn_weights=False)[1].shape == (B, H, T, S + 2)
        out1, w1 = m(q[:, 0] if not batch_first else q[0], torch.randn(S, 7), torch.randn(S, 5))
        assert out1.shape == (T, E) and w1.shape == (T, S + 2)


def test_average_weights_are_the_mean_of_the_per_head_weights(device):
    _, ours = _pair(device=device)
    q, k, v = _inputs(ours)
    mean = ours(q, k, v)[1]
    per_head = ours(q, k, v, average_attn_weights=False)[1]
    assert torch.allclose(mean, per_head.mean(dim=1), atol=1e-7)
    assert torch.allclose(per_head.sum(-1), torch.ones(B, H, T, device=device))


def test_self_attention_is_the_same_function_as_cross_attention_on_copies(device):
    _, ours = _pair(device=device)
    x = torch.randn(T, B, E).to(device)
    same, _ = ours(x, x, x)  # one GEMM for Q, K and V
    copies, _ = ours(x, x.clone(), x.clone())  # three GEMMs
    assert (same - copies).abs().max() <= TOL


# -- errors: one sentence, argument, received, expected, fix ---------------------------------------

ERRORS = {
    "query width": (lambda m: m(torch.randn(T, B, 5), torch.randn(S, B, E), torch.randn(S, B, E)),
                    ValueError, r"query has last dimension 5 \(shape \(5, 2, 5\)\); expected embed_dim=12 in \(T, B, embed_dim\): project it to 12 features or build the module with embed_dim=5\."),
    "key batch": (lambda m: m(torch.randn(T, B, E), torch.randn(S, 3, E), torch.randn(S, 3, E)),
                  ValueError, r"key has batch size 3 but query has 2 \(dim 1 of \(S, B, kdim\), as batch_first=False\); pass one key sequence per query sequence\."),
    "value length": (lambda m: m(torch.randn(T, B, E), torch.randn(S, B, E), torch.randn(S + 1, B, E)),
                     ValueError, r"value has shape \(7, 2, 12\) but key has \(6, 2, 12\); every key needs exactly one value"),
    "query rank": (lambda m: m(torch.randn(1, T, B, E), torch.randn(S, B, E), torch.randn(S, B, E)),
                   ValueError, r"query has 4 dimensions \(shape \(1, 5, 2, 12\)\); expected \(T, B, E\) batched or \(T, E\) unbatched"),
    "key rank": (lambda m: m(torch.randn(T, B, E), torch.randn(S, E), torch.randn(S, E)),
                 ValueError, r"key has 2 dimensions \(shape \(6, 12\)\) but query has 3; key must be batched like query: expected \(S, B, kdim\)\."),
    "int query": (lambda m: m(torch.ones(T, B, E, dtype=torch.long), torch.randn(S, B, E), torch.randn(S, B, E)),
                  TypeError, r"query has dtype torch.int64; expected a floating tensor .* go through an nn.Embedding first\."),
    "dtype mismatch": (lambda m: m(*(torch.randn(T, B, E, dtype=torch.float64),) * 3),
                       TypeError, r"query has dtype torch.float64 but the module's weights are torch.float32; cast one of them"),
    "padding shape": (lambda m: m(*(torch.randn(T, B, E),) * 3, key_padding_mask=torch.zeros(B, T + 1, dtype=torch.bool)),
                      ValueError, r"key_padding_mask has shape \(2, 6\); expected \(B, S\) = \(2, 5\), one flag per key position"),
    "padding dtype": (lambda m: m(*(torch.randn(T, B, E),) * 3, key_padding_mask=torch.zeros(B, T, dtype=torch.long)),
                      TypeError, r"key_padding_mask has dtype torch.int64; expected torch.bool \(True = padding, torch's polarity\) or a float dtype .*: pass key_padding_mask.bool\(\)"),
    "mask shape": (lambda m: m(*(torch.randn(T, B, E),) * 3, attn_mask=torch.zeros(T, T + 1, dtype=torch.bool)),
                   ValueError, r"attn_mask has shape \(5, 6\); expected \(T, S\) = \(5, 5\) or \(B\*num_heads, T, S\) = \(8, 5, 5\)"),
    "mask 3-D per batch": (lambda m: m(*(torch.randn(T, B, E),) * 3, attn_mask=torch.zeros(B, T, T, dtype=torch.bool)),
                           ValueError, r"attn_mask has shape \(2, 5, 5\); expected .* row b\*num_heads \+ h of a 3-D mask being batch b, head h"),
    "mask 4-D": (lambda m: m(*(torch.randn(T, B, E),) * 3, attn_mask=torch.zeros(B, H, T, T, dtype=torch.bool)),
                 ValueError, r"attn_mask has 4 dimensions .* \(a \(B, num_heads, T, S\) mask: pass attn_mask.flatten\(0, 1\)\)\."),
    "mask dtype": (lambda m: m(*(torch.randn(T, B, E),) * 3, attn_mask=torch.zeros(T, T, dtype=torch.uint8)),
                   TypeError, r"attn_mask has dtype torch.uint8; expected torch.bool \(True = blocked, torch's polarity\)"),
    "mask type": (lambda m: m(*(torch.randn(T, B, E),) * 3, attn_mask=[[True]]),
                  TypeError, r"attn_mask must be a torch.Tensor .* got list; wrap it with torch.as_tensor"),
    "causal hint alone": (lambda m: m(*(torch.randn(T, B, E),) * 3, is_causal=True),
                          ValueError, r"is_causal=True was given without attn_mask; .* pass attn_mask=nn.Transformer.generate_square_subsequent_mask\(T\)"),
    "sdpa with weights": (lambda m: (setattr(m, "backend", "sdpa"), m(*(torch.randn(T, B, E),) * 3)),
                          ValueError, r"need_weights=True \(nn.MultiheadAttention's default\) with backend='sdpa'.*pass need_weights=False"),
}  # fmt: skip


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_the_argument_what_came_what_was_expected_and_the_fix(case):
    call, exc, message = ERRORS[case]
    with pytest.raises(exc, match=message) as err:
        call(MultiheadAttention(E, H))
    text = str(err.value)
    assert text.count(". ") == 0 and text.endswith((".", ")")), "one sentence"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_heads": 5}, r"embed_dim=12 is not divisible by num_heads=5"),
        ({"num_kv_heads": 3}, r"num_heads=4 is not divisible by num_kv_heads=3"),
        ({"backend": "flash"}, r"backend must be one of \('auto', 'math', 'sdpa', 'flex'\), got 'flash'"),
    ],
)
def test_constructor_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiheadAttention(**{"embed_dim": E, "num_heads": H, **kwargs})
