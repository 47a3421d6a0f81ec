"""attnlab: multi-head attention for PyTorch, readable, verified and fast."""

from .compat.swap import SwapReport, swap
from .core.attention import MultiHeadAttention
from .core.functional import math_attention, sdpa_attention
from .core.kv_cache import KVCache
from .heads.report import HeadReport, inspect
from .models.generation import generate, left_pad
from .models.gpt import GPTConfig, TinyGPT
from .models.llama import Llama
from .models.llama_config import LlamaConfig
from .models.pretrained import from_pretrained
from .models.saved_model import load_checkpoint, save_checkpoint
from .models.tokenizer import ByteTokenizer, CharTokenizer

__all__ = [
    "ByteTokenizer",
    "CharTokenizer",
    "GPTConfig",
    "TinyGPT",
    "Llama",
    "LlamaConfig",
    "from_pretrained",
    "inspect",
    "HeadReport",
    "generate",
    "left_pad",
    "load_checkpoint",
    "save_checkpoint",
    "KVCache",
    "MultiHeadAttention",
    "swap",
    "SwapReport",
    "math_attention",
    "sdpa_attention",
]
__version__ = "0.1.0"
