"""Adapters: how ``attnlab check`` calls an attention module and reads its weights.

Notation: B batch, T_q query positions, T_k key positions, E embed_dim, H query heads,
G key/value heads, D = E // H head dim.

The checks compare a target with attnlab's float64 reference, which recomputes the expected
output from the target's own weights. So an adapter gives the checks two things: the
weights in attnlab's layout, and one calling convention. The protocol, all an adapter needs:

Required:
    ``name: str``; ``embed_dim``, ``num_heads``, ``num_kv_heads``, ``kdim``, ``vdim: int``;
    ``scale: float`` (multiplier of Q K^T; 1/sqrt(D) for standard attention);
    ``projections() -> Projections``: the q/k/v/out weights and biases as
    ``nn.Linear`` would hold them, Q rows ordered head by head (head h is rows
    ``[h*D, (h+1)*D)``; K/V rows likewise for G heads);
    ``__call__(query (B, T_q, E), key (B, T_k, kdim), value (B, T_k, vdim), *,
    keep_mask=None, key_padding_mask=None, is_causal=False) -> (B, T_q, E)``, where
    ``keep_mask`` is bool ``(T_q, T_k)`` or ``(B, T_q, T_k)`` with **True = may attend**,
    ``key_padding_mask`` is bool ``(B, T_k)`` with **True = padding**, and ``is_causal``
    is bottom-right aligned (query i sees keys ``j <= i + T_k - T_q``). For self-attention
    the checks pass one tensor object as query, key and value.

Optional (each missing one skips the checks that need it, with the reason):
    ``supports_float64``, ``supports_cross_attention: bool`` (default True);
    ``bool_mask_convention``: ``"keep"`` or ``"block"``, what a bool mask means to the
    module's own API (None: unknown, only reported);
    ``dropout_p: float`` and ``set_training(mode: bool)``;
    ``raw_bool_mask(query, mask) -> output``: self-attention with a bool ``(T_q, T_k)`` mask
    handed to the module untranslated, for the mask-semantics probe;
    ``attention_weights(query, key, value, **masks)``: the weights the target returns, ``(B, H, T_q, T_k)``
    or ``(B, T_q, T_k)`` averaged over heads, with the masks ``__call__`` takes;
    ``decode_with_cache(x, chunks) -> (B, T, E)``: causal self-attention of ``x`` fed in
    chunks of the given lengths through the module's KV cache;
    ``cast(dtype) -> adapter``: a copy of the target in another dtype;
    ``to(device, dtype) -> adapter``: a copy of the target on another device and in another dtype,
    for ``run_checks(device=..., dtype=...)`` (an adapter without it is checked where it is);
    ``resized(embed_dim, num_heads, num_kv_heads) -> adapter``: a fresh target of the same
    kind at another size (its own new weights), for the checks at other head dims and head
    layouts (:class:`AttentionAdapter` builds it with ``factory`` when one is set);
    ``parameters() -> list[Tensor]``: the target's trainable tensors, whose gradients the
    deterministic-backward check compares too (default: none).
    A capability method may raise :class:`Unsupported` with the reason instead.

Subclass :class:`AttentionAdapter` to get those defaults. attnlab's ``MultiHeadAttention``, and
any module following its convention (``forward(query, key, value, *, attn_mask,
key_padding_mask, is_causal)``, bool ``attn_mask`` True = may attend, ``q_proj``/``k_proj``/
``v_proj``/``out_proj``), is wrapped by :class:`ModuleAdapter`; ``torch.nn.MultiheadAttention``
by :class:`TorchMHAAdapter`; any other module, by :func:`attnlab.check.as_adapter`, in
:class:`attnlab.check.probe.ProbedAdapter`, which needs no adapter written.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, SupportsInt, cast

import torch
from torch import Tensor, nn

from ..core.attention import Backend, MultiHeadAttention
from ..core.functional import causal_keep
from ..core.kv_cache import KVCache

__all__ = [
    "AttentionAdapter",
    "ModuleAdapter",
    "Projections",
    "TorchMHAAdapter",
    "Unsupported",
    "call_factory",
    "mha_projections",
]


class Unsupported(Exception):
    """Raised by an adapter's capability method: the target lacks the feature (the message says why)."""


