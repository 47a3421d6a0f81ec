"""``LlamaConfig``: the hyper-parameters of :class:`attnlab.models.llama.Llama`, each with why it exists.

A config sits below the model that reads it, so that the readers of weight files
(:mod:`attnlab.weight_files.hf_llama`, :mod:`attnlab.weight_files.gguf`) can build and check one
before the model, and its memory, exist. Field names follow
:class:`~attnlab.models.config.GPTConfig` where the two families share an idea (``n_layer``,
``n_head``, ``n_kv_head``, ``n_embd``, ``rope_base``) and Hugging Face's ``LlamaConfig`` where
only Llama has it (``intermediate_size``, ``attention_bias``, ``mlp_bias``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LLAMA_NAMES, DecoderConfig, check_positive_ints

__all__ = ["LlamaConfig"]


@dataclass
class LlamaConfig:
    """Hyper-parameters of a Llama-family decoder; the defaults are SmolLM2-135M's."""

    vocab_size: int = 49152  # rows of the token embedding (and of the output head)
    block_size: int = 8192  # longest sequence generate() may reach: HF's max_position_embeddings
    n_layer: int = 30  # decoder blocks
    n_head: int = 9  # query heads H; must divide n_embd (head dim D = n_embd // n_head)
    n_kv_head: int = 3  # key/value heads G (GQA): the KV cache is H / G times smaller than MHA's
    n_embd: int = 576  # residual width E
    intermediate_size: int = 1536  # hidden width F of the SwiGLU MLP (gate and up are E -> F)
    rope_base: float = 100000.0  # RoPE theta: rotation of channel pair c is position * theta^(-2c/D)
    norm_eps: float = 1e-5  # RMSNorm's epsilon, added to the mean square before the rsqrt
    tie_embeddings: bool = True  # output head = token embedding (small models); False: its own (V, E) matrix
    attention_bias: bool = False  # biases on Q/K/V/O (Llama has none; attnlab's module has all four or none)
    mlp_bias: bool = False  # biases on gate/up/down (Llama has none)

    def __post_init__(self) -> None:
        check_positive_ints(
            self, ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size")
        )
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"LlamaConfig needs n_embd divisible by n_head with an even head dim for RoPE, got n_embd={self.n_embd}, "
                f"n_head={self.n_head} (head dim {self.n_embd / self.n_head:g}); change n_embd or n_head."
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}: each K/V head serves "
                f"n_head / n_kv_head query heads; pick a divisor of {self.n_head}."
            )
        if not self.rope_base > 1.0:
            raise ValueError(f"LlamaConfig.rope_base must be > 1 (Llama uses 10000 to 500000), got {self.rope_base!r}.")
        if not self.norm_eps > 0.0:
            raise ValueError(f"LlamaConfig.norm_eps must be > 0 (Llama uses 1e-5 or 1e-6), got {self.norm_eps!r}.")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def decoder_config(self) -> DecoderConfig:
        """Llama's switches: RMSNorm, SwiGLU MLP of width ``intermediate_size``, RoPE, no dropout, HF's plain init."""
        return DecoderConfig.of_family(
            self,
            norm="rmsnorm",
            norm_bias=False,
            mlp="swiglu",
            position="rotary",
            scaled_residual_init=False,
            names=LLAMA_NAMES,
        )
