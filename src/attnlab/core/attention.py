"""``MultiHeadAttention``: projections, head split, attention, merge, output projection.

Shapes: B batch, T_q query length, T_k key length, E embed_dim, H heads, G key/value heads,
D query/key head dim (``head_dim``, default E // H), Dv value head dim (``v_head_dim``, default D).
The module is always batch-first.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from .dispatch import attend
from .flex import FlexCall, flex_available, flex_choice, flex_min_head_dim
from .functional import sdpa_compute_dtype
from .interop import from_torch_mha, to_torch_mha
from .kv_cache import KVCache, RollingKVCache
from .masks import Masks, prepare_masks
from .rope import apply_rope
from .validation import (
    Backend,
    check_backend,
    check_document_ids,
    check_forward_inputs,
    check_head_args,
    check_init_args,
    check_variant_args,
)
from .variants import Structure, alibi_slopes, banded_sdpa, document_runs, variant_math, variant_sdpa

__all__ = ["Backend", "ContextParallelAttention", "MultiHeadAttention"]


class ContextParallelAttention(Protocol):
    """What ``forward(..., context_parallel=)`` calls: :class:`attnlab.distributed.ContextParallel` is one.

    ``attend`` returns this rank's ``context (B, H, L, D)`` from its ``q (B, H, L, D)`` and ``k, v (B, G, L, D)``,
    attending over the whole sequence the ranks hold between them (one head dim: the module refuses
    ``v_head_dim != head_dim`` with it)."""

    length: int | None

    def positions(self, device: torch.device | str | None = None) -> Tensor: ...

    def document_positions(self, document_ids: Tensor) -> Tensor: ...

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        is_causal: bool,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
        alibi: Tensor | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor: ...


# Sliding-window calls at least this long (and >= 2 windows) run SDPA per query block on its key band. Measured
# (attnlab bench --variant window, W=256, E=512, H=8, 1 CPU thread, torch 2.13), band vs dense-mask SDPA kernels:
# forward 6.1 vs 5.6 ms at T=512, 12.9 vs 18.7 at 1024; forward+backward 18.0 vs 17.9 at 512, 38.5 vs 57.4 at 1024.
BAND_MIN_TOKENS = 1024


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention, batch-first, with GQA/MQA, two backends and one mask convention.

    Args:
        embed_dim: E, width of the query and of the output.
        num_heads: H, number of query heads; must divide ``embed_dim`` unless ``head_dim`` is given.
        num_kv_heads: G, number of key/value heads (GQA; 1 is MQA); must divide ``num_heads``.
            Query head h reads K/V head ``h // (H // G)``. Default: ``num_heads``.
        kdim, vdim: widths of ``key`` and ``value`` for cross-attention on a context of
            another width. Default: ``embed_dim``.
        dropout: dropout probability on the attention weights, applied in training mode only.
        bias: whether the projections have biases.
        scale: multiplier of ``Q K^T``; default ``1 / sqrt(D)``, D the query/key head dim.
        head_dim: D, the width of each query and key head, set apart from the width (Qwen 3, Gemma:
            hidden 1024, 16 heads, ``head_dim=128``). Default ``embed_dim // num_heads``. The
            projections are then ``q_proj: E -> H*D``, ``k_proj: kdim -> G*D``.
        v_head_dim: Dv, the width of each value head (DeepSeek's MLA: Dv != D). Default ``head_dim``.
            ``v_proj: vdim -> G*Dv``, ``out_proj: H*Dv -> E``; the context is ``(B, H, T_q, Dv)``.
        rope_dims: partial rotary: ``forward(rope=(cos, sin))`` rotates the first ``rope_dims``
            channels of each query and key head and passes the other ``D - rope_dims`` through
            (GPT-NeoX's ``rotary_pct``, Qwen3-Next's ``partial_rotary_factor``: ``int(D * f)``); cos and
            sin are then ``(T_q, rope_dims)``. Even, at most D. Default None: the whole head.
        output_gate: ``"elementwise"`` (Qwen3-Next) multiplies the merged context ``(B, T_q, H*Dv)`` by
            ``sigmoid(gate_proj(query))`` before ``out_proj``, ``gate_proj: E -> H*Dv``; ``"headwise"`` by one
            sigmoid per head, ``gate_proj: E -> H``. A plain ``nn.Linear`` child (PEFT finds it by name).
            Default False: no gate, no ``gate_proj``.
        backend: ``"auto"`` (SDPA unless the call needs the math path), ``"math"`` (the explicit
            reference, the only one that can return weights), ``"sdpa"`` or ``"flex"``
            (FlexAttention, for the variants). A public attribute: may be changed after construction.

    Variants (keyword options, off by default, composable; the formulas are in
    :mod:`attnlab.core.variants`):
        window: sliding window ``W`` (Mistral, Gemma 2): query ``i`` sees keys ``i - W < j <= i``.
            Needs ``is_causal=True`` at call time.
        softcap: logit soft-capping ``C`` (Gemma 2): scores ``C * tanh(scores / C)`` before masking.
        alibi: ALiBi (BLOOM, MPT): head ``h`` adds ``-m_h * |i - j|`` to its scores.
        sinks: a learned per-head sink logit in the softmax denominator (gpt-oss); ``self.sinks (H,)``.
        qk_norm: RMSNorm on q and k before rotary: ``True``/``"head"`` over each head's ``D``
            channels (Qwen 3, Gemma 3), ``"full"`` over all of q's ``H*D`` and k's ``G*D`` channels (OLMo 2).
        qk_norm_eps: the RMSNorm epsilon.
    ``forward(..., document_ids=(B, T))`` packs several sequences in a row: attention is blocked
    across documents.

    Shapes in ``forward``: ``query (B, T_q, E)``, ``key (B, T_k, kdim)``, ``value (B, T_k, vdim)``,
    output ``(B, T_q, E)``, weights ``(B, H, T_q, T_k)``; inside, ``q (B, H, T_q, D)``, ``k (B, G, T_k, D)``,
    ``v (B, G, T_k, Dv)``, context ``(B, H, T_q, Dv)``.

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

    The projections ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (and ``gate_proj`` with an output gate)
    are ordinary ``nn.Linear`` children that own their parameters: replace or wrap any of them (LoRA, a
    quantized Linear, a hook) and the module runs it. Each runs as its own GEMM: one GEMM on
    the three weights concatenated per call was measured slower in training (the copy and its
    backward cost more than the merged GEMM saves; see docs/reference/module.md, Projections).

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
        window: int | None = None,
        softcap: float | None = None,
        alibi: bool = False,
        sinks: bool = False,
        qk_norm: bool | str = False,
        qk_norm_eps: float = 1e-6,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        rope_dims: int | None = None,
        output_gate: bool | str | None = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        check_init_args(embed_dim, num_heads, num_kv_heads, kdim, vdim, dropout, scale, backend, head_dim=head_dim)
        check_head_args(embed_dim, num_heads, head_dim, v_head_dim, rope_dims, output_gate)
        check_variant_args(window, softcap, alibi, sinks, qk_norm)
        self.embed_dim = embed_dim
        self.num_heads = num_heads  # H
        self.num_kv_heads = num_kv_heads  # G: only the cache and K/V projections shrink with it
        self.head_dim = embed_dim // num_heads if head_dim is None else head_dim  # D: each query/key head
        self.v_head_dim = self.head_dim if v_head_dim is None else v_head_dim  # Dv: each value head
        self.q_width = num_heads * self.head_dim  # width of Q: H * D (E unless head_dim is set)
        self.kv_dim = num_kv_heads * self.head_dim  # width of K: G * D (and of V when Dv == D)
        self.v_width = num_kv_heads * self.v_head_dim  # width of V: G * Dv
        self.context_width = num_heads * self.v_head_dim  # the merged heads out_proj reads: H * Dv
        self.rope_dims = rope_dims  # channels of each q/k head that RoPE rotates; None: all D
        self.output_gate: str | None = str(output_gate) if output_gate else None
        self.kdim, self.vdim = kdim, vdim
        self.dropout = dropout
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        self.backend = backend
        self.last_backend: str | None = None
        self.last_backend_reason: str | None = None

        factory = {"device": device, "dtype": dtype}
        # Typed as nn.Module: a user may swap in any module computing (..., in) -> (..., out).
        self.q_proj: nn.Module = nn.Linear(embed_dim, self.q_width, bias=bias, **factory)  # E -> H*D
        self.k_proj: nn.Module = nn.Linear(kdim, self.kv_dim, bias=bias, **factory)  # kdim -> G*D
        self.v_proj: nn.Module = nn.Linear(vdim, self.v_width, bias=bias, **factory)  # vdim -> G*Dv
        self.out_proj: nn.Module = nn.Linear(self.context_width, embed_dim, bias=bias, **factory)  # H*Dv -> E
        # Qwen3-Next's output gate, its own Linear (HF keeps its rows inside q_proj): None when off, a plain
        # attribute then, so that forward's one check reads the instance dict, and the state dict is unchanged.
        self.gate_proj: nn.Module | None = None
        if self.output_gate is not None:
            gate_width = self.context_width if self.output_gate == "elementwise" else num_heads  # H*Dv or H
            self.gate_proj = nn.Linear(embed_dim, gate_width, bias=bias, **factory)  # E -> H*Dv or H
        # Optional: one module computing [q | k | v] of a self-attention input in a single matmul (set by
        # attnlab.models.llama.fuse_quantized; its weights are the three projections' own, shared).
        self.qkv_proj: nn.Module | None = None

        self.window, self.softcap = window, (None if softcap is None else float(softcap))
        # ALiBi slopes: a buffer (moves with .to()), not saved: they follow from num_heads.
        self.alibi_slopes: Tensor | None
        self.register_buffer("alibi_slopes", alibi_slopes(num_heads).to(device) if alibi else None, persistent=False)
        self.sinks: nn.Parameter | None = (
            nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype)) if sinks else None  # (H,) sink logits
        )
        self.qk_norm: str | None = "head" if qk_norm is True else (str(qk_norm) if qk_norm else None)
        q_width, k_width = (self.head_dim, self.head_dim) if self.qk_norm == "head" else (self.q_width, self.kv_dim)
        self.q_norm: nn.RMSNorm | None = None
        self.k_norm: nn.RMSNorm | None = None
        if self.qk_norm is not None:
            self.q_norm = nn.RMSNorm(q_width, eps=qk_norm_eps, device=device, dtype=dtype)
            self.k_norm = nn.RMSNorm(k_width, eps=qk_norm_eps, device=device, dtype=dtype)
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
            gate = () if self.gate_proj is None else (self.gate_proj,)
            for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj, *gate):
                weight, bias = getattr(proj, "weight", None), getattr(proj, "bias", None)
                if isinstance(weight, Tensor):  # a swapped-in module may hold its weights elsewhere
                    nn.init.xavier_uniform_(weight)
                if isinstance(bias, Tensor):
                    bias.zero_()
            if self.sinks is not None:
                self.sinks.zero_()
            for norm in (self.q_norm, self.k_norm):
                if norm is not None:
                    norm.reset_parameters()

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.num_kv_heads != self.num_heads:
            s += f", num_kv_heads={self.num_kv_heads}"
        if (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim):
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.head_dim != self.embed_dim // self.num_heads or self.q_width != self.embed_dim:
            s += f", head_dim={self.head_dim}"
        if self.v_head_dim != self.head_dim:
            s += f", v_head_dim={self.v_head_dim}"
        for name, value in (
            ("rope_dims", self.rope_dims),
            ("output_gate", self.output_gate),
            ("window", self.window),
            ("softcap", self.softcap),
            ("qk_norm", self.qk_norm),
        ):
            if value is not None:
                s += f", {name}={value!r}"
        if self.alibi_slopes is not None:
            s += ", alibi=True"
        if self.sinks is not None:
            s += ", sinks=True"
        return s + f", dropout={self.dropout}, backend={self.backend!r}"

    @property
    def has_variants(self) -> bool:
        """Whether a variant option (window, softcap, alibi, sinks) is on; qk_norm needs no special backend."""
        return (  # read on every forward: the buffer's dict directly, not nn.Module.__getattr__ (0.9 -> 0.2 us)
            self.window is not None
            or self.softcap is not None
            or self._buffers.get("alibi_slopes") is not None
            or self.sinks is not None
        )

    # -- forward -------------------------------------------------------------------------
    def _a_weight(self) -> Tensor:
        """A tensor whose device and dtype the inputs must match: ``out_proj.weight`` unless a swapped-in
        ``out_proj`` keeps its weights elsewhere (``compute_reference``: attnlab.quant's layers), else a parameter."""
        for name in ("weight", "compute_reference"):  # a quantized out_proj holds blocks, and says its dtype so
            w = getattr(self.out_proj, name, None)
            if isinstance(w, Tensor):
                return w
        return next(self.parameters())

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V projections: (B, T_q, H*D), (B, T_k, G*D), (B, T_k, G*Dv)."""
        fused = self.qkv_proj
        if fused is not None and query is key and key is value:  # self-attention: one matmul, split by columns
            fq, fk, fv = fused(query).split((self.q_width, self.kv_dim, self.v_width), dim=-1)
            return fq, fk, fv
        q: Tensor = self.q_proj(query)  # (B, T_q, H*D)
        k: Tensor = self.k_proj(key)  # (B, T_k, G*D)
        v: Tensor = self.v_proj(value)  # (B, T_k, G*Dv)
        return q, k, v

    def _gate(self, context: Tensor, query: Tensor) -> Tensor:
        """The output gate: ``context (B, T_q, H*Dv)`` times ``sigmoid(gate_proj(query))``, per channel
        (``"elementwise"``) or per head (``"headwise"``)."""
        gate = torch.sigmoid(cast(nn.Module, self.gate_proj)(query))  # (B, T_q, H*Dv) or (B, T_q, H)
        if self.output_gate == "elementwise":
            return context * gate  # (B, T_q, H*Dv)
        B, T_q, _ = context.shape
        heads = context.view(B, T_q, self.num_heads, self.v_head_dim)  # (B, T_q, H, Dv)
        return (heads * gate[..., None]).view(B, T_q, self.context_width)  # (B, T_q, H, Dv) -> (B, T_q, H*Dv)

    def _attend_variants(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | Masks | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        kv_cache: KVCache | None,
        cache_positions: Tensor | None,
        document_ids: Tensor | None,
        need_weights: bool,
        dropout_p: float,
        k_pos: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, str, str | None]:
        """Attention with the variants on (:mod:`attnlab.core.variants`): ``(context, weights, backend, reason)``."""
        B, H, T_q, _ = q.shape
        T_k = k.size(2)
        if isinstance(attn_mask, Masks):  # a model's shared masks (decoder_masks): causal by construction
            masks, causal = replace(attn_mask, causal=False), attn_mask.causal or is_causal or self.window is not None
        else:
            if self.window is not None and not is_causal:
                raise ValueError(
                    f"window={self.window} is a causal sliding window (query i sees keys i - {self.window} < j <= i); "
                    f"call the module with is_causal=True."
                )
            if cache_positions is not None and not is_causal:
                raise ValueError(
                    "cache_positions was given with is_causal=False; position mode attends over the whole "
                    "cache buffer and relies on the causal mask to hide unwritten slots: pass is_causal=True."
                )
            if is_causal and T_q > T_k:
                raise ValueError(
                    f"is_causal=True needs T_q <= T_k, got T_q={T_q} queries and T_k={T_k} keys; pass an explicit attn_mask."
                )
            # the structure does the causal masking, from positions
            masks = prepare_masks(
                attn_mask,
                key_padding_mask,
                False,
                batch=B,
                heads=H,
                q_len=T_q,
                k_len=T_k,
                dtype=q.dtype,
                device=q.device,
            )
            causal = is_causal
        if document_ids is not None:
            check_document_ids(document_ids, B, T_q, T_k, kv_cache)
            document_ids = document_runs(document_ids)  # a run of equal ids is a document, as positions restart
        if cache_positions is not None:
            q_pos = cache_positions
        else:
            q_pos = torch.arange(T_k - T_q, T_k, device=q.device)  # bottom-right: the last T_q positions
        if k_pos is None:
            k_pos = torch.arange(T_k, device=q.device)  # a key's index is its position
        st = Structure(
            q_pos=q_pos,
            k_pos=k_pos,
            causal=causal,
            window=self.window,
            softcap=self.softcap,
            alibi=self.alibi_slopes,
            sinks=self.sinks,
            q_doc=document_ids,
            k_doc=document_ids,
        )
        if key_padding_mask is not None and kv_cache is None:
            k, v = _zero_padded_keys(k, v, key_padding_mask)

        backend, reason = self._choose_variant_backend(need_weights, st, T_q, T_k, kv_cache is None, (q, k, v, masks))
        if backend == "math":
            context, weights = variant_math(
                q, k, v, masks, st, scale=self.scale, dropout_p=dropout_p, need_weights=need_weights
            )
            return context, weights, backend, reason
        if backend == "flex":
            from .flex import flex_variant  # torch.nn.attention.flex_attention is imported only when used

            return flex_variant(q, k, v, masks, st, scale=self.scale), None, backend, reason
        compute_dtype, adapted = sdpa_compute_dtype(q)
        out_dtype = q.dtype
        if compute_dtype is not None:
            q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
            reason = adapted if reason is None else f"{reason}; {adapted}"
        if backend == "sdpa-band":
            context = banded_sdpa(q, k, v, masks, st, scale=self.scale, dropout_p=dropout_p)
        else:
            context = variant_sdpa(q, k, v, masks, st, scale=self.scale, dropout_p=dropout_p)
        return context.to(out_dtype), None, backend, reason

    def _choose_variant_backend(
        self,
        need_weights: bool,
        st: Structure,
        T_q: int,
        T_k: int,
        no_cache: bool,
        inputs: tuple[Tensor, Tensor, Tensor, Masks] | None = None,
    ) -> tuple[str, str | None]:
        """``(backend, reason)`` for a call with variants: ``math``, ``sdpa`` (dense mask), ``sdpa-band``
        (window, key bands, no T x T mask) or ``flex``.

        ``auto`` sends a call to flex only where a measurement says flex wins for its device, grad mode,
        dtype and case (:func:`attnlab.core.flex.flex_choice`), says which measurement in the reason, and
        only within flex's known limits (its head dim on a GPU; a kernel that failed earlier for the same
        ``inputs`` ``(q, k, v, masks)``: :class:`attnlab.core.flex.FlexCall`), else says why not.
        Grad mode is ``torch.is_grad_enabled()``: a forward outside ``torch.no_grad()`` may be backpropagated.
        """
        if need_weights:
            if self.backend in ("sdpa", "flex"):
                raise ValueError(
                    f"need_weights=True with backend={self.backend!r}: only the math backend materialises the "
                    f"weights; set mha.backend = 'auto' or 'math' for this call."
                )
            return "math", "need_weights=True: only the math backend materialises the weights"
        if self.backend == "math":
            return "math", "backend='math' was requested"
        weight = self._a_weight()
        device, grad = weight.device, torch.is_grad_enabled()
        dropout = self.training and self.dropout > 0.0
        if self.backend == "flex":
            if dropout:
                raise ValueError(
                    f"backend='flex' in training mode with dropout={self.dropout}: flex_attention has no dropout; "
                    f"call mha.eval(), construct with dropout=0.0, or use backend='auto'."
                )
            needs_grad = grad and any(p.requires_grad for p in self.parameters())
            call = None if inputs is None else FlexCall.of(*inputs, st)
            smallest = min(self.head_dim, self.v_head_dim)  # flex's Triton kernel needs both q/k's and v's
            ok, why = flex_available(device, needs_grad, weight.dtype, head_dim=smallest, call=call)
            if not ok:
                least = flex_min_head_dim(device)
                if least is not None and smallest < least and self.q_width == self.embed_dim == self.context_width:
                    fix = (
                        f"build the module with embed_dim // num_heads >= {least} (now {self.embed_dim} // "
                        f"{self.num_heads} = {self.head_dim}: fewer heads or a wider embed_dim)"
                    )
                elif least is not None and smallest < least:
                    fix = (
                        f"build the module with head_dim and v_head_dim >= {least} (now head_dim={self.head_dim}, "
                        f"v_head_dim={self.v_head_dim})"
                    )
                elif device.type == "cpu" and needs_grad:
                    fix = "for inference call the module under torch.no_grad()"
                else:
                    fix = ""
                raise ValueError(
                    f"backend='flex' cannot run this call: {why}. Use backend='auto' (it picks the SDPA or math "
                    f"path and says why in last_backend_reason){f', or {fix}' if fix else ''}."
                )
            return "flex", None
        mode = f"{device.type} {'training' if grad else 'inference'}"
        not_flex = ""
        if self.backend == "auto" and (st.softcap is not None or st.window is not None):
            case = "softcap" if st.softcap is not None else "window"
            dropout_p = self.dropout if self.training else 0.0
            smallest = min(self.head_dim, self.v_head_dim)
            use_flex, why = flex_choice(case, T_q, device, grad, weight.dtype, dropout_p, head_dim=smallest)
            if use_flex and inputs is not None:  # past the crossover only: a one-query decode step never builds the key
                ok, failed = flex_available(device, grad, weight.dtype, call=FlexCall.of(*inputs, st))
                use_flex, why = (True, why) if ok else (False, f"flex not used: {failed}")
            if use_flex:
                what = f"softcap={st.softcap}" if case == "softcap" else f"window={st.window}"
                return "flex", f"{what}, T={T_q}, {mode}: {why}"
            not_flex = why
        if st.softcap is not None:
            if self.backend == "sdpa":
                raise ValueError(
                    f"softcap={st.softcap} applies tanh to the scores inside the softmax, which SDPA cannot express; "
                    f"use backend='auto', 'math' or 'flex'."
                )
            why_math = "softcap: SDPA cannot apply tanh to the scores, so the math backend runs"
            return "math", f"{why_math}; {not_flex}" if not_flex else why_math
        banded = no_cache and T_q == T_k and T_q >= 2 * st.window if st.window is not None else False
        if banded and T_q >= BAND_MIN_TOKENS:
            return "sdpa-band", (
                f"window={st.window}, T={T_q}, {mode}: SDPA on each query block's key band, no T x T mask "
                f"(measured 1.4x dense-mask SDPA at T=1024, 4-6x at 4096)" + (f"; {not_flex}" if not_flex else "")
            )
        if st.window is not None and not_flex:
            return "sdpa", f"window={st.window}, T={T_q}, {mode}: dense-mask SDPA; {not_flex}"
        return "sdpa", None

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
        document_ids: Tensor | None = None,
        context_parallel: ContextParallelAttention | None = None,
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
            cache_positions: ``(T_q,)`` int64 (or int32) cache slots of this call's tokens (position mode,
                see :mod:`attnlab.core.kv_cache`: fixed shapes for ``torch.compile``), on any device: positions
                elsewhere than the cache are moved to it once per call. Needs ``is_causal=True``: a query sees
                the slots at or before its own.
            rope: ``(cos, sin)`` from :func:`attnlab.core.rope.rope_cos_sin`, each ``(T_q, D)`` or
                ``(B, T_q, D)``: rotary embeddings applied to Q and to this call's K. With ``rope_dims``
                set, ``(T_q, rope_dims)`` or ``(B, T_q, rope_dims)``: the first ``rope_dims`` channels
                of each head are rotated, the rest pass through.
            document_ids: ``(B, T)`` int ids of packed sequences (self-attention, no cache): a
                query sees only keys of its own document. Rotary positions restarting at each
                document are the caller's ``rope`` (the models compute them).

        Returns:
            ``output (B, T_q, E)``, or ``(output, weights)`` when ``need_weights``.
        """
        if context_parallel is not None:
            _check_context_parallel(self, query, key, value, attn_mask, kv_cache, cache_positions, need_weights)
        key = query if key is None else key
        value = key if value is None else value
        check_forward_inputs(self, self._a_weight(), query, key, value, kv_cache, cache_positions, rope)
        if kv_cache is not None and cache_positions is not None:
            if cache_positions.device != kv_cache.k.device or cache_positions.dtype != torch.long:
                # torch.tensor([3]) is built on the CPU, as users write it: moved once (its bounds checked there
                # first) for the cache, the masks and the variants' positions alike; nothing to do when already there
                cache_positions = kv_cache.prepare_positions(cache_positions)  # (T_q,) int64 on the cache's device
        B, T_q, _ = query.shape
        H, G, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim

        q, k, v = self._project(query, key, value)  # (B, T_q, H*D), (B, T_k, G*D), (B, T_k, G*Dv)
        if self.qk_norm == "full":  # OLMo 2: over all of q's H*D and k's G*D channels
            q, k = cast(nn.RMSNorm, self.q_norm)(q), cast(nn.RMSNorm, self.k_norm)(k)
        q = q.view(B, T_q, H, D).transpose(1, 2)  # (B, H, T_q, D): heads become a batch dim
        k = k.view(B, k.size(1), G, D).transpose(1, 2)  # (B, G, T_k, D)
        v = v.view(B, v.size(1), G, Dv).transpose(1, 2)  # (B, G, T_k, Dv)
        if self.qk_norm == "head":  # Qwen 3: over each head's D channels
            q, k = cast(nn.RMSNorm, self.q_norm)(q), cast(nn.RMSNorm, self.k_norm)(k)
        if rope is not None:  # cos/sin narrower than D (rope_dims): the first rope_dims channels only
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # (B, H, T_q, D), (B, G, T_k, D)
        k_pos: Tensor | None = None  # positions of the keys when they are not their indices (a rolling cache)
        if isinstance(kv_cache, RollingKVCache):
            if self.window is None or self.window > kv_cache.window:
                raise ValueError(
                    f"a RollingKVCache of {kv_cache.window} slots serves a sliding-window layer with window <= "
                    f"{kv_cache.window}; this module has window={self.window}. Use KVCache for full attention."
                )
            k, v, k_pos = kv_cache.update_rolling(k, v, cache_positions)  # (B, G, S, D), (B, G, S, Dv), (S,)
        elif kv_cache is not None:
            k, v = kv_cache.update(k, v, cache_positions)  # (B, G, T_cached, D), (B, G, T_cached, Dv): all cached

        dropout_p = self.dropout if self.training else 0.0
        if context_parallel is not None:
            context = context_parallel.attend(
                q,
                k,
                v,
                scale=self.scale,
                is_causal=is_causal,
                key_padding_mask=key_padding_mask,
                document_ids=document_ids,
                window=self.window,
                softcap=self.softcap,
                alibi=self.alibi_slopes,
                sinks=self.sinks,
            )  # (B, H, L, D): this rank's queries over every rank's keys
            backend = "context-parallel"
            reason: str | None = repr(context_parallel)
            weights: Tensor | None = None
        elif self.has_variants or document_ids is not None or self.backend == "flex":
            context, weights, backend, reason = self._attend_variants(
                q,
                k,
                v,
                attn_mask,
                key_padding_mask,
                is_causal,
                kv_cache,
                cache_positions,
                document_ids,
                need_weights,
                dropout_p,
                k_pos,
            )
        else:
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
                k, v = _zero_padded_keys(k, v, key_padding_mask)
            backend, reason = self._choose_backend(need_weights)
            context, weights, adapted = attend(
                backend, q, k, v, masks, scale=self.scale, dropout_p=dropout_p, need_weights=need_weights
            )  # context: (B, H, T_q, Dv)
            reason = reason or adapted
        if not torch.compiler.is_compiling():  # bookkeeping only; keeps compiled graphs whole
            self.__dict__.update(last_backend=backend, last_backend_reason=reason)  # plain attrs

        context = context.transpose(1, 2).contiguous().view(B, T_q, H * Dv)  # (B, T_q, H*Dv): heads merged
        if self.gate_proj is not None:  # Qwen3-Next: sigmoid(gate) of the input, before out_proj
            context = self._gate(context, query)  # (B, T_q, H*Dv)
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


