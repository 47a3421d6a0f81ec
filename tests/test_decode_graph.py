"""The compiled decode step's structure, counted on a CPU: what a GPU runs as kernels, fixed by a test.

On a GPU every op of a decode step is at least one kernel launch (~1.3 us each even under CUDA graphs),
and a step of a GPT-2-small-shaped model is bound by launches, not bytes (H200, torch 2.11, bf16: 178
kernels, 550 us of GPU time, 13x the bandwidth floor; issue 42). What torch.compile traces is the same
graph on any device, so this file counts it with a counting backend, on the CPU: the weight GEMMs per
layer (``F.linear`` nodes) and every op per layer (the count at 2 layers minus the count at 1: exact,
whatever the step does once). A change that adds a kernel to every layer fails here, on any machine.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from attnlab.core.fused import FusedLinearView
from attnlab.models.generation import decode_step
from attnlab.models.gpt import GPTConfig, TinyGPT
from attnlab.models.llama import Llama, LlamaConfig

# Ops a layer adds to the compiled step with its projections fused (torch 2.13, CPU; the same graph on a GPU).
# Lower them when a change removes work; raise one only with the reason in the commit that does it.
OPS_PER_LAYER = {"gpt2": 39, "llama": 77}


def build(family: str, n_layer: int) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return TinyGPT(GPTConfig(vocab_size=97, block_size=64, n_layer=n_layer, n_head=4, n_embd=32)).eval()
    config = LlamaConfig(
        vocab_size=97, block_size=64, n_layer=n_layer, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48
    )
    return Llama(config).eval()


def traced_ops(model: nn.Module, fuse: bool = True) -> tuple[collections.Counter, torch.Tensor]:
    """The ops of one compiled decode step (batch 1, cache of 64 slots), by name, and its logits."""
    if fuse:
        assert model.fuse_projections() == []
    graphs = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(decode_step, backend=counting_backend, fullgraph=True)
    caches = model.setup_caches(1, 64)
    pad = torch.zeros(1, 64, dtype=torch.bool)
    with torch.no_grad():
        logits = step(model, torch.tensor([[5]]), torch.tensor([[3]]), torch.tensor([3]), pad, caches)
    counts: collections.Counter = collections.Counter()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                counts[str(getattr(node.target, "__name__", node.target))] += 1
    return counts, logits


@pytest.mark.parametrize("family, unfused", [("gpt2", 6), ("llama", 7)])
def test_a_layer_runs_four_weight_gemms(family, unfused):
    one, _ = traced_ops(build(family, 1))
    two, _ = traced_ops(build(family, 2))
    assert two["linear"] - one["linear"] == 4  # Q|K|V, out, and the MLP's two (gate|up fused for SwiGLU)
    plain_one, _ = traced_ops(build(family, 1), fuse=False)
    plain_two, _ = traced_ops(build(family, 2), fuse=False)
    assert plain_two["linear"] - plain_one["linear"] == unfused  # what fuse_projections saves


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_ops_per_layer_do_not_grow(family):
    one, _ = traced_ops(build(family, 1))
    two, _ = traced_ops(build(family, 2))
    per_layer = sum(two.values()) - sum(one.values())
    assert per_layer <= OPS_PER_LAYER[family], f"{per_layer} ops a layer: {two - one}"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_padding_mask_is_converted_once_a_step(family):
    """Which rows see no key, and the bool mask as an additive one, are found by decoder_masks for all layers
    (on the H200, bitwise_not + masked_fill in each of 12 layers); a layer adds the mask and zeroes dead rows."""
    one, _ = traced_ops(build(family, 1))
    two, _ = traced_ops(build(family, 2))
    per_layer = two - one
    assert per_layer["invert"] == per_layer["any"] == per_layer["or_"] == 0, per_layer
    assert per_layer["masked_fill"] == 1  # the context of rows that see no key: exact zeros


def test_a_row_that_sees_no_key_decodes_to_finite_logits_beside_a_real_one():
    """A fully padded row in a cached step (its own slot padding too) must not turn the batch NaN, and the real
    row must get the logits it gets alone: the dead rows found once are honoured in every layer."""
    model = build("llama", 2)
    idx = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        caches = model.setup_caches(2, 8)
        pad = torch.zeros(2, 8, dtype=torch.bool)
        pad[1] = True  # row 1: every slot is padding
        model(idx, caches=caches, cache_positions=torch.arange(5), key_padding_mask=pad)
        step = model(idx[:, -1:], caches=caches, cache_positions=torch.tensor([5]), key_padding_mask=pad)
        alone_caches = model.setup_caches(1, 8)
        model(idx[:1], caches=alone_caches, cache_positions=torch.arange(5), key_padding_mask=pad[:1])
        alone = model(idx[:1, -1:], caches=alone_caches, cache_positions=torch.tensor([5]), key_padding_mask=pad[:1])
    assert torch.isfinite(step).all()
    torch.testing.assert_close(step[:1], alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fused_step_computes_the_unfused_logits(family):
    _, fused = traced_ops(build(family, 2))
    _, plain = traced_ops(build(family, 2), fuse=False)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)


def test_the_view_follows_the_weights_and_leaves_training_alone():
    model = build("llama", 1)
    model.fuse_projections()
    attn = model.blocks[0].attn
    assert isinstance(attn.qkv_proj, FusedLinearView)
    assert list(model.state_dict()) == list(build("llama", 1).state_dict())  # no new keys
    idx = torch.randint(0, 97, (1, 6))
    # training: gradients reach the separate projections, through the parts' own calls
    model.train()
    model(idx).sum().backward()
    assert attn.q_proj.weight.grad is not None and attn.v_proj.weight.grad is not None
    with torch.no_grad():
        attn.k_proj.weight.mul_(2.0)  # an optimizer step, in place
    model.eval()
    with torch.no_grad():
        fused = model(idx)
        attn.qkv_proj = None
        torch.testing.assert_close(fused, model(idx), rtol=1e-6, atol=1e-6)


def test_a_wrapped_projection_is_left_unfused_and_named():
    class LoraLinear(nn.Module):  # what PEFT puts in place of a projection: the base Linear plus a low-rank path
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base, self.down, self.up = (
                base,
                nn.Linear(base.in_features, 2, bias=False),
                nn.Linear(2, base.out_features, bias=False),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + self.up(self.down(x))

    model = build("gpt2", 2)
    model.blocks[1].attn.v_proj = LoraLinear(model.blocks[1].attn.v_proj)
    skipped = model.fuse_projections()
    assert skipped == [
        "transformer.h.1: qkv_proj not fused, part 2 is a LoraLinear, not a plain nn.Linear (a wrapper such as LoRA computes more)"
    ]
    assert isinstance(model.blocks[0].attn.qkv_proj, FusedLinearView) and model.blocks[1].attn.qkv_proj is None
