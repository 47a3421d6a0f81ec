"""The KV caches take ``cache_positions`` from any device and as int32 (issue 36, point 4).

On an H200, position mode with ``cache_positions=torch.tensor([3])`` (built on the CPU, as users write it)
on a CUDA cache raised ``RuntimeError: Expected all tensors to be on the same device ... index_copy_``. The
meta device reproduces it on a CPU machine: a cache and module on ``meta``, positions on the CPU. Meta
tensors have shapes but no values, so on a CPU run the cross-device cases assert shapes, devices and that
nothing raises, and int32 positions (the same conversion, on real values) assert equality. With
``ATTNLAB_TEST_DEVICE=cuda`` the cross-device device is the GPU under test: CPU positions on a CUDA cache,
compared with the same positions given on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import KVCache, MultiHeadAttention
from attnlab.core.kv_cache import RollingKVCache
from attnlab.core.masks import decoder_masks
from attnlab.models.config import GPTConfig
from attnlab.models.gpt import TinyGPT
from attnlab.models.llama import Llama, LlamaConfig

B, E, H, G, W = 2, 16, 4, 2, 4  # batch, embed_dim, heads, key/value heads, window of the rolling cache


@pytest.fixture
def cache_device(device: torch.device) -> torch.device:
    """Where the cache lives while the positions stay on the CPU: the device under test, or ``meta`` on a CPU run."""
    return torch.device("meta") if device.type == "cpu" else device


def real(device: torch.device) -> bool:
    """Whether tensors on ``device`` hold values to compare (not the meta device)."""
    return device.type != "meta"


def drawn(*shape: int, device: torch.device) -> torch.Tensor:
    """Values drawn on the CPU, then moved (as every device test draws them)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(device)


# -- the caches alone ----------------------------------------------------------------------------
@pytest.mark.parametrize("slots", [[3], [1, 2, 3]], ids=["decode", "prefill"])
def test_kv_cache_takes_cpu_positions_on_another_device(slots, cache_device):
    cache = KVCache(B, 8, G, 4, device=cache_device)
    k, v = drawn(B, G, len(slots), 4, device=cache_device), drawn(B, G, len(slots), 4, device=cache_device) + 1
    keys, values = cache.update(k, v, torch.tensor(slots))  # positions on the CPU, as users write them
    assert keys.shape == values.shape == (B, G, 8, 4) and keys.device == cache_device
    if real(cache_device):
        want = KVCache(B, 8, G, 4, device=cache_device)
        want.update(k, v, torch.tensor(slots, device=cache_device))
        assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)


@pytest.mark.parametrize("slots", [[5], [4, 5, 6]], ids=["decode", "prefill"])
def test_rolling_cache_takes_cpu_positions_on_another_device(slots, cache_device):
    cache = RollingKVCache(B, W, G, 4, device=cache_device)
    k, v = drawn(B, G, len(slots), 4, device=cache_device), drawn(B, G, len(slots), 4, device=cache_device) + 1
    keys, values, pos = cache.update_rolling(k, v, torch.tensor(slots))
    S = W if len(slots) == 1 else W + len(slots)  # decode: the window; prefill: the window and its own keys
    assert keys.shape == values.shape == (B, G, S, 4) and pos.shape == (S,)
    assert pos.device == cache.pos.device == cache_device and pos.dtype == torch.long
    if real(cache_device):
        want = RollingKVCache(B, W, G, 4, device=cache_device)
        _, _, want_pos = want.update_rolling(k, v, torch.tensor(slots, device=cache_device))
        assert torch.equal(pos, want_pos) and torch.equal(cache.pos, want.pos)
        assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)


def test_positions_are_bounds_checked_on_the_cpu_before_they_move(cache_device):
    """The overflow check reads CPU positions (free: no device sync) before moving them to the cache."""
    cache = KVCache(B, 4, G, 4, device=cache_device)
    k = drawn(B, G, 1, 4, device=cache_device)
    with pytest.raises(ValueError, match=r"kv_cache overflow: cache_positions span \[4, 4\] but max_len=4"):
        cache.update(k, k, torch.tensor([4]))
    with pytest.raises(ValueError, match=r"kv_cache overflow: cache_positions span \[-1, -1\] but max_len=4"):
        cache.update(k, k, torch.tensor([-1], dtype=torch.int32))


