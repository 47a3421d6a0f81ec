"""attnlab.compat.MultiheadAttention on NestedTensor inputs: what nn.TransformerEncoder sends a
``self_attn`` swapped in after it was built (strided, eval, no_grad, no masks), what
nn.MultiheadAttention takes on its fast path (strided self-attention), and what ours takes beyond
it (jagged, cross-attention, seq-first modules, training with autograd), each compared with torch
holding the same weights; and the refusals that remain, message by message.

Letters: B batch, T_b / S_b the query / key length of sequence b, E embed_dim, H heads.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

from attnlab.compat import MultiheadAttention

pytestmark = [
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True, but self.use_nested_tensor is False"),
]

E, H = 8, 2
Q_LENS, K_LENS = (5, 2, 4, 1), (3, 6, 1, 2)  # the first query is full length (T = 5)
TOL32, TOL64 = 1e-6, 1e-12
LAYOUTS = {"strided": torch.strided, "jagged": torch.jagged}


def _pair(*, dtype=torch.float32, seed=0, **kw) -> tuple[nn.MultiheadAttention, MultiheadAttention]:
    """torch's module with every parameter non-trivial (biases included), and ours with its state dict."""
    ref = nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=dtype))
    ours = MultiheadAttention(E, H, dtype=dtype, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _seqs(lengths, width, dtype=torch.float32, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, width, generator=g, dtype=dtype) for n in lengths]


def _nested(seqs, layout, device="cpu", requires_grad=False) -> torch.Tensor:
    return torch.nested.nested_tensor([s.to(device) for s in seqs], layout=layout, requires_grad=requires_grad)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.is_nested:
        a, b = torch.cat(a.unbind()), torch.cat(b.unbind())
    return (a - b).abs().max().item()


# -- inside nn.TransformerEncoder -------------------------------------------------------------------


def _encoder_pair(batch_first: bool, norm_first: bool, device) -> tuple[nn.TransformerEncoder, nn.TransformerEncoder]:
    """torch's encoder, and a deep copy with every layer's self_attn swapped for ours (the recipe in docs/howto/swap.md)."""
    layer = nn.TransformerEncoderLayer(
        E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first, norm_first=norm_first
    )
    ref = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True).eval()
    ours = copy.deepcopy(ref)
    for mod in ours.layers:
        attn = MultiheadAttention(E, H, batch_first=batch_first)
        attn.load_state_dict(mod.self_attn.state_dict())
        mod.self_attn = attn
    return ref.to(device), ours.to(device)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_an_encoder_swapped_after_it_was_built_matches_torch(batch_first, norm_first, device):
    ref, ours = _encoder_pair(batch_first, norm_first, device)
    seen = []  # what each self_attn call received
    for mod in ours.layers:
        mod.self_attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_nested))
    lengths = torch.tensor(Q_LENS)
    pad = torch.arange(max(Q_LENS))[None] >= lengths[:, None]  # (B, T), True = padding
    x = torch.randn(len(Q_LENS), max(Q_LENS), E)
    x, pad = (x if batch_first else x.transpose(0, 1)).to(device), pad.to(device)
    with torch.no_grad():
        expected, got = ref(x, src_key_padding_mask=pad), ours(x, src_key_padding_mask=pad)
    # torch decides at construction: nested tensors only for a batch-first, post-norm encoder
    nested = batch_first and not norm_first
    assert ours.use_nested_tensor == nested and seen == [nested, nested]
    keep = ~pad if batch_first else ~pad.T
    assert (got[keep] - expected[keep]).abs().max() <= TOL32
    if nested:  # the encoder pads its nested output with zeros: ours came back nested, as it must
        assert torch.equal(got[~keep], torch.zeros_like(got[~keep]))


def test_a_nested_encoder_in_training_takes_the_padded_path_for_both(device):
    ref, ours = _encoder_pair(True, False, device)
    seen = []
    ours.layers[0].self_attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_nested))
    x = torch.randn(2, 4, E).to(device)
    pad = torch.tensor([[False] * 4, [False, False, True, True]]).to(device)
    expected, got = ref.train()(x, src_key_padding_mask=pad), ours.train()(x, src_key_padding_mask=pad)
    assert seen == [False]  # torch's encoder nests only in eval mode without grad
    assert (got[~pad] - expected[~pad]).abs().max() <= TOL32


