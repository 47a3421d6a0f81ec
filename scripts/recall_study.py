"""Why TinyGPT stalls on 8-pair recall while seed 002's block learns it: head scores, the share of
the token embedding in the residual stream, and single changes to TinyGPT, over several seeds.

Each (variant, seed) is an ordinary in-process ``attnlab.lab.train`` run of the default recall
task (``--data.task recall``) with head scores logged at every evaluation. The TinyGPT variants
are not lab options: for the duration of a run this script swaps the lab's model builder for one
that makes the change, and adds one measurement to the head scorer:

* ``token_share``, ``token_cos``: at the query keys of the held-out recall batch,
  ``|token embedding| / |x|`` and ``cos(token embedding, x)`` for the residual stream ``x``
  entering each block and leaving the last (``L + 1`` values each).
* ``key_r2``, ``value_r2``: per attention layer, the share of the variance of its input at the
  query keys (at the context values) that is explained by which key (value) sits there. Layer 1
  can look the queried key up only if its input still says which key it is.

Writes ``--out`` (every evaluation of every run, JSON), prints Markdown tables, and draws
``--plot`` (accuracy and the largest head scores vs step, one panel per variant, seed 0).

    python scripts/recall_study.py --variants gpt minimal --seeds 0 --steps 400 --plot docs/recall_heads.png
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.masks import decoder_masks
from attnlab.heads.capture import attention_layers
from attnlab.lab import DataConfig, ModelConfig, TrainConfig
from attnlab.lab.data import RecallTask, build_task
from attnlab.lab.head_scores import HeadScorer
from attnlab.lab.models import build_model, reinit_linears
from attnlab.models.gpt import GPTConfig, TinyGPT

train_module = importlib.import_module("attnlab.lab.train")  # the module: attnlab.lab.train is also the function


@dataclass(frozen=True)
class Variant:
    """One model: seed 002's block, or TinyGPT with some of the differences between the two removed."""

    label: str
    kind: str = "gpt"  # "gpt" or "minimal"
    wte_std: float | None = None  # token embedding N(0, wte_std) instead of GPT-2's N(0, 0.02)
    wpe_std: float | None = None  # position embedding likewise
    untied: bool = False  # a separate output layer (torch's nn.Linear init) instead of wte
    head_copy: bool = False  # with untied: the output layer starts as a copy of wte (tied values, untied training)
    final_norm: bool = True  # TinyGPT's ln_f before the output layer


VARIANTS = {
    "gpt": Variant("TinyGPT (default)"),
    "minimal": Variant("seed 002's block (--model.kind minimal)", kind="minimal"),
    "gpt-untied": Variant("TinyGPT, untied output", untied=True),
    "gpt-wte1": Variant("TinyGPT, token embedding N(0, 1)", wte_std=1.0),
    "gpt-wte1-untied": Variant("TinyGPT, token embedding N(0, 1) + untied output", wte_std=1.0, untied=True),
    "gpt-wte1-headcopy": Variant(
        "TinyGPT, token embedding N(0, 1) + untied output initialised to it", wte_std=1.0, untied=True, head_copy=True
    ),
    "gpt-emb1-untied": Variant(
        "TinyGPT, token and position embeddings N(0, 1) + untied output", wte_std=1.0, wpe_std=1.0, untied=True
    ),
    "gpt-three": Variant(
        "TinyGPT, the three changes of docs/howto/train.md (N(0, 1) embeddings, untied, no ln_f)",
        wte_std=1.0,
        wpe_std=1.0,
        untied=True,
        final_norm=False,
    ),
}


