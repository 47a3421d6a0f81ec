"""Grouped-query attention with rotary embeddings, written the way the Mistral reference (mistral-src one_file_ref.py) writes it (the style: see mistral_correct.py).

Mistake: repeat_kv tiles the K/V heads (kv0 kv1 kv0 kv1) with ``repeat`` instead of repeating each one in
place (kv0 kv0 kv1 kv1): query heads meet another group's keys and values.
Line: keys = keys.repeat(1, 1, repeats, 1)
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

EXPECTED = "gqa_kv_heads_tiled"
TARGET = "Attention"
STYLE = "mistral"
CALL = "forward(x, mask=None): x (B,T,dim); mask additive float (T,T), 0 keep / -inf blocked, built by the caller; rotary (interleaved pairs, theta=rope_theta) applied inside to q and k; GQA by repeat_interleave"


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 1
    head_dim: int = 8
    hidden_dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    norm_eps: float = 1e-5
    vocab_size: int = 128
    sliding_window: int = 16
    rope_theta: float = 10000.0
    max_batch_size: int = 0


def precompute_freqs_cis(dim: int, end: int, theta: float, dtype=torch.float32) -> torch.Tensor:
    """(end, dim // 2) complex: position t times frequency theta ** (-2i / dim), as a unit complex number."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype)[: (dim // 2)] / dim))
    t = torch.arange(end, dtype=dtype)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """xq (B, T, H, D), xk (B, T, G, D); freqs_cis (T, D // 2). Rotates each adjacent feature pair."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]  # (T, 1, D // 2)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(keys: torch.Tensor, values: torch.Tensor, repeats: int):
    keys = keys.repeat(1, 1, repeats, 1)
    values = values.repeat(1, 1, repeats, 1)
    return keys, values


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args

        self.n_heads: int = args.n_heads
        self.n_kv_heads: int = args.n_kv_heads
        self.head_dim: int = args.head_dim
        self.repeats = self.n_heads // self.n_kv_heads
        self.scale = self.args.head_dim**-0.5

        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape

        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)

        freqs_cis = precompute_freqs_cis(self.head_dim, seqlen, self.args.rope_theta, dtype=x.dtype)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        key, value = repeat_kv(xk, xv, self.repeats)  # (B, T, H, D)

        query = xq.transpose(1, 2)  # (B, H, T, D)
        key = key.transpose(1, 2)
        value = value.transpose(1, 2)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scale  # (B, H, T, T)

        if mask is not None:
            scores = scores + mask[None, None, ...]

        scores = F.softmax(scores, dim=-1)
        output = torch.matmul(scores, value)  # (B, H, T, D)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)
