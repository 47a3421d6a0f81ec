"""Causal self-attention written the way nanoGPT's model.py writes it, flash path only.

Style: ``CausalSelfAttention(config)`` reads config.n_embd, config.n_head, config.dropout and config.bias (the file
defines no config: the caller's GPTConfig supplies them). One fused ``c_attn`` projects to q, k, v, cut apart with
``.split(n_embd, dim=2)``; ``c_proj`` is the output projection. forward(x) takes no mask: attention is always
causal, through F.scaled_dot_product_attention(is_causal=True).

Mistake: the fused projection is unpacked as k, q, v: the first third of c_attn (the query weights of a
GPT-2 checkpoint) becomes the keys and the second the queries.
Line: k, q, v = self.c_attn(x).split(self.n_embd, dim=2)
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "qkv_split_order"
TARGET = "CausalSelfAttention"
STYLE = "nanogpt"
CALL = "forward(x): x (B,T,n_embd), no mask argument, always causal (query i sees keys j <= i)"


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # q, k and v for every head in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # back to the residual stream
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x):
        B, T, C = x.size()  # batch, sequence length, embedding width (n_embd)

        k, q, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # fused kernel: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T), masked, softmaxed, times v
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again: (B, T, C)

        y = self.resid_dropout(self.c_proj(y))
        return y
