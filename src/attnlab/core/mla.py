"""Multi-head latent attention (MLA, DeepSeek-V2 section 2.1; DeepSeek-V3), written twice: as the paper states it
and in the absorbed form that decoding runs, behind one signature, with a test that they agree to rounding.

Notation of every shape comment here:
    B batch, T query positions (T_q), S key positions (the cache's slots or T), E ``hidden_size``, H heads,
    C ``kv_lora_rank`` (the cached latent), R ``qk_rope_head_dim`` (the decoupled rotary key, one for all
    heads), N ``qk_nope_head_dim``, Dv ``v_head_dim``, Q ``q_lora_rank`` (the query latent, when there is one).

What every token leaves in the cache is one row ``[c_KV | k_R]`` of ``C + R`` values (576 for DeepSeek-V3),
not ``H`` keys and values: ``c_KV = RMSNorm(W_DKV h)`` and ``k_R = RoPE(W_KR h)`` (both from
``kv_a_proj_with_mqa``). Queries are ``[q_C | q_R]`` per head (from ``q_proj``, or ``q_a_proj`` ->
``q_a_layernorm`` -> ``q_b_proj``). ``kv_b_proj``'s weight holds, per head, ``W_UK (N, C)`` over ``W_UV (Dv, C)``.

The two paths (``path=``), each ending in attnlab's attention (:func:`attnlab.core.dispatch.attend`, math or SDPA):

=========================  ==============================================  =============================================
step                       naive (the paper's form, HF's)                  absorbed (vLLM's decode form)
=========================  ==============================================  =============================================
keys, values               ``k_C = W_UK c_KV`` (B, H, S, N), ``v = W_UV     none built: the rows ``[c_KV | k_R]``
                           c_KV`` (B, H, S, Dv), from every cached latent  (B, 1, S, C + R) are the keys, ``c_KV``
                                                                           (B, 1, S, C) the values
key per head               ``[k_C | k_R]`` (B, H, S, N + R)                one key head shared by all H (MQA)
query per head             ``[q_C | q_R]`` (B, H, T, N + R)                ``[q_C W_UK | q_R]`` (B, H, T, C + R), folded
                                                                           into H*T query rows (B, 1, H*T, C + R)
attention                  (B, H, T, S) scores, context (B, H, T, Dv)      (B, 1, H*T, S) scores, context (B, H, T, C)
after attention            -                                               ``W_UV`` per head: (B, H, T, Dv)
output                     ``o_proj``: (B, T, H*Dv) -> (B, T, E)           the same
=========================  ==============================================  =============================================

Both use the same scores, since ``q_C . (W_UK c) = (W_UK^T q_C) . c``, and the same scale ``1/sqrt(N + R)``, the
query-key head dim of the paper's form (never the latent width ``C + R``). The naive path multiplies every cached
latent by ``kv_b_proj`` on every call (``S * C * H * (N + Dv)`` multiply-adds); the absorbed one multiplies only
the ``T`` queries, but its attention is ``C + R`` wide instead of ``N + R``. So absorbed wins when few queries
read many keys (decode), naive when many queries read as many keys (prefill, training): ``path="auto"`` counts
both (:func:`path_costs`).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dispatch import attend
from .functional import causal_keep
from .masks import Masks, prepare_masks
from .mla_cache import MLACache
from .rope import apply_rope, apply_rope_interleaved
from .validation import check_cache_positions, check_rope_pair

__all__ = [
    "MLABackend",
    "MLAPath",
    "MultiHeadLatentAttention",
    "mla_absorbed",
    "mla_naive",
    "mla_reference",
    "path_costs",
]

MLAPath = Literal["auto", "naive", "absorbed"]
MLA_PATHS: tuple[str, ...] = get_args(MLAPath)
MLABackend = Literal["auto", "math", "sdpa"]
MLA_BACKENDS: tuple[str, ...] = get_args(MLABackend)


# -- the two paths, one signature -----------------------------------------------------------------------------
def mla_naive(
    q_nope: Tensor, q_rot: Tensor, kv: Tensor, w_kv_b: Tensor, masks: Masks, *, backend: str, scale: float
) -> tuple[Tensor, str | None]:
    """The paper's form: every latent expanded into per-head keys and values, then ordinary multi-head attention.

    Args:
        q_nope: ``q_C`` (B, H, T, N). q_rot: ``q_R`` (B, H, T, R), already rotated.
        kv: the rows ``[c_KV | k_R]`` (B, S, C + R) of the keys (a cache's buffer or this call's).
        w_kv_b: ``kv_b_proj.weight`` (H*(N + Dv), C): per head ``W_UK`` (N rows) over ``W_UV`` (Dv rows).
        masks: converted for (B, H, T, S) scores (:func:`attnlab.core.masks.prepare_masks`).
        backend: ``"math"`` or ``"sdpa"``. scale: multiplier of the scores.

    Returns: ``(context (B, H, T, Dv), how SDPA was adapted or None)``.
    """
    B, H, _, N = q_nope.shape
    S, R = kv.size(1), q_rot.size(-1)
    C, Dv = kv.size(-1) - R, w_kv_b.size(0) // H - N
    latent, k_rot = torch.split(kv, [C, R], dim=-1)  # (B, S, C), (B, S, R)
    kv_heads = F.linear(latent, w_kv_b)  # (B, S, C) @ (C, H*(N+Dv)) -> (B, S, H*(N+Dv)): every key, every head
    kv_heads = kv_heads.view(B, S, H, N + Dv).transpose(1, 2)  # (B, H, S, N+Dv)
    k_nope, v = torch.split(kv_heads, [N, Dv], dim=-1)  # k_C (B, H, S, N), v_C (B, H, S, Dv)
    k = torch.cat((k_nope, k_rot[:, None].expand(B, H, S, R)), dim=-1)  # (B, H, S, N+R): k_R joins every head
    q = torch.cat((q_nope, q_rot), dim=-1)  # (B, H, T, N+R)
    context, _, adapted = attend(backend, q, k, v, masks, scale=scale)  # (B, H, T, Dv)
    return context, adapted


def mla_absorbed(
    q_nope: Tensor, q_rot: Tensor, kv: Tensor, w_kv_b: Tensor, masks: Masks, *, backend: str, scale: float
) -> tuple[Tensor, str | None]:
    """The absorbed form: ``W_UK`` folded into the queries, attention over the latent rows as one key/value head
    (MQA, the H heads as H*T query rows), ``W_UV`` applied to each head's latent context afterwards.

    Arguments and result as :func:`mla_naive`.
    """
    B, H, T, N = q_nope.shape
    S, R = kv.size(1), q_rot.size(-1)
    C, Dv = kv.size(-1) - R, w_kv_b.size(0) // H - N
    w_uk, w_uv = torch.split(w_kv_b.view(H, N + Dv, C), [N, Dv], dim=1)  # W_UK (H, N, C), W_UV (H, Dv, C)
    q_latent = q_nope @ w_uk  # (B, H, T, N) @ (H, N, C) -> (B, H, T, C): the query, in latent space
    q = torch.cat((q_latent, q_rot), dim=-1)  # (B, H, T, C+R)
    q = q.reshape(B, 1, H * T, C + R)  # (B, 1, H*T, C+R): row h*T + t, all reading one key head
    k = kv[:, None]  # (B, 1, S, C+R): the rows are the keys, as they lie in the cache
    v = kv[:, None, :, :C]  # (B, 1, S, C): their latents are the values (a view)
    # One key head with H*T queries, not H heads over a shared one (SDPA's enable_gqa): the rows are read once.
    # Measured, SDPA alone, one query a head, H=16, S=4096, C+R=288, fp32, 1 CPU thread, torch 2.13: 134 ms with
    # enable_gqa against 2.5 ms folded.
    context, _, adapted = attend(backend, q, k, v, _fold_heads(masks, H, T, S, q.device), scale=scale)
    context = context.reshape(B, H, T, C)  # (B, 1, H*T, C) -> (B, H, T, C): each head's latent context
    context = context @ w_uv.transpose(1, 2)  # (B, H, T, C) @ (H, C, Dv) -> (B, H, T, Dv): W_UV per head
    return context, adapted


def _fold_heads(masks: Masks, heads: int, q_len: int, k_len: int, device: torch.device) -> Masks:
    """Masks of (B, H, T, S) scores as masks of (B, 1, H*T, S) scores, row ``h*T + t`` being head h's query t."""
    keep = masks.keep
    if masks.causal:  # square causal left to SDPA: the rows no longer are positions, so it is written out
        tri = causal_keep(q_len, k_len, device)[None, None]  # (1, 1, T, S)
        keep = tri if keep is None else keep & tri
    return Masks(
        keep=_fold_mask(keep, heads, q_len),
        bias=_fold_mask(masks.bias, heads, q_len),
        causal=False,
        empty_rows=masks.empty_rows,
    )


