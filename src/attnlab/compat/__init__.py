"""Drop-in replacements for other people's attention modules, backed by attnlab's attention.

``attnlab.compat.MultiheadAttention`` takes the arguments, parameters, state-dict keys, shapes and
mask conventions of ``torch.nn.MultiheadAttention``; ``FusedQKVAttention`` is timm's and open_clip's
fused-QKV self-attention with real ``q_proj``/``k_proj``/``v_proj`` Linears; :func:`swap` puts them
(and ``attn_implementation="attnlab"`` for Hugging Face models) into a model in one call. Only the
source's conventions live at this edge; attnlab's own (batch-first, bool True = may attend) stay inside.
"""

from .fused import FusedQKVAttention
from .multihead import MultiheadAttention
from .swap import SwapReport, SwapVerificationError, swap

__all__ = ["MultiheadAttention", "FusedQKVAttention", "swap", "SwapReport", "SwapVerificationError"]