class StudyGPT(TinyGPT):
    """TinyGPT whose output layer may be untied and whose final LayerNorm may be skipped (training forward only)."""

    def __init__(self, config: GPTConfig, variant: Variant) -> None:
        super().__init__(config)
        self.variant = variant
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False) if variant.untied else None

    def forward(self, idx: Tensor, **_: Any) -> Tensor:
        wte, wpe = _embedding(self, "wte"), _embedding(self, "wpe")
        B, T = idx.shape
        x = wte(idx) + wpe(torch.arange(T, device=idx.device))  # (B, T, E)
        masks = decoder_masks(
            None,
            batch=B,
            heads=self.config.n_head,
            q_len=T,
            cache=None,
            cache_positions=None,
            dtype=x.dtype,
            device=x.device,
        )
        for block in cast(nn.ModuleList, self.transformer.h):
            x = block(x, masks)  # (B, T, E)
        if self.variant.final_norm:
            x = cast(nn.LayerNorm, self.transformer.ln_f)(x)
        weight = wte.weight if self.head is None else self.head.weight  # (V, E)
        return F.linear(x, weight)  # (B, T, V)


def _embedding(model: TinyGPT, name: str) -> nn.Embedding:
    return cast(nn.Embedding, model.transformer[name])


def build_variant(variant: Variant, cfg: ModelConfig, vocab_size: int, block_size: int) -> nn.Module:
    """The lab's model for ``cfg``, with ``variant``'s changes (the lab's init otherwise: torch Linears)."""
    if variant.kind == "minimal":
        return build_model(cfg, vocab_size, block_size)
    config = GPTConfig(
        vocab_size=vocab_size,
        block_size=block_size,
        n_layer=cfg.num_layers,
        n_head=cfg.num_heads,
        n_embd=cfg.embed_dim,
        dropout=cfg.dropout,
    )
    model = StudyGPT(config, variant)
    reinit_linears(model)  # what build_model does for --model.init torch (the default)
    with torch.no_grad():
        for name, std in (("wte", variant.wte_std), ("wpe", variant.wpe_std)):
            if std is not None:
                _embedding(model, name).weight.normal_(0.0, std)
        if model.head is not None and variant.head_copy:
            model.head.weight.copy_(_embedding(model, "wte").weight)
    return model


@torch.no_grad()
def block_inputs(model: nn.Module, x: Tensor, modules: list[nn.Module], *, last_output: bool = False) -> list[Tensor]:
    """The first argument each of ``modules`` receives in ``model(x)`` (eval mode), and with ``last_output``
    the last module's output too: ``(B, T, E)`` each."""
    seen: list[Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.append(args[0])) for m in modules]
    if last_output:
        hooks.append(modules[-1].register_forward_hook(lambda _m, _a, out: seen.append(out)))
    was_training = model.training
    model.eval()
    try:
        model(x)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return seen


@torch.no_grad()
def token_share(model: nn.Module, x: Tensor, rows: Tensor) -> tuple[list[float], list[float]]:
    """At positions ``rows`` of ``x`` ``(B, T)``, for the residual entering each block and leaving the last:
    the mean ``|token embedding| / |residual|``, and the mean cosine between the two."""
    if isinstance(model, TinyGPT):
        embedding, blocks = _embedding(model, "wte"), list(cast(nn.ModuleList, model.transformer.h))
    else:
        embedding, blocks = cast(nn.Embedding, model.tok_emb), list(cast(nn.ModuleList, model.blocks))
    residuals = block_inputs(model, x, blocks, last_output=True)
    tok = embedding(x)[:, rows]  # (B, n, E)
    ratio = [round(float((tok.norm(dim=-1) / r[:, rows].norm(dim=-1)).mean()), 4) for r in residuals]
    cosine = [round(float(F.cosine_similarity(tok, r[:, rows], dim=-1).mean()), 4) for r in residuals]
    return ratio, cosine


