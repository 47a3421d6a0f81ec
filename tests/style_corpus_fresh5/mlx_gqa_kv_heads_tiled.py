"""Grouped-query self-attention written the way Apple's mlx-lm (mlx_lm/models/llama.py) writes it, ported to torch (the style: see mlx_correct.py).

Mistake: the K/V heads are repeated with ``repeat(1, rep, 1, 1)`` (g0 g1 g0 g1), not ``repeat_interleave`` (g0 g0 g1 g1).
Line: keys = keys.repeat(1, rep, 1, 1)
"""

from dataclasses import dataclass

import torch
from torch import nn

EXPECTED = "gqa_kv_heads_tiled"
TARGET = "Attention"
STYLE = "mlx"
CALL = "forward(x, mask=None): mask additive, broadcast to (B,H,L,L); G = n_kv_heads"


@dataclass
class ModelArgs:
    dim: int = 512
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int | None = None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.dim
        self.n_heads = n_heads = args.n_heads
        self.n_kv_heads = n_kv_heads = args.n_kv_heads
        self.head_dim = head_dim = args.head_dim or args.dim // n_heads
        self.scale = head_dim**-0.5
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, mask=None):
        B, L, D = x.shape
        queries, keys, values = self.wq(x), self.wk(x), self.wv(x)
        queries = queries.reshape(B, L, self.n_heads, -1).permute(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).permute(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).permute(0, 2, 1, 3)
        rep = self.n_heads // self.n_kv_heads
        keys = keys.repeat(1, rep, 1, 1)
        values = values.repeat(1, rep, 1, 1)
        scores = (queries * self.scale) @ keys.transpose(-1, -2)
        if mask is not None:
            scores = scores + mask
        scores = torch.softmax(scores.float(), dim=-1).type(scores.dtype)
        output = (scores @ values).permute(0, 2, 1, 3).reshape(B, L, -1)
        return self.wo(output)
