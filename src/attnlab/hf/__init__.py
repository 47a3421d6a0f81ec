"""attnlab's attention in other people's Hugging Face models: ``attn_implementation="attnlab"``.

``attnlab.hf.register()`` registers it with transformers (5.x); then any model whose attention
layers go through ``AttentionInterface`` (GPT-2, Llama, Mistral, Qwen2/3, OLMo 2; Gemma 2 and
gpt-oss, whose soft-capping and sinks run as attnlab's variants; T5 and its kin, whose relative
position bias joins the mask; DeepSeek-V3, Qwen3-Next, Gemma 3 and Llama 4, whose head dims, value
heads, partial RoPE, gates and chunks are their layers' own) runs attnlab's attention when loaded with
``attn_implementation="attnlab"``. transformers is imported only by ``register()``, which ``import attnlab``
runs as soon as transformers' models are imported (:mod:`attnlab.hf.autoregister`), so that the name works
without calling it. ``backends_used(model)`` (and each layer's ``last_backend`` and ``last_backend_reason``, as on
attnlab's own modules) says which attnlab backend ran in each attention layer, and why;
:func:`attnlab.hf.trace.trace_hf` (what ``trace(model)`` runs for an HF model) records each layer's call with
its shapes and its error against the float64 reference.

:mod:`attnlab.hf.layers` converts one HF attention layer (Qwen3-Next, GPT-NeoX, Gemma 3, Llama 4) into
attnlab's own ``MultiHeadAttention``, its weights copied.
"""

from .attention import ATTENTION_NAME, attnlab_attention_forward, backends_used, hf_mask_to_keep, register

__all__ = ["ATTENTION_NAME", "register", "attnlab_attention_forward", "backends_used", "hf_mask_to_keep"]
