"""Multi-head attention with 3-D einsum kernels, written the way Keras's ``MultiHeadAttention`` layer (keras/layers/attention/multi_head_attention.py) writes it, ported to torch (the style: see keras_correct.py).

Mistake: none. Repaired twin of keras_softmax_query_axis.py: the same code with that one mistake fixed
(norm_axes = (-1,): the key axis).
"""

import math

import torch
from torch import nn

EXPECTED = "pass"
TARGET = "MultiHeadAttention"
STYLE = "keras"
CALL = "forward(query, value, key=None, attention_mask=None, return_attention_scores=False): key defaults to value; attention_mask (B,T,S) 1 attend / 0 not"


class EinsumDense(nn.Module):
    def __init__(self, equation, kernel_shape, bias_shape=None):
        super().__init__()
        self.equation = equation
        self.kernel = nn.Parameter(torch.empty(kernel_shape))
        nn.init.xavier_uniform_(self.kernel.view(kernel_shape[0], -1) if len(kernel_shape) == 3 else self.kernel)
        self.bias = nn.Parameter(torch.zeros(bias_shape)) if bias_shape is not None else None

    def forward(self, inputs):
        ret = torch.einsum(self.equation, inputs, self.kernel)
        if self.bias is not None:
            ret = ret + self.bias
        return ret


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True, query_dim=None):
        super().__init__()
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim if value_dim else key_dim
        self._dropout = dropout
        self._use_bias = use_bias
        self._query_dim = query_dim if query_dim is not None else num_heads * key_dim
        e = self._query_dim

        def dense(equation, kernel_shape, bias_shape):
            return EinsumDense(equation, kernel_shape, bias_shape if self._use_bias else None)

        self._query_dense = dense("abc,cde->abde", (e, num_heads, self._key_dim), (num_heads, self._key_dim))
        self._key_dense = dense("abc,cde->abde", (e, num_heads, self._key_dim), (num_heads, self._key_dim))
        self._value_dense = dense("abc,cde->abde", (e, num_heads, self._value_dim), (num_heads, self._value_dim))
        self._output_dense = dense("abcd,cde->abe", (num_heads, self._value_dim, e), (e,))
        self._dropout_layer = nn.Dropout(p=dropout)
        self._inverse_sqrt_key_dim = 1.0 / math.sqrt(float(self._key_dim))

    def _masked_softmax(self, attention_scores, attention_mask=None):
        # attention_scores: (B, N, T, S); attention_mask: (B, T, S), 1 = attend
        norm_axes = (-1,)
        if attention_mask is not None:
            mask = attention_mask.unsqueeze(-3).to(attention_scores.dtype)
            attention_scores = attention_scores + (1.0 - mask) * -1e9
        return torch.softmax(attention_scores, dim=norm_axes[0])

    def _compute_attention(self, query, key, value, attention_mask=None):
        query = query * self._inverse_sqrt_key_dim
        attention_scores = torch.einsum("aecd,abcd->acbe", key, query)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        final_attn_scores = self._dropout_layer(attention_scores)
        attention_output = torch.einsum("acbe,aecd->abcd", final_attn_scores, value)
        return attention_output, attention_scores

    def forward(self, query, value, key=None, attention_mask=None, return_attention_scores=False):
        if key is None:
            key = value

        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)

        attention_output, attention_scores = self._compute_attention(query, key, value, attention_mask)
        attention_output = self._output_dense(attention_output)

        if return_attention_scores:
            return attention_output, attention_scores
        return attention_output
