"""One decoder for every family: ``Decoder`` built from the switches of a ``DecoderConfig``.

What must hold: the families' state dicts keep their checkpoints' keys; a family class is the bare
decoder with its config (same seed, same weights, same logits); every combination of switches
computes what a plain float64 reference of the same equations computes, decodes with a cache as it
computes without one, and never leaks the future; and a new family is data (a config with its own
names), not code.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from attnlab import Llama, TinyGPT
from attnlab.models.config import GPT2_NAMES, LLAMA_NAMES, DecoderConfig, GPTConfig, LatentDims, ModuleNames
from attnlab.models.decoder import Decoder
from attnlab.models.llama_config import LlamaConfig

SMALL = dict(vocab_size=61, block_size=24, n_layer=2, n_head=4, n_embd=16)


def test_gpt2_state_dict_keys_are_gpt2s():
    """The saved-checkpoint format: these keys, in this order (saved_model and the HF map read them)."""
    model = TinyGPT(GPTConfig(**{**SMALL, "n_layer": 1}))
    block = [
        "ln_1.weight",
        "ln_1.bias",
        "attn.q_proj.weight",
        "attn.q_proj.bias",
        "attn.k_proj.weight",
        "attn.k_proj.bias",
        "attn.v_proj.weight",
        "attn.v_proj.bias",
        "attn.out_proj.weight",
        "attn.out_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ]
    expected = (
        ["transformer.wte.weight"]
        + [f"transformer.h.0.{k}" for k in block]
        + ["transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wpe.weight"]
    )
    assert list(model.state_dict()) == expected


def test_llama_state_dict_keys_are_llamas():
    model = Llama(LlamaConfig(**{**SMALL, "n_layer": 1}, n_kv_head=2, intermediate_size=24, tie_embeddings=False))
    block = [
        "attn_norm.weight",
        "attn.q_proj.weight",
        "attn.k_proj.weight",
        "attn.v_proj.weight",
        "attn.out_proj.weight",
        "mlp_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    expected = ["embed.weight"] + [f"layers.0.{k}" for k in block] + ["norm.weight", "lm_head.weight"]
    assert list(model.state_dict()) == expected
    assert Llama(LlamaConfig(**SMALL, n_kv_head=2, intermediate_size=24)).lm_head is None  # tied


@pytest.mark.parametrize(
    "family, config",
    [
        (TinyGPT, GPTConfig(**SMALL)),
        (TinyGPT, GPTConfig(**SMALL, n_kv_head=2, position="rotary", bias=False)),
        (Llama, LlamaConfig(**SMALL, n_kv_head=2, intermediate_size=24)),
        (Llama, LlamaConfig(**SMALL, n_kv_head=1, intermediate_size=24, tie_embeddings=False, attention_bias=True)),
    ],
)
def test_a_family_is_the_bare_decoder_with_its_config(family, config):
    torch.manual_seed(0)
    named = family(config).eval()
    torch.manual_seed(0)
    bare = Decoder(config.decoder_config()).eval()
    a, b = named.state_dict(), bare.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    idx = torch.randint(0, SMALL["vocab_size"], (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(named(idx), bare(idx), rtol=0, atol=0)


SWITCHES = list(itertools.product(["layernorm", "rmsnorm"], ["gelu", "swiglu"], ["learned", "rotary"], [True, False]))


def switch_config(norm: str, mlp: str, position: str, tie: bool, **extra) -> DecoderConfig:
    return DecoderConfig(
        **SMALL, n_kv_head=2, intermediate_size=24, norm=norm, mlp=mlp, position=position, tie_embeddings=tie, **extra
    )


def reference_logits(model: Decoder, idx: torch.Tensor) -> torch.Tensor:
    """The decoder's equations written out on its float64 weights: embed (+ wpe), per block
    ``x + o(attn(norm(x)))`` with causal GQA and RoPE on Q/K, ``x + mlp(norm(x))``, final norm, head."""
    a = model.arch
    p = {k: v.double() for k, v in model.state_dict().items()}
    n = a.names
    B, T = idx.shape
    H, G, D = a.n_head, a.n_kv_head, a.head_dim
    assert G is not None

    def norm(x, prefix):
        if a.norm == "layernorm":
            return F.layer_norm(x, (a.n_embd,), p[prefix + ".weight"], p.get(prefix + ".bias"), a.norm_eps)
        return p[prefix + ".weight"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + a.norm_eps)

    def linear(x, prefix):
        return F.linear(x, p[prefix + ".weight"], p.get(prefix + ".bias"))

    def rope(t):  # (B, h, T, D): pair (c, c + D/2) rotated by pos * base^(-2c/D)
        inv = a.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
        ang = torch.arange(T, dtype=torch.float64)[:, None] * inv  # (T, D/2)
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, D)
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    x = p[n.embed + ".weight"][idx]  # (B, T, E)
    if a.position == "learned":
        x = x + p[f"{n.positions}.weight"][:T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(a.n_layer):
        pre = f"{n.blocks}.{i}"
        h = norm(x, f"{pre}.{n.attn_norm}")
        q = linear(h, f"{pre}.attn.q_proj").view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = linear(h, f"{pre}.attn.k_proj").view(B, T, G, D).transpose(1, 2)  # (B, G, T, D)
        v = linear(h, f"{pre}.attn.v_proj").view(B, T, G, D).transpose(1, 2)
        if a.position == "rotary":
            q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)  # (B, H, T, D)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)  # (B, H, T, T)
        w = s.masked_fill(~causal, float("-inf")).softmax(-1)
        o = (w @ v).transpose(1, 2).reshape(B, T, a.n_embd)  # (B, T, E)
        x = x + linear(o, f"{pre}.attn.out_proj")
        h = norm(x, f"{pre}.{n.mlp_norm}")
        if a.mlp == "gelu":
            m = linear(F.gelu(linear(h, f"{pre}.mlp.c_fc"), approximate="tanh"), f"{pre}.mlp.c_proj")
        else:
            m = linear(
                F.silu(linear(h, f"{pre}.mlp.gate_proj")) * linear(h, f"{pre}.mlp.up_proj"), f"{pre}.mlp.down_proj"
            )
        x = x + m
    x = norm(x, n.final_norm)
    head = p[(n.embed if a.tie_embeddings else n.head) + ".weight"]
    return x @ head.T  # (B, T, V)


@pytest.mark.parametrize("norm, mlp, position, tie", SWITCHES)
def test_every_switch_setting_computes_its_equations(norm, mlp, position, tie):
    torch.manual_seed(0)
    model = Decoder(switch_config(norm, mlp, position, tie)).double().eval()
    idx = torch.randint(0, SMALL["vocab_size"], (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference_logits(model, idx), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm, mlp, position, tie", SWITCHES)
def test_every_switch_setting_decodes_with_a_cache_as_without(norm, mlp, position, tie):
    torch.manual_seed(0)
    model = Decoder(switch_config(norm, mlp, position, tie)).eval()
    idx = torch.randint(0, SMALL["vocab_size"], (2, 10))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        caches = model.setup_caches(2, 12)
        prefill = model(idx[:, :6], caches=caches, cache_positions=torch.arange(6))
        steps = [model(idx[:, t : t + 1], caches=caches, cache_positions=torch.tensor([t])) for t in range(6, 10)]
        cached = torch.cat([prefill, *steps], dim=1)
        torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
        # no causal leak: changing the last token leaves every earlier position's logits as they were
        changed = idx.clone()
        changed[:, -1] = (changed[:, -1] + 1) % SMALL["vocab_size"]
        torch.testing.assert_close(model(changed)[:, :-1], full[:, :-1], rtol=0, atol=0)


def test_a_switch_changes_only_the_parts_it_names():
    """Each switch owns its weights: flipping it changes only the keys of the part it names."""
    base = set(Decoder(switch_config("layernorm", "gelu", "learned", True)).state_dict())
    norm = set(Decoder(switch_config("rmsnorm", "gelu", "learned", True)).state_dict())
    assert base - norm == {k for k in base if k.endswith("bias") and ("ln_" in k)}  # RMSNorm has no bias
    mlp = set(Decoder(switch_config("layernorm", "swiglu", "learned", True)).state_dict())
    assert {k.split("mlp.")[1] for k in mlp ^ base if "mlp." in k} == {
        "c_fc.weight",
        "c_fc.bias",
        "c_proj.weight",
        "c_proj.bias",
        "gate_proj.weight",
        "gate_proj.bias",
        "up_proj.weight",
        "up_proj.bias",
        "down_proj.weight",
        "down_proj.bias",
    }
    assert all("mlp." in k for k in mlp ^ base)
    rotary = set(Decoder(switch_config("layernorm", "gelu", "rotary", True)).state_dict())
    assert base - rotary == {"transformer.wpe.weight"} and rotary <= base
    untied = set(Decoder(switch_config("layernorm", "gelu", "learned", False)).state_dict())
    assert untied - base == {"lm_head.weight"} and base <= untied


@dataclass
class NeoXishConfig:
    """A family that is not in the package: data only. LayerNorm, GELU MLP, RoPE, untied head, its own names."""

    vocab_size: int = 61
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 16

    def decoder_config(self) -> DecoderConfig:
        names = ModuleNames(
            embed="gpt_neox.embed_in",
            blocks="gpt_neox.layers",
            final_norm="gpt_neox.final_layer_norm",
            head="embed_out",
            attn_norm="input_layernorm",
            mlp_norm="post_attention_layernorm",
        )
        return DecoderConfig(
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            position="rotary",
            tie_embeddings=False,
            names=names,
        )


def test_a_new_family_is_a_config_not_code():
    torch.manual_seed(0)
    model = Decoder(NeoXishConfig()).eval()
    keys = list(model.state_dict())
    assert keys[0] == "gpt_neox.embed_in.weight" and keys[-1] == "embed_out.weight"
    assert "gpt_neox.layers.1.post_attention_layernorm.bias" in keys
    assert model.config == NeoXishConfig()  # kept whole, as the families keep theirs
    idx = torch.randint(0, 61, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model.double()(idx), reference_logits(model, idx), rtol=1e-10, atol=1e-10)
    out = model.float().generate(idx, 4)  # attnlab.generate: cache, masks and sampling as for the families
    assert out.shape == (1, 9)
    assert torch.equal(out[:, :5], idx)


def test_the_families_names_are_what_their_checkpoints_use():
    assert GPTConfig(**SMALL).decoder_config().names == GPT2_NAMES
    assert LlamaConfig(**SMALL, n_kv_head=2).decoder_config().names == LLAMA_NAMES


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(norm="batchnorm"), r"DecoderConfig.norm must be one of 'layernorm', 'rmsnorm', got 'batchnorm'\."),
        (dict(mlp="relu"), r"DecoderConfig.mlp must be one of 'gelu', 'swiglu', got 'relu'\."),
        (dict(position="alibi"), r"DecoderConfig.position must be one of 'learned', 'rotary', got 'alibi'\."),
        (dict(n_layer=0), r"DecoderConfig.n_layer must be a positive int, got 0\."),
        (dict(names=LLAMA_NAMES), r"position='learned' needs names.positions"),
        (
            dict(attention="mla", latent=LatentDims(16, 4, 8, 8), position="rotary", dropout=0.1),
            r"DecoderConfig.dropout=0.1 with attention='mla': multi-head latent attention has no dropout",
        ),
    ],
)
def test_a_bad_switch_is_named_with_its_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**kwargs)


def test_rope_positions_past_block_size_compute_a_learned_table_refuses():
    """A learned table has block_size rows; RoPE has no table (untrained past block_size, as HF computes)."""
    rotary = Decoder(switch_config("rmsnorm", "swiglu", "rotary", True)).eval()
    learned = Decoder(switch_config("rmsnorm", "swiglu", "learned", True)).eval()
    idx = torch.randint(0, SMALL["vocab_size"], (1, SMALL["block_size"] + 3))
    with torch.no_grad():
        assert rotary(idx).shape == (1, SMALL["block_size"] + 3, SMALL["vocab_size"])
        with pytest.raises(ValueError, match=r"idx has T=27 tokens but block_size=24; crop it"):
            learned(idx)
