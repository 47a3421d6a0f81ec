"""``ScriptableMultiheadAttention``: what ``torch.jit.script`` compiles in place of ``compat.MultiheadAttention``.

Notation (as in :mod:`attnlab.compat.multihead`; torch's letters in brackets):
    B batch (N), T query positions (L), S key positions, E embed_dim, H num_heads,
    G num_kv_heads, D = E // H head dim, S' = S + add_bias_kv + add_zero_attn.

``torch.jit.script(obj)`` first calls ``__prepare_scriptable__()`` on ``obj`` and on every submodule
(``torch/jit/_script.py``, ``call_prepare_scriptable_func``) and compiles what it returns.
``compat.MultiheadAttention.__prepare_scriptable__`` returns this twin, built from it:

* it holds the **same** ``Parameter`` objects and the same ``out_proj`` module under the same names,
  so the state dict, ``parameters()`` and an optimizer stepping either one stay coherent;
* its attributes have the types TorchScript infers for ``torch.nn.MultiheadAttention`` (``batch_first``
  a constant, ``bias_k``/``bias_v`` ``Optional[Tensor]``, an absent projection ``None``), plus what
  torch's scripted encoder reads of a ``self_attn`` (``_qkv_same_embed_dim``, kept False, and
  ``merge_masks``), so it compiles inside any module where torch's does;
* scripted, its forward is the eager module's computation written in the TorchScript subset: the
  same masks (torch's polarity at the edge), the same backends (SDPA, or the explicit math path when
  weights are needed), the same zeros for a query whose every key is masked, the same GEMMs;
* called eagerly it runs the module it was built from. torch's protocol also puts the twin in place
  of the original *inside a parent module* (``parent._modules`` is rewritten while scripting), so an
  eager model that was once scripted keeps computing, and keeps ``backend``/``last_backend``
  working, exactly as before.

What the scripted module does not do is :data:`SCRIPT_WARNING`, warned when it is made.
"""

# ruff: noqa: UP032  # str.format, not f-strings: TorchScript compiles the one and not the other

import math
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SCRIPT_WARNING", "ScriptableMultiheadAttention"]

SCRIPT_WARNING = (
    "torch.jit.script compiles attnlab.compat.MultiheadAttention as attnlab.compat.scripted."
    "ScriptableMultiheadAttention, which shares its parameters and computes the same outputs, except that the "
    "scripted module takes nested tensors in the strided layout only (not jagged), checks a backend assigned "
    "to it at its next call rather than at assignment, and raises input errors as torch.jit.Error carrying the "
    "eager message; it records its own last_backend. In the eager parent module, torch leaves the twin in "
    "place of the original (the __prepare_scriptable__ protocol); called eagerly, the twin runs the original."
)


class Source(Protocol):
    """What the twin reads of the ``compat.MultiheadAttention`` it is made from (a Protocol, so that this
    file imports nothing from multihead.py, which imports it)."""

    embed_dim: int
    kdim: int
    vdim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dim: int
    dropout: float
    batch_first: bool
    add_zero_attn: bool
    backend: str
    last_backend: str | None
    training: bool
    _parameters: dict[str, nn.Parameter | None]

    @property
    def out_proj(self) -> nn.Linear: ...

    def train(self, mode: bool = True) -> Any: ...

    def extra_repr(self) -> str: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def _shape(x: Tensor) -> str:
    """``tuple(x.shape)`` as Python prints it, ``(2, 3)`` or ``(3,)``: f-strings do not script."""
    dims = [str(d) for d in x.shape]
    return "({}{})".format(", ".join(dims), "," if len(dims) == 1 else "")


def _dtype(dtype: torch.dtype) -> str:
    """``str(dtype)`` as Python prints it (``torch.float32``): scripted, ``str`` of a dtype is its enum number."""
    if not torch.jit.is_scripting():
        return str(dtype)
    names = [
        (torch.float32, "torch.float32"),
        (torch.float64, "torch.float64"),
        (torch.float16, "torch.float16"),
        (torch.bfloat16, "torch.bfloat16"),
        (torch.int64, "torch.int64"),
        (torch.int32, "torch.int32"),
        (torch.int16, "torch.int16"),
        (torch.int8, "torch.int8"),
        (torch.uint8, "torch.uint8"),
        (torch.bool, "torch.bool"),
        (torch.complex64, "torch.complex64"),
        (torch.complex128, "torch.complex128"),
    ]
    for dt, name in names:
        if dtype == dt:
            return name
    return "dtype number " + str(dtype)


