"""Model configs: the switches of the one decoder, and one dataclass per family that sets them.

:class:`DecoderConfig` names every place where decoder families differ (norm, MLP, positions,
biases, tied head, dropout, init, module names); :class:`attnlab.models.decoder.Decoder` builds
whatever it describes. A family (:class:`GPTConfig` here, :class:`~attnlab.models.llama_config.LlamaConfig`)
keeps the field names its checkpoints use and says, in ``decoder_config()``, which switches it sets.

A config sits below the model that reads it, so that the weight maps (:mod:`.weight_maps`) can build one
without importing the model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["ModuleNames", "GPT2_NAMES", "LLAMA_NAMES", "DEEPSEEK_NAMES", "LatentDims", "DecoderConfig", "GPTConfig"]


@dataclass(frozen=True)
class ModuleNames:
    """Where a family keeps each part of the decoder: the attribute paths its state-dict keys start with.

    Only names change between families here, never computation; a name of None means the family
    holds no such module (Llama has no position table and no embedding dropout).
    """

    embed: str  # token embedding (V, E)
    blocks: str  # the nn.ModuleList of blocks
    final_norm: str  # the norm after the last block
    head: str  # the output head, when not tied to the embedding
    attn_norm: str  # inside a block: the norm before attention
    mlp_norm: str  # inside a block: the norm before the MLP
    positions: str | None = None  # learned position table (block_size, E)
    embed_dropout: str | None = None  # dropout on the embeddings


# GPT-2's names (Hugging Face's GPT2LMHeadModel, nanoGPT): transformer.{wte, wpe, drop, h, ln_f}
GPT2_NAMES = ModuleNames(
    embed="transformer.wte",
    blocks="transformer.h",
    final_norm="transformer.ln_f",
    head="lm_head",
    attn_norm="ln_1",
    mlp_norm="ln_2",
    positions="transformer.wpe",
    embed_dropout="transformer.drop",
)
# attnlab's Llama names (a short form of HF's model.{embed_tokens, layers, norm}; weight maps translate)
LLAMA_NAMES = ModuleNames(
    embed="embed", blocks="layers", final_norm="norm", head="lm_head", attn_norm="attn_norm", mlp_norm="mlp_norm"
)


def check_positive_ints(config: object, names: tuple[str, ...]) -> None:
    """Refuse a size that is not a positive int, naming the config class and the field."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}.")


