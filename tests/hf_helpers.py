"""Shared by the tests of attnlab's attention inside Hugging Face models."""

from __future__ import annotations

import torch
from torch import nn

from attnlab.hf import ATTENTION_NAME


def run_as(model: nn.Module, implementation: str, fn):
    """``fn(model)`` with the model's attention switched to ``implementation``, then back to attnlab."""
    model.set_attn_implementation(implementation)
    try:
        with torch.no_grad():
            return fn(model)
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def left_padded_inputs(vocab: int, length: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(2, length)`` in ``1 .. vocab - 1`` and an attention mask whose first row is left-padded
    by ``pad`` tokens (id 0); the same ids on every call."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, :pad] = 0
    ids[0, :pad] = 0  # the pad id
    return ids, mask
