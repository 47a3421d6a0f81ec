"""Multi-headed attention written the way ESPnet's espnet/nets/pytorch_backend/transformer/attention.py writes it (the style: see espnet_correct.py).

Mistake: the scores are divided by sqrt(k.size(-2)), the key sequence length, instead of sqrt(d_k).
Line: scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(k.size(-2))
"""

import math

import torch
from torch import nn

EXPECTED = "scale_by_length"
TARGET = "MultiHeadedAttention"
STYLE = "espnet"
CALL = "forward(query, key, value, mask): mask positional, None or (B,1,T2)/(B,T1,T2) 1/True = keep (bool or 0/1 float); fill finfo.min, weights re-zeroed after softmax"


class MultiHeadedAttention(nn.Module):
    """Multi-Head Attention layer.

    :param int n_head: the number of heads
    :param int n_feat: the number of features
    :param float dropout_rate: dropout rate
    """

    def __init__(self, n_head, n_feat, dropout_rate):
        super(MultiHeadedAttention, self).__init__()
        assert n_feat % n_head == 0
        # We assume d_v always equals d_k
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        """query (batch, time1, size), key/value (batch, time2, size) -> q (batch, head, time1, d_k), k/v (batch, head, time2, d_k)."""
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        q = q.transpose(1, 2)  # (batch, head, time1, d_k)
        k = k.transpose(1, 2)  # (batch, head, time2, d_k)
        v = v.transpose(1, 2)  # (batch, head, time2, d_k)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        """value (batch, head, time2, d_k), scores (batch, head, time1, time2), mask (batch, 1|time1, time2)."""
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)  # (batch, head, time1, time2)
        else:
            self.attn = torch.softmax(scores, dim=-1)  # (batch, head, time1, time2)

        p_attn = self.dropout(self.attn)
        x = torch.matmul(p_attn, value)  # (batch, head, time1, d_k)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)  # (batch, time1, d_model)
        return self.linear_out(x)  # (batch, time1, d_model)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(k.size(-2))
        return self.forward_attention(v, scores, mask)
