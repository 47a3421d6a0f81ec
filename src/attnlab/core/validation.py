"""Input checks run before any computation: each failure is one sentence naming the argument,
what was received, what was expected, and the fix. Mask checks live in :mod:`attnlab.core.masks`.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

import torch
from torch import Tensor

Backend = Literal["auto", "math", "sdpa", "flex"]
BACKEND_NAMES: tuple[str, ...] = get_args(Backend)


class AttentionDims(Protocol):
    """What the forward checks read of a module: its widths (``MultiHeadAttention`` has them)."""

    embed_dim: int
    kdim: int
    vdim: int
    head_dim: int
    rope_dims: int | None  # channels of each q/k head that RoPE rotates; None: all head_dim of them


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__}).")


def check_init_args(
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    kdim: int,
    vdim: int,
    dropout: float,
    scale: float | None,
    backend: str,
    *,
    head_dim: int | None = None,
) -> None:
    """Constructor arguments of :class:`attnlab.MultiHeadAttention`. ``head_dim`` given (checked by
    :func:`check_head_args`) frees the heads from dividing ``embed_dim``."""
    for name, value in (
        ("embed_dim", embed_dim),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("kdim", kdim),
        ("vdim", vdim),
    ):
        _positive_int(name, value)
    if head_dim is None and embed_dim % num_heads:
        divisors = [h for h in range(1, embed_dim + 1) if embed_dim % h == 0]
        near = sorted(divisors, key=lambda h: abs(h - num_heads))[:2]
        raise ValueError(
            f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}: every head gets "
            f"embed_dim // num_heads dims; choose num_heads among the divisors of {embed_dim} "
            f"(nearest: {sorted(near)}) or change embed_dim to a multiple of {num_heads}."
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}: each K/V head "
            f"serves an equal group of query heads; choose num_kv_heads among "
            f"{[g for g in range(1, num_heads + 1) if num_heads % g == 0]}."
        )
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}; it is the probability of zeroing a weight.")
    if scale is not None and not float(scale) > 0.0:
        raise ValueError(f"scale must be a positive float (default 1/sqrt(head_dim)), got {scale!r}.")
    check_backend(backend)


OUTPUT_GATES: tuple[object, ...] = (False, None, "elementwise", "headwise")  # False and None: no gate


def check_head_args(
    embed_dim: int,
    num_heads: int,
    head_dim: object,
    v_head_dim: object,
    rope_dims: object,
    output_gate: object,
) -> None:
    """The head-shape options of :class:`attnlab.MultiHeadAttention`: ``head_dim``, ``v_head_dim`` (each a positive
    int or None), ``rope_dims`` (even, at most the query/key head dim) and ``output_gate``."""
    for name, value, default in (
        ("head_dim", head_dim, f"embed_dim // num_heads = {embed_dim // num_heads}"),
        ("v_head_dim", v_head_dim, "head_dim"),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{name} must be a positive int or None (default {default}), got {value!r} ({type(value).__name__}); "
                f"pass an int, e.g. {name}=64."
            )
        if value <= 0:
            raise ValueError(
                f"{name} must be a positive int or None (default {default}), got {value}; each head needs at least "
                f"one channel: pass e.g. {name}=64, or leave it None."
            )
    d_qk = head_dim if isinstance(head_dim, int) else embed_dim // num_heads  # checked above: an int or None
    if rope_dims is not None:
        if isinstance(rope_dims, bool) or not isinstance(rope_dims, int):
            raise TypeError(
                f"rope_dims must be an even int or None (RoPE on the whole head), got {rope_dims!r} "
                f"({type(rope_dims).__name__}); for a rotary fraction f pass rope_dims=int(head_dim * f)."
            )
        if rope_dims <= 0:
            raise ValueError(
                f"rope_dims must be a positive even int or None (RoPE on the whole head), got {rope_dims}; for no "
                f"rotary embedding at all, pass no rope= to forward."
            )
        if rope_dims % 2:
            even = " or ".join(str(r) for r in (rope_dims - 1, rope_dims + 1) if r > 0)
            raise ValueError(
                f"rope_dims={rope_dims} is odd: RoPE rotates channel pairs (c, c + rope_dims/2) of each query/key "
                f"head; use rope_dims={even}."
            )
        if rope_dims > d_qk:
            raise ValueError(
                f"rope_dims={rope_dims} exceeds the query/key head dim {d_qk}: RoPE rotates the first rope_dims "
                f"channels of each head and passes the rest through; use rope_dims <= {d_qk} (a rotary fraction f "
                f"is rope_dims=int({d_qk} * f)), or None for the whole head."
            )
    if not any(output_gate is g or (isinstance(g, str) and output_gate == g) for g in OUTPUT_GATES):
        hint = " (True is ambiguous: name the kind)" if output_gate is True else ""
        raise ValueError(
            f"output_gate must be False, 'elementwise' (a sigmoid gate per output channel, H * v_head_dim, as "
            f"Qwen3-Next) or 'headwise' (one per head, H); got {output_gate!r}{hint}."
        )


def check_variant_args(window: object, softcap: object, alibi: object, sinks: object, qk_norm: object) -> None:
    """The variant options of :class:`attnlab.MultiHeadAttention` (see :mod:`attnlab.core.variants`)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(
            f"window must be a positive int (query i sees keys i - window < j <= i) or None, got {window!r}."
        )
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be a positive float (Gemma 2 uses 50.0) or None, got {softcap!r}.")
    for name, flag in (("alibi", alibi), ("sinks", sinks)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r} ({type(flag).__name__}).")
    if qk_norm not in (False, True, "head", "full"):
        raise ValueError(
            f"qk_norm must be False, True or 'head' (RMSNorm over each head's D channels, Qwen 3), or 'full' "
            f"(over all H*D channels of q and G*D of k, OLMo 2); got {qk_norm!r}."
        )