def _math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    empty_rows: bool,
    scale: float,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """:func:`attnlab.core.functional.math_attention` in the TorchScript subset, op for op (so the
    scripted results equal the eager ones bit for bit): ``q (B, H, T, D)``, ``k, v (B, G, S', D)``
    -> ``(context (B, H, T, D), weights (B, H, T, S') or None)``."""
    out_dtype = q.dtype
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 for fp16/bf16/fp32, float64 for float64
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    rep = q.size(1) // k.size(1)
    if rep > 1:  # GQA: query head h reads K/V head h // rep
        k = k.repeat_interleave(rep, dim=1)  # (B, H, S', D)
        v = v.repeat_interleave(rep, dim=1)  # (B, H, S', D)
    T_q, T_k = q.size(-2), k.size(-2)
    if causal:
        tri = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril(diagonal=T_k - T_q)  # (T, S')
        keep = tri if keep is None else keep & tri
        empty_rows = empty_rows or T_q > T_k
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, D) @ (B, H, D, S') -> (B, H, T, S')
    if bias is not None:
        scores = scores + bias  # (B, H, T, S')
    if keep is not None:
        # torch.finfo(acc).min, which TorchScript cannot call: acc is float32 or float64
        lowest = -1.7976931348623157e308 if scores.dtype == torch.float64 else -3.4028234663852886e38
        scores = scores.masked_fill(~keep, lowest)
    weights = torch.softmax(scores, dim=-1)  # (B, H, T, S')
    if keep is not None and empty_rows:
        weights = weights.masked_fill(~keep.any(dim=-1, keepdim=True), 0.0)  # fully masked rows: zeros
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    context = weights @ v  # (B, H, T, S') @ (B, H, S', D) -> (B, H, T, D)
    return context.to(out_dtype), (weights.to(out_dtype) if need_weights else None)


def _sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    empty_rows: bool,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """:func:`attnlab.core.functional.sdpa_attention` with the dtype of
    :func:`~attnlab.core.functional.sdpa_compute_dtype`, in the TorchScript subset: same shapes,
    context ``(B, H, T, D)``; rows with no visible key opened before the kernel and zeroed after it, as
    :func:`~attnlab.core.functional.unmask_dead_rows` says why."""
    out_dtype = q.dtype
    if q.device.type == "cpu" and (q.dtype == torch.float16 or q.dtype == torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()  # fp16/bf16 SDPA on a CPU computes in float32
        if bias is not None:
            bias = bias.float()
    T_q, T_k = q.size(-2), k.size(-2)
    if causal and (T_q != T_k or keep is not None or bias is not None):
        # SDPA's is_causal is top-left aligned and takes no other mask: materialise ours
        tri = torch.ones(T_q, T_k, dtype=torch.bool, device=q.device).tril(diagonal=T_k - T_q)  # (T, S')
        keep = tri if keep is None else keep & tri
        causal = False
        empty_rows = empty_rows or T_q > T_k
    dead: Tensor | None = None
    if keep is not None and empty_rows:
        # no kernel sees a row with no visible key (cuDNN's backward: NaN dq there; see unmask_dead_rows)
        dead = ~keep.any(dim=-1, keepdim=True)  # (B|1, H|1, T|1, 1)
        keep = keep | dead
    mask = keep
    if bias is not None:  # SDPA takes one mask: the blocked positions folded into the bias
        mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
        if dead is not None:
            mask = mask.masked_fill(dead, 0.0)
    context = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=q.size(1) != k.size(1)
    )  # (B, H, T, D)
    if dead is not None:
        context = context.masked_fill(dead, 0.0)  # exact zeros, and a zero gradient into the kernel
    return context.to(out_dtype)


# -- shared with compat.MultiheadAttention: its steps written once, in the TorchScript subset -------------
# The eager module calls these functions as Python; the twin's scripted forward compiles them. Written once,
# the two forms cannot drift apart, and each error is raised with the same sentence by both.


def _autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, which does not script: scripted, the CPU and CUDA flags."""
    if not torch.jit.is_scripting():
        return torch.is_autocast_enabled(device_type)
    return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _pad_fix(name: str, batch_first: bool) -> str:
    """The expression that pads nested ``name`` into a module's layout, for error messages."""
    return name + ".to_padded_tensor(0.0)" + ("" if batch_first else ".transpose(0, 1)")


def _layout(what: str, width: str, batched: bool, batch_first: bool) -> str:
    """``(B, T, width)``, ``(T, B, width)`` or unbatched ``(T, width)`` (S for key and value), for messages."""
    letter = "T" if what == "query" else "S"
    if not batched:
        return "({}, {})".format(letter, width)
    return ("(B, {}, {})" if batch_first else "({}, B, {})").format(letter, width)


