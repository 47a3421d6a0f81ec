"""The probe reads modules written in the styles people learn from, as written, with no options.

Notation: B batch, T positions, E embed_dim, H heads. Each module below is a small attention written
the way one source teaches it (the Annotated Transformer's ModuleList, nanoGPT's fused ``c_attn`` and
config, d2l's LazyLinear and ``valid_lens``, Hugging Face's config and ``attention_mask``, a wrapper of
``nn.MultiheadAttention``); the tests assert what the probe finds in each, and that ``attnlab check``
and ``attnlab trace`` run on them from a file.
"""

from __future__ import annotations

import math
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.check.probe import ProbedAdapter
from attnlab.check.target import TargetError, build_target
from attnlab.cli import main

E, H = 32, 4


def _heads(x: Tensor, h: int) -> Tensor:
    B, T, _ = x.shape
    return x.view(B, T, h, -1).transpose(1, 2)  # (B, H, T, D)


def _merge(x: Tensor) -> Tensor:
    B, _, T, _ = x.shape
    return x.transpose(1, 2).reshape(B, T, -1)  # (B, T, E)


# -- the styles ----------------------------------------------------------------------------------
class ListOfFour(nn.Module):
    """The Annotated Transformer: clones(nn.Linear(d, d), 4), a 0/1 mask unsqueezed for the heads."""

    def __init__(self, h: int, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.h, self.d_k = h, d_model // h
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # (B, 1, T_q, T_k) or (B, 1, 1, T_k): one mask for every head
        q, k, v = (_heads(lin(x), self.h) for lin, x in zip(self.linears, (query, key, value), strict=False))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, H, T_q, T_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        return self.linears[-1](_merge(self.dropout(scores.softmax(-1)) @ v))


class Fused(nn.Module):
    """nanoGPT: a config, a fused c_attn, forward(x), causal by SDPA or by a tril buffer; ``order`` says
    how the fused output is split (nanoGPT's is "qkv")."""

    order = "qkv"

    def __init__(self, config) -> None:
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.causal = getattr(config, "causal", True)

    def forward(self, x):
        parts = dict(zip(self.order, self.c_attn(x).split(self.n_embd, dim=2), strict=True))
        q, k, v = (_heads(parts[n], self.n_head) for n in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)  # (B, H, T, D)
        return self.c_proj(_merge(y))


class FusedSwapped(Fused):
    order = "kqv"


class FusedTril(Fused):
    """nanoGPT's manual path: a (1, 1, block, block) tril buffer named ``bias``."""

    def __init__(self, config) -> None:
        super().__init__(config)
        tril = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", tril.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        T = x.size(1)
        q, k, v = (_heads(t, self.n_head) for t in self.c_attn(x).split(self.n_embd, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))  # (B, H, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return self.c_proj(_merge(att.softmax(-1) @ v))


class Bidirectional(nn.Module):
    """A fused qkv, forward(x), no causality: must not be called causal."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = nn.Linear(embed_dim, 3 * embed_dim), nn.Linear(embed_dim, embed_dim)

    def forward(self, x):
        q, k, v = (_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(_merge(F.scaled_dot_product_attention(q, k, v)))


def _masked_softmax(scores: Tensor, valid_lens: Tensor | None) -> Tensor:
    """d2l's: scores (B*H, T_q, T_k); valid_lens (B*H,) or (B*H, T_q); masked keys get -1e6."""
    if valid_lens is None:
        return scores.softmax(-1)
    shape = scores.shape
    lens = valid_lens.repeat_interleave(shape[1]) if valid_lens.dim() == 1 else valid_lens.reshape(-1)
    flat = scores.reshape(-1, shape[-1])
    keep = torch.arange(shape[-1], device=scores.device)[None, :] < lens[:, None]
    return flat.masked_fill(~keep, -1e6).reshape(shape).softmax(-1)


class Lazy(nn.Module):
    """d2l: LazyLinear W_q .. W_o, num_hiddens, forward(queries, keys, values, valid_lens)."""

    def __init__(self, num_hiddens: int, num_heads: int, dropout: float, bias: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.LazyLinear(num_hiddens, bias=bias) for _ in range(4))

    def _split(self, x: Tensor) -> Tensor:
        return _heads(x, self.num_heads).flatten(0, 1)  # (B*H, T, D)

    def forward(self, queries, keys, values, valid_lens):
        q, k, v = self._split(self.W_q(queries)), self._split(self.W_k(keys)), self._split(self.W_v(values))
        if valid_lens is not None:
            valid_lens = valid_lens.repeat_interleave(self.num_heads, dim=0)
        w = _masked_softmax(q @ k.transpose(1, 2) / math.sqrt(q.size(-1)), valid_lens)  # (B*H, T_q, T_k)
        out = (w @ v).unflatten(0, (-1, self.num_heads))  # (B, H, T_q, D)
        return self.W_o(_merge(out))


class HFStyle(nn.Module):
    """Hugging Face: (config, layer_idx), GQA from config.num_key_value_heads, an additive attention_mask."""

    def __init__(self, config, layer_idx) -> None:
        super().__init__()
        self.head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
        self.groups = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size)
        self.attention_dropout = config.attention_dropout

    def forward(self, hidden_states, attention_mask=None):
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, G, T, D)
        v = self.v_proj(hidden_states).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, G, T, D)
        k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)  # (B, H, T, D)
        w = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)  # (B, H, T, T)
        if attention_mask is not None:
            w = w + attention_mask
        return self.o_proj(_merge(w.softmax(-1) @ v))