# -- module-level parity: torch's fast path -----------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_self_attention_on_nested_input_matches_torchs_fast_path(layout, batch_first, need_weights, average, device):
    ref, ours = _pair(batch_first=True)  # torch's fast path needs batch_first
    ours.batch_first = batch_first  # a nested tensor is (B, T_b, E) either way
    ref, ours = ref.to(device).eval(), ours.to(device).eval()
    seqs = _seqs(Q_LENS, E)
    x = _nested(seqs, LAYOUTS[layout], device)
    with torch.no_grad():
        # torch takes strided self-attention only (a jagged tensor "has_torch_function"): its answer on
        # the same sequences, strided, is the reference for both layouts
        strided = _nested(seqs, torch.strided, device)
        expected, expected_w = ref(strided, strided, strided, need_weights=need_weights, average_attn_weights=average)
        got, got_w = ours(x, x, x, need_weights=need_weights, average_attn_weights=average)
    assert got.is_nested and got.layout == x.layout
    assert [t.shape for t in got.unbind()] == [t.shape for t in x.unbind()]
    assert _max_err(got, expected) <= TOL32
    if not need_weights:
        assert got_w is None and expected_w is None
    else:  # torch's fast path returns padded weights, zero on padded rows and columns
        assert not got_w.is_nested and got_w.shape == expected_w.shape
        assert (got_w - expected_w).abs().max() <= TOL32


def test_the_output_is_nested_like_the_query():
    _, ours = _pair(batch_first=True)
    jagged = _nested(_seqs(Q_LENS, E), torch.jagged)
    out, _ = ours(jagged, jagged, jagged, need_weights=False)
    assert (jagged + out).shape == jagged.shape  # shares the query's offsets: a residual works
    assert out.to_padded_tensor(0.0).shape == (len(Q_LENS), max(Q_LENS), E)  # not padded to the total length
    strided = _nested(_seqs(Q_LENS, E), torch.strided)
    out, _ = ours(strided, strided, strided, need_weights=False)
    assert out.layout == torch.strided and (strided + out).is_nested


# -- beyond torch's fast path: per sequence, against torch's module on each sequence alone ------------

CONFIGS = {
    "packed": {},
    "everything": {"add_bias_kv": True, "add_zero_attn": True, "kdim": 6, "vdim": 5},
}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cross_attention_in_training_matches_torch_sequence_by_sequence(
    layout, batch_first, config, device_with_float64
):
    """Nested input where torch refuses it (training, grad, cross-attention, seq-first, bias_kv...):
    each sequence's output, weights and every gradient equal torch's module run on that sequence alone."""
    device = device_with_float64
    ref, ours = _pair(dtype=torch.float64, batch_first=batch_first, **CONFIGS[config])
    ref, ours = ref.to(device).train(), ours.to(device).train()
    qs = _seqs(Q_LENS, E, torch.float64, seed=1)
    ks, vs = _seqs(K_LENS, ours.kdim, torch.float64, seed=2), _seqs(K_LENS, ours.vdim, torch.float64, seed=3)
    q, k, v = (_nested(s, LAYOUTS[layout], device, requires_grad=True) for s in (qs, ks, vs))
    out, weights = ours(q, k, v, average_attn_weights=False)  # weights (B, H, T, S + extra), padded
    S = max(K_LENS)
    extra = int(ours.bias_k is not None) + int(ours.add_zero_attn)
    assert out.layout == q.layout and weights.shape == (len(Q_LENS), H, max(Q_LENS), S + extra)
    torch.cat(out.unbind()).pow(2).sum().backward()

    leaves = [t.to(device).requires_grad_() for t in (*qs, *ks, *vs)]
    n = len(Q_LENS)
    for b, (t, s) in enumerate(zip(Q_LENS, K_LENS, strict=True)):  # unbatched (T_b, E): batch_first plays no part
        o, w = ref(leaves[b], leaves[n + b], leaves[2 * n + b], average_attn_weights=False)  # w (H, T_b, s + extra)
        assert (out.unbind()[b] - o).abs().max() <= TOL64
        mine = weights[b, :, :t]  # (H, T_b, S + extra)
        assert (torch.cat([mine[..., :s], mine[..., S:]], dim=-1) - w).abs().max() <= TOL64
        assert not mine[..., s:S].any() and not weights[b, :, t:].any()  # zero on the padding
        o.pow(2).sum().backward()
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad - p_ref.grad).abs().max() <= TOL64, name
    for nested, first in ((q, 0), (k, n), (v, 2 * n)):  # gradients reach the nested inputs
        for b, g in enumerate(nested.grad.unbind()):
            assert (g - leaves[first + b].grad).abs().max() <= TOL64


