"""Gated multi-head attention written the way OpenFold (openfold/model/primitives.py: Attention) writes it, as
AlphaFold 2's supplement describes it.

The style: ``Attention(c_q, c_k, c_v, c_hidden, no_heads, gating=True)`` with ``c_hidden`` the size of one head,
bias-free q/k/v projections, a ``Linear`` subclass with AlphaFold's initialisers (the gate's weight zero and its
bias one, the output projection all zero: "final"), heads kept at ``[*, Q, H, C_hidden]`` and moved by a
``permute_final_dims`` helper, the scores scaled after the product, optional additive ``biases`` (a pair bias, a
mask as ``inf * (mask - 1)``), and the output gated per channel by ``sigmoid(linear_g(q_x))`` before
``linear_o``. ``forward(q_x, kv_x, biases=None)``.

Mistake: none
"""

import math
from typing import List, Optional

import torch
import torch.nn as nn

EXPECTED = "pass"
TARGET = "Attention"
STYLE = "openfold"
CALL = "forward(q_x, kv_x, biases=None): biases additive, each broadcast to (B, H, Q, K); output gated by sigmoid(linear_g(q_x))"


def permute_final_dims(tensor: torch.Tensor, inds: List[int]):
    zero_index = -1 * len(inds)
    first_inds = list(range(len(tensor.shape[:zero_index])))
    return tensor.permute(first_inds + [zero_index + i for i in inds])


def flatten_final_dims(t: torch.Tensor, no_dims: int):
    return t.reshape(t.shape[:-no_dims] + (-1,))


class Linear(nn.Linear):
    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, init: str = "default"):
        super(Linear, self).__init__(in_dim, out_dim, bias=bias)
        with torch.no_grad():
            if bias:
                self.bias.fill_(0)
            if init == "glorot":
                nn.init.xavier_uniform_(self.weight, gain=1)
            elif init == "gating":
                self.weight.fill_(0.0)
                if bias:
                    self.bias.fill_(1.0)
            elif init == "final":
                self.weight.fill_(0.0)
            else:
                nn.init.kaiming_normal_(self.weight, nonlinearity="linear")


class Attention(nn.Module):
    def __init__(self, c_q: int, c_k: int, c_v: int, c_hidden: int, no_heads: int, gating: bool = True):
        super(Attention, self).__init__()
        self.c_q = c_q
        self.c_k = c_k
        self.c_v = c_v
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.gating = gating

        self.linear_q = Linear(self.c_q, self.c_hidden * self.no_heads, bias=False, init="glorot")
        self.linear_k = Linear(self.c_k, self.c_hidden * self.no_heads, bias=False, init="glorot")
        self.linear_v = Linear(self.c_v, self.c_hidden * self.no_heads, bias=False, init="glorot")
        self.linear_o = Linear(self.c_hidden * self.no_heads, self.c_q, init="final")
        self.linear_g = None
        if self.gating:
            self.linear_g = Linear(self.c_q, self.c_hidden * self.no_heads, init="gating")
        self.sigmoid = nn.Sigmoid()

    def _prep_qkv(self, q_x: torch.Tensor, kv_x: torch.Tensor):
        q = self.linear_q(q_x)
        k = self.linear_k(kv_x)
        v = self.linear_v(kv_x)

        # [*, Q/K/V, H, C_hidden]
        q = q.view(q.shape[:-1] + (self.no_heads, -1))
        k = k.view(k.shape[:-1] + (self.no_heads, -1))
        v = v.view(v.shape[:-1] + (self.no_heads, -1))

        # [*, H, Q/K/V, C_hidden]
        q = q.transpose(-2, -3)
        k = k.transpose(-2, -3)
        v = v.transpose(-2, -3)
        return q, k, v

    def _wrap_up(self, o: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        if self.linear_g is not None:
            g = self.sigmoid(self.linear_g(q_x))
            # [*, Q, H, C_hidden]
            g = g.view(g.shape[:-1] + (self.no_heads, -1))
            o = o * g
        # [*, Q, H * C_hidden]
        o = flatten_final_dims(o, 2)
        return self.linear_o(o)

    def forward(
        self, q_x: torch.Tensor, kv_x: torch.Tensor, biases: Optional[List[torch.Tensor]] = None
    ) -> torch.Tensor:
        if biases is None:
            biases = []
        q, k, v = self._prep_qkv(q_x, kv_x)

        # [*, H, Q, K]
        a = torch.matmul(q, permute_final_dims(k, (1, 0)))
        a = a / math.sqrt(self.c_hidden)
        for b in biases:
            a = a + b
        a = torch.softmax(a, dim=-1)

        # [*, H, Q, C_hidden]
        o = torch.matmul(a, v)
        # [*, Q, H, C_hidden]
        o = o.transpose(-2, -3)
        return self._wrap_up(o, q_x)
