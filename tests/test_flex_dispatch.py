"""Flex on CUDA from a CPU: ``auto``'s crossovers, flex's head-dim limit and the failure memory (issue 36, point 6).

What the H200 run showed, modelled here so that a CPU test fails if it goes: ``auto`` never picked flex for a
window on CUDA (no entry in ``FLEX_CROSSOVERS``), flex on CUDA refuses a head dim below 16 (an InductorError
at E=8), and one such failure, remembered per device type, made every later flex call in the process refuse.
The CUDA decisions are asked with ``torch.device("cuda")`` objects: nothing here touches a GPU.
"""

from __future__ import annotations

import types

import pytest
import torch

import attnlab.core.flex as flex
from attnlab import MultiHeadAttention
from attnlab.core.flex import FLEX_MIN_HEAD_DIM, Crossover, FlexCall, flex_available, flex_choice, record_failure
from attnlab.core.masks import Masks
from attnlab.core.variants import Structure

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
CUDA = torch.device("cuda")
MEASURED = "measured on an H200, bfloat16, W=256, E=1024, H=16, torch 2.11 (scripts/gpu_check.py window step)"
FIGURES = {
    False: "module forward on flex 0.8 ms vs 1.1 ms on band SDPA at T=8192, 1.4 vs 2.7 at T=32768",
    True: "module forward+backward on flex 3.3 ms vs 3.6 ms on band SDPA at T=8192, 4.0 vs 6.3 at T=32768",
}


# -- the CUDA window crossovers ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("T", [4096, 8192, 32768])
def test_auto_sends_cuda_windows_to_flex_from_the_measured_length_and_says_which_measurement(T, grad, dtype):
    initialised = torch.cuda.is_available() and torch.cuda.is_initialized()
    use_flex, why = flex_choice("window", T, CUDA, grad, dtype)  # the positional signature of old
    if dtype == torch.float32:
        assert not use_flex
        assert why == "flex not used: measured in torch.bfloat16 (torch.float16 by the same kernel), not torch.float32"
    elif T < 8192:
        assert not use_flex
        assert why == f"flex not used below T=8192 ({MEASURED}: {FIGURES[grad]})"
    elif dtype == torch.bfloat16:
        assert use_flex
        assert why == f"flex ({MEASURED}: {FIGURES[grad]}; auto picks it from T >= 8192)"
    else:  # float16: listed on the reasoning, which the reason states, then the bf16 measurement
        assert use_flex
        assert why.startswith("flex (torch.float16: flex runs float16 through the same Triton template as bfloat16")
        assert "not measured" in why and f"{MEASURED}: {FIGURES[grad]}" in why
    assert initialised or not (torch.cuda.is_available() and torch.cuda.is_initialized()), "flex_choice touched CUDA"


def cuda_module(monkeypatch, embed_dim: int, heads: int, dtype=torch.bfloat16, **kw) -> MultiHeadAttention:
    """A module whose backend choice believes it is on CUDA in ``dtype`` (its weights stay on the CPU)."""
    m = MultiHeadAttention(embed_dim, heads, window=256, **kw)
    monkeypatch.setattr(m, "_a_weight", lambda: types.SimpleNamespace(device=CUDA, dtype=dtype))
    return m


def window_structure(T: int) -> Structure:
    return Structure(q_pos=torch.arange(T), k_pos=torch.arange(T), window=256)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_the_module_on_cuda_picks_flex_for_a_long_window_and_says_so(monkeypatch, grad):
    m = cuda_module(monkeypatch, 256, 16)  # D = 16
    with torch.set_grad_enabled(grad):
        backend, reason = m._choose_variant_backend(False, window_structure(8192), 8192, 8192, True)
    mode = "training" if grad else "inference"
    assert backend == "flex"
    assert (
        reason == f"window=256, T=8192, cuda {mode}: flex ({MEASURED}: {FIGURES[grad]}; auto picks it from T >= 8192)"
    )


