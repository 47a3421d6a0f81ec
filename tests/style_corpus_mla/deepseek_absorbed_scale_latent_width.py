"""Multi-head latent attention written the way DeepSeek-V3's inference/model.py writes it (the absorbed form).

Style: ``MLA(dim, n_heads, ...)`` with DeepSeek's names: wq (or wq_a -> q_norm -> wq_b when q_lora_rank > 0),
wkv_a (E -> C + R), kv_norm (RMSNorm on the latent), wkv_b (C -> H*(N + Dv)), wo. ``forward(x, start_pos,
freqs_cis, mask)``: freqs_cis is complex (T, R/2), the rotary channels come in adjacent pairs; mask is additive
(T, T), -inf above the diagonal, built by the caller (None: no mask). W_UK is folded into the queries
(einsum over wkv_b's first N rows per head), the scores are read against the normalised latents and the shared
rotary key, and W_UV is applied after attention. The latent cache of the original is left out (start_pos must be
0: each call attends to its own tokens). kv_lora_rank (32) is twice qk_nope_head_dim (16); DeepSeek-V3's is four
times (512 and 128).
The rotation and the softmax keep the input's dtype when it is wider than float32.

Mistake: the scores are scaled by 1/sqrt(kv_lora_rank + qk_rope_head_dim), the width of the absorbed query,
instead of 1/sqrt(qk_nope_head_dim + qk_rope_head_dim).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "mla_scale_latent_width"
TARGET = "MLA"
STYLE = "deepseek_mla"
CALL = "forward(x, start_pos, freqs_cis, mask): complex freqs_cis (T, R/2) and an additive (T, T) mask"


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


def apply_rotary_emb(x, freqs_cis):
    dtype = x.dtype
    x = torch.view_as_complex(x.to(torch.promote_types(dtype, torch.float32)).view(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
    y = torch.view_as_real(x * freqs_cis).flatten(3)
    return y.to(dtype)


class MLA(nn.Module):
    def __init__(
        self, dim, n_heads, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=4, v_head_dim=8
    ):
        super().__init__()
        self.dim = dim
        self.n_heads = n_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim

        if self.q_lora_rank == 0:
            self.wq = nn.Linear(self.dim, self.n_heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(self.dim, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(self.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, self.dim, bias=False)
        self.softmax_scale = (self.kv_lora_rank + self.qk_rope_head_dim) ** -0.5

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.size()
        assert start_pos == 0, "this copy keeps no cache"
        if self.q_lora_rank == 0:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, self.n_heads, self.qk_head_dim)  # (B, T, H, N+R)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv = self.wkv_a(x)  # (B, T, C+R)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis)  # (B, T, 1, R): one for all heads

        wkv_b = self.wkv_b.weight.view(self.n_heads, -1, self.kv_lora_rank)  # (H, N+Dv, C)
        q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : self.qk_nope_head_dim])  # (B, T, H, C)
        kv = self.kv_norm(kv)  # (B, T, C)
        k_pe = k_pe.squeeze(2)  # (B, T, R)
        scores = (
            torch.einsum("bshc,btc->bsht", q_nope, kv) + torch.einsum("bshr,btr->bsht", q_pe, k_pe)
        ) * self.softmax_scale  # (B, T, H, T)
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.promote_types(x.dtype, torch.float32)).type_as(x)
        x = torch.einsum("bsht,btc->bshc", scores, kv)  # (B, T, H, C)
        x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -self.v_head_dim :])  # (B, T, H, Dv)
        x = self.wo(x.flatten(2))
        return x
