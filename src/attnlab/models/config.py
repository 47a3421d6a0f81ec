"""Model configs: one dataclass per decoder family, each field with the reason it exists.

A config sits below the model that reads it, so that weight converters (:mod:`.hf_gpt2`) can
build one without importing the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["GPTConfig"]


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`TinyGPT`; field names follow nanoGPT (and so GPT-2)."""

    vocab_size: int = 50257  # GPT-2's BPE vocabulary; a char-level model needs ~65
    block_size: int = 1024  # longest sequence: rows of wpe, and the cap on prompt + new tokens
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # query heads H; must divide n_embd
    n_embd: int = 768  # residual width E
    dropout: float = 0.0  # one rate for embeddings, attention weights and residual branches, as nanoGPT
    bias: bool = True  # biases in Linear layers and LayerNorms (GPT-2 has them)
    n_kv_head: int | None = None  # key/value heads G (GQA, 1 = MQA); None means n_head, as GPT-2
    position: Literal["learned", "rotary"] = "learned"  # GPT-2's wpe table, or RoPE on Q/K
    rope_base: float = 10000.0  # RoPE frequency base, used when position == "rotary"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}.")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.position not in ("learned", "rotary"):
            raise ValueError(
                f"GPTConfig.position must be 'learned' (GPT-2's wpe table) or 'rotary' (RoPE), got {self.position!r}."
            )
        if self.position == "rotary" and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"GPTConfig.position='rotary' needs an even head dim, got n_embd // n_head = "
                f"{self.n_embd} // {self.n_head} = {self.n_embd // self.n_head}; change n_embd or n_head."
            )
        # divisibility of n_embd by n_head and of n_head by n_kv_head is checked by MultiHeadAttention

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head
