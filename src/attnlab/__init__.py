"""attnlab: multi-head attention for PyTorch, readable, verified and fast."""

from .attention import MultiHeadAttention
from .functional import math_attention, sdpa_attention

__all__ = ["MultiHeadAttention", "math_attention", "sdpa_attention"]
__version__ = "0.1.0"