def test_positions_already_on_the_cache_are_not_copied(device):
    """What generate passes (int64 on the cache's device) comes back as the same tensor: no copy, nothing new
    in a compiled step's graph."""
    for cache in (KVCache(B, 8, G, 4, device=device), RollingKVCache(B, W, G, 4, device=device)):
        slots = torch.tensor([3], device=device)
        assert cache.prepare_positions(slots) is slots


@pytest.mark.parametrize("kind", ["KVCache", "RollingKVCache"])
def test_int32_positions_write_the_same_slots_as_int64(kind, device):
    """int32 positions (accepted by the module's checks) used to fail in ``index_copy_``, which takes int64 only."""
    cls, slots_held = (KVCache, 8) if kind == "KVCache" else (RollingKVCache, W)
    got, want = (cls(B, slots_held, G, 4, device=device) for _ in range(2))
    for slots in ([0, 1, 2], [3], [4], [5]):
        k = drawn(B, G, len(slots), 4, device=device)
        a = got.update(k, k + 1, torch.tensor(slots, dtype=torch.int32))
        b = want.update(k, k + 1, torch.tensor(slots, device=device))
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_decoder_masks_take_positions_from_another_device(cache_device):
    cache = KVCache(B, 8, G, 4, device=cache_device)
    masks = decoder_masks(
        None,
        batch=B,
        heads=H,
        q_len=2,
        cache=cache,
        cache_positions=torch.tensor([3, 4]),
        dtype=torch.float32,
        device=cache_device,
    )
    assert masks.keep is not None and masks.keep.shape == (2, 8) and masks.keep.device == cache_device
    if real(cache_device):
        want = torch.arange(8)[None, :] <= torch.tensor([3, 4])[:, None]  # (T_q, max_len): slot j <= own slot
        assert torch.equal(masks.keep.cpu(), want)


# -- through the module ----------------------------------------------------------------------------
MODULES: dict[str, dict[str, object]] = {
    "plain": {},
    "alibi": {"alibi": True},  # the variants' path: the positions become Structure.q_pos
    "window": {"window": W},
}


def module(options: dict, device: torch.device) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(E, H, num_kv_heads=G, **options).eval().to(device)


def decode(m: MultiHeadAttention, x: torch.Tensor, cache: KVCache, chunks, place) -> torch.Tensor:
    """``x (B, T, E)`` through ``m`` chunk by chunk in position mode, each chunk's positions made by ``place(range)``."""
    outs, start = [], 0
    for size in chunks:
        xs = x[:, start : start + size]
        outs.append(m(xs, kv_cache=cache, cache_positions=place(range(start, start + size)), is_causal=True))
        start += size
    return torch.cat(outs, dim=1)  # (B, T, E)


CACHES = [(name, False) for name in MODULES] + [("window", True)]  # a RollingKVCache serves a window layer only