def test_a_sequence_without_keys_gets_out_proj_bias_as_its_output(device):
    """The one deliberate difference from torch holds for nested input too: zeros, not NaN."""
    _, ours = _pair(batch_first=True)
    ours = ours.to(device)
    q = _nested(_seqs((2, 3), E), torch.jagged, device)
    kv = _nested([torch.randn(0, E), torch.randn(4, E)], torch.jagged, device)
    out, weights = ours(q, kv, kv)
    assert torch.equal(out.unbind()[0], ours.out_proj.bias.expand(2, E))
    assert torch.equal(weights[0], torch.zeros_like(weights[0]))
    assert torch.isfinite(out.unbind()[1]).all()


# -- what is still refused --------------------------------------------------------------------------


def test_is_causal_is_refused_where_torchs_fast_path_ignores_it():
    ref, ours = _encoder_pair(True, False, "cpu")
    x = torch.randn(2, 4, E)
    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    with torch.no_grad():  # torch's nested encoder attends to every key, causal hint or not
        assert torch.equal(ref(x, src_key_padding_mask=pad, is_causal=True), ref(x, src_key_padding_mask=pad))
        with pytest.raises(ValueError, match=r"^is_causal=True was given with NestedTensor inputs"):
            ours(x, src_key_padding_mask=pad, is_causal=True)
        causal = torch.ones(4, 4, dtype=torch.bool).triu(1)  # True = blocked, a bool like the padding mask
        expected = ref(x, mask=causal, src_key_padding_mask=pad, is_causal=True)  # the fix: no nesting then
        got = ours(x, mask=causal, src_key_padding_mask=pad, is_causal=True)
    assert (got[~pad] - expected[~pad]).abs().max() <= TOL32


def test_a_seq_first_module_says_how_to_pad_into_its_layout():
    _, ours = _pair(batch_first=False)
    x = _nested(_seqs((2, 3), E), torch.strided)
    with pytest.raises(ValueError, match=re.escape("(key.to_padded_tensor(0.0).transpose(0, 1)) with it.")):
        ours(x, x, x, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))


