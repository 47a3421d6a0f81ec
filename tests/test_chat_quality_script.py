"""``scripts/chat_quality.py``'s figures on answers made here: the repetition share and the log-likelihood."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "chat_quality.py"
spec = importlib.util.spec_from_file_location("chat_quality", SCRIPT)
assert spec is not None and spec.loader is not None
chat_quality = importlib.util.module_from_spec(spec)
sys.modules["chat_quality"] = chat_quality  # its dataclass looks its module up there
spec.loader.exec_module(chat_quality)


def test_repeated_4grams_counts_the_4grams_seen_before():
    assert chat_quality.repeated_4grams([1, 2, 3]) == 0.0  # no 4-gram at all
    assert chat_quality.repeated_4grams([1, 2, 3, 4, 5, 6]) == 0.0
    # "la France, la France, ...": 1 2 1 2 1 2 1 2 has 5 4-grams, (1 2 1 2) and (2 1 2 1) new, the other 3 repeats
    assert chat_quality.repeated_4grams([1, 2, 1, 2, 1, 2, 1, 2]) == 3 / 5
    assert (
        len(chat_quality.PROMPTS) >= 20
        and sum(any("\u4e00" <= c <= "\u9fff" for c in p) for p in chat_quality.PROMPTS) >= 10
    )


def test_mean_log_likelihood_is_the_answers_mean_log_softmax():
    class Fixed(torch.nn.Module):  # logits that depend on the position only: log p is known in closed form
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            T = idx.size(1)
            return torch.arange(3.0).expand(1, T, 3).clone()

    ll = chat_quality.mean_log_likelihood(Fixed(), [0, 1], [2, 0])
    logp = torch.arange(3.0).log_softmax(-1)
    assert math.isclose(ll, float((logp[2] + logp[0]) / 2), rel_tol=1e-6)
    assert math.isnan(chat_quality.mean_log_likelihood(Fixed(), [0], []))
