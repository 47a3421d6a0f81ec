"""``FusedQKVAttention``: the ViT-style self-attention of timm and open_clip, computed by attnlab.

Notation: B batch, T tokens, C ``dim`` (input width), H heads, D head dim, A = H * D attention width,
C' ``dim_out`` (output width; C unless timm's ``dim_out``).

timm's ``Attention`` and open_clip's ``Attention`` project Q, K and V with one fused matrix (timm's
``qkv`` Linear, open_clip's ``in_proj_weight``), rows Q then K then V. Here the three are real
``nn.Linear`` children, ``q_proj``/``k_proj``/``v_proj`` ``C -> A`` (so LoRA, hooks and freezing
work on each), split from the fused rows by :meth:`FusedQKVAttention.from_timm` and
:meth:`FusedQKVAttention.from_open_clip`. Everything else the source module owns (its q/k norms,
its norm before the output projection, the output projection itself, its output dropout) is moved
over as the same module object, so its parameters, hooks and initialisation are the user's own.

At this edge the source's conventions hold, inside attnlab's:

=======================  =======================================  =========================================
                         timm (``mask_convention="keep"``)        open_clip (``mask_convention="block"``)
=======================  =======================================  =========================================
bool ``attn_mask``       True = may attend (SDPA's)               True = blocked (``masked_fill(mask, -inf)``)
float ``attn_mask``      added to the scores                      added to the scores
2-D / 3-D mask           broadcast right-aligned to (B, H, T, T)  ``(T, T)`` / ``(B*H, T, T)``
=======================  =======================================  =========================================

The forward is ``forward(x, attn_mask=None, is_causal=False) -> (B, T, C')``, timm's signature
(open_clip's is the same without ``is_causal``).
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention
from ..core.dispatch import attend
from ..core.masks import Masks
from ..core.validation import Backend, check_like_weight

__all__ = ["FusedQKVAttention", "MaskConvention"]

MaskConvention = Literal["keep", "block"]


class FusedQKVAttention(MultiHeadAttention):
    r"""Self-attention with timm's / open_clip's structure and attnlab's attention.

    ``out = proj_drop(out_proj(gate * inner_norm(merge(head_scale * attend(q_norm(q), k_norm(k), v)))))``
    with ``q, k, v = q_proj(x), k_proj(x), v_proj(x)`` split into heads; ``gate`` (timm's ``gated``) is
    ``sigmoid(gate_proj(x))``, ``head_scale`` (open_clip's ``scale_heads``) a per-head gain ``(H, 1, 1)``;
    absent pieces are identities.

    Args:
        dim: C, width of ``x``.
        num_heads: H.
        head_dim: D; default ``dim // num_heads``.
        dim_out: C', width of the output; default ``dim``.
        qkv_bias: biases on ``q_proj``/``k_proj``/``v_proj`` (and on ``gate_proj``).
        proj_bias: bias on ``out_proj``.
        attn_drop: dropout probability on the attention weights, in training mode only.
        proj_drop: dropout probability after ``out_proj``.
        gated: a sigmoid gate ``gate_proj (C -> A)`` on the merged heads (timm's ``gated=True``).
        scale_heads: a learned per-head gain ``head_scale (H, 1, 1)`` on each head's context.
        mask_convention: ``"keep"`` (timm, SDPA) or ``"block"`` (open_clip); see the module docstring.
        backend: ``"auto"``, ``"math"`` or ``"sdpa"``, as :class:`attnlab.MultiHeadAttention`.

    ``q_norm``/``k_norm`` (per head, over D; ``nn.Identity`` unless set) and ``inner_norm`` (over A,
    before ``out_proj``) are plain child modules: the ``from_*`` constructors move the source's own
    (timm's LayerNorm, or whatever ``norm_layer`` built) so that they run exactly as they did.
    ``scale`` is ``D ** -0.5`` as in both sources.

    ``embed_dim`` (inherited) is A, the attention width; ``dim`` and ``dim_out`` are the widths in and out.

    State dicts: its own keys are ``q_proj``/``k_proj``/``v_proj``/``out_proj``/``q_norm``/``k_norm``/
    ``inner_norm``/``gate_proj``/``head_scale``; a state dict in the source's keys (a timm or open_clip
    checkpoint: ``qkv.*``, ``proj.*``, ``norm.*``, ``gate.*`` / ``in_proj_weight``, ``ln_q.*``, ...) also
    loads, its fused rows split on load, so a swapped model still loads the checkpoints of the original.
    """

    q_norm: nn.Module  # type: ignore[assignment]  # the source's per-head norm (any module), not attnlab's RMSNorm
    k_norm: nn.Module  # type: ignore[assignment]

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        dim_out: int | None = None,
        qkv_bias: bool = False,
        proj_bias: bool = True,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        gated: bool = False,
        scale_heads: bool = False,
        mask_convention: MaskConvention = "keep",
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if mask_convention not in ("keep", "block"):
            raise ValueError(
                f"mask_convention must be 'keep' (bool True = may attend, timm's and SDPA's) or 'block' "
                f"(bool True = blocked, open_clip's), got {mask_convention!r}."
            )
        head_dim = dim // num_heads if head_dim is None else head_dim
        attn_dim = num_heads * head_dim  # A
        # The parent builds its projections on the meta device (no memory); ours replace them below.
        super().__init__(attn_dim, num_heads, kdim=dim, vdim=dim, dropout=attn_drop, backend=backend, device="meta")
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.dim, self.dim_out = dim, (dim if dim_out is None else dim_out)
        self.mask_convention: MaskConvention = mask_convention
        self.q_proj = nn.Linear(dim, attn_dim, bias=qkv_bias, **factory)  # C -> A
        self.k_proj = nn.Linear(dim, attn_dim, bias=qkv_bias, **factory)  # C -> A
        self.v_proj = nn.Linear(dim, attn_dim, bias=qkv_bias, **factory)  # C -> A
        self.out_proj = nn.Linear(attn_dim, self.dim_out, bias=proj_bias, **factory)  # A -> C'
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.inner_norm: nn.Module = nn.Identity()
        self.gate_proj: nn.Linear | None = nn.Linear(dim, attn_dim, bias=qkv_bias, **factory) if gated else None
        self.head_scale: nn.Parameter | None = (
            nn.Parameter(torch.ones(num_heads, 1, 1, **factory)) if scale_heads else None  # (H, 1, 1)
        )
        self.proj_drop: nn.Module = nn.Dropout(proj_drop)
        self.register_load_state_dict_pre_hook(_load_source_keys)  # a timm / open_clip checkpoint loads too

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, num_heads={self.num_heads}, head_dim={self.head_dim}"
        if self.dim_out != self.dim:
            s += f", dim_out={self.dim_out}"
        if self.head_scale is not None:
            s += ", scale_heads=True"
        return s + f", dropout={self.dropout}, mask_convention={self.mask_convention!r}, backend={self.backend!r}"

    # -- construction from the sources -----------------------------------------------------
    @classmethod
    def from_timm(cls, m: nn.Module, *, backend: Backend = "auto") -> FusedQKVAttention:
        """An attnlab module computing what timm's ``Attention`` ``m`` computes, with its weights.

        ``m.qkv`` (rows Q, K, V) is split into ``q_proj``/``k_proj``/``v_proj``; ``m.q_norm``,
        ``m.k_norm``, ``m.norm``, ``m.proj``, ``m.proj_drop`` (and ``m.gate``) are moved as they are.
        Refuses (ValueError) a module whose ``qkv`` is not a plain ``nn.Linear`` (a LoRA-wrapped one,
        say), since splitting it would drop the wrapper; :func:`attnlab.swap` reports why instead.
        """
        qkv, proj = _plain_linear(m, "qkv"), _plain_linear(m, "proj")
        num_heads, head_dim = int(cast(int, m.num_heads)), int(cast(int, m.head_dim))
        _check_default_scale(m, head_dim)
        gate = getattr(m, "gate", None)
        ours = cls(
            qkv.in_features,
            num_heads,
            head_dim=head_dim,
            dim_out=proj.out_features,
            qkv_bias=qkv.bias is not None,
            proj_bias=proj.bias is not None,
            attn_drop=float(cast(nn.Dropout, m.attn_drop).p),
            gated=gate is not None,
            mask_convention="keep",
            backend=backend,
            device="meta",
        )
        ours._take_fused(qkv.weight, qkv.bias, qkv.training)
        ours.out_proj = proj
        ours.q_norm, ours.k_norm = cast(nn.Module, m.q_norm), cast(nn.Module, m.k_norm)
        ours.inner_norm = cast(nn.Module, m.norm)
        ours.proj_drop = cast(nn.Module, m.proj_drop)
        if gate is not None:
            ours.gate_proj = _plain_linear(m, "gate")
        ours.training = m.training
        return ours

    @classmethod
    def from_open_clip(cls, m: nn.Module, *, backend: Backend = "auto") -> FusedQKVAttention:
        """An attnlab module computing what open_clip's ``transformer.Attention`` ``m`` computes.

        ``m.in_proj_weight``/``in_proj_bias`` (rows Q, K, V) are split into the three projections;
        ``ln_q``, ``ln_k``, ``ln_inner``, ``out_proj``, ``out_drop`` and ``head_scale`` are moved.
        Refuses (ValueError) ``scaled_cosine=True``: see :func:`attnlab.swap`'s report for why.
        """
        if getattr(m, "logit_scale", None) is not None:
            raise ValueError(
                "open_clip Attention with scaled_cosine=True: its own forward calls torch.bmm on 4-D "
                "(B, H, T, D) tensors and fails on every input (open_clip 3.3.0), so there is no output to match."
            )
        _check_default_scale(m, int(cast(int, m.head_dim)))
        weight = cast(nn.Parameter, m.in_proj_weight)  # (3A, C)
        bias = cast("nn.Parameter | None", m.in_proj_bias)  # (3A,) or None
        out = _plain_linear(m, "out_proj")
        head_scale = cast("nn.Parameter | None", getattr(m, "head_scale", None))
        ours = cls(
            weight.size(1),
            int(cast(int, m.num_heads)),
            head_dim=int(cast(int, m.head_dim)),
            dim_out=out.out_features,
            qkv_bias=bias is not None,
            proj_bias=out.bias is not None,
            attn_drop=float(cast(nn.Dropout, m.attn_drop).p),
            scale_heads=head_scale is not None,
            mask_convention="block",
            backend=backend,
            device="meta",
        )
        ours._take_fused(weight, bias, m.training)
        ours.out_proj = out
        ours.q_norm, ours.k_norm = cast(nn.Module, m.ln_q), cast(nn.Module, m.ln_k)
        ours.inner_norm = cast(nn.Module, m.ln_inner)
        ours.proj_drop = cast(nn.Module, m.out_drop)
        if head_scale is not None:
            ours.head_scale = head_scale  # the same Parameter: an optimizer holding it still updates it
        ours.training = m.training
        return ours

    def _take_fused(self, weight: Tensor, bias: Tensor | None, training: bool) -> None:
        """Split fused rows ``weight (3A, C)``, ``bias (3A,)`` into ``q_proj``/``k_proj``/``v_proj``:
        new Parameters (copies) on the fused weight's device and dtype, with its ``requires_grad``."""
        A = self.embed_dim
        if weight.shape != (3 * A, self.dim):
            raise ValueError(
                f"the fused QKV weight has shape {tuple(weight.shape)}; expected (3 * H * D, C) = ({3 * A}, {self.dim})."
            )
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            lin = nn.Linear(self.dim, A, bias=bias is not None, device="meta")
            rows = slice(i * A, (i + 1) * A)  # Q rows, then K rows, then V rows
            lin.weight = nn.Parameter(weight.detach()[rows].clone(), requires_grad=weight.requires_grad)  # (A, C)
            if bias is not None:
                lin.bias = nn.Parameter(bias.detach()[rows].clone(), requires_grad=bias.requires_grad)  # (A,)
            lin.training = training
            setattr(self, name, lin)

    # -- forward -------------------------------------------------------------------------
    def forward(  # type: ignore[override]  # the source's signature, not MultiHeadAttention's
        self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        """Self-attention over ``x (B, T, C)``; returns ``(B, T, C')``.

        Args:
            x: ``(B, T, C)``.
            attn_mask: bool or float, in the source's convention (``mask_convention``), broadcastable
                to ``(B, H, T, T)``.
            is_causal: causal masking (query i sees keys j <= i); not together with ``attn_mask``.
        """
        self._check_x(x)
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = self._project(x, x, x)  # (B, T, A) each
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        q, k = self.q_norm(q), self.k_norm(k)  # per head, over D, as the source does
        masks = self._masks(attn_mask, is_causal, B, T, q.dtype)
        backend, reason = self._choose_backend(need_weights=False)
        dropout_p = self.dropout if self.training else 0.0
        context, _, adapted = attend(backend, q, k, v, masks, scale=self.scale, dropout_p=dropout_p)  # (B, H, T, D)
        if not torch.compiler.is_compiling():
            self.__dict__.update(last_backend=backend, last_backend_reason=reason or adapted)
        if self.head_scale is not None:
            context = context * self.head_scale  # (B, H, T, D) * (H, 1, 1)
        context = context.transpose(1, 2).reshape(B, T, H * D)  # (B, T, A): heads merged
        context = self.inner_norm(context)  # (B, T, A)
        if self.gate_proj is not None:
            context = context * self.gate_proj(x).sigmoid()  # (B, T, A)
        out: Tensor = self.proj_drop(self.out_proj(context))  # (B, T, C')
        return out

    def _check_x(self, x: object) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor of shape (B, T, C={self.dim}), got {type(x).__name__}.")
        if x.dim() != 3 or x.size(-1) != self.dim:
            raise ValueError(
                f"x has shape {tuple(x.shape)}; expected (B, T, C) with C = dim = {self.dim} (this module is "
                f"batch-first self-attention, as the {'timm' if self.mask_convention == 'keep' else 'open_clip'} "
                f"module it replaced)."
            )
        check_like_weight("x", x, self._a_weight(), module="module")

    def _masks(self, attn_mask: Tensor | None, is_causal: bool, B: int, T: int, dtype: torch.dtype) -> Masks:
        """The source's ``attn_mask`` (and ``is_causal``) as attnlab's :class:`Masks` (bool keep + float bias)."""
        if attn_mask is None:
            return Masks(causal=is_causal)
        if is_causal:
            raise ValueError(
                "attn_mask and is_causal=True were both given; timm's two paths disagree on that call (its SDPA path "
                "raises, its manual path ignores attn_mask), so there is no answer to match: fold the causal mask "
                "into attn_mask, or pass one of them."
            )
        if not isinstance(attn_mask, Tensor) or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
            got = type(attn_mask).__name__ if not isinstance(attn_mask, Tensor) else f"dtype {attn_mask.dtype}"
            polarity = "True = may attend" if self.mask_convention == "keep" else "True = blocked"
            raise TypeError(
                f"attn_mask must be a bool tensor ({polarity}) or a float tensor added to the scores, got {got}."
            )
        H = self.num_heads
        mask = attn_mask
        if self.mask_convention == "block" and mask.dim() == 3:
            if mask.size(0) != B * H:
                raise ValueError(
                    f"attn_mask has shape {tuple(mask.shape)}; a 3-D mask here is (B*H, T, T) = ({B * H}, {T}, {T}) "
                    f"as open_clip reads it (row b*H + h: batch b, head h)."
                )
            mask = mask.reshape(B, H, T, T)  # (B*H, T, T) -> (B, H, T, T)
        if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(mask.shape[::-1], (T, T, H, B), strict=False)):
            raise ValueError(
                f"attn_mask has shape {tuple(mask.shape)}, which does not broadcast to the scores' (B, H, T, T) = "
                f"({B}, {H}, {T}, {T}); pass (T, T) or a mask whose dims are 1 or those."
            )
        mask4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # right-aligned, as broadcasting: (.., T, T)
        if mask4.device != self._a_weight().device:
            raise ValueError(f"attn_mask is on {mask4.device} but x is on {self._a_weight().device}; move it there.")
        if mask4.dtype == torch.bool:
            keep = mask4 if self.mask_convention == "keep" else ~mask4  # True = may attend
            return Masks(keep=keep, empty_rows=True)
        return Masks(keep=mask4 != float("-inf"), bias=mask4.to(dtype), empty_rows=True)  # -inf rows: fully masked


# The source's state-dict names (timm's, open_clip's) -> ours; the fused QKV rows are split separately.
_SOURCE_NAMES = {
    "proj.": "out_proj.",
    "norm.": "inner_norm.",
    "gate.": "gate_proj.",
    "ln_q.": "q_norm.",
    "ln_k.": "k_norm.",
    "ln_inner.": "inner_norm.",
}


def _load_source_keys(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
    """Load-time hook: a timm / open_clip state dict (``qkv.weight`` or ``in_proj_weight``, rows Q, K, V;
    ``proj.*``, ``ln_q.*``, ...) in this module's own keys."""
    fused = {"qkv.weight": "weight", "qkv.bias": "bias", "in_proj_weight": "weight", "in_proj_bias": "bias"}
    for key, kind in fused.items():
        rows = state_dict.pop(prefix + key, None)  # (3A, C) or (3A,)
        if rows is None:
            continue
        A = cast(int, getattr(module, "embed_dim"))  # noqa: B009
        if rows.size(0) != 3 * A:
            raise ValueError(
                f"{prefix}{key} has {rows.size(0)} rows; this module expects 3 * H * D = {3 * A} (Q, K, V rows): the "
                f"checkpoint was written by a module of another shape."
            )
        for name, part in zip(("q_proj", "k_proj", "v_proj"), rows.split(A), strict=True):
            state_dict[f"{prefix}{name}.{kind}"] = part
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        for theirs, ours in _SOURCE_NAMES.items():
            if rest.startswith(theirs):
                state_dict[prefix + ours + rest[len(theirs) :]] = state_dict.pop(key)
                break


def _check_default_scale(m: nn.Module, head_dim: int) -> None:
    """Both sources' SDPA paths scale by ``D ** -0.5`` whatever ``m.scale`` says; their manual paths read
    ``m.scale``. A changed ``m.scale`` makes the two disagree: there is no one answer to reproduce."""
    scale = getattr(m, "scale", None)
    if scale is not None and not math.isclose(float(scale), head_dim**-0.5, rel_tol=1e-12):
        raise ValueError(
            f"{type(m).__name__}.scale is {scale}, not head_dim ** -0.5 = {head_dim**-0.5:.6g}; its SDPA path ignores "
            f"scale and its manual path uses it, so the module has no one output to match"
        )


def _plain_linear(m: nn.Module, name: str) -> nn.Linear:
    """``m.<name>``, which must be exactly an ``nn.Linear`` (a subclass or wrapper may compute something else)."""
    child = getattr(m, name, None)
    if type(child) is not nn.Linear:
        raise ValueError(
            f"{type(m).__name__}.{name} is a {type(child).__name__}, not an nn.Linear; attnlab splits or moves only "
            f"plain Linear projections, so that the replacement computes exactly what the original did."
        )
    return child
