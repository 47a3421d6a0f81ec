"""Attention as a custom autograd.Function whose hand-written backward forgets the scale in dq and dk.

Mistake: dS = P * (dP - rowsum(dP * P)), then dq = dS @ k and dk = dS^T @ q without the factor `scale`.
"""

import math

import torch

EXPECTED = "wrong_backward"
TARGET = "attention"
LAYOUT = "BHTD"


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        scale = 1 / math.sqrt(q.size(-1))
        p = torch.softmax(q @ k.transpose(-2, -1) * scale, -1)  # (B, H, T_q, T_k)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, do):
        q, k, v, p = ctx.saved_tensors
        dv = p.transpose(-2, -1) @ do
        dp = do @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        return ds @ k, ds.transpose(-2, -1) @ q, dv  # the mistake: both lack * scale


def attention(q, k, v):
    return _Attention.apply(q, k, v)
