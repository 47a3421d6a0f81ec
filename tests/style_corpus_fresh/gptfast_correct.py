"""Attention written the way Meta's gpt-fast (pytorch-labs/gpt-fast, model.py) writes it.

Style: ``Attention(config)`` over a ``ModelArgs`` dataclass (dim, n_head, n_local_heads, head_dim filled in
``__post_init__``, rope_base); one fused ``wqkv`` Linear without bias, (n_head + 2 * n_local_heads) * head_dim wide,
cut with ``split([dim, kv_size, kv_size])``; ``wo``; a ``kv_cache`` attribute that stays None outside generation;
rotary on q and k by (cos, sin) pairs of adjacent features; K/V heads repeated with ``repeat_interleave`` and the
attention left to ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask)``. Upstream the Transformer computes
freqs_cis once and hands it in; here it is computed in forward for the positions (input_pos, or 0..T-1), in the
input's dtype. ``forward(x, mask=None, input_pos=None)``: mask bool (1, 1, T, S), True = may attend (gpt-fast
slices it from its tril buffer).

Mistake: none.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

EXPECTED = "pass"
TARGET = "Attention"
STYLE = "gptfast"
CALL = "forward(x, mask=None, input_pos=None): x (B,T,dim); mask bool (1,1,T,S) True = attend, handed to F.scaled_dot_product_attention; fused wqkv split [dim, kv_size, kv_size]; rotary on q and k by adjacent pairs; K/V heads by repeat_interleave"


@dataclass
class ModelArgs:
    dim: int = 4096
    n_head: int = 32
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        self.head_dim = self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.bfloat16):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


def precompute_freqs_cis(positions: Tensor, n_elem: int, base: float = 10000, dtype=torch.float32) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2, device=positions.device)[: (n_elem // 2)].to(dtype) / n_elem))
    freqs = torch.outer(positions.to(dtype), freqs)  # (T, D // 2)
    return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1)  # (T, D // 2, 2)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.reshape(*x.shape[:-1], -1, 2)  # (B, T, H, D // 2, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        assert config.dim % config.n_head == 0

        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        # key, query, value projections for all heads, but in a batch
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None

        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim
        self.rope_base = config.rope_base

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, input_pos: Optional[Tensor] = None) -> Tensor:
        bsz, seqlen, _ = x.shape

        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        if input_pos is None:
            input_pos = torch.arange(seqlen, device=x.device)
        freqs_cis = precompute_freqs_cis(input_pos, self.head_dim, self.rope_base, dtype=x.dtype)
        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)

        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))

        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)

        y = self.wo(y)
        return y
