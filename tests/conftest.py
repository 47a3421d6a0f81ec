"""Shared helpers: tiny dimensions, every mask kind built the same way in every test."""

from __future__ import annotations

import pytest
import torch

MASK_KINDS = ("none", "bool", "float", "padding", "causal", "causal+padding", "all")


def make_masks(kind: str, B: int, T_q: int, T_k: int, *, dtype=torch.float32, generator=None) -> dict:
    """Keyword arguments for forward(); every row keeps at least one key unless stated."""
    g = generator or torch.Generator().manual_seed(1234)
    kw: dict = {}
    if kind in ("bool", "all"):
        keep = torch.rand(B, T_q, T_k, generator=g) > 0.3
        keep[..., 0] = True  # no fully masked rows here; they are tested on their own
        kw["attn_mask"] = keep
    if kind == "float":
        bias = torch.randn(T_q, T_k, generator=g, dtype=dtype)
        bias[:, 1::3] = float("-inf")
        kw["attn_mask"] = bias
    if kind in ("padding", "causal+padding", "all"):
        pad = torch.zeros(B, T_k, dtype=torch.bool)
        pad[0, -2:] = True  # the first sequence ends with 2 pad tokens
        kw["key_padding_mask"] = pad
    if kind in ("causal", "causal+padding", "all"):
        kw["is_causal"] = True
    return kw


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from 2 threads, and OpenMP threads spinning against another
    process's on the same 2 cores slow a step 20-40x (measured): one thread keeps tests steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
