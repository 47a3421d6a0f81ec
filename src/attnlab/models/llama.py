"""``Llama``: the Llama family's decoder-only language model, its attention being attnlab's.

Exactly Hugging Face's ``LlamaForCausalLM`` (SmolLM2, TinyLlama, Llama 2/3 without RoPE scaling):
token embedding with no position table, pre-RMSNorm blocks, grouped-query attention with rotary
embeddings on Q and K (theta ``rope_base``), SwiGLU MLP, final RMSNorm, output head tied to the
embedding or its own matrix. The model is :class:`~attnlab.models.decoder.Decoder` with the
switches of :meth:`LlamaConfig.decoder_config`: it differs from :class:`attnlab.TinyGPT` only
where Llama differs from GPT-2.

RoPE: attnlab's :func:`attnlab.core.rope.apply_rope` rotates channel pair ``(c, c + D/2)``, which
is Hugging Face's ``rotate_half`` (``cat(-x2, x1)``) with ``cos``/``sin`` = ``cat(freqs, freqs)``,
so HF Llama weights load as they are. GGUF files store Q/K rows in llama.cpp's interleaved
pair order; :func:`attnlab.models.weight_maps.unpermute_qk` puts them back into this order on load.
"""

from __future__ import annotations

from .blocks import Block, RMSNorm
from .blocks import SwiGLUMLP as MLP
from .decoder import Decoder, fuse_quantized
from .llama_config import LlamaConfig

__all__ = ["LlamaConfig", "RMSNorm", "MLP", "Block", "Llama", "fuse_quantized"]


class Llama(Decoder):
    """A Llama-family decoder with attnlab attention; ``model(idx)`` returns logits ``(B, T, V)``.

    Build one from real weights with :func:`attnlab.from_pretrained` (a GGUF file, a Hugging Face
    directory); ``Llama(config)`` alone is randomly initialised.

    Args:
        config: a :class:`LlamaConfig`, kept whole as ``model.config``.
    """

    config: LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
