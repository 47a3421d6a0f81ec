"""From failing rows to a named mistake: the diagnosis of ``attnlab check``.

Notation: B batch, T_q/T_k query/key positions, E embed_dim, H heads, G K/V heads, D head dim.

When a check fails, :func:`diagnose` tests the catalogue (:mod:`attnlab.check.catalogue`) as
hypotheses, in four steps:

1. **Crashes** are named by their message (a ``view`` of a transposed tensor, a ``-1e9`` fill in
   float16, K viewed with the query's length...).
2. **Numerical mistakes**: the module runs on a few probe inputs (self- and cross-attention;
   unmasked, causal, padded, bool-masked). Each catalogued mistake recomputes the output with that
   mistake, on the module's own weights and inputs. A mistake is named when it matches the module
   on every probe while the textbook formula does not. Its evidence is the match and the gap.
3. **Behaviours**: a fully masked row (NaN, or a uniform average), NaN in padded values, dropout
   in eval or at the wrong rate or scale, float32 inside a float64 run, a mask read the other way.
4. Where nothing catalogued fits, the module's own intermediate tensors are captured
   (:mod:`attnlab.check.capture`) and compared with the reference's stages: the **first stage
   that diverges** is named.

Each cause lists the failing rows it *explains*: a row the module passes when the reference makes
that mistake too, or one that a module making exactly that mistake fails as well. Follow-on
failures are so grouped under their cause instead of drowning it.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .adapters import AttentionAdapter, Projections, Unsupported
from .capture import capture, departure_hint, first_departure, match_stages
from .catalogue import MISTAKES, Mistake, by_id
from .recipe import Proj, Recipe, stages_of
from .result import Cause, CheckResult, Report
from .suite import CHECKS, HALF, SEQ_LEN, Context, placed, their_line

__all__ = ["diagnose"]

HYPOTHESIS_TOL = 1e-4  # a float32 module matches its own formula to ~1e-7; mistakes differ by > 1e-2
DISTINCT = 1e-3  # the textbook formula must be off by more than this on some probe for a mistake to be named
PROBE_B, PROBE_T, PROBE_TK = 2, 7, 5  # odd lengths, unequal to each other and to the head counts


class _Probe:
    """One probe input, the module's output on it (or the error it raised)."""

    def __init__(self, name: str, q: Tensor, k: Tensor, v: Tensor, masks: dict, raw_bool: Tensor | None = None):
        self.name, self.q, self.k, self.v, self.masks, self.raw_bool = name, q, k, v, masks, raw_bool
        self.out: Tensor | None = None
        self.error = ""


def _dims(a: AttentionAdapter, **extra: object) -> dict[str, object]:
    D = a.embed_dim // a.num_heads
    return {
        "qkv_order": ", ".join(_qkv_order(a)),
        "E": a.embed_dim,
        "H": a.num_heads,
        "G": a.num_kv_heads,
        "D": D,
        "scale": a.scale,
        "rE": 1.0 / math.sqrt(a.embed_dim),
        "rD": 1.0 / math.sqrt(D),
        **extra,
    }


def _cause(m: Mistake | str, a: AttentionAdapter, evidence: str, explains: Sequence[str], **extra: object) -> Cause:
    """The cause ``m`` (a mistake or its id) names, its texts filled with ``a``'s sizes and ``extra``."""
    m = by_id(m) if isinstance(m, str) else m
    dims = _dims(a, **extra)
    return Cause(m.id, m.text("found", dims), evidence, m.text("fix", dims), m.seed, tuple(explains), m.hardening)


_QKV = ("q", "k", "v")


def _qkv_order(a: AttentionAdapter) -> tuple[str, ...]:
    """The order a fused projection's thirds are used in: the probe's finding (``adapter.qkv_order``) when it
    found one other than q, k, v; else k, q, v, the swap the ``qkv_split_order`` recipe recomputes."""
    found = tuple(getattr(a, "qkv_order", None) or ())
    return found if sorted(found) == sorted(_QKV) and found != _QKV else ("k", "q", "v")


def _recipe_of(m: Mistake, a: AttentionAdapter) -> Recipe | None:
    """``m``'s recipe for this target: the split order the probe found, for ``qkv_split_order``; for
    ``mask_ignored``, only what travels through the mask argument is lost (see :func:`_apart_from_mask`)."""
    if m.id == "mask_ignored" and m.recipe is not None:
        return replace(m.recipe, kept_apart=_apart_from_mask(a))
    if m.id == "padding_inverted" and m.recipe is not None and getattr(getattr(a, "masks", None), "use", "") == "float":
        # key padding handed as an additive mask: read the other way round, it is subtracted (HF's extended mask)
        fill = cast(tuple[float, float], _handed_values(a))[1]
        return replace(m.recipe, padding_fill=fill) if math.isfinite(fill) else m.recipe
    if m.id != "qkv_split_order":
        return m.recipe
    order = _qkv_order(a)
    # the adapter names the thirds by position (q, k, v); the module's Q is the third it splits off as "q"
    third = lambda role: cast(Proj, _QKV[order.index(role)])
    return Recipe(q_from=(third("q"), "query"), k_from=(third("k"), "key"), v_from=(third("v"), "value"))


def _apart_from_mask(a: AttentionAdapter) -> tuple[str, ...]:
    """The masks that reach the module otherwise than through its attention-mask argument: key padding with
    an argument of its own, causality with an ``is_causal`` flag of its own or built in (always causal)."""
    form = getattr(a, "form", None)
    if form is None:  # not a probed module: every mask goes in one argument
        return ("is_causal",) if getattr(a, "always_causal", False) else ()
    apart = ["key_padding_mask"] if form.padding_arg is not None else []
    if getattr(a, "always_causal", False) or (form.causal_arg is not None and not form.torch_form):
        apart.append("is_causal")
    return tuple(apart)


