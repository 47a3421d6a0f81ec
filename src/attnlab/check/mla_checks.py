"""The checks of a hand-written MLA module (:class:`attnlab.check.mla.MLAAdapter`), its mistakes, and its diagnosis.

Rows, each in float64 on a copy of the module, causal as DeepSeek's attention is:

- ``mla_shared_rope_key``: the down-projection gives ``C + R`` rows (one rotary key for all heads), not ``C + H*R``;
- ``mla_parity[causal]``: the output against attnlab's float64 reference (:func:`attnlab.core.mla.mla_reference`,
  on a :class:`~attnlab.core.mla.MultiHeadLatentAttention` holding the module's weights), relative max error;
- ``mla_parity[padding]``: the same with the last keys of one sequence hidden (modules taking a (B, 1, T, T) mask);
- ``mla_gradients``: the gradients of a weighted sum of the output, with respect to the input and to every
  weight, against the same gradients through the paper's equations (:func:`attnlab.check.mla.mla_recipe`);
- ``mla_causal_leak``: changing the last token leaves every earlier output as it was.

When a row fails, each mistake of :data:`MLA_MISTAKES` recomputes the output on the module's own weights and
inputs (:class:`~attnlab.check.mla.MLARecipe`); those that reproduce it are named, the closest first.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.functional import causal_keep
from .mla import Layout, MLAAdapter, MLARecipe
from .result import Cause, CheckResult, Report
from .suite import SEQ_LEN

__all__ = ["MLA_CHECKS", "MLA_MISTAKES", "MLAMistake", "run_mla"]

SEE = "DeepSeek-V2, section 2.1 (attnlab.core.mla)"
TOL = 1e-8  # float64 on both sides: what differs by more is a different computation, not rounding
MATCH = 1e-6  # a recipe reproduces the module when it is this close (relative max error)
LAYOUTS: tuple[Layout, ...] = ("interleaved", "half")
MLA_CHECKS = ("mla_shared_rope_key", "mla_parity[causal]", "mla_parity[padding]", "mla_gradients", "mla_causal_leak")


@dataclass(frozen=True)
class MLAMistake:
    """A mistake people make writing MLA: what is found, why it matters, the fix, and the recipe reproducing it.
    ``found``/``why``/``fix`` may name ``{H} {C} {R} {N} {Dv}`` and ``{rq}`` 1/sqrt(N+R), ``{rn}`` 1/sqrt(N), ``{rl}`` 1/sqrt(C+R)."""

    id: str
    title: str
    found: str
    why: str
    fix: str
    recipe: MLARecipe

    def text(self, field: str, dims: Mapping[str, object]) -> str:
        return str(getattr(self, field)).format(**dims)


MLA_MISTAKES: tuple[MLAMistake, ...] = (
    MLAMistake(
        "mla_rope_key_per_head",
        "the rotary key projected per head",
        "the rotary key is projected per head ({H} x {R} rows after the {C} latent ones) instead of one {R}-wide "
        "key shared by every head",
        "every token then caches C + H*R = {C} + {H}x{R} values instead of C + R, which is what MLA saves; and "
        "the module computes another attention than DeepSeek's, so its weights do not load",
        "kv_a_proj_with_mqa = nn.Linear(E, kv_lora_rank + qk_rope_head_dim) and "
        "k_rot.view(B, 1, T, R).expand(B, H, T, R) (one key, broadcast to the heads)",
        MLARecipe(rope_key="per_head"),
    ),
    MLAMistake(
        "mla_scale_nope_only",
        "the scale from the nope dims only",
        "the scores are scaled by 1/sqrt(qk_nope_head_dim) = {rn:.4g}, not 1/sqrt(qk_nope_head_dim + "
        "qk_rope_head_dim) = {rq:.4g}",
        "each score is a dot product over N + R = {N}+{R} channels (the rotary ones too), so the softmax is "
        "sharper than trained and a checkpoint's attention differs",
        "scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 (HF's qk_head_dim ** -0.5)",
        MLARecipe(scale="nope"),
    ),
    MLAMistake(
        "mla_uk_transposed",
        "W_UK transposed in the absorption",
        "the absorption folds W_UK transposed into the queries: q_nope is contracted with wkv_b's latent index "
        "instead of its nope index (it runs only because N = C = {N})",
        "q_C . (W_UK c) equals (W_UK^T q_C) . c, not (W_UK q_C) . c: the scores are those of another key "
        "projection, and at any real size (N != C) the einsum fails",
        'torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :qk_nope_head_dim]) with wkv_b viewed as (H, N+Dv, C)',
        MLARecipe(w_uk="transposed"),
    ),
    MLAMistake(
        "mla_latent_norm_missing",
        "the latent norm forgotten",
        "the latent c_KV goes into kv_b_proj without kv_a_layernorm (RMSNorm over its {C} channels)",
        "DeepSeek's weights were trained on the normalised latent, and the cache is meant to hold it: keys and "
        "values come out at the wrong scale",
        "k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass)) (DeepSeek: kv = self.kv_norm(kv) before the cache)",
        MLARecipe(latent_norm=False),
    ),
    MLAMistake(
        "mla_rope_on_latent",
        "the rotation applied to the latent",
        "the rotary angles turn the latent c_KV too (its first {R} channels), not only q_R and the shared k_R",
        "positions then reach the keys and values through W_UK and W_UV, which the decoupled rotary key exists "
        "to avoid (the absorbed form can no longer fold W_UK into the queries)",
        "rotate only q_R and k_R = W_KR h; leave c_KV = RMSNorm(W_DKV h) as it is",
        MLARecipe(rope_on_latent=True),
    ),
    MLAMistake(
        "mla_scale_latent_width",
        "the scale from the absorbed query's width",
        "the scores are scaled by 1/sqrt(kv_lora_rank + qk_rope_head_dim) = {rl:.4g}, the width of the absorbed "
        "query and the latent key, not 1/sqrt(qk_nope_head_dim + qk_rope_head_dim) = {rq:.4g}",
        "absorbing W_UK changes where the dot product is computed, not its value: each score is still the paper's "
        "q . k over N + R = {N}+{R} channels, so its scale stays 1/sqrt(N + R); the wider one flattens the softmax",
        "softmax_scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 on both paths (DeepSeek's self.softmax_scale)",
        MLARecipe(scale="latent"),
    ),
    MLAMistake(
        "mla_kv_b_split_swapped",
        "kv_b_proj's key and value rows swapped",
        "each head's rows of kv_b_proj are split value first: the first {Dv} rows are used as W_UV and the last "
        "{N} as W_UK, where DeepSeek's checkpoints hold W_UK (qk_nope_head_dim rows) first",
        "keys are then made with the value weights and values with the key weights; with N = Dv (DeepSeek-V3: 128 "
        "and 128) no shape error says so",
        "k_nope, value_states = torch.split(kv, [qk_nope_head_dim, v_head_dim], dim=-1) (key rows first)",
        MLARecipe(kv_b_order="value_first"),
    ),
    MLAMistake(
        "mla_query_norm_missing",
        "the query latent's norm forgotten",
        "the query latent c_Q goes into q_b_proj without q_a_layernorm (RMSNorm over its q_lora_rank channels)",
        "DeepSeek normalises the query latent as it does the key/value latent: without it the queries, and so "
        "every score, come out at the wrong scale",
        "q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))",
        MLARecipe(query_norm=False),
    ),
)


def by_id(mistake_id: str) -> MLAMistake:
    for m in MLA_MISTAKES:
        if m.id == mistake_id:
            return m
    raise KeyError(f"no MLA mistake {mistake_id!r}; known: {[m.id for m in MLA_MISTAKES]}")


def _rel(a: Tensor, b: Tensor) -> float:
    """Max absolute difference over the reference's largest magnitude."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _row(name: str, err: float, detail: str) -> CheckResult:
    """Row ``name``: it passes when the relative error ``err`` is within :data:`TOL`."""
    return CheckResult(name, "pass" if err <= TOL else "fail", err, TOL, detail)


