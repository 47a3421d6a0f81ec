"""Training throughput of the lab's default model: attnlab attention vs ``torch.nn.MultiheadAttention``.

The two models are one TinyGPT, copied, with every block's attention swapped for PyTorch's
module carrying the same weights (checked: same logits). Both train on the same batches with
AdamW; runs alternate, and the median tokens/s of several runs is reported.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import MultiHeadAttention


class TorchAttention(nn.Module):
    """``torch.nn.MultiheadAttention`` behind the call TinyGPT's blocks make (causal self-attention)."""

    def __init__(self, ours: MultiHeadAttention) -> None:
        super().__init__()
        self.mha = ours.to_torch(batch_first=True)
        self._masks: dict[int, Tensor] = {}

    def forward(
        self,
        x: Tensor,
        attn_mask: object = None,
        kv_cache: object = None,
        cache_positions: object = None,
        rope: object = None,
    ) -> Tensor:
        if kv_cache is not None or rope is not None:
            raise ValueError("TorchAttention serves training only: kv_cache and rope must be None.")
        T = x.size(1)
        if T not in self._masks:  # torch wants the mask even with is_causal (its fast path then ignores it)
            self._masks[T] = nn.Transformer.generate_square_subsequent_mask(T, device=x.device, dtype=x.dtype)
        return self.mha(x, x, x, attn_mask=self._masks[T], is_causal=True, need_weights=False)[0]


@dataclass
class ThroughputResult:
    model: str  # what was trained
    tokens_per_step: int
    attnlab_tok_s: float
    torch_tok_s: float

    @property
    def ratio(self) -> float:
        return self.attnlab_tok_s / self.torch_tok_s


def train_throughput(steps: int = 20, repeats: int = 5) -> ThroughputResult:
    """tokens/s of ``attnlab train``'s default model, trained with attnlab's and with torch's attention."""
    from ..lab.config import TrainConfig
    from ..lab.data import IGNORE, build_task
    from ..lab.models import build_model
    from ..models.gpt import TinyGPT

    cfg = TrainConfig()
    task = build_task(cfg.data)
    torch.manual_seed(cfg.seed)
    ours = build_model(cfg.model, task.vocab_size, task.block_size + 1)
    theirs = cast(TinyGPT, copy.deepcopy(ours))  # TrainConfig's default model is a TinyGPT
    for block in theirs.blocks:
        block.attn = TorchAttention(cast(MultiHeadAttention, block.attn))
    x, _ = task.batch(0)  # (B, T) inputs; targets unused
    with torch.no_grad():
        gap = (ours(x) - theirs(x)).abs().max().item()
    if gap > 1e-4:
        raise RuntimeError(
            f"the torch-attention copy disagrees with attnlab by {gap:.2e}; the comparison would be void."
        )
    runs: dict[str, list[float]] = {"attnlab": [], "torch": []}
    models = {"attnlab": ours, "torch": theirs}
    opts = {n: torch.optim.AdamW(m.parameters(), lr=cfg.optim.lr) for n, m in models.items()}
    batches = [task.batch(s) for s in range(steps)]

    def run(name: str) -> float:
        model, opt = models[name], opts[name]
        t0 = time.perf_counter()
        for xb, yb in batches:
            logits = model(xb)  # (B, T, V)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), yb.reshape(-1), ignore_index=IGNORE)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return steps * x.numel() / (time.perf_counter() - t0)

    for name in models:  # warm-up
        run(name)
    for rep in range(repeats):
        for name in ("attnlab", "torch") if rep % 2 == 0 else ("torch", "attnlab"):
            runs[name].append(run(name))
    c = cfg.model
    what = (
        f"TinyGPT {c.num_layers} layers, embed_dim {c.embed_dim}, {c.num_heads} heads, copy task, "
        f"batch {x.size(0)} x {x.size(1)} tokens"
    )
    return ThroughputResult(what, x.numel(), statistics.median(runs["attnlab"]), statistics.median(runs["torch"]))
