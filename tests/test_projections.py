"""The projections are real ``nn.Linear`` children: replacing, wrapping, hooking and freezing them
takes effect, PEFT's LoRA can target them, and state dicts of the old fused layout still load."""

from __future__ import annotations

import peft
import pytest
import torch
from torch import Tensor, nn

from attnlab import MultiHeadAttention


class LoRALinear(nn.Module):
    """A hand-written LoRA wrapper, as users write them: base output + (x A^T) B^T * scale."""

    def __init__(self, base: nn.Linear, rank: int = 2, scale: float = 2.0) -> None:
        super().__init__()
        self.base, self.scale = base, scale
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_a.T @ self.lora_b.T) * self.scale


@pytest.fixture(params=[3, 1100], ids=["short", "long"])
def x(request):
    return torch.randn(2, request.param, 16)


@pytest.mark.parametrize("name", ["q_proj", "k_proj", "v_proj", "out_proj"])
def test_a_replaced_projection_is_the_one_that_runs(name, x):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    before = mha(x)
    setattr(mha, name, LoRALinear(getattr(mha, name)))
    after = mha(x)
    assert (after - before).abs().max() > 1e-3
    with torch.no_grad():
        getattr(mha, name).lora_b.zero_()  # a zero adapter is the identity change
    assert torch.allclose(mha(x), before, atol=1e-6)


def test_a_forward_hook_on_a_projection_sees_the_call(x):
    mha = MultiHeadAttention(16, 4)
    seen = []
    mha.k_proj.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    mha(x)
    assert seen == [(2, x.size(1), 16)]


def test_a_global_module_hook_sees_each_projection(x):
    mha = MultiHeadAttention(16, 4)
    names = {id(m): n for n, m in mha.named_modules()}
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda mod, inp, out: seen.append(names.get(id(mod))))
    try:
        mha(x)
    finally:
        handle.remove()
    assert {"q_proj", "k_proj", "v_proj", "out_proj"} <= set(seen)


def test_freezing_a_projection_freezes_it():
    mha = MultiHeadAttention(16, 4)
    for p in mha.q_proj.parameters():
        p.requires_grad_(False)
    mha(torch.randn(2, 1100, 16)).sum().backward()
    assert mha.q_proj.weight.grad is None and mha.q_proj.bias.grad is None
    assert mha.k_proj.weight.grad is not None and mha.out_proj.weight.grad is not None


def test_old_fused_state_dict_loads():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2)
    sd = mha.state_dict()
    old = {
        "in_proj.weight": torch.cat([sd["q_proj.weight"], sd["k_proj.weight"], sd["v_proj.weight"]]),
        "in_proj.bias": torch.cat([sd["q_proj.bias"], sd["k_proj.bias"], sd["v_proj.bias"]]),
        "out_proj.weight": sd["out_proj.weight"],
        "out_proj.bias": sd["out_proj.bias"],
    }
    fresh = MultiHeadAttention(16, 4, num_kv_heads=2)
    fresh.load_state_dict(old, strict=True)
    x = torch.randn(2, 5, 16)
    assert torch.equal(fresh(x), mha(x))


def test_old_fused_state_dict_of_another_shape_is_a_clear_error():
    other = {"in_proj.weight": torch.zeros(48, 16), "out_proj.weight": torch.zeros(16, 16)}
    with pytest.raises(ValueError, match=r"in_proj.weight has 48 rows; this module expects 32 \(embed_dim"):
        MultiHeadAttention(16, 4, num_kv_heads=2, bias=False).load_state_dict(other)


def test_old_tinygpt_checkpoint_loads(tmp_path):
    from safetensors.torch import load_file, save_file

    from attnlab import GPTConfig, TinyGPT, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)).eval()
    save_checkpoint(model, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    for i in range(2):  # rewrite the file as the fused layout wrote it
        p = f"transformer.h.{i}.attn."
        for kind in ("weight", "bias"):
            parts = [sd.pop(f"{p}{proj}.{kind}") for proj in ("q_proj", "k_proj", "v_proj")]
            sd[f"{p}in_proj.{kind}"] = torch.cat(parts)
    save_file(sd, tmp_path / "model.safetensors")
    loaded, _ = load_checkpoint(tmp_path)
    idx = torch.randint(0, 32, (2, 10))
    assert torch.equal(loaded(idx), model(idx))


def test_peft_lora_on_q_and_v_trains_only_the_adapters():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = MultiHeadAttention(16, 4, num_kv_heads=2)
            self.head = nn.Linear(16, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.attn(x, is_causal=True))

    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 6, 16)
    base = net(x).detach()
    model = peft.get_peft_model(net, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj" in n for n in trainable) and any("v_proj" in n for n in trainable)
    assert not any("k_proj" in n or "out_proj" in n for n in trainable)
    assert torch.allclose(model(x), base, atol=1e-6)  # LoRA's B starts at zero: no change yet

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    model.eval()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert (model(x) - base).abs().max() > 1e-4  # the adapters change the output
    with model.disable_adapter():
        assert torch.allclose(model(x), base, atol=1e-6)  # and disabling them restores it
