"""attnlab's ``MultiHeadAttention`` with the weights of one transformers attention layer: one function per source.

Each function reads a layer of a transformers 5 model (its ``config`` and its projections; transformers itself is
never imported here) and returns attnlab's module configured as that layer and holding a copy of its weights, so
that ``mha(hidden_states, rope=position_embeddings, is_causal=True, ...)`` computes what the layer computes. Where
HF stores a weight in another layout than attnlab, the conversion says how it is moved:

* Qwen3-Next's ``q_proj`` holds the output gate: per head, ``D`` query rows then ``D`` gate rows
  (``view(..., H, 2 * D)`` then ``chunk(2)``); they are split into ``q_proj`` and ``gate_proj``.
* Qwen3-Next's and Gemma 3's RMSNorm multiply by ``1 + weight``; attnlab's ``nn.RMSNorm`` by ``weight``: the
  weight is copied as ``1 + weight``.
* GPT-NeoX's ``query_key_value`` holds, per head, ``D`` rows of q, then of k, then of v.
* Llama 4 rotates channel pairs ``(2c, 2c + 1)`` (complex ``freqs_cis``); attnlab's RoPE pairs ``(c, c + D/2)``.
  Each q and k head's rows are reordered (even channels first, then odd), which leaves ``q . k`` unchanged, and
  :func:`llama4_rope` turns ``freqs_cis`` into the matching ``(cos, sin)``.

Notation: E hidden size, H query heads, G key/value heads, D query/key head dim, Dv value head dim.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention

__all__ = ["from_gemma3", "from_gpt_neox", "from_llama4_text", "from_qwen3_next", "llama4_rope"]


def _linear(layer: nn.Module, name: str) -> nn.Linear:
    child = getattr(layer, name, None)
    if not isinstance(child, nn.Linear):
        raise TypeError(
            f"{type(layer).__name__}.{name} is {type(child).__name__}, not an nn.Linear: this conversion reads the "
            f"layer as transformers 5 builds it; a layer whose projections were replaced (quantized, LoRA) is not "
            f"converted. Convert the model before replacing them."
        )
    return child


def _copy(dst: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
    """``dst.weight`` and ``dst.bias`` (a Linear of attnlab's module) set from HF's rows."""
    linear = cast(nn.Linear, dst)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)


def _bias(linear: nn.Linear) -> Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _rotary_fraction(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", 1.0)) if isinstance(params, dict) else 1.0


def _one_plus_norm(mha: MultiHeadAttention, layer: nn.Module) -> None:
    """Qwen3-Next's / Gemma 3's ``q_norm``, ``k_norm`` (``x_hat * (1 + weight)``) into attnlab's (``x_hat * weight``)."""
    with torch.no_grad():
        for name in ("q_norm", "k_norm"):
            cast(nn.RMSNorm, getattr(mha, name)).weight.copy_(1.0 + getattr(layer, name).weight.detach())


def _factory(layer: nn.Module, name: str) -> dict[str, Any]:
    w = _linear(layer, name).weight
    return {"device": w.device, "dtype": w.dtype}


def from_qwen3_next(hf_layer: nn.Module) -> MultiHeadAttention:
    """Qwen3-Next's gated full-attention layer (``Qwen3NextAttention``).

    Partial RoPE (``rope_dims = int(D * partial_rotary_factor)``: pass the model's ``position_embeddings``, whose
    width that is), the elementwise output gate (its rows split out of ``q_proj``), RMSNorm on each q and k head
    (``1 + weight`` copied) and GQA. Call ``mha(x, rope=(cos, sin), is_causal=True)``.
    """
    layer: Any = hf_layer  # transformers' layer: its attributes are untyped here
    config = layer.config
    H, G, D = int(config.num_attention_heads), int(config.num_key_value_heads), int(layer.head_dim)
    E = int(config.hidden_size)
    q_proj = _linear(layer, "q_proj")
    mha = MultiHeadAttention(
        E,
        H,
        num_kv_heads=G,
        head_dim=D,
        rope_dims=int(D * _rotary_fraction(config)),
        output_gate="elementwise",
        qk_norm="head",
        qk_norm_eps=float(layer.q_norm.eps),
        scale=float(layer.scaling),
        bias=q_proj.bias is not None,
        dropout=float(config.attention_dropout),
        **_factory(layer, "o_proj"),
    )
    rows = q_proj.weight.detach().view(H, 2, D, E)  # (H, query|gate, D, E): per head, D query rows then D gate rows
    bias = None if q_proj.bias is None else q_proj.bias.detach().view(H, 2, D)  # (H, 2, D)
    _copy(mha.q_proj, rows[:, 0].reshape(H * D, E), None if bias is None else bias[:, 0].reshape(H * D))
    _copy(cast(nn.Module, mha.gate_proj), rows[:, 1].reshape(H * D, E), None if bias is None else bias[:, 1].flatten())
    for ours, theirs in (("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
        linear = _linear(layer, theirs)
        _copy(getattr(mha, ours), linear.weight.detach(), _bias(linear))
    _one_plus_norm(mha, layer)
    return mha


def from_gpt_neox(hf_layer: nn.Module) -> MultiHeadAttention:
    """GPT-NeoX's attention (``GPTNeoXAttention``, also Pythia): partial RoPE on ``rotary_ndims`` channels
    (``rotary_pct``), the fused ``query_key_value`` split per head. Call ``mha(x, rope=(cos, sin), is_causal=True)``."""
    layer: Any = hf_layer  # transformers' layer: its attributes are untyped here
    config = layer.config
    H, E = int(config.num_attention_heads), int(config.hidden_size)
    D = int(layer.head_size)
    fused = _linear(layer, "query_key_value")
    mha = MultiHeadAttention(
        E,
        H,
        rope_dims=int(layer.rotary_ndims),
        scale=float(layer.scaling),
        bias=fused.bias is not None,
        dropout=float(config.attention_dropout),
        **_factory(layer, "dense"),
    )
    rows = fused.weight.detach().view(H, 3, D, E)  # (H, q|k|v, D, E): per head, D rows of each
    bias = None if fused.bias is None else fused.bias.detach().view(H, 3, D)  # (H, 3, D)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        _copy(getattr(mha, name), rows[:, i].reshape(H * D, E), None if bias is None else bias[:, i].reshape(H * D))
    dense = _linear(layer, "dense")
    _copy(mha.out_proj, dense.weight.detach(), _bias(dense))
    return mha


def from_gemma3(hf_layer: nn.Module) -> MultiHeadAttention:
    """Gemma 3's attention (``Gemma3Attention``): a sliding-window layer (``window = sliding_window``: HF's mask
    keeps ``q - W < k <= q``, attnlab's window is the same ``W``) or a global one, ``head_dim`` apart from the
    width, the scale ``query_pre_attn_scalar ** -0.5`` and RMSNorm on each q and k head (``1 + weight`` copied).
    No soft-capping: the layer keeps ``attn_logit_softcapping`` but never passes it to its attention function
    (transformers 5.24). Pass the layer type's own ``position_embeddings`` (local base 1e4, global 1e6):
    ``mha(x, rope=(cos, sin), is_causal=True)``."""
    layer: Any = hf_layer  # transformers' layer: its attributes are untyped here
    config = layer.config
    H, G, E = int(config.num_attention_heads), int(config.num_key_value_heads), int(config.hidden_size)
    window = getattr(layer, "sliding_window", None)
    if window is not None and not getattr(layer, "is_causal", True):
        raise ValueError(
            f"{type(layer).__name__} is a bidirectional sliding-window layer (use_bidirectional_attention=True, "
            f"sliding_window={window}); attnlab's window is causal (i - W < j <= i). Convert a causal Gemma 3."
        )
    q_proj = _linear(layer, "q_proj")
    mha = MultiHeadAttention(
        E,
        H,
        num_kv_heads=G,
        head_dim=int(layer.head_dim),
        window=None if window is None else int(window),
        qk_norm="head",
        qk_norm_eps=float(layer.q_norm.eps),
        scale=float(layer.scaling),
        bias=q_proj.bias is not None,
        dropout=float(config.attention_dropout),
        **_factory(layer, "o_proj"),
    )
    for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
        linear = _linear(layer, theirs)
        _copy(getattr(mha, ours), linear.weight.detach(), _bias(linear))
    _one_plus_norm(mha, layer)
    return mha


def _halves_first(t: Tensor, heads: int, D: int) -> Tensor:
    """Rows ``(heads*D, ...)`` reordered within each head: channels 0, 2, 4, ... then 1, 3, 5, ...; Llama 4's pair
    ``(2c, 2c + 1)`` becomes attnlab's ``(c, c + D/2)``."""
    order = torch.cat([torch.arange(0, D, 2), torch.arange(1, D, 2)]).to(t.device)  # (D,)
    return t.view(heads, D, *t.shape[1:])[:, order].reshape(t.shape)  # (heads, D, ...) -> (heads*D, ...)


def from_llama4_text(hf_layer: nn.Module) -> MultiHeadAttention:
    """Llama 4's text attention (``Llama4TextAttention``), a RoPE layer or a NoPE one (``no_rope_layers``).

    RoPE layers: q and k rows reordered for attnlab's channel pairs; pass ``rope=llama4_rope(freqs_cis)``. Their
    L2 qk-norm (``use_qk_norm``: RMS without a weight, over each head, *after* RoPE) becomes attnlab's
    ``qk_norm="head"`` with weights of 1, before RoPE: a rotation keeps each head's norm, so the two agree.
    Chunked layers (``layer_types[i] == "chunked_attention"``): a token sees only its own chunk of
    ``attention_chunk_size`` positions, causally: pass ``document_ids=positions // attention_chunk_size`` with
    ``is_causal=True``. NoPE layers: no ``rope``; HF's temperature tuning (``attn_temperature_tuning``) scales
    their queries by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``, which is 1 below position
    ``floor_scale - 1`` (8191 by default) and which attnlab does not apply: exact below that position only.
    """
    layer: Any = hf_layer  # transformers' layer: its attributes are untyped here
    config = layer.config
    H, G, E = int(config.num_attention_heads), int(config.num_key_value_heads), int(config.hidden_size)
    D = int(layer.head_dim)
    use_rope = bool(layer.use_rope)
    norm = getattr(layer, "qk_norm", None)
    q_proj = _linear(layer, "q_proj")
    mha = MultiHeadAttention(
        E,
        H,
        num_kv_heads=G,
        head_dim=D,
        qk_norm="head" if norm is not None else False,
        qk_norm_eps=float(norm.eps) if norm is not None else 1e-6,
        scale=float(layer.scaling),
        bias=q_proj.bias is not None,
        dropout=float(config.attention_dropout),
        **_factory(layer, "o_proj"),
    )
    for ours, theirs, heads in (("q_proj", "q_proj", H), ("k_proj", "k_proj", G), ("v_proj", "v_proj", 0)):
        linear = _linear(layer, theirs)
        weight, bias = linear.weight.detach(), _bias(linear)
        if use_rope and heads:  # q and k only: v is never rotated
            weight = _halves_first(weight, heads, D)
            bias = None if bias is None else _halves_first(bias, heads, D)
        _copy(getattr(mha, ours), weight, bias)
    o_proj = _linear(layer, "o_proj")
    _copy(mha.out_proj, o_proj.weight.detach(), _bias(o_proj))
    return mha


def llama4_rope(freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """Llama 4's complex rotary ``freqs_cis`` ``(B, T, D/2)`` (angle of pair ``(2c, 2c + 1)``) as attnlab's
    ``(cos, sin)`` ``(B, T, D)`` for the channels :func:`from_llama4_text` reordered (pair ``(c, c + D/2)``)."""
    cos, sin = freqs_cis.real, freqs_cis.imag  # (B, T, D/2) each
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # (B, T, D) each
