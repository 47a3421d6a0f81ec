"""What bounds the memory of loading a model and of a long prefill (issue 51's peak RSS): properties, no timing.

- loading builds the model on the meta device and allocates it without importing torch._dynamo or sympy (~70 MB
  resident, measured), which torch's random inits and ``empty_like`` on meta tensors would;
- a long no-grad call runs the MLP ``MLP_ROWS`` positions at a time, with the logits of one call over all;
- the prefill computes the output head for the last position only.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from attnlab.models import blocks
from attnlab.models.generation import generate
from attnlab.models.llama import Llama, LlamaConfig


def tiny_llama() -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, block_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2)
    return Llama(config).eval()


def test_loading_imports_neither_dynamo_nor_sympy():
    code = textwrap.dedent(
        """
        import sys, torch
        from attnlab.models.llama import Llama, LlamaConfig
        from attnlab.weight_files.pretrained import _allocate, _meta
        config = LlamaConfig(vocab_size=96, block_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2)
        model = _allocate(_meta(Llama, config, torch.float32), torch.device("cpu"))
        head = model.output_weight
        assert head.device.type == "cpu" and head.stride() == (1, 96), head.stride()  # the layout kept
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_long_no_grad_call_runs_the_mlp_in_row_chunks_with_the_same_logits(monkeypatch):
    model = tiny_llama()
    idx = torch.randint(0, 96, (2, 11))
    whole = model(idx).detach()  # autograd on: one MLP call over all 11 positions
    monkeypatch.setattr(blocks, "MLP_ROWS", 4)
    rows: list[int] = []
    hook = model.blocks[0].mlp.register_forward_hook(lambda m, args, out: rows.append(args[0].size(1)))
    with torch.no_grad():
        chunked = model(idx)
    hook.remove()
    assert rows == [4, 4, 3]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_prefill_computes_the_output_head_for_the_last_position_only(monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(blocks, "MLP_ROWS", 4)
    seen: list[tuple[int, ...]] = []
    real = model._logits
    monkeypatch.setattr(model, "_logits", lambda x: (seen.append(tuple(x.shape)), real(x))[1])
    out = generate(model, torch.randint(0, 96, (1, 20)), 3, temperature=0)
    assert out.shape == (1, 23)
    assert seen == [(1, 1, 32)] * 3  # the prefill's one position, then one per decode step


@pytest.mark.parametrize("kv_dtype", [None, "float16"])
def test_chunked_mlp_prefill_generates_the_tokens_of_the_unchunked_one(monkeypatch, kv_dtype):
    model = tiny_llama()
    prompt = torch.randint(0, 96, (2, 13))
    before = generate(model, prompt, 5, temperature=0, kv_dtype=kv_dtype)
    monkeypatch.setattr(blocks, "MLP_ROWS", 4)
    assert torch.equal(generate(model, prompt, 5, temperature=0, kv_dtype=kv_dtype), before)
