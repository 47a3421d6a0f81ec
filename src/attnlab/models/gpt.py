"""``TinyGPT``: GPT-2's decoder-only language model, its attention being attnlab's.

Exactly GPT-2 (token + learned position embeddings, pre-LayerNorm blocks, tanh-GELU MLP of
width 4E, final LayerNorm, output embedding tied to the token embedding), with two options
GPT-2 lacks: ``n_kv_head < n_head`` (grouped-query attention, a smaller KV cache) and
``position="rotary"`` (RoPE on Q and K instead of the ``wpe`` table).

The model is :class:`~attnlab.models.decoder.Decoder` with the switches of
:meth:`GPTConfig.decoder_config`; its parts keep GPT-2's names (``transformer.wte``,
``transformer.h[i].ln_1``, ``mlp.c_fc`` ...), so state dicts are GPT-2's.
"""

from __future__ import annotations

from .blocks import Block
from .blocks import GeluMLP as MLP
from .config import GPTConfig
from .decoder import Decoder
from .weight_maps import gpt2_weights_from_hf

__all__ = ["GPTConfig", "MLP", "Block", "TinyGPT"]


class TinyGPT(Decoder):
    """GPT-2 with attnlab attention; ``model(idx)`` returns logits ``(B, T, V)``.

    Args:
        config: a :class:`GPTConfig`, kept whole as ``model.config``.
    """

    config: GPTConfig

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)

    @classmethod
    def from_hf_gpt2(cls, model_or_state_dict, *, n_head: int | None = None) -> TinyGPT:
        """A TinyGPT with the weights of a Hugging Face ``GPT2LMHeadModel`` (or its state dict).

        A state dict does not say how many heads it has: pass ``n_head`` with one.
        """
        config, state_dict = gpt2_weights_from_hf(model_or_state_dict, n_head=n_head)
        model = cls(config)
        missing = sorted(set(model.state_dict()) - set(state_dict))
        if missing:
            raise KeyError(
                f"the GPT-2 weights lack {missing[:4]}{' ...' if len(missing) > 4 else ''}; expected a complete GPT2LMHeadModel state dict."
            )
        model.load_state_dict(state_dict, strict=True)
        return model
