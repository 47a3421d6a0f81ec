"""Drop-in replacements for PyTorch modules, backed by attnlab's attention.

``attnlab.compat.MultiheadAttention`` takes the arguments, parameters, state-dict keys, shapes and
mask conventions of ``torch.nn.MultiheadAttention``; only its conventions live at this edge, and
attnlab's own (batch-first, bool True = may attend) stay inside.
"""

from .multihead import MultiheadAttention

__all__ = ["MultiheadAttention"]