def check_document_ids(document_ids: object, batch: int, q_len: int, k_len: int, kv_cache: object) -> None:
    """``document_ids`` of a packed self-attention call: int ``(B, T)``, no KV cache."""
    if not isinstance(document_ids, Tensor) or document_ids.is_floating_point() or document_ids.dtype == torch.bool:
        raise TypeError(
            f"document_ids must be an integer tensor (B, T) of document ids, got "
            f"{getattr(document_ids, 'dtype', type(document_ids).__name__)}; e.g. torch.tensor([[0, 0, 0, 1, 1]])."
        )
    if kv_cache is not None or q_len != k_len:
        raise ValueError(
            f"document_ids packs sequences for self-attention over the whole row (T_q == T_k, no kv_cache), got "
            f"T_q={q_len}, T_k={k_len}{' and a kv_cache' if kv_cache is not None else ''}; decode each document "
            f"with its own cache instead."
        )
    if tuple(document_ids.shape) != (batch, q_len):
        raise ValueError(
            f"document_ids has shape {tuple(document_ids.shape)}; expected (B, T) = ({batch}, {q_len}), one id per token."
        )


def check_backend(backend: object) -> None:
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}.")


def _check_3d(name: str, x: object, width_name: str, width: int) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (B, T, {width_name}={width}), got {type(x).__name__}.")
    if not x.is_floating_point():
        raise TypeError(
            f"{name} has dtype {x.dtype}; expected a floating tensor (B, T, {width_name}={width}). "
            f"Token ids go through an nn.Embedding first."
        )
    if x.dim() == 2 and x.size(-1) == width:
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}, an unbatched (T, {width_name}) input; attnlab is "
            f"batch-first and expects (B, T, {width_name}): add a batch dimension with {name}.unsqueeze(0)."
        )
    if x.dim() != 3:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected 3-D (B, T, {width_name}={width}).")
    if x.size(-1) != width:
        hint = " (use kdim/vdim for a context of another width)" if name != "query" else ""
        raise ValueError(
            f"{name} has last dimension {x.size(-1)} (shape {tuple(x.shape)}); expected {width_name}={width}{hint}."
        )


def check_cache_positions(cache_positions: object, has_cache: bool, cache: str, length: str) -> None:
    """``cache_positions`` (when given) comes with a cache, ``cache`` naming its kind (``"a KVCache"``), and is an
    int64 (or int32) tensor of shape ``(length,)``, ``length`` the letter of the call's new tokens."""
    if cache_positions is None:
        return
    if not has_cache:
        raise ValueError(
            f"cache_positions was given without kv_cache; it names slots of {cache}, pass kv_cache=... too."
        )
    if not isinstance(cache_positions, Tensor) or cache_positions.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"cache_positions must be an int64 tensor of shape ({length},), got "
            f"{getattr(cache_positions, 'dtype', type(cache_positions).__name__)}; use torch.arange(start, start + {length})."
        )


