"""Where a hand-written attention module keeps its weights: the q/k/v/out projections, by the names people give them.

``find_projections`` reads them off the module without calling it: direct children named
``q_proj``, ``w_q``, ``query``, ``to_q``, ``W_o``, ``fc_out``...; a fused ``qkv``/``in_proj``/``c_attn``
(split in thirds; :class:`~attnlab.check.probe.ProbedAdapter` tells the thirds apart by their
effect); a ``ModuleList`` of four (the Annotated Transformer's ``clones``); Hugging Face GPT-2's
``Conv1D`` (a Linear stored transposed); projections further down (BERT's ``self.query``,
``output.dense``); or an ``nn.MultiheadAttention`` inside the module. How the module is *called*, and
what its mask means, is :mod:`attnlab.check.probe`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from torch import Tensor, nn

__all__ = ["NotAttention", "find_projections", "linear_weights", "linear_in", "name_key"]


class NotAttention(TypeError):
    """The module cannot be read as multi-head attention (no projections found, or it does not run as one)."""


def name_key(name: str) -> str:
    """A name as compared with the spellings people use: lowercase, without underscores (``W_q`` -> ``wq``)."""
    return name.lower().replace("_", "")


# Child names, lowercased without underscores, that people give each projection.
_NAMES = {
    "q": {"qproj", "q", "query", "wq", "qlinear", "linearq", "toq", "queryproj", "projq", "qlin", "queries", "wquery"},
    "k": {"kproj", "k", "key", "wk", "klinear", "lineark", "tok", "keyproj", "projk", "klin", "keys", "wkey"},
    "v": {"vproj", "v", "value", "wv", "vlinear", "linearv", "tov", "valueproj", "projv", "vlin", "values", "wvalue"},
    "out": {
        "outproj", "oproj", "out", "wo", "fcout", "o", "proj", "outlinear", "linearout", "toout", "dense",
        "cproj", "output", "olin", "outputproj", "projout", "wout", "linear", "fc", "olinear",
    },
    "qkv": {"qkv", "qkvproj", "inproj", "cattn", "toqkv", "wqkv", "qkvlinear", "attn", "inprojection"},
}  # fmt: skip


def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's GPT-2 ``Conv1D``: a Linear with its weight stored transposed, ``(in, out)``, applied as
    ``addmm(bias, x, weight)``; known by its ``nf`` (the output width) and that layout, not by import."""
    w = getattr(m, "weight", None)
    nf = getattr(m, "nf", None)
    return isinstance(w, nn.Parameter) and w.dim() == 2 and isinstance(nf, int) and w.size(1) == nf


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def linear_in(module: nn.Module) -> nn.Module | None:
    """``module`` itself if it is a Linear (or GPT-2's Conv1D), else its first one (``to_out = Sequential(Linear,
    Dropout)``)."""
    if _is_linear(module):
        return module
    return next((m for m in module.modules() if _is_linear(m)), None)