def _fold_mask(mask: Tensor | None, heads: int, q_len: int) -> Tensor | None:
    if mask is None:
        return None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, T|1, S): a causal (T, S) too
    if mask.size(1) == 1 and mask.size(2) == 1:
        return mask  # (B|1, 1, 1, S): the same for every row, folded or not
    b, S = mask.size(0), mask.size(3)
    return mask.expand(b, heads, q_len, S).reshape(b, 1, heads * q_len, S)  # (B|1, 1, H*T, S)


def path_costs(
    q_len: int,
    k_len: int,
    *,
    heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> tuple[int, int]:
    """Multiply-adds of one MLA attention call, ``(naive, absorbed)``, for ``T = q_len`` queries over ``S = k_len``
    keys (projections shared by both paths left out).

    naive: expand every key ``S*H*C*(N+Dv)``, scores ``T*S*H*(N+R)``, context ``T*S*H*Dv``.
    absorbed: fold ``W_UK`` into the queries ``T*H*N*C``, scores ``T*S*H*(C+R)``, context ``T*S*H*C``,
    ``W_UV`` ``T*H*C*Dv``.

    Checked against the clock with scripts/mla_paths.py (one thread of a shared 2-core CPU, torch 2.13, fp32,
    B=1, E=1024, H=16, C=256, R=32, N=Dv=64, SDPA), ms naive / absorbed, ``T_q x S``: 1 x 256 10.2 / 1.3,
    1 x 4096 121 / 6.2, 16 x 4096 155 / 23, 64 x 4096 139 / 84, 256 x 4096 386 / 481, 256 x 256 40 / 52,
    1024 x 1024 308 / 629. The count picks the faster path in each. It turns at
    ``T_q = S C (N+Dv) / (S (2C - N - Dv) + C (N+Dv))``, which tends to ``C (N+Dv) / (2C - N - Dv)`` for a long
    cache: 84 queries at S=4096 here, 171 at DeepSeek-V3's shapes.
    """
    T, S, H = q_len, k_len, heads
    C, N, R, Dv = kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
    naive = S * H * C * (N + Dv) + T * S * H * (N + R + Dv)
    absorbed = T * H * N * C + T * S * H * (C + R + C) + T * H * C * Dv
    return naive, absorbed


# -- the module ---------------------------------------------------------------------------------------------------
class MultiHeadLatentAttention(nn.Module):
    r"""Multi-head latent attention (DeepSeek-V2/V3), batch-first, self-attention, with a latent KV cache.

    Args:
        hidden_size: E, width of the input and of the output.
        num_heads: H.
        kv_lora_rank: C, width of the latent ``c_KV`` every token caches (DeepSeek-V3: 512).
        qk_nope_head_dim: N, per-head query/key channels without rotary (V3: 128).
        qk_rope_head_dim: R, rotary channels: per head in the query, one key shared by all heads (V3: 64). Even.
        v_head_dim: Dv, per-head value channels (V3: 128).
        q_lora_rank: Q, width of the query latent (V3: 1536: ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``);
            None: one ``q_proj`` (V2-Lite).
        rope_interleave: the rotary channels come in adjacent pairs (DeepSeek's checkpoints; HF's
            ``rope_interleave``, default True) rather than half-split (Llama's layout).
        norm_eps: epsilon of the two RMSNorms (HF builds them with 1e-6 whatever the config says).
        attention_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (HF's ``attention_bias``;
            ``q_proj``, ``q_b_proj`` and ``kv_b_proj`` never have one).
        scale: multiplier of the scores; default ``1/sqrt(N + R)`` (for YaRN, pass HF's ``mscale``-adjusted one).
        path: ``"naive"``, ``"absorbed"`` or ``"auto"`` (the cheaper of the two for the call's T and S, counted
            by :func:`path_costs`). A public attribute: may be changed between calls.
        backend: ``"auto"`` (SDPA), ``"math"`` or ``"sdpa"``, as :class:`attnlab.MultiHeadAttention`'s.

    Modules, named as in Hugging Face's ``DeepseekV3Attention`` so that its state dict loads as it is:
    ``q_proj`` (E -> H*(N+R)) or ``q_a_proj`` (E -> Q), ``q_a_layernorm`` (Q), ``q_b_proj`` (Q -> H*(N+R));
    ``kv_a_proj_with_mqa`` (E -> C + R), ``kv_a_layernorm`` (C), ``kv_b_proj`` (C -> H*(N+Dv)); ``o_proj``
    (H*Dv -> E). ``kv_b_proj`` must stay an ``nn.Linear`` without bias: both paths read its weight as a matrix.

    Shapes of ``forward``, stage by stage (see the module docstring for the two paths side by side):

    * ``hidden_states`` (B, T, E);
    * queries ``(B, T, H*(N+R))`` -> ``q_C (B, H, T, N)`` and ``q_R (B, H, T, R)``, rotated;
    * ``kv_a_proj_with_mqa``: (B, T, C + R) -> ``c_KV (B, T, C)`` normalised, ``k_R (B, T, R)`` rotated; the rows
      ``[c_KV | k_R]`` (B, T, C + R) are what the cache keeps; with a cache, S = its filled or all slots;
    * naive: keys (B, H, S, N+R), values (B, H, S, Dv); absorbed: queries (B, 1, H*T, C+R) over the rows
      (B, 1, S, C+R), latent context (B, H, T, C) -> (B, H, T, Dv);
    * context (B, H, T, Dv) -> (B, T, H*Dv) -> ``o_proj`` -> output (B, T, E).

    Masks as :class:`attnlab.MultiHeadAttention`'s: ``attn_mask`` bool (True = may attend) or float (added),
    ``key_padding_mask (B, S)`` True = padding, ``is_causal`` bottom-right aligned. A query with every key masked
    gets a context of zeros (its output is ``o_proj.bias``), never NaN.

    After each call ``last_path`` says which path ran, ``last_backend`` which backend, and
    ``last_backend_reason`` why that path (and how SDPA was adapted, when it was).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        rope_interleave: bool = True,
        norm_eps: float = 1e-6,
        attention_bias: bool = False,
        scale: float | None = None,
        path: MLAPath = "auto",
        backend: MLABackend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_init_args(
            hidden_size, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank, norm_eps
        )
        if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0):
            raise ValueError(
                f"scale must be a positive float (default 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = "
                f"{1 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim):.4g}), got {scale!r}."
            )
        for name, flag in (("rope_interleave", rope_interleave), ("attention_bias", attention_bias)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r} ({type(flag).__name__}).")
        self.hidden_size = hidden_size  # E
        self.num_heads = num_heads  # H
        self.kv_lora_rank = kv_lora_rank  # C: the cache's latent width
        self.q_lora_rank = q_lora_rank  # Q, or None for one q_proj
        self.qk_nope_head_dim = qk_nope_head_dim  # N
        self.qk_rope_head_dim = qk_rope_head_dim  # R
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim  # N + R: what the scale is taken from, on both paths
        self.v_head_dim = v_head_dim  # Dv
        self.rope_interleave = rope_interleave
        self.scale = 1.0 / math.sqrt(self.qk_head_dim) if scale is None else float(scale)
        self.path = path
        self.backend = backend
        self.last_path: str | None = None
        self.last_backend: str | None = None
        self.last_backend_reason: str | None = None

        factory = {"device": device, "dtype": dtype}
        H, N, R, Dv, C = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank
        # Typed as nn.Module: a user may swap in any module computing (..., in) -> (..., out) (but see kv_b_proj).
        self.q_proj: nn.Module | None = None
        self.q_a_proj: nn.Module | None = None
        self.q_a_layernorm: nn.Module | None = None
        self.q_b_proj: nn.Module | None = None
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, H * (N + R), bias=False, **factory)  # E -> H*(N+R)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias, **factory)  # E -> Q: c_Q
            self.q_a_layernorm = nn.RMSNorm(
                q_lora_rank, eps=norm_eps, device=device, dtype=dtype
            )  # over c_Q's Q channels
            self.q_b_proj = nn.Linear(q_lora_rank, H * (N + R), bias=False, **factory)  # Q -> H*(N+R): W_UQ, W_QR
        self.kv_a_proj_with_mqa: nn.Module = nn.Linear(
            hidden_size, C + R, bias=attention_bias, **factory
        )  # W_DKV, W_KR
        self.kv_a_layernorm: nn.Module = nn.RMSNorm(
            C, eps=norm_eps, device=device, dtype=dtype
        )  # over c_KV's C channels
        self.kv_b_proj = nn.Linear(C, H * (N + Dv), bias=False, **factory)  # C -> H*(N+Dv): W_UK, W_UV per head
        self.o_proj: nn.Module = nn.Linear(H * Dv, hidden_size, bias=attention_bias, **factory)  # W_O
        self.reset_parameters()

    @property
    def path(self) -> str:
        """``"auto"``, ``"naive"`` or ``"absorbed"``; may be changed between calls."""
        return str(self.__dict__["_path"])

    @path.setter
    def path(self, value: str) -> None:
        if value not in MLA_PATHS:
            raise ValueError(
                f"path must be one of {MLA_PATHS}, got {value!r}: 'naive' expands the latents into per-head keys "
                f"and values (prefill), 'absorbed' attends over the latents themselves (decode), 'auto' picks per call."
            )
        self.__dict__["_path"] = value

    @property
    def backend(self) -> str:
        """``"auto"``, ``"math"`` or ``"sdpa"``; may be changed between calls."""
        return str(self.__dict__["_backend"])

    @backend.setter
    def backend(self, value: str) -> None:
        if value not in MLA_BACKENDS:
            raise ValueError(f"backend must be one of {MLA_BACKENDS} for MultiHeadLatentAttention, got {value!r}.")
        self.__dict__["_backend"] = value

    def reset_parameters(self) -> None:
        """Xavier-uniform weights, zero biases, RMSNorm weights of one."""
        with torch.no_grad():
            for proj in (
                self.q_proj,
                self.q_a_proj,
                self.q_b_proj,
                self.kv_a_proj_with_mqa,
                self.kv_b_proj,
                self.o_proj,
            ):
                weight, bias = getattr(proj, "weight", None), getattr(proj, "bias", None)
                if isinstance(weight, Tensor):
                    nn.init.xavier_uniform_(weight)
                if isinstance(bias, Tensor):
                    bias.zero_()
            for norm in (self.q_a_layernorm, self.kv_a_layernorm):
                if isinstance(norm, nn.RMSNorm):
                    norm.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"q_lora_rank={self.q_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
            f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
            f"rope_interleave={self.rope_interleave}, path={self.path!r}, backend={self.backend!r}"
        )

    # -- forward ----------------------------------------------------------------------------------------------
    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``q_C (B, H, T, N)`` and the not yet rotated ``q_R (B, H, T, R)`` of ``x (B, T, E)``."""
        B, T, _ = x.shape
        H, N, R = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.q_proj is not None:
            q: Tensor = self.q_proj(x)  # (B, T, H*(N+R))
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (B, T, Q) -> (B, T, H*(N+R))
        q = q.view(B, T, H, N + R).transpose(1, 2)  # (B, H, T, N+R)
        q_nope, q_rot = torch.split(q, [N, R], dim=-1)  # (B, H, T, N), (B, H, T, R)
        return q_nope, q_rot

    def _rotate(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """``x (B, heads, T, R)`` rotated by ``rope``, in this module's channel layout."""
        if rope is None:
            return x
        return apply_rope_interleaved(x, *rope) if self.rope_interleave else apply_rope(x, *rope)

    def _kv_b_weight(self) -> Tensor:
        proj = self.kv_b_proj
        if not isinstance(proj, nn.Linear) or proj.bias is not None:
            raise ValueError(
                f"kv_b_proj is a {type(proj).__name__}{' with a bias' if isinstance(proj, nn.Linear) else ''}; "
                f"both MLA paths read its weight (H*(N+Dv), C) = ({self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)}, "
                f"{self.kv_lora_rank}) as the matrices W_UK and W_UV, so it must be an nn.Linear without bias: "
                f"merge an adapter into it (peft's merge_and_unload) before calling the module."
            )
        return proj.weight

    def choose_path(self, q_len: int, k_len: int) -> tuple[str, str]:
        """The path a call of ``q_len`` queries over ``k_len`` keys takes, and why."""
        if self.path != "auto":
            return self.path, f"path={self.path!r} was requested"
        naive, absorbed = path_costs(
            q_len,
            k_len,
            heads=self.num_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )
        counts = f"{absorbed / 1e6:.3g}M multiply-adds absorbed, {naive / 1e6:.3g}M naive"
        if absorbed <= naive:
            return "absorbed", (
                f"auto: absorbed, T_q={q_len} over T_k={k_len} keys: {counts} (naive expands all {k_len} latents "
                f"through kv_b_proj; absorbed only the queries)"
            )
        return "naive", (
            f"auto: naive, T_q={q_len} over T_k={k_len} keys: {counts} (absorbed attends {self.kv_lora_rank + self.qk_rope_head_dim} "
            f"channels wide instead of {self.qk_head_dim}, for each of the {q_len} queries)"
        )

    def forward(
        self,
        hidden_states: Tensor,
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        attn_mask: Tensor | Masks | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        kv_cache: MLACache | None = None,
        cache_positions: Tensor | None = None,
    ) -> Tensor:
        """Self-attention of ``hidden_states``.

        Args:
            hidden_states: ``(B, T, E)``.
            rope: ``(cos, sin)`` for this call's positions, each ``(T, R)`` or ``(B, T, R)``, from
                :func:`attnlab.core.rope.rope_cos_sin` with ``head_dim=R`` (or HF's rotary embedding): rotates
                ``q_R`` and ``k_R``. None: no rotation (positions then do not enter the scores).
            attn_mask: bool (True = may attend) or float (added to the scores), ``(T, S)``, ``(B, T, S)`` or
                broadcastable ``(B, H, T, S)``; or converted :class:`attnlab.core.masks.Masks`.
            key_padding_mask: ``(B, S)`` bool, True = padding.
            is_causal: causal masking, bottom-right aligned.
            kv_cache: an :class:`attnlab.core.mla_cache.MLACache` for this layer: this call's rows are written into
                it and attention runs over everything cached (S = the cached length, or its ``max_len`` in
                position mode).
            cache_positions: ``(T,)`` int cache slots of this call's tokens (position mode; needs ``is_causal``).

        Returns:
            ``(B, T, E)``.
        """
        self._check_forward(hidden_states, rope, kv_cache, cache_positions)
        if kv_cache is not None and cache_positions is not None:
            cache_positions = kv_cache.prepare_positions(cache_positions)  # (T,) int64 on the cache's device
        B, T, _ = hidden_states.shape
        C, R = self.kv_lora_rank, self.qk_rope_head_dim

        q_nope, q_rot = self._queries(hidden_states)  # (B, H, T, N), (B, H, T, R)
        q_rot = self._rotate(q_rot, rope)  # (B, H, T, R)
        compressed: Tensor = self.kv_a_proj_with_mqa(hidden_states)  # (B, T, C+R)
        latent, k_rot = torch.split(compressed, [C, R], dim=-1)  # (B, T, C), (B, T, R)
        latent = self.kv_a_layernorm(latent)  # (B, T, C): c_KV
        k_rot = self._rotate(k_rot[:, None], rope)[:, 0]  # (B, 1, T, R) -> (B, T, R): k_R, one for all heads
        kv = torch.cat((latent, k_rot), dim=-1)  # (B, T, C+R): the rows a cache keeps
        if kv_cache is not None:
            kv = kv_cache.update(kv, cache_positions)  # (B, S, C+R): every cached row
        S = kv.size(1)

        masks = prepare_masks(
            attn_mask,
            key_padding_mask,
            is_causal,
            batch=B,
            heads=self.num_heads,
            q_len=T,
            k_len=S,
            dtype=q_nope.dtype,
            device=q_nope.device,
            q_positions=cache_positions,
        )
        if key_padding_mask is not None and kv_cache is None:
            # never attended, but 0 * NaN is NaN: whatever a caller left in the padding must not reach the output
            kv = kv.masked_fill(key_padding_mask[:, :, None], 0.0)  # (B, S, C+R)
        path, why = self.choose_path(T, S)
        backend = "math" if self.backend == "math" else "sdpa"
        run = mla_absorbed if path == "absorbed" else mla_naive
        context, adapted = run(q_nope, q_rot, kv, self._kv_b_weight(), masks, backend=backend, scale=self.scale)
        if not torch.compiler.is_compiling():  # bookkeeping only; keeps compiled graphs whole
            reason = why if adapted is None else f"{why}; {adapted}"
            self.__dict__.update(last_path=path, last_backend=backend, last_backend_reason=reason)

        context = context.transpose(1, 2).reshape(B, T, self.num_heads * self.v_head_dim)  # (B, T, H*Dv)
        out: Tensor = self.o_proj(context)  # (B, T, E)
        return out

    def _check_forward(self, x: object, rope: object, kv_cache: object, cache_positions: object) -> None:
        E, R = self.hidden_size, self.qk_rope_head_dim
        if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() != 3 or x.size(-1) != E:
            got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"hidden_states must be a floating tensor (B, T, hidden_size={E}), got {got}; MLA is batch-first "
                f"self-attention (add a batch dimension with .unsqueeze(0) to a (T, {E}) input)."
            )
        w = next(self.parameters())
        if x.device != w.device or (x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type)):
            raise ValueError(
                f"hidden_states is {x.dtype} on {x.device} but the module's weights are {w.dtype} on {w.device}; "
                f"move one of them: hidden_states.to({w.device.type!r}, {w.dtype}) or mla.to(...)."
            )
        if kv_cache is not None and not isinstance(kv_cache, MLACache):
            raise TypeError(
                f"kv_cache must be an MLACache (one row of kv_lora_rank + qk_rope_head_dim values per token), got "
                f"{type(kv_cache).__name__}; build one with MLACache.for_module(mla, batch_size, max_len)."
            )
        check_cache_positions(cache_positions, kv_cache is not None, "an MLACache", "T")
        if rope is not None:
            cos = check_rope_pair(rope)
            if cos.shape[-2:] != (x.size(1), R) or cos.dim() not in (2, 3):
                raise ValueError(
                    f"rope cos/sin have shape {tuple(cos.shape)}; expected (T, qk_rope_head_dim) = ({x.size(1)}, {R}) "
                    f"or (B, T, {R}): MLA rotates only the R rotary channels, so build them with "
                    f"rope_cos_sin(positions, {R})."
                )


