"""torch.jit.script of attnlab.compat.MultiheadAttention (issue 23): it scripts wherever
torch.nn.MultiheadAttention does (alone, inside torch's transformer layers, a torchvision ViT, an
open_clip CLIP), computes what the eager module computes, and says at script time what it does not do.

Letters: B batch, T query positions, S key positions, E embed_dim, H heads, G K/V heads.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from attnlab.compat import MultiheadAttention
from attnlab.compat.scripted import SCRIPT_WARNING, ScriptableMultiheadAttention

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning"),  # torch 2.13 says so
    pytest.mark.filterwarnings("ignore:`torch.jit.save` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
]

E, H, B, T, S = 8, 2, 2, 4, 5
TOL = 1e-6  # attnlab against torch's module: the same math, in other kernels

EXPECTED_WARNING = (
    "torch.jit.script compiles attnlab.compat.MultiheadAttention as attnlab.compat.scripted."
    "ScriptableMultiheadAttention, which shares its parameters and computes the same outputs, except that the "
    "scripted module takes nested tensors in the strided layout only (not jagged), checks a backend assigned "
    "to it at its next call rather than at assignment, and raises input errors as torch.jit.Error carrying the "
    "eager message; it records its own last_backend. In the eager parent module, torch leaves the twin in "
    "place of the original (the __prepare_scriptable__ protocol); called eagerly, the twin runs the original."
)

# Module layouts: torch's own (compared with torch's module, eager and scripted) and GQA (attnlab's only).
CONFIGS = {
    "seq_first_no_bias": {"bias": False},  # torch's own module with bias=False does not script (torch 2.13)
    "batch_first": {"batch_first": True},
    "batch_first_extras": {"batch_first": True, "kdim": 6, "vdim": 3, "add_bias_kv": True, "add_zero_attn": True},
    "gqa_kdim_no_bias": {"num_kv_heads": 1, "kdim": 6, "bias": False, "batch_first": True},
    "gqa_bias_kv": {"num_heads": 4, "num_kv_heads": 2, "add_bias_kv": True},
}


def _script(m: nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SCRIPT_WARNING, tested on its own
        return torch.jit.script(m)


class _Family:
    """One config's four modules on the same weights: compat eager and scripted, torch eager and scripted."""

    def __init__(self, name: str) -> None:
        kw = dict(CONFIGS[name])
        heads = kw.pop("num_heads", H)
        torch.manual_seed(0)
        self.ours = MultiheadAttention(E, heads, **kw)
        with torch.no_grad():
            for p in self.ours.parameters():  # torch zeroes the biases: make them matter
                p.add_(0.3 * torch.randn(p.shape))
        self.scripted = _script(self.ours)
        self.torch: nn.MultiheadAttention | None = None
        self.torch_scripted: torch.jit.ScriptModule | None = None
        if "num_kv_heads" not in kw:
            self.torch = nn.MultiheadAttention(E, heads, **kw)
            self.torch.load_state_dict(self.ours.state_dict())
            if kw.get("bias", True):  # torch's own module with bias=False does not script: ours does
                self.torch_scripted = torch.jit.script(self.torch)
        self.heads = heads

    def inputs(self, batched: bool = True, self_attention: bool = False) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(1)
        m = self.ours

        def seq(length: int, width: int) -> torch.Tensor:
            if not batched:
                return torch.randn(length, width, generator=g)  # (T, E)
            shape = (B, length, width) if m.batch_first else (length, B, width)
            return torch.randn(shape, generator=g)  # (B, T, E) or (T, B, E)

        q = seq(T, E)
        if self_attention and m.kdim == E and m.vdim == E:
            return q, q, q
        return q, seq(S, m.kdim), seq(S, m.vdim)


_FAMILIES: dict[str, _Family] = {}


def family(name: str) -> _Family:
    """Built and scripted once per config for the whole file (scripting is the slow part)."""
    if name not in _FAMILIES:
        _FAMILIES[name] = _Family(name)
    return _FAMILIES[name]


