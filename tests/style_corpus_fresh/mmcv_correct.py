"""Multi-head attention written the way OpenMMLab's mmcv (mmcv/cnn/bricks/transformer.py) writes its MultiheadAttention wrapper.

Style: ``MultiheadAttention(embed_dims, num_heads, attn_drop=0.0, proj_drop=0.0, dropout_layer=dict(type='Dropout',
drop_prob=0.0), init_cfg=None, batch_first=False, **kwargs)`` around ``nn.MultiheadAttention``, with an identity
connection: the output is ``identity + dropout(out)``, identity defaulting to the query. ``forward(query, key=None,
value=None, identity=None, query_pos=None, key_pos=None, attn_mask=None, key_padding_mask=None)``: time-first
(num_queries, B, E) unless batch_first; key defaults to the query and value to the key; query_pos is added to the
query (and to the key, when their shapes match and no key_pos is given), never to the value; attn_mask and
key_padding_mask as ``nn.MultiheadAttention`` reads them (bool True = blocked). The registry's
``build_dropout`` is a plain ``nn.Dropout`` here.

Mistake: none.
"""

import warnings

import torch
import torch.nn as nn

EXPECTED = "pass"
TARGET = "MultiheadAttention"
STYLE = "mmcv"
CALL = "forward(query, key=None, value=None, identity=None, query_pos=None, key_pos=None, attn_mask=None, key_padding_mask=None): time-first (T,B,E) (batch_first=False); returns identity + attention output (a residual, identity = query); key_padding_mask (B,S) True = pad"


class MultiheadAttention(nn.Module):
    def __init__(
        self,
        embed_dims,
        num_heads,
        attn_drop=0.0,
        proj_drop=0.0,
        dropout_layer=dict(type="Dropout", drop_prob=0.0),
        init_cfg=None,
        batch_first=False,
        **kwargs,
    ):
        super().__init__()
        if "dropout" in kwargs:
            warnings.warn(
                "The arguments `dropout` in MultiheadAttention has been deprecated, now you can separately "
                "set `attn_drop`(float), proj_drop(float), and `dropout_layer`(dict) ",
                DeprecationWarning,
            )
            attn_drop = kwargs["dropout"]
            dropout_layer["drop_prob"] = kwargs.pop("dropout")

        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.batch_first = batch_first

        self.attn = nn.MultiheadAttention(embed_dims, num_heads, attn_drop, **kwargs)

        self.proj_drop = nn.Dropout(proj_drop)
        self.dropout_layer = nn.Dropout(dropout_layer["drop_prob"]) if dropout_layer else nn.Identity()

    def forward(
        self,
        query,
        key=None,
        value=None,
        identity=None,
        query_pos=None,
        key_pos=None,
        attn_mask=None,
        key_padding_mask=None,
        **kwargs,
    ):
        if key is None:
            key = query
        if value is None:
            value = key
        if identity is None:
            identity = query
        if key_pos is None:
            if query_pos is not None:
                # use query_pos if key_pos is not available
                if query_pos.shape == key.shape:
                    key_pos = query_pos
                else:
                    warnings.warn(f"position encoding of key is missing in {self.__class__.__name__}.")
        if query_pos is not None:
            query = query + query_pos
        if key_pos is not None:
            key = key + key_pos

        # Because the dataflow('key', 'query', 'value') of
        # ``torch.nn.MultiheadAttention`` is (num_query, batch,
        # embed_dims), We should adjust the shape of dataflow from
        # batch_first (batch, num_query, embed_dims) to num_query_first
        # (num_query ,batch, embed_dims), and recover ``attn_output``
        # from num_query_first to batch_first.
        if self.batch_first:
            query = query.transpose(0, 1)
            key = key.transpose(0, 1)
            value = value.transpose(0, 1)

        out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask, key_padding_mask=key_padding_mask)[0]

        if self.batch_first:
            out = out.transpose(0, 1)

        return identity + self.dropout_layer(self.proj_drop(out))
