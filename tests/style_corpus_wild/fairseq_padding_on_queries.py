"""Multi-head attention written the way fairseq's fairseq/modules/multihead_attention.py writes it (the style: see fairseq_correct.py).

Mistake: key_padding_mask is unsqueezed to (B, 1, S, 1) instead of (B, 1, 1, S): it blocks the padded
queries' whole rows (which become NaN) instead of the padded keys.
Line: key_padding_mask.unsqueeze(1).unsqueeze(3).to(torch.bool)
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EXPECTED = "padding_on_queries"
TARGET = "MultiheadAttention"
STYLE = "fairseq"
CALL = "forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None): time-first (T,B,E); key_padding_mask (B,S) True = pad; attn_mask additive float (T,S), -inf = blocked; heads folded into (B*H); returns (output, head-averaged weights)"


class MultiheadAttention(nn.Module):
    """Multi-headed attention over time-first inputs: query (T, B, E), key and value (S, B, E)."""

    def __init__(
        self,
        embed_dim,
        num_heads,
        kdim=None,
        vdim=None,
        dropout=0.0,
        bias=True,
        self_attention=False,
        encoder_decoder_attention=False,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.dropout_p = dropout
        self.head_dim = embed_dim // num_heads
        assert self.head_dim * num_heads == embed_dim, "embed_dim must be divisible by num_heads"
        self.scaling = self.head_dim**-0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention

        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def forward(
        self,
        query: Tensor,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
    ):
        tgt_len, bsz, embed_dim = query.size()
        if self.self_attention:
            q = self.q_proj(query)
            k = self.k_proj(query)
            v = self.v_proj(query)
        elif self.encoder_decoder_attention:
            q = self.q_proj(query)
            k = self.k_proj(key)
            v = self.v_proj(key)
        else:
            q = self.q_proj(query)
            k = self.k_proj(key)
            v = self.v_proj(value)
        q *= self.scaling

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)  # (B*H, T, D)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)  # (B*H, S, D)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)  # (B*H, S, D)
        src_len = k.size(1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))  # (B*H, T, S)

        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)  # (1, T, S), additive
            attn_weights += attn_mask

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(3).to(torch.bool), float("-inf")
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights_float = F.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = F.dropout(attn_weights, p=self.dropout_p, training=self.training)

        attn = torch.bmm(attn_probs, v)  # (B*H, T, D)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)  # (T, B, E)
        attn = self.out_proj(attn)

        weights = None
        if need_weights:
            weights = attn_weights_float.view(bsz, self.num_heads, tgt_len, src_len).transpose(1, 0).mean(dim=0)
        return attn, weights
