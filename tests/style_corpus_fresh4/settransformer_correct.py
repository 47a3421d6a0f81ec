"""Multihead attention block with the heads folded into the batch by split and cat, written the way the Set Transformer (juho-lee/set_transformer, modules.py) writes it.

Style: ``MAB(dim_Q, dim_K, dim_V, num_heads, ln=False)``: widths named by their role, no ``embed_dim``. ``fc_q``
projects the queries Q, ``fc_k`` and ``fc_v`` project the same set K into keys and values. The heads are folded
into the batch axis with ``torch.cat(X.split(dim_split, 2), 0)`` ((B, N, dim_V) -> (H * B, N, dim_V / H), head
major), the scores are ``Q_.bmm(K_.transpose(1, 2))`` divided by the root of the width, softmax over the keys
(``dim=2``), ``A.bmm(V_)``, and the heads are unfolded with ``torch.cat(O.split(Q.size(0), 0), 2)``. This module
keeps the attention part of the block (the source adds the projected queries back and a row-wise feed-forward
around it; here ``fc_o`` is the output projection) and scales by the per-head width. ``forward(Q, K)``.

Mistake: none.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

EXPECTED = "pass"
TARGET = "MAB"
STYLE = "settransformer"
CALL = "forward(Q, K): queries Q attend to the set K (keys and values both from K); no mask"


class MAB(nn.Module):
    def __init__(self, dim_Q, dim_K, dim_V, num_heads, ln=False):
        super(MAB, self).__init__()
        self.dim_V = dim_V
        self.num_heads = num_heads
        self.fc_q = nn.Linear(dim_Q, dim_V)
        self.fc_k = nn.Linear(dim_K, dim_V)
        self.fc_v = nn.Linear(dim_K, dim_V)
        if ln:
            self.ln0 = nn.LayerNorm(dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)

    def forward(self, Q, K):
        Q = self.fc_q(Q)
        K, V = self.fc_k(K), self.fc_v(K)

        dim_split = self.dim_V // self.num_heads
        Q_ = torch.cat(Q.split(dim_split, 2), 0)
        K_ = torch.cat(K.split(dim_split, 2), 0)
        V_ = torch.cat(V.split(dim_split, 2), 0)

        A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(dim_split), 2)
        O = torch.cat(A.bmm(V_).split(Q.size(0), 0), 2)
        O = O if getattr(self, "ln0", None) is None else self.ln0(O)
        O = self.fc_o(O)
        return O
