"""Where a hand-written attention module keeps its weights, as its data flow uses them.

:mod:`attnlab.check.dataflow` reads which parameter rows make Q, K, V and the output. What it cannot read is
which weight a module *meant* for a role: one that computes V with the key projection, or K and V with each
other's, computes attention all the same. :func:`settle_roles` decides that, in one place, by hints: a weight
left unused takes the role that borrowed another's, and weights read as a permutation of the roles their
names (or their places in a ``ModuleList``) give are read by those. :func:`find_projections` then names the
weights when each role reads whole ones (``q_proj``, a fused ``c_attn`` cut in thirds in the order q, k, v,
an ``nn.MultiheadAttention`` inside); where the data flow cannot be read at all, the Linear layers in
declaration order. How the module is *called*, and what its mask means, is :mod:`attnlab.check.probe`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import cast

from torch import Tensor, nn

from .adapters import NotAttention
from .dataflow import Reading, RowSource, name_hint

__all__ = ["NotAttention", "find_projections", "linear_weights", "name_key", "settle_roles"]

ROLES = ("q", "k", "v", "out")


def name_key(name: str) -> str:
    """A name as compared with the spellings people use: lowercase, without underscores (``W_q`` -> ``wq``)."""
    return name.lower().replace("_", "")


def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's GPT-2 ``Conv1D``: a Linear with its weight stored transposed, ``(in, out)``, applied as
    ``addmm(bias, x, weight)``; known by its ``nf`` (the output width) and that layout, not by import."""
    w = getattr(m, "weight", None)
    nf = getattr(m, "nf", None)
    return isinstance(w, nn.Parameter) and w.dim() == 2 and isinstance(nf, int) and w.size(1) == nf


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def linear_weights(m: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(weight, bias)`` in ``nn.Linear``'s layout, ``weight`` ``(out, in)``: a Conv1D's is a transposed view,
    so that gradients and in-place changes reach its own parameter."""
    weight = cast(Tensor, m.weight)
    return (weight.t() if _is_conv1d(m) else weight), cast("Tensor | None", getattr(m, "bias", None))


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
    order: tuple[str, ...] | None = None  # a fused projection's thirds in their order of use, by data flow


def _hint(module: nn.Module, path: str) -> str | None:
    """The role a weight's path suggests: its name (``linear_values`` -> ``v``), else its place in a
    ``ModuleList`` or ``Sequential`` of four (the Annotated Transformer's ``clones``: q, k, v, out)."""
    hint = name_hint(path)
    parts = path.split(".")
    if hint is None and len(parts) >= 3 and parts[-2].isdigit():
        home = module.get_submodule(".".join(parts[:-2]))
        if isinstance(home, nn.ModuleList | nn.Sequential) and len(home) == 4:
            return ROLES[int(parts[-2])]
    return hint


def _whole(src: RowSource, module: nn.Module, out: bool = False) -> str | None:
    """The Linear whose whole weight, in its own order and layout, is ``src`` (``out``: its columns, as the
    output projection is read); None when ``src`` is anything else."""
    if len(src.parts) != 1:
        return None
    path, transposed, rows = src.parts[0]
    owner, _, last = path.rpartition(".")
    if last != "weight" or not _is_linear(module.get_submodule(owner)) or not _own_bias(src, owner, module):
        return None
    p = module.get_parameter(path)
    natural = transposed == (_is_conv1d(module.get_submodule(owner)) != out)
    return owner if natural and rows == tuple(range((p.t() if transposed else p).size(0))) else None


def _own_bias(src: RowSource, owner: str, module: nn.Module) -> bool:
    """Whether ``src``'s bias, if any, is its Linear's own or zero (not BEiT's ``q_bias`` beside a bias-free
    ``qkv``)."""
    return src.bias is None or all(
        path == f"{owner}.bias" or not module.get_parameter(path).reshape(-1)[list(rows)].any()
        for path, rows in src.bias
    )


def _spare_for(
    role: str, src: RowSource, spare: list[str], params: Mapping[str, Tensor], module: nn.Module
) -> list[str]:
    """The unused weights that ``role`` takes back from the role whose weight it borrowed: one of its rows'
    count (its hint first), or, for a role of whole per-head weights (Karpathy's ``heads.i.query``), the unused
    one beside each part that names ``role`` (``heads.i.value``); [] when none fits."""
    fits = [n for n in spare if params[n].shape[0] == src.rows and _hint(module, n) in (role, None)]
    pick = next((n for n in fits if _hint(module, n) == role), fits[0] if fits else None)
    if pick is not None:
        return [pick]
    picks: list[str] = []
    for path, transposed, rows in src.parts:
        whole = not transposed and rows == tuple(range(params[path].size(0)))
        parent = path.rsplit(".", 2)[0] if path.count(".") >= 2 else ""
        beside = [
            n
            for n in spare
            if whole
            and n not in picks
            and params[n].shape == params[path].shape
            and name_hint(n) == role
            and (n.rsplit(".", 2)[0] if n.count(".") >= 2 else "") == parent
        ]
        if not beside:
            return []
        picks.append(beside[0])
    return picks


def _from(names: list[str], params: Mapping[str, Tensor]) -> RowSource:
    """Whole weights (and their biases, where each has one) as one role's rows."""
    parts = tuple((n, False, tuple(range(params[n].size(0)))) for n in names)
    biases = [f"{n.rsplit('.', 1)[0]}.bias" if "." in n else "bias" for n in names]
    has_bias = all(b in params and params[b].dim() == 1 for b in biases)
    return RowSource(parts, tuple((b, tuple(range(params[b].size(0)))) for b in biases) if has_bias else None, 1.0)


def _rows_taken_back(roles: dict[str, RowSource], params: Mapping[str, Tensor]) -> dict[str, RowSource]:
    """``roles`` with the rows of one fused weight that no role reads given back: where two roles read the same
    rows of it (Phi-3's V sliced at K's place) and as many rows go unused, the role that borrowed takes them,
    the later of the two (q, k, v) when they lie after the shared rows, the earlier when before."""
    pairs = [(a, b) for a, b in (("q", "k"), ("q", "v"), ("k", "v")) if roles[a].parts == roles[b].parts]
    if len(pairs) != 1 or any(len(s.parts) != 1 for s in roles.values()):
        return roles
    a, b = pairs[0]
    path, transposed, rows = roles[a].parts[0]
    if any(s.parts[0][:2] != (path, transposed) for s in roles.values()) or params[path].dim() != 2:
        return roles
    used = {i for s in roles.values() for i in s.parts[0][2]}
    free = tuple(i for i in range(params[path].size(1 if transposed else 0)) if i not in used)
    if len(free) != len(rows):
        return roles
    bias = roles[a].bias
    if bias is not None and (len(bias) != 1 or bias[0][1] != rows):
        return roles
    taker = b if min(free) > max(rows) else a
    back = replace(roles[a], parts=((path, transposed, free),), bias=None if bias is None else ((bias[0][0], free),))
    return {**roles, taker: back}


def settle_roles(module: nn.Module, r: Reading) -> Reading:
    """The reading with each role on the weight meant for it, where the data flow alone cannot tell.

    A role made with another role's weight while a weight of that shape goes unused takes the unused one;
    whole weights used as a permutation of the roles their hints give (K through ``v_proj`` and V through
    ``k_proj``) are read by the hints; an output projection the module leaves unused (or that the reading
    took from a weight Q, K or V uses: fully masked rows blur it) is still the one the module meant. The module's mistake then shows against the reference.
    """
    roles = {"q": r.q, "k": r.k, "v": r.v}
    params = dict(module.named_parameters())
    spare = [n for n in r.unused if params[n].dim() == 2]
    for role, src in roles.items():
        if not spare or not any(o != role and s.parts == src.parts for o, s in roles.items()):
            continue
        if _hint(module, src.parts[0][0]) == role:
            continue  # its own weight: the other role borrowed it
        picks = _spare_for(role, src, spare, params, module)
        if picks:
            roles[role] = _from(picks, params)
            spare = [n for n in spare if n not in picks]
    roles = _rows_taken_back(roles, params)
    hints = {role: _hint(module, src.parts[0][0]) if len(src.parts) == 1 else None for role, src in roles.items()}
    if sorted(map(str, hints.values())) == ["k", "q", "v"] and any(h != role for role, h in hints.items()):
        roles = {cast(str, hints[role]): src for role, src in roles.items()}
    out, used = r.out, {path for src in roles.values() for path, _, _ in src.parts}
    if out is None or any(path in used for path, _, _ in out.parts):  # none read, or a role's weight again:
        E, HD = r.embed_dim, r.q.rows
        fits = [n for n in spare if params[n].shape == (E, HD) and _hint(module, n) in ("out", None)]
        pick = next((n for n in fits if _hint(module, n) == "out"), fits[0] if len(fits) == 1 else None)
        if pick is not None:
            out = replace(_from([pick], params), parts=((pick, True, tuple(range(HD))),))
            spare.remove(pick)
    return replace(
        r, q=roles["q"], k=roles["k"], v=roles["v"], out=out, unused=tuple(n for n in r.unused if n in spare)
    )


def _thirds(r: Reading, module: nn.Module) -> tuple[str, tuple[str, ...]] | None:
    """``(the fused Linear, the roles of its thirds in order)`` where Q, K and V are each one third of one
    Linear's rows, else None."""
    srcs = {"q": r.q, "k": r.k, "v": r.v}
    if any(len(s.parts) != 1 for s in srcs.values()) or len({s.parts[0][0] for s in srcs.values()}) != 1:
        return None
    path = r.q.parts[0][0]
    owner, _, last = path.rpartition(".")
    if (
        last != "weight"
        or not _is_linear(module.get_submodule(owner))
        or not all(_own_bias(s, owner, module) for s in srcs.values())
    ):
        return None
    n = linear_weights(module.get_submodule(owner))[0].size(0) // 3
    at = {s.parts[0][2]: role for role, s in srcs.items()}
    thirds = [tuple(range(i * n, (i + 1) * n)) for i in range(3)]
    return (owner, tuple(at[t] for t in thirds)) if all(t in at for t in thirds) else None


def find_projections(module: nn.Module, r: Reading | None) -> _Found | None:
    """Name the q/k/v/out projections of ``module`` from its settled reading ``r`` (:func:`settle_roles`): an
    ``nn.MultiheadAttention`` inside it; whole Linears, one a role; or a fused Linear cut in thirds, read in
    the order q, k, v whatever the module's (its order of use kept in ``order``: another is a mistake). None
    where the data flow reads anything else (packed per head, per-head modules): its rows are then the
    weights. Without a reading, the module's Linears in declaration order (four, or a fused one and an out).

    Raises:
        NotAttention: without a reading and Linears to take, naming those found.
    """
    mha = next((n for n, m in module.named_modules() if n and isinstance(m, nn.MultiheadAttention)), None)
    if mha is not None:
        return _Found(None, None, None, f"{mha}.out_proj", mha=mha)
    if r is not None:
        out = None if r.out is None else _whole(r.out, module, out=True)
        if out is None:
            return None
        fused = _thirds(r, module)
        if fused is not None:
            return _Found(None, None, None, out, qkv=fused[0], order=fused[1])
        q, k, v = (_whole(s, module) for s in (r.q, r.k, r.v))
        if q is None or k is None or v is None:
            return None
        return _Found(q, k, v, out, listed=_listed((q, k, v, out)))
    linears = {n: lin for n, lin in module.named_modules() if n and _is_linear(lin)}
    paths = list(linears)
    if len(paths) == 4:
        by_hint = {_hint(module, f"{p}.weight"): p for p in paths}
        q, k, v, out = (by_hint[role] for role in ROLES) if set(by_hint) == set(ROLES) else paths
        return _Found(q, k, v, out, listed=_listed((q, k, v, out)))
    if len(paths) == 2:
        widths = [linear_weights(linears[p])[0].shape for p in paths]
        wide = next((i for i in (0, 1) if widths[i][0] == 3 * widths[1 - i][1]), None)
        if wide is not None:
            return _Found(None, None, None, paths[1 - wide], qkv=paths[wide])
    listed = ", ".join(f"{n} ({'->'.join(map(str, linear_weights(m)[0].shape[::-1]))})" for n, m in linears.items())
    raise NotAttention(
        f"{type(module).__name__} has no recognisable q/k/v/out projections (nn.Linear children found: "
        f"{listed or 'none'}); its attention weights were not reached by its data flow either, and its Linears are "
        f"not four (q, k, v, out) or a fused qkv and an out; wrap the module in an attnlab.check.AttentionAdapter"
    )


def _listed(paths: tuple[str, ...]) -> str | None:
    """The container the four paths are items 0..3 of, in order, else None."""
    homes = {p.rpartition(".")[0] for p in paths}
    return homes.pop() if len(homes) == 1 and [p.rpartition(".")[2] for p in paths] == ["0", "1", "2", "3"] else None