def _check_context_parallel(
    mha: MultiHeadAttention,
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    attn_mask: Tensor | Masks | None,
    kv_cache: KVCache | None,
    cache_positions: Tensor | None,
    need_weights: bool,
) -> None:
    """What context parallelism cannot take, refused in one sentence each (the shard checks are the ring's own)."""
    if (key is not None and key is not query) or (value is not None and value is not key and value is not query):
        T_k = key.size(1) if isinstance(key, Tensor) and key.dim() == 3 else "?"
        raise ValueError(
            f"context_parallel is self-attention over one sharded sequence (T_q == T_k); this call passed a "
            f"separate key/value (T_q={query.size(1) if query.dim() == 3 else '?'}, T_k={T_k}). Cross-attention is "
            f"not context-parallel: call the module without context_parallel for it (the context is usually short)."
        )
    if attn_mask is not None:
        raise ValueError(
            "context_parallel takes no attn_mask: a (T_q, T_k) mask would be one shard's rows of a full-sequence "
            "mask, which the ring cannot split. Express it as is_causal=True, key_padding_mask (sharded with "
            "cp.shard(mask, dim=1)), document_ids or the module's window, which context parallelism shards."
        )
    if kv_cache is not None or cache_positions is not None:
        raise ValueError(
            "context_parallel with a kv_cache: context parallelism shards one full sequence for training or "
            "prefill; decode one token at a time without context_parallel."
        )
    if need_weights:
        raise ValueError(
            "need_weights=True with context_parallel: the weights (B, H, T, T) are never assembled across ranks; "
            "call without need_weights, or gather the input and run the math backend on one process."
        )
    if mha.v_head_dim != mha.head_dim:
        raise ValueError(
            f"context_parallel with v_head_dim={mha.v_head_dim} != head_dim={mha.head_dim}: the ring's block kernels "
            f"hold one head dim for q, k and v; call the module without context_parallel, or build it with "
            f"v_head_dim=None (= head_dim)."
        )
    if mha.training and mha.dropout > 0.0:
        raise ValueError(
            f"context_parallel in training mode with dropout={mha.dropout}: attention dropout across ranks would "
            f"not reproduce the single-process masks; construct with dropout=0.0 or call mha.eval()."
        )