class HFKeep2D(nn.Module):
    """BERT as HF models are called: attention_mask (B, T) with 1 = keep, extended to additive inside."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.query, self.key, self.value, self.dense = (
            nn.Linear(config.hidden_size, config.hidden_size) for _ in range(4)
        )

    def forward(self, hidden_states, attention_mask=None):
        h = self.num_attention_heads
        q, k, v = (_heads(p(hidden_states), h) for p in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))  # (B, H, T, T)
        if attention_mask is not None:  # (B, T): 1 = keep
            scores = scores + (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(scores.dtype).min
        return self.dense(_merge(scores.softmax(-1) @ v))


class IntKeep2D(HFKeep2D):
    """attention_mask (B, T) of 0/1 integers, 1 = keep: ``1 - mask`` rejects a bool mask."""

    def forward(self, hidden_states, attention_mask=None):
        h = self.num_attention_heads
        q, k, v = (_heads(p(hidden_states), h) for p in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))  # (B, H, T, T)
        if attention_mask is not None:
            scores = scores + (1 - attention_mask[:, None, None, :]) * torch.finfo(scores.dtype).min
        return self.dense(_merge(scores.softmax(-1) @ v))


class Additive4D(HFKeep2D):
    """BERT's extended mask: additive float (B, 1, 1, T) or any shape that broadcasts, added as it is."""

    def forward(self, hidden_states, attention_mask=None):
        h = self.num_attention_heads
        q, k, v = (_heads(p(hidden_states), h) for p in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))  # (B, H, T, T)
        if attention_mask is not None:
            scores = scores + attention_mask
        return self.dense(_merge(scores.softmax(-1) @ v))


class PerKeyBool(ListOfFour):
    """A bool key mask (B, 1, 1, T_k), True = keep, used as it is: per key only."""

    def forward(self, query, key, value, mask=None):
        q, k, v = (_heads(lin(x), self.h) for lin, x in zip(self.linears, (query, key, value), strict=False))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, H, T_q, T_k)
        if mask is not None:
            if mask.dim() != 4 or mask.size(2) != 1:
                raise ValueError(f"mask must be (B, 1, 1, T_k), got {list(mask.shape)}")
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.linears[-1](_merge(scores.softmax(-1) @ v))


