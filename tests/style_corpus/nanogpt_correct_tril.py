"""Causal self-attention written the way nanoGPT's model.py writes it, slow (manual) path only.

Style: ``CausalSelfAttention(config)`` reads config.n_embd, config.n_head, config.dropout, config.bias and
config.block_size (the file defines no config: the caller's GPTConfig supplies them). One fused ``c_attn`` projects
to q, k, v, cut apart with ``.split(n_embd, dim=2)``; the causal mask is a lower-triangular buffer named ``bias``
of side block_size, sliced to T. forward(x) takes no mask: attention is always causal.

Mistake: none.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "pass"
TARGET = "CausalSelfAttention"
STYLE = "nanogpt"
CALL = "forward(x): x (B,T,n_embd) with T <= block_size, no mask argument, always causal (query i sees keys j <= i)"


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
        # 1 where query i may see key j (j <= i); "bias" is the name the GPT-2 checkpoints use
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(config.block_size, config.block_size)).view(
                1, 1, config.block_size, config.block_size
            ),
        )

    def forward(self, x):
        B, T, C = x.size()  # batch, sequence length, embedding width (n_embd)

        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again: (B, T, C)

        y = self.resid_dropout(self.c_proj(y))
        return y
