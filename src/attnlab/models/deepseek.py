"""``DeepSeekV3``: the DeepSeek-V3 family's dense decoder, its attention being attnlab's multi-head latent attention.

A family added as the issue that made one decoder asked: one config (:class:`DeepSeekV3Config`, whose
``decoder_config()`` sets the switches) and one weight map (:func:`attnlab.models.weight_maps.deepseek_name_from_hf`).
The model is :class:`~attnlab.models.decoder.Decoder`: pre-RMSNorm blocks, SwiGLU MLPs, RoPE on the decoupled
rope key only, an untied head, and :class:`~attnlab.core.mla.MultiHeadLatentAttention` in every block, whose
cache keeps ``kv_lora_rank + qk_rope_head_dim`` values per token and layer.

What it leaves out of DeepSeek-V3: the mixture-of-experts layers (every layer here is dense, as HF's first
``first_k_dense_replace`` layers are), multi-token prediction, and YaRN's rope scaling. :meth:`DeepSeekV3.from_hf`
refuses a checkpoint that needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .config import DEEPSEEK_NAMES, DecoderConfig, LatentDims, check_positive_ints
from .decoder import Decoder
from .weight_maps import deepseek_name_from_hf

__all__ = ["DeepSeekV3Config", "DeepSeekV3"]


@dataclass
class DeepSeekV3Config:
    """Hyper-parameters of a dense DeepSeek-V3-family decoder; the attention sizes default to DeepSeek-V3's,
    the rest to a small model. Names follow HF's ``DeepseekV3Config`` where attnlab has no shared name."""

    vocab_size: int = 32000  # rows of the token embedding and of the head
    block_size: int = 4096  # longest sequence generate() may reach: HF's max_position_embeddings
    n_layer: int = 4  # decoder blocks (all dense)
    n_head: int = 16  # query heads H
    n_embd: int = 1024  # residual width E
    intermediate_size: int = 2816  # SwiGLU hidden width F
    kv_lora_rank: int = 512  # C: the cached latent per token
    q_lora_rank: int | None = 1536  # the query latent; None: one q_proj
    qk_rope_head_dim: int = 64  # R: the shared rotary key (cached beside the latent)
    qk_nope_head_dim: int = 128  # N: per-head query/key dims without RoPE
    v_head_dim: int = 128  # Dv: per-head value dims
    rope_base: float = 10000.0  # RoPE theta on the R rope channels
    rope_interleave: bool = True  # DeepSeek's rope channels come in interleaved pairs
    norm_eps: float = 1e-6  # every RMSNorm's epsilon (blocks, final, latent norms)
    attention_bias: bool = False  # biases on the down-projections and o_proj (DeepSeek has none)
    mla_path: str = "auto"  # "naive" (expand the latent), "absorbed" (attend over it), "auto" (count both)

    def __post_init__(self) -> None:
        check_positive_ints(
            self, ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "intermediate_size", "kv_lora_rank")
        )
        # the latent sizes are checked by MultiHeadLatentAttention, naming each

    @property
    def n_kv_head(self) -> int:
        return self.n_head  # every head reads the one latent; the decoder's masks count query heads

    def decoder_config(self) -> DecoderConfig:
        """DeepSeek-V3's switches: RMSNorm, SwiGLU, RoPE on the rope key, latent attention, untied head, HF's names."""
        latent = LatentDims(
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
            rope_interleave=self.rope_interleave,
            path=self.mla_path,  # type: ignore[arg-type]  # checked by MultiHeadLatentAttention
        )
        return DecoderConfig.of_family(
            self,
            norm="rmsnorm",
            norm_bias=False,
            mlp="swiglu",
            mlp_bias=False,
            position="rotary",
            attention="mla",
            latent=latent,
            tie_embeddings=False,
            scaled_residual_init=False,
            names=DEEPSEEK_NAMES,
        )


def _hf_field(hf_config: Any, name: str, default: Any = None) -> Any:
    return getattr(hf_config, name, default)


def config_from_hf(hf_config: Any) -> DeepSeekV3Config:
    """A :class:`DeepSeekV3Config` from HF's ``DeepseekV3Config``; refuses what attnlab's dense model cannot hold."""
    layers = int(hf_config.num_hidden_layers)
    dense = int(_hf_field(hf_config, "first_k_dense_replace", 0) or 0)
    experts = _hf_field(hf_config, "n_routed_experts", None)
    if experts and dense < layers:
        raise ValueError(
            f"this DeepseekV3Config has mixture-of-experts layers (n_routed_experts={experts}, first_k_dense_replace="
            f"{dense} < num_hidden_layers={layers}), which attnlab's DeepSeekV3 does not hold; it runs dense models "
            f"only: set first_k_dense_replace >= num_hidden_layers."
        )
    rope = _hf_field(hf_config, "rope_parameters", None) or _hf_field(hf_config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"this DeepseekV3Config scales RoPE (rope_type={rope.get('rope_type')!r}), which attnlab's DeepSeekV3 does "
            f"not do; use a config with rope_type 'default'."
        )
    if _hf_field(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: attnlab's SwiGLU MLP uses silu.")
    theta = rope.get("rope_theta", _hf_field(hf_config, "rope_theta", 10000.0))
    return DeepSeekV3Config(
        vocab_size=hf_config.vocab_size,
        block_size=hf_config.max_position_embeddings,
        n_layer=layers,
        n_head=hf_config.num_attention_heads,
        n_embd=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        kv_lora_rank=hf_config.kv_lora_rank,
        q_lora_rank=hf_config.q_lora_rank,
        qk_rope_head_dim=hf_config.qk_rope_head_dim,
        qk_nope_head_dim=hf_config.qk_nope_head_dim,
        v_head_dim=hf_config.v_head_dim,
        rope_base=float(theta),
        rope_interleave=bool(_hf_field(hf_config, "rope_interleave", True)),
        norm_eps=hf_config.rms_norm_eps,
        attention_bias=bool(_hf_field(hf_config, "attention_bias", False)),
    )


class DeepSeekV3(Decoder):
    """A dense DeepSeek-V3-family decoder with attnlab's multi-head latent attention; ``model(idx)`` returns
    logits ``(B, T, V)``.

    Args:
        config: a :class:`DeepSeekV3Config`, kept whole as ``model.config``.
    """

    config: DeepSeekV3Config

    def __init__(self, config: DeepSeekV3Config) -> None:
        super().__init__(config)

    @classmethod
    def from_hf(cls, hf_model: nn.Module, *, mla_path: str = "auto") -> DeepSeekV3:
        """The model with the weights of a Hugging Face ``DeepseekV3ForCausalLM`` (dense layers only).

        ``mla_path``: the latent attention's path in every block (``"naive"``, ``"absorbed"`` or ``"auto"``).
        """
        config = config_from_hf(hf_model.config)
        config.mla_path = mla_path
        model = cls(config)
        state = {}
        for name, tensor in hf_model.state_dict().items():
            ours = deepseek_name_from_hf(name)
            if ours is not None:
                state[ours] = tensor
        unknown = sorted(set(state) - set(model.state_dict()))
        missing = sorted(set(model.state_dict()) - set(state))
        if unknown or missing:
            raise KeyError(
                f"the DeepseekV3 weights do not fit attnlab's DeepSeekV3: unexpected {unknown[:4]}, missing "
                f"{missing[:4]}; expected a dense DeepseekV3ForCausalLM state dict."
            )
        model.load_state_dict(state, strict=True)
        return model