def _recipes_of(m: Mistake, a: AttentionAdapter) -> list[Recipe]:
    """The forms ``m`` takes in the code people write: its recipe for this target, then the catalogue's
    other forms (``Mistake.also``)."""
    recipe = _recipe_of(m, a)
    if recipe is None:
        return []
    added = _handed_values(a) if recipe.mask_stage == "after" else None
    return [recipe, *m.also, *([replace(recipe, mask_added_after=added)] if added is not None else [])]


def _handed_values(a: AttentionAdapter) -> tuple[float, float] | None:
    """The numbers a kept and a blocked pair carry in the mask as the module is handed it (a bool or 0/1 mask of
    its polarity, an additive one); None for valid lengths or a module without a probed mask form."""
    masks = getattr(a, "masks", None)
    if masks is None or masks.use == "lens":
        return None
    if masks.use == "float":
        return 0.0, float("-inf") if masks.fill == "-inf" else torch.finfo(a.projections().q_weight.dtype).min
    return (1.0, 0.0) if masks.polarity == "keep" else (0.0, 1.0)


# -- probes ---------------------------------------------------------------------------------------
WINDOW_PROBE = "window masks"  # distinct masks per window, two images: for a target that takes one per window


@torch.no_grad()
def _probe_gain(a: AttentionAdapter, x: Tensor) -> float:
    """The factor the probe inputs are taken by so that the textbook scores spread by about 1: weights
    initialised small (GPT-2's Conv1D and HF's ``initializer_range`` 0.02) give scores of ~0.01 on unit inputs,
    where every weighting is near uniform and a mistake in the scale, the mask fill or the softmax barely moves
    the output (a scale of 1/D for 1/sqrt(D) was 6e-4 away and fitted no recipe). 1 where they spread by 0.1
    or more, as nn.Linear's default initialisation gives."""
    try:
        with torch.no_grad():
            spread = float(_probe_stages(a, _Probe("self", x, x, x, {}))["scaled"].std())
    except (RuntimeError, KeyError):
        return 1.0
    if not math.isfinite(spread) or spread >= 0.1 or spread <= 0.0:
        return 1.0
    return min(math.sqrt(1.0 / spread), 100.0)  # scores grow as the square of the inputs (biases aside)


def _run_probes(a: AttentionAdapter, seed: int) -> list[_Probe]:
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    w = a.projections().q_weight
    dev = w.device
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(w)  # on the target's device, in its dtype
    B, T, Tk, E = PROBE_B, PROBE_T, PROBE_TK, a.embed_dim
    x = rnd(B, T, E)  # (B, T, E)
    gain = _probe_gain(a, x)
    if gain != 1.0:
        x = x * gain
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(w) * gain
    pad = torch.zeros(B, T, dtype=torch.bool, device=dev)
    pad[0, -2:] = True
    pad[1, -1] = True
    keep = (torch.rand(B, T, T, generator=g) > 0.4).to(dev)  # (B, T, T)
    keep[..., 0] = True  # no query without a key: those rows are a behaviour of their own
    probes = [
        _Probe("self", x, x, x, {}),
        _Probe("causal", x, x, x, {"is_causal": True}),
        _Probe("padding", x, x, x, {"key_padding_mask": pad}),
        _Probe("bool mask", x, x, x, {"keep_mask": keep}),
    ]
    if getattr(a, "supports_cross_attention", True):
        k = rnd(B, Tk, a.kdim)  # (B, T_k, kdim)
        v = k if getattr(a, "shared_kv", False) else rnd(B, Tk, a.vdim)  # (B, T_k, vdim)
        probes.insert(1, _Probe("cross", rnd(B, T, E), k, v, {}))
        if Tk != T:  # K and V as long as the queries: a mistake that crashes at another length shows what it does
            k2 = rnd(B, T, a.kdim)  # (B, T, kdim)
            v2 = k2 if getattr(a, "shared_kv", False) else rnd(B, T, a.vdim)
            probes.insert(2, _Probe("cross of equal lengths", rnd(B, T, E), k2, v2, {}))
    if getattr(a, "window_masks", False):  # one mask per window: distinct windows over two images, windows fastest
        wkeep = (torch.rand(2, T, T, generator=g) > 0.4).to(dev)  # (nW, T, T)
        wkeep[..., 0] = True
        xw = rnd(4, T, E)  # (nW * B, T, E)
        probes.append(_Probe(WINDOW_PROBE, xw, xw, xw, {"keep_mask": wkeep.repeat(2, 1, 1)}))
    masks = getattr(a, "masks", None)
    if masks is not None and masks.bool_reading is None and masks.use == "float":
        raw = keep[0]  # (T, T): handed untranslated, as a user would
        probes.append(_Probe("raw bool mask", x, x, x, {"keep_mask": raw}, raw_bool=raw))
    a.set_training(False)
    for p in probes:
        try:
            p.out = a.raw_bool_mask(p.q, p.raw_bool) if p.raw_bool is not None else a(p.q, p.k, p.v, **p.masks)
        except Unsupported:
            p.error = "unsupported"
        except Exception as e:
            p.error = f"{type(e).__name__}: {e}"
    return [p for p in probes if p.error != "unsupported"]


def _own_masks(a: AttentionAdapter, masks: dict) -> dict:
    """``masks`` as the module applies them: an always-causal module (nanoGPT's ``forward(x)``) masks the
    future on every call, so each recipe it is compared with does too (as :meth:`Context.own_masks`)."""
    return {**masks, "is_causal": True} if getattr(a, "always_causal", False) else masks


