"""Every user-facing mask form, converted once per call into attnlab's one convention.

Inside attnlab a mask is a bool tensor broadcastable to ``(B, H, T_q, T_k)`` where
**True = may attend** (as in ``F.scaled_dot_product_attention``), plus an optional float
``bias`` added to the scores. At the API:

* ``attn_mask`` bool: True = may attend. *Opposite* of ``nn.MultiheadAttention``, where True
  blocks; pass ``~mask`` when porting code from it.
* ``attn_mask`` float: added to the scores (``0`` keeps, ``-inf`` blocks, anything else biases).
* ``key_padding_mask`` ``(B, T_k)`` bool: **True = padding**, never attended (as in PyTorch).
* ``is_causal=True``: query i sees keys j <= i, aligned bottom-right when ``T_q < T_k``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .functional import causal_keep, unmask_dead_rows
from .kv_cache import KVCache

__all__ = ["Masks", "decoder_masks", "prepare_masks"]


@dataclass(frozen=True)
class Masks:
    """The converted masks handed to a backend (see :mod:`attnlab.core.functional`)."""

    keep: Tensor | None = None  # bool, broadcastable to (B, H, T_q, T_k), True = may attend
    bias: Tensor | None = None  # float, broadcastable likewise, added to the scores
    causal: bool = False  # square causal masking left to the backend (SDPA's is_causal)
    empty_rows: bool = False  # whether `keep` may block every key of some query (padding, user masks)
    # Computed once for a model's call (decoder_masks) instead of once a layer: `keep` with every row that
    # sees no key opened to all keys, and those rows (functional.unmask_dead_rows). A backend that meets the
    # unchanged `keep` uses them; anything else reads `keep` and `empty_rows` as they are.
    opened: Tensor | None = None
    dead: Tensor | None = None
    # `opened` (or `keep` itself where no row is empty) as an additive float mask (0 / -inf) in the model's dtype
    opened_bias: Tensor | None = None


def _as_4d(mask: Tensor, batch: int, heads: int, q_len: int, k_len: int) -> Tensor:
    """View an attn_mask of shape (T_q, T_k), (B, T_q, T_k) or 4-D as 4-D, checking it broadcasts."""
    target = (batch, heads, q_len, k_len)
    if mask.dim() == 2:
        mask4 = mask[None, None]  # (1, 1, T_q, T_k)
    elif mask.dim() == 3:
        mask4 = mask[:, None]  # (B, 1, T_q, T_k)
    elif mask.dim() == 4:
        mask4 = mask
    else:
        mask4 = None
    if mask4 is None or any(m not in (1, t) for m, t in zip(mask4.shape, target, strict=True)):
        raise ValueError(
            f"attn_mask has shape {tuple(mask.shape)}, which does not broadcast to the scores' "
            f"(B, H, T_q, T_k) = {target}; pass (T_q, T_k) = ({q_len}, {k_len}), "
            f"(B, T_q, T_k) = ({batch}, {q_len}, {k_len}), or a 4-D mask whose every dim is 1 or "
            f"the one in {target} (a mask of shape (B*H, T_q, T_k) must be viewed as (B, H, T_q, T_k))."
        )
    return mask4


def _check_device(name: str, mask: Tensor, device: torch.device) -> None:
    if mask.device != device:
        raise ValueError(
            f"{name} is on {mask.device} but the query is on {device}; move it with {name}.to({str(device)!r})."
        )


def _check_float_mask_values(mask: Tensor) -> None:
    """Refuse a float mask of 0s and 1s: meant as keep/block, it would silently mask nothing."""
    if mask.device.type != "cpu" or mask.requires_grad or mask.numel() == 0 or torch.compiler.is_compiling():
        return  # reading a GPU mask's values would sync the device; a compiled graph cannot branch on them
    ones_and_zeros = (mask == 0) | (mask == 1)
    if bool(ones_and_zeros.all()) and bool((mask == 1).any()):
        raise ValueError(
            "attn_mask is a float tensor holding only 0s and 1s; a float mask is *added* to the "
            "scores, so this masks nothing and only shifts some scores by 1. For a keep/block "
            "mask pass attn_mask.bool() (True = may attend); for an additive mask use 0 to keep "
            "and float('-inf') to block, e.g. torch.zeros_like(m).masked_fill(m == 0, float('-inf'))."
        )


def prepare_masks(
    attn_mask: Tensor | Masks | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    *,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    dtype: torch.dtype,
    device: torch.device,
    q_positions: Tensor | None = None,
) -> Masks:
    """Validate the user's masks and convert them to :class:`Masks` (one pass, once per call).

    A model whose layers share masks converts them once and passes the :class:`Masks` to
    every layer as ``attn_mask``; it is then used as it is.
    """
    if isinstance(attn_mask, Masks):  # q_positions then only say where a KV cache writes
        if key_padding_mask is not None or is_causal:
            raise ValueError(
                "attn_mask is an already-converted attnlab Masks, so key_padding_mask and is_causal "
                "must be left unset: fold them in when calling prepare_masks(...)."
            )
        return attn_mask
    keep: Tensor | None = None
    bias: Tensor | None = None
    empty_rows = attn_mask is not None or key_padding_mask is not None  # causal alone never empties a row

    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(
                f"attn_mask must be a torch.Tensor (bool: True = may attend, or float: added to "
                f"the scores), got {type(attn_mask).__name__}; wrap it with torch.as_tensor(...)."
            )
        _check_device("attn_mask", attn_mask, device)
        if attn_mask.dtype == torch.bool:
            keep = _as_4d(attn_mask, batch, heads, q_len, k_len)
        elif attn_mask.is_floating_point():
            _check_float_mask_values(attn_mask)
            bias4 = _as_4d(attn_mask, batch, heads, q_len, k_len)
            keep = bias4 != float("-inf")  # so that a fully -inf row is caught as fully masked
            bias = bias4.to(dtype)
        else:
            raise TypeError(
                f"attn_mask has dtype {attn_mask.dtype}; expected torch.bool (True = may attend) or "
                f"a float dtype (added to the scores). For a 0/1 integer mask pass attn_mask.bool()."
            )

    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(
                f"key_padding_mask must be a bool torch.Tensor of shape (B, T_k) = ({batch}, {k_len}) "
                f"with True = padding, got {type(key_padding_mask).__name__}."
            )
        _check_device("key_padding_mask", key_padding_mask, device)
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask has dtype {key_padding_mask.dtype}; expected torch.bool with "
                f"True = padding. For a 0/1 mask where 1 marks padding pass key_padding_mask.bool(); "
                f"for an attention mask where 1 marks real tokens pass attention_mask == 0."
            )
        if tuple(key_padding_mask.shape) != (batch, k_len):
            raise ValueError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected (B, T_k) = "
                f"({batch}, {k_len}), one flag per key position with True = padding."
            )
        not_pad = ~key_padding_mask[:, None, None, :]  # (B, 1, 1, T_k)
        keep = not_pad if keep is None else keep & not_pad

    causal = False
    if q_positions is not None:  # KV cache in position mode: key slot j is visible iff j <= the query's slot
        if not is_causal:
            raise ValueError(
                "cache_positions was given with is_causal=False; position mode attends over the whole "
                "cache buffer and relies on the causal mask to hide unwritten slots: pass is_causal=True."
            )
        q_positions = q_positions.to(device)  # from any device, as the cache takes them (a no-op when already there)
        tri = torch.arange(k_len, device=device)[None, :] <= q_positions[:, None]  # (T_q, T_k)
        keep = tri if keep is None else keep & tri
    elif is_causal:
        if q_len > k_len:
            raise ValueError(
                f"is_causal=True needs T_q <= T_k, got T_q={q_len} queries and T_k={k_len} keys: "
                f"causal masking aligns the last query with the last key, so the first "
                f"{q_len - k_len} queries would see no key at all. Pass an explicit attn_mask instead."
            )
        if q_len == 1:
            pass  # one query at the last position sees every key: nothing to mask (the decode step)
        elif keep is None and q_len == k_len:
            causal = True  # left to the backend: SDPA's is_causal needs no mask tensor at all
        else:
            tri = causal_keep(q_len, k_len, device)  # (T_q, T_k)
            keep = tri if keep is None else keep & tri
    return Masks(keep=keep, bias=bias, causal=causal, empty_rows=empty_rows)


def decoder_masks(
    key_padding_mask: Tensor | None,
    *,
    batch: int,
    heads: int,
    q_len: int,
    cache: KVCache | None,
    cache_positions: Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Masks:
    """The causal (+ padding) masks of one decoder call, converted once and shared by every layer.

    ``cache`` is any layer's :class:`KVCache` (all are alike): position mode (``cache_positions``
    given) attends over every slot, append mode over the slots filled once this call is written.
    """
    if cache is None:
        k_len = q_len
    else:
        k_len = cache.max_len if cache_positions is not None else cache.length + q_len
    masks = prepare_masks(
        None,
        key_padding_mask,
        True,
        batch=batch,
        heads=heads,
        q_len=q_len,
        k_len=k_len,
        dtype=dtype,
        device=device,
        q_positions=cache_positions,
    )
    if masks.keep is not None and masks.empty_rows:
        # every layer would find the same rows with no key (an `any`, a `~` and a `|` each in the traced step):
        # find them once
        opened, dead = unmask_dead_rows(masks.keep, True)
        assert opened is not None  # masks.keep is not None
        # and the bool -> float conversion a fused kernel would otherwise do in every layer (bitwise_not and
        # masked_fill: 12 of the 178 kernels of an H200 decode step of 12 layers, issue 42)
        additive = torch.zeros(opened.shape, dtype=dtype, device=device).masked_fill_(~opened, float("-inf"))
        masks = replace(masks, opened=opened, dead=dead, opened_bias=additive)
    elif masks.keep is not None and q_len > 1:
        # A prefill chunk's causal mask over the slots filled so far (T_q x T_k), no row empty: SDPA would turn it
        # into a float mask in every layer, a transient 4x the bool one (16.5 MB at 504 x 8184) that glibc's heap
        # kept resident, fragmented, ~1.5 MB more per layer (issue 51, measured). Converted once here instead.
        # torch.where writes it at once: no negated copy of the bool mask (4 MB at 504 x 8184) beside it
        additive = torch.where(masks.keep, torch.tensor(0.0, dtype=dtype), torch.tensor(float("-inf"), dtype=dtype))
        masks = replace(masks, opened_bias=additive)
    return masks