def _check_init_args(
    hidden_size: object,
    num_heads: object,
    kv_lora_rank: object,
    qk_nope_head_dim: object,
    qk_rope_head_dim: object,
    v_head_dim: object,
    q_lora_rank: object,
    norm_eps: object,
) -> None:
    """Constructor arguments of :class:`MultiHeadLatentAttention`, each refused in one sentence."""
    v3 = {
        "hidden_size": "7168",
        "num_heads": "128",
        "kv_lora_rank": "512",
        "qk_nope_head_dim": "128",
        "qk_rope_head_dim": "64",
        "v_head_dim": "128",
        "q_lora_rank": "1536",
    }
    for name, value in (
        ("hidden_size", hidden_size),
        ("num_heads", num_heads),
        ("kv_lora_rank", kv_lora_rank),
        ("qk_nope_head_dim", qk_nope_head_dim),
        ("qk_rope_head_dim", qk_rope_head_dim),
        ("v_head_dim", v_head_dim),
        ("q_lora_rank", q_lora_rank),
    ):
        if name == "q_lora_rank" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            also = " or None (one q_proj)" if name == "q_lora_rank" else ""
            raise ValueError(f"{name} must be a positive int{also} (DeepSeek-V3 uses {v3[name]}), got {value!r}.")
    assert isinstance(qk_rope_head_dim, int)
    if qk_rope_head_dim % 2:
        raise ValueError(
            f"qk_rope_head_dim={qk_rope_head_dim} is odd; rotary embeddings rotate channel pairs, so it must be even "
            f"(DeepSeek-V3 uses 64): choose {qk_rope_head_dim - 1} or {qk_rope_head_dim + 1}."
        )
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not norm_eps > 0:
        raise ValueError(
            f"norm_eps must be a positive float (the RMSNorms' epsilon, 1e-6 in DeepSeek-V3), got {norm_eps!r}."
        )


