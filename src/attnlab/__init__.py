"""attnlab: multi-head attention for PyTorch, readable, verified and fast."""

from .attention import MultiHeadAttention
from .functional import math_attention, sdpa_attention
from .kv_cache import KVCache
from .model import GPTConfig, TinyGPT
from .generation import generate, left_pad
from .checkpoint import load_checkpoint, save_checkpoint
from .tokenizer import ByteTokenizer, CharTokenizer

__all__ = ["ByteTokenizer", "CharTokenizer", "GPTConfig", "TinyGPT", "generate", "left_pad", "load_checkpoint", "save_checkpoint", "KVCache", "MultiHeadAttention", "math_attention", "sdpa_attention"]
__version__ = "0.1.0"
