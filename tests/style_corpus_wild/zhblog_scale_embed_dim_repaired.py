"""多头注意力 (multi-head attention) written the way Chinese-language blog tutorials (CSDN / Zhihu 'Transformer 从零实现') write it (the style: see zhblog_correct.py).

Mistake: none. Repaired twin of zhblog_scale_embed_dim.py: the same code with that one mistake fixed
(score / math.sqrt(n_d)).
"""

import math

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "MultiHeadAttention"
STYLE = "zhblog"
CALL = "forward(q, k, v, mask=None): three inputs (B,len,d_model); mask 0/1 keep broadcastable to (B,H,T,S), e.g. (T,S) or (B,1,1,S), filled -10000"


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super(MultiHeadAttention, self).__init__()
        self.n_head = n_head  # 头的个数
        self.d_model = d_model  # 模型维度
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_combine = nn.Linear(d_model, d_model)  # 多头拼接之后的线性层
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v, mask=None):
        batch, time, dimension = q.shape
        n_d = self.d_model // self.n_head  # 每个头的维度
        q, k, v = self.w_q(q), self.w_k(k), self.w_v(v)

        # 拆分多头: (batch, time, d_model) -> (batch, n_head, time, n_d)
        q = q.view(batch, time, self.n_head, n_d).permute(0, 2, 1, 3)
        k = k.view(batch, k.shape[1], self.n_head, n_d).permute(0, 2, 1, 3)
        v = v.view(batch, v.shape[1], self.n_head, n_d).permute(0, 2, 1, 3)

        # 计算注意力分数并缩放
        score = q @ k.transpose(2, 3) / math.sqrt(n_d)
        if mask is not None:
            # mask 中为 0 的位置不允许关注
            score = score.masked_fill(mask == 0, -10000)
        score = self.softmax(score) @ v

        # 合并多头: (batch, n_head, time, n_d) -> (batch, time, d_model)
        score = score.permute(0, 2, 1, 3).contiguous().view(batch, time, dimension)
        output = self.w_combine(score)
        return output
