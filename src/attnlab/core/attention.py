"""``MultiHeadAttention``: projections, head split, attention, merge, output projection.

Shapes: B batch, T_q query length, T_k key length, E embed_dim, H heads, G key/value heads,
D = E // H head dim. The module is always batch-first.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import functional
from .interop import from_torch_mha, to_torch_mha
from .masks import Masks, prepare_masks
from .rope import apply_rope
from .validation import Backend, check_backend, check_forward_inputs, check_init_args

if TYPE_CHECKING:
    from .kv_cache import KVCache

__all__ = ["Backend", "MultiHeadAttention"]


class ProjectionSlice(nn.Module):
    """Rows ``[start, stop)`` of the fused ``in_proj``: reads and runs like an ``nn.Linear``.

    Owns no parameter: ``weight``/``bias`` are views of the fused ones, so writing into them
    (``with torch.no_grad(): mha.q_proj.weight.copy_(w)``) updates the module.
    """

    _fused: nn.Linear

    def __init__(self, fused: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.__dict__["_fused"] = fused  # a plain reference, not a child: no duplicate state_dict key
        self.start, self.stop = start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    @property
    def weight(self) -> Tensor:
        return self._fused.weight[self.start : self.stop]  # (out_features, in_features)

    @property
    def bias(self) -> Tensor | None:
        b = self._fused.bias
        return None if b is None else b[self.start : self.stop]

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows=[{self.start}:{self.stop}] of in_proj"


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention, batch-first, with GQA/MQA, two backends and one mask convention.

    Args:
        embed_dim: E, width of the query and of the output.
        num_heads: H, number of query heads; must divide ``embed_dim``. Head dim D = E // H.
        num_kv_heads: G, number of key/value heads (GQA; 1 is MQA); must divide ``num_heads``.
            Query head h reads K/V head ``h // (H // G)``. Default: ``num_heads``.
        kdim, vdim: widths of ``key`` and ``value`` for cross-attention on a context of
            another width. Default: ``embed_dim``.
        dropout: dropout probability on the attention weights, applied in training mode only.
        bias: whether the four projections have biases.
        scale: multiplier of ``Q K^T``; default ``1 / sqrt(D)``.
        backend: ``"auto"`` (SDPA unless the call needs the math path), ``"math"`` (the explicit
            reference, the only one that can return weights) or ``"sdpa"``. A public attribute:
            may be changed after construction.

    Shapes in ``forward``: ``query (B, T_q, E)``, ``key (B, T_k, kdim)``, ``value (B, T_k, vdim)``,
    output ``(B, T_q, E)``, weights ``(B, H, T_q, T_k)``.

    Masks (all three may be combined):
        * ``attn_mask`` bool: **True = may attend** (as SDPA; the *opposite* of
          ``nn.MultiheadAttention``). Float: added to the scores. Shape ``(T_q, T_k)``,
          ``(B, T_q, T_k)`` or 4-D broadcastable to ``(B, H, T_q, T_k)``.
        * ``key_padding_mask`` ``(B, T_k)`` bool: **True = padding**, never attended.
        * ``is_causal``: query i sees keys at positions <= its own (bottom-right aligned).

    A query whose keys are all masked gets a context of zeros (its output is then
    ``out_proj.bias``) and weights of zeros, with finite gradients, on every backend.

    After each call, ``last_backend`` says which backend ran and ``last_backend_reason`` why
    the fused one was not taken (None when it was).

    The projections ``q_proj``, ``k_proj``, ``v_proj`` are ``nn.Linear``-like. When
    ``kdim == vdim == embed_dim`` they are row slices of one fused ``in_proj`` (Q rows, then K,
    then V) so that self-attention computes Q, K and V with a single GEMM.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        scale: float | None = None,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        check_init_args(embed_dim, num_heads, num_kv_heads, kdim, vdim, dropout, scale, backend)
        self.embed_dim = embed_dim
        self.num_heads = num_heads  # H
        self.num_kv_heads = num_kv_heads  # G: only the cache and K/V projections shrink with it
        self.head_dim = embed_dim // num_heads  # D
        self.kv_dim = num_kv_heads * self.head_dim  # width of K and of V: G * D
        self.kdim, self.vdim = kdim, vdim
        self.dropout = dropout
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        self.backend = backend
        self.last_backend: str | None = None
        self.last_backend_reason: str | None = None

        factory = {"device": device, "dtype": dtype}
        self.fused_qkv = kdim == embed_dim and vdim == embed_dim
        self.q_proj: nn.Module
        self.k_proj: nn.Module
        self.v_proj: nn.Module
        if self.fused_qkv:
            # One (E + 2*G*D, E) weight: rows [0, E) are Q, then K, then V.
            self.in_proj = nn.Linear(embed_dim, embed_dim + 2 * self.kv_dim, bias=bias, **factory)
            self.q_proj = ProjectionSlice(self.in_proj, 0, embed_dim)
            self.k_proj = ProjectionSlice(self.in_proj, embed_dim, embed_dim + self.kv_dim)
            self.v_proj = ProjectionSlice(self.in_proj, embed_dim + self.kv_dim, embed_dim + 2 * self.kv_dim)
        else:
            self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
            self.k_proj = nn.Linear(kdim, self.kv_dim, bias=bias, **factory)
            self.v_proj = nn.Linear(vdim, self.kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    @property
    def backend(self) -> str:
        """``"auto"``, ``"math"`` or ``"sdpa"``; may be changed between calls."""
        return str(self.__dict__["_backend"])

    @backend.setter
    def backend(self, value: str) -> None:
        check_backend(value)
        self.__dict__["_backend"] = value

    def reset_parameters(self) -> None:
        """Xavier-uniform weights and zero biases, each projection on its own fan (seed 002)."""
        with torch.no_grad():
            for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
                assert isinstance(proj.weight, Tensor) and isinstance(proj.bias, Tensor | None)
                nn.init.xavier_uniform_(proj.weight)
                if proj.bias is not None:
                    proj.bias.zero_()

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if not self.fused_qkv:
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        return s + f", dropout={self.dropout}, backend={self.backend!r}"

    # -- forward -------------------------------------------------------------------------
    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V projections: (B, T_q, E), (B, T_k, G*D), (B, T_k, G*D), in as few GEMMs as allowed."""
        if not self.fused_qkv:
            q: Tensor = self.q_proj(query)  # (B, T_q, E)
            k: Tensor = self.k_proj(key)  # (B, T_k, KV)
            v: Tensor = self.v_proj(value)  # (B, T_k, KV)
            return q, k, v
        w, b = self.in_proj.weight, self.in_proj.bias
        E, KV = self.embed_dim, self.kv_dim
        if key is query and value is query:  # self-attention: one GEMM for Q, K and V
            qkv = F.linear(query, w, b)  # (B, T, E + 2*KV)
            q, k, v = torch.split(qkv, [E, KV, KV], dim=-1)  # views: (B, T, E), (B, T, KV), (B, T, KV)
            return q, k, v
        q = F.linear(query, w[:E], None if b is None else b[:E])  # (B, T_q, E)
        if value is key:  # cross-attention on one context: K and V in one GEMM
            kv = F.linear(key, w[E:], None if b is None else b[E:])  # (B, T_k, 2*KV)
            k, v = torch.split(kv, [KV, KV], dim=-1)  # views: (B, T_k, KV) each
            return q, k, v
        k = F.linear(key, w[E : E + KV], None if b is None else b[E : E + KV])  # (B, T_k, KV)
        v = F.linear(value, w[E + KV :], None if b is None else b[E + KV :])  # (B, T_k, KV)
        return q, k, v

    def _choose_backend(self, need_weights: bool) -> tuple[str, str | None]:
        """The backend for this call and, when it is not the fused one, why."""
        if self.backend == "math":
            return "math", "backend='math' was requested"
        if need_weights:
            if self.backend == "sdpa":
                raise ValueError(
                    "need_weights=True with backend='sdpa': SDPA never materialises the "
                    "attention weights; set mha.backend = 'auto' or 'math' for this call."
                )
            return "math", "need_weights=True: only the math backend materialises the weights"
        return "sdpa", None

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | Masks | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache: KVCache | None = None,
        cache_positions: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: ``(B, T_q, E)``.
            key: ``(B, T_k, kdim)``; None means self-attention (``key = query``).
            value: ``(B, T_k, vdim)``; None means ``value = key``.
            attn_mask: bool (True = may attend) or float (added to the scores), shape
                ``(T_q, T_k)``, ``(B, T_q, T_k)`` or broadcastable ``(B, H, T_q, T_k)``. Or an
                :class:`attnlab.core.masks.Masks` from :func:`attnlab.core.masks.prepare_masks`, converted
                once and shared by every layer of a model.
            key_padding_mask: ``(B, T_k)`` bool, True = padding (never attended).
            is_causal: causal masking, bottom-right aligned (query i sees keys j <= i + T_k - T_q).
            need_weights: also return the per-head weights ``(B, H, T_q, T_k)`` (math backend).
            kv_cache: an :class:`attnlab.KVCache` for this layer (self-attention only): this
                call's K/V are written into it and attention runs over everything cached.
                ``T_k`` is then the cached length, and masks index cached slots.
            cache_positions: ``(T_q,)`` int64 cache slots of this call's tokens (position mode,
                see :mod:`attnlab.core.kv_cache`: fixed shapes for ``torch.compile``). Needs
                ``is_causal=True``: a query sees the slots at or before its own.
            rope: ``(cos, sin)`` from :func:`attnlab.core.rope.rope_cos_sin`, each ``(T_q, D)`` or
                ``(B, T_q, D)``: rotary embeddings applied to Q and to this call's K.

        Returns:
            ``output (B, T_q, E)``, or ``(output, weights)`` when ``need_weights``.
        """
        key = query if key is None else key
        value = key if value is None else value
        check_forward_inputs(self, self.out_proj.weight, query, key, value, kv_cache, cache_positions, rope)
        B, T_q, _ = query.shape
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim

        q, k, v = self._project(query, key, value)  # (B, T_q, H*D), (B, T_k, G*D), (B, T_k, G*D)
        q = q.view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D): heads become a batch dim
        k = k.view(B, k.size(1), G, D).transpose(1, 2)  # (B, G, T_k, D)
        v = v.view(B, v.size(1), G, D).transpose(1, 2)  # (B, G, T_k, D)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # (B, H, T_q, D), (B, G, T_k, D)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, cache_positions)  # (B, G, T_cached, D): all cached keys

        masks = prepare_masks(
            attn_mask,
            key_padding_mask,
            is_causal,
            batch=B,
            heads=H,
            q_len=T_q,
            k_len=k.size(2),
            dtype=q.dtype,
            device=q.device,
            q_positions=cache_positions,
        )
        backend, reason = self._choose_backend(need_weights)
        if not torch.compiler.is_compiling():  # bookkeeping only; keeps compiled graphs whole
            self.__dict__.update(
                last_backend=backend, last_backend_reason=reason
            )  # plain attrs, no Module.__setattr__ cost
        attend = functional.math_attention if backend == "math" else functional.sdpa_attention
        context, weights = attend(
            q,
            k,
            v,
            keep=masks.keep,
            bias=masks.bias,
            causal=masks.causal,
            empty_rows=masks.empty_rows,
            scale=self.scale,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
        )  # context: (B, H, T_q, D)

        context = context.transpose(1, 2).contiguous().view(B, T_q, H * D)  # (B, T_q, E): heads merged
        out = self.out_proj(context)  # (B, T_q, E)
        return (out, weights) if need_weights else out  # type: ignore[return-value]

    # -- interop ---------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, *, backend: Backend = "auto") -> MultiHeadAttention:
        """Build an attnlab module with the weights of ``torch.nn.MultiheadAttention`` (either layout)."""
        return from_torch_mha(cls, m, backend=backend)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """A ``torch.nn.MultiheadAttention`` computing the same function (GQA K/V heads repeated)."""
        return to_torch_mha(self, batch_first=batch_first)
