"""Multi-head attention written the way Andrej Karpathy's 'Let's build GPT' lecture (karpathy/ng-video-lecture gpt.py) writes it (the style: see karpathy_correct.py).

Mistake: none. Repaired twin of karpathy_scale_embed_dim.py: the same code with that one mistake fixed
(k.shape[-1] ** -0.5, the head size).
"""

import torch
import torch.nn as nn
from torch.nn import functional as F

EXPECTED = "pass"
TARGET = "MultiHeadAttention"
STYLE = "karpathy"
CALL = "forward(x): x (B,T,n_embd) with n_embd a module global (32); always causal by each Head's tril buffer; ModuleList of Head modules (key/query/value per head) concatenated, then proj"

# hyperparameters
n_embd = 32
block_size = 16  # what is the maximum context length for predictions?
dropout = 0.0
# ------------


class Head(nn.Module):
    """one head of self-attention"""

    def __init__(self, head_size):
        super().__init__()
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        # input of size (batch, time-step, channels)
        # output of size (batch, time-step, head size)
        B, T, C = x.shape
        k = self.key(x)  # (B,T,hs)
        q = self.query(x)  # (B,T,hs)
        # compute attention scores ("affinities")
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
        wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))  # (B, T, T)
        wei = F.softmax(wei, dim=-1)  # (B, T, T)
        wei = self.dropout(wei)
        # perform the weighted aggregation of the values
        v = self.value(x)  # (B,T,hs)
        out = wei @ v  # (B, T, T) @ (B, T, hs) -> (B, T, hs)
        return out


class MultiHeadAttention(nn.Module):
    """multiple heads of self-attention in parallel"""

    def __init__(self, num_heads, head_size):
        super().__init__()
        self.heads = nn.ModuleList([Head(head_size) for _ in range(num_heads)])
        self.proj = nn.Linear(head_size * num_heads, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        out = torch.cat([h(x) for h in self.heads], dim=-1)
        out = self.dropout(self.proj(out))
        return out