def _masks(case: str, heads: int, batched: bool) -> dict:
    """forward() keyword arguments for a mask case, in torch's conventions (bool True = blocked)."""
    g = torch.Generator().manual_seed(2)
    rows = (B * heads if batched else heads, T, S)
    kw: dict = {}
    if case in ("bool_2d", "bool_3d_and_padding"):
        blocked = torch.rand(rows if case == "bool_3d_and_padding" else (T, S), generator=g) > 0.6
        blocked[..., 0] = False  # every query keeps a key: fully masked rows have their own test
        kw["attn_mask"] = blocked
    if case in ("float_2d", "float_3d", "float_and_float_padding"):
        bias = torch.randn(rows if case == "float_3d" else (T, S), generator=g)
        bias[..., 2] = float("-inf")
        kw["attn_mask"] = bias
    if case in ("padding", "bool_3d_and_padding", "float_padding", "float_and_float_padding", "causal_and_padding"):
        pad = torch.zeros(B if batched else 1, S, dtype=torch.bool)
        pad[-1, -2:] = True  # the last sequence is 2 keys shorter
        if case in ("float_padding", "float_and_float_padding"):
            kw["key_padding_mask"] = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))
        else:
            kw["key_padding_mask"] = pad
        if not batched:
            kw["key_padding_mask"] = kw["key_padding_mask"][0]  # (S,)
    if case in ("causal", "causal_and_padding"):
        kw["attn_mask"] = torch.ones(T, S, dtype=torch.bool).triu(1)  # torch's causal mask, True = blocked
        kw["is_causal"] = True
    return kw


MASK_CASES = [  # bool 2-D masks come with the causal cases, float 2-D with float padding
    "none",
    "float_3d",
    "padding",
    "bool_3d_and_padding",
    "float_and_float_padding",
    "causal",
    "causal_and_padding",
]


UNBATCHED_CASES = ("none", "float_3d", "causal_and_padding")  # (H, T, S) masks, (S,) padding


def _assert_same(got: tuple, want: tuple, exact: bool) -> None:
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
        elif exact:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


# -- the family: scripted == eager compat, and == torch's module (eager and scripted) --------------------


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", MASK_CASES)
def test_scripted_equals_eager_and_torch(config, case):
    fam = family(config)
    for batched in (True, False) if case in UNBATCHED_CASES else (True,):
        q, k, v = fam.inputs(batched)
        kw = _masks(case, fam.heads, batched)  # over the caller's S keys
        for need_weights, average in ((True, True), (True, False), (False, True)):
            call = dict(kw, need_weights=need_weights, average_attn_weights=average)
            want = fam.ours(q, k, v, **call)
            got = fam.scripted(q, k, v, **call)
            _assert_same(got, want, exact=True)  # the same ops in the same order
            assert fam.scripted.last_backend == fam.ours.last_backend == ("math" if need_weights else "sdpa")
            if fam.torch is not None:
                _assert_same(got, fam.torch(q, k, v, **call), exact=False)
            if fam.torch_scripted is not None:
                _assert_same(got, fam.torch_scripted(q, k, v, **call), exact=False)


@pytest.mark.parametrize("config", ["seq_first_no_bias", "batch_first"])
def test_self_attention_takes_the_same_fused_projection(config):
    fam = family(config)
    q, k, _ = fam.inputs(self_attention=True)  # q is k is v
    causal = {"attn_mask": torch.ones(T, T, dtype=torch.bool).triu(1), "is_causal": True}  # square: SDPA's is_causal
    for need_weights in (True, False):
        for kw in ({}, causal):
            got = fam.scripted(q, q, q, need_weights=need_weights, **kw)
            _assert_same(got, fam.ours(q, q, q, need_weights=need_weights, **kw), True)
            if fam.torch is not None:
                _assert_same(got, fam.torch(q, q, q, need_weights=need_weights, **kw), False)
        kv = fam.scripted(q, k, k, need_weights=need_weights)  # key is value: K and V in one GEMM
        _assert_same(kv, fam.ours(q, k, k, need_weights=need_weights), True)


