"""attnlab's attention inside Hugging Face ``transformers`` models, through ``AttentionInterface``.

transformers 5 picks a model's attention function by name from a registry
(``config._attn_implementation``); every attention layer calls it with one signature. After
:func:`register`, ``attn_implementation="attnlab"`` makes a model's layers call
:func:`attnlab_attention_forward`, which runs :mod:`attnlab.core.functional`: the math backend when
the caller asked for the weights (``output_attentions=True``), SDPA otherwise. Layers that pass
``softcap`` (Gemma 2) or ``s_aux`` (gpt-oss's sinks) run :mod:`attnlab.core.variants` instead, in
blocks of queries that never hold the ``T_q x T_k`` scores at once (HF's eager attention, the only
one transformers offers those models besides flash/flex kernels, materialises all of them).

Notation: B batch, H query heads, G key/value heads (GQA: H = G * R), T_q query positions,
T_k key positions (cache included), D query/key head dim, Dv value head dim (DeepSeek's MLA: Dv != D;
D elsewhere).

At this edge HF's conventions hold, inside attnlab's: HF hands ``query (B, H, T_q, D)``,
``key, value (B, G, T_k, D)`` and a 4-D mask, and takes back ``(B, T_q, H, D)``. The mask comes
from the mask function registered under the same name, HF's own ``sdpa_mask``: bool,
``(B, 1, T_q, T_k)``, **True = may attend** (attnlab's convention already), or ``None`` when
plain causal masking (or none) suffices. A 4-D float mask passed by a user (HF's eager form:
``0`` keeps, the dtype's minimum or ``-inf`` blocks) is converted to keep + bias. A layer's
``position_bias`` kwarg (T5, mT5, UMT5, LongT5, Switch Transformers, Pix2Struct, UDOP: the
relative position bias, ``(1, H, T_q, T_k)``, passed beside the mask rather than folded into it)
joins that bias, broadcast over the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core import variants  # called through the module, so that tests can count the calls
from ..core.dispatch import attend
from ..core.functional import sdpa_compute_dtype
from ..core.masks import Masks, prepare_masks
from ..core.variants import Structure
from ..runtime.optional import import_failure, installed_version
from .routing import attnlab_mask

__all__ = [
    "ATTENTION_NAME",
    "LAST_BACKEND",
    "LAST_BACKEND_REASON",
    "attnlab_attention_forward",
    "backends_used",
    "hf_mask_to_keep",
    "register",
]

ATTENTION_NAME = "attnlab"
# The attributes each HF attention layer gets, as attnlab's own modules have them: the backend its last call ran
# ("sdpa" or "math") and why that one, or how SDPA was adapted (None: SDPA as it is).
LAST_BACKEND = "last_backend"
LAST_BACKEND_REASON = "last_backend_reason"


def backends_used(model: nn.Module) -> dict[str, str]:
    """``{layer name: attnlab backend its last forward ran}`` for every attention layer of an HF ``model`` that
    attnlab's attention ran in (``attn_implementation="attnlab"``); empty before the first forward, or when
    attnlab never ran there (another implementation, or a model whose attention is inline).

    The backend is ``"sdpa"``, or ``"math"`` where the weights were asked for (``output_attentions=True``) or
    the scores are soft-capped (Gemma 2, which SDPA cannot apply); each layer's ``last_backend_reason`` says why
    it is not plain SDPA (the weights asked for, the softcap, gpt-oss's sinks as one more key, how SDPA was
    adapted), or is None, as on :class:`attnlab.MultiHeadAttention`.
    """
    return {
        name: getattr(m, LAST_BACKEND)
        for name, m in model.named_modules()
        if isinstance(getattr(m, LAST_BACKEND, None), str)
    }


def hf_mask_to_keep(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """HF's 4-D attention mask as attnlab's ``(keep, bias)``.

    Args:
        mask: ``(B or 1, 1 or H, T_q, T_k)``. Bool: True = may attend (HF's ``sdpa_mask``).
            Float: added to the scores, where an entry at or below half the dtype's minimum
            (HF's eager masks use the minimum; ``-inf`` also counts) blocks the key.

    Returns:
        ``keep``: bool, same shape, True = may attend; ``bias``: the float mask with blocked
        entries set to 0 (they are blocked by ``keep``), or None for a bool mask.
    """
    if not isinstance(mask, Tensor):  # e.g. flex attention's BlockMask, built for another implementation
        raise TypeError(
            f"attention_mask is a {type(mask).__name__}; attnlab's HF attention takes a 4-D bool or float tensor, "
            f"the masks transformers builds under {ATTENTION_NAME!r} once attnlab.hf.register() has run."
        )
    if mask.dim() != 4:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; attnlab's HF attention expects the 4-D "
            f"(B, 1, T_q, T_k) mask that transformers builds; pass the 2-D padding mask to the model, "
            f"not to the attention function."
        )
    if mask.dtype == torch.bool:
        return mask, None
    if not mask.is_floating_point():
        raise TypeError(
            f"attention_mask has dtype {mask.dtype}; expected torch.bool (True = may attend) or a float "
            f"dtype added to the scores (0 keeps, the dtype's minimum or -inf blocks)."
        )
    return _split_blocked(mask)


def _split_blocked(additive: Tensor) -> tuple[Tensor, Tensor]:
    """A float mask or bias as ``(keep, bias)``: entries at or below half the dtype's minimum block
    (HF blocks with ``finfo.min`` rather than ``-inf``; small scores added leave it near the minimum)."""
    blocked = additive <= torch.finfo(additive.dtype).min / 2  # same shape as `additive`; -inf included
    return ~blocked, additive.masked_fill(blocked, 0.0)


def _check_position_bias(module: nn.Module, bias: object, query: Tensor, T_k: int) -> Tensor:
    """The ``position_bias`` a layer passed (T5's relative attention), checked: float, 4-D,
    broadcastable to the scores ``(B, H, T_q, T_k)``, on the query's device."""
    B, H, T_q, _ = query.shape
    target = (B, H, T_q, T_k)
    who = f"{type(module).__name__} passed position_bias"
    if not isinstance(bias, Tensor) or not bias.is_floating_point():
        got = f"a {bias.dtype} tensor" if isinstance(bias, Tensor) else f"a {type(bias).__name__}"
        raise TypeError(
            f"{who} as {got}; an additive position bias is a float tensor added to the scores, broadcastable "
            f"to (B, H, T_q, T_k) = {target}."
        )
    if bias.dim() != 4 or any(b not in (1, t) for b, t in zip(bias.shape, target, strict=True)):
        raise ValueError(
            f"{who} of shape {tuple(bias.shape)}, which does not broadcast to the scores' (B, H, T_q, T_k) = "
            f"{target}; expected a 4-D float tensor whose every dim is 1 or the one in {target}, e.g. "
            f"(1, {H}, {T_q}, {T_k}) as T5's compute_bias makes."
        )
    if bias.device != query.device:
        raise ValueError(
            f"{who} on {bias.device} but the query is on {query.device}; compute it on the query's device."
        )
    return bias


def _wants_weights(module: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the caller will read this call's weights (``output_attentions=True``).

    Llama, Mistral and Qwen2 pass ``output_attentions`` down to attention; GPT-2 drops it. What
    holds for every model is transformers' output collector, active during the forward: weights
    are recorded when it has an ``*attentions`` entry. Without one (the function called outside
    a model's forward), the module's config decides.
    """
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without the collector: the kwarg and the config are all there is
        collected = None
    else:
        collected = _active_collector.get()  # {"attentions": [...], ...} or None
    if collected is not None:
        return any(key.endswith("attentions") for key in collected)
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


def attnlab_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Attention for a transformers model, with HF's signature (that of ``eager_attention_forward``).

    Args:
        module: the calling attention layer; read for ``is_causal`` (default True) and its
            ``config.output_attentions``.
        query: ``(B, H, T_q, D)``.
        key, value: ``(B, G, T_k, D)`` and ``(B, G, T_k, Dv)``, the cache's keys included; G divides H
            (GQA: query head h reads K/V head ``h // (H // G)``, as ``repeat_kv``).
        attention_mask: None, or 4-D broadcastable to ``(B, H, T_q, T_k)``, bool (True = may
            attend) or float (added; see :func:`hf_mask_to_keep`). It already holds causality,
            padding and any sliding window. None means plain causal masking for a causal layer
            (HF's SDPA contract: top-left aligned, so with ``T_q < T_k`` only the first T_q keys
            count, the case of a static cache's prefill), and none at all otherwise.
        scaling: multiplier of ``Q K^T``; default ``1 / sqrt(D)``.
        dropout: dropout probability on the weights (HF passes 0.0 in eval mode).
        is_causal: overrides ``module.is_causal``, as in HF's SDPA function.
        kwargs: ``softcap`` (Gemma 2: scores ``C * tanh(s / C)``) and ``s_aux`` (gpt-oss: ``(H,)``
            sink logits) select attnlab's variants (:mod:`attnlab.core.variants`);
            ``output_attentions`` picks the math backend; ``sliding_window`` is checked against a
            missing mask; ``position_bias`` (T5 and its kin: a float ``(B or 1, H or 1, T_q, T_k)``
            relative position bias, learned, so gradients flow into it) is added to the scores
            after ``scaling`` (T5 passes 1.0), together with the mask and causality, as in HF's
            eager and SDPA functions; the rest (``position_ids``, ``use_cache``, ...) is not for
            attention.

    Returns:
        ``(output (B, T_q, H, Dv), weights (B, H, T_q, T_k) or None)``. A query that may attend
        to no key (a left-padding position) gets an output of zeros and weights of zeros.
    """
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query, key and value must be 4-D (B, heads, T, D) as transformers hands them, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}."
        )
    B, H, T_q, D = query.shape
    G = key.size(1)
    if H % G != 0 or value.size(1) != G:
        raise ValueError(
            f"query has {H} heads but key/value have {G} and {value.size(1)}; grouped-query attention needs "
            f"the same number of key and value heads, dividing the query heads."
        )
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise ValueError(
            f"{type(module).__name__} passed s_aux of shape {tuple(sinks.shape)}; attention sinks are one logit "
            f"per query head, shape ({H},)."
        )
    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    scale = scaling if scaling is not None else D**-0.5
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        position_bias = _check_position_bias(module, position_bias, query, key.size(2))

    if attention_mask is None:
        if causal and 1 < T_q < key.size(2):
            # HF's SDPA convention for a missing mask is SDPA's top-left is_causal: the keys past the
            # first T_q are a static cache's empty slots (prefill). attnlab's causal is bottom-right.
            key, value = key[:, :, :T_q], value[:, :, :T_q]  # (B, G, T_q, D) each
            if position_bias is not None and position_bias.size(-1) > 1:
                position_bias = position_bias[..., :T_q]  # (B|1, H|1, T_q|1, T_q): the keys kept
        sliding_window = kwargs.get("sliding_window")
        if causal and sliding_window is not None and key.size(2) > sliding_window:
            raise ValueError(
                f"{type(module).__name__} has sliding_window={sliding_window} but got no attention mask for "
                f"{key.size(2)} keys, so the window cannot be applied; build the model's masks with "
                f"transformers' mask functions (call attnlab.hf.register() before loading the model, which "
                f"registers them under {ATTENTION_NAME!r})."
            )
        keep, bias = None, None
    else:
        keep, bias = hf_mask_to_keep(attention_mask)
    if position_bias is not None:
        # Added to the scores beside the mask, as HF's eager and SDPA functions do; entries at the
        # dtype's minimum (a mask folded into the bias) block like the mask's own.
        bias_keep, position_bias = _split_blocked(position_bias)  # (B|1, H|1, T_q|1, T_k) each
        keep = bias_keep if keep is None else keep & bias_keep  # broadcast: (B|1, H|1, T_q, T_k)
        bias = position_bias if bias is None else bias + position_bias  # (B|1, H|1, T_q, T_k)
    masks = prepare_masks(
        keep,
        None,
        causal and attention_mask is None,
        batch=B,
        heads=H,
        q_len=T_q,
        k_len=key.size(2),
        dtype=query.dtype,
        device=query.device,
    )
    if bias is not None:
        masks = dataclasses.replace(masks, bias=bias.to(query.dtype))

    need_weights = _wants_weights(module, kwargs)
    context, weights, ran, reason = _run(query, key, value, masks, softcap, sinks, scale, dropout, need_weights)
    setattr(module, LAST_BACKEND, ran)  # plain attributes (torch.compile traces a module's setattr)
    setattr(module, LAST_BACKEND_REASON, reason)
    if OBSERVERS:  # attnlab.hf.trace is recording: it gets the call, and how to run it again in another dtype
        call = ObservedCall(module, query, key, value, attention_mask, masks, scale, context, ran, reason)
        for observe in OBSERVERS:
            observe(call, lambda dtype: _rerun(call, softcap, sinks, dtype))
    return context.transpose(1, 2).contiguous(), weights  # (B, T_q, H, D), as HF's layers reshape it


def _run(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    masks: Masks,
    softcap: float | None,
    sinks: Tensor | None,
    scale: float,
    dropout: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None, str, str | None]:
    """One call's attention: ``(context (B, H, T_q, Dv), weights (B, H, T_q, T_k) or None, the backend that ran,
    why that one or how SDPA was adapted (None: SDPA as it is))``."""
    asked = "output_attentions=True: the weights were asked for, which only the math backend returns"
    if softcap is not None or sinks is not None:
        context, weights = _attend_variants(
            query, key, value, masks, softcap, sinks, scale=scale, dropout_p=dropout, need_weights=need_weights
        )
        if need_weights:
            return context, weights, "math", f"{asked} (attnlab.core.variants)"
        if softcap is not None:
            why = f"softcap={softcap}: SDPA cannot apply tanh to the scores"
            return context, weights, "math", f"{why} (attnlab.core.variants, in blocks of queries)"
        return context, weights, "sdpa", "sinks: each head's sink logit as one more key (attnlab.core.variants)"
    backend = "math" if need_weights else "sdpa"
    context, weights, adapted = attend(
        backend, query, key, value, masks, scale=scale, dropout_p=dropout, need_weights=need_weights
    )  # (B, H, T_q, D), (B, H, T_q, T_k) or None
    return context, weights, backend, asked if need_weights else adapted


# -- observing the calls: attnlab.hf.trace ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ObservedCall:
    """One call of :func:`attnlab_attention_forward`, as :mod:`attnlab.hf.trace` records it."""

    module: nn.Module  # the HF attention layer that called
    query: Tensor  # (B, H, T_q, D), as the layer handed it
    key: Tensor  # (B, G, T_k, D)
    value: Tensor  # (B, G, T_k, Dv)
    attention_mask: Tensor | None  # as the layer handed it (HF's 4-D mask, or None)
    masks: Masks  # what attnlab made of it (keep, bias, causal)
    scale: float
    context: Tensor  # (B, H, T_q, Dv): what attnlab computed
    backend: str  # what ran: LAST_BACKEND's value
    reason: str | None  # LAST_BACKEND_REASON's value


# Called after every call with the call and ``rerun(dtype) -> context``: the same call on the math reference
# (the weights asked for) with q, k, v, the bias and the sinks in ``dtype``. Empty unless a trace is recording, so
# that a model's forward pays one truth test per call.
OBSERVERS: list[Callable[[ObservedCall, Callable[[torch.dtype], Tensor]], None]] = []


def _rerun(call: ObservedCall, softcap: float | None, sinks: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``call``'s attention on the math reference in ``dtype`` (no dropout): ``(B, H, T_q, Dv)``."""
    q, k, v = (t.detach().to(dtype) for t in (call.query, call.key, call.value))
    m = call.masks
    to = lambda t: None if t is None else t.detach().to(dtype)
    masks = dataclasses.replace(m, bias=to(m.bias), opened_bias=to(m.opened_bias))  # float masks in `dtype`
    sinks = None if sinks is None else sinks.detach().to(dtype)
    with torch.no_grad():
        return _run(q, k, v, masks, softcap, sinks, call.scale, 0.0, need_weights=True)[0]


# --- the variants: soft-capping and sinks ---------------------------------------------------------

# Blocks of at most 128 queries, fewer where B x H x T_k is large, so that a block's scores stay within
# BLOCK_SCORES elements (16 MiB in fp32; a Gemma-2-shaped layer, H=8, at T=4096 holds 512 MiB of scores
# per temporary). Measured on one CPU thread (torch 2.13), that layer (G=4, D=256, softcap 50, causal):
# T=1024 / 2048 / 4096 in 89 / 414 / 1100 ms, against 144 / 476 ms as one block and HF eager's
# 178 / 1180 / 2600 ms; blocks of 16-32 rows re-read K and V too often (1500-1900 ms at T=4096).
BLOCK_SCORES = 1 << 22
_MIN_BLOCK_ROWS = 16
_MAX_BLOCK_ROWS = 128


def _attend_variants(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: Masks,
    softcap: float | None,
    sinks: Tensor | None,
    *,
    scale: float,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """Soft-capping and/or sinks through :mod:`attnlab.core.variants`: ``(context (B, H, T_q, D), weights)``.

    HF's mask is the authority on which key a query sees: it holds causality, padding and the
    sliding window, in the cache's own slot order (a sliding layer's cache rolls, so a key's index
    is not its position). The :class:`Structure` adds what a mask cannot say, the softcap and the
    sinks, and the square causal mask that HF leaves out (``masks.causal``: no mask, T_q == T_k).

    Weights asked for: the math reference on the whole call. Otherwise softcap runs the math
    backend (SDPA cannot apply tanh to the scores) and sinks alone the SDPA one (the sink as one
    more key), both in blocks of queries, each over the span of keys HF's mask lets it see.
    """
    T_q, T_k = q.size(2), k.size(2)
    st = Structure(
        q_pos=torch.arange(T_k - T_q, T_k, device=q.device),  # bottom-right, as masks.causal
        k_pos=torch.arange(T_k, device=q.device),
        causal=masks.causal,
        softcap=softcap,
        sinks=sinks,
    )
    masks = dataclasses.replace(masks, causal=False)  # the structure holds it now
    if need_weights:
        return variants.variant_math(q, k, v, masks, st, scale=scale, dropout_p=dropout_p, need_weights=True)
    if softcap is not None:

        def run(q: Tensor, k: Tensor, v: Tensor, masks: Masks, st: Structure) -> Tensor:
            return variants.variant_math(q, k, v, masks, st, scale=scale, dropout_p=dropout_p)[0]

    else:
        compute_dtype, _ = sdpa_compute_dtype(q)  # fp16/bf16 on a CPU: float32, as attend() does

        def run(q: Tensor, k: Tensor, v: Tensor, masks: Masks, st: Structure) -> Tensor:
            if compute_dtype is None:
                return variants.variant_sdpa(q, k, v, masks, st, scale=scale, dropout_p=dropout_p)
            low = q.dtype
            q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
            return variants.variant_sdpa(q, k, v, masks, st, scale=scale, dropout_p=dropout_p).to(low)

    # the math path repeats GQA's K/V heads for its matmuls: once here, not once per block
    return _by_query_blocks(run, q, k, v, masks, st, repeat_kv=softcap is not None), None


def _by_query_blocks(
    run: Callable[[Tensor, Tensor, Tensor, Masks, Structure], Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: Masks,
    st: Structure,
    *,
    repeat_kv: bool,
) -> Tensor:
    """``run`` on blocks of queries, each with only the keys it may see: ``(B, H, T_q, D)``.

    Rows of the softmax are independent, so a block of queries gives the same context as the whole
    call; and a key masked for every query of the block changes nothing when left out. Memory:
    ``B x H x rows x span`` scores instead of ``T_q x T_k``; work: causal rows skip the keys after
    the block, sliding-window rows those before the window too. A block that may see no key (all
    padding) is zeros, as fully masked rows are on every backend.
    """
    B, H, T_q, _ = q.shape
    T_k = k.size(2)
    rows = min(_MAX_BLOCK_ROWS, max(_MIN_BLOCK_ROWS, BLOCK_SCORES // (B * H * T_k)))
    if T_q <= rows:
        return run(q, k, v, masks, st)
    if repeat_kv and H != k.size(1):
        rep = H // k.size(1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T_k, D) each
    outs = []
    for start, span in zip(range(0, T_q, rows), _key_spans(masks, st, rows), strict=True):
        qs = slice(start, min(start + rows, T_q))
        if span is None:
            outs.append(q.new_zeros(B, H, qs.stop - start, v.size(-1)))
            continue
        ks = slice(*span)
        block_masks = Masks(keep=_block(masks.keep, qs, ks), bias=_block(masks.bias, qs, ks))
        block_st = dataclasses.replace(st, q_pos=st.q_pos[qs], k_pos=st.k_pos[ks])
        outs.append(run(q[:, :, qs], k[:, :, ks], v[:, :, ks], block_masks, block_st))
    return torch.cat(outs, dim=2)  # (B, H, T_q, D)


def _key_spans(masks: Masks, st: Structure, rows: int) -> list[tuple[int, int] | None]:
    """For each block of ``rows`` queries, ``(first, last + 1)`` of the keys some query of it may see,
    or None when it may see none. Read from the masks, so that it holds for any cache layout."""
    T_q, T_k = st.q_pos.size(-1), st.k_pos.size(-1)
    keep = st.keep()  # (1, 1, T_q, T_k) or None
    if masks.keep is not None:
        keep = masks.keep if keep is None else masks.keep & keep
    if keep is None:  # nothing masked: every block sees every key
        return [(0, T_k)] * -(-T_q // rows)
    seen = keep.flatten(0, 1).any(dim=0).expand(T_q, T_k)  # (T_q, T_k): some batch row and head may attend
    blocks = torch.stack([seen[s : s + rows].any(dim=0) for s in range(0, T_q, rows)]).to(torch.int8)  # (nb, T_k)
    first = blocks.argmax(dim=1)  # (nb,): the first key seen
    stop = T_k - blocks.flip(1).argmax(dim=1)  # (nb,): one past the last
    any_seen = blocks.amax(dim=1)  # (nb,)
    return [(a, b) if hit else None for a, b, hit in zip(first.tolist(), stop.tolist(), any_seen.tolist(), strict=True)]


def _block(t: Tensor | None, qs: slice, ks: slice) -> Tensor | None:
    """``t[..., qs, ks]`` of a 4-D mask, its broadcast dims (size 1) kept as they are."""
    if t is None:
        return None
    return t[:, :, qs if t.size(2) > 1 else slice(None), ks if t.size(3) > 1 else slice(None)]


def _same_function(registered: object, ours: object) -> bool:
    """Identity, or the same module and name (a reloaded module makes new function objects)."""
    return registered is ours or (
        getattr(registered, "__module__", None) == getattr(ours, "__module__", None)
        and getattr(registered, "__qualname__", None) == getattr(ours, "__qualname__", None)
    )


def register() -> str:
    """Register attnlab's attention with transformers under :data:`ATTENTION_NAME`; returns the name.

    Registers :func:`attnlab_attention_forward` with ``AttentionInterface`` and
    :func:`attnlab.hf.routing.attnlab_mask` (transformers' ``sdpa_mask``, or its ``eager_mask`` for a
    model whose attention is inline and never calls attnlab) with ``AttentionMaskInterface`` (without
    a mask function registered under the name, transformers hands a custom attention no mask at
    all: padding and sliding windows would be lost). Idempotent; raises if another function already
    holds the name. When transformers does not import, the ImportError says why, from :func:`attnlab.runtime.optional.import_failure`: not
    installed, too old (its version named), lacking the names, or broken by another package (named,
    with its version, the module that raised and the error; a torchvision that does not match torch
    is told apart), the original error chained as ``__cause__``.

    Usage::

        import attnlab.hf
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attnlab.hf.register())
    """
    try:
        # eager_mask and sdpa_mask are imported here only to fail now, not at a model's first forward (attnlab_mask calls them)
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask  # noqa: F401
    except Exception as err:  # optional dependency; a broken package under it raises RuntimeError, OSError...
        # not installed, too old, lacking the names, or broken by a package it imports (torchvision...)
        need = "attnlab.hf.register() needs transformers 5 (AttentionInterface and AttentionMaskInterface)"
        raise ImportError(import_failure("transformers", need, err, min_major=5)) from err
    for interface, ours in (
        (AttentionInterface, attnlab_attention_forward),
        (AttentionMaskInterface, attnlab_mask),
    ):
        mapping = getattr(interface, "_global_mapping", None)  # transformers 5's registry: {name: function}
        if not isinstance(mapping, dict) or not callable(getattr(interface, "register", None)):
            raise ImportError(
                f"attnlab.hf.register() needs transformers 5's {interface.__name__} with register() and its "
                f"_global_mapping, which this transformers {installed_version('transformers') or '(version unknown)'} lacks; install a 5.x release "
                f"with pip install -U 'transformers>=5,<6'."
            )
        registered = mapping.get(ATTENTION_NAME)
        if registered is not None and not _same_function(registered, ours):
            raise ValueError(
                f"{interface.__name__} already maps {ATTENTION_NAME!r} to {registered!r}, not attnlab's "
                f"{ours.__qualname__}; remove that entry (del {interface.__name__}._global_mapping"
                f"[{ATTENTION_NAME!r}]) before calling attnlab.hf.register()."
            )
        interface.register(ATTENTION_NAME, ours)
    return ATTENTION_NAME
