"""attnlab: multi-head attention for PyTorch, readable, verified and fast."""

from .attention import MultiHeadAttention
from .functional import math_attention, sdpa_attention
from .kv_cache import KVCache

__all__ = ["KVCache", "MultiHeadAttention", "math_attention", "sdpa_attention"]
__version__ = "0.1.0"