@pytest.mark.parametrize("config", ["seq_first_no_bias", "gqa_bias_kv"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_fully_masked_rows_are_zeros_with_finite_gradients(config, need_weights):
    fam = family(config)
    m, sm = fam.ours, fam.scripted
    q, k, v = (x.clone().requires_grad_() for x in fam.inputs())
    blocked = torch.zeros(T, S, dtype=torch.bool)
    blocked[1] = True  # query 1 sees no key of the caller's (bias_k's row is still there in gqa_bias_kv)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0] = True  # every key of sequence 0 is padding
    out, w = sm(q, k, v, attn_mask=blocked, key_padding_mask=pad, need_weights=need_weights)
    want, _ = m(q, k, v, attn_mask=blocked, key_padding_mask=pad, need_weights=need_weights)
    assert torch.equal(out, want)
    if m.bias_k is None:  # no appended key row: these queries attend to nothing
        bias = torch.zeros(E) if m.out_proj.bias is None else m.out_proj.bias.detach()
        q_first = out.transpose(0, 1)  # (B, T, E)
        assert torch.equal(q_first[0], bias.expand(T, E))  # all of sequence 0
        assert torch.equal(q_first[1, 1], bias)  # query 1 of sequence 1
        if need_weights:
            assert w is not None and w[0].abs().sum() == 0 and w[1, 1].abs().sum() == 0
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("config", ["batch_first", "batch_first_extras", "gqa_kdim_no_bias"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_gradients_through_the_scripted_module_equal_eager(config, need_weights):
    fam = family(config)
    m, sm = fam.ours, fam.scripted
    q, k, v = fam.inputs()
    kw = _masks("float_and_float_padding", fam.heads, True)

    def grads(mod: nn.Module) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)  # the scripted module's parameters are the eager one's
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out, w = mod(*xs, need_weights=need_weights, **kw)
        loss = out.square().sum() + (0 if w is None else w.square().sum())
        loss.backward()
        return [x.grad for x in xs] + [p.grad.clone() for p in m.parameters()]

    want, got = grads(m), grads(sm)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_in_training_draws_the_same_masks(need_weights):
    torch.manual_seed(0)
    m = MultiheadAttention(E, H, dropout=0.5).train()
    sm = _script(m)
    q, k, v = family("seq_first_no_bias").inputs()
    torch.manual_seed(3)
    want = m(q, k, v, need_weights=need_weights)
    torch.manual_seed(3)
    got = sm(q, k, v, need_weights=need_weights)
    _assert_same(got, want, exact=True)
    assert not torch.equal(got[0], sm.eval()(q, k, v, need_weights=need_weights)[0])  # dropout did act


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_low_and_double_precision_equal_eager(dtype):
    """bf16 SDPA on a CPU computes in float32 (attnlab's policy), the math path accumulates in float32 at least."""
    torch.manual_seed(0)
    m = MultiheadAttention(E, H, num_kv_heads=1, batch_first=True, dtype=dtype)
    sm = _script(m)
    q, kv = torch.randn(B, T, E, dtype=dtype), torch.randn(B, S, E, dtype=dtype)
    kw = {n: t.to(dtype) for n, t in _masks("float_and_float_padding", H, True).items()}
    for need_weights in (True, False):
        got = sm(q, kv, kv, need_weights=need_weights, **kw)
        assert got[0].dtype == dtype
        _assert_same(got, m(q, kv, kv, need_weights=need_weights, **kw), True)


# -- one module: shared parameters, backends, save/load, errors, the warning ----------------------------


def test_the_warning_at_script_time_says_what_the_scripted_module_does_not_do():
    assert SCRIPT_WARNING == EXPECTED_WARNING
    with pytest.warns(UserWarning) as record:
        torch.jit.script(MultiheadAttention(E, H))
    assert [str(r.message) for r in record if r.category is UserWarning] == [EXPECTED_WARNING]


def test_the_scripted_module_shares_the_eager_parameters():
    fam = family("batch_first_extras")
    sm, m = fam.scripted, fam.ours
    assert dict(sm.named_parameters()).keys() == dict(m.named_parameters()).keys()
    for (_, a), (_, b) in zip(sm.named_parameters(), m.named_parameters(), strict=True):
        assert a.data_ptr() == b.data_ptr()
    q, k, v = fam.inputs()
    before = sm(q, k, v)[0]
    saved = m.out_proj.bias.detach().clone()
    with torch.no_grad():
        m.out_proj.bias.add_(1.0)  # an optimizer step on the eager module reaches the scripted one
    try:
        assert torch.allclose(sm(q, k, v)[0], before + 1.0, atol=1e-6)
        assert torch.equal(sm(q, k, v)[0], m(q, k, v)[0])
    finally:
        with torch.no_grad():
            m.out_proj.bias.copy_(saved)


def test_backend_switching_and_last_backend_on_the_scripted_module():
    torch.manual_seed(0)
    m = MultiheadAttention(E, H, backend="math")
    sm = _script(m)
    q, k, v = family("seq_first_no_bias").inputs()
    sm(q, k, v, need_weights=False)
    assert sm.last_backend == "math"  # the backend the module had when scripted
    sm.backend = "sdpa"
    assert sm(q, k, v, need_weights=False)[1] is None and sm.last_backend == "sdpa"
    with pytest.raises(
        torch.jit.Error, match="need_weights=True \\(nn.MultiheadAttention's default\\) with backend='sdpa'"
    ):
        sm(q, k, v)
    sm.backend = "fast"
    with pytest.raises(
        torch.jit.Error,
        match="backend must be one of \\('auto', 'math', 'sdpa', 'flex'\\), got 'fast'; set scripted.backend to one of them.",
    ):
        sm(q, k, v)


def test_save_and_load_the_scripted_module(tmp_path):
    fam = family("gqa_bias_kv")
    path = tmp_path / "mha.pt"
    torch.jit.save(fam.scripted, str(path))
    loaded = torch.jit.load(str(path))
    q, k, v = fam.inputs()
    kw = _masks("bool_3d_and_padding", fam.heads, True)
    for need_weights in (True, False):
        _assert_same(
            loaded(q, k, v, need_weights=need_weights, **kw), fam.ours(q, k, v, need_weights=need_weights, **kw), True
        )
    assert loaded.last_backend == "sdpa" and loaded.batch_first is False and loaded.num_kv_heads == 2
    sd = fam.ours.state_dict()
    assert {n: t for n, t in loaded.state_dict().items()}.keys() == sd.keys()
    assert all(torch.equal(loaded.state_dict()[n], sd[n]) for n in sd)


def _errors() -> list[tuple]:
    q, k, v = torch.randn(T, B, E), torch.randn(S, B, E), torch.randn(S, B, E)
    return [
        ("query width", (torch.randn(T, B, E + 1), k, v), {}),
        ("4-D query", (torch.randn(1, T, B, E), k, v), {}),
        ("unbatched key", (q, torch.randn(S, E), v), {}),
        ("batch sizes", (q, torch.randn(S, B + 1, E), torch.randn(S, B + 1, E)), {}),
        ("value length", (q, k, torch.randn(S + 1, B, E)), {}),
        ("int query", (q.long(), k, v), {}),
        ("dtype", (q.double(), k, v), {}),
        ("padding shape", (q, k, v), {"key_padding_mask": torch.zeros(B, S + 1, dtype=torch.bool)}),
        ("int padding", (q, k, v), {"key_padding_mask": torch.zeros(B, S, dtype=torch.long)}),
        ("causal without mask", (q, k, v), {"is_causal": True}),
        ("mask shape", (q, k, v), {"attn_mask": torch.zeros(T, S + 1, dtype=torch.bool)}),
        ("4-D mask", (q, k, v), {"attn_mask": torch.zeros(B, H, T, S, dtype=torch.bool)}),
        ("3-D mask rows", (q, k, v), {"attn_mask": torch.zeros(B, T, S, dtype=torch.bool)}),
    ]


@pytest.mark.parametrize("case", _errors(), ids=lambda c: c[0] if isinstance(c, tuple) else None)
def test_scripted_errors_carry_the_eager_message(case):
    _, args, kw = case
    fam = family("seq_first_no_bias")
    with pytest.raises((ValueError, TypeError)) as eager:
        fam.ours(*args, **kw)
    with pytest.raises(torch.jit.Error) as scripted:
        fam.scripted(*args, **kw)
    last_line = str(scripted.value).strip().splitlines()[-1]
    assert last_line == f"builtins.{type(eager.value).__name__}: {eager.value}"


@pytest.mark.parametrize("config", ["batch_first", "seq_first_no_bias"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_a_strided_nested_tensor_equals_the_padded_call(config, need_weights):
    fam = family(config)
    lengths = [3, 2]
    seqs = [torch.randn(n, E, generator=torch.Generator().manual_seed(n)) for n in lengths]
    nested = torch.nested.nested_tensor(seqs)  # strided, (B, T_b, E): what nn.TransformerEncoder makes
    out, w = fam.scripted(nested, nested, nested, need_weights=need_weights)
    assert out.is_nested
    padded = nested.to_padded_tensor(0.0)  # (B, T, E)
    pad = torch.arange(3)[None, :] >= torch.tensor(lengths)[:, None]  # (B, T), True = padding
    x = padded if fam.ours.batch_first else padded.transpose(0, 1)
    want, want_w = fam.ours(x, x, x, key_padding_mask=pad, need_weights=need_weights)
    want = want if fam.ours.batch_first else want.transpose(0, 1)  # (B, T, E)
    for b, n in enumerate(lengths):
        assert torch.equal(out[b], want[b, :n])
    if need_weights:
        assert w is not None and want_w is not None
        assert torch.equal(w[1, :2], want_w[1, :2]) and w[1, 2:].abs().sum() == 0  # padded query rows: zeros
    eager_out, eager_w = fam.ours(nested, nested, nested, need_weights=need_weights)  # the eager nested path
    assert torch.equal(out.to_padded_tensor(0.0), eager_out.to_padded_tensor(0.0))
    assert (w is None and eager_w is None) or (w is not None and eager_w is not None and torch.equal(w, eager_w))


def test_nested_inputs_the_scripted_module_cannot_take_are_refused_clearly():
    fam = family("batch_first")
    nested = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(2, E)])
    with pytest.raises(torch.jit.Error, match="key_padding_mask was given with NestedTensor inputs"):
        fam.scripted(nested, nested, nested, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(
        torch.jit.Error, match="query is a NestedTensor but key is a padded tensor of shape \\(2, 3, 8\\)"
    ):
        fam.scripted(nested, torch.randn(2, 3, E), torch.randn(2, 3, E))
    jagged = torch.nested.nested_tensor([torch.randn(3, E), torch.randn(2, E)], layout=torch.jagged)
    with pytest.raises(Exception, match="jagged"):  # whatever TorchScript makes of the jagged subclass
        fam.scripted(jagged, jagged, jagged, need_weights=False)


# -- inside other people's models -----------------------------------------------------------------------


def _swap(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with every nn.MultiheadAttention replaced by compat on the same weights."""
    module = copy.deepcopy(module)
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if type(sub) is nn.MultiheadAttention:
                ours = MultiheadAttention(
                    sub.embed_dim,
                    sub.num_heads,
                    dropout=sub.dropout,
                    bias=sub.in_proj_bias is not None,
                    add_bias_kv=sub.bias_k is not None,
                    add_zero_attn=sub.add_zero_attn,
                    kdim=sub.kdim,
                    vdim=sub.vdim,
                    batch_first=sub.batch_first,
                )
                ours.load_state_dict(sub.state_dict())
                setattr(child, attr, ours)
    return module


@pytest.mark.parametrize(
    "kind, batch_first", [("encoder_layer", False), ("decoder_layer", True), ("transformer", True)]
)
def test_torch_transformer_layers_and_transformer_script_with_compat_inside(kind, batch_first):
    torch.manual_seed(0)
    kw = {"dim_feedforward": 16, "dropout": 0.0, "batch_first": batch_first}
    if kind == "encoder_layer":
        ref: nn.Module = nn.TransformerEncoderLayer(E, H, **kw)
    elif kind == "decoder_layer":
        ref = nn.TransformerDecoderLayer(E, H, norm_first=True, **kw)
    else:
        ref = nn.Transformer(E, H, num_encoder_layers=1, num_decoder_layers=1, **kw)
    src = torch.randn((B, S, E) if batch_first else (S, B, E))
    tgt = torch.randn((B, T, E) if batch_first else (T, B, E))
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T)
    if kind == "encoder_layer":
        args: tuple = (src,)
        kwargs: dict = {"src_key_padding_mask": pad}
    elif kind == "decoder_layer":
        args, kwargs = (tgt, src), {"tgt_mask": causal, "tgt_is_causal": True, "memory_key_padding_mask": pad}
    else:  # in eval + no_grad torch's encoder hands its layers a nested tensor here (the padding is left-aligned)
        args, kwargs = (src, tgt), {"src_key_padding_mask": pad, "tgt_mask": causal, "memory_key_padding_mask": pad}
    ref.eval()  # eval + no_grad: where torch's own module would take its fused fast path
    ours = _swap(ref)
    scripted = _script(ours)
    # torch.jit.script put the twins in the eager parent too (torch's protocol); they still run compat
    assert {type(m) for m in ours.modules() if "Attention" in type(m).__name__} == {ScriptableMultiheadAttention}
    with torch.no_grad():
        want = ref(*args, **kwargs)
        got = scripted(*args, **kwargs)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(ours(*args, **kwargs), got)  # the eager parent, now holding twins


def test_the_eager_parent_after_scripting_keeps_backend_and_last_backend_working():
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0)
    original = MultiheadAttention(E, H)
    layer.self_attn = original
    _script(layer)
    twin = layer.self_attn
    assert isinstance(twin, ScriptableMultiheadAttention) and twin._source[0] is original
    x = torch.randn(T, B, E)
    layer(x)
    assert twin.last_backend == original.last_backend == "sdpa"
    twin.backend = "math"
    layer(x)
    assert original.backend == "math" and twin.last_backend == "math"
    layer.train()
    layer(x)
    assert original.training  # the parent's mode reaches the module that computes
    again = _script(layer.eval())  # a parent scripted twice: the twin is scripted as it is
    assert torch.equal(again(x), layer(x))


def test_torch_export_of_an_eager_parent_that_was_scripted():
    """torch.export (and torch.compile) keep working on the eager model after scripting has put the twin in it
    (torch.compile(layer, fullgraph=True) of the same layer was checked by hand: 2.4e-7 off eager, 8 s to
    compile, too slow for this file)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0)
    layer.self_attn = MultiheadAttention(E, H)
    _script(layer)
    assert isinstance(layer.self_attn, ScriptableMultiheadAttention)
    x = torch.randn(T, B, E)
    exported = torch.export.export(layer, (x,))
    assert torch.equal(exported.module()(x), layer(x))


def test_a_torchvision_vit_with_compat_attention_scripts_and_matches_the_original():
    vit_module = pytest.importorskip("torchvision.models.vision_transformer")
    torch.manual_seed(0)
    ref = vit_module.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    ).eval()
    ours = copy.deepcopy(ref)
    for block in ours.encoder.layers:
        torch_attn = block.self_attention
        block.self_attention = MultiheadAttention(32, 2, batch_first=True)
        block.self_attention.load_state_dict(torch_attn.state_dict())
    scripted = _script(ours)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), ref(x), atol=1e-5, rtol=1e-5)


TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 2},
}


def test_open_clip_create_model_jit_with_compat_attention_matches_the_eager_torch_model(monkeypatch):
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    ref = open_clip.create_model("ViT-S-32", pretrained=None, **TINY_CLIP).eval()  # torch's attention, eager
    # open_clip builds nn.MultiheadAttention by name: build compat instead, under the same seed (compat draws
    # its initial values as torch does), and let create_model(jit=True) script it
    monkeypatch.setattr(open_clip.transformer.nn, "MultiheadAttention", MultiheadAttention)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        jit_model = open_clip.create_model("ViT-S-32", pretrained=None, jit=True, **TINY_CLIP)
    monkeypatch.undo()
    assert isinstance(jit_model, torch.jit.ScriptModule)  # create_model falls back to eager when scripting fails
    ref_sd, jit_sd = ref.state_dict(), jit_model.state_dict()
    assert all(torch.equal(jit_sd[name], ref_sd[name]) for name in ref_sd)  # the same weights
    image, text = torch.randn(2, 3, 32, 32), torch.randint(0, 64, (2, 8))
    jit_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(jit_model.encode_image(image), ref.encode_image(image), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(jit_model.encode_text(text), ref.encode_text(text), atol=1e-5, rtol=1e-5)
