"""Multi-head attention written the way flash-attention's flash_attn/modules/mha.py writes its MHA and the plain-PyTorch SelfAttention it falls back to (the style: see flashattn_correct.py).

Mistake: the additive padding row is opened where the mask is False: ``masked_fill_(~key_padding_mask, 0.0)``
keeps the padded keys and blocks the real ones.
Line: padding_mask.masked_fill_(~key_padding_mask, 0.0)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "padding_inverted"
TARGET = "MHA"
STYLE = "flashattn"
CALL = "forward(x, key_padding_mask=None): x (B,T,E); key_padding_mask (B,S) bool True = keep, made additive -10000.0; packed Wqkv viewed (B,T,3,H,D); einsum bthd,bshd->bhts; causal=False by default"


class SelfAttention(nn.Module):
    """Implement the scaled dot product attention with softmax.

    softmax_scale: The temperature to use for the softmax attention (default: 1/sqrt(d_keys)).
    attention_dropout: The dropout rate to apply to the attention (default: 0.0).
    """

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        """qkv (B, S, 3, H, D); key_padding_mask (B, S) bool, True = keep. Returns (B, S, H, D)."""
        batch_size, seqlen = qkv.shape[0], qkv.shape[1]
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(dim=2)
        softmax_scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * softmax_scale)
        if key_padding_mask is not None:
            padding_mask = torch.full((batch_size, seqlen), -10000.0, dtype=scores.dtype, device=scores.device)
            padding_mask.masked_fill_(~key_padding_mask, 0.0)
            scores = scores + padding_mask[:, None, None, :]  # 'b s -> b 1 1 s'
        if causal:
            causal_mask = torch.triu(torch.full((seqlen, seqlen), -10000.0, device=scores.device), 1)
            scores = scores + causal_mask.to(dtype=scores.dtype)
        attention = torch.softmax(scores, dim=-1, dtype=v.dtype)
        attention_drop = self.drop(attention)
        output = torch.einsum("bhts,bshd->bthd", attention_drop, v)
        return output


class MHA(nn.Module):
    """Multi-head self-attention."""

    def __init__(
        self,
        embed_dim,
        num_heads,
        causal=False,
        softmax_scale=None,
        dropout=0.0,
        qkv_proj_bias=True,
        out_proj_bias=True,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.causal = causal
        self.num_heads = num_heads
        assert self.embed_dim % num_heads == 0, "embed_dim must be divisible by num_heads"
        self.head_dim = self.embed_dim // num_heads
        qkv_dim = self.head_dim * 3 * num_heads

        self.Wqkv = nn.Linear(embed_dim, qkv_dim, bias=qkv_proj_bias)
        self.inner_attn = SelfAttention(causal=causal, softmax_scale=softmax_scale, attention_dropout=dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias)

    def forward(self, x, key_padding_mask=None):
        """x (B, S, E); key_padding_mask (B, S) bool, True = keep. Returns (B, S, E)."""
        qkv = self.Wqkv(x)
        qkv = qkv.unflatten(-1, (3, self.num_heads, self.head_dim))  # '... (three h d) -> ... three h d'
        context = self.inner_attn(qkv, key_padding_mask=key_padding_mask)  # (B, S, H, D)
        out = self.out_proj(context.flatten(-2))  # '... h d -> ... (h d)'
        return out
