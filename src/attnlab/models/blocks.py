"""The parts a decoder block is built from, each chosen by a switch of :class:`DecoderConfig`.

Reads top-down: the two norms, the two MLPs, the block. Shapes: B batch, T tokens of this call,
E = n_embd, F = the MLP's hidden width. Every part keeps the attribute names of the checkpoints
it loads (GPT-2's ``c_fc``/``c_proj``, Llama's ``gate_proj``/``up_proj``/``down_proj``), so a
state dict reads the same as the family's own.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import ContextParallelAttention, MultiHeadAttention
from ..core.kv_cache import KVCache
from ..core.masks import Masks
from ..core.mla import MultiHeadLatentAttention
from .config import DecoderConfig

__all__ = ["RMSNorm", "GeluMLP", "SwiGLUMLP", "Block", "MLP_ROWS", "make_norm", "make_mlp", "make_attention"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, normalised in float32 as Hugging Face does.

    The normalised value is cast back to the input dtype *before* the weight multiplies it
    (HF's ``LlamaRMSNorm``), so that bf16 outputs round exactly as HF's do. A float64 input stays
    float64 (HF's casts it down to float32), so that a float64 model is float64 throughout and
    ``gradcheck`` can run on it.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # (B, T, E), at least float32
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, E) / (B, T, 1)
        return self.weight * normed.to(x.dtype)  # (E,) * (B, T, E)

    def extra_repr(self) -> str:
        return f"{self.weight.size(0)}, eps={self.eps}"


def make_norm(config: DecoderConfig) -> nn.Module:
    """The ``norm`` switch: ``"layernorm"`` (GPT-2: mean and variance, a bias unless ``norm_bias=False``) or
    ``"rmsnorm"`` (Llama: root mean square, no bias)."""
    if config.norm == "layernorm":
        return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.norm_bias)
    return RMSNorm(config.n_embd, config.norm_eps)


class GeluMLP(nn.Module):
    """GPT-2's feed-forward: E -> F, tanh-approximated GELU (GPT-2's ``gelu_new``), F -> E, then dropout."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.mlp_bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.mlp_bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, E) -> (B, T, F) -> (B, T, E)


class SwiGLUMLP(nn.Module):
    """Llama's feed-forward: ``down(silu(gate(x)) * up(x))``, E -> F -> E, then dropout (none in Llama)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.mlp_bias)
        self.dropout = nn.Dropout(config.dropout)
        # Optional: one module computing [gate | up] in a single matmul (fuse_quantized), weights shared.
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, 2F) -> 2 x (B, T, F)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, F) each
        return self.dropout(self.down_proj(F.silu(gate) * up))  # (B, T, F) -> (B, T, E)


def make_mlp(config: DecoderConfig) -> nn.Module:
    """The ``mlp`` switch: ``"gelu"`` (:class:`GeluMLP`) or ``"swiglu"`` (:class:`SwiGLUMLP`)."""
    return GeluMLP(config) if config.mlp == "gelu" else SwiGLUMLP(config)


def make_attention(config: DecoderConfig) -> nn.Module:
    """The ``attention`` switch: :class:`MultiHeadAttention` (MHA, GQA or MQA by ``n_kv_head``) or
    :class:`MultiHeadLatentAttention` (``"mla"``, DeepSeek-V2/V3, with ``config.latent``'s sizes)."""
    if config.latent is None:
        return MultiHeadAttention(
            config.n_embd,
            config.n_head,
            num_kv_heads=config.n_kv_head,
            dropout=config.dropout,
            bias=config.attention_bias,
        )
    d = config.latent
    return MultiHeadLatentAttention(
        config.n_embd,
        config.n_head,
        kv_lora_rank=d.kv_lora_rank,
        qk_nope_head_dim=d.qk_nope_head_dim,
        qk_rope_head_dim=d.qk_rope_head_dim,
        v_head_dim=d.v_head_dim,
        q_lora_rank=d.q_lora_rank,
        rope_interleave=d.rope_interleave,
        norm_eps=config.norm_eps,
        attention_bias=config.attention_bias,
        path=d.path,
    )


# Positions per MLP call in a no-grad call over more of them (a long prefill; see Block.forward). The MLP's
# hidden activations are (B, T, F) float32 several times over: SmolLM2's fused gate|up alone is 100 MB at
# T = 8192 (F = 1536), and glibc keeps such freed blocks resident. 512 rows hold them to ~6 MB a call; the
# quantized matmuls read their weights once more per 512 rows (~1 MB a layer for SmolLM2), next to nothing.
MLP_ROWS = 512


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm_1(x))``, then ``x + mlp(norm_2(x))``.

    The two norms are registered under the family's names (``config.names.attn_norm`` and
    ``mlp_norm``: GPT-2's ``ln_1``/``ln_2``, Llama's ``attn_norm``/``mlp_norm``), so that
    ``model.transformer.h[0].ln_1`` and ``model.layers[0].attn_norm`` are what they were.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self._norm_names = (config.names.attn_norm, config.names.mlp_norm)
        self.add_module(config.names.attn_norm, make_norm(config))
        self.attn: nn.Module = make_attention(config)
        self.resid_dropout = nn.Dropout(config.dropout)  # GPT-2's dropout after the attention's c_proj
        self.add_module(config.names.mlp_norm, make_norm(config))
        self.mlp = make_mlp(config)

    @property
    def attn_norm_module(self) -> nn.Module:
        """The norm before attention, whatever the family calls it."""
        return self._modules[self._norm_names[0]]  # type: ignore[return-value]

    @property
    def mlp_norm_module(self) -> nn.Module:
        """The norm before the MLP, whatever the family calls it."""
        return self._modules[self._norm_names[1]]  # type: ignore[return-value]

    def forward(
        self,
        x: Tensor,
        masks: Masks | None,
        *,
        rope: tuple[Tensor, Tensor] | None = None,
        kv_cache: KVCache | None = None,
        cache_positions: Tensor | None = None,
        document_ids: Tensor | None = None,
        context_parallel: ContextParallelAttention | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """``masks``: causal (+ padding) masks, converted once per model call by the decoder; None with
        ``context_parallel``, where ``key_padding_mask`` is this rank's shard and causality is the ring's.
        ``rope``: ``(cos, sin)`` of this call's positions, or None with a learned position table."""
        # document_ids only when packing: a swapped-in attention module need not know the argument
        extra: dict[str, Any] = {} if document_ids is None else {"document_ids": document_ids}
        if context_parallel is not None:
            extra.update(context_parallel=context_parallel, key_padding_mask=key_padding_mask, is_causal=True)
        a = self.attn(
            self.attn_norm_module(x),
            attn_mask=masks,
            kv_cache=kv_cache,
            cache_positions=cache_positions,
            rope=rope,
            **extra,
        )  # (B, T, E)
        x = x + self.resid_dropout(a)
        if (
            x.size(1) <= MLP_ROWS
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or not isinstance(self.mlp, (GeluMLP, SwiGLUMLP))
        ):
            return x + self.mlp(self.mlp_norm_module(x))  # (B, T, E)
        # A long prompt without autograd (a prefill): the MLP, which treats each position alone, MLP_ROWS
        # positions at a time, added in place into x (this call's own sum), so that its (B, T, F) hidden
        # activations never exist whole.
        for start in range(0, x.size(1), MLP_ROWS):
            rows = x[:, start : start + MLP_ROWS]  # (B, <= MLP_ROWS, E), a view of x
            rows += self.mlp(self.mlp_norm_module(rows))
        return x  # (B, T, E)