def _refusals():
    x = _nested(_seqs((2, 3), E), torch.strided)
    other = _nested(_seqs((4, 1), E), torch.strided)
    padded = torch.randn(2, 3, E)
    holes = torch.nested.narrow(torch.randn(2, 4, E), 1, 0, torch.tensor([2, 3]), layout=torch.jagged)
    return {
        "key padded, query nested": (
            (x, padded, padded),
            {},
            TypeError,
            "query is a NestedTensor but key is a padded tensor of shape (2, 3, 8); pass query, key and value all "
            "nested (one sequence per batch entry), or all padded: query.to_padded_tensor(0.0) with a "
            "key_padding_mask.",
        ),
        "key nested, query padded": (
            (padded, x, x),
            {},
            TypeError,
            "key is a NestedTensor but query is not; pass query, key and value all nested (one sequence per batch "
            "entry), or all padded: key.to_padded_tensor(0.0) with a key_padding_mask.",
        ),
        "key_padding_mask with nested input": (
            (x, x, x),
            {"key_padding_mask": torch.zeros(2, 3, dtype=torch.bool)},
            ValueError,
            "key_padding_mask was given with NestedTensor inputs, whose lengths already say which keys exist "
            "(nn.MultiheadAttention refuses the pair too); drop it, or pass padded tensors "
            "(key.to_padded_tensor(0.0)) with it.",
        ),
        "attn_mask with nested input": (
            (x, x, x),
            {"attn_mask": torch.zeros(3, 3, dtype=torch.bool)},
            ValueError,
            "attn_mask was given with NestedTensor inputs, which take no attn_mask (nn.MultiheadAttention refuses "
            "the pair too); pass padded tensors (query.to_padded_tensor(0.0)) with a key_padding_mask and the "
            "attn_mask instead.",
        ),
        "is_causal with nested input": (
            (x, x, x),
            {"is_causal": True},
            ValueError,
            "is_causal=True was given with NestedTensor inputs, which take no attn_mask for it to describe (torch's "
            "fast path ignores the hint and attends to every key); pass padded tensors (query.to_padded_tensor(0.0)) "
            "with attn_mask=nn.Transformer.generate_square_subsequent_mask(T) and a key_padding_mask "
            "(nn.TransformerEncoder does so when given mask= too), or drop is_causal.",
        ),
        "value lengths differ from key lengths": (
            (x, x, other),
            {},
            ValueError,
            "value has sequence lengths [4, 1] but key has [2, 3]; every key needs exactly one value: pass value "
            "sequences of the key sequences' lengths.",
        ),
        "fewer key sequences": (
            (x, _nested(_seqs((2,), E), torch.strided), _nested(_seqs((2,), E), torch.strided)),
            {},
            ValueError,
            "key holds 1 sequences but query holds 2; pass one key sequence per query sequence.",
        ),
        "a jagged query with holes": (
            (holes, holes, holes),
            {},
            ValueError,
            "query is a jagged NestedTensor with holes (offsets and lengths, as torch.nested.narrow makes), which "
            "cannot be padded; pass query.contiguous().",
        ),
        "a jagged query ragged in its last dim": (
            (_nested(_seqs((2, 3), E), torch.jagged).transpose(1, 2), x, x),
            {},
            ValueError,
            "query is a jagged NestedTensor ragged in dim 2; expected (B, T_b, embed_dim=8), ragged in dim 1 (the "
            "sequence length): undo the transpose that moved it.",
        ),
        "nested sequences of 1-D vectors": (
            (_nested([torch.randn(2), torch.randn(3)], torch.strided),) * 3,
            {},
            ValueError,
            "query is a NestedTensor of 2 dimensions; expected (B, T_b, embed_dim=8), B sequences of shape "
            "(T_b, embed_dim) (nested tensors are batch-first whatever batch_first says).",
        ),
        "a jagged key of the wrong width": (
            (x, _nested(_seqs((2, 3), 7), torch.jagged), x),
            {},
            ValueError,
            "key is a NestedTensor whose sequences have width 7; expected kdim=8 for every sequence, (B, S_b, kdim=8): "
            "project it to 8 features or build the module with kdim=7.",
        ),
        "token ids": (
            (_nested([torch.ones(2, E, dtype=torch.long)], torch.jagged),) * 3,
            {},
            TypeError,
            "query has dtype torch.int64; expected a floating NestedTensor (B, T_b, embed_dim=8) like the module's "
            "weights (torch.float32); token ids go through an nn.Embedding first.",
        ),
        "sequences of different widths": (
            (_nested([torch.randn(2, E), torch.randn(3, E + 1)], torch.strided),) * 3,
            {},
            ValueError,
            "query is a NestedTensor whose sequences have width 8 and 9; expected embed_dim=8 for every sequence, "
            "(B, T_b, embed_dim=8).",
        ),
    }


with warnings.catch_warnings():  # building the cases makes strided nested tensors, which warn
    warnings.simplefilter("ignore", UserWarning)
    REFUSALS = list(_refusals())


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_say_what_was_wrong_and_the_fix(case):
    args, kw, error, message = _refusals()[case]
    _, ours = _pair(batch_first=True)
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        ours(*args, **kw)
