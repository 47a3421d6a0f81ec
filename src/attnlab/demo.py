"""``attnlab demo``: the seed-000 test case (batch 2, seq 10, dim 64, heads 8), run for real."""

from __future__ import annotations

import torch

from .attention import MultiHeadAttention
from .trace import trace


def demo(batch: int = 2, seq_len: int = 10, embed_dim: int = 64, num_heads: int = 8, seed: int = 0) -> int:
    """Run the seed-000 case through attnlab.MultiHeadAttention and report shapes and backend.

    Args:
        batch: B.
        seq_len: T.
        embed_dim: E (model_dim in the seed).
        num_heads: H.
        seed: torch.manual_seed for the random input and weights.
    """
    torch.manual_seed(seed)
    x = torch.randn(batch, seq_len, embed_dim)
    mha = MultiHeadAttention(embed_dim, num_heads).eval()
    out = mha(x, x)  # seed 000: mha(x, x) is self-attention
    print(f"input  x: {list(x.shape)}  (batch, seq, model_dim)")
    print(f"output  : {list(out.shape)}  (batch, seq, model_dim), head_dim = {mha.head_dim}")
    print(f"backend : {mha.last_backend}" + (f" ({mha.last_backend_reason})" if mha.last_backend_reason else ""))
    _, weights = mha(x, need_weights=True)
    print(f"weights : {list(weights.shape)}  (batch, heads, query, key) via backend "
          f"{mha.last_backend!r}: {mha.last_backend_reason}")
    print("\nEvery stage of the same call on the math backend, shapes read off the real tensors:\n")
    mha.backend = "math"
    with trace(mha) as calls:
        mha(x, x)
    print(calls[0].to_text())
    return 0
