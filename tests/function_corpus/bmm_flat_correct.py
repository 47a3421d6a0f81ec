"""Attention over (B*H, T, D) tensors with torch.bmm, its scale a required argument, its names not q, k, v:
the layout and what the fourth argument means are found by calling it.
"""

import torch

EXPECTED = "pass"
TARGET = "attend"
LAYOUT = "flat"
FOUND = "layout (B*H, T, D)"


def attend(x, y, z, s):
    w = torch.softmax(torch.bmm(x, y.transpose(1, 2)) * s, dim=-1)  # (B*H, T_q, T_k)
    return torch.bmm(w, z)  # (B*H, T_q, D)
