"""Rotary position embeddings (RoPE), half-split layout as in GPT-NeoX and Llama.

Channel pair ``(c, c + D/2)`` of a head is rotated by ``position * base^(-2c/D)``. Applied to
queries and keys after the head split, so that ``q_i . k_j`` depends on ``i - j`` only.

Partial rotary (GPT-NeoX's ``rotary_pct``, Qwen3-Next's ``partial_rotary_factor``): angles built for
``R < D`` channels (``rope_cos_sin(positions, R)``) rotate the first ``R`` channels of each head, pair
``(c, c + R/2)`` by ``position * base^(-2c/R)``, and the other ``D - R`` pass through, as HF's
``apply_rotary_pos_emb`` does when its cos/sin are narrower than the head.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(
    positions: Tensor, head_dim: int, *, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """cos and sin for ``positions`` ``(T,)`` or ``(B, T)``; each ``(..., T, D)``."""
    if head_dim % 2:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}; use n_embd // n_head even.")
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )  # (D/2,)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (..., T, D): channel c and c + D/2 share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, heads, T, D)`` by ``cos, sin`` of shape ``(T, R)`` or ``(B, T, R)``, ``R <= D`` even:
    the first ``R`` channels of each head are rotated, the rest pass through (``R == D``: the whole head)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, R): broadcast over heads
    R = cos.size(-1)
    if R != x.size(-1):  # partial rotary: rotate the first R channels, pass the other D - R through
        rot, rest = x[..., :R], x[..., R:]  # (B, heads, T, R), (B, heads, T, D - R)
        return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)  # (B, heads, T, D)
    x1, x2 = x.chunk(2, dim=-1)  # (B, heads, T, D/2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, heads, T, D)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, heads, T, D)`` whose rotary channels come in adjacent pairs ``(2c, 2c + 1)`` (DeepSeek's
    layout, HF's ``rope_interleave=True``), by the same ``cos, sin`` ``(T, D)`` or ``(B, T, D)`` as :func:`apply_rope`.

    The result is laid out half-split, ``[x_even', x_odd']`` (as Hugging Face's DeepSeek-V3 writes it): queries and
    keys both come out so, which leaves every ``q . k`` as the pairwise rotation makes it."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D): broadcast over heads
    half = cos.size(-1) // 2
    cos, sin = cos[..., :half], sin[..., :half]  # (..., T, D/2): one angle per pair
    even, odd = x[..., 0::2], x[..., 1::2]  # (B, heads, T, D/2) each: the pairs' two channels
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)  # (B, heads, T, D)