class NotAttention(TypeError):
    """The module cannot be read as multi-head attention (no projections found, or it does not run as one)."""


@dataclass(frozen=True)
class Projections:
    """Weights in ``nn.Linear`` layout (``y = x @ W.T + b``); a bias may be None."""

    q_weight: Tensor  # (H*D, E)
    k_weight: Tensor  # (G*D, kdim)
    v_weight: Tensor  # (G*D, vdim)
    out_weight: Tensor  # (E, H*D)
    q_bias: Tensor | None = None  # (H*D,)
    k_bias: Tensor | None = None  # (G*D,)
    v_bias: Tensor | None = None  # (G*D,)
    out_bias: Tensor | None = None  # (E,)
    # a position map the module applies to Q and K after the projection (rotary), found by
    # attnlab.check.dataflow: the reference applies the same one (an object with apply(x (..., T, D)))
    rotary: Any = None
    # maps the module applies to the Q or K heads after the projection and before the scores, each to every vector
    # alone (qk-norm: DiT's, Qwen3's q_norm and k_norm): {"q": map, "k": map}, each an object with apply(x (B, n, T, D))
    head_maps: Any = None
    # what the module does to its scaled scores before the softmax (a bias by position, a soft-cap), found by
    # attnlab.check.scoremap: the reference applies the same (an object with apply(scores (B, H, T_q, T_k)))
    score_map: Any = None
    # an elementwise gate the module multiplies the merged heads by before the output projection, computed from the
    # input alone (OpenFold's sigmoid(linear_g(q_x))), found by attnlab.check.gate: the reference multiplies by the
    # module's own gate values (an object with apply(query, key, value) -> (B, T_q, H*D))
    gate: Any = None

    def to(self, dtype: torch.dtype) -> Projections:
        """Detached copies in ``dtype``: the reference must not feed gradients into the target."""

        def cast(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.detach().to(dtype)

        maps = ("rotary", "head_maps", "score_map", "gate")
        weights = {f: cast(getattr(self, f)) for f in self.__dataclass_fields__ if f not in maps}
        return Projections(**weights, **{f: getattr(self, f) for f in maps})  # type: ignore[arg-type]

    def normed(self, role: str, x: Tensor) -> Tensor:
        """``x`` ``(B, n, T, D)``, the ``role`` ("q" or "k") heads, through the module's own map for them (none: as
        it is)."""
        found = (self.head_maps or {}).get(role)
        return x if found is None else found.apply(x)

    def mapped(self, scores: Tensor, *, negated: bool = False) -> Tensor:
        """Scaled ``scores`` ``(B, H, T_q, T_k)`` through the module's score map (none: as they are)."""
        return scores if self.score_map is None else self.score_map.apply(scores, negated=negated)

    def gated(self, merged: Tensor, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """``merged`` ``(B, T_q, H*D)`` times the module's output gate for these inputs (none: as it is)."""
        return merged if self.gate is None else merged * self.gate.apply(query, key, value).to(merged)

    def rotate(self, x: Tensor, crossed: bool = False) -> Tensor:
        """``x`` ``(B, n, T, D)`` at positions ``0 .. T-1`` through the module's position map (none: as it is);
        ``crossed``: its features turned against partners of the other pairing (see ``Rotary.apply``)."""
        if self.rotary is None:
            return x
        return self.rotary.apply(x, crossed=True) if crossed else self.rotary.apply(x)


def call_factory(factory: Callable[..., object], **kwargs: object) -> object:
    """``factory`` called with whichever of ``kwargs`` its signature names (how ``--target`` builds)."""
    params = inspect.signature(factory).parameters
    return factory(**{k: v for k, v in kwargs.items() if k in params})


class AttentionAdapter:
    """Base class of adapters: the protocol above with every optional capability declined,
    except ``resized``, which works when ``factory`` is set."""

    name: str = "target"
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    kdim: int
    vdim: int
    supports_float64: bool = True
    supports_cross_attention: bool = True
    bool_mask_convention: Literal["keep", "block"] | None = None
    dropout_p: float = 0.0
    # The scale the target itself states (a ``scale`` attribute), reported when it disagrees with
    # ``scale``, which is the truth: 1/sqrt(D) unless the user gave another. None: it states none.
    declared_scale: float | None = None
    # True when the target takes one context for K and V (``forward(x_query, x_context)``): the
    # checks then hand it the same tensor as key and value.
    shared_kv: bool = False
    # True when the target masks the future by itself on every call (nanoGPT's forward(x)): the checks then
    # compare it with a causal reference, and ``is_causal`` asks nothing more of it.
    always_causal: bool = False
    # What built the target, called with whichever of embed_dim, num_heads, num_kv_heads and
    # dropout it names, returning a module or an adapter: lets ``resized`` build other sizes.
    factory: Callable[..., object] | None = None

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.embed_dim // self.num_heads)

    def projections(self) -> Projections:
        raise NotImplementedError(
            f"{type(self).__name__}.projections() must return the target's weights as Projections."
        )

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        keep_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__}.__call__ must run the target (see attnlab.check.adapters).")

    def describe_call(self) -> str | None:
        """One line in plain words: how the target is called and what was found about it (None: nothing to say)."""
        return None

    def set_training(self, mode: bool) -> None:
        """Train or eval mode; a target without modes ignores it."""

    def raw_bool_mask(self, query: Tensor, mask: Tensor) -> Tensor:
        raise Unsupported(f"{type(self).__name__} does not implement raw_bool_mask")

    def decode_with_cache(self, x: Tensor, chunks: list[int]) -> Tensor:
        raise Unsupported(f"{type(self).__name__} does not implement decode_with_cache (no KV cache)")

    def cast(self, dtype: torch.dtype) -> AttentionAdapter:
        raise Unsupported(f"{type(self).__name__} does not implement cast(dtype)")

    def parameters(self) -> list[Tensor]:
        return []

    def resized(self, embed_dim: int, num_heads: int, num_kv_heads: int) -> AttentionAdapter:
        """A fresh target at ``(E, H, G) = (embed_dim, num_heads, num_kv_heads)``, built by ``factory``."""
        built = _wrap(self._build(embed_dim, num_heads, num_kv_heads))
        return _same_size(built, embed_dim, num_heads, num_kv_heads)

    def _build(self, embed_dim: int, num_heads: int, num_kv_heads: int) -> object:
        """What ``factory`` makes at that size, on the target's device and in its dtype."""
        if self.factory is None:
            raise Unsupported(
                f"{self.name} cannot be rebuilt at another size: give its adapter a factory "
                f"(ModuleAdapter(module, factory=...), or attnlab check --target path/to/file.py:Class)"
            )
        params = inspect.signature(self.factory).parameters
        needs = ["embed_dim", "num_heads"] + (["num_kv_heads"] if num_kv_heads != num_heads else [])
        missing = [n for n in needs if n not in params]
        if missing:
            raise Unsupported(f"the target's factory takes no {' or '.join(missing)}")
        made = call_factory(
            self.factory,
            embed_dim=embed_dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            dropout=self.dropout_p,
        )
        weight = self.projections().out_weight
        if isinstance(made, nn.Module):  # where the target lives: a factory builds on the CPU in float32
            made = made.to(device=weight.device, dtype=weight.dtype)
        return made


def _same_size(built: AttentionAdapter, embed_dim: int, num_heads: int, num_kv_heads: int) -> AttentionAdapter:
    got = (built.embed_dim, built.num_heads, built.num_kv_heads)
    if got != (embed_dim, num_heads, num_kv_heads):
        raise Unsupported(
            f"the target's factory was asked for (E, H, G) = {(embed_dim, num_heads, num_kv_heads)} and built {got}"
        )
    return built


def _first(out: Tensor | tuple) -> Tensor:
    """The output of a module that may return ``(output, weights)``."""
    return out[0] if isinstance(out, tuple) else out


def module_dropout(module: nn.Module, names: tuple[str, ...] = ("dropout",)) -> float:
    """The module's attention dropout: the first of its attributes ``names`` that is a number, else its first
    ``nn.Dropout``'s rate, else 0."""
    for name in names:
        p = getattr(module, name, None)
        if isinstance(p, float | int) and not isinstance(p, bool):
            return float(p)
    return next((float(m.p) for m in module.modules() if isinstance(m, nn.Dropout)), 0.0)


class _LinearLike(Protocol):
    """A projection as the checks read it: ``nn.Linear``'s ``weight`` and ``bias``."""

    weight: Tensor
    bias: Tensor | None


class _ConventionModule(Protocol):
    """What :class:`ModuleAdapter` reads from a module following attnlab's convention."""

    embed_dim: SupportsInt
    num_heads: SupportsInt
    q_proj: _LinearLike
    k_proj: _LinearLike
    v_proj: _LinearLike
    out_proj: _LinearLike


def _check_expressible(module: nn.Module) -> None:
    """Refuse, before any check runs, a module whose attention check's float64 reference does not compute: head dims
    set apart from ``embed_dim // num_heads`` or a value head dim of its own (``head_dim=``, ``v_head_dim=``), or an
    output gate (``output_gate=``). Those options are verified against their own reference in
    tests/test_attention_dims.py; here they would read as mistakes."""
    E, H = int(getattr(module, "embed_dim", 0)), int(getattr(module, "num_heads", 0) or 1)
    D, Dv = getattr(module, "head_dim", None), getattr(module, "v_head_dim", None)
    found = []
    if isinstance(D, int) and D != E // H:
        found.append(f"head_dim={D} (embed_dim // num_heads = {E} // {H} = {E // H})")
    if isinstance(D, int) and isinstance(Dv, int) and Dv != D:
        found.append(f"v_head_dim={Dv} (head_dim={D})")
    gate = getattr(module, "output_gate", None)
    if gate:
        found.append(f"output_gate={gate!r}")
    if found:
        raise NotAttention(
            f"{type(module).__name__} has {', '.join(found)}, which attnlab check's float64 reference of multi-head "
            f"attention does not compute yet (head dim embed_dim // num_heads, one head dim for Q, K and V, no gate); "
            f"check the module built without them. The options themselves are verified against a float64 reference "
            f"of their own in attnlab's tests (tests/test_attention_dims.py)."
        )


class ModuleAdapter(AttentionAdapter):
    """Any ``nn.Module`` following attnlab's calling convention (attnlab's own included).

    Args:
        module: has ``embed_dim`` and ``num_heads`` (``num_kv_heads``, ``kdim``, ``vdim`` and
            ``scale`` optional) and ``q_proj``/``k_proj``/``v_proj``/``out_proj`` with
            ``.weight``/``.bias``; ``forward(query, key, value, *, attn_mask, key_padding_mask,
            is_causal)`` with a bool ``attn_mask`` where True = may attend. A ``kv_cache``
            keyword in ``forward`` enables the KV-cache check (an :class:`attnlab.KVCache` is used).
        name: shown in the report.
        factory: builds the module at another size, for the checks at other head dims and
            head layouts (see :attr:`AttentionAdapter.factory`). Not needed for attnlab's own
            ``MultiHeadAttention``, which is rebuilt through its constructor.
    """

    bool_mask_convention = "keep"

    def __init__(
        self,
        module: nn.Module,
        *,
        name: str | None = None,
        factory: Callable[..., object] | None = None,
        scale: float | None = None,
    ) -> None:
        missing = [
            a for a in ("embed_dim", "num_heads", "q_proj", "k_proj", "v_proj", "out_proj") if not hasattr(module, a)
        ]
        if missing:
            raise TypeError(
                f"module {type(module).__name__} lacks {missing}; a plain nn.Module is checked only if it "
                f"follows attnlab's convention (see attnlab.check.adapters), otherwise wrap it in an AttentionAdapter."
            )
        _check_expressible(module)
        self.module, self.factory = module, factory
        backend = getattr(module, "backend", None)
        self.name = name or type(module).__name__ + (f"(backend={backend!r})" if isinstance(backend, str) else "")
        conv = cast(_ConventionModule, module)  # the attributes checked just above
        self.embed_dim, self.num_heads = int(conv.embed_dim), int(conv.num_heads)
        self.num_kv_heads = int(getattr(module, "num_kv_heads", self.num_heads))
        self.kdim = int(getattr(module, "kdim", self.embed_dim))
        self.vdim = int(getattr(module, "vdim", self.embed_dim))
        own = getattr(module, "scale", None)
        self.declared_scale = float(own) if isinstance(own, float | int) and not isinstance(own, bool) else None
        self._scale = scale  # the user's; None: 1/sqrt(D)
        self.dropout_p = module_dropout(module)

    @property
    def scale(self) -> float:
        return super().scale if self._scale is None else float(self._scale)

    def projections(self) -> Projections:
        m = cast(_ConventionModule, self.module)
        return Projections(
            m.q_proj.weight,
            m.k_proj.weight,
            m.v_proj.weight,
            m.out_proj.weight,
            m.q_proj.bias,
            m.k_proj.bias,
            m.v_proj.bias,
            m.out_proj.bias,
        )

    def __call__(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        return _first(
            self.module(query, key, value, attn_mask=keep_mask, key_padding_mask=key_padding_mask, is_causal=is_causal)
        )

    def set_training(self, mode: bool) -> None:
        self.module.train(mode)

    def raw_bool_mask(self, query: Tensor, mask: Tensor) -> Tensor:
        return _first(self.module(query, query, query, attn_mask=mask))

    def attention_weights(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        if "need_weights" not in inspect.signature(self.module.forward).parameters:
            raise Unsupported(f"{self.name}.forward has no need_weights argument")
        if getattr(self.module, "backend", None) == "sdpa":
            raise Unsupported("backend='sdpa' never materialises the weights (the math and auto backends do)")
        out = self.module(
            query,
            key,
            value,
            attn_mask=keep_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            need_weights=True,
        )
        if not isinstance(out, tuple) or len(out) < 2 or not isinstance(out[1], Tensor):
            raise Unsupported(f"{self.name} returns no weights with need_weights=True")
        return out[1]

    def decode_with_cache(self, x: Tensor, chunks: list[int]) -> Tensor:
        if "kv_cache" not in inspect.signature(self.module.forward).parameters:
            raise Unsupported(f"{self.name}.forward has no kv_cache argument")
        cache = KVCache.for_module(self.module, x.size(0), x.size(1))
        outs, start = [], 0
        for n in chunks:
            piece = x[:, start : start + n]  # (B, n, E): this step's tokens
            outs.append(_first(self.module(piece, kv_cache=cache, is_causal=True)))  # (B, n, E)
            start += n
        return torch.cat(outs, dim=1)  # (B, T, E)

    def cast(self, dtype: torch.dtype) -> ModuleAdapter:
        return type(self)(copy.deepcopy(self.module).to(dtype), name=self.name, factory=self.factory, scale=self._scale)

    def to(self, device: torch.device, dtype: torch.dtype) -> ModuleAdapter:
        moved = copy.deepcopy(self.module).to(device=device, dtype=dtype)
        return type(self)(moved, name=self.name, factory=self.factory, scale=self._scale)

    def parameters(self) -> list[Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def resized(self, embed_dim: int, num_heads: int, num_kv_heads: int) -> AttentionAdapter:
        m = self.module
        if self.factory is not None or not isinstance(m, MultiHeadAttention):
            made = self._build(embed_dim, num_heads, num_kv_heads)
            if isinstance(made, nn.Module) and not isinstance(made, nn.MultiheadAttention):
                made = type(self)(made, name=self.name, factory=self.factory, scale=self._scale)
            return _same_size(_wrap(made), embed_dim, num_heads, num_kv_heads)
        proj = self.projections()
        default_scale = m.scale == 1.0 / math.sqrt(m.head_dim)
        built = MultiHeadAttention(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            dropout=m.dropout,
            bias=proj.out_bias is not None,
            scale=None if default_scale else m.scale,  # a custom scale is kept as it is
            backend=cast(Backend, m.backend),  # validated when it was set
            device=proj.out_weight.device,
            dtype=proj.out_weight.dtype,
        )
        return type(self)(built.train(m.training), name=self.name, scale=self._scale)


class TorchMHAAdapter(AttentionAdapter):
    """``torch.nn.MultiheadAttention``, either ``batch_first``, through its own conventions.

    Its bool masks mean True = *blocked*; a per-batch mask must be ``(B*H, T_q, T_k)``; it
    returns ``(output, weights)``; its ``is_causal`` is only a hint that needs the mask too.

    Args:
        module: the module to check.
        need_weights: passed on every call. PyTorch's default is True, which also decides
            which of its code paths runs (and what a fully masked row gives).
    """

    bool_mask_convention = "block"

    def __init__(self, module: nn.MultiheadAttention, *, need_weights: bool = True) -> None:
        from ..core.interop import check_representable

        check_representable(module, "TorchMHAAdapter")  # the reference is attnlab's math: same limits
        self.module, self.need_weights = module, need_weights
        self.name = f"torch.nn.MultiheadAttention(need_weights={need_weights})"
        self.embed_dim, self.num_heads = module.embed_dim, module.num_heads
        self.num_kv_heads = module.num_heads
        self.kdim, self.vdim = module.kdim, module.vdim
        self.dropout_p = float(module.dropout)

    def projections(self) -> Projections:
        return mha_projections(self.module)

    def describe_call(self) -> str | None:
        layout = "batch-first (B, T, E)" if self.module.batch_first else "sequence-first (T, B, E), transposed by check"
        return (
            f"torch.nn.MultiheadAttention called as forward(query, key, value, attn_mask, key_padding_mask), "
            f"{layout}; bool masks mean True = blocked"
        )

    def _run(
        self, query: Tensor, key: Tensor, value: Tensor, *, weights: bool = False, **kw
    ) -> tuple[Tensor, Tensor | None]:
        """``(output (B, T_q, E), per-head weights (B, H, T_q, T_k) when ``weights``, else None)``."""
        seq_first = not self.module.batch_first
        if seq_first:  # (B, T, E) -> (T, B, E), keeping self-attention's one tensor object
            q = query.transpose(0, 1)
            k = q if key is query else key.transpose(0, 1)
            v = k if value is key else value.transpose(0, 1)
        else:
            q, k, v = query, key, value
        if weights:
            out, w = self.module(q, k, v, need_weights=True, average_attn_weights=False, **kw)
        else:
            out, w = _first(self.module(q, k, v, need_weights=self.need_weights, **kw)), None
        return (out.transpose(0, 1) if seq_first else out), w  # (B, T_q, E)

    def __call__(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        return self._masked(query, key, value, keep_mask, key_padding_mask, is_causal, weights=False)[0]

    def _masked(self, query, key, value, keep_mask, key_padding_mask, is_causal, *, weights: bool):
        T_q, T_k = query.size(1), key.size(1)
        keep = keep_mask
        if is_causal:  # torch's is_causal is a hint that requires the mask itself: build it
            tri = causal_keep(T_q, T_k, query.device)  # (T_q, T_k)
            keep = tri if keep is None else keep & tri
        blocked = None
        if keep is not None:
            blocked = ~keep  # torch: True = blocked
            if blocked.dim() == 3:  # (B, T_q, T_k) -> (B*H, T_q, T_k), batch-major as torch expects
                blocked = blocked.repeat_interleave(self.num_heads, dim=0)
        return self._run(query, key, value, weights=weights, attn_mask=blocked, key_padding_mask=key_padding_mask)

    def set_training(self, mode: bool) -> None:
        self.module.train(mode)

    def raw_bool_mask(self, query: Tensor, mask: Tensor) -> Tensor:
        return self._run(query, query, query, attn_mask=mask)[0]

    def attention_weights(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        _, w = self._masked(query, key, value, keep_mask, key_padding_mask, is_causal, weights=True)
        assert w is not None  # need_weights=True always returns them
        return w

    def decode_with_cache(self, x: Tensor, chunks: list[int]) -> Tensor:
        raise Unsupported("torch.nn.MultiheadAttention has no KV cache")

    def cast(self, dtype: torch.dtype) -> TorchMHAAdapter:
        return TorchMHAAdapter(copy.deepcopy(self.module).to(dtype), need_weights=self.need_weights)

    def to(self, device: torch.device, dtype: torch.dtype) -> TorchMHAAdapter:
        moved = copy.deepcopy(self.module).to(device=device, dtype=dtype)
        return TorchMHAAdapter(moved, need_weights=self.need_weights)

    def parameters(self) -> list[Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def resized(self, embed_dim: int, num_heads: int, num_kv_heads: int) -> TorchMHAAdapter:
        if num_kv_heads != num_heads:
            raise Unsupported("torch.nn.MultiheadAttention has no GQA/MQA (num_kv_heads < num_heads)")
        m, weight = self.module, self.module.out_proj.weight
        built = nn.MultiheadAttention(
            embed_dim,
            num_heads,
            dropout=m.dropout,
            bias=m.in_proj_bias is not None,
            batch_first=m.batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        return TorchMHAAdapter(built.train(m.training), need_weights=self.need_weights)


def mha_projections(m: nn.MultiheadAttention) -> Projections:
    """The weights of ``torch.nn.MultiheadAttention`` (its fused ``in_proj`` split in thirds q, k, v)."""
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.chunk(3)  # (E, E) each
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight  # (E, E), (E, kdim), (E, vdim)
    bq = bk = bv = None
    if m.in_proj_bias is not None:
        bq, bk, bv = m.in_proj_bias.chunk(3)  # (E,) each
    return Projections(wq, wk, wv, m.out_proj.weight, bq, bk, bv, m.out_proj.bias)


def _wrap(made: object) -> AttentionAdapter:
    """What a factory built, as an adapter (for ``resized``): modules by their kind, adapters as they are.

    A module that is neither torch's nor attnlab's is wrapped by :class:`ModuleAdapter`, whose
    convention a factory-backed adapter's modules follow; :func:`attnlab.check.probe.as_adapter` is the
    public entry, which probes any other module instead.
    """
    if isinstance(made, nn.MultiheadAttention):
        return TorchMHAAdapter(made)
    if isinstance(made, nn.Module):
        return ModuleAdapter(made)
    if callable(made) and hasattr(made, "projections"):
        return made  # type: ignore[return-value]  # duck-typed adapter following the protocol
    raise TypeError(
        f"attnlab check got a {type(made).__name__}; expected an nn.Module or an adapter with "
        f"projections() and __call__ (see attnlab.check.adapters)."
    )