def _check_inputs(
    query: Tensor, key: Tensor, value: Tensor, widths: list[int], batch_first: bool, weight: Tensor
) -> None:
    """Ranks, widths, batch sizes, dtypes and devices of query, key and value; ``widths`` is
    ``[embed_dim, kdim, vdim]``, ``weight`` the module's (its dtype and device are the expected ones)."""
    names = ["query", "key", "value"]
    xs = [query, key, value]
    width_names = ["embed_dim", "kdim", "vdim"]
    for i in range(3):
        name, x = names[i], xs[i]
        layout = _layout(name, "{}={}".format(width_names[i], widths[i]), True, batch_first)
        if x.is_nested:  # a nested query never gets here (forward hands it to the nested path)
            raise TypeError(
                "{} is a NestedTensor but query is not; pass query, key and value all nested (one sequence per "
                "batch entry), or all padded: {} with a key_padding_mask.".format(name, _pad_fix(name, batch_first))
            )
        if not x.is_floating_point():
            raise TypeError(
                "{} has dtype {}; expected a floating tensor {} like the module's weights ({}); token ids go "
                "through an nn.Embedding first.".format(name, _dtype(x.dtype), layout, _dtype(weight.dtype))
            )
    if query.dim() != 2 and query.dim() != 3:
        raise ValueError(
            "query has {} dimensions (shape {}); expected {} batched or (T, E) unbatched, with E = embed_dim = "
            "{}.".format(query.dim(), _shape(query), _layout("query", "E", True, batch_first), widths[0])
        )
    batched = query.dim() == 3
    for i in range(1, 3):
        name, x = names[i], xs[i]
        if x.dim() != query.dim():
            raise ValueError(
                "{} has {} dimensions (shape {}) but query has {}; {} must be {} like query: expected {}.".format(
                    name,
                    x.dim(),
                    _shape(x),
                    query.dim(),
                    name,
                    "batched" if batched else "unbatched",
                    _layout(name, width_names[i], batched, batch_first),
                )
            )
    for i in range(3):
        name, x = names[i], xs[i]
        if x.size(-1) != widths[i]:
            wn, w = width_names[i], widths[i]
            raise ValueError(
                "{} has last dimension {} (shape {}); expected {}={} in {}: project it to {} features or build "
                "the module with {}={}.".format(
                    name, x.size(-1), _shape(x), wn, w, _layout(name, wn, batched, batch_first), w, wn, x.size(-1)
                )
            )
    if batched:
        b_dim = 0 if batch_first else 1
        if key.size(b_dim) != query.size(b_dim):
            raise ValueError(
                "key has batch size {} but query has {} (dim {} of {}, as batch_first={}); pass one key "
                "sequence per query sequence.".format(
                    key.size(b_dim), query.size(b_dim), b_dim, _layout("key", "kdim", True, batch_first), batch_first
                )
            )
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            "value has shape {} but key has {}; every key needs exactly one value: pass a value with the same "
            "{}length S as key.".format(_shape(value), _shape(key), "batch size and " if batched else "")
        )
    for i in range(3):
        name, x = names[i], xs[i]
        if x.device != weight.device:
            raise ValueError(
                "{} is on {} but the module's weights are on {}; move one of them: {}.to('{}') or mha.to('{}').".format(
                    name, x.device, weight.device, name, weight.device, x.device
                )
            )
        if x.dtype != weight.dtype and not _autocast_enabled(x.device.type):
            got, want = _dtype(x.dtype), _dtype(weight.dtype)
            raise TypeError(
                "{} has dtype {} but the module's weights are {}; cast one of them ({}.to({}) or mha.to({})), or "
                "run under torch.autocast.".format(name, got, want, name, want, got)
            )


def _check_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    is_causal: bool,
    batched: bool,
    B: int,
    H: int,
    T: int,
    S: int,
    device: torch.device,
) -> None:
    """Dtypes, shapes and devices of the masks, in torch's conventions."""
    if key_padding_mask is not None:
        _check_mask_dtype("key_padding_mask", key_padding_mask, "True = padding")
        if batched:
            shape_ok = key_padding_mask.dim() == 2 and key_padding_mask.size(0) == B and key_padding_mask.size(1) == S
            expected = "(B, S) = ({}, {})".format(B, S)
        else:
            shape_ok = key_padding_mask.dim() == 1 and key_padding_mask.size(0) == S
            expected = "(S,) = ({},) for unbatched input".format(S)
        if not shape_ok:
            raise ValueError(
                "key_padding_mask has shape {}; expected {}, one flag per key position (True = padding, or a "
                "float added to the scores).".format(_shape(key_padding_mask), expected)
            )
        _check_mask_device("key_padding_mask", key_padding_mask, device)
    if attn_mask is None:
        if is_causal:
            raise ValueError(
                "is_causal=True was given without attn_mask; as in nn.MultiheadAttention, is_causal is only a "
                "hint that attn_mask is causal: pass attn_mask=nn.Transformer.generate_square_subsequent_mask(T) "
                "along with it, or drop is_causal."
            )
        return
    _check_mask_dtype("attn_mask", attn_mask, "True = blocked")
    if batched:
        rows = "(B*num_heads, T, S) = ({}, {}, {})".format(B * H, T, S)
    else:
        rows = "(num_heads, T, S) = ({}, {}, {})".format(H, T, S)
    if attn_mask.dim() != 2 and attn_mask.dim() != 3:
        fix = " (a (B, num_heads, T, S) mask: pass attn_mask.flatten(0, 1))" if attn_mask.dim() == 4 else ""
        raise ValueError(
            "attn_mask has {} dimensions (shape {}); expected (T, S) = ({}, {}) or {}{}.".format(
                attn_mask.dim(), _shape(attn_mask), T, S, rows, fix
            )
        )
    if attn_mask.dim() == 2:
        shape_ok = attn_mask.size(0) == T and attn_mask.size(1) == S
    else:
        shape_ok = attn_mask.size(0) == B * H and attn_mask.size(1) == T and attn_mask.size(2) == S
    if not shape_ok:
        raise ValueError(
            "attn_mask has shape {}; expected (T, S) = ({}, {}) or {}, row b*num_heads + h of a 3-D mask being "
            "batch b, head h; build it for T={} queries and S={} keys.".format(_shape(attn_mask), T, S, rows, T, S)
        )
    _check_mask_device("attn_mask", attn_mask, device)