class Wrapper(nn.Module):
    """nn.MultiheadAttention inside a module, called through the wrapper's own forward."""

    def __init__(self, embed_dim: int, num_heads: int, batch_first: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.mha = nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first)

    def forward(self, x, key_padding_mask=None):
        x = x if self.batch_first else x.transpose(0, 1)  # (T, B, E) for a sequence-first module
        out, _ = self.mha(x, x, x, key_padding_mask=key_padding_mask)
        return out if self.batch_first else out.transpose(0, 1)


def _config(**over) -> SimpleNamespace:
    fields = {"n_embd": E, "n_head": H, "bias": True, "block_size": 64}
    return SimpleNamespace(**{**fields, **over})


def _probed(module: nn.Module, **kw) -> ProbedAdapter:
    torch.manual_seed(0)
    return ProbedAdapter(module.eval(), num_heads=H, **kw)


# -- projections ----------------------------------------------------------------------------------
def test_a_module_list_of_four_is_read_as_q_k_v_out_in_order():
    a = _probed(ListOfFour(H, E))
    assert (a.found.q, a.found.k, a.found.v, a.found.out) == ("linears.0", "linears.1", "linears.2", "linears.3")
    assert a.projections().q_weight is a.module.linears[0].weight
    assert "linears[0..3] taken as q, k, v, out" in (a.describe_call() or "")


@pytest.mark.parametrize("cls, order", [(Fused, ("q", "k", "v")), (FusedSwapped, ("k", "q", "v"))])
def test_a_fused_projections_split_order_is_found_by_its_effect(cls, order):
    a = _probed(cls(_config()))
    assert a.found.qkv == "c_attn" and a.qkv_order == order
    assert f"fused c_attn split as {', '.join(order)}" in (a.describe_call() or "")


def test_lazy_linear_is_materialised_by_one_call_and_its_weights_read():
    a = _probed(Lazy(E, H, 0.0), embed_dim=E)
    assert a.lazy and a.embed_dim == E and a.projections().q_weight.shape == (E, E)
    assert "(LazyLinear, materialised by one call)" in (a.describe_call() or "")


def test_nn_multihead_attention_inside_a_wrapper_is_found_with_its_batch_first():
    for batch_first in (True, False):
        a = _probed(Wrapper(E, H, batch_first=batch_first))
        assert a.found.mha == "mha" and a.num_heads == H
        assert a.projections().out_weight is a.module.mha.out_proj.weight
        assert f"batch_first={batch_first}" in (a.describe_call() or "")


