"""Seed 002's MinimalFormerBlock, its stack, and the model builder."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnlab import TinyGPT
from attnlab.lab.config import ModelConfig
from attnlab.lab.models import MinimalFormer, MinimalFormerBlock, build_model


def test_minimal_block_is_the_seeds_layout():
    block = MinimalFormerBlock(d_model=64, num_heads=4, ff_dim=128, dropout=0.1)
    kinds = [type(m) for m in block.ffn]
    assert kinds == [nn.Linear, nn.GELU, nn.Linear, nn.Dropout]
    assert block.ffn[0].out_features == 128 and block.attn.num_heads == 4
    x = torch.randn(2, 32, 64)
    assert block(x).shape == (2, 32, 64)


def test_minimal_block_is_pre_norm_residual():
    block = MinimalFormerBlock(16, 2, 32, dropout=0.0).eval()
    x = torch.randn(2, 5, 16)
    h = x + block.attn(block.norm1(x))
    assert torch.allclose(block(x), h + block.ffn(block.norm2(h)), atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_causal_mask_decides_whether_the_future_leaks(causal):
    torch.manual_seed(0)
    model = MinimalFormer(vocab_size=10, block_size=8, d_model=16, num_heads=2, ff_dim=32, causal=causal).eval()
    a = torch.randint(0, 10, (1, 8))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % 10  # change only the last token
    same_prefix = torch.allclose(model(a)[0, :-1], model(b)[0, :-1])
    assert same_prefix == causal  # without the mask (the seed's call) earlier positions see the change


@pytest.mark.parametrize("kind", ["gpt", "minimal"])
def test_build_model_maps_ids_to_logits(kind):
    model = build_model(ModelConfig(kind=kind, num_layers=1, num_heads=2, embed_dim=16), vocab_size=11, block_size=9)
    assert isinstance(model, TinyGPT if kind == "gpt" else MinimalFormer)
    assert model(torch.randint(0, 11, (3, 9))).shape == (3, 9, 11)


def test_build_model_rejects_heads_that_do_not_divide_d_model():
    with pytest.raises(ValueError, match="--model.num-heads 3 must divide --model.embed-dim 16"):
        build_model(ModelConfig(num_heads=3, embed_dim=16), 5, 5)


@pytest.mark.parametrize("init, lo, hi", [("gpt2", 0.015, 0.025), ("torch", 0.05, 0.2)])
def test_gpt_init_choice_scales_the_linear_layers(init, lo, hi):
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind="gpt", num_layers=1, num_heads=4, embed_dim=64, init=init), 10, 8)
    block = model.transformer.h[0]
    assert lo < float(block.mlp.c_fc.weight.detach().std()) < hi
    assert lo < float(block.attn.q_proj.weight.detach().std()) < hi
    assert (
        0.015 < float(model.transformer.wte.weight.detach().std()) < 0.025
    )  # embeddings keep GPT-2's N(0, 0.02) either way
