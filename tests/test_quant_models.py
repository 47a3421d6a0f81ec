"""from_pretrained(..., dtype="gguf"): a Llama of the file's own blocks, against the float32-dequantized model.

Tiny GGUF files are written here (every matrix in one format, or mixed as test_pretrained writes them);
the real SmolLM2 file is the last family. With int8 activations a logit moves by up to ~1 when any
float32 rounding upstream changes (measured: a 1e-6 nudge of the embedding moves SmolLM2's logits as
much as the fused C++ step does), so whole-model checks on several layers use that scale, and the
exact checks are per product (tests/test_quant.py) and on the paths that do not round x.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab import from_pretrained, generate
from attnlab.models.llama import Llama
from attnlab.quant import QuantEmbedding, QuantLinear, kernel_status
from attnlab.quant import layers as layers_module
from attnlab.runtime import UsageError

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from test_pretrained import hf_llama, write_llama_gguf  # noqa: E402

KERNELS = kernel_status().available  # the tiled kernels run on any x86-64 where they built


def file_tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_every_matrix_kept_as_stored_and_prefill_equals_the_float_model(tmp_path, qtype, monkeypatch):
    path = tmp_path / "q.gguf"
    write_llama_gguf(path, tied=True, all_quantized=qtype)
    mq, _ = from_pretrained(path, dtype="gguf")
    mf, _ = from_pretrained(path, dtype="float32")  # the float model (the default on a CPU with kernels is gguf)
    assert isinstance(mq, Llama) and mq.quantized and not mf.quantized
    kept = [m for m in mq.modules() if isinstance(m, (QuantLinear, QuantEmbedding)) and not m.is_fusion]
    assert len(kept) == 1 + 7 * 2  # the embedding (tied head) and every projection of the 2 blocks
    assert mq.num_params() == mf.num_params()
    assert mq.weight_bytes() <= 1.2 * file_tensor_bytes(path)  # the memory goal (tiles pad rows to 16)
    for name, m in mq.named_modules():
        if isinstance(m, QuantLinear) and not m.is_fusion:
            assert torch.equal(m.dequantize(), mf.get_parameter(name + ".weight")), name  # Q/K unpermuted too
    idx = torch.randint(0, mf.config.vocab_size, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # this CPU's own route for 120 rows: int8 tiles (AVX2) or dequantize + GEMM (past 96)
        lq, lf = mq(idx), mf(idx)
    assert (lq - lf).abs().max() <= 5e-2 * lf.abs().max()
    # past the tiles' limit every matmul dequantizes, then float32 GEMM runs as the float model's does
    monkeypatch.setitem(layers_module.TILED_DIRECT_ROWS, kernel_status().tiles_isa, 96)
    with torch.no_grad():
        assert torch.allclose(mq(idx)[:, :-1], mf(idx)[:, :-1], atol=1e-5)
    assert mq.has_fused_decode == KERNELS  # tiled, fused Q|K|V and gate|up: the one-call C++ step


@pytest.mark.skipif(not KERNELS, reason="the fused C++ decode step needs the compiled kernels")
def test_fused_cpp_step_equals_the_python_step(tmp_path):
    path = tmp_path / "q.gguf"
    write_llama_gguf(path, tied=False, all_quantized=Q.Q8_0)
    model, _ = from_pretrained(path, dtype="gguf")
    B, S = 3, 24
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :4] = True  # a left-padded row
    pad[2, :9] = True
    positions = ((~pad).long().cumsum(1) - 1).clamp(min=0)
    idx = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    runs = []
    for fused in (True, False):
        caches = model.setup_caches(B, S)
        with torch.no_grad():
            model(
                idx[:, :10],
                positions=positions[:, :10],
                key_padding_mask=pad,
                caches=caches,
                cache_positions=torch.arange(10),
            )
            if not fused:
                model.__dict__["_fused_cache"] = (None,)  # the Python forward, the same weights
            steps = [
                model(idx[:, s : s + 1], positions=positions[:, s : s + 1], key_padding_mask=pad, caches=caches,
                      cache_positions=torch.tensor([s]), only_last=True)
                for s in range(10, S)
            ]  # fmt: skip
            model.__dict__.pop("_fused_cache", None)
        runs.append((torch.cat(steps, 1), caches))
    (fast, fast_caches), (slow, slow_caches) = runs
    assert fast.shape == (B, S - 10, model.config.vocab_size)
    # 2 blocks: few int8 roundings can flip; each flip moves a logit by far less than this
    assert (fast - slow).abs().max() <= 2e-2 * slow.abs().max()
    assert (fast.argmax(-1) == slow.argmax(-1)).float().mean() >= 0.9
    for a, b in zip(fast_caches, slow_caches, strict=True):
        assert torch.allclose(a.k, b.k, atol=1e-2) and torch.allclose(a.v, b.v, atol=1e-2)


@pytest.mark.skipif(not KERNELS, reason="the fused C++ decode step needs the compiled kernels")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_fused_cpp_step_is_the_same_on_every_instruction_set(tmp_path, qtype):
    # the plain C++ step against the vector one this CPU runs (AVX2 or AVX-512 VNNI): the matmuls are the
    # same floats; the attention's float32 sums are ordered differently, so the logits agree to rounding
    path = tmp_path / "q.gguf"
    write_llama_gguf(path, tied=True, all_quantized=qtype)
    model, _ = from_pretrained(path, dtype="gguf")
    weights, kinds, dims = model._fused_decode_inputs()
    B, S = 2, 12
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :3] = True
    idx = torch.randint(0, model.config.vocab_size, (B, S), generator=torch.Generator().manual_seed(3))
    best = int(torch.ops.attnlab_quant.cpu_tile_isa())
    outs = {}
    for isa in sorted({0, best}):
        caches = model.setup_caches(B, S)
        logits = [
            torch.ops.attnlab_quant.llama_decode(
                idx[:, s], torch.full((B,), s), torch.tensor([s]), pad, [c.k for c in caches], [c.v for c in caches],
                weights, kinds, dims, model.config.norm_eps, model.config.rope_base, isa,
            )
            for s in range(S)
        ]  # fmt: skip
        outs[isa] = torch.stack(logits, 1)
    assert outs[0].shape == (B, S, model.config.vocab_size) and torch.isfinite(outs[0]).all()
    assert (outs[0] - outs[best]).abs().max() <= 1e-2 * outs[0].abs().max()


def test_mixed_file_keeps_the_quantized_tensors_and_floats_the_rest(tmp_path):
    path = tmp_path / "mixed.gguf"
    write_llama_gguf(path, tied=True)  # q/k/up F32, v/out/gate Q4_1, down Q8_0, embedding Q8_0
    mq, _ = from_pretrained(path, dtype="gguf")
    mf, _ = from_pretrained(path, dtype="float32")  # the float model (the default on a CPU with kernels is gguf)
    block = mq.layers[0]
    assert isinstance(block.attn.q_proj, torch.nn.Linear) and isinstance(block.mlp.up_proj, torch.nn.Linear)
    assert isinstance(block.attn.v_proj, QuantLinear) and block.attn.v_proj.fmt.name == "Q4_1"
    assert isinstance(block.mlp.down_proj, QuantLinear) and block.mlp.down_proj.fmt.name == "Q8_0"
    assert block.attn.qkv_proj is None and not mq.has_fused_decode  # nothing to fuse: the Python forward runs
    idx = torch.randint(0, mf.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    out_q, out_f = generate(mq, idx, 6, temperature=0), generate(mf, idx, 6, temperature=0)
    assert out_q.shape == out_f.shape == (1, 14)
    with torch.no_grad():
        lq, lf = mq(idx), mf(idx)
    assert (lq - lf).abs().max() <= 5e-2 * lf.abs().max()  # int8 activations on 8 rows, 2 blocks


def test_gguf_dtype_refusals_name_the_fix(tmp_path):
    hf_llama().save_pretrained(tmp_path / "hf")
    with pytest.raises(
        UsageError,
        match=r"dtype gguf keeps a GGUF file's blocks as stored, but '.*hf' is not a .gguf file; pass a float dtype",
    ):
        from_pretrained(tmp_path / "hf", dtype="gguf")
    with pytest.raises(UsageError, match=r"dtype 'q4' is not a weight dtype; use auto"):
        from_pretrained(tmp_path / "hf", dtype="q4")


@pytest.mark.slow
def test_smollm2_as_stored_memory_decode_logits_and_fast_path(monkeypatch):
    from attnlab.quant.layers import direct_rows
    from attnlab.weight_files.pretrained import smollm2_path

    try:
        path = smollm2_path()
    except Exception as err:
        pytest.skip(str(err))
    mq, tok = from_pretrained("smollm2", dtype="gguf")
    mf, _ = from_pretrained("smollm2", dtype="float32")  # the float model
    assert mq.weight_bytes() <= 1.2 * file_tensor_bytes(path)  # 96.6 MB for a 96.6 MB file (fp32: 538 MB)
    assert mf.weight_bytes() / mq.weight_bytes() > 5
    text = "The capital of France is Paris. It is known for the Eiffel Tower, museums and its long history."
    idx = torch.tensor([tok(text)["input_ids"]])
    T = idx.size(1)
    # teacher-forced decode steps, each model on its own cache: the int8 route against the float32 model.
    # Measured on this prompt family: mean |dlogit| ~0.2, max ~1.2, the same argmax; llama.cpp on the same
    # file: mean 0.28, max 1.43 (docs/howto/real-models.md, "How exact it is").
    steps = {}
    for name, m in (("gguf", mq), ("fp32", mf)):
        caches = m.setup_caches(1, T)
        pad = torch.zeros(1, T, dtype=torch.bool)
        with torch.no_grad():
            m(idx[:, :4], key_padding_mask=pad, caches=caches, cache_positions=torch.arange(4))
            steps[name] = torch.cat([
                m(idx[:, s : s + 1], positions=torch.tensor([[s]]), key_padding_mask=pad, caches=caches,
                  cache_positions=torch.tensor([s]), only_last=True)[0]
                for s in range(4, T)
            ])  # fmt: skip
    diff = (steps["gguf"] - steps["fp32"]).abs()
    assert diff.mean() < 0.5 and diff.max() < 3.0, (diff.mean(), diff.max())
    assert (steps["gguf"].argmax(-1) == steps["fp32"].argmax(-1)).float().mean() >= 0.9
    import attnlab.models.generation as generation

    def no_compile(device=None):
        raise AssertionError("the fused C++ step has nothing for torch.compile to do")

    monkeypatch.setattr(generation, "compiled_decode_step", no_compile)
    assert generate(mq, idx, 8, temperature=0, compile=True).shape == (1, T + 8)
    long = idx.repeat(1, 5)
    limit = direct_rows("tiles")
    with torch.no_grad():
        lq, lf = mq(long), mf(long)
    if limit is not None and long.size(1) > limit:  # the dequantized GEMM path: the float model's own numbers
        np.testing.assert_array_equal(lq.numpy(), lf.numpy())
    else:  # this CPU's tiles read the blocks at any length (AVX2): int8 x, held as the decode steps above
        diff = (lq - lf).abs()
        assert diff.mean() < 0.5 and diff.max() < 3.0 and (lq.argmax(-1) == lf.argmax(-1)).float().mean() >= 0.9