@torch.no_grad()
def token_r2(model: nn.Module, x: Tensor, rows: Tensor) -> list[float]:
    """Per attention layer: the share of the variance of its input (after the block's LayerNorm) at
    positions ``rows`` that is explained by which token sits there, ``sum_k n_k |mean_k - mean|^2 /
    sum_i |x_i - mean|^2``. 1: the input says exactly which token it is; 0: nothing about it."""
    ids = x[:, rows].reshape(-1)  # (N,)
    out = []
    for h in block_inputs(model, x, list(attention_layers(model))):
        v = h[:, rows].reshape(ids.numel(), -1).double()  # (N, E)
        mean = v.mean(0)
        total = ((v - mean) ** 2).sum()
        between = sum(
            int((ids == k).sum()) * float(((v[ids == k].mean(0) - mean) ** 2).sum()) for k in ids.unique().tolist()
        )
        out.append(round(between / float(total), 4))
    return out


class StudyScorer(HeadScorer):
    """The lab's head scores plus ``token_share``, ``token_cos`` (``L + 1`` floats), ``key_r2`` and ``value_r2`` (``L``)."""

    def __init__(self, task: Any, device: torch.device) -> None:
        super().__init__(task, device)
        self.wide: tuple[Tensor, Tensor] | None = None
        if isinstance(task, RecallTask):
            x, _ = task.batch(0, split="eval")  # all 64 held-out rows: ~20 queries per key for key_r2
            self.wide = (x.to(device), task.answer_sources(x)[0])

    def __call__(self, model: nn.Module) -> dict[str, Any]:
        out: dict[str, Any] = dict(super().__call__(model))
        if self.recall is not None and self.wide is not None:
            x, queries, _ = self.recall
            out["token_share"], out["token_cos"] = token_share(model, x, queries)
            out["key_r2"] = token_r2(model, self.wide[0], self.wide[1])
            out["value_r2"] = token_r2(model, self.wide[0], torch.arange(1, self.wide[1].numel() * 2, 2))
        return out


@contextlib.contextmanager
def patched(variant: Variant) -> Iterator[None]:
    """Inside: the lab's train() builds ``variant`` and scores with :class:`StudyScorer`."""
    saved = {name: getattr(train_module, name) for name in ("build_model", "HeadScorer")}
    setattr(train_module, "build_model", lambda cfg, v, b: build_variant(variant, cfg, v, b))  # noqa: B010
    setattr(train_module, "HeadScorer", StudyScorer)  # noqa: B010
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(train_module, name, value)


@torch.no_grad()
def answer_kinds(model: nn.Module, task: RecallTask, batch: int = 512) -> dict[str, float]:
    """How the model answers held-out queries: accuracy, share of answers that are a value of the
    context, and share that are a most frequent value seen so far (the histogram strategy)."""
    x, y = task.batch(0, split="eval")
    x, y = x[:batch], y[:batch]
    n = task.cfg.n_pairs
    queries, _ = task.answer_sources(x)
    model.eval()
    pred = model(x).argmax(-1)[:, queries]  # (B, n)
    answer = y[:, queries]  # (B, n)
    values = x[:, 1 : 2 * n : 2]  # (B, n) context values
    in_context = (pred[:, :, None] == values[:, None, :]).any(-1)  # (B, n)
    is_mode = torch.zeros_like(in_context)
    for j, q in enumerate(queries.tolist()):
        seen = torch.cat([values, x[:, 2 * n + 2 : q : 2]], dim=1)  # context values + answers given so far
        counts = torch.zeros(x.size(0), task.vocab_size).scatter_add_(1, seen, torch.ones_like(seen, dtype=torch.float))
        is_mode[:, j] = counts.gather(1, pred[:, j : j + 1]).squeeze(1) == counts.max(1).values
    return {
        "acc": round(float((pred == answer).float().mean()), 4),
        "answer_in_context": round(float(in_context.float().mean()), 4),
        "answer_is_mode": round(float(is_mode.float().mean()), 4),
    }