def check_rotary_head_dim(config: object, n_embd: int, n_head: int) -> None:
    """RoPE rotates channel pairs: refuse an odd head dim, naming the config class."""
    if (n_embd // n_head) % 2:
        raise ValueError(
            f"{type(config).__name__}.position='rotary' needs an even head dim, got n_embd // n_head = "
            f"{n_embd} // {n_head} = {n_embd // n_head}; change n_embd or n_head."
        )


# Hugging Face's names for the DeepSeek-V3 family (model.embed_tokens, model.layers.i.input_layernorm ...):
# its checkpoints load with only self_attn -> attn renamed (weight_maps.deepseek_name_from_hf)
DEEPSEEK_NAMES = ModuleNames(
    embed="model.embed_tokens",
    blocks="model.layers",
    final_norm="model.norm",
    head="lm_head",
    attn_norm="input_layernorm",
    mlp_norm="post_attention_layernorm",
)


@dataclass(frozen=True)
class LatentDims:
    """The sizes of multi-head latent attention (DeepSeek-V2/V3), by DeepSeek's names; see
    :class:`attnlab.core.mla.MultiHeadLatentAttention`. DeepSeek-V3's: 512, 64, 128, 128, 1536."""

    kv_lora_rank: int  # C: the latent each token leaves in the cache
    qk_rope_head_dim: int  # R: the one rotary key shared by all heads (also cached)
    qk_nope_head_dim: int  # N: the per-head query/key dims without RoPE
    v_head_dim: int  # Dv: the per-head value dims
    q_lora_rank: int | None = None  # the query latent; None: one q_proj
    rope_interleave: bool = True  # DeepSeek's checkpoints keep the rope channels in interleaved pairs
    path: Literal["auto", "naive", "absorbed"] = "auto"  # the module's path (auto: by counting both)


_NORMS = ("layernorm", "rmsnorm")
_MLPS = ("gelu", "swiglu")
_POSITIONS = ("learned", "rotary")
_ATTENTIONS = ("mha", "mla")


@dataclass
class DecoderConfig:
    """Everything :class:`~attnlab.models.decoder.Decoder` needs: sizes, and one switch per architectural choice.

    A new family is one of these (plus a weight map for its files): nothing else in the decoder
    changes. The defaults are GPT-2's.
    """

    vocab_size: int = 50257  # rows of the token embedding (and of a tied output head)
    block_size: int = 1024  # positions: rows of a learned table; for RoPE, the longest sequence trained on
    n_layer: int = 12  # blocks
    n_head: int = 12  # query heads H; must divide n_embd (head dim D = n_embd // n_head)
    n_kv_head: int | None = None  # key/value heads G (GQA, 1 = MQA); None means n_head
    n_embd: int = 768  # residual width E
    intermediate_size: int | None = None  # MLP hidden width F; None means 4 * n_embd (GPT-2's)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # GPT-2's LayerNorm or Llama's RMSNorm
    norm_eps: float = 1e-5  # added to the variance (or mean square) before the rsqrt
    norm_bias: bool = True  # a LayerNorm bias (RMSNorm has none)
    mlp: Literal["gelu", "swiglu"] = "gelu"  # GPT-2's tanh-GELU MLP or Llama's gated SwiGLU
    position: Literal["learned", "rotary"] = "learned"  # a wpe table added to the embedding, or RoPE on Q/K
    rope_base: float = 10000.0  # RoPE theta, used when position == "rotary"
    attention: Literal["mha", "mla"] = "mha"  # multi-head attention (GQA/MQA by n_kv_head), or latent (MLA)
    latent: LatentDims | None = None  # MLA's sizes, when attention == "mla"
    attention_bias: bool = True  # biases on Q/K/V/O
    mlp_bias: bool = True  # biases in the MLP's Linear layers
    tie_embeddings: bool = True  # output head = token embedding; False: its own (V, E) matrix
    dropout: float = 0.0  # one rate for embeddings, attention weights and residual branches, as nanoGPT
    scaled_residual_init: bool = True  # GPT-2's init: residual projections N(0, 0.02 / sqrt(2 n_layer))
    names: ModuleNames = GPT2_NAMES  # where each part lives, so state dicts keep their family's keys

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        check_positive_ints(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd"))
        for name, allowed in (("norm", _NORMS), ("mlp", _MLPS), ("position", _POSITIONS), ("attention", _ATTENTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"DecoderConfig.{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}."
                )
        if (self.attention == "mla") != (self.latent is not None):
            raise ValueError(
                f"DecoderConfig.attention={self.attention!r} with latent={self.latent!r}: multi-head latent attention "
                f"needs its sizes and only it takes them; pass attention='mla' with latent=LatentDims(...), or neither."
            )
        if self.latent is not None and self.dropout > 0.0:
            raise ValueError(
                f"DecoderConfig.dropout={self.dropout} with attention='mla': multi-head latent attention has no "
                f"dropout on its weights, so the rate would be applied only in part; use dropout=0.0."
            )
        if self.position == "rotary" and self.latent is None:
            check_rotary_head_dim(self, self.n_embd, self.n_head)
        if self.position == "learned" and self.names.positions is None:
            raise ValueError(
                "DecoderConfig.position='learned' needs names.positions, the attribute path of the position table "
                "(GPT-2's is 'transformer.wpe'); give one, or use position='rotary'."
            )
        # divisibility of n_embd by n_head and of n_head by n_kv_head is checked by MultiHeadAttention

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rope_dim(self) -> int:
        """Channels RoPE rotates per head: the head dim, or MLA's decoupled rope key (``qk_rope_head_dim``)."""
        return self.head_dim if self.latent is None else self.latent.qk_rope_head_dim

    @property
    def mlp_hidden(self) -> int:
        """The MLP's hidden width F."""
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.n_embd

    @classmethod
    def of_family(cls, family: object, **switches: Any) -> DecoderConfig:
        """The decoder a family's config describes: every field the family has by the decoder's name
        (``n_layer``, ``rope_base``, ``tie_embeddings`` ...) passes on as it is; ``switches`` set the rest."""
        shared = {f.name: getattr(family, f.name) for f in fields(cls) if hasattr(family, f.name)}
        return cls(**{**shared, **switches})


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`TinyGPT`; field names follow nanoGPT (and so GPT-2)."""

    vocab_size: int = 50257  # GPT-2's BPE vocabulary; a char-level model needs ~65
    block_size: int = 1024  # longest sequence: rows of wpe, and the cap on prompt + new tokens
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # query heads H; must divide n_embd
    n_embd: int = 768  # residual width E
    dropout: float = 0.0  # one rate for embeddings, attention weights and residual branches, as nanoGPT
    bias: bool = True  # biases in Linear layers and LayerNorms (GPT-2 has them)
    n_kv_head: int | None = None  # key/value heads G (GQA, 1 = MQA); None means n_head, as GPT-2
    position: Literal["learned", "rotary"] = "learned"  # GPT-2's wpe table, or RoPE on Q/K
    rope_base: float = 10000.0  # RoPE frequency base, used when position == "rotary"

    def __post_init__(self) -> None:
        check_positive_ints(self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"))
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.position not in ("learned", "rotary"):
            raise ValueError(
                f"GPTConfig.position must be 'learned' (GPT-2's wpe table) or 'rotary' (RoPE), got {self.position!r}."
            )
        if self.position == "rotary":
            check_rotary_head_dim(self, self.n_embd, self.n_head)
        # divisibility of n_embd by n_head and of n_head by n_kv_head is checked by MultiHeadAttention

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def decoder_config(self) -> DecoderConfig:
        """GPT-2's switches: LayerNorm, tanh-GELU MLP of width 4E, learned positions (or RoPE), tied head;
        ``bias`` sets all three kinds of bias, as in nanoGPT."""
        return DecoderConfig.of_family(
            self, norm_bias=self.bias, attention_bias=self.bias, mlp_bias=self.bias, names=GPT2_NAMES
        )
