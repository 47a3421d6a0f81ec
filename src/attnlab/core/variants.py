"""Attention variants that real models ship: sliding window, logit soft-capping, ALiBi, sinks, packed documents.

Each is a change to one step of the reference algorithm (:func:`attnlab.core.functional.math_attention`),
written here once, for the positions of a query ``i`` and a key ``j`` (absolute positions: a
KV-cache slot's position, not its index in a rolling buffer):

* **window** ``W`` (Mistral, Gemma 2): query ``i`` sees key ``j`` iff ``i - W < j <= i``; always
  combined with causal masking, so a query sees itself and the ``W - 1`` keys before it.
* **softcap** ``C`` (Gemma 2): the scaled scores become ``C * tanh(s / C)``, before any mask or bias.
* **ALiBi** (BLOOM, MPT): head ``h`` adds ``-m_h * |i - j|`` to the scores, ``m_h`` the standard
  geometric slopes (:func:`alibi_slopes`). BLOOM adds ``m_h * j``, which differs by ``m_h * i``,
  the same for a whole row: the softmax is unchanged.
* **sinks** (gpt-oss): a learned logit ``s_h`` per head joins every row's softmax as one more
  "key" whose value is zero: ``w_ij = exp(x_ij) / (exp(s_h) + sum_j' exp(x_ij'))``. A row may
  then give less than 1 in total to the real keys (and a fully masked row gives them 0).
* **documents** (packed sequences): query ``i`` sees key ``j`` only inside its own document,
  ``doc[i] == doc[j]``.

:class:`Structure` holds what a call needs to materialise these for any block of queries and keys
(the dense backends take the whole ``T_q x T_k``; the banded SDPA path takes one query block and
its key band; the flex backend turns the same fields into ``mask_mod`` / ``score_mod``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .functional import math_attention, sdpa_attention, sdpa_compute_dtype
from .masks import Masks

__all__ = [
    "Structure",
    "alibi_slopes",
    "document_positions",
    "document_runs",
    "document_start",
    "variant_math",
    "variant_sdpa",
    "banded_sdpa",
]


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes ``(H,)`` float32 (Press et al., 2022; BLOOM's rule for any H).

    For ``H`` a power of two: ``2^(-8 k / H)``, k = 1..H. Otherwise the slopes of the largest
    power of two ``n < H``, then every other slope of ``2n`` for the remaining heads.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    n = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / n)
    slopes = [base ** (k + 1) for k in range(n)]
    if n < num_heads:
        extra_base = 2.0 ** (-4.0 / n)  # the slopes of 2n heads, odd ones: 2^(-8 (2k+1) / 2n)
        slopes += [extra_base ** (2 * k + 1) for k in range(num_heads - n)]
    return torch.tensor(slopes, dtype=torch.float32)


def document_positions(document_ids: Tensor) -> Tensor:
    """``(B, T)`` int64 positions that restart at 0 where each packed document starts.

    ``document_ids`` ``(B, T)``: a document is a run of equal ids (``[[7, 7, 7, 2, 2]]`` -> ``[[0, 1, 2, 0, 1]]``).
    """
    index = torch.arange(document_ids.size(1), device=document_ids.device)  # (T,)
    return index - document_start(document_ids)


def document_start(document_ids: Tensor) -> Tensor:
    """``(B, T)`` int64: the index where each position's document (run of equal ids) starts (``[[7, 7, 2]]`` ->
    ``[[0, 0, 2]]``)."""
    B, T = document_ids.shape
    index = torch.arange(T, device=document_ids.device).expand(B, T)  # (B, T)
    starts = torch.ones(B, T, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # (B, T): start of each run


def document_runs(document_ids: Tensor) -> Tensor:
    """``(B, T)`` int64: each run of equal ids numbered 0, 1, 2, ... along the row (``[[7, 7, 2, 7]]`` -> ``[[0, 0, 1, 2]]``).

    A document is a *run*: an id that comes back later in the row starts a new document, as
    :func:`document_positions` restarts its positions there; the masks compare runs, so the two agree
    (and the runs increase along the row, which the flex backend's tile masks rely on).
    """
    starts = torch.zeros_like(document_ids, dtype=torch.long)
    starts[:, 1:] = (document_ids[:, 1:] != document_ids[:, :-1]).long()
    return starts.cumsum(dim=1)


@dataclass(frozen=True)
class Structure:
    """The position-dependent part of one attention call.

    ``q_pos`` ``(T_q,)`` or ``(B, T_q)`` and ``k_pos`` ``(T_k,)`` or ``(B, T_k)``: int64 absolute
    positions. ``q_doc`` ``(B, T_q)`` / ``k_doc`` ``(B, T_k)``: document ids (packed sequences).
    ``alibi``: ``(H,)`` slopes; ``sinks``: ``(H,)`` logits; ``window``/``softcap`` as in the module.
    """

    q_pos: Tensor
    k_pos: Tensor
    causal: bool = True
    window: int | None = None
    softcap: float | None = None
    alibi: Tensor | None = None
    sinks: Tensor | None = None
    q_doc: Tensor | None = None
    k_doc: Tensor | None = None

    @property
    def has_mask(self) -> bool:
        return self.causal or self.window is not None or self.q_doc is not None

    def keep(self, qs: slice | None = None, ks: slice | None = None) -> Tensor | None:
        """Bool ``(B or 1, 1, tq, tk)`` for queries ``qs`` and keys ``ks`` (None: all); True = may attend."""
        qp = _take(self.q_pos, qs)[..., :, None]  # (.., tq, 1)
        kp = _take(self.k_pos, ks)[..., None, :]  # (.., 1, tk)
        keep: Tensor | None = None
        if self.causal:
            keep = kp <= qp
        if self.window is not None:
            near = (qp - kp) < self.window  # with causal: i - W < j <= i
            keep = near if keep is None else keep & near
        if self.q_doc is not None and self.k_doc is not None:
            same = _take(self.q_doc, qs)[:, :, None] == _take(self.k_doc, ks)[:, None, :]  # (B, tq, tk)
            keep = same if keep is None else keep & same
        if keep is None:
            return None
        return keep[None, None] if keep.dim() == 2 else keep[:, None]

    def bias(
        self, qs: slice | None = None, ks: slice | None = None, dtype: torch.dtype = torch.float32
    ) -> Tensor | None:
        """ALiBi's float ``(B or 1, H, tq, tk)`` bias for queries ``qs`` and keys ``ks`` (None: all), or None."""
        if self.alibi is None:
            return None
        dist = (
            (_take(self.q_pos, qs)[..., :, None] - _take(self.k_pos, ks)[..., None, :]).abs().to(dtype)
        )  # (.., tq, tk)
        dist = dist[None, None] if dist.dim() == 2 else dist[:, None]  # (B|1, 1, tq, tk)
        return -self.alibi.to(dtype)[None, :, None, None] * dist


# Slices are only ever made by the block loops (eager code). The dense paths pass None for "all": a compiled
# decode step runs them, and torch 2.11's dynamo cannot trace a slice object handed around as a value
# ("SourcelessBuilder.create does not know how to wrap <class 'slice'>", measured on the H200 run: a rolling-cache
# decode step with fullgraph=True); torch 2.13's can. Subscript syntax (t[..., a:b]) traces on both.
def _take(t: Tensor, s: slice | None) -> Tensor:
    """``t[..., s]`` along the last dim, or ``t`` itself when ``s`` is None."""
    return t if s is None else t[..., s]


def _slice4(t: Tensor | None, qs: slice | None, ks: slice | None) -> Tensor | None:
    """``t[..., qs, ks]`` of a mask broadcastable to (B, H, T_q, T_k) (None: all): broadcast dims (size 1) kept."""
    if t is None:
        return None
    if qs is not None and t.size(2) > 1:
        t = t[:, :, qs]
    if ks is not None and t.size(3) > 1:
        t = t[:, :, :, ks]
    return t


def _combine(
    masks: Masks, st: Structure, qs: slice | None, ks: slice | None, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """``(keep, bias)`` of the user's masks and the structure, for queries ``qs`` and keys ``ks`` (None: all)."""
    keep = _slice4(masks.keep, qs, ks)
    st_keep = st.keep(qs, ks)
    if st_keep is not None:
        keep = st_keep if keep is None else keep & st_keep
    bias = _slice4(masks.bias, qs, ks)
    st_bias = st.bias(qs, ks, dtype)
    if st_bias is not None:
        bias = st_bias if bias is None else bias + st_bias
    return keep, bias


def variant_math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: Masks,
    st: Structure,
    *,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The reference with every variant: ``q (B, H, T_q, D)``, ``k, v (B, G, T_k, D)`` -> ``(context, weights)``.

    Order: scores = ``q k^T * scale``; softcap; + user bias + ALiBi; masks (user, causal, window,
    documents); softmax over the keys and, with sinks, the sink logit; dropout; ``@ v``. Computed
    in float32 at least (float64 stays float64). Weights ``(B, H, T_q, T_k)`` exclude the sink.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    keep, bias = _combine(masks, st, None, None, acc)  # causal, window, documents live in `keep`
    return math_attention(
        q,
        k,
        v,
        keep=keep,
        bias=bias,
        empty_rows=True,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        softcap=st.softcap,
        sinks=st.sinks,
    )


def _sdpa_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    bias: Tensor | None,
    sinks: Tensor | None,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """One :func:`~attnlab.core.functional.sdpa_attention` call on materialised masks; sinks as one extra
    key of zeros whose bias is the sink logit (a row whose keys are all masked then gives the sink all
    its weight, and a context of exactly 0)."""
    if sinks is not None:
        B, H, tq, _ = q.shape
        tk = k.size(2)
        k = torch.cat([k, k.new_zeros(B, k.size(1), 1, k.size(-1))], dim=2)  # (B, G, tk + 1, D)
        v = torch.cat([v, v.new_zeros(B, v.size(1), 1, v.size(-1))], dim=2)  # (B, G, tk + 1, Dv)
        bias = q.new_zeros(1, H, tq, tk) if bias is None else bias.expand(bias.size(0), H, tq, tk)
        sink = sinks.to(q.dtype)[None, :, None, None].expand(bias.size(0), H, tq, 1)
        bias = torch.cat([bias, sink], dim=-1)  # (B|1, H, tq, tk + 1)
        if keep is not None:
            keep = keep.expand(keep.size(0), 1, tq, tk)
            keep = torch.cat([keep, keep.new_ones(keep.size(0), 1, tq, 1)], dim=-1)  # the sink is always kept
    context, _ = sdpa_attention(q, k, v, keep=keep, bias=bias, empty_rows=True, scale=scale, dropout_p=dropout_p)
    return context


def _upcast(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v`` in the dtype SDPA computes in (:func:`~attnlab.core.functional.sdpa_compute_dtype`: float32 for
    fp16/bf16 on a CPU), cast *before* any gather, concatenation or slice: the backward of those sums gradients
    (a key in two bands, one K/V head's R query heads) and must sum them in that dtype, not in bf16/fp16."""
    compute_dtype, _ = sdpa_compute_dtype(q)
    if compute_dtype is None:
        return q, k, v
    return q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)


def variant_sdpa(
    q: Tensor, k: Tensor, v: Tensor, masks: Masks, st: Structure, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """The same as :func:`variant_math` through one SDPA call with a dense ``T_q x T_k`` mask (no softcap).

    Computed in :func:`~attnlab.core.functional.sdpa_compute_dtype`'s dtype (float32 for fp16/bf16 on a CPU), the
    context returned in the inputs' dtype; so is :func:`banded_sdpa`."""
    if st.softcap is not None:
        raise ValueError(
            "softcap changes the scores inside the softmax, which SDPA cannot express; use the math or flex backend."
        )
    out_dtype = q.dtype
    q, k, v = _upcast(q, k, v)
    keep, bias = _combine(masks, st, None, None, q.dtype)
    return _sdpa_block(q, k, v, keep, bias, st.sinks, scale, dropout_p).to(out_dtype)


def banded_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: Masks,
    st: Structure,
    *,
    scale: float,
    dropout_p: float = 0.0,
    block: int = 256,
) -> Tensor:
    """Sliding-window attention without the ``T x T`` mask: each block of ``block`` queries attends, by
    SDPA, to its key band only (the ``W - 1`` keys before the block and the block's own).

    Needs ``st.window``, causal masking, and positions that are the indices (no cache offset:
    ``q_pos = k_pos = 0 .. T-1``). All blocks run as one batched SDPA call: the key bands are
    gathered with one index (whose backward is one scatter-add, so forward and backward are linear
    in T), the queries padded to whole blocks. Memory ``T x (block + W - 1)`` for the mask and
    about ``(1 + (W - 1) / block)`` times K and V for the bands.
    """
    if st.window is None or not st.causal or st.softcap is not None:
        raise ValueError("banded_sdpa needs a window, causal masking and no softcap")
    out_dtype = q.dtype
    q, k, v = _upcast(q, k, v)  # before the bands are gathered: their backward scatter-adds
    full_mask = (masks.keep is not None and masks.keep.size(2) > 1) or masks.bias is not None
    if full_mask:  # a user mask over (query, key) pairs: slice it block by block
        return _banded_loop(q, k, v, masks, st, scale=scale, dropout_p=dropout_p, block=block).to(out_dtype)
    B, H, T, _ = q.shape
    Dv = v.size(-1)  # the value head dim: the context's, and D's unless the module sets v_head_dim
    W = st.window
    nb = -(-T // block)  # blocks of queries, the last one padded
    band = block + W - 1  # keys a block may see
    device = q.device
    key_index = (
        torch.arange(nb, device=device)[:, None] * block - (W - 1) + torch.arange(band, device=device)
    )  # (nb, band)
    valid = (key_index >= 0) & (key_index < T)
    key_index = key_index.clamp(0, T - 1)
    query_index = (torch.arange(nb * block, device=device)).clamp(max=T - 1).view(nb, block)  # padded rows repeat T-1

    def blocks(t: Tensor) -> Tensor:  # (B, G, T, D) -> (B*nb, G, band, D): every block's key band (D or Dv)
        return t[:, :, key_index].permute(0, 2, 1, 3, 4).reshape(B * nb, t.size(1), band, t.size(-1))

    D = q.size(-1)
    q_b = F.pad(q, (0, 0, 0, nb * block - T)).view(B, H, nb, block, D).transpose(1, 2).reshape(B * nb, H, block, D)
    empty = torch.full_like(key_index, 2**62)  # a position no query reaches: keys before 0 or past T - 1
    k_pos = torch.where(valid, key_index, empty)
    banded = Structure(
        q_pos=query_index.repeat(B, 1),  # (B*nb, block)
        k_pos=k_pos.repeat(B, 1),  # (B*nb, band)
        causal=True,
        window=W,
        alibi=st.alibi,
        sinks=st.sinks,
        q_doc=None if st.q_doc is None else st.q_doc[:, query_index.flatten()].reshape(B * nb, block),
        k_doc=None if st.k_doc is None else st.k_doc[:, key_index.flatten()].reshape(B * nb, band),
    )
    keep = banded.keep()  # (B*nb, 1, block, band)
    if masks.keep is not None:  # a key mask (padding): (B or 1, 1, 1, T) -> every block's band
        key_keep = masks.keep[:, 0, 0][:, key_index]  # (B or 1, nb, band)
        key_keep = key_keep.expand(B, nb, band).reshape(B * nb, 1, 1, band)
        keep = key_keep if keep is None else keep & key_keep
    bias = banded.bias(dtype=q.dtype)  # ALiBi, (B*nb, H, block, band) or None
    out = _sdpa_block(q_b, blocks(k), blocks(v), keep, bias, st.sinks, scale, dropout_p)  # (B*nb, H, block, Dv)
    return out.view(B, nb, H, block, Dv).transpose(1, 2).reshape(B, H, nb * block, Dv)[:, :, :T].to(out_dtype)


def _banded_loop(
    q: Tensor, k: Tensor, v: Tensor, masks: Masks, st: Structure, *, scale: float, dropout_p: float, block: int
) -> Tensor:
    """:func:`banded_sdpa` one block at a time, for user masks over (query, key) pairs."""
    assert st.window is not None
    T = q.size(2)
    outs = []
    for start in range(0, T, block):
        stop = min(start + block, T)
        k_start = max(0, start - st.window + 1)
        qs, ks = slice(start, stop), slice(k_start, stop)
        keep, bias = _combine(masks, st, qs, ks, q.dtype)
        outs.append(_sdpa_block(q[:, :, qs], k[:, :, ks], v[:, :, ks], keep, bias, st.sinks, scale, dropout_p))
    return torch.cat(outs, dim=2)  # (B, H, T, D)