def histogram_accuracy(task: RecallTask, batch: int = 4096) -> float:
    """Held-out accuracy of answering the most frequent value seen so far (ties broken at random): no lookup at all."""
    x, y = RecallTask(DataConfig(task="recall", batch_size=batch)).batch(0, split="eval")
    n = task.cfg.n_pairs
    queries, _ = task.answer_sources(x)
    values = x[:, 1 : 2 * n : 2]
    g = torch.Generator().manual_seed(0)
    correct = 0.0
    for q in queries.tolist():
        seen = torch.cat([values, x[:, 2 * n + 2 : q : 2]], dim=1)
        counts = torch.zeros(x.size(0), task.vocab_size).scatter_add_(1, seen, torch.ones_like(seen, dtype=torch.float))
        guess = (counts + 0.1 * torch.rand(counts.shape, generator=g)).argmax(1)
        correct += float((guess == y[:, q]).float().mean())
    return correct / n


def run(name: str, seed: int, steps: int, eval_every: int, task: str = "recall") -> dict[str, Any]:
    """One (variant, seed) run of ``task``; copy runs report when held-out accuracy first reaches 95%."""
    variant = VARIANTS[name]
    cfg = TrainConfig(
        data=DataConfig(task="recall" if task == "recall" else "copy"),
        model=ModelConfig(kind="minimal" if variant.kind == "minimal" else "gpt"),
        steps=steps,
        seed=seed,
        eval_every=eval_every,
        ckpt_every=0,
        progress=False,
    )
    t0 = time.perf_counter()
    with patched(variant):
        result = train_module.train(cfg, write=False, quiet=True)
    evals = [
        {k: r[k] for k in ("step", "eval_acc", "eval_loss", "head_scores")} for r in result.history if "eval_acc" in r
    ]
    to90 = next((r["step"] for r in evals if r["eval_acc"] >= 0.9), None)
    if task == "copy":
        to95 = next((r["step"] for r in evals if r["eval_acc"] >= 0.95), None)
        print(f"{name:18s} seed {seed}: copy, acc {evals[-1]['eval_acc']:.3f}, 95% at step {to95}", flush=True)
        return {"variant": name, "seed": seed, "steps": steps, "evals": evals, "to95": to95}
    answers = answer_kinds(result.model, result.task)
    print(
        f"{name:18s} seed {seed}: acc {evals[-1]['eval_acc']:.3f}, 90% at step {to90}, "
        f"answers {answers} ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    return {"variant": name, "seed": seed, "steps": steps, "evals": evals, "to90": to90, "answers": answers}


def top(rec: dict[str, Any], name: str, layer: int | None = None) -> float:
    """The largest ``name`` score over the heads of ``layer`` (every layer when None)."""
    grid = rec["head_scores"][name]
    rows = grid if layer is None else [grid[layer]]
    return max(max(row) for row in rows)


def step_table(results: list[dict[str, Any]], name: str, every: int) -> str:
    """Markdown: per evaluation step of ``name`` (its lowest seed), accuracy and the largest head scores."""
    run_ = min((r for r in results if r["variant"] == name), key=lambda r: r["seed"])
    lines = [
        f"{VARIANTS[name].label}, seed {run_['seed']}:\n",
        "| step | held-out acc | loss | L0 prev-token (probe) | L1 induction (probe) | L0 value->key (recall) "
        "| L1 query->value (recall) | key R² entering L1 | token share entering L1 |",
        "|" + "---:|" * 9,
    ]
    for r in run_["evals"]:
        if r["step"] % every:
            continue
        hs = r["head_scores"]
        cells = [
            str(r["step"]),
            f"{r['eval_acc']:.2f}",
            f"{r['eval_loss']:.2f}",
            f"{top(r, 'prev_token', 0):.2f}",
            f"{top(r, 'induction', 1):.2f}",
            f"{top(r, 'recall_prev', 0):.2f}",
            f"{top(r, 'recall_value', 1):.2f}",
            f"{hs['key_r2'][1]:.2f}",
            f"{hs['token_share'][1]:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(results: list[dict[str, Any]], plateau_step: int) -> str:
    """Markdown: per variant, steps to 90% and final accuracy per seed, and what layer 1's input says at ``plateau_step``."""
    lines = [
        f"| variant | loss at init | steps to 90% (per seed) | final acc | at step {plateau_step}: key R² entering L1 "
        "| cos(residual, token embedding) entering L1 | answers that are a most frequent value |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["variant"] for r in results):
        runs = [r for r in results if r["variant"] == name]
        at = [next(e for e in r["evals"] if e["step"] == plateau_step)["head_scores"] for r in runs]
        cells = [
            VARIANTS[name].label,
            ", ".join(f"{r['evals'][0]['eval_loss']:.1f}" for r in runs),
            ", ".join(str(r["to90"] or "-") for r in runs),
            ", ".join(f"{r['evals'][-1]['eval_acc']:.2f}" for r in runs),
            ", ".join(f"{h['key_r2'][1]:.2f}" for h in at),
            ", ".join(f"{h['token_cos'][1]:.2f}" for h in at),
            ", ".join(f"{r['answers']['answer_is_mode']:.2f}" for r in runs),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], names: list[str], path: Path) -> None:
    """One panel per variant (its lowest seed): held-out accuracy and the largest head scores vs step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = min(r["seed"] for r in results)
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 4.6), sharey=True, squeeze=False)
    curves = (
        ("eval_acc", None, "held-out accuracy", "C1", "-"),
        ("recall_prev", 0, "L0 max value -> its key (recall)", "C2", "-"),
        ("recall_value", 1, "L1 max query -> its value (recall)", "C3", "-"),
        ("prev_token", 0, "L0 max previous-token (probe)", "C2", ":"),
        ("induction", 1, "L1 max induction (probe)", "C3", ":"),
        ("key_r2", 1, "key R² of L1's input (which key is asked)", "gray", "--"),
    )
    for ax, name in zip(axes[0], names, strict=True):
        run_ = next(r for r in results if r["variant"] == name and r["seed"] == seed)
        steps = [e["step"] for e in run_["evals"]]
        for key, layer, label, color, style in curves:
            if key == "eval_acc":
                ys = [e["eval_acc"] for e in run_["evals"]]
            elif key == "key_r2":
                ys = [e["head_scores"]["key_r2"][1] for e in run_["evals"]]
            else:
                ys = [top(e, key, layer) for e in run_["evals"]]
            ax.plot(steps, ys, style, color=color, lw=1.6 if key == "eval_acc" else 1.2, label=label)
        ax.set(title=VARIANTS[name].label, xlabel="step", ylim=(0, 1.02))
        ax.title.set_fontsize(9)
    axes[0][0].set_ylabel("attention weight / accuracy / R²")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"8-pair recall, seed {seed}: the jump in accuracy is the lookup heads forming", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["gpt", "minimal"], choices=sorted(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (tiny models gain nothing from more)")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every evaluation of every run")
    parser.add_argument("--plot", type=Path, default=None, help="PNG: accuracy and head scores vs step, per variant")
    parser.add_argument("--table-every", type=int, default=50, help="steps between rows of the per-step tables")
    parser.add_argument("--plateau-step", type=int, default=150, help="the step (before any jump) the summary reads")
    parser.add_argument("--task", choices=["recall", "copy"], default="recall", help="copy: steps to 95%% only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    results = [run(name, seed, args.steps, args.eval_every, args.task) for name in args.variants for seed in args.seeds]
    if args.task == "copy":
        for name in args.variants:
            steps = ", ".join(str(r["to95"] or "-") for r in results if r["variant"] == name)
            print(f"| {VARIANTS[name].label} | {steps} |")
        return
    task = build_task(DataConfig(task="recall"))
    assert isinstance(task, RecallTask)
    print(f"\nhistogram strategy (most frequent value seen so far): held-out accuracy {histogram_accuracy(task):.3f}\n")
    print(summary_table(results, args.plateau_step) + "\n")
    for name in args.variants:
        print(step_table(results, name, args.table_every) + "\n")
    if args.out:
        args.out.write_text(json.dumps(results) + "\n")
    if args.plot:
        plot(results, args.variants, args.plot)


if __name__ == "__main__":
    main()