def _core_reference(adapter: MLAAdapter, x: Tensor, keep: Tensor, layout: Layout) -> Tensor:
    """attnlab's float64 reference (:func:`attnlab.core.mla.mla_reference`) with the module's weights copied into a
    :class:`~attnlab.core.mla.MultiHeadLatentAttention`."""
    from ..core.mla import MultiHeadLatentAttention, mla_reference

    d, w = adapter.dims, adapter.weights()
    mla = MultiHeadLatentAttention(
        d.E,
        d.H,
        kv_lora_rank=d.C,
        qk_nope_head_dim=d.N,
        qk_rope_head_dim=d.R,
        v_head_dim=d.Dv,
        q_lora_rank=d.Q,
        rope_interleave=layout == "interleaved",
        norm_eps=w.kvnorm[1],
        attention_bias=True,
        dtype=torch.float64,
        device=x.device,
    )
    copies: list[tuple[str, str, Tensor]] = [
        ("kv_a_proj_with_mqa", "weight", w.W_a),
        ("kv_a_proj_with_mqa", "bias", w.b_a),
        ("kv_a_layernorm", "weight", w.kvnorm[0]),
        ("kv_b_proj", "weight", w.W_kvb.reshape(-1, d.C)),  # (H*(N+Dv), C)
        ("o_proj", "weight", w.W_o),
        ("o_proj", "bias", w.b_o),
    ]
    if w.W_q is not None:
        copies.append(("q_proj", "weight", w.W_q))
    else:
        assert w.W_qa is not None and w.b_qa is not None and w.qnorm is not None and w.W_qb is not None
        copies += [("q_a_proj", "weight", w.W_qa), ("q_a_proj", "bias", w.b_qa), ("q_b_proj", "weight", w.W_qb)]
        copies.append(("q_a_layernorm", "weight", w.qnorm[0]))
        vars(mla.get_submodule("q_a_layernorm"))["eps"] = w.qnorm[1]
    with torch.no_grad():
        for part, attr, value in copies:
            mine: Tensor = getattr(mla.get_submodule(part), attr)
            mine.copy_(value)
    angles = adapter.angles(x.size(1), x.device)  # (T, R/2)
    both = torch.cat((angles, angles), dim=-1)  # (T, R): mla_reference reads the first R/2
    with torch.no_grad():
        return mla_reference(mla, x, rope=(both.cos(), both.sin()), keep=keep)