# -- the paper's equations, for the tests ---------------------------------------------------------------------
def mla_reference(
    mla: MultiHeadLatentAttention,
    hidden_states: Tensor,
    *,
    rope: tuple[Tensor, Tensor] | None = None,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    is_causal: bool = False,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """DeepSeek-V2's equations (section 2.1, with its RMSNorms on the latents), one einsum each, with ``mla``'s
    weights, computed in ``dtype`` (float64: the reference; fp16/bf16: "plain PyTorch in low precision" for
    flash-attention's rule). No cache: ``hidden_states (B, T, E)`` attends to itself.

    ``keep``: bool, broadcastable to ``(B, T, T)``, True = may attend; ``bias``: float, likewise, added to the scores
    (``-inf`` blocks); ``is_causal`` on top. A query with no key left gets a context of zeros. ``rope``: ``(cos, sin)`` as the module's, applied here as the rotation of each
    channel pair (adjacent pairs when ``mla.rope_interleave``, else channel c with c + R/2).
    """
    H, C, N, R, Dv = mla.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    h = hidden_states.to(dtype)
    B, T, E = h.shape

    def weight_of(module: nn.Module | None) -> Tensor:
        w: Tensor = getattr(module, "weight")  # noqa: B009 (an nn.Module attribute, untyped)
        return w.to(dtype)

    def bias_of(module: nn.Module | None, width: int) -> Tensor:
        b: Tensor | None = getattr(module, "bias", None)
        return torch.zeros(width, dtype=dtype, device=h.device) if b is None else b.to(dtype)

    def rms_norm(x: Tensor, norm: nn.Module | None) -> Tensor:
        eps = float(getattr(norm, "eps") or 1e-6)  # noqa: B009
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight_of(norm)

    def rotate(x: Tensor) -> Tensor:  # x (..., T, R): each channel pair turned by its angle
        if rope is None:
            return x
        cos, sin = (t.to(dtype)[..., : R // 2] for t in rope)  # (T, R/2) or (B, T, R/2): one angle per pair
        if cos.dim() == 3 and x.dim() == 4:
            cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, R/2)
        a, b = (x[..., 0::2], x[..., 1::2]) if mla.rope_interleave else (x[..., : R // 2], x[..., R // 2 :])
        # (a + ib)(cos + i sin), written out in `dtype`; the rotated pairs' layout leaves every q . k as it is
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)  # (..., T, R)

    # queries: c_Q = W_DQ h (normalised), q_C = W_UQ c_Q, q_R = RoPE(W_QR c_Q); or [q_C | q_R] = W_Q h
    if mla.q_lora_rank is None:
        W_Q = weight_of(mla.q_proj).view(H, N + R, E)  # (H, N+R, E)
        q = torch.einsum("bte,hde->bhtd", h, W_Q)  # (B, H, T, N+R)
    else:
        c_Q = rms_norm(
            torch.einsum("bte,qe->btq", h, weight_of(mla.q_a_proj)) + bias_of(mla.q_a_proj, mla.q_lora_rank),
            mla.q_a_layernorm,
        )
        q = torch.einsum("btq,hdq->bhtd", c_Q, weight_of(mla.q_b_proj).view(H, N + R, -1))  # (B, H, T, N+R)
    q_C, q_R = q[..., :N], rotate(q[..., N:])  # (B, H, T, N), (B, H, T, R)

    # keys and values: c_KV = W_DKV h (normalised), k_C = W_UK c_KV, v_C = W_UV c_KV, k_R = RoPE(W_KR h)
    W_a, b_a = weight_of(mla.kv_a_proj_with_mqa), bias_of(mla.kv_a_proj_with_mqa, C + R)  # (C+R, E), (C+R,)
    c_KV = rms_norm(torch.einsum("bte,ce->btc", h, W_a[:C]) + b_a[:C], mla.kv_a_layernorm)  # (B, T, C)
    k_R = rotate(torch.einsum("bte,re->btr", h, W_a[C:]) + b_a[C:])  # (B, T, R): one for all heads
    W_UKV = weight_of(mla.kv_b_proj).view(H, N + Dv, C)  # (H, N+Dv, C)
    k_C = torch.einsum("bsc,hnc->bhsn", c_KV, W_UKV[:, :N])  # (B, H, T, N)
    v_C = torch.einsum("bsc,hdc->bhsd", c_KV, W_UKV[:, N:])  # (B, H, T, Dv)

    # o = softmax([q_C | q_R] . [k_C | k_R] / sqrt(N + R)) v_C, masked rows zero; u = W_O o
    scores = torch.einsum("bhtn,bhsn->bhts", q_C, k_C) + torch.einsum("bhtr,bsr->bhts", q_R, k_R)  # (B, H, T, T)
    scores = scores * mla.scale
    allowed = torch.ones(T, T, dtype=torch.bool, device=h.device)  # (T, S)
    if keep is not None:
        allowed = allowed & keep  # (B|1, T, S)
    if bias is not None:
        scores = scores + bias.to(dtype).reshape(-1, 1, T, T)  # (B|1, 1, T, S): one bias for every head
        allowed = allowed & (bias != float("-inf"))  # (B|1, T, S)
    if is_causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
    allowed = allowed.expand(B, T, T)[:, None]  # (B, 1, T, S)
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # (B, H, T, S)
    p = torch.where(allowed.any(-1, keepdim=True), p, 0.0)  # a query with no key: zeros, not NaN
    o = torch.einsum("bhts,bhsd->bhtd", p, v_C)  # (B, H, T, Dv)
    u = torch.einsum("bhtd,ehd->bte", o, weight_of(mla.o_proj).view(E, H, Dv))  # (B, T, E)
    return u + bias_of(mla.o_proj, E)
