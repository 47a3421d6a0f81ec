"""torch.autograd.gradcheck in float64 on the math backend (seed 002, section 3.3)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

from attnlab import MultiHeadAttention


@pytest.mark.parametrize(
    "case", ["plain", "causal", "padding", "gqa", "mqa_causal", "cross", "cross_kdim", "float_mask", "fully_masked_row"]
)
def test_gradcheck_math_float64(case):
    kv = {"gqa": 2, "mqa_causal": 1}.get(case)
    kdim = 6 if case == "cross_kdim" else None
    mha = MultiHeadAttention(8, 4, num_kv_heads=kv, kdim=kdim, vdim=kdim, backend="math", dtype=torch.float64)
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 4, 8, dtype=torch.float64, requires_grad=True)
    inputs: tuple = (x,)
    kw: dict = {}
    if case.startswith("cross"):
        inputs = (x, torch.randn(2, 5, kdim or 8, dtype=torch.float64, requires_grad=True))
    if case in ("causal", "mqa_causal"):
        kw["is_causal"] = True
    if case == "padding":
        kw["key_padding_mask"] = torch.tensor([[False, False, True, True], [False] * 4])
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(4, 4, dtype=torch.float64)
    if case == "fully_masked_row":
        keep = torch.ones(4, 4, dtype=torch.bool)
        keep[1] = False
        kw["attn_mask"] = keep
    assert gradcheck(lambda *a: mha(*a, **kw), inputs, eps=1e-6, atol=1e-5)
