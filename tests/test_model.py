"""TinyGPT: shapes, GPT-2 init, tied embedding, causality, left-padding invariance, errors."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab import GPTConfig, TinyGPT
from attnlab.models.generation import left_pad, positions_from_padding


def tiny(**overrides) -> TinyGPT:
    kw = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32) | overrides
    return TinyGPT(GPTConfig(**kw)).eval()


FLAGS = [dict(n_kv_head=g, position=p) for g in (4, 2, 1) for p in ("learned", "rotary")]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"kv{f['n_kv_head']}-{f['position']}")
def test_logits_shape_and_no_causal_leak(flags):
    model = tiny(**flags)
    idx = torch.randint(0, 50, (2, 9))
    logits = model(idx)
    assert logits.shape == (2, 9, 50)
    changed = idx.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 50  # edit the future only
    after = model(changed)
    torch.testing.assert_close(after[:, :6], logits[:, :6], atol=0, rtol=0)
    assert not torch.allclose(after[:, 6:], logits[:, 6:])


@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: f"kv{f['n_kv_head']}-{f['position']}")
def test_left_padding_does_not_change_real_positions(flags):
    model = tiny(**flags)
    short, long = [3, 1, 4], [1, 5, 9, 2, 6, 5]
    idx, pad = left_pad([short, long], pad_token_id=7)
    logits = model(idx, key_padding_mask=pad, positions=positions_from_padding(pad))
    alone = model(torch.tensor([short]))
    torch.testing.assert_close(logits[0, -3:], alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], model(torch.tensor([long]))[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(logits).all()  # padding rows attend to nothing: zeros, not NaN


def test_output_embedding_is_tied_and_saved_once():
    model = tiny()
    assert "lm_head.weight" not in model.state_dict()
    with torch.no_grad():
        model.transformer.wte.weight[7].zero_()
    logits = model(torch.tensor([[1, 2]]))
    assert torch.all(logits[..., 7] == 0)  # the output row of token 7 is wte[7]
    loss = model(torch.tensor([[1, 2]])).sum()
    loss.backward()
    assert model.transformer.wte.weight.grad[7].abs().sum() > 0  # grads from the output side too


def test_gpt2_init_scales_residual_projections():
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=64, n_layer=8, n_head=4, n_embd=128))
    block = model.transformer.h[0]
    for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
        assert abs(proj.weight.std().item() - 0.02) < 0.002
    expected = 0.02 / math.sqrt(2 * 8)
    for w in (block.attn.out_proj.weight, block.mlp.c_proj.weight):
        assert abs(w.std().item() - expected) < 0.1 * expected
    assert torch.all(block.attn.q_proj.bias == 0) and torch.all(block.ln_1.weight == 1)
    assert isinstance(block.mlp.gelu, torch.nn.GELU) and block.mlp.gelu.approximate == "tanh"


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_kv_cache_bytes_per_token_shrink_with_gqa(kv_heads):
    model = tiny(n_kv_head=kv_heads)
    caches = model.setup_caches(batch_size=1, max_len=8)
    assert model.kv_cache_bytes_per_token == sum(c.bytes_per_token for c in caches)
    assert model.kv_cache_bytes_per_token == 2 * 2 * kv_heads * 8 * 4  # K and V, 2 layers, G heads of 8 floats
    assert caches[0].k.shape == (1, kv_heads, 8, 8)


def test_errors_name_the_argument_and_the_fix():
    model = tiny()
    with pytest.raises(ValueError, match=r"idx has T=33 tokens but block_size=32; crop it to its last 32 tokens"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(
        TypeError, match=r"idx must be an int64 tensor of token ids with shape \(B, T\).*unsqueeze\(0\)"
    ):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"positions reach 40 but block_size=32"):
        model(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([0, 40]))
    with pytest.raises(
        ValueError, match=r"idx holds token id 50 at \[0, 1\], outside the model's vocabulary of 50 ids \(0 \.\. 49\)"
    ):
        model(torch.tensor([[3, 50, 51]]))  # an IndexError from the embedding before
    with pytest.raises(ValueError, match=r"idx holds token id -2 at \[1, 0\].*token ids are >= 0"):
        model(torch.tensor([[3, 4], [-2, 1]]))
    with pytest.raises(ValueError, match=r"max_len=40 exceeds block_size=32"):
        model.setup_caches(1, 40)
    with pytest.raises(
        ValueError, match=r"position='rotary' needs an even head dim, got n_embd // n_head = 12 // 4 = 3"
    ):
        GPTConfig(n_embd=12, n_head=4, position="rotary")
    with pytest.raises(ValueError, match=r"GPTConfig.position must be 'learned'.*got 'alibi'"):
        GPTConfig(position="alibi")


def test_tied_embedding_stays_column_major_through_load_and_to():
    """The (V, E) weight lives in (E, V) storage so decoding's x @ wte.T reads a contiguous operand."""
    model = tiny()
    other = tiny()
    other.load_state_dict(model.state_dict())
    for m in (model, other, other.to(torch.float64)):
        w = m.transformer.wte.weight
        assert w.shape == (50, 32) and w.t().is_contiguous()
    torch.testing.assert_close(other(torch.tensor([[1, 2, 3]])), model(torch.tensor([[1, 2, 3]])).double())
