"""Causal self-attention written the way Salesforce's CodeGen (transformers, modeling_codegen.py) writes it (the style: see codegen_correct.py).

Mistake: the softmax runs over ``dim=-2`` (the queries), not over the keys.
Line: w = nn.Softmax(dim=-2)(w).to(value.dtype)
"""

import torch
from torch import nn

EXPECTED = "softmax_query_axis"
TARGET = "CodeGenAttention"
STYLE = "codegen"
CALL = "forward(hidden_states, attention_mask=None): always causal; attention_mask additive (B,1,1,T)"


class CodeGenAttention(nn.Module):
    def __init__(self, embed_dim, num_attention_heads, max_positions=2048, rotary_dim=None):
        super().__init__()
        self.register_buffer(
            "causal_mask",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.embed_dim = embed_dim
        self.num_attention_heads = num_attention_heads
        self.head_dim = self.embed_dim // self.num_attention_heads
        self.scale_attn = torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float32)).to(torch.get_default_dtype())
        self.qkv_proj = nn.Linear(self.embed_dim, self.embed_dim * 3, bias=False)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=False)

    def _split_heads(self, x, n_head, dim_head, mp_num):
        reshaped = x.reshape(x.shape[:-1] + (n_head // mp_num, dim_head))
        reshaped = reshaped.reshape(x.shape[:-2] + (-1,) + reshaped.shape[-1:])
        return reshaped

    def forward(self, hidden_states, attention_mask=None):
        qkv = self.qkv_proj(hidden_states)
        mp_num = 4
        qkv_split = qkv.reshape(qkv.shape[:-1] + (mp_num, -1))
        local_dim = self.head_dim * self.num_attention_heads // mp_num
        query, value, key = torch.split(qkv_split, local_dim, dim=-1)
        query = self._split_heads(query, self.num_attention_heads, self.head_dim, mp_num=mp_num).permute(0, 2, 1, 3)
        key = self._split_heads(key, self.num_attention_heads, self.head_dim, mp_num=mp_num).permute(0, 2, 1, 3)
        value = self._split_heads(value, self.num_attention_heads, self.head_dim, mp_num=mp_num).permute(0, 2, 1, 3)
        q_len, k_len = query.size(-2), key.size(-2)
        causal = self.causal_mask[:, :, k_len - q_len : k_len, :k_len]
        query = query.to(torch.float32)
        key = key.to(torch.float32)
        w = torch.matmul(query, key.transpose(-1, -2))
        w = w / self.scale_attn
        w = torch.where(causal, w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype))
        if attention_mask is not None:
            w = w + attention_mask
        w = nn.Softmax(dim=-2)(w).to(value.dtype)
        out = torch.matmul(w, value)
        out = out.permute(0, 2, 1, 3).contiguous()
        out = out.view(out.size()[:-2] + (self.num_attention_heads * self.head_dim,))
        return self.out_proj(out)