def linear_weights(m: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(weight, bias)`` in ``nn.Linear``'s layout, ``weight`` ``(out, in)``: a Conv1D's is a transposed view,
    so that gradients and in-place changes reach its own parameter."""
    weight = cast(Tensor, m.weight)
    return (weight.t() if _is_conv1d(m) else weight), cast("Tensor | None", getattr(m, "bias", None))


def _widths(m: nn.Module) -> str:
    w, _ = linear_weights(m)
    return f"{w.size(1)}->{w.size(0)}"


@dataclass(frozen=True)
class _Found:
    """Where the projections live, as paths from the module (``q_proj``, ``linears.0``; ``qkv`` for a fused
    one, split in thirds; ``mha`` for an ``nn.MultiheadAttention`` inside, whose own weights are read)."""

    q: str | None
    k: str | None
    v: str | None
    out: str
    qkv: str | None = None
    mha: str | None = None
    listed: str | None = None  # the ModuleList they were taken from, in order q, k, v, out
    weak: bool = False  # taken in declaration order, no name telling: the data flow decides instead

    def paths(self) -> set[str]:
        """The parameter-owning module paths named here."""
        return {p for p in (self.q, self.k, self.v, self.out, self.qkv) if p is not None}

    def describe(self) -> str:
        if self.mha is not None:
            return f"nn.MultiheadAttention {self.mha}"
        if self.qkv is not None:
            return f"{self.qkv} (fused, split in thirds), {self.out}"
        if self.listed is not None:
            return f"{self.listed}[0], [1], [2], [3] taken as q, k, v, out"
        return f"{self.q}, {self.k}, {self.v}, {self.out}"


def _inner_mha(module: nn.Module) -> str | None:
    """The path of the first ``nn.MultiheadAttention`` inside ``module`` (not ``module`` itself)."""
    return next((n for n, m in module.named_modules() if n and isinstance(m, nn.MultiheadAttention)), None)


def find_projections(module: nn.Module) -> _Found:
    """Name the q/k/v/out projections of ``module``: among its direct children by name, in a ModuleList of
    four (q, k, v, out in order), or an ``nn.MultiheadAttention`` inside it.

    Raises:
        NotAttention: naming the Linear children found and the names looked for.
    """
    mha = _inner_mha(module)
    if mha is not None:
        return _Found(None, None, None, f"{mha}.out_proj", mha=mha)
    children = {n: lin for n, c in module.named_children() if (lin := linear_in(c)) is not None}
    by_role: dict[str, str] = {}
    for name in children:
        for role, names in _NAMES.items():
            if name_key(name) in names and role not in by_role:
                by_role[role] = name
    if "out" in by_role and "qkv" in by_role and not {"q", "k", "v"} <= by_role.keys():
        return _Found(None, None, None, by_role["out"], qkv=by_role["qkv"])
    if {"q", "k", "v", "out"} <= by_role.keys():
        return _Found(by_role["q"], by_role["k"], by_role["v"], by_role["out"])
    for name, child in module.named_children():  # the Annotated Transformer: clones(nn.Linear(d, d), 4)
        if isinstance(child, nn.ModuleList | nn.Sequential):
            lins = [f"{name}.{i}" for i, m in enumerate(child) if _is_linear(m)]
            if len(lins) == 4 == len(child):
                return _Found(lins[0], lins[1], lins[2], lins[3], listed=name)
            if len(lins) == 3 == len(child) and "out" in by_role:
                return _Found(lins[0], lins[1], lins[2], by_role["out"], listed=name)
    if len(children) == 4 and not by_role.keys() & {"q", "k", "v"}:
        q, k, v, out = children  # four Linears with names of their own: taken in declaration order
        return _Found(q, k, v, out, weak=True)
    nested = _nested_roles(module)
    if nested is not None:
        return nested
    listed = ", ".join(f"{n} ({_widths(c)})" for n, c in children.items()) or "none"
    raise NotAttention(
        f"{type(module).__name__} has no recognisable q/k/v/out projections (nn.Linear children found: {listed}); "
        f"name them q_proj, k_proj, v_proj, out_proj (or w_q.., query.., a fused qkv, a ModuleList of four), "
        f"or wrap the module in an attnlab.check.AttentionAdapter"
    )


def _nested_roles(module: nn.Module) -> _Found | None:
    """Projections further down, each named by its last path part (BERT's ``BertAttention``: ``self.query``,
    ``self.key``, ``self.value``, ``output.dense``); None unless each role has exactly one Linear."""
    by_role: dict[str, list[str]] = {}
    for path, m in module.named_modules():
        if path and _is_linear(m):
            for role, names in _NAMES.items():
                if name_key(path.rsplit(".", 1)[-1]) in names:
                    by_role.setdefault(role, []).append(path)
                    break
    one = {role: paths[0] for role, paths in by_role.items() if len(paths) == 1}
    if {"q", "k", "v", "out"} <= one.keys():
        return _Found(one["q"], one["k"], one["v"], one["out"])
    if {"qkv", "out"} <= one.keys() and not by_role.keys() & {"q", "k", "v"}:
        return _Found(None, None, None, one["out"], qkv=one["qkv"])
    return None