@pytest.mark.parametrize(("name", "rolling"), CACHES, ids=[f"{n}-{'rolling' if r else 'kv'}" for n, r in CACHES])
def test_module_position_mode_takes_cpu_positions_on_another_device(name, rolling, cache_device):
    m = module(MODULES[name], cache_device)
    make = RollingKVCache.for_module if rolling else KVCache.for_module
    x = drawn(B, 7, E, device=cache_device)
    with torch.no_grad():
        cache = make(m, B, 8)
        got = decode(m, x, cache, (3, 1, 1, 2), lambda r: torch.tensor(list(r)))  # positions on the CPU
        assert got.shape == (B, 7, E) and got.device == cache_device
        if real(cache_device):
            on_device = decode(m, x, make(m, B, 8), (3, 1, 1, 2), lambda r: torch.tensor(list(r), device=cache_device))
            torch.testing.assert_close(got, on_device, atol=0, rtol=0)
            torch.testing.assert_close(got, m(x, is_causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", MODULES.values(), ids=MODULES.keys())
def test_module_append_mode_then_cpu_positions_on_another_device(options, cache_device):
    """Append mode carries no positions; a prefill in append mode followed by decode steps in position mode
    (the fill level set by hand, as the KV-cache docs say) takes the steps' CPU positions."""
    m = module(options, cache_device)
    x = drawn(B, 6, E, device=cache_device)
    with torch.no_grad():
        cache = KVCache.for_module(m, B, 8)
        outs = [m(x[:, :4], kv_cache=cache, is_causal=True)]  # append mode: slots 0..3
        assert cache.length == 4
        for s in (4, 5):
            outs.append(m(x[:, s : s + 1], kv_cache=cache, cache_positions=torch.tensor([s]), is_causal=True))
        got = torch.cat(outs, dim=1)
        assert got.shape == (B, 6, E) and got.device == cache_device
        if real(cache_device):
            torch.testing.assert_close(got, m(x, is_causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", MODULES.values(), ids=MODULES.keys())
def test_module_int32_positions_equal_int64(options, device):
    m = module(options, device)
    x = drawn(B, 7, E, device=device)
    make = RollingKVCache.for_module if "window" in options else KVCache.for_module
    with torch.no_grad():
        got = decode(m, x, make(m, B, 8), (3, 1, 1, 2), lambda r: torch.tensor(list(r), dtype=torch.int32))
        want = decode(m, x, make(m, B, 8), (3, 1, 1, 2), lambda r: torch.tensor(list(r), device=device))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# -- through the models ----------------------------------------------------------------------------
def tiny_model(kind: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt-learned":
        model: torch.nn.Module = TinyGPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32))
    elif kind == "gpt-rotary":
        model = TinyGPT(GPTConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_embd=32, position="rotary"))
    else:
        model = Llama(
            LlamaConfig(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48)
        )
    return model.eval().to(device)


@pytest.mark.parametrize("kind", ["gpt-learned", "gpt-rotary", "llama"])
def test_models_take_cpu_cache_positions_on_another_device(kind, cache_device, monkeypatch):
    """The models feed the positions to the position table or RoPE, the masks and every layer's cache."""
    if cache_device.type == "meta":  # torch keeps no autocast state for meta, and the models ask for it
        monkeypatch.setattr(torch, "is_autocast_enabled", lambda *args: False)
    model = tiny_model(kind, cache_device)
    idx = torch.randint(0, 50, (B, 6), generator=torch.Generator().manual_seed(0)).to(cache_device)

    def run(place) -> torch.Tensor:
        caches = model.setup_caches(B, 8)  # type: ignore[operator]
        with torch.no_grad():
            prefill = model(idx[:, :4], caches=caches, cache_positions=place([0, 1, 2, 3]))
            steps = [model(idx[:, s : s + 1], caches=caches, cache_positions=place([s])) for s in (4, 5)]
        return torch.cat([prefill, *steps], dim=1)  # (B, 6, V)

    got = run(lambda slots: torch.tensor(slots))  # on the CPU
    assert got.shape == (B, 6, 50) and got.device == cache_device
    if real(cache_device):
        torch.testing.assert_close(got, run(lambda slots: torch.tensor(slots, device=cache_device)), atol=0, rtol=0)
        with torch.no_grad():
            torch.testing.assert_close(got, model(idx), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_compiled_decode_step_takes_int32_cpu_positions_in_one_graph(device):
    """Moving and widening the positions happens inside the compiled step without a graph break (the bounds
    check is skipped while compiling, as before): one graph for every step, equal to the uncached module."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    m = module({}, device)
    cache = KVCache.for_module(m, 1, 8)
    x = drawn(1, 8, E, device=device)

    def step(tok, pos):
        return m(tok, kv_cache=cache, cache_positions=pos, is_causal=True)

    compiled = torch.compile(step, fullgraph=True)
    counters.clear()
    with torch.no_grad():
        outs = [compiled(x[:, i : i + 1], torch.tensor([i], dtype=torch.int32)) for i in range(8)]
        full = m(x, is_causal=True)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
