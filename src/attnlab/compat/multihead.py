"""``MultiheadAttention``: ``torch.nn.MultiheadAttention``'s interface on attnlab's attention.

Notation (torch's own letters in brackets):
    B batch (N), T query positions (L), S key positions, E embed_dim, H num_heads,
    G num_kv_heads (= H unless GQA), D = E // H head dim,
    S' = S + add_bias_kv + add_zero_attn: the key positions attention runs over.

At the edge everything is torch's: seq-first ``(T, B, E)`` unless ``batch_first``, unbatched
``(T, E)`` and NestedTensors ``(B, T_b, E)`` accepted, bool masks True = *blocked*, ``attn_mask``
of shape ``(T, S)`` or ``(B*H, T, S)``. Inside, everything is attnlab's: ``(B, H, T, D)`` and one
bool keep-mask (True = may attend) plus a float bias, converted once per call in
:func:`_attnlab_masks`; nested input is padded once, in :meth:`MultiheadAttention._forward_nested`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ..core.dispatch import attend
from ..core.masks import Masks, prepare_masks
from ..core.validation import Backend, check_backend, check_init_args
from .scripted import (
    ScriptableMultiheadAttention,
    _batch_first_views,
    _check_inputs,
    _check_masks,
    _finish,
    _layout,
    _merge_heads,
    _pad_fix,
    _pick_backend,
    _project,
    _split_heads,
    _torch_masks,
    make_scriptable,
)

__all__ = ["MultiheadAttention"]


class MultiheadAttention(nn.Module):
    r"""``torch.nn.MultiheadAttention``, computed by attnlab: same arguments, parameters, state-dict
    keys, shapes, masks and return value, so it can replace torch's module anywhere, including
    ``nn.TransformerEncoderLayer.self_attn`` and ``nn.TransformerDecoderLayer``'s two attentions.

    Shapes (B batch, T query positions, S key positions, E ``embed_dim``, H ``num_heads``,
    G ``num_kv_heads``, D = E // H, S' = S + 1 per extra key row of ``add_bias_kv`` /
    ``add_zero_attn``; T_b, S_b the lengths of sequence b of a nested tensor, T, S the longest):

    ============================  =====================  =====================  =================  ===================
    argument                      ``batch_first=False``  ``batch_first=True``   unbatched          nested (either)
    ============================  =====================  =====================  =================  ===================
    ``query``                     ``(T, B, E)``          ``(B, T, E)``          ``(T, E)``         ``(B, T_b, E)``
    ``key``                       ``(S, B, kdim)``       ``(B, S, kdim)``       ``(S, kdim)``      ``(B, S_b, kdim)``
    ``value``                     ``(S, B, vdim)``       ``(B, S, vdim)``       ``(S, vdim)``      ``(B, S_b, vdim)``
    ``key_padding_mask``          ``(B, S)``             ``(B, S)``             ``(S,)``           refused
    ``attn_mask``                 ``(T, S)`` or          ``(T, S)`` or          ``(T, S)`` or      refused
                                  ``(B*H, T, S)``        ``(B*H, T, S)``        ``(H, T, S)``
    output                        ``(T, B, E)``          ``(B, T, E)``          ``(T, E)``         ``(B, T_b, E)``
    weights, averaged (default)   ``(B, T, S')``         ``(B, T, S')``         ``(T, S')``        ``(B, T, S')``
    weights, per head             ``(B, H, T, S')``      ``(B, H, T, S')``      ``(H, T, S')``     ``(B, H, T, S')``
    ============================  =====================  =====================  =================  ===================

    Row ``b * H + h`` of a 3-D ``attn_mask`` is batch ``b``, head ``h`` (torch's layout).

    NestedTensors (layout ``torch.strided`` or ``torch.jagged``) are taken for ``query``, ``key`` and
    ``value``, all three or none: ``(B, T_b, E)``, ``(B, S_b, kdim)``, ``(B, S_b, vdim)`` whatever
    ``batch_first`` says (a nested tensor's dim 0 lists its sequences), key and value of the same lengths,
    which may differ from the query's. They are padded once, the key lengths becoming a
    ``key_padding_mask``, so the result is exactly that of the padded call. The output is a NestedTensor
    of the query's layout and lengths (a jagged one shares the query's offsets, so ``query + output``
    works); weights, with ``need_weights=True``, come back padded as torch's fast path returns them,
    ``(B, T, S')`` or ``(B, H, T, S')``, zeros at the padding.
    ``nn.TransformerEncoder`` built around torch's module sends strided nested tensors (eval mode, under
    ``no_grad``, with a ``src_key_padding_mask``, ``need_weights=False``, no masks) to a ``self_attn``
    swapped in afterwards, so the swap needs no ``use_nested_tensor = False``. torch's module takes
    nested input only on its fast path (strided self-attention, ``batch_first``, eval, no grad); this
    one also in training, with autograd (gradients reach the nested inputs), for cross-attention, in
    either ``batch_first`` and with every constructor option. ``key_padding_mask`` and ``attn_mask`` are
    refused with nested input, as torch refuses them (the lengths are the key padding), and so is
    ``is_causal=True``, which torch's fast path silently ignores.

    Masks, with torch's polarity: a bool mask is **True = blocked** (both ``attn_mask`` and
    ``key_padding_mask``); a float mask is added to the scores (``-inf`` blocks). Bool and float
    may be mixed. ``is_causal=True`` is torch's *hint* that ``attn_mask`` is the causal mask: it
    needs ``attn_mask``, and as in torch, when there is no ``key_padding_mask`` and
    ``need_weights=False`` the hint is trusted: ``attn_mask`` is not read and SDPA's causal mask
    (top-left aligned, query i sees key positions j <= i of all S') is used instead; otherwise
    ``attn_mask`` is applied as given.

    Forward returns ``(output, weights)``, ``weights`` None when ``need_weights=False``. With
    ``need_weights=True`` (torch's default) attnlab's math backend runs and materialises the
    weights (after dropout, as torch returns them); with ``need_weights=False`` the ``"auto"``
    backend runs ``F.scaled_dot_product_attention``.

    **The one deliberate difference from torch**: a query whose every key is masked gets a
    context of zeros, so its output is exactly ``out_proj.bias`` and its weights are zeros, with
    finite gradients, on every path. ``torch.nn.MultiheadAttention`` returns NaN there with
    ``need_weights=True`` (its default), and with ``need_weights=False`` NaN or zeros as the SDPA
    kernel decides (pytorch issues 41508, 152028); a NaN then spreads through any later layer.

    Differences from attnlab's own ``attnlab.MultiHeadAttention``, which this is not a subclass
    of: that module (1) returns a tensor, not an ``(output, weights)`` tuple; (2) is always
    batch-first, ``(B, T, E)``; (3) reads a bool ``attn_mask`` as **True = may attend** (SDPA's
    polarity), the opposite of this one.

    Args:
        embed_dim: E, width of ``query`` and of the output.
        num_heads: H; must divide ``embed_dim``.
        dropout: dropout probability on the attention weights, in training mode only.
        bias: biases on the input projections (``in_proj_bias``) and on ``out_proj``.
        add_bias_kv: append a learned key row ``bias_k`` and value row ``bias_v``, each
            ``(1, 1, G*D)``, to every sequence's keys and values (always attendable).
        add_zero_attn: append an all-zero key and value row (always attendable).
        kdim, vdim: widths of ``key`` and ``value``. Default: ``embed_dim``.
        batch_first: inputs and output are ``(B, T, E)`` instead of ``(T, B, E)``.
        device, dtype: of the parameters.
        num_kv_heads: G, keyword-only: grouped-query attention (1 is MQA); must divide
            ``num_heads``; query head h reads K/V head ``h // (H // G)``. Default ``num_heads``.
        backend: keyword-only, ``"auto"`` (SDPA unless weights are needed), ``"math"`` (always
            attnlab's reference) or ``"sdpa"`` (refuses ``need_weights=True``). May be changed
            later; after each call ``last_backend`` says which one ran.

    Parameters, as torch names and initialises them (so the two load each other's state dicts):
        * ``kdim == vdim == embed_dim`` and no GQA: ``in_proj_weight (3E, E)`` (Q rows, K rows,
          V rows), Xavier-uniform over the whole packed matrix.
        * otherwise ``q_proj_weight (E, E)``, ``k_proj_weight (G*D, kdim)``,
          ``v_proj_weight (G*D, vdim)``, each Xavier-uniform; ``in_proj_weight`` is None.
          GQA always takes this layout: torch's packed ``(3E, E)`` matrix cannot hold K/V
          projections of ``G*D < E`` rows, and loading a packed state dict into a GQA module
          fails with an error that says so.
        * ``in_proj_bias (E + 2*G*D,)`` (``3E`` without GQA), ``out_proj`` an ``(E, E)`` Linear,
          biases zero; ``bias_k``, ``bias_v`` ``(1, 1, G*D)`` Xavier-normal.

    ``_qkv_same_embed_dim``, torch's private layout flag, is always False here, on purpose:
    torch's encoder layers read it to decide whether they may skip ``self_attn.forward`` and
    call a fused kernel on its weights (see the property). Test the layout with
    ``mha.in_proj_weight is not None`` instead.
    """

    in_proj_weight: Tensor | None
    q_proj_weight: Tensor | None
    k_proj_weight: Tensor | None
    v_proj_weight: Tensor | None
    in_proj_bias: Tensor | None
    bias_k: Tensor | None
    bias_v: Tensor | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        num_kv_heads: int | None = None,
        backend: Backend = "auto",
    ) -> None:
        super().__init__()
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_init_args(embed_dim, num_heads, num_kv_heads, kdim, vdim, dropout, None, backend)
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim  # E
        self.kdim, self.vdim = kdim, vdim
        self.num_heads = num_heads  # H
        self.num_kv_heads = num_kv_heads  # G
        self.head_dim = embed_dim // num_heads  # D
        self.kv_dim = num_kv_heads * self.head_dim  # G*D: rows of the K and of the V projection
        self.dropout = dropout
        self.batch_first = batch_first
        self.backend = backend
        self.last_backend: str | None = None

        # Parameters are created in torch's order, with torch's shapes, so that state dicts,
        # `parameters()` order (optimizer state) and, under one seed, the initial values all match.
        if kdim == embed_dim and vdim == embed_dim and num_kv_heads == num_heads:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((self.kv_dim, kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((self.kv_dim, vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * self.kv_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        # torch's class for it (a Linear that dynamic quantization leaves alone); it draws its
        # default init from the RNG here, exactly where torch's does.
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, self.kv_dim), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, self.kv_dim), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch's init, in torch's order: Xavier-uniform projections, zero biases, Xavier-normal bias_k/v."""
        if self.in_proj_weight is not None:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                assert w is not None
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None and self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    @property
    def _qkv_same_embed_dim(self) -> bool:
        """Always False, deliberately, so that torch never bypasses this module's forward.

        In eval mode under ``no_grad``, ``nn.TransformerEncoderLayer.forward`` takes a "fast path"
        when its ``self_attn`` looks like torch's packed module: it reads ``in_proj_weight`` and
        friends and calls ``torch._transformer_encoder_layer_fwd`` itself, never calling
        ``self_attn``. It is gated on this flag (``"self_attn._qkv_same_embed_dim was not True"``),
        checked on every call, the one check that reads a property of the module alone without
        changing what it computes. Failing it keeps attnlab's code, and its zeros for fully masked
        rows, on every call. ``nn.TransformerEncoder`` reads the flag once, when it is built, to
        decide whether to pass nested tensors to its layers: built around this module it never does;
        built around torch's and swapped afterwards it does, and ``forward`` takes them.
        """
        return False

    @property
    def backend(self) -> str:
        """``"auto"``, ``"math"`` or ``"sdpa"``; may be changed between calls."""
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        check_backend(value)
        self._backend = value

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.bias_k is not None:
            s += ", add_bias_kv=True"
        if self.add_zero_attn:
            s += ", add_zero_attn=True"
        return s + f", dropout={self.dropout}, batch_first={self.batch_first}, backend={self.backend!r}"

    def __prepare_scriptable__(self) -> ScriptableMultiheadAttention:
        """What ``torch.jit.script`` compiles for this module (it calls this first, on every submodule):
        a twin sharing its parameters, written in the TorchScript subset, warning what it does not do
        (:data:`attnlab.compat.scripted.SCRIPT_WARNING`). See :mod:`attnlab.compat.scripted`."""
        return make_scriptable(self)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # torch alone would report missing and unexpected keys; say which layout was expected and why.
        packed_in_sd = prefix + "in_proj_weight" in state_dict
        separate_in_sd = prefix + "q_proj_weight" in state_dict
        if self.in_proj_weight is None and packed_in_sd:
            why = (
                f"num_kv_heads={self.num_kv_heads} differs from num_heads={self.num_heads} (GQA), whose K/V "
                f"projections have {self.kv_dim} rows instead of {self.embed_dim}"
                if self.num_kv_heads != self.num_heads
                else f"kdim={self.kdim} and vdim={self.vdim} are not both embed_dim={self.embed_dim}"
            )
            error_msgs.append(
                f"the state dict holds a packed '{prefix}in_proj_weight' (torch's layout when kdim == vdim == "
                f"embed_dim) but this module keeps separate q/k/v_proj_weight because {why}; build the module "
                f"with the kdim, vdim and num_kv_heads of the one that saved the state dict."
            )
        elif self.in_proj_weight is not None and separate_in_sd and not packed_in_sd:
            error_msgs.append(
                f"the state dict holds separate '{prefix}q_proj_weight'/k_proj_weight/v_proj_weight (torch's layout "
                f"when kdim or vdim differ from embed_dim) but this module packs them into in_proj_weight "
                f"(kdim == vdim == embed_dim={self.embed_dim}, no GQA); build the module with the kdim, vdim and "
                f"num_kv_heads of the one that saved the state dict."
            )
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    # -- forward -------------------------------------------------------------------------
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value``; shapes and masks as in the class docstring.

        Returns:
            ``(output, weights)``: output ``(T, B, E)`` / ``(B, T, E)`` / ``(T, E)``, or a NestedTensor
            ``(B, T_b, E)`` of the query's layout for a nested query; weights None unless
            ``need_weights``, then ``(B, T, S')`` averaged over heads or, with
            ``average_attn_weights=False``, ``(B, H, T, S')`` (no B for unbatched input; padded for
            nested input).
        """
        if isinstance(query, Tensor) and query.is_nested:  # the one check the padded path pays
            self._check_nested(query, key, value, key_padding_mask, attn_mask, is_causal)  # no masks: lengths
            return self._forward_nested(query, key, value, need_weights, average_attn_weights)
        return self._forward_padded(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )

    def _forward_padded(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """``forward`` on padded (ordinary) tensors; also what nested input runs once padded, called
        directly so that a subclass overriding ``forward`` still sees each call once."""
        self._check_inputs(query, key, value)
        batched = query.dim() == 3
        q_in, k_in, v_in = _batch_first_views(
            query, key, value, batched, self.batch_first
        )  # (B, T, E), (B, S, kdim), (B, S, vdim)
        B, T, _ = q_in.shape
        S = k_in.size(1)
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        self._check_masks(attn_mask, key_padding_mask, is_causal, batched, B, T, S, q_in.device)
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (S,) -> (1, S)

        separate = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)  # None with in_proj_weight
        q, k, v = _project(
            q_in, k_in, v_in, self.in_proj_weight, self.in_proj_bias, separate
        )  # (B, T, E), (B, S, G*D), (B, S, G*D): in as few GEMMs as the inputs allow
        q, k, v = _split_heads(
            q, k, v, self.bias_k, self.bias_v, self.add_zero_attn, H, G, D
        )  # (B, H, T, D), (B, G, S', D) x2

        masks = self._attnlab_masks(attn_mask, key_padding_mask, is_causal, need_weights, B, T, S, k.size(2), q.dtype)
        backend = _pick_backend(self.backend, need_weights)
        if not torch.compiler.is_compiling():
            self.__dict__["last_backend"] = backend  # a plain attribute: no Module.__setattr__ per call
        dropout_p = self.dropout if self.training else 0.0
        context, weights, _ = attend(
            backend, q, k, v, masks, scale=1.0 / math.sqrt(D), dropout_p=dropout_p, need_weights=need_weights
        )  # context (B, H, T, D), weights (B, H, T, S') or None
        out = self.out_proj(_merge_heads(context, batched and not self.batch_first))  # (T, B, E) or (B, T, E)
        return _finish(out, weights, average_attn_weights, batched)

    # -- nested tensors: padded once, attended by the padded path, nested again ----------------
    def _forward_nested(
        self, query: Tensor, key: Tensor, value: Tensor, need_weights: bool, average_attn_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """NestedTensor inputs, each ``(B, T_b, width)``: zero-padded once to ``(B, T, width)``, the key
        lengths becoming a ``key_padding_mask``; the padded path attends, and the output is nested again
        in the query's layout (strided or jagged) with the query's lengths. Weights stay padded. ``forward``
        has checked the inputs (:meth:`_check_nested`), and that no mask came with them."""
        q_pad, q_len = _unnest(query)  # (B, T, E), (B,)
        k_pad, k_len = (q_pad, q_len) if key is query else _unnest(key)  # (B, S, kdim), (B,)
        if value is key or value is query:
            v_pad = k_pad if value is key else q_pad  # (B, S, vdim)
        else:
            v_pad, v_len = _unnest(value)  # (B, S, vdim), (B,)
            if not torch.equal(v_len.cpu(), k_len.cpu()):
                raise ValueError(
                    f"value has sequence lengths {v_len.tolist()} but key has {k_len.tolist()}; every key needs "
                    f"exactly one value: pass value sequences of the key sequences' lengths."
                )
        device = q_pad.device
        T, S = q_pad.size(1), k_pad.size(1)
        key_pad = torch.arange(S, device=device) >= k_len.to(device)[:, None]  # (B, S), True = padding

        # A nested tensor is batch-first whatever batch_first says (its dim 0 lists the sequences); the
        # padded path reads (T, B, E) when batch_first=False, so hand it views in that layout.
        def to_layout(x: Tensor) -> Tensor:
            return x if self.batch_first else x.transpose(0, 1)  # (B, T, E) or (T, B, E)

        q_in = to_layout(q_pad)
        k_in = q_in if k_pad is q_pad else to_layout(k_pad)
        v_in = q_in if v_pad is q_pad else k_in if v_pad is k_pad else to_layout(v_pad)
        out, weights = self._forward_padded(
            q_in, k_in, v_in, key_pad, need_weights, None, average_attn_weights, False
        )  # (B, T, E) or (T, B, E); weights (B, T, S') / (B, H, T, S') or None
        out = to_layout(out)  # (B, T, E)
        q_keep = torch.arange(T, device=device) < q_len.to(device)[:, None]  # (B, T), True = a real query
        if weights is not None:  # as torch's fast path returns them: padded, zero on padded query rows
            rows = q_keep[:, :, None] if weights.dim() == 3 else q_keep[:, None, :, None]  # (B, [1,] T, 1)
            weights = weights.masked_fill(~rows, 0.0)
        return _nested_like(query, out, q_keep), weights

    def _check_nested(
        self,
        query: Tensor,
        key: object,
        value: object,
        key_padding_mask: object,
        attn_mask: object,
        is_causal: bool,
    ) -> None:
        """Nested query, key and value as the padded path cannot check them: all nested, 3-D, a regular
        width, one key sequence per query sequence; and no masks (the lengths are the mask).
        Whether dtypes and devices match the weights' is checked by the padded path, after padding."""
        widths = {"query": ("embed_dim", self.embed_dim), "key": ("kdim", self.kdim), "value": ("vdim", self.vdim)}
        for name, x in (("query", query), ("key", key), ("value", value)):
            width_name, width = widths[name]
            layout = f"(B, {'T' if name == 'query' else 'S'}_b, {width_name}={width})"
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, nested {layout} like query, got {type(x).__name__}.")
            if not x.is_nested:
                raise TypeError(
                    f"query is a NestedTensor but {name} is a padded tensor of shape {tuple(x.shape)}; pass query, "
                    f"key and value all nested (one sequence per batch entry), or all padded: "
                    f"{_pad_fix('query', self.batch_first)} with a key_padding_mask."
                )
            if not x.is_floating_point():
                raise TypeError(
                    f"{name} has dtype {x.dtype}; expected a floating NestedTensor {layout} like the module's "
                    f"weights ({self.out_proj.weight.dtype}); token ids go through an nn.Embedding first."
                )
            if x.dim() != 3:
                raise ValueError(
                    f"{name} is a NestedTensor of {x.dim()} dimensions; expected {layout}, B sequences of shape "
                    f"({'T' if name == 'query' else 'S'}_b, {width_name}) (nested tensors are batch-first whatever "
                    f"batch_first says)."
                )
            if x.layout == torch.jagged:
                jagged: Any = x  # torch's NestedTensor subclass, whose offsets() and friends are untyped
                if jagged._ragged_idx != 1:
                    raise ValueError(
                        f"{name} is a jagged NestedTensor ragged in dim {jagged._ragged_idx}; expected {layout}, "
                        f"ragged in dim 1 (the sequence length): undo the transpose that moved it."
                    )
                if jagged.lengths() is not None:
                    raise ValueError(
                        f"{name} is a jagged NestedTensor with holes (offsets and lengths, as torch.nested.narrow "
                        f"makes), which cannot be padded; pass {name}.contiguous()."
                    )
                got = [x.size(-1)]  # one width: a jagged tensor is ragged in dim 1 only
            else:  # strided: each sequence has its own shape
                got = x._nested_tensor_size()[:, -1].unique().tolist()  # the sequences' widths
            if got != [width] and x.size(0) > 0:
                hint = f"project it to {width} features or build the module with {width_name}={got[0]}"
                raise ValueError(
                    f"{name} is a NestedTensor whose sequences have width {' and '.join(map(str, got))}; "
                    f"expected {width_name}={width} for every sequence, {layout}"
                    + (f": {hint}." if len(got) == 1 else ".")
                )
        assert isinstance(key, Tensor)
        if key.size(0) != query.size(0):
            raise ValueError(
                f"key holds {key.size(0)} sequences but query holds {query.size(0)}; pass one key sequence per "
                f"query sequence."
            )
        if key_padding_mask is not None:
            raise ValueError(
                "key_padding_mask was given with NestedTensor inputs, whose lengths already say which keys exist "
                "(nn.MultiheadAttention refuses the pair too); drop it, or pass padded tensors "
                f"({_pad_fix('key', self.batch_first)}) with it."
            )
        if attn_mask is not None:
            raise ValueError(
                f"attn_mask was given with NestedTensor inputs, which take no attn_mask (nn.MultiheadAttention "
                f"refuses the pair too); pass padded tensors ({_pad_fix('query', self.batch_first)}) with a key_padding_mask "
                f"and the attn_mask instead."
            )
        if is_causal:  # torch's fast path ignores it and attends to every key: refused, not silently dropped
            raise ValueError(
                f"is_causal=True was given with NestedTensor inputs, which take no attn_mask for it to describe "
                f"(torch's fast path ignores the hint and attends to every key); pass padded tensors "
                f"({_pad_fix('query', self.batch_first)}) with attn_mask=nn.Transformer.generate_square_subsequent_mask(T) and a "
                f"key_padding_mask (nn.TransformerEncoder does so when given mask= too), or drop is_causal."
            )

    # -- masks: torch's conventions in, attnlab's out ------------------------------------------
    def _attnlab_masks(
        self,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        B: int,
        T: int,
        S: int,
        S_all: int,
        dtype: torch.dtype,
    ) -> Masks:
        """torch's masks (bool True = blocked, float added; ``(T, S)`` / ``(B*H, T, S)``; key
        padding bool or float) as attnlab's :class:`Masks`: bool keep (True = may attend) plus a
        float bias, over all S' keys (the extra rows of ``add_bias_kv``/``add_zero_attn`` are
        always kept, as torch pads its masks with 0 for them)."""
        H = self.num_heads
        # torch trusts the hint only when nothing else needs a mask: then SDPA's causal mask replaces attn_mask.
        trust_causal = is_causal and key_padding_mask is None and not need_weights
        keep, bias, pad = _torch_masks(attn_mask, key_padding_mask, trust_causal, B, H, T, S, S_all, dtype)

        square_causal = trust_causal and T == S_all
        if trust_causal and not square_causal:  # SDPA's is_causal is top-left aligned: query i sees keys j <= i
            keep = torch.ones(T, S_all, dtype=torch.bool, device=self.out_proj.weight.device).tril()  # (T, S')
        masks = prepare_masks(
            keep,
            pad,
            square_causal,
            batch=B,
            heads=H,
            q_len=T,
            k_len=S_all,
            dtype=dtype,
            device=self.out_proj.weight.device,
        )
        return masks if bias is None else dataclasses.replace(masks, bias=bias)

    # -- input checks: one sentence each, in torch's terms ------------------------------------
    def _check_inputs(self, query: object, key: object, value: object) -> None:
        """Types of query, key and value (the twin's TorchScript signature checks those), then, in
        :func:`~attnlab.compat.scripted._check_inputs`, their ranks, widths, batch sizes, dtypes and devices."""
        width_names = {"query": f"embed_dim={self.embed_dim}", "key": f"kdim={self.kdim}", "value": f"vdim={self.vdim}"}
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                layout = _layout(name, width_names[name], True, self.batch_first)
                raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}.")
        assert isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)
        widths = [self.embed_dim, self.kdim, self.vdim]
        _check_inputs(query, key, value, widths, self.batch_first, self.out_proj.weight)

    def _check_masks(
        self,
        attn_mask: object,
        key_padding_mask: object,
        is_causal: bool,
        batched: bool,
        B: int,
        T: int,
        S: int,
        device: torch.device,
    ) -> None:
        """Types of the masks, then, in :func:`~attnlab.compat.scripted._check_masks`, their dtypes, shapes
        and devices, in torch's conventions."""
        for name, mask, bool_meaning in (
            ("key_padding_mask", key_padding_mask, "True = padding"),
            ("attn_mask", attn_mask, "True = blocked"),
        ):
            if mask is not None and not isinstance(mask, Tensor):
                raise TypeError(
                    f"{name} must be a torch.Tensor (bool: {bool_meaning}, or float: added to the scores), "
                    f"got {type(mask).__name__}; wrap it with torch.as_tensor(...)."
                )
        assert attn_mask is None or isinstance(attn_mask, Tensor)
        assert key_padding_mask is None or isinstance(key_padding_mask, Tensor)
        _check_masks(attn_mask, key_padding_mask, is_causal, batched, B, self.num_heads, T, S, device)


def _unnest(x: Tensor) -> tuple[Tensor, Tensor]:
    """A NestedTensor ``(B, T_b, width)`` as a zero-padded ``(B, T, width)`` tensor and its lengths ``(B,)``."""
    if x.layout == torch.jagged:
        jagged: Any = x  # torch's NestedTensor subclass, whose offsets() is untyped
        lengths = jagged.offsets().diff()  # (B,), on x's device
        max_len = int(lengths.max()) if lengths.numel() else 0
        # an explicit size: without a cached max length torch pads a jagged tensor to its total length
        return x.to_padded_tensor(0.0, output_size=(x.size(0), max_len, x.size(-1))), lengths
    return x.to_padded_tensor(0.0), x._nested_tensor_size()[:, 0]  # sizes are host metadata: no sync


def _nested_like(like: Tensor, padded: Tensor, keep: Tensor) -> Tensor:
    """The rows of ``padded`` ``(B, T, E)`` where ``keep`` ``(B, T)`` as a NestedTensor of ``like``'s
    layout and lengths; differentiable, as the padding was."""
    if like.layout == torch.jagged:
        jagged: Any = like  # torch's NestedTensor subclass, whose offsets() is untyped
        # like's own offsets: the result shares its ragged size, so `like + result` (a residual) works
        return torch.nested.nested_tensor_from_jagged(padded[keep], jagged.offsets(), max_seqlen=padded.size(1))
    return torch._nested_tensor_from_mask(padded, keep, mask_check=False)  # as nn.TransformerEncoder makes them
