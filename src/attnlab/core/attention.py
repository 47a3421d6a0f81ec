"""``MultiHeadAttention``: projections, head split, attention, merge, output projection.

Shapes: B batch, T_q query length, T_k key length, E embed_dim, H heads, G key/value heads,
D = E // H head dim. The module is always batch-first.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from .dispatch import attend
from .interop import from_torch_mha, to_torch_mha
from .masks import Masks, prepare_masks
from .rope import apply_rope
from .validation import Backend, check_backend, check_forward_inputs, check_init_args

if TYPE_CHECKING:
    from .kv_cache import KVCache

__all__ = ["Backend", "MultiHeadAttention"]


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
    the fused one was not taken, or how it was adapted (None when it ran as it is): fp16/bf16
    on a CPU computes in float32, faster and more exact there (measured: see
    :func:`attnlab.core.functional.sdpa_compute_dtype`).

    Precision: every backend accumulates scores, softmax and ``weights @ V`` in float32 at least,
    so fp16/bf16 neither overflow nor lose more than plain PyTorch does in that precision.

    The projections ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` are ordinary
    ``nn.Linear`` children that own their parameters: replace or wrap any of them (LoRA, a
    quantized Linear, a hook) and the module runs it. Each runs as its own GEMM: one GEMM on
    the three weights concatenated per call was measured slower in training (the copy and its
    backward cost more than the merged GEMM saves; see the README's benchmark notes).

    State dicts written before the projections were separate (one ``in_proj`` weight, rows Q
    then K then V) still load: ``in_proj.*`` keys are split on load.
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
        # Typed as nn.Module: a user may swap in any module computing (..., in) -> (..., out).
        self.q_proj: nn.Module = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)  # E -> H*D
        self.k_proj: nn.Module = nn.Linear(kdim, self.kv_dim, bias=bias, **factory)  # kdim -> G*D
        self.v_proj: nn.Module = nn.Linear(vdim, self.kv_dim, bias=bias, **factory)  # vdim -> G*D
        self.out_proj: nn.Module = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)  # H*D -> E
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(_split_fused_in_proj)  # type: ignore[no-untyped-call]  # unannotated in torch

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
                weight, bias = getattr(proj, "weight", None), getattr(proj, "bias", None)
                if isinstance(weight, Tensor):  # a swapped-in module may hold its weights elsewhere
                    nn.init.xavier_uniform_(weight)
                if isinstance(bias, Tensor):
                    bias.zero_()

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim):
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        return s + f", dropout={self.dropout}, backend={self.backend!r}"

    # -- forward -------------------------------------------------------------------------
    def _a_weight(self) -> Tensor:
        """A parameter whose device and dtype the inputs must match: ``out_proj.weight`` unless a
        swapped-in ``out_proj`` keeps its weights elsewhere."""
        w = getattr(self.out_proj, "weight", None)
        return w if isinstance(w, Tensor) else next(self.parameters())

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V projections: (B, T_q, E), (B, T_k, G*D), (B, T_k, G*D)."""
        q: Tensor = self.q_proj(query)  # (B, T_q, E)
        k: Tensor = self.k_proj(key)  # (B, T_k, KV)
        v: Tensor = self.v_proj(value)  # (B, T_k, KV)
        return q, k, v

    def _choose_backend(self, need_weights: bool) -> tuple[str, str | None]:
        """The backend for this call and, when it is not the fused one, why (see
        :func:`attnlab.core.functional.sdpa_compute_dtype` for how the fused one may be adapted)."""
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
        check_forward_inputs(self, self._a_weight(), query, key, value, kv_cache, cache_positions, rope)
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
        if key_padding_mask is not None and kv_cache is None:
            # Padded keys are never attended, but 0 * NaN is NaN: whatever a caller left in the
            # padding (NaN, inf) must not reach the output through the zero weights.
            pad = key_padding_mask[:, None, :, None]  # (B, 1, T_k, 1)
            k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)  # (B, G, T_k, D) each
        backend, reason = self._choose_backend(need_weights)
        dropout_p = self.dropout if self.training else 0.0
        context, weights, adapted = attend(
            backend, q, k, v, masks, scale=self.scale, dropout_p=dropout_p, need_weights=need_weights
        )  # context: (B, H, T_q, D)
        if not torch.compiler.is_compiling():  # bookkeeping only; keeps compiled graphs whole
            self.__dict__.update(last_backend=backend, last_backend_reason=reason or adapted)  # plain attrs

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


def _split_fused_in_proj(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
    """Load-time hook: a state dict from before the projections were separate holds one
    ``in_proj`` (rows Q, then K, then V); split it into ``q_proj``/``k_proj``/``v_proj``."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}in_proj.{kind}", None)
        if fused is None:
            continue
        sizes = [cast(int, getattr(module, "embed_dim"))] + 2 * [cast(int, getattr(module, "kv_dim"))]  # noqa: B009
        if fused.size(0) != sum(sizes):
            raise ValueError(
                f"{prefix}in_proj.{kind} has {fused.size(0)} rows; this module expects {sum(sizes)} "
                f"(embed_dim + 2 * num_kv_heads * head_dim = {' + '.join(map(str, sizes))}): the checkpoint "
                "was written by a module of another shape; build the module with that checkpoint's sizes."
            )
        for name, part in zip(("q_proj", "k_proj", "v_proj"), torch.split(fused, sizes), strict=True):
            state_dict[f"{prefix}{name}.{kind}"] = part
