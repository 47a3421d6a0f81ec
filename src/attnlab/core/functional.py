"""The attention math: the explicit reference and the fused SDPA path, behind one signature.

Notation used in every shape comment of attnlab:
    B batch, H query heads, G key/value heads (H = G * R, R queries share one K/V head),
    T_q query positions (i), T_k key positions (j), D head dim.

Both functions take the heads already split, ``q: (B, H, T_q, D)``, ``k, v: (B, G, T_k, D)``
(``v`` may have its own head dim ``Dv``: the context is then ``(B, H, T_q, Dv)``), and masks already in attnlab's one internal convention (see :mod:`attnlab.core.masks`):

* ``keep``: bool, broadcastable to ``(B, H, T_q, T_k)``, **True = may attend**;
* ``bias``: float, broadcastable likewise, added to the scores (``-inf`` entries are also
  False in ``keep``);
* ``causal``: causal masking, bottom-right aligned (query i sees keys j <= i + T_k - T_q), on
  top of ``keep`` if both are given. :func:`attnlab.core.masks.prepare_masks` leaves it
  unmaterialised only when ``T_q == T_k`` and there is no other mask, so that SDPA can take its
  ``is_causal`` fast path; both functions accept any combination and agree on it;
* ``empty_rows``: whether ``keep`` may block every key of some query (key padding, user masks;
  never causal masking alone), so that such rows must be zeroed.

A query row whose keys are all masked attends to nothing: its context is zeros, never NaN.

Precision: scores, softmax and ``weights @ V`` run in float32 at least (float64 stays float64)
on the math path, so fp16/bf16 inputs neither overflow (``q @ k^T`` exceeds fp16's 65504 long
before it is scaled) nor lose the probabilities' precision before ``@ V``; the context is cast
back to the inputs' dtype. The SDPA path follows :func:`sdpa_compute_dtype` unless told otherwise
(``compute_dtype``): float32 for fp16/bf16 on a CPU, the inputs' dtype elsewhere.

Grouped heads (GQA/MQA) in low precision: the gradient of a K/V head is a sum over the ``R = H / G``
query heads that read it. Both paths sum it in float32 at least: the math path upcasts K/V *before*
repeating them, so that autograd's reduction of the repeated gradient runs in float32; on a CPU,
SDPA runs in float32 (torch's CPU flash kernel, in bf16/fp16 with ``enable_gqa``, accumulates the R
heads' dK/dV in bf16/fp16: dV error 9.4e-2 against plain PyTorch's 3.7e-2, bf16 MQA, D=32, 256 x 128
causal, outside flash-attention's rule of twice plain's error; 3.2e-2 in float32). On CUDA the fused
kernels run as they are: FlashAttention-2 (torch's flash backend) writes each query head's dK/dV and
sums the R of them with one ``at::sum`` (a float32 accumulator, one rounding: as plain PyTorch does),
and torch's math backend, which serves GQA with a mask, keeps fp16/bf16 intermediates in float32 (its
documentation); not measured here (no GPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "math_attention",
    "sdpa_attention",
    "one_query_attention",
    "sdpa_compute_dtype",
    "causal_keep",
    "unmask_dead_rows",
]


def causal_keep(q_len: int, k_len: int, device: torch.device | None = None) -> Tensor:
    """Bool ``(T_q, T_k)``: query i (at absolute position ``T_k - T_q + i``) may see key j <= it.

    Aligned bottom-right, so it is right both for a full sequence (``T_q == T_k``) and for
    the last ``T_q`` positions of a sequence whose first ``T_k - T_q`` keys are cached.
    """
    ones = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    return ones.tril(diagonal=k_len - q_len)  # (T_q, T_k)


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    empty_rows: bool = True,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    rows: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The reference: the seeds' algorithm written out, float64-capable, can return weights.

    Returns ``(context (B, H, T_q, D), weights (B, H, T_q, T_k) or None)``; the weights are
    those multiplied with V (after dropout, when dropout is on). Two variants
    (:mod:`attnlab.core.variants`) change one step each: ``softcap`` C turns the scaled scores
    into ``C * tanh(scores / C)`` before the bias and masks; ``sinks`` ``(H,)`` joins each row's
    softmax as one more logit whose value is zero (the weights returned exclude it). ``rows``: as
    :func:`sdpa_attention`'s, the rows of ``keep`` that see no key, found once for all layers.
    """
    out_dtype = q.dtype
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 for fp16/bf16/fp32, float64 for float64
    q, k, v = q.to(acc), k.to(acc), v.to(acc)  # no-ops in float32/float64
    rep = q.size(1) // k.size(1)
    if rep > 1:  # GQA/MQA: query head n reads K/V head n // rep (Llama's repeat_kv grouping)
        k = k.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
        v = v.repeat_interleave(rep, dim=1)  # (B, H, T_k, D)
    T_q, T_k = q.size(-2), k.size(-2)
    if causal:
        tri = causal_keep(T_q, T_k, q.device)  # (T_q, T_k), bottom-right aligned
        keep = tri if keep is None else keep & tri
        empty_rows = empty_rows or T_q > T_k  # the first T_q - T_k queries then see no key
        rows = None  # keep changed: the rows found for it no longer hold

    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T_q, D) @ (B, H, D, T_k) -> (B, H, T_q, T_k)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias  # (B, H, T_q, T_k)
    if keep is not None:
        # A finite fill, not -inf: a row with every key masked then stays NaN-free (softmax of
        # equal values) in both directions, and is zeroed below.
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    if sinks is not None:  # the sink as one more "key" of each row, dropped after the softmax
        sink = sinks.to(acc)[None, :, None, None].expand(*scores.shape[:-1], 1)  # (B, H, T_q, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # (B, H, T_q, T_k)
    else:
        weights = torch.softmax(scores, dim=-1)  # (B, H, T_q, T_k), in `acc`
    if keep is not None and empty_rows:
        dead = rows[1] if rows is not None else ~keep.any(dim=-1, keepdim=True)  # (B|1, H|1, T_q, 1)
        weights = weights.masked_fill(dead, 0.0)  # fully masked rows
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    context = weights @ v  # (B, H, T_q, T_k) @ (B, H, T_k, D) -> (B, H, T_q, D)
    return context.to(out_dtype), (weights.to(out_dtype) if need_weights else None)


