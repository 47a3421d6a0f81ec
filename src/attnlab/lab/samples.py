"""Held-out prompts completed by a trained TinyGPT with the KV cache: what the demo shows after training."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.generation import generate
from ..models.gpt import TinyGPT
from .data import IGNORE, CopyTask
from .train import RunResult

__all__ = ["Sample", "heldout_samples", "print_samples"]


@dataclass
class Sample:
    prompt: str  # the held-out sequence up to the first scored position
    expected: str  # what a perfect model writes next
    generated: str  # what the model wrote (greedy, KV cache)

    @property
    def correct(self) -> bool:
        return self.generated == self.expected


def heldout_samples(result: RunResult, n: int = 3) -> list[Sample]:
    """``n`` held-out sequences of ``result``'s task, cut before the first scored token and
    continued greedily by the model: copy writes the copied half, recall the first queried value
    (a recall prompt ends with a query key, so one token answers it)."""
    model, task = result.model, result.task
    if not isinstance(model, TinyGPT) or task.tokenizer is None:
        raise ValueError(
            f"heldout_samples needs a TinyGPT on a task with a tokenizer, got {type(model).__name__} "
            f"on {type(task).__name__}; train with --model.kind gpt on copy, recall or text."
        )
    x, y = task.batch(0, split="eval")  # (B, T) each: the evaluation's first batch
    samples = []
    for row_x, row_y in zip(x[:n], y[:n], strict=True):
        scored = (row_y != IGNORE).nonzero().flatten()  # (S,) positions whose next token is scored
        first = int(scored[0]) if len(scored) else len(row_y) - 1
        # copy: every scored target follows from the prompt; recall: only the first (later queries are new keys)
        n_new = len(scored) if isinstance(task, CopyTask) else 1
        prompt = row_x[: first + 1]  # (first + 1,)
        out = generate(model.eval(), prompt[None], n_new, temperature=0.0, use_cache=True)  # (1, first + 1 + n_new)
        samples.append(
            Sample(
                prompt=task.tokenizer.decode(prompt.tolist()),
                expected=task.tokenizer.decode(row_y[first : first + n_new].tolist()),
                generated=task.tokenizer.decode(out[0, first + 1 :].tolist()),
            )
        )
    return samples


def print_samples(samples: list[Sample]) -> None:
    for s in samples:
        print(f"  {s.prompt} -> {s.generated}  ({'correct' if s.correct else f'expected {s.expected}'})")