def run_mla(
    adapter: MLAAdapter,
    *,
    seed: int = 0,
    batch: int = 2,
    seq_len: int = SEQ_LEN,
    strict: bool = False,
    on_check: Callable[[str], None] = lambda name: None,
) -> Report:
    """Every MLA row on ``adapter``, then, when one fails, the diagnosis; a :class:`Report` as the MHA checks give."""
    adapter.float64()
    d = adapter.dims
    dev = next(adapter.module64.parameters()).device
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, d.E, generator=g, dtype=torch.float64).to(dev)  # (B, T, E)
    causal = causal_keep(seq_len, seq_len, dev)[None]  # (1, T, T)
    pad = torch.zeros(batch, seq_len, dtype=torch.bool, device=dev)
    pad[0, -3:] = True  # the last 3 keys of sequence 0 are padding
    padded_keep = causal & ~pad[:, None, :]  # (B, T, T)
    rows: list[CheckResult] = []
    dims_text = dict(
        H=d.H,
        C=d.C,
        R=d.R,
        N=d.N,
        Dv=d.Dv,
        rq=1 / math.sqrt(d.N + d.R),
        rn=1 / math.sqrt(d.N),
        rl=1 / math.sqrt(d.C + d.R),
    )

    on_check("mla_shared_rope_key")
    rows.append(
        CheckResult(
            "mla_shared_rope_key",
            "pass" if d.shared_rope_key else "fail",
            f"{d.key_rope_rows} rows",
            f"{d.R} rows",
            f"the rotary key rows of the down-projection after the C={d.C} latent ones: one R={d.R}-wide key for "
            f"all heads (DeepSeek's 'with_mqa')",
        )
    )

    with torch.no_grad():
        y = adapter(x)  # (B, T, E)
        y_pad = adapter(x, pad) if adapter.takes_padding() else None
    on_check("mla_parity[causal]")
    if d.shared_rope_key:
        errors = {lay: _rel(y, _core_reference(adapter, x, causal, lay)) for lay in LAYOUTS}
        adapter.layout = min(errors, key=errors.__getitem__)
        err = errors[adapter.layout]
        rows.append(
            _row(
                "mla_parity[causal]",
                err,
                f"relative max error against attnlab.core.mla.mla_reference (float64, the module's weights), causal, "
                f"rotary pairs {adapter.layout} (interleaved {errors['interleaved']:.1e}, half-split {errors['half']:.1e})",
            )
        )
    else:
        rows.append(
            CheckResult(
                "mla_parity[causal]",
                "fail",
                "no MLA",
                TOL,
                "the weights do not have MLA's shapes (see mla_shared_rope_key): no reference computes this module",
            )
        )
    on_check("mla_parity[padding]")
    if y_pad is None:
        rows.append(CheckResult("mla_parity[padding]", "skip", detail="its forward takes no per-sequence mask"))
    elif d.shared_rope_key:
        err = _rel(y_pad, _core_reference(adapter, x, padded_keep, adapter.layout))
        rows.append(
            _row("mla_parity[padding]", err, "causal, the last 3 keys of sequence 0 hidden by the additive mask")
        )
    else:
        rows.append(CheckResult("mla_parity[padding]", "skip", detail="no reference for these shapes"))

    on_check("mla_gradients")
    if d.shared_rope_key:
        rows.append(_gradients(adapter, x, causal))
    else:
        rows.append(CheckResult("mla_gradients", "skip", detail="no reference for these shapes"))

    on_check("mla_causal_leak")
    x2 = x.clone()
    x2[:, -1] = torch.randn(batch, d.E, generator=g, dtype=torch.float64).to(dev)
    with torch.no_grad():
        moved = _rel(adapter(x2)[:, :-1], y[:, :-1])
    what = "how far the outputs of positions 0..T-2 move when the last token changes (causal: not at all)"
    rows.append(_row("mla_causal_leak", moved, what))

    config = {
        "embed_dim": d.E,
        "num_heads": d.H,
        "num_kv_heads": f"latent C={d.C}",
        "batch": batch,
        "seq_len": seq_len,
        "seed": seed,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": "float64",
        "mla": {"H": d.H, "C": d.C, "R": d.R, "N": d.N, "Dv": d.Dv, "q_lora_rank": d.Q, "layout": adapter.layout},
    }
    report = Report(adapter.name, rows, config, strict=strict)
    report.config["call_form"] = adapter.describe_call()
    if report.failing:
        on_check("diagnosis")
        report.apply_diagnosis(_diagnose(adapter, report, x, y, causal, y_pad, padded_keep, dims_text))
    return report