def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    keep: Tensor | None = None,
    bias: Tensor | None = None,
    causal: bool = False,
    empty_rows: bool = True,
    scale: float,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    compute_dtype: torch.dtype | None = None,
    rows: tuple[Tensor, Tensor] | None = None,
    opened_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The fused path: ``F.scaled_dot_product_attention`` (flash / memory-efficient / CPU flash).

    Same signature and result as :func:`math_attention`; it cannot return weights.
    ``compute_dtype``: the dtype the kernel runs in, the context cast back to the inputs' dtype.
    None (the default): :func:`sdpa_compute_dtype`'s choice, float32 for fp16/bf16 inputs on a CPU
    (faster there, and the only way its gradients meet flash-attention's rule with GQA/MQA), the
    inputs' own dtype elsewhere. ``compute_dtype=q.dtype`` runs the inputs' dtype on any device: on a
    CPU in fp16/bf16 that is slower, and its dK/dV of grouped heads miss the rule (measured, see
    :func:`sdpa_compute_dtype`). ``rows``: :func:`unmask_dead_rows` of ``keep``, computed once for all
    layers (:attr:`attnlab.core.masks.Masks.opened` and ``.dead``); used while ``keep`` is unchanged here.
    ``opened_bias``: the opened ``keep`` (``keep`` itself where ``empty_rows`` is False) as an additive float mask
    (0 / -inf), also made once for all layers: SDPA and the one-query path then add it instead of turning a bool
    mask into one in every layer.
    """
    if need_weights:
        raise ValueError(
            "need_weights=True cannot be served by the 'sdpa' backend, which never materialises "
            "the weights; use backend='math' or 'auto'."
        )
    out_dtype = q.dtype
    if compute_dtype is None:
        compute_dtype = _policy_dtype(q)
    if compute_dtype is not None and compute_dtype != q.dtype:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
        bias = None if bias is None else bias.to(compute_dtype)
    T_q, T_k = q.size(-2), k.size(-2)
    given = keep  # the caller's keep: opened_bias describes it (or its opened rows), not one changed here
    if causal and (T_q != T_k or keep is not None or bias is not None):
        # SDPA's is_causal is top-left aligned and takes no other mask: materialise ours.
        tri = causal_keep(T_q, T_k, q.device)  # (T_q, T_k), bottom-right aligned
        keep = tri if keep is None else keep & tri
        causal = False
        empty_rows = empty_rows or T_q > T_k  # the first T_q - T_k queries then see no key
        rows = None  # keep changed: the rows found for it no longer hold
    if keep is None and bias is not None and empty_rows:
        keep = bias != float("-inf")  # a float mask alone may block every key of a row too
    shared = rows is not None and keep is not None and empty_rows
    keep, dead = rows if shared and rows is not None else unmask_dead_rows(keep, empty_rows)
    mask = keep
    usable = shared or (not empty_rows and keep is not None and keep is given)
    if usable and bias is None and opened_bias is not None and opened_bias.dtype == q.dtype:
        mask = opened_bias  # (B|1, 1, T_q, T_k) float: the same mask, converted once for every layer
    if bias is not None:  # SDPA takes one mask: fold the blocked positions into the bias
        mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
        if dead is not None:
            mask = mask.masked_fill(dead, 0.0)  # a dead row's own -inf bias entries are no harmless mask
    if (
        T_q == 1
        and T_k <= ONE_QUERY_MAX_KEYS
        and not causal
        and dropout_p == 0.0
        and q.device.type == "cpu"
        and torch.compiler.is_compiling()
    ):
        context = one_query_attention(q, k, v, mask, scale)  # a compiled CPU decode step
    else:
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,  # (B, H, T_q, D), (B, G, T_k, D), (B, G, T_k, D)
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal,
            scale=scale,
            enable_gqa=q.size(1) != k.size(1),
        )  # (B, H, T_q, D)
    if dead is not None:
        context = context.masked_fill(dead, 0.0)  # (B, H, T_q, D): exact zeros, and a zero gradient into the kernel
    return context.to(out_dtype), None


def unmask_dead_rows(keep: Tensor | None, empty_rows: bool) -> tuple[Tensor | None, Tensor | None]:
    """``(keep', dead)``: ``keep`` with every row that sees no key opened to all keys, and those rows ``dead``
    (bool, ``keep``'s shape with the key dim 1), or ``(keep, None)`` when no row can be empty.

    What a fused kernel must never see is a row with no visible key: its log-sum-exp is ``-inf``, and what a
    kernel makes of that differs. Measured on an H200 (torch 2.11.0+cu130, cuDNN SDPA, bf16 and fp16), cuDNN's
    forward returns 0 for such a row and its backward returns **NaN in dq for that row**, whatever gradient
    comes in: zeroing the context afterwards does not stop it (0 x NaN is NaN), so one fully padded sequence
    made ``q_proj.weight.grad`` NaN for the whole model. It is PyTorch issue #196678 (an explicit mask, a key
    length of 64 mod 128 and a row log-sum-exp below -88.7 = ln(FLT_MAX): the padded half of the last key
    tile scores 0 and ``exp(0 - lse)`` overflows), regressed in 2.11; torch prefers cuDNN on Hopper from
    cuDNN 9.15 on. Older kernels differed again (NaN in the forward). Opened to every key, a dead row has a
    finite log-sum-exp on every kernel; the caller zeroes its context after the call (``masked_fill(dead,
    0)``), so the row's forward is exactly 0 and the kernel receives a gradient of exactly 0 for it: its dq,
    and its share of dk and dv, are then exact zeros. ``tests/test_kernel_models.py`` models the measured
    kernels on a CPU and holds every public path to that.

    Costs one ``any`` over the keys and one ``|``, only on calls with a mask that may empty a row
    (``empty_rows``: key padding, user masks; never causal masking alone, never no mask).
    """
    if keep is None or not empty_rows:
        return keep, None
    dead = ~keep.any(dim=-1, keepdim=True)  # (B|1, H|1, T_q|1, 1): rows that see no key
    return keep | dead, dead


# Up to this many keys a compiled CPU decode step runs one_query_attention rather than SDPA. Measured
# (30 layers compiled alone, 2 threads, fp32, D=64): 1024 keys 2.5 vs 3.1 ms at batch 1 and 21.0 vs
# 26.4 ms at batch 8 (H=9, G=3); 2048 keys 18.1 vs 18.0 ms and 146.7 vs 132.3 ms (H=G=12): from
# there both read K/V at the memory's rate and SDPA's kernel is the better reader.
ONE_QUERY_MAX_KEYS = 1024


def one_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Attention of one query per row, ``q (B, H, 1, D)`` over ``k (B, G, S, D)``, ``v (B, G, S, Dv)``: two batched
    matmuls around a softmax, the query heads grouped by the K/V head they share (no K/V copies).

    ``mask``: None, bool keep or float bias, broadcastable to ``(B, H, 1, S)``. A row with no
    visible key comes out NaN, as from SDPA; :func:`sdpa_attention` zeroes it.

    What a compiled decode step on a CPU runs instead of ``F.scaled_dot_product_attention``, whose
    CPU flash kernel is mostly overhead for one query (SmolLM2, 2 threads, 128 cache slots: 36 us a
    layer at batch 1 and 172 us at batch 8). Measured on the whole compiled step, interleaved
    A/B: fp32 batch 1 22.4-22.7 -> 21.9 ms, batch 8 44.3-44.9 -> 41.5-44.3 ms, bf16 batch 1 25.1-26.4
    -> 24.0-24.4 ms. Written as broadcast products and sums instead, inductor's fused loops made
    the fp32 batch-1 step 3.5 ms slower in the model (though faster alone), so matmuls it is.
    Eager calls, and caches over ``ONE_QUERY_MAX_KEYS`` slots, keep SDPA.
    """
    B, H, _, D = q.shape
    G, S = k.size(1), k.size(2)
    qg = q.reshape(B, G, H // G, D)  # (B, G, H/G, D): one query per head, grouped
    scores = (qg @ k.transpose(-1, -2)) * scale  # (B, G, H/G, D) @ (B, G, D, S) -> (B, G, H/G, S)
    if mask is not None:
        m = mask.expand(B, H, 1, S).reshape(B, G, H // G, S)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    weights = scores.softmax(-1)  # (B, G, H/G, S)
    context = weights @ v  # (B, G, H/G, S) @ (B, G, S, Dv) -> (B, G, H/G, Dv)
    return context.reshape(B, H, 1, v.size(-1))  # (B, H, 1, Dv): V may be narrower than Q and K (MLA)


def sdpa_compute_dtype(q: Tensor) -> tuple[torch.dtype | None, str | None]:
    """The dtype SDPA computes in, when not the inputs', and why: attnlab's policy, which
    :func:`sdpa_attention` applies by default and every SDPA path of attnlab follows.

    On a CPU, fp16/bf16 inputs run SDPA in float32. Measured with torch 2.13 on a 2-core
    AVX-512 CPU (B=4, H=8, G=2, T=1024, D=64, causal): fwd+bwd 550 ms in bf16 and 379 ms in
    fp16 against 336 ms upcast to float32; forward alone at T=2048 381 / 231 ms against 225 ms.
    And the low-precision CPU kernel's GQA backward misses flash-attention's error rule: it sums
    the query heads' dK/dV in bf16/fp16 (bf16, B=3, H=8, MQA, D=32, T_q=256, T_k=128, causal: dV
    error 9.4e-2 against plain PyTorch's 3.7e-2, rule 7.4e-2; over 4x plain's in a sweep with 16
    query heads per K/V head), which float32 meets with room to spare (3.2e-2; the cases are in
    tests/test_numerics.py). On CUDA the low-precision kernels run as they are (fast; their
    grouped-head sums are float32, see the module docstring; not measured here: no GPU).
    """
    if _policy_dtype(q) is not None:
        return torch.float32, f"cpu {q.dtype}: SDPA computed in float32 (faster and more exact on CPU)"
    return None, None


def _policy_dtype(q: Tensor) -> torch.dtype | None:
    """:func:`sdpa_compute_dtype`'s dtype without its reason: float32 for fp16/bf16 on a CPU, else None."""
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return None