def _check_mask_dtype(name: str, mask: Tensor, bool_meaning: str) -> None:
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            "{} has dtype {}; expected torch.bool ({}, torch's polarity) or a float dtype (added to the scores): "
            "pass {}.bool() if its 1s mark the positions to leave out.".format(
                name, _dtype(mask.dtype), bool_meaning, name
            )
        )


def _check_mask_device(name: str, mask: Tensor, device: torch.device) -> None:
    if mask.device != device:
        raise ValueError(
            "{} is on {} but the query is on {}; move it with {}.to('{}').".format(
                name, mask.device, device, name, device
            )
        )


def _batch_first_views(
    query: Tensor, key: Tensor, value: Tensor, batched: bool, batch_first: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(B, T, E), (B, S, kdim), (B, S, vdim)`` views, keeping ``key is query`` / ``value is key``
    (self-attention then projects Q, K and V with one GEMM)."""
    q = _to_batch_first(query, batched, batch_first)
    k = q if key is query else _to_batch_first(key, batched, batch_first)
    if value is key:
        v = k
    elif value is query:
        v = q
    else:
        v = _to_batch_first(value, batched, batch_first)
    return q, k, v


def _to_batch_first(x: Tensor, batched: bool, batch_first: bool) -> Tensor:
    if not batched:
        return x.unsqueeze(0)  # (1, T, E)
    return x if batch_first else x.transpose(0, 1)  # (B, T, E)


def _project(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    separate: tuple[Tensor | None, Tensor | None, Tensor | None],
) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K, V: (B, T, E), (B, S, G*D), (B, S, G*D), in as few GEMMs as the inputs allow: ``in_proj_weight``
    ``(3E, E)`` packed (then K and V have E = G*D rows), or else ``separate`` = ``(q_proj_weight (E, E),
    k_proj_weight (G*D, kdim), v_proj_weight (G*D, vdim))``; ``in_proj_bias`` ``(E + 2*G*D,)`` or None."""
    w = in_proj_weight
    wq, wk, wv = separate[0], separate[1], separate[2]
    if w is not None:  # packed only when kdim == vdim == E and there is no GQA: K and V have E rows each
        E, KV = w.size(1), w.size(1)
    else:
        assert wq is not None and wk is not None
        E, KV = wq.size(0), wk.size(0)
    b = in_proj_bias
    bq: Tensor | None = None
    bk: Tensor | None = None
    bv: Tensor | None = None
    if b is not None:
        parts = b.split([E, KV, KV])  # (E,), (G*D,), (G*D,)
        bq, bk, bv = parts[0], parts[1], parts[2]
    if w is None:  # separate weights: kdim/vdim differ from E, or GQA
        assert wq is not None and wk is not None and wv is not None
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)  # (B, T, E), (B, S, G*D) x2
    if key is query and value is query:  # self-attention: one GEMM for Q, K and V
        qkv = F.linear(query, w, b).split([E, KV, KV], dim=-1)  # (B, T, 3E) -> three (B, T, E) views
        return qkv[0], qkv[1], qkv[2]
    q = F.linear(query, w[:E], bq)  # (B, T, E)
    if value is key:  # one context: K and V in one GEMM
        kv = F.linear(key, w[E:], None if b is None else b[E:]).split([KV, KV], dim=-1)  # (B, S, E) each
        return q, kv[0], kv[1]
    k = F.linear(key, w[E : E + KV], bk)  # (B, S, E)
    v = F.linear(value, w[E + KV :], bv)  # (B, S, E)
    return q, k, v