# -- config ----------------------------------------------------------------------------------------
def test_a_config_is_synthesised_with_the_fields_the_class_reads():
    kw = {"embed_dim": E, "num_heads": H, "num_kv_heads": None, "dropout": 0.0, "seed": 0}
    nano = build_target("test_check_styles_probe:Fused", **kw)
    hf = build_target("test_check_styles_probe:HFStyle", **kw)
    assert (nano.embed_dim, nano.num_heads, nano.num_kv_heads) == (E, H, H)
    assert (hf.embed_dim, hf.num_heads, hf.num_kv_heads) == (E, H, H // 2)  # num_key_value_heads: H/2 when not given
    assert hf.factory is not None and hf.resized(64, 4, 1).num_kv_heads == 1  # rebuilt through the config


def test_a_config_field_check_cannot_fill_is_named(tmp_path):
    path = tmp_path / "odd.py"
    path.write_text(
        textwrap.dedent(
            """
            from torch import nn
            class Odd(nn.Module):
                def __init__(self, config):
                    super().__init__()
                    self.q = nn.Linear(config.n_embd, config.n_embd * config.rope_fraction)
            """
        )
    )
    with pytest.raises(TargetError, match=r"config\.rope_fraction"):
        build_target(f"{path}:Odd", embed_dim=E, num_heads=H, num_kv_heads=None, dropout=0.0, seed=0)


# -- masks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "module, said",
    [
        (ListOfFour(H, E), "mask as bool, True = may attend"),
        (HFStyle(_config(hidden_size=E, num_attention_heads=H, num_key_value_heads=2, attention_dropout=0.0), 0),
         "attention_mask as additive float"),
        (HFKeep2D(_config(hidden_size=E, num_attention_heads=H)), "shaped (B, T_k), one mask per key"),
        (Additive4D(_config(hidden_size=E, num_attention_heads=H)), "attention_mask as additive float"),
        (IntKeep2D(_config(hidden_size=E, num_attention_heads=H)), "0/1 integers, 1 = may attend"),
        (PerKeyBool(H, E), "shaped (B, 1, 1, T_k), one mask per key"),
        (Lazy(E, H, 0.0), "valid_lens as valid lengths (B, T_q)"),
    ],
)  # fmt: skip
def test_each_mask_convention_is_found_said_and_honoured(module, said):
    a = _probed(module, embed_dim=E)
    assert said in (a.describe_call() or "")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, E, generator=g)  # (B, T, E)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, -2:] = pad[2, -3:] = True  # (B, T): trailing padding, other per sequence
    out = a(x, x, x, key_padding_mask=pad)
    moved = x.clone()
    moved[0, -2:] += 3.0  # the pad tokens of sequence 0 change: no real query may notice
    after = a(moved, moved, moved, key_padding_mask=pad)
    assert torch.allclose(out[~pad], after[~pad], atol=1e-6)
    assert not torch.allclose(out[pad], after[pad], atol=1e-3)  # the mask did not simply hide everything


def test_a_per_key_mask_cannot_carry_a_per_query_mask_and_says_so():
    from attnlab.check.adapters import Unsupported

    a = _probed(PerKeyBool(H, E))
    x = torch.randn(2, 5, E)
    with pytest.raises(Unsupported, match="one mask per key"):
        a(x, x, x, is_causal=True)


# -- causality -------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", [Fused(_config()), FusedTril(_config())])
def test_an_always_causal_module_is_detected(module):
    a = _probed(module)
    assert a.always_causal
    assert "always causal" in (a.describe_call() or "")


def test_a_bidirectional_module_is_not_called_causal():
    a = _probed(Bidirectional(E, H))
    assert not a.always_causal and "always causal" not in (a.describe_call() or "")


# -- the commands on files ----------------------------------------------------------------------------
_FILE = """
import math
import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MultiHeadAttention(nn.Module):
    def __init__(self, num_hiddens, num_heads, dropout, bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.LazyLinear(num_hiddens, bias=bias) for _ in range(4))

    def forward(self, queries, keys, values, valid_lens):
        B, T, _ = queries.shape
        split = lambda t: t.view(B, t.size(1), self.num_heads, -1).transpose(1, 2)
        q, k, v = split(self.W_q(queries)), split(self.W_k(keys)), split(self.W_v(values))
        s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
        if valid_lens is not None:
            keep = torch.arange(k.size(2))[None, None, None, :] < valid_lens.view(B, 1, -1, 1)
            s = s.masked_fill(~keep, -1e6)
        return self.W_o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1))
"""


@pytest.mark.parametrize("name", ["CausalSelfAttention", "MultiHeadAttention"])
def test_check_and_trace_run_on_each_style_from_a_file(tmp_path, capsys, name):
    path = tmp_path / "styles.py"
    path.write_text(_FILE)
    fast = ["parity_self", "parity_cross", "no_causal_leak", "padding_invariance", "determinism"]
    code = main(
        ["check", "--target", f"{path}:{name}", "--embed-dim", str(E), "--num-heads", str(H), "--checks", *fast]
    )
    shown = capsys.readouterr().out
    assert code == 0, shown
    assert "called as forward(" in shown
    assert main(["trace", "--target", f"{path}:{name}", "--embed-dim", str(E), "--num-heads", str(H)]) == 0
    traced = capsys.readouterr().out
    assert "first departure" not in traced, traced