def _probe_stages(a: AttentionAdapter, probe: _Probe, recipe: Recipe | None = None) -> dict[str, Tensor]:
    """``recipe``'s stages (float64) at the module's sizes on ``probe``'s inputs, under its masks as the module
    applies them."""
    return stages_of(a, probe.q, probe.k, probe.v, recipe=recipe or Recipe(), **_own_masks(a, probe.masks))


def _recipe_error(a: AttentionAdapter, recipe: Recipe, probe: _Probe, *, nan_ok: bool = False) -> float | None:
    """Relative error of the module against ``recipe`` on ``probe``, over the queries that see a key (and,
    with ``nan_ok``, whose outputs are finite); None: the recipe cannot be computed at these sizes (so it
    is not what the module does)."""
    try:
        with torch.no_grad():  # values compared, no gradient wanted (float() of one warns)
            s = _probe_stages(a, probe, recipe)
    except RuntimeError:
        return None
    assert probe.out is not None
    sees = (s["weights"].abs().sum(-1) > 0).any(dim=1)  # (B, T_q): rows with a visible key
    if sees.shape != probe.out.shape[:2]:  # a recipe that reads the axes otherwise (batch_seq_swapped): every row
        sees = torch.ones(probe.out.shape[:2], dtype=torch.bool, device=probe.out.device)
    if nan_ok:
        sees = sees & torch.isfinite(probe.out).all(dim=-1)
    got, want = probe.out.detach().double()[sees], s["out"][sees]
    if got.shape != want.shape:
        return math.inf
    if not bool(torch.isfinite(got).all()):
        return math.inf
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12)) if want.numel() else 0.0