# -- flex's head-dim limit ----------------------------------------------------------------------------
def test_flex_head_dim_limit_is_the_triton_kernels_only():
    """torch/_inductor/kernel/flex/flex_attention.py refuses D < 16 in the Triton lowering (CUDA, XPU); the CPU
    template has no such check, and a D that is not a power of two is padded, not refused."""
    assert FLEX_MIN_HEAD_DIM == 16
    for device in (CUDA, torch.device("xpu")):
        ok, why = flex_available(device, True, torch.bfloat16, head_dim=8)
        assert not ok
        assert why == (
            f"head_dim=8, but flex_attention's Triton kernel on {device.type} needs a head dim of at least 16 "
            "(torch's lowering refuses less: tl.dot needs 16)"
        )
        assert flex_available(device, True, torch.bfloat16, head_dim=16) == (True, "")
        assert flex_available(device, True, torch.bfloat16, head_dim=24) == (True, "")  # padded to 32 inside
    assert flex_available(torch.device("cpu"), False, torch.float32, head_dim=8) == (True, "")
    assert flex_available(CUDA, True, torch.bfloat16) == (True, "")  # no head dim given: not checked


@pytest.mark.parametrize("T", [4096, 8192])
def test_auto_on_cuda_keeps_a_small_head_dim_off_flex_and_says_why(monkeypatch, T):
    m = cuda_module(monkeypatch, 32, 4)  # D = 8: InductorError on the H200
    use_flex, why = flex_choice("window", 8192, CUDA, True, torch.bfloat16, head_dim=8)
    assert not use_flex and why.startswith("flex not used: head_dim=8, but flex_attention's Triton kernel on cuda")
    backend, reason = m._choose_variant_backend(False, window_structure(T), T, T, True)
    assert backend == "sdpa-band"
    assert reason is not None and reason.startswith(f"window=256, T={T}, cuda training: SDPA on each query block")
    assert reason.endswith(
        "; flex not used: head_dim=8, but flex_attention's Triton kernel on cuda needs a head dim of at least 16 "
        "(torch's lowering refuses less: tl.dot needs 16)"
    )


def test_explicit_flex_with_a_small_head_dim_on_cuda_names_head_dim_and_the_fix(monkeypatch):
    m = cuda_module(monkeypatch, 32, 4, backend="flex")
    with pytest.raises(ValueError) as info:
        m._choose_variant_backend(False, window_structure(1024), 1024, 1024, True)
    assert str(info.value) == (
        "backend='flex' cannot run this call: head_dim=8, but flex_attention's Triton kernel on cuda needs a head dim "
        "of at least 16 (torch's lowering refuses less: tl.dot needs 16). Use backend='auto' (it picks the SDPA or "
        "math path and says why in last_backend_reason), or build the module with embed_dim // num_heads >= 16 "
        "(now 32 // 4 = 8: fewer heads or a wider embed_dim)."
    )
    assert cuda_module(monkeypatch, 64, 4, backend="flex")._choose_variant_backend(
        False, window_structure(1024), 1024, 1024, True
    ) == ("flex", None)


# -- the failure memory ------------------------------------------------------------------------------
def flex_call(D=8, dtype=torch.float32, T=80, sinks=False, grad=False) -> FlexCall:
    q = torch.zeros(1, 4, T, D, dtype=dtype, requires_grad=grad)
    k = torch.zeros(1, 4, T, D, dtype=dtype)
    st = Structure(q_pos=torch.arange(T), k_pos=torch.arange(T), window=16, sinks=torch.zeros(4) if sinks else None)
    return FlexCall.of(q, k, k, Masks(), st)


