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
