"""The GPU-only branches of decoding, driven on the CPU through the device check they depend on:
CUDA graphs for the compiled step, no per-step host tensors, a private copy of each graph output,
bucketed cache lengths."""

from __future__ import annotations

import torch

from attnlab import GPTConfig, TinyGPT
from attnlab.models import generation


def tiny() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=40, block_size=256, n_layer=2, n_head=4, n_embd=32)).eval()


def test_the_compiled_decode_step_uses_cuda_graphs_on_cuda_only():
    assert generation.decode_compile_mode(torch.device("cuda")) == "reduce-overhead"
    assert generation.decode_compile_mode(torch.device("cuda:1")) == "reduce-overhead"
    assert generation.decode_compile_mode(torch.device("cpu")) is None


def test_each_step_reads_its_slot_from_one_device_tensor(monkeypatch):
    """No torch.tensor per step (a host-to-device copy on a GPU): every slot is a view of one arange."""
    slots = []
    real = generation.decode_step

    def recording(model, tok, position, slot, pad, caches):
        slots.append(slot)
        return real(model, tok, position, slot, pad, caches)

    monkeypatch.setattr(generation, "decode_step", recording)
    tiny().generate(torch.randint(0, 40, (2, 5)), 6, temperature=0)
    assert [int(s) for s in slots] == [5, 6, 7, 8, 9]
    assert len({s.untyped_storage().data_ptr() for s in slots}) == 1  # one buffer, five views


def test_graph_outputs_are_copied_before_the_next_replay(monkeypatch):
    """A CUDA graph writes every replay into the same output buffer; the logits a step yields must
    survive the next replay. Simulated on the CPU by a step function that, like a graph, reuses one buffer."""
    model = tiny()
    idx = torch.randint(0, 40, (1, 4))
    want = [step.logits.clone() for step in generation.generate_steps(model, idx, 6, temperature=0)]
    buffer: list[torch.Tensor] = []

    def graph_like(model, tok, position, slot, pad, caches):
        out = generation.decode_step(model, tok, position, slot, pad, caches)
        if not buffer:
            buffer.append(torch.empty_like(out))
        return buffer[0].copy_(out)

    monkeypatch.setattr(generation, "decode_compile_mode", lambda device: "reduce-overhead")
    monkeypatch.setattr(generation, "compiled_decode_step", lambda device=None: graph_like)
    got = [step.logits for step in generation.generate_steps(model, idx, 6, temperature=0, compile=True)]
    assert len(buffer) == 1  # the graph-like step ran
    for g, w in zip(got, want, strict=True):  # kept without cloning, every step still holds its own logits
        torch.testing.assert_close(g, w)


def test_cuda_eager_decode_buckets_the_cache_length(monkeypatch):
    """On a GPU every new cache length is a new kernel shape: eager decode rounds it up as the compiled path does."""
    sizes = []
    model = tiny()
    real = model.setup_caches

    def recording(batch, max_len):
        sizes.append(max_len)
        return real(batch, max_len)

    monkeypatch.setattr(model, "setup_caches", recording)
    idx = torch.randint(0, 40, (1, 5))
    eager = model.generate(idx, 3, temperature=0)
    assert sizes == [8]  # CPU eager: exactly prompt + new tokens
    assert generation.buckets_cache_len(torch.device("cuda")) and not generation.buckets_cache_len(torch.device("cpu"))
    monkeypatch.setattr(generation, "buckets_cache_len", lambda device: True)  # the CUDA branch, driven on the CPU
    assert torch.equal(model.generate(idx, 3, temperature=0), eager)  # same tokens from a larger cache
    assert sizes == [8, 64]


def test_bench_uses_gpu_sizes_on_cuda_unless_sizes_are_given(monkeypatch):
    from attnlab.bench import attention as bench

    monkeypatch.setattr(
        bench, "resolve_device", lambda name: torch.device("cuda") if name in ("auto", "cuda") else torch.device(name)
    )
    on_gpu = bench.gpu_sizes(bench.BenchConfig())
    assert (on_gpu.embed_dim, on_gpu.tokens, max(on_gpu.lengths)) == (2048, 65536, 16384)
    mine = bench.gpu_sizes(bench.BenchConfig(embed_dim=256))
    assert (mine.embed_dim, mine.tokens) == (256, bench.BenchConfig.tokens)  # a size given: nothing replaced
    assert bench.gpu_sizes(bench.BenchConfig(device="cpu")).embed_dim == bench.BenchConfig.embed_dim