def _gradients(adapter: MLAAdapter, x: Tensor, keep: Tensor) -> CheckResult:
    """The gradients of ``sum(out * w)`` (w fixed, random) through the module and through the paper's equations,
    with respect to the input and to each weight of the float64 copy; relative max error of the worst."""
    params = [p for p in adapter.module64.parameters() if p.requires_grad]
    xs = x.clone().requires_grad_(True)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(x.shape, generator=g, dtype=x.dtype).to(x.device)
    mine = torch.autograd.grad((adapter(xs) * w).sum(), [xs, *params], allow_unused=True)
    ref = torch.autograd.grad(
        (adapter.reference(xs, keep, layout=adapter.layout) * w).sum(), [xs, *params], allow_unused=True
    )
    names = ["input"] + [n for n, p in adapter.module64.named_parameters() if p.requires_grad]
    worst, where = 0.0, "input"
    for name, a, b in zip(names, mine, ref, strict=True):
        if a is None and b is None:
            continue
        if a is None or b is None:  # one side gives this weight no gradient at all
            one = a if a is not None else b
            assert one is not None
            err = math.inf if one.abs().max() > 0 else 0.0
        else:
            err = _rel(a, b) if b.abs().max() > 0 else float(a.abs().max())
        if err > worst:
            worst, where = err, name
    return _row(
        "mla_gradients",
        worst,
        f"gradients of a weighted output sum w.r.t. the input and all {len(params)} weights against the paper's "
        f"equations (float64, causal); worst: {where}",
    )


def _diagnose(
    adapter: MLAAdapter,
    report: Report,
    x: Tensor,
    y: Tensor,
    causal: Tensor,
    y_pad: Tensor | None,
    padded_keep: Tensor,
    dims_text: Mapping[str, object],
) -> list[Cause]:
    """Each mistake's recipe against the module's outputs, both rotary layouts; those within :data:`MATCH`,
    closest first. None matching: one cause saying so, with the closest."""
    failing = tuple(r.name for r in report.failures)
    tried: list[tuple[float, MLAMistake, Layout]] = []
    with torch.no_grad():
        for m in MLA_MISTAKES:
            if not m.recipe.applies(adapter.dims):
                continue
            for lay in LAYOUTS:
                err = _rel(y, adapter.reference(x, causal, layout=lay, recipe=m.recipe))
                if y_pad is not None:
                    err = max(err, _rel(y_pad, adapter.reference(x, padded_keep, layout=lay, recipe=m.recipe)))
                tried.append((err, m, lay))
    tried.sort(key=lambda t: t[0])
    matched = [(e, m, lay) for e, m, lay in tried if e <= MATCH]
    seen: set[str] = set()
    causes: list[Cause] = []
    for err, m, lay in matched:
        if m.id in seen:
            continue
        seen.add(m.id)
        causes.append(
            Cause(
                m.id,
                m.text("found", dims_text),
                f"recomputing MLA with this mistake (rotary pairs {lay}) on the module's own weights and inputs "
                f"gives its outputs to {err:.1e} (relative); why it matters: {m.text('why', dims_text)}",
                m.text("fix", dims_text),
                SEE,
                explains=failing,
            )
        )
    if causes:
        return causes
    closest = ", ".join(f"{m.id} {e:.1e}" for e, m, _ in tried[:3]) or "none applies to these shapes"
    return [
        Cause(
            "stage",
            "no catalogued MLA mistake reproduces the module's outputs",
            f"closest recipes (relative max error): {closest}",
            "compare each stage with attnlab.core.mla.mla_reference (q_C, q_R, c_KV, k_R, scores, context)",
            SEE,
        )
    ]
