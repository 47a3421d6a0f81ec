"""attnlab's attention in other people's Hugging Face models: ``attn_implementation="attnlab"``.

``attnlab.hf.register()`` registers it with transformers (5.x); then any model whose attention
layers go through ``AttentionInterface`` (GPT-2, Llama, Mistral, Qwen2/3, OLMo 2; Gemma 2 and
gpt-oss, whose soft-capping and sinks run as attnlab's variants; T5 and its kin, whose relative
position bias joins the mask) runs attnlab's attention when loaded with
``attn_implementation="attnlab"``. transformers is imported only by ``register()``.
"""

from .attention import ATTENTION_NAME, attnlab_attention_forward, hf_mask_to_keep, register

__all__ = ["ATTENTION_NAME", "register", "attnlab_attention_forward", "hf_mask_to_keep"]
