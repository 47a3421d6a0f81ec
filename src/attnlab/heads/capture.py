"""Capture every attention layer's per-head weights during one forward pass, leaving the model as it was.

:func:`capture_attention` finds each :class:`attnlab.MultiHeadAttention` in a model (in the
order ``model.modules()`` yields them, which is layer order for every attnlab model) and, only
inside the ``with`` block, makes it run with ``need_weights=True``: the math backend computes
the softmax weights, the layer returns its usual output to the model, and the weights are kept.
Outside the block nothing is patched: normal calls take the fused path exactly as before (the
instance attribute that shadows ``forward`` is removed on exit, even after an exception).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention

__all__ = ["attention_layers", "capture_attention", "Captured"]


def attention_layers(model: nn.Module) -> list[MultiHeadAttention]:
    """The model's attention modules in layer order; a clear error if it has none."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if not layers:
        raise TypeError(
            f"{type(model).__name__} has no attnlab.MultiHeadAttention inside; inspect works on attnlab models "
            f"(TinyGPT, Llama, the lab's MinimalFormer, or any module built from attnlab.MultiHeadAttention)."
        )
    return layers


class Captured:
    """The weights seen by each layer in the ``with`` block: ``weights[l]`` is ``(B, H, T_q, T_k)`` float32 on CPU.

    A layer called several times in the block (e.g. generation) keeps its last call.
    """

    def __init__(self, n_layers: int) -> None:
        self.weights: list[Tensor | None] = [None] * n_layers

    def stacked(self) -> list[Tensor]:
        """Every layer's weights; an error naming the layers that never ran."""
        missing = [i for i, w in enumerate(self.weights) if w is None]
        if missing:
            raise RuntimeError(f"attention layers {missing} were not called inside capture_attention")
        return [w for w in self.weights if w is not None]


@contextmanager
def capture_attention(model: nn.Module) -> Iterator[Captured]:
    """``with capture_attention(model) as cap: model(idx)`` then ``cap.weights[l]``: layer ``l``'s ``(B, H, T_q, T_k)``.

    Weights are the post-softmax probabilities of the math backend (dropout off in eval mode;
    in train mode they are the pre-dropout probabilities). Padded keys and masked positions hold 0.
    """
    layers = attention_layers(model)
    captured = Captured(len(layers))

    def wrap(index: int, layer: MultiHeadAttention) -> Any:
        def forward(*args: Any, need_weights: bool = False, **kwargs: Any) -> Any:
            out, weights = MultiHeadAttention.forward(layer, *args, need_weights=True, **kwargs)
            captured.weights[index] = weights.detach().float().cpu()
            return (out, weights) if need_weights else out

        return forward

    try:
        for i, layer in enumerate(layers):
            layer.forward = wrap(i, layer)  # type: ignore[method-assign]  # an instance attribute, removed below
        yield captured
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


@torch.no_grad()
def run_and_capture(model: nn.Module, idx: Tensor, **forward_kwargs: Any) -> tuple[Tensor, list[Tensor]]:
    """``(logits, weights)`` of ``model(idx, **forward_kwargs)`` in eval mode; the model's mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with capture_attention(model) as cap:
            logits = model(idx, **forward_kwargs)
    finally:
        model.train(was_training)
    return logits, cap.stacked()