def test_a_failure_is_remembered_for_its_kernel_only(monkeypatch):
    """Device, dtype, q and k shapes, grad mode and the traced variants each make another kernel."""
    monkeypatch.setattr(flex, "_FAILED", {})
    failed = flex_call()
    assert str(failed) == "q (1, 4, 80, 8), k (1, 4, 80, 8), torch.float32, cpu inference, causal+window"
    assert record_failure(failed, RuntimeError("inductor could not build the kernel\nmore")) == (
        "RuntimeError: inductor could not build the kernel"
    )
    cpu = torch.device("cpu")
    ok, why = flex_available(cpu, False, torch.float32, call=flex_call())  # the same kernel, asked again
    assert not ok
    assert why == (
        "flex failed earlier in this process on cpu for this kernel (q (1, 4, 80, 8), k (1, 4, 80, 8), "
        "torch.float32, cpu inference, causal+window): RuntimeError: inductor could not build the kernel"
    )
    others = [flex_call(D=16), flex_call(dtype=torch.bfloat16), flex_call(T=96), flex_call(sinks=True)]
    others.append(flex_call(grad=True))
    for other in others:
        assert other != failed
        assert flex_available(CUDA, False, torch.float32, call=other) == (True, "")
    assert flex_available(cpu, False, torch.float32) == (True, "")  # no kernel named: no memory to consult


E = 32


@pytest.fixture
def flex_fails_at_head_dim_8_in_float32(monkeypatch):
    """Compiled flex as on the H200 at E=8, for float32 only: ``_compiled_flex`` returns torch's unfused flex,
    which raises for that one kernel; crossovers at T=64 for float32 and bfloat16; no failure remembered yet."""
    from torch.nn.attention.flex_attention import flex_attention

    tried: list[tuple[int, torch.dtype]] = []

    def attend(q, k, v, *args, **kwargs):
        tried.append((q.size(-1), q.dtype))
        if q.size(-1) == 8 and q.dtype == torch.float32:
            raise RuntimeError("InductorError: embedding dimension of the query, key, and value must be at least 16")
        return flex_attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(flex, "_compiled_flex", lambda: attend)
    for key in list(flex.FLEX_CROSSOVERS):
        monkeypatch.setitem(flex.FLEX_CROSSOVERS, key, Crossover(64, (torch.float32, torch.bfloat16), "a test's"))
    monkeypatch.setattr(flex, "_FAILED", {})
    return tried


def test_one_failed_kernel_leaves_flex_to_every_other_call(flex_fails_at_head_dim_8_in_float32):
    tried = flex_fails_at_head_dim_8_in_float32
    torch.manual_seed(0)
    small = MultiHeadAttention(E, 4, window=16).eval()  # D = 8
    x = torch.randn(1, 80, E)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match=r"at least 16\) for q \(1, 4, 80, 8\).*not tried again for these"):
            out = small(x, is_causal=True)
        assert tried == [(8, torch.float32)]  # tried, failed, ran SDPA on key bands instead
        again = small(x, is_causal=True)
    assert tried == [(8, torch.float32)], "the kernel that failed was built again"
    assert small.last_backend == "sdpa"
    assert "flex failed earlier in this process on cpu for this kernel (q (1, 4, 80, 8)" in str(
        small.last_backend_reason
    )
    torch.testing.assert_close(again, out)
    small.backend = "math"
    torch.testing.assert_close(out, small(x, is_causal=True), atol=1e-5, rtol=1e-5)

    torch.manual_seed(0)
    wide = MultiHeadAttention(2 * E, 4, window=16).eval()  # D = 16: another kernel, still flex
    with torch.no_grad():
        got = wide(x.repeat(1, 1, 2), is_causal=True)
    assert wide.last_backend == "flex" and tried[-1] == (16, torch.float32)
    wide.backend = "math"
    torch.testing.assert_close(got, wide(x.repeat(1, 1, 2), is_causal=True), atol=1e-5, rtol=1e-5)

    half = MultiHeadAttention(E, 4, window=16).eval().to(torch.bfloat16)  # D = 8 in bfloat16: another kernel
    with torch.no_grad():
        half(x.to(torch.bfloat16), is_causal=True)
    assert half.last_backend == "flex" and tried[-1] == (8, torch.bfloat16)

    small.backend = "flex"  # asked for explicitly, the failed kernel is refused with the reason
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"flex failed earlier in this process on cpu for this kernel"),
    ):
        small(x, is_causal=True)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=r"q \(1, 4, 96, 8\)"):
        small(torch.randn(1, 96, E), is_causal=True)  # other shapes are other kernels: tried (and here fail too)
    assert tried[-1] == (8, torch.float32) and len(flex._FAILED) == 2
