"""Multi-head attention written the way OpenAI Whisper's whisper/model.py writes it (the style: see whisper_correct.py).

Mistake: none. Repaired twin of whisper_scale_head_dim_not_sqrt.py: the same code with that one mistake fixed
(scale = head_dim ** -0.25 on each of q and k).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EXPECTED = "pass"
TARGET = "MultiHeadAttention"
STYLE = "whisper"
CALL = "forward(x, xa=None, mask=None): x (B,T,n_state); xa = cross-attention input (B,S,n_state); mask additive float (n_ctx,n_ctx) -inf above the diagonal, sliced [:T,:T]; returns (output, qk)"


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x: Tensor, xa: Optional[Tensor] = None, mask: Optional[Tensor] = None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale  # (B, H, T, D)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale  # (B, H, D, S)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)  # (B, H, S, D)

        qk = q @ k  # (B, H, T, S)
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]

        w = F.softmax(qk, dim=-1)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach()