# -- which failing rows a cause explains ------------------------------------------------------------
class _Formula(AttentionAdapter):
    """A module that makes exactly ``recipe``'s mistake, on the target's weights (the oracle of a hypothesis)."""

    def __init__(self, target: AttentionAdapter, recipe: Recipe) -> None:
        self.target, self.recipe = target, recipe
        self.name = f"formula with {recipe.changes()}"
        self.embed_dim, self.num_heads, self.num_kv_heads = target.embed_dim, target.num_heads, target.num_kv_heads
        self.kdim, self.vdim = target.kdim, target.vdim
        self.supports_cross_attention = getattr(target, "supports_cross_attention", True)
        self.shared_kv = getattr(target, "shared_kv", False)
        self.always_causal = getattr(target, "always_causal", False)  # its checks' reference is causal too

    @property
    def scale(self) -> float:
        return self.target.scale

    def projections(self) -> Projections:
        return self.target.projections()

    def _stage(self, stage: str, query: Tensor, key: Tensor, value: Tensor, **masks: object) -> Tensor:
        masks = _own_masks(self, masks)  # as the target, masked causally on every call when it is always causal
        return stages_of(self, query, key, value, recipe=self.recipe, **masks)[stage].to(query.dtype)

    def __call__(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        masks = {"keep_mask": keep_mask, "key_padding_mask": key_padding_mask, "is_causal": is_causal}
        return self._stage("out", query, key, value, **masks)

    def attention_weights(self, query, key, value, *, keep_mask=None, key_padding_mask=None, is_causal=False):
        masks = {"keep_mask": keep_mask, "key_padding_mask": key_padding_mask, "is_causal": is_causal}
        return self._stage("weights", query, key, value, **masks)

    def cast(self, dtype: torch.dtype) -> AttentionAdapter:
        return self


def _explained(
    a: AttentionAdapter,
    recipe: Recipe,
    failing: Sequence[str],
    *,
    seed: int,
    batch: int,
    seq_len: int,
    nan_rows: set[str] | None = None,
) -> list[str]:
    """The rows in ``failing`` that ``recipe``'s mistake accounts for; those where the mistake alone makes
    NaN/inf too are added to ``nan_rows``."""
    ctx = Context(a, batch=batch, seq_len=seq_len, seed=seed, recipe=recipe, long_lens=(63, 64))
    oracle = Context(_Formula(a, recipe), batch=batch, seq_len=seq_len, seed=seed, long_lens=(63, 64))
    out = []
    with torch.random.fork_rng(devices=[]):
        for name in failing:
            torch.manual_seed(seed)
            try:
                row = CHECKS[name](oracle)
                if row.status == "fail":  # the mistake alone fails this row too (cheap: no module call)
                    out.append(name)
                    if nan_rows is not None and "NaN/inf" in row.detail:
                        nan_rows.add(name)
                    continue
            except Exception:
                pass
            try:
                if CHECKS[name](ctx).status == "pass":  # the module agrees with the mistaken formula here
                    out.append(name)
            except Exception:
                pass
    a.set_training(False)
    if "dropout_rate" in failing and "dropout_rate" not in out and "parity_self" in out:
        out.append("dropout_rate")  # it reads the heads back through the textbook forward, which this mistake breaks
    return out


# -- where a tensor on the wrong device comes from --------------------------------------------------
# torch functions that make a tensor from nothing: without device= it lands on the default device (the
# CPU), wherever the inputs are. (*_like and Tensor.new_* follow their tensor: never the culprit.)
_FACTORIES = frozenset(
    {"ones", "zeros", "full", "empty", "tensor", "as_tensor", "arange", "eye", "rand", "randn", "randint",
     "linspace", "tril_indices", "triu_indices"}
)  # fmt: skip


class _Factories(TorchFunctionMode):
    """While on, records each tensor a factory makes from the target's own code: ``(function, device, where)``."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, torch.device, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if name in _FACTORIES and isinstance(out, Tensor) and out.dim() > 0:  # a 0-dim tensor mixes with any device
            at = their_line(traceback.extract_stack())
            if at:
                self.made.append((name, out.device, at))
        return out


def _made_elsewhere(a: AttentionAdapter, seed: int) -> str:
    """Which line of the target's code makes a tensor on another device than its inputs, found by running
    the probes with every factory call recorded: ``"torch.ones at mine.py:41 (`...`) makes it on cpu, for
    inputs on cuda:0"``; empty when none does (the tensor came from elsewhere: a plain attribute, say)."""
    dev = a.projections().q_weight.device
    with _Factories() as recorder:
        _run_probes(a, seed)
    for name, made_on, at in recorder.made:
        if made_on != dev:
            file_line, _, code = at.partition(": ")
            return f"torch.{name} at {file_line} (`{code}`) makes it on {made_on}, for inputs on {dev}"
    return ""


# -- the steps ---------------------------------------------------------------------------------------
_RAISED = re.compile(r"^raised (\w+): (.*)$")


def _crash_causes(a: AttentionAdapter, rows: list[CheckResult]) -> list[Cause]:
    """Failing rows that raised, grouped by the catalogued message they carry."""
    crashed = [(r, m) for r in rows if (m := _RAISED.match(r.detail))]
    passed_self = not any(r.name == "parity_self" for r, _ in crashed)
    causes: dict[str, tuple[Mistake | None, list[str], str]] = {}
    for r, match in crashed:
        message = f"{match[1]}: {match[2]}"
        mistake = next((m for m in MISTAKES if m.kind == "crash" and re.search(m.pattern, match[2])), None)
        if mistake is not None and mistake.id == "key_length_from_query" and not passed_self:
            mistake = None  # a shape error in self-attention too is not about the key length
        key = mistake.id if mistake else message
        causes.setdefault(key, (mistake, [], message))[1].append(r.name)
    out = []
    for mistake, names, message in causes.values():
        at = next((r.data["raised_at"] for r in rows if r.name in names and r.data.get("raised_at")), "")
        evidence = f"{len(names)} row(s) raised {message}" + (f"; raised at {at}" if at else "")
        if mistake is not None:
            out.append(_cause(mistake, a, evidence, names))
        else:
            out.append(
                Cause(
                    "crash",
                    f"the module raises {message.split(':')[0]} on these inputs",
                    evidence,
                    "run the module alone on the row's inputs (ATTNLAB_DEBUG=1 shows the traceback)",
                    "seed 002, section 4.1",
                    tuple(names),
                )
            )
    return out


def _recipe_causes(
    a: AttentionAdapter, probes: list[_Probe], fit: Callable[..., tuple[list[Cause], dict[str, float]]]
) -> tuple[list[Cause], bool]:
    """(the numerical mistakes that fit, whether the textbook formula failed a probe); ``fit`` is
    :func:`_fitting` with the failing rows and the sizes bound.

    Where none fits a module not found always causal, they are tried once more with the future masked on
    every call: a module that masks causally by itself but makes a mistake that lets later tokens reach
    earlier outputs (a merge that mixes positions, a mask one step off) is not found causal by the probe.
    Where a bool mask had no clear effect on the module (a mistake that mixes heads or positions blurs it), the
    masks it was handed may not be its own: the mistakes are then fitted on the unmasked probes alone."""
    found, off = fit(a, probes)
    if found or not off:
        return found, bool(off)
    if not getattr(a, "always_causal", False):
        assumed = copy.copy(a)
        assumed.always_causal = True
        found, _ = fit(assumed, probes, note="causal")
    masks = getattr(a, "masks", None)
    if not found and masks is not None and masks.bool_reading is None and masks.use == "bool":
        found, _ = fit(a, [p for p in probes if not p.masks], note="unmasked")
    return found, True


def _fitting(
    a: AttentionAdapter,
    probes: list[_Probe],
    failing: list[str],
    *,
    seed: int,
    batch: int,
    seq_len: int,
    nan_rows: set[str],
    note: str = "",
) -> tuple[list[Cause], dict[str, float]]:
    """(the numerical mistakes that fit ``a``'s outputs on ``probes``, the probes the textbook formula is off on)."""
    ran = [p for p in probes if p.out is not None]
    masks = getattr(a, "masks", None)
    if masks is not None and masks.use == "float":  # the float-mask probes ran another code path than a bool mask
        # ... unless it has no bool path at all (HF's additive masks): its key padding then goes no other way
        only = not any(p.raw_bool is not None for p in ran)
        ran = [
            p
            for p in ran
            if not p.masks
            or p.raw_bool is not None
            or (only and set(p.masks) == {"key_padding_mask"})
            or p.name == WINDOW_PROBE  # per-window masks: the one path a window mask has
            # causal without a mask where it masks causally by itself when handed none: its own mask, no float's
            or (p.masks == {"is_causal": True} and getattr(a, "causal_unless_masked", False))
        ]
    textbook = {p.name: _recipe_error(a, Recipe(), p) for p in ran}
    off = {n: e for n, e in textbook.items() if e is not None and e > DISTINCT}
    if not off:
        return [], off
    taken = {
        "causal": " with the future masked on every call (the module masks it by itself)",
        "unmasked": " unmasked (a bool mask had no clear effect on the module: the masked probes are left out)",
    }.get(note, "")
    found = []
    for m in MISTAKES:
        for recipe in _recipes_of(m, a):
            errs = {p.name: _recipe_error(a, recipe, p, nan_ok=m.nan_under_masks and bool(p.masks)) for p in ran}
            if all(e is not None and e <= HYPOTHESIS_TOL for e in errs.values()):
                break
        else:
            continue
        worst = max(e for e in errs.values() if e is not None)
        gap_case = max(off, key=off.__getitem__)
        evidence = (
            f"the output matches this mistake{taken} to {worst:.1e} on {len(errs)} probe inputs ({', '.join(errs)}); "
            f"the textbook formula is off by {off[gap_case]:.1e} ({gap_case})"
        )
        if m.nan_under_masks:  # the whole forward is off, and what masked slices give depends on the fill: all of it
            explains = list(failing)
        else:
            explains = _explained(a, recipe, failing, seed=seed, batch=batch, seq_len=seq_len, nan_rows=nan_rows)
        # by what the mistake is: its implied rows; and found with the future masked, the module is causal by
        # itself, so position order matters to it (permutation_equivariance holds for bidirectional modules only)
        implied = (*m.implies, *(("permutation_equivariance",) if note == "causal" else ()))
        explains = [*explains, *(r for r in implied if r in failing and r not in explains)]
        found.append((len(explains), -MISTAKES.index(m), _cause(m, a, evidence, explains)))
    found.sort(key=lambda t: (t[0], t[1]), reverse=True)
    return [c for *_, c in found], off


@torch.no_grad()
def _fully_masked(a: AttentionAdapter, seed: int) -> Cause | None:
    g = torch.Generator().manual_seed(seed + 3)
    T, E = PROBE_T, a.embed_dim
    x = torch.randn(PROBE_B, T, E, generator=g).to(a.projections().q_weight)  # (B, T, E)
    keep = torch.ones(T, T, dtype=torch.bool, device=x.device)
    keep[2] = False  # query 2 sees no key
    with torch.enable_grad():
        xg = x.clone().requires_grad_()
        full = a(xg, xg, xg, keep_mask=keep)  # (B, T, E)
        grad = (
            torch.autograd.grad(full.sum(), xg)[0] if full.requires_grad and bool(torch.isfinite(full).all()) else None
        )
    out = full.detach()[:, 2]  # (B, E)
    inference = a(x, x, x, keep_mask=keep)[:, 2]  # (B, E): no_grad may take another path (torch's MHA fast path)
    bad = lambda t: int((~torch.isfinite(t)).sum())  # its NaN/inf entries
    what = "query 2 with every key masked:"
    if not bad(out) and bad(inference):
        nan = (
            f"{what} finite with autograd, but {bad(inference)} of {inference.numel()} outputs NaN/inf under "
            f"torch.no_grad (another code path, e.g. nn.MultiheadAttention's fast path)"
        )
    elif grad is not None and bad(grad):
        nan = f"{what} outputs finite, but {bad(grad)} input gradients NaN/inf (autograd through a softmax of -inf)"
    elif bad(out):
        nan = f"{what} {bad(out)} of {out.numel()} outputs NaN/inf"
    else:
        nan = ""
    if nan:
        return _cause("fully_masked_nan", a, nan, ["fully_masked_rows"])
    s = stages_of(a, x, x, x)
    p = a.projections().to(torch.float64)
    rep = a.num_heads // a.num_kv_heads
    mean_v = s["v_heads"].mean(dim=2, keepdim=True).repeat_interleave(rep, dim=1)  # (B, H, 1, D): every key alike
    uniform = torch.nn.functional.linear(
        mean_v.transpose(1, 2).reshape(PROBE_B, -1), p.out_weight, p.out_bias
    )  # (B, E)
    err = float((out.double() - uniform).abs().max() / uniform.abs().max())
    if err <= HYPOTHESIS_TOL:
        return _cause(
            "fully_masked_uniform",
            a,
            f"query 2 with every key masked equals the plain average of all values to {err:.1e}, not the zero context",
            ["fully_masked_rows"],
        )
    return None


def _dropout(a: AttentionAdapter, rows: dict[str, CheckResult]) -> Cause | None:
    """The rate and the rescale, read off dropout_rate's figures (dropout in eval is named first, in diagnose)."""
    p = float(getattr(a, "dropout_p", 0.0))
    r = rows.get("dropout_rate")
    if r is None or "dropped" not in r.data:  # a row that raised carries only where
        return None
    frac, kept, n = r.data["dropped"], r.data["kept_scale"], r.data["draws"]
    band = 5.0 * math.sqrt(p * (1 - p) / n)
    if abs(frac - (1 - p)) <= band and abs(frac - p) > band:
        return _cause(
            "dropout_keep_prob", a, f"{frac:.3f} of the weights dropped, p = {p:g}: that is 1 - p", ["dropout_rate"]
        )
    if abs(frac - p) <= band and abs(kept - 1.0) < 0.1 * (1 / (1 - p) - 1):
        return _cause(
            "dropout_no_rescale",
            a,
            f"dropped fraction {frac:.3f} = p, but kept weights x{kept:.4f}, want x{1 / (1 - p):.4f}",
            ["dropout_rate"],
        )
    if frac < p / 4:
        return _cause(
            "dropout_inactive",
            a,
            f"in training, {frac:.4f} of {n} one-key weights were dropped, want p = {p:g}",
            ["dropout_rate"],
        )
    return None


def _float64(
    a: AttentionAdapter, rows: dict[str, CheckResult], seed: int, failing_names: Sequence[str]
) -> Cause | None:
    grads = [n for n in rows if n.startswith("gradcheck") or n == "grad_parity"]
    if not grads:
        return None
    try:
        a64 = a.cast(torch.float64)
    except Unsupported:
        return None
    a64.set_training(False)
    g = torch.Generator().manual_seed(seed + 5)
    x = torch.randn(1, 4, a.embed_dim, generator=g, dtype=torch.float64).to(a.projections().q_weight.device)
    module = getattr(a64, "module", None)
    ops = capture(lambda: a64(x, x, x), {"query": x}, module)
    low = next(
        (
            op
            for op in ops
            if op.dtype in (torch.float32, torch.float16, torch.bfloat16) and torch.float64 in op.input_dtypes
        ),
        None,
    )
    if low is not None:
        _name_by_stage(a64, x, ops)
        where = _call_text(ops.index(low), ops, ["x"])
        return _cause(
            "float64_downcast",
            a,
            f"in a float64 run, op #{ops.index(low) + 1} `{where}` returns {str(low.dtype).removeprefix('torch.')}",
            grads,
        )
    forward_rows = {"parity_self", "parity_cross", "parity_masked", "odd_lengths"}
    if not forward_rows & rows.keys() and not forward_rows & set(failing_names):
        backward = grads + [n for n in rows if n.startswith("low_precision_grad")]
        return _cause(
            by_id("wrong_backward"), a, "the forward matches the reference but its gradients do not", backward
        )
    return None


def _low_precision(
    a: AttentionAdapter, rows: dict[str, CheckResult], seed: int, *, run_dtype: torch.dtype | None = None
) -> Cause | None:
    """The low-precision rows' loss; in a run in a half ``run_dtype``, any row's (each was held to the same rule)."""
    names = [n for n in rows if run_dtype in HALF or n.startswith("low_precision")]
    if not names:
        return None
    if run_dtype is not None and run_dtype in HALF:
        dtype = run_dtype
    else:
        dtype = torch.float16 if any("fp16" in n for n in names) else torch.bfloat16
    where = ""
    try:
        low = a.cast(dtype)
        low.set_training(False)
        g = torch.Generator().manual_seed(seed + 11)
        x = torch.randn(1, 4, a.embed_dim, generator=g).to(a.projections().q_weight.device, dtype)
        ops = capture(lambda: low(x, x, x), {"query": x}, getattr(low, "module", None))
        bits = lambda d: torch.finfo(d).bits if d.is_floating_point else 64
        narrow = next((op for op in ops if op.input_dtypes and bits(op.dtype) < min(map(bits, op.input_dtypes))), None)
        if narrow is not None:
            _name_by_stage(low, x, ops)
            where = f"; op #{ops.index(narrow) + 1} `{_call_text(ops.index(narrow), ops, ['x'])}` narrows {dtype} to {narrow.dtype}"
    except Exception:
        pass
    worst = max(
        (rows[n] for n in names),
        key=lambda r: (
            r.measured / r.tolerance if isinstance(r.measured, float) and isinstance(r.tolerance, float) else 0
        ),
    )
    evidence = (
        f"{worst.name}: max error {worst.measured:.2e} against a budget of {worst.tolerance:.2e} (2x plain PyTorch + 1e-6)"
        if isinstance(worst.measured, float)
        else worst.detail
    )
    return _cause("low_precision_loss", a, evidence + where, names)


# What an op's result is called in a message: the reference stage it equals, in the seed's words.
_SHOWN = {"q_heads": "q", "k_heads": "k", "v_heads": "v", "scaled": "scores", "masked": "scores"}


def _name_by_stage(target: AttentionAdapter, x: Tensor, ops: list) -> None:
    """Match the ops of a self-attention call on ``x`` with the reference's stages (names for messages)."""
    match_stages(ops, stages_of(target, x, x, x))


def _call_text(op_index: int, ops: list, input_names: list[str]) -> str:
    op = ops[op_index]

    def name(a: object) -> str:
        if isinstance(a, int) and a < 0:
            return input_names[-1 - a] if -1 - a < len(input_names) else "input"
        if isinstance(a, int):
            stage = ops[a].stage
            return _SHOWN.get(stage, stage) if stage else f"t{a + 1}"
        return str(a)

    args = ", ".join(str(name(x)) for x in op.args)
    kwargs = "".join(f", {k}={v}" for k, v in op.kwargs.items())
    return f"{op.func}({args}{kwargs})"


def _mask_polarity(a: AttentionAdapter, rows: dict[str, CheckResult]) -> Cause | None:
    r = rows.get("mask_semantics")
    if r is None or r.measured not in ("True = may attend", "True = blocked"):
        return None
    declared = r.tolerance
    keep = declared == "True = may attend"
    fix = (
        "mask with masked_fill(~attn_mask, float('-inf')) so that True = may attend; or, if True = blocked is "
        "your convention, say so: --mask-convention block"
        if keep
        else "mask with masked_fill(attn_mask, float('-inf')) so that True = blocked; or pass --mask-convention keep"
    )
    return _cause(
        "mask_polarity",
        a,
        f"a bool mask reads {r.measured} here ({r.detail}); expected {declared}",
        ["mask_semantics"],
        convention=f"{declared} (the convention of {'the seeds and SDPA' if keep else 'nn.MultiheadAttention'})",
        polarity_fix=fix,
    )


@torch.no_grad()
def _stage_cause(a: AttentionAdapter, probes: list[_Probe], explains: list[str]) -> Cause | None:
    """Where no catalogued mistake fits: the first stage whose tensor the module never produces."""
    module = getattr(a, "module", None)
    probe = next((p for p in probes if p.out is not None and (_recipe_error(a, Recipe(), p) or 0) > DISTINCT), None)
    if probe is None:  # the forward matches on every probe: nothing to locate
        return None
    inputs = {"query": probe.q} if probe.k is probe.q else {"query": probe.q, "key": probe.k, "value": probe.v}
    ops = capture(lambda: a(probe.q, probe.k, probe.v, **probe.masks), inputs, module)
    stages = _probe_stages(a, probe)
    match_stages(ops, stages)
    matched, missing, candidate = first_departure(ops, stages, masked=bool(_own_masks(a, probe.masks)))
    if missing is None:
        return None
    hint = departure_hint(missing, candidate, stages, a.scale, ops)
    same = [s for s in matched if s != missing]
    ok = ", ".join(same)
    plural = missing.endswith("s")  # weights, scores, q_heads: "do"; q, masked, context: "does"
    match = "match" if len(same) > 1 or ok.endswith("s") else "matches"
    found = (
        f"your {ok} {match} the reference; your {missing} {'do' if plural else 'does'} not"
        if ok
        else f"no stage of yours matches the reference, from the first on: your {missing} already "
        f"{'differ' if plural else 'differs'}"
    ) + (f": {hint}" if hint else "")
    where = (
        f" (op #{ops.index(candidate) + 1}, {candidate.func}, shape {candidate.shape})" if candidate is not None else ""
    )
    reading = getattr(a, "reading", None)
    if getattr(reading, "rotary_on_heads", False):  # the data flow saw the map itself: say what it does
        found += "; its rotary turns each head by an angle that follows the head index, not the position"
    return Cause(
        "stage",
        found,
        f"intermediate tensors captured on the {probe.name!r} probe and compared with the reference's stages{where}",
        f"compare your {missing} step with the reference: attnlab trace --target ... shows both side by side",
        {"q": "seed 002, section 2.1", "k": "seed 002, section 2.1", "v": "seed 002, section 2.1",
         "q_heads": "seed 002, section 2.2", "scaled": "seed 002, section 2.3", "weights": "seed 002, section 2.4",
         "context": "seed 000, section 3.4", "merged": "seed 002, section 2.2", "out": "seed 002, section 2.1"}.get(missing, "seed 000"),
        tuple(explains),
    )  # fmt: skip


# -- the whole diagnosis ---------------------------------------------------------------------------------
def _resolving(a: AttentionAdapter) -> AttentionAdapter:
    """The target the hypotheses are tested on: itself, or, in a half dtype, a float32 copy on the same
    device. A recomputed mistake matches a float32 module to ~1e-7 (``HYPOTHESIS_TOL``); in bfloat16
    rounding alone is ~1e-2, where the mistakes cannot be told apart. What only half precision does
    (a -1e9 fill overflowing float16, a softmax in bfloat16) shows in the failing rows themselves."""
    if a.projections().q_weight.dtype not in HALF:
        return a
    try:
        wide = a.cast(torch.float32)
    except Unsupported:
        return a
    wide.set_training(False)
    return wide


def diagnose(
    a: AttentionAdapter,
    report: Report,
    *,
    seed: int = 0,
    batch: int = 2,
    seq_len: int = SEQ_LEN,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
) -> list[Cause]:
    """The likely causes of ``report``'s failures, most likely first (empty when nothing failed).

    ``device``, ``dtype``: where and in what to test the hypotheses, as in :func:`attnlab.check.run_checks`
    (default: where and as ``a`` is; pass the report's own to diagnose a report made elsewhere). In a
    half dtype they are recomputed on a float32 copy (see :func:`_resolving`).
    """
    failing = [r for r in report.results if r.status == "fail"]
    if not failing:
        return []
    a = cast(AttentionAdapter, placed(a, device, dtype))
    run_dtype = a.projections().q_weight.dtype
    a = _resolving(a)
    causes: list[Cause] = []
    explained: set[str] = set()
    nan_by_mistake: set[str] = set()  # rows where a named numerical mistake makes NaN/inf by itself

    def add(c: Cause | None, *, force: bool = False) -> None:
        """Record ``c``; ``force``: its rows move to it from earlier causes (a NaN no formula makes)."""
        if c is None:
            return
        if force:
            for i, other in enumerate(causes):
                causes[i] = replace(other, explains=tuple(n for n in other.explains if n not in c.explains))
            explained.difference_update(c.explains)
        new = tuple(n for n in c.explains if n not in explained)
        if not new and c.explains:
            return
        causes.append(replace(c, explains=new))
        explained.update(new)

    crashes = _crash_causes(a, failing)
    for i, c in enumerate(crashes):
        if c.id == "device_mismatch":
            try:
                origin = _made_elsewhere(a, seed)
            except Exception:  # the search is a refinement: the cause stands without it
                origin = ""
            if origin:
                crashes[i] = replace(c, found=f"{c.found}: {origin}")
    for c in crashes:
        if c.id != "crash":  # a catalogued crash first; an unknown one may be a mistake's consequence
            add(c)
    determinism_off = "determinism" in {r.name for r in failing} and "determinism" not in explained  # not a crash
    drawn = report["determinism"].measured if determinism_off else None
    # two eval calls that differ by a finite amount: a NaN output is no draw of dropout's (NaN != NaN)
    determinism_off = isinstance(drawn, float) and math.isfinite(drawn)
    if determinism_off and float(getattr(a, "dropout_p", 0.0)) > 0:
        # outputs drawn at random in eval: every comparison is noise, so this cause comes first and alone
        d = report["determinism"]
        add(
            _cause(
                "dropout_in_eval",
                a,
                f"two eval calls on the same input differ by {d.measured:.2e}, with dropout p={getattr(a, 'dropout_p', 0):g}"
                if isinstance(d.measured, float)
                else d.detail,
                [r.name for r in failing if r.name not in explained],
            )
        )
        return causes
    rest = [r.name for r in failing if r.name not in explained]
    # K and V viewed with the key's length crash when they were computed from the query: that mistake, if the
    # recipes find it, is the cause, and the crash its consequence
    length = next((c for c in causes if c.id == "key_length_from_query"), None)
    probes = _run_probes(a, seed) if rest or length is not None else []
    textbook_off = False
    if rest or length is not None:
        rows_off = [*rest, *(length.explains if length else ())]
        fit = functools.partial(
            _fitting, failing=rows_off, seed=seed, batch=batch, seq_len=seq_len, nan_rows=nan_by_mistake
        )
        found, textbook_off = _recipe_causes(a, probes, fit)
        from_query = next((c for c in found[:3] if c.id == "kv_from_query"), None)
        if length is not None and from_query is not None:
            causes.remove(length)
            explained.difference_update(length.explains)
            joined = replace(from_query, explains=tuple(dict.fromkeys((*from_query.explains, *length.explains))))
            found = [joined, *(c for c in found if c.id != "kv_from_query")]
        # most likely first; more than three fitting mistakes would say that the probes cannot tell them apart
        for c in found[:3]:
            add(c)
    swapped = next((c for c in causes if c.id == "batch_seq_swapped"), None)
    if swapped is not None:  # cross-attention's K/V viewed with "the query's length": the batch, read as one
        for c in [c for c in causes if c.id == "key_length_from_query"]:
            causes.remove(c)
            i = causes.index(swapped)
            swapped = causes[i] = replace(swapped, explains=(*swapped.explains, *c.explains))
    for c in crashes:
        if c.id == "crash" and swapped is not None and "shape" in c.evidence:
            # inputs read as (T, B, E): every mask of shape (B, ..) or (T, T) no longer fits; the same mistake
            i = causes.index(swapped)
            swapped = causes[i] = replace(swapped, explains=(*swapped.explains, *c.explains))
            explained.update(c.explains)
        elif c.id == "crash":
            add(c)
    left = {r.name: r for r in failing if r.name not in explained}
    rows = {r.name: r for r in failing}
    # a NaN that no named numerical mistake makes on its own is a behaviour of its own
    nan = lambda name: name in rows and "NaN/inf" in rows[name].detail and name not in nan_by_mistake
    if "fully_masked_rows" in left or nan("fully_masked_rows"):
        try:
            add(_fully_masked(a, seed), force=nan("fully_masked_rows"))
        except Exception:
            pass
    if nan("padded_kv_nonfinite") and "padding_invariance" not in left:
        r = rows["padded_kv_nonfinite"]
        why = r.detail.split(" (", 1)[-1].removesuffix(")").split("); worst")[0]
        form = getattr(a, "form", None)
        pad_fix = (
            "zero V at the keys no query may see before the weighted sum: v.masked_fill(~attn_mask.any(-2)[..., None], 0.0)"
            if form is not None and form.padding_arg is None
            else "zero the padded rows of V before the weighted sum: v.masked_fill(key_padding_mask[:, None, :, None], 0.0)"
        )
        add(_cause("padded_values_nan", a, why, ["padded_kv_nonfinite"], pad_fix=pad_fix), force=True)
    left = {r.name: r for r in failing if r.name not in explained}
    add(_dropout(a, left))
    left = {r.name: r for r in failing if r.name not in explained}
    try:
        add(_float64(a, left, seed, [r.name for r in failing]))
    except Exception:
        pass
    left = {r.name: r for r in failing if r.name not in explained}
    add(_mask_polarity(a, left))
    if not textbook_off:  # the forward is right in float32: a half-precision failure is a precision matter
        left = {r.name: r for r in failing if r.name not in explained}
        add(_low_precision(a, left, seed, run_dtype=run_dtype))
    if "scale_attribute" in {r.name for r in failing}:
        declared = getattr(a, "declared_scale", None)
        scale_causes = [i for i, c in enumerate(causes) if c.id.startswith("scale_")]
        if scale_causes and "scale_attribute" not in explained:
            i = scale_causes[0]
            causes[i] = replace(causes[i], explains=(*causes[i].explains, "scale_attribute"))
            explained.add("scale_attribute")
        elif declared is not None:
            add(_cause("scale_attribute", a, report["scale_attribute"].detail, ["scale_attribute"], declared=declared))
    left_names = [r.name for r in failing if r.name not in explained]
    if left_names and textbook_off and not any(c.id in _NUMERIC for c in causes):
        try:
            add(_stage_cause(a, probes, left_names))
        except Exception:
            pass
    if run_dtype == torch.float16:  # asked to run in float16, a fill it cannot hold is no robustness matter
        causes = [replace(c, hardening=False) if c.id == "fill_overflows_half" else c for c in causes]
    return _ordered(causes)


def _ordered(causes: list[Cause]) -> list[Cause]:
    """What makes the attention wrong before robustness it was not written for (hardening causes last);
    within each, the cause explaining more of the failing rows first, unknown crashes last; ties: catalogued
    crashes, then what is wrong with the forward's numbers, then behaviours (stable: the catalogue's order
    breaks the rest)."""

    def rank(c: Cause) -> int:
        if by_kind(c.id) == "crash":
            return 0
        if c.id in _NUMERIC or c.id == "stage":
            return 1
        return 3 if c.id == "crash" else 2

    return sorted(causes, key=lambda c: (c.hardening, c.id == "crash", -len(c.explains), rank(c)))


def by_kind(mistake_id: str) -> str:
    return next((m.kind for m in MISTAKES if m.id == mistake_id), "")


_NUMERIC = {m.id for m in MISTAKES if m.recipe is not None}