def _zero_padded_keys(k: Tensor, v: Tensor, key_padding_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``k, v (B, G, T_k, D)`` with the padded keys' rows zeroed. Padded keys are never attended, but
    0 * NaN is NaN: whatever a caller left in the padding (NaN, inf) must not reach the output through
    the zero weights. Called after the masks are built, which validate ``key_padding_mask (B, T_k)``."""
    pad = key_padding_mask[:, None, :, None]  # (B, 1, T_k, 1)
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)


def _split_fused_in_proj(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
    """Load-time hook: a state dict from before the projections were separate holds one
    ``in_proj`` (rows Q, then K, then V); split it into ``q_proj``/``k_proj``/``v_proj``."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}in_proj.{kind}", None)
        if fused is None:
            continue
        sizes = [cast(int, getattr(module, name)) for name in ("q_width", "kv_dim", "v_width")]  # H*D, G*D, G*Dv
        if fused.size(0) != sum(sizes):
            plain = sizes[0] == getattr(module, "embed_dim") and sizes[1] == sizes[2]  # noqa: B009
            widths = (
                "embed_dim + 2 * num_kv_heads * head_dim"
                if plain
                else "num_heads * head_dim + num_kv_heads * head_dim + num_kv_heads * v_head_dim"
            )
            raise ValueError(
                f"{prefix}in_proj.{kind} has {fused.size(0)} rows; this module expects {sum(sizes)} "
                f"({widths} = {' + '.join(map(str, sizes))}): the checkpoint "
                "was written by a module of another shape; build the module with that checkpoint's sizes."
            )
        for name, part in zip(("q_proj", "k_proj", "v_proj"), torch.split(fused, sizes), strict=True):
            state_dict[f"{prefix}{name}.{kind}"] = part
