"""Multi-head latent attention written from the paper's equations, one matrix a symbol, as blog posts write it.

Style: ``LatentAttention(d_model, n_heads, ...)`` with separate projections named after DeepSeek-V2's symbols:
W_Q (E -> H*(N + R)), W_DKV (E -> C), W_KR (E -> R, the shared rotary key), W_UK (C -> H*N), W_UV (C -> H*Dv),
W_O, and kv_norm (nn.RMSNorm over the latent). ``forward(x)`` only: the module computes its own rotary angles
from ``rope_theta`` for positions 0..T-1, half-split layout (channel c with c + R/2), and is always causal
(SDPA with is_causal=True).

Mistake: the rotary angles are applied to the latent too (the first R channels of c_KV rotated before W_UK
and W_UV): positions leak into the compressed keys and values, which the decoupled rotary key exists to avoid.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "mla_rope_on_latent"
TARGET = "LatentAttention"
STYLE = "scratch_mla"
CALL = "forward(x): its own rotary angles, always causal"


def rotate(x, theta):
    """x (B, heads, T, R), half-split pairs, rotated by position."""
    R = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, R, 2, dtype=x.dtype, device=x.device) / R)  # (R/2,)
    angles = torch.arange(x.shape[-2], dtype=x.dtype, device=x.device)[:, None] * inv_freq  # (T, R/2)
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., : R // 2], x[..., R // 2 :]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, d_model, n_heads, d_latent=16, d_nope=8, d_rope=4, d_value=8, rope_theta=10000.0):
        super().__init__()
        self.n_heads, self.d_nope, self.d_rope, self.d_value = n_heads, d_nope, d_rope, d_value
        self.rope_theta = rope_theta
        self.W_Q = nn.Linear(d_model, n_heads * (d_nope + d_rope), bias=False)
        self.W_DKV = nn.Linear(d_model, d_latent, bias=False)
        self.W_KR = nn.Linear(d_model, d_rope, bias=False)
        self.kv_norm = nn.RMSNorm(d_latent, eps=1e-6)
        self.W_UK = nn.Linear(d_latent, n_heads * d_nope, bias=False)
        self.W_UV = nn.Linear(d_latent, n_heads * d_value, bias=False)
        self.W_O = nn.Linear(n_heads * d_value, d_model, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        H = self.n_heads
        q = self.W_Q(x).view(B, T, H, self.d_nope + self.d_rope).transpose(1, 2)  # (B, H, T, N+R)
        q_c, q_r = q.split([self.d_nope, self.d_rope], dim=-1)
        q_r = rotate(q_r, self.rope_theta)
        c_kv = self.kv_norm(self.W_DKV(x))  # (B, T, C)
        c_kv = torch.cat((rotate(c_kv[:, None, :, : self.d_rope], self.rope_theta)[:, 0], c_kv[..., self.d_rope :]), -1)
        k_c = self.W_UK(c_kv).view(B, T, H, self.d_nope).transpose(1, 2)  # (B, H, T, N)
        v = self.W_UV(c_kv).view(B, T, H, self.d_value).transpose(1, 2)  # (B, H, T, Dv)
        k_r = rotate(self.W_KR(x)[:, None], self.rope_theta).expand(B, H, T, self.d_rope)  # (B, H, T, R)
        q = torch.cat((q_c, q_r), dim=-1)
        k = torch.cat((k_c, k_r), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(N+R) from q's width
        return self.W_O(out.transpose(1, 2).reshape(B, T, H * self.d_value))
