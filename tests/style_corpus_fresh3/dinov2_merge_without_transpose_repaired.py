"""Bidirectional ViT attention through an xformers-style ``memory_efficient_attention``, written the way DINOv2 (dinov2/layers/attention.py) writes ``MemEffAttention`` (the style: see dinov2_correct.py).

Mistake: none. Repaired twin of dinov2_merge_without_transpose.py: the same code with that one mistake fixed
(return out.transpose(1, 2): the heads moved back behind the sequence).
"""

import logging
from typing import Optional

import torch
from torch import Tensor, nn

logger = logging.getLogger("dinov2")

EXPECTED = "pass"
TARGET = "MemEffAttention"
STYLE = "dinov2"
CALL = "forward(x, attn_bias=None): no mask, bidirectional; attn_bias additive (B,H,N,N) or None; q/k/v in (B, N, H, D) layout (xformers BMHK); returns the output tensor"

XFORMERS_AVAILABLE = False


def memory_efficient_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Optional[Tensor] = None,
    p: float = 0.0,
    scale: Optional[float] = None,
) -> Tensor:
    """xformers' contract in plain torch: (B, M, H, K) in and out."""
    scale = 1.0 / query.shape[-1] ** 0.5 if scale is None else scale
    query = query.transpose(1, 2)  # BHMK
    key = key.transpose(1, 2)
    value = value.transpose(1, 2)
    attn = query * scale @ key.transpose(-2, -1)
    if attn_bias is not None:
        attn = attn + attn_bias
    attn = attn.softmax(-1)
    attn = torch.nn.functional.dropout(attn, p)
    out = attn @ value
    return out.transpose(1, 2)  # back to BMHK


class Attention(nn.Module):
    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        qkv_bias: bool = False,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = head_dim**-0.5

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)

        q, k, v = qkv[0] * self.scale, qkv[1], qkv[2]
        attn = q @ k.transpose(-2, -1)

        attn = attn.softmax(dim=-1)
        attn = self.attn_drop(attn)

        x = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class MemEffAttention(Attention):
    def forward(self, x: Tensor, attn_bias=None) -> Tensor:
        if not XFORMERS_AVAILABLE and attn_bias is not None:
            logger.debug("xFormers is not available: attn_bias handled by the plain-torch fallback")

        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads)

        q, k, v = torch.unbind(qkv, 2)

        x = memory_efficient_attention(q, k, v, attn_bias=attn_bias, p=self.attn_drop.p if self.training else 0.0)
        x = x.reshape([B, N, C])

        x = self.proj(x)
        x = self.proj_drop(x)
        return x