def _split_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    add_zero_attn: bool,
    H: int,
    G: int,
    D: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Projected ``q (B, T, E)``, ``k, v (B, S, G*D)`` as ``q (B, H, T, D)``, ``k, v (B, G, S', D)``, with
    the extra key/value rows of ``add_bias_kv`` (``bias_k``/``bias_v``) and ``add_zero_attn`` appended."""
    B, T = q.size(0), q.size(1)
    if bias_k is not None and bias_v is not None:  # one learned key/value row per sequence
        k = torch.cat([k, bias_k.expand(B, 1, -1)], dim=1)  # (B, S+1, G*D)
        v = torch.cat([v, bias_v.expand(B, 1, -1)], dim=1)  # (B, S+1, G*D)
    q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D): heads become a batch dim
    k = k.view(B, k.size(1), G, D).transpose(1, 2)  # (B, G, S, D) (S+1 with bias_k)
    v = v.view(B, v.size(1), G, D).transpose(1, 2)  # (B, G, S, D)
    if add_zero_attn:  # one all-zero key/value row per sequence and head
        k = torch.cat([k, k.new_zeros(B, G, 1, D)], dim=2)  # (B, G, S', D)
        v = torch.cat([v, v.new_zeros(B, G, 1, D)], dim=2)  # (B, G, S', D)
    return q, k, v


def _merge_heads(context: Tensor, seq_first: bool) -> Tensor:
    """``context (B, H, T, D)`` straight into the caller's layout, ``(T, B, E)`` if ``seq_first`` else
    ``(B, T, E)``, so the output is contiguous as torch's is."""
    B, H, T, D = context.size(0), context.size(1), context.size(2), context.size(3)
    if seq_first:
        return context.permute(2, 0, 1, 3).reshape(T, B, H * D)  # (T, B, E)
    return context.transpose(1, 2).reshape(B, T, H * D)  # (B, T, E)


def _finish(
    out: Tensor, weights: Tensor | None, average_attn_weights: bool, batched: bool
) -> tuple[Tensor, Tensor | None]:
    """The returned pair: weights ``(B, H, T, S')`` averaged over heads if asked, and the batch dim of an
    unbatched call dropped again."""
    if weights is not None and average_attn_weights:
        weights = weights.mean(dim=1)  # (B, T, S')
    if not batched:
        out = out.squeeze(0)  # (T, E)
        if weights is not None:
            weights = weights.squeeze(0)  # (T, S') or (H, T, S')
    return out, weights


def _pick_backend(backend: str, need_weights: bool) -> str:
    """``"math"`` or ``"sdpa"``, the one that runs for ``backend`` (``"auto"``, ``"math"``, ``"sdpa"``)."""
    if backend == "math" or (need_weights and backend == "auto"):
        return "math"
    if need_weights:
        raise ValueError(
            "need_weights=True (nn.MultiheadAttention's default) with backend='sdpa': SDPA never "
            "materialises the attention weights; pass need_weights=False, or set mha.backend = 'auto'."
        )
    return "sdpa"


def _torch_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    trust_causal: bool,
    B: int,
    H: int,
    T: int,
    S: int,
    S_all: int,
    dtype: torch.dtype,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """torch's masks (bool True = blocked, float added; ``(T, S)`` / ``(B*H, T, S)``; key padding bool or
    float) as ``(keep, bias, pad)`` over all S' keys: ``keep`` bool ``(1, 1, T, S')`` or ``(B, H, T, S')``,
    True = may attend; ``bias`` float, broadcastable likewise, added to the scores; ``pad`` bool ``(B, S')``,
    True = padding (the same polarity in torch and attnlab). The extra rows of ``add_bias_kv``/``add_zero_attn``
    are always kept, as torch pads its masks with 0 for them. ``trust_causal``: ``attn_mask`` is not read."""
    keep: Tensor | None = None
    bias: Tensor | None = None
    if attn_mask is not None and not trust_causal:
        if attn_mask.dim() == 2:
            m4 = attn_mask[None, None]  # (1, 1, T, S)
        else:
            m4 = attn_mask.reshape(B, H, T, -1)  # (B*H, T, S) -> (B, H, T, S)
        if m4.dtype == torch.bool:
            keep = ~m4  # torch's True = blocked -> attnlab's True = may attend
        else:
            bias = m4.to(dtype)
            keep = m4 != float("-inf")  # so that a row of -inf counts as fully masked
    pad: Tensor | None = None
    if key_padding_mask is not None:
        if key_padding_mask.dtype == torch.bool:
            pad = key_padding_mask
        else:
            pad = key_padding_mask == float("-inf")
            pad_bias = key_padding_mask[:, None, None, :].to(dtype)  # (B, 1, 1, S)
            bias = pad_bias if bias is None else bias + pad_bias  # (B, H, T, S) or broadcastable
    extra = S_all - S
    if extra > 0:  # the appended key rows: never padding, never blocked
        if keep is not None:
            keep = F.pad(keep, (0, extra), value=True)  # (.., T, S')
        if bias is not None:
            bias = F.pad(bias, (0, extra), value=0.0)  # (.., T, S')
        if pad is not None:
            pad = F.pad(pad, (0, extra), value=False)  # (B, S')
    return keep, bias, pad


class ScriptableMultiheadAttention(nn.Module):
    """The scriptable twin of an :class:`attnlab.compat.MultiheadAttention` (see the module docstring);
    made by ``torch.jit.script`` through ``MultiheadAttention.__prepare_scriptable__``, not by hand.

    Same forward signature, shapes, masks and return value as ``torch.nn.MultiheadAttention`` (the
    table is in :class:`attnlab.compat.MultiheadAttention`'s docstring).
    """

    __constants__ = ("batch_first",)  # as torch.nn.MultiheadAttention declares it (a list there)
    __jit_ignored_attributes__ = ("_source",)
    bias_k: Tensor | None  # torch's two class annotations, so that the attribute types match its module's
    bias_v: Tensor | None
    last_backend: str | None
    if TYPE_CHECKING:  # for mypy alone: TorchScript infers these from the values, as it does for torch's module
        in_proj_weight: Tensor | None
        q_proj_weight: Tensor | None
        k_proj_weight: Tensor | None
        v_proj_weight: Tensor | None
        in_proj_bias: Tensor | None
        out_proj: nn.Linear

    def __init__(self, source: Source) -> None:
        super().__init__()
        self.embed_dim = source.embed_dim  # E
        self.kdim, self.vdim = source.kdim, source.vdim
        self.num_heads = source.num_heads  # H
        self.num_kv_heads = source.num_kv_heads  # G
        self.head_dim = source.head_dim  # D
        self.kv_dim = source.kv_dim  # G*D
        self.dropout = source.dropout
        self.batch_first = source.batch_first
        self.add_zero_attn = source.add_zero_attn
        self._qkv_same_embed_dim = False  # never torch's fused fast path: see MultiheadAttention's property
        self.backend = source.backend
        self.last_backend = source.last_backend
        self.training = source.training
        # The same Parameter objects (None where the source has none), registered under the same names.
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias"):
            self.register_parameter(name, source._parameters[name])
        for name in ("bias_k", "bias_v"):
            if name in source._parameters:
                self.register_parameter(name, source._parameters[name])
            else:  # a plain None attribute, as in torch's module
                setattr(self, name, None)
        self.out_proj = source.out_proj  # the same Linear module: its parameters are shared with it
        # A tuple, so that nn.Module does not register the source as a submodule (it would be scripted
        # and saved twice) and torch's prepare step does not visit it again.
        self._source = (source,)

    def extra_repr(self) -> str:
        return self._source[0].extra_repr()

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """torch.nn.MultiheadAttention's forward; shapes and masks as in compat.MultiheadAttention."""
        if not torch.jit.is_scripting():  # TorchScript compiles none of this block
            # Called eagerly: the source module runs, with this twin's training mode and backend (a parent's
            # .train()/.eval() reaches the twin, not the source).
            source = self._source[0]
            if source.training != self.training:
                source.train(self.training)
            if source.backend != self.backend:
                source.backend = self.backend  # validated by the source's setter
            out: tuple[Tensor, Tensor | None] = source(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
            if not torch.compiler.is_compiling():
                self.__dict__["last_backend"] = source.last_backend
            return out
        if query.is_nested:
            self._check_nested(query, key, value, key_padding_mask, attn_mask, is_causal)  # no masks: lengths
            return self._nested_forward(query, key, value, need_weights, average_attn_weights)
        return self._padded_forward(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
        )

    def merge_masks(
        self, attn_mask: Tensor | None, key_padding_mask: Tensor | None, query: Tensor
    ) -> tuple[Tensor | None, int | None]:
        """Present because torch's scripted ``TransformerEncoderLayer`` compiles a call to it on its fused
        fast path, which ``_qkv_same_embed_dim = False`` keeps it from ever taking."""
        raise RuntimeError(
            "merge_masks belongs to torch's fused encoder fast path, which attnlab.compat.MultiheadAttention "
            "never takes (_qkv_same_embed_dim is False); call the module itself."
        )

    # -- the scripted computation: compat.MultiheadAttention.forward, step for step ----------------
    def _padded_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        widths = [self.embed_dim, self.kdim, self.vdim]
        _check_inputs(query, key, value, widths, self.batch_first, self.out_proj.weight)
        batched = query.dim() == 3
        q_in, k_in, v_in = _batch_first_views(
            query, key, value, batched, self.batch_first
        )  # (B, T, E), (B, S, kdim), (B, S, vdim)
        B, T = q_in.size(0), q_in.size(1)
        S = k_in.size(1)
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        _check_masks(attn_mask, key_padding_mask, is_causal, batched, B, H, T, S, q_in.device)
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (S,) -> (1, S)

        separate = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)  # None with in_proj_weight
        q, k, v = _project(
            q_in, k_in, v_in, self.in_proj_weight, self.in_proj_bias, separate
        )  # (B, T, E), (B, S, G*D), (B, S, G*D)
        q, k, v = _split_heads(
            q, k, v, self.bias_k, self.bias_v, self.add_zero_attn, H, G, D
        )  # (B, H, T, D), (B, G, S', D) x2

        keep, bias, causal, empty_rows = self._masks(
            attn_mask, key_padding_mask, is_causal, need_weights, B, T, S, k.size(2), q.dtype
        )
        backend = self._choose_backend(need_weights)
        self.last_backend = backend
        dropout_p = self.dropout if self.training else 0.0
        scale = 1.0 / math.sqrt(D)
        weights: Tensor | None = None
        if backend == "math":
            context, weights = _math_attention(
                q, k, v, keep, bias, causal, empty_rows, scale, dropout_p, need_weights
            )  # (B, H, T, D), (B, H, T, S') or None
        else:
            context = _sdpa_attention(q, k, v, keep, bias, causal, empty_rows, scale, dropout_p)  # (B, H, T, D)
        out = self.out_proj(_merge_heads(context, batched and not self.batch_first))  # (T, B, E) or (B, T, E)
        return _finish(out, weights, average_attn_weights, batched)

    # -- nested tensors (strided, as nn.TransformerEncoder makes them): padded, attended, nested again ----
    def _nested_forward(
        self, query: Tensor, key: Tensor, value: Tensor, need_weights: bool, average_attn_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The eager module's nested path: inputs ``(B, T_b, width)`` zero-padded to ``(B, T, width)``,
        the key lengths becoming a ``key_padding_mask``, the output nested again with the query's
        lengths; weights stay padded, zero on padded query rows. ``forward`` has checked the inputs."""
        q_pad = query.to_padded_tensor(0.0)  # (B, T, E)
        q_len = query._nested_tensor_size()[:, 0]  # (B,): host metadata, no sync
        k_pad, k_len = q_pad, q_len
        if key is not query:
            k_pad, k_len = key.to_padded_tensor(0.0), key._nested_tensor_size()[:, 0]  # (B, S, kdim), (B,)
        if value is key:
            v_pad = k_pad  # (B, S, vdim)
        elif value is query:
            v_pad = q_pad
        else:
            v_pad, v_len = value.to_padded_tensor(0.0), value._nested_tensor_size()[:, 0]  # (B, S, vdim), (B,)
            if not torch.equal(v_len, k_len):
                v_lens: list[int] = v_len.tolist()
                k_lens: list[int] = k_len.tolist()
                raise ValueError(
                    "value has sequence lengths {} but key has {}; every key needs exactly one value: pass value "
                    "sequences of the key sequences' lengths.".format(v_lens, k_lens)
                )
        device = q_pad.device
        T, S = q_pad.size(1), k_pad.size(1)
        key_pad = torch.arange(S, device=device) >= k_len.to(device)[:, None]  # (B, S), True = padding
        # nested tensors are batch-first whatever batch_first says; the padded path reads (T, B, E) when it is False
        q_in = self._layout_of(q_pad)
        k_in = q_in if key is query else self._layout_of(k_pad)
        if value is key:
            v_in = k_in
        elif value is query:
            v_in = q_in
        else:
            v_in = self._layout_of(v_pad)
        out, weights = self._padded_forward(
            q_in, k_in, v_in, key_pad, need_weights, None, average_attn_weights, False
        )  # (B, T, E) or (T, B, E); weights (B, T, S') / (B, H, T, S') or None
        out = self._layout_of(out)  # (B, T, E)
        q_keep = torch.arange(T, device=device) < q_len.to(device)[:, None]  # (B, T), True = a real query
        if weights is not None:
            rows = q_keep[:, :, None] if weights.dim() == 3 else q_keep[:, None, :, None]  # (B, [1,] T, 1)
            weights = weights.masked_fill(~rows, 0.0)
        return torch._nested_tensor_from_mask(out, q_keep, mask_check=False), weights

    def _layout_of(self, x: Tensor) -> Tensor:
        return x if self.batch_first else x.transpose(0, 1)  # (B, T, E) <-> (T, B, E)

    def _check_nested(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        is_causal: bool,
    ) -> None:
        """What the padded path cannot check of nested inputs (the eager module's sentences)."""
        names = ["query", "key", "value"]
        xs = [query, key, value]
        width_names = ["embed_dim", "kdim", "vdim"]
        widths = [self.embed_dim, self.kdim, self.vdim]
        for i in range(3):
            name, x = names[i], xs[i]
            letter = "T" if name == "query" else "S"
            layout = "(B, {}_b, {}={})".format(letter, width_names[i], widths[i])
            if not x.is_nested:
                raise TypeError(
                    "query is a NestedTensor but {} is a padded tensor of shape {}; pass query, key and value all "
                    "nested (one sequence per batch entry), or all padded: query.to_padded_tensor(0.0) with a "
                    "key_padding_mask.".format(name, _shape(x))
                )
            if x.layout != torch.strided:
                raise TypeError(
                    "{} is a jagged NestedTensor, which the scripted attnlab.compat.MultiheadAttention does not take "
                    "(TorchScript runs strided ones, as nn.TransformerEncoder makes them); pass "
                    "torch.nested.nested_tensor(sequences, layout=torch.strided), or a padded tensor with a "
                    "key_padding_mask.".format(name)
                )
            if x.dim() != 3:
                raise ValueError(
                    "{} is a NestedTensor of {} dimensions; expected {}, B sequences of shape ({}_b, {}) (nested "
                    "tensors are batch-first whatever batch_first says).".format(
                        name, x.dim(), layout, letter, width_names[i]
                    )
                )
            got = x._nested_tensor_size()[:, -1]  # (B,): each sequence's width
            if x.size(0) > 0 and bool((got != widths[i]).any()):
                all_widths: list[int] = got.tolist()
                got_widths: list[int] = []
                for w in sorted(all_widths):  # the distinct widths, as torch.unique lists them
                    if len(got_widths) == 0 or got_widths[-1] != w:
                        got_widths.append(w)
                raise ValueError(
                    "{} is a NestedTensor whose sequences have width {}; expected {}={} for every sequence, {}.".format(
                        name, " and ".join([str(w) for w in got_widths]), width_names[i], widths[i], layout
                    )
                )
        if key.size(0) != query.size(0):
            raise ValueError(
                "key holds {} sequences but query holds {}; pass one key sequence per query sequence.".format(
                    key.size(0), query.size(0)
                )
            )
        if key_padding_mask is not None:
            raise ValueError(
                "key_padding_mask was given with NestedTensor inputs, whose lengths already say which keys exist "
                "(nn.MultiheadAttention refuses the pair too); drop it, or pass padded tensors "
                "(key.to_padded_tensor(0.0)) with it."
            )
        if attn_mask is not None or is_causal:
            what = "attn_mask" if attn_mask is not None else "is_causal=True"
            raise ValueError(
                "{} was given with NestedTensor inputs, which take no attn_mask (nn.MultiheadAttention refuses the "
                "pair too); pass padded tensors (query.to_padded_tensor(0.0)) with a key_padding_mask and the "
                "attn_mask instead.".format(what)
            )

    def _choose_backend(self, need_weights: bool) -> str:
        if self.backend not in ["auto", "math", "sdpa", "flex"]:  # attnlab.core.validation.BACKEND_NAMES
            raise ValueError(
                "backend must be one of ('auto', 'math', 'sdpa', 'flex'), got '{}'; set scripted.backend to one of "
                "them.".format(self.backend)
            )
        return _pick_backend(self.backend, need_weights)

    def _masks(
        self,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        B: int,
        T: int,
        S: int,
        S_all: int,
        dtype: torch.dtype,
    ) -> tuple[Tensor | None, Tensor | None, bool, bool]:
        """torch's masks as attnlab's ``(keep, bias, causal, empty_rows)`` (the fields of
        :class:`attnlab.core.masks.Masks`): what ``_attnlab_masks`` and ``prepare_masks`` make of them."""
        H = self.num_heads
        trust_causal = is_causal and key_padding_mask is None and not need_weights  # torch's rule for the hint
        keep, bias, pad = _torch_masks(attn_mask, key_padding_mask, trust_causal, B, H, T, S, S_all, dtype)
        square_causal = trust_causal and T == S_all
        if trust_causal and not square_causal:  # SDPA's is_causal is top-left aligned: query i sees keys j <= i
            keep = torch.ones(T, S_all, dtype=torch.bool, device=self.out_proj.weight.device).tril()[None, None]
        empty_rows = keep is not None or pad is not None
        if pad is not None:
            not_pad = ~pad[:, None, None, :]  # (B, 1, 1, S')
            keep = not_pad if keep is None else keep & not_pad
        causal = square_causal and T != 1  # one query over one key: nothing to mask
        return keep, bias, causal, empty_rows


def make_scriptable(source: Source) -> ScriptableMultiheadAttention:
    """The twin ``torch.jit.script`` compiles for ``source``, with :data:`SCRIPT_WARNING` (once per
    call site under Python's default warning filter)."""
    warnings.warn(SCRIPT_WARNING, UserWarning, stacklevel=3)
    return ScriptableMultiheadAttention(source)
