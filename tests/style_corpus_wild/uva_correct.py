"""Multi-head attention written the way the UvA deep learning tutorials (phlippe/uvadlc_notebooks, tutorial 6) write it.

Style: ``MultiheadAttention(input_dim, embed_dim, num_heads)``; one ``qkv_proj`` Linear(input_dim, 3 * embed_dim)
whose output is laid out per head: reshaped to (B, T, H, 3 * head_dim), permuted to (B, H, T, 3 * head_dim) and
chunked into q, k, v (so each head's q, k and v rows sit next to each other in the weight); o_proj maps
embed_dim to embed_dim. A free function ``scaled_dot_product(q, k, v, mask)`` fills ``mask == 0`` with -9e15.
``forward(x, mask=None, return_attention=False)``: mask is 0/1 (or bool), 1 = keep, (T, T), (B, T, T) or 4-d,
broadcast to 4-d by ``expand_mask``.

Mistake: none.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "pass"
TARGET = "MultiheadAttention"
STYLE = "uva"
CALL = "forward(x, mask=None, return_attention=False): x (B,T,input_dim), output (B,T,embed_dim); mask 0/1 keep (T,T)/(B,T,T)/(B,1,T,T), filled -9e15; qkv_proj laid out per head (B,T,H,3*D)"


def scaled_dot_product(q, k, v, mask=None):
    d_k = q.size()[-1]
    attn_logits = torch.matmul(q, k.transpose(-2, -1))
    attn_logits = attn_logits / math.sqrt(d_k)
    if mask is not None:
        attn_logits = attn_logits.masked_fill(mask == 0, -9e15)
    attention = F.softmax(attn_logits, dim=-1)
    values = torch.matmul(attention, v)
    return values, attention


def expand_mask(mask):
    assert mask.ndim >= 2, "Mask must be at least 2-dimensional with seq_length x seq_length"
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    return mask


class MultiheadAttention(nn.Module):
    def __init__(self, input_dim, embed_dim, num_heads):
        super().__init__()
        assert embed_dim % num_heads == 0, "Embedding dimension must be 0 modulo number of heads."

        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads

        # Stack all weight matrices 1...h together for efficiency
        self.qkv_proj = nn.Linear(input_dim, 3 * embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, mask=None, return_attention=False):
        batch_size, seq_length, _ = x.size()
        if mask is not None:
            mask = expand_mask(mask)
        qkv = self.qkv_proj(x)

        # Separate Q, K, V from linear output
        qkv = qkv.reshape(batch_size, seq_length, self.num_heads, 3 * self.head_dim)
        qkv = qkv.permute(0, 2, 1, 3)  # [Batch, Head, SeqLen, Dims]
        q, k, v = qkv.chunk(3, dim=-1)

        # Determine value outputs
        values, attention = scaled_dot_product(q, k, v, mask=mask)
        values = values.permute(0, 2, 1, 3)  # [Batch, SeqLen, Head, Dims]
        values = values.reshape(batch_size, seq_length, self.embed_dim)
        o = self.o_proj(values)

        if return_attention:
            return o, attention
        else:
            return o