def check_rope_pair(rope: object) -> Tensor:
    """``rope`` is a ``(cos, sin)`` pair of tensors; returns ``cos``, whose shape the caller checks."""
    if not (isinstance(rope, tuple) and len(rope) == 2 and all(isinstance(t, Tensor) for t in rope)):
        raise TypeError(
            f"rope must be a (cos, sin) tuple of tensors from attnlab.core.rope.rope_cos_sin, got {type(rope).__name__}."
        )
    cos: Tensor = rope[0]
    return cos


def check_like_weight(name: str, x: Tensor, weight: Tensor, module: str = "mha") -> None:
    """``x`` on the device of ``weight`` (one of the module's parameters) and, unless autocast is on there,
    of its dtype; ``module`` is what the fix calls the module (``mha.to(...)``)."""
    if x.device != weight.device:
        raise ValueError(
            f"{name} is on {x.device} but the module's weights are on {weight.device}; move "
            f"one of them: {name}.to({str(weight.device)!r}) or {module}.to({str(x.device)!r})."
        )
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{name} has dtype {x.dtype} but the module's weights are {weight.dtype}; cast one "
            f"of them ({name}.to({weight.dtype}) or {module}.to({x.dtype})), or run under torch.autocast."
        )


def check_forward_inputs(
    m: AttentionDims,
    weight: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    kv_cache: object = None,
    cache_positions: Tensor | None = None,
    rope: object = None,
) -> None:
    """Shapes, devices and dtypes of ``query``, ``key``, ``value`` against the module's widths
    and against ``weight``, one of its parameters (device and dtype)."""
    _check_3d("query", query, "embed_dim", m.embed_dim)
    if key is query and m.kdim != m.embed_dim:
        raise ValueError(
            f"key was not given, so it defaulted to query (self-attention), but this module was built with "
            f"kdim={m.kdim} != embed_dim={m.embed_dim}; pass the context explicitly: mha(query, key) with key of "
            f"shape (B, T_k, {m.kdim})."
        )
    _check_3d("key", key, "kdim", m.kdim)
    if value is key and m.vdim != m.kdim:
        raise ValueError(
            f"value was not given, so it defaulted to key, but this module was built with vdim={m.vdim} != "
            f"kdim={m.kdim}; pass value explicitly (shape (B, T_k, {m.vdim})), or build the module with "
            f"vdim={m.kdim}."
        )
    _check_3d("value", value, "vdim", m.vdim)
    if key.size(0) != query.size(0):
        raise ValueError(
            f"key has batch size {key.size(0)} but query has {query.size(0)}; query (B, T_q, E) "
            f"and key (B, T_k, kdim) must share B (for one shared context, use key.expand({query.size(0)}, -1, -1))."
        )
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"value has (B, T_k) = {tuple(value.shape[:2])} but key has {tuple(key.shape[:2])}; "
            f"every key needs exactly one value."
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_like_weight(name, x, weight)
    self_attention = key is query and value is query
    if kv_cache is not None and not self_attention:
        raise ValueError(
            "kv_cache was given for cross-attention; the cache appends the keys of the tokens being "
            "decoded, which only makes sense in self-attention (mha(x, kv_cache=...)). For a fixed "
            "context, project it once and reuse the module without a cache."
        )
    check_cache_positions(cache_positions, kv_cache is not None, "a KVCache", "T_q")
    if rope is not None:
        if not self_attention:
            raise ValueError(
                "rope was given for cross-attention; rotary embeddings rotate queries and keys of one sequence (self-attention only)."
            )
        cos = check_rope_pair(rope)
        if m.rope_dims is None and cos.shape[-2:] != (query.size(1), m.head_dim):
            raise ValueError(
                f"rope cos/sin have shape {tuple(cos.shape)}; expected (T_q, head_dim) = "
                f"({query.size(1)}, {m.head_dim}) or (B, T_q, head_dim): one angle set per query position."
            )
        if m.rope_dims is not None and cos.shape[-2:] != (query.size(1), m.rope_dims):
            raise ValueError(
                f"rope cos/sin have shape {tuple(cos.shape)}; this module rotates rope_dims={m.rope_dims} of each "
                f"head's {m.head_dim} channels, so expected (T_q, rope_dims) = ({query.size(1)}, {m.rope_dims}) or "
                f"(B, T_q, rope_dims): build them with rope_cos_sin(positions, {m.rope_dims})."
            )
