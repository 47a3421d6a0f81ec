"""``Decoder``: one decoder-only language model for every family, built from the switches of a :class:`DecoderConfig`.

Reads top-down: construction, init, sizes, caches, the forward, the fused GGUF decode step.
Shapes: B batch, T tokens of this call, E = n_embd, V = vocab_size, H = n_head, G = n_kv_head,
D = E // H. Token ids are int64 ``(B, T)``.

GPT-2 (:class:`attnlab.TinyGPT`) and Llama (:class:`attnlab.Llama`) are this class with their
configs; they differ only where their architectures differ (norm, MLP, positions, biases, tied
head, init), each a field of :class:`DecoderConfig`. Attention, KV cache, masks, context
parallelism, document packing and :func:`attnlab.generate` are the same code for all of them.
"""

from __future__ import annotations

import math
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import ContextParallelAttention, MultiHeadAttention
from ..core.fused import FusedLinearView, fusable
from ..core.kv_cache import KVCache, decoder_positions, kv_storage_dtype, share_read_scratch
from ..core.masks import decoder_masks
from ..core.mla_cache import MLACache
from ..core.rope import rope_cos_sin
from ..core.validation import check_document_ids
from ..core.variants import document_positions
from ..quant.layers import QuantEmbedding, QuantLinear, fuse_rows
from ..runtime import release_freed_heap, trims_each_layer
from .blocks import Block, RMSNorm, SwiGLUMLP, make_norm
from .config import DecoderConfig
from .generation import check_token_ids, generate
from .parallel import context_parallel_positions

__all__ = ["Decoder", "FamilyConfig", "fuse_quantized"]


class FamilyConfig(Protocol):
    """A family's own config (:class:`GPTConfig`, :class:`LlamaConfig`): its field names, and the switches it sets."""

    @property
    def block_size(self) -> int: ...  # generation reads it from model.config

    def decoder_config(self) -> DecoderConfig: ...


def _contiguous_weight(module: nn.Module, state_dict: dict[str, Tensor], prefix: str, local_metadata: object) -> None:
    """State-dict hook of the output matrix: its column-major weight leaves as a contiguous ``(V, E)`` copy.

    A copy of V x E values per ``state_dict()`` call (what saving does anyway), in exchange for a
    state dict that ``safetensors.torch.save_file`` accepts as it is. With ``keep_vars=True`` the
    caller asked for the parameter itself, so it is left alone.
    """
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is not None and not isinstance(value, nn.Parameter) and not value.is_contiguous():
        state_dict[key] = value.contiguous()


class Decoder(nn.Module):
    """A pre-norm decoder with attnlab attention; ``model(idx)`` returns logits ``(B, T, V)``.

    Args:
        config: a :class:`DecoderConfig`, or a family's config with a ``decoder_config()`` method
            (:class:`GPTConfig`, :class:`LlamaConfig`); kept whole as ``model.config``, while
            ``model.arch`` is the :class:`DecoderConfig` it describes.
    """

    def __init__(self, config: DecoderConfig | FamilyConfig) -> None:
        super().__init__()
        self.config = config
        arch = config if isinstance(config, DecoderConfig) else config.decoder_config()
        self.arch = arch
        names = arch.names
        # Registration order is construction order: it fixes the state dict's key order, the
        # parameters' order (an optimizer's saved state follows it) and how much of the random
        # stream each layer's default init draws before reset_parameters, so a seed gives the
        # weights it gave before the families shared this class.
        self._put(names.embed, nn.Embedding(arch.vocab_size, arch.n_embd))  # (V, E)
        if names.embed_dropout is not None:
            self._put(names.embed_dropout, nn.Dropout(arch.dropout))
        self._put(names.blocks, nn.ModuleList(Block(arch) for _ in range(arch.n_layer)))
        self._put(names.final_norm, make_norm(arch))  # the blocks' kind of norm
        if arch.position == "learned":
            assert names.positions is not None  # DecoderConfig.__post_init__ requires it
            self._put(names.positions, nn.Embedding(arch.block_size, arch.n_embd))  # (block_size, E)
        if not arch.tie_embeddings:
            self._put(names.head, nn.Linear(arch.n_embd, arch.vocab_size, bias=False))
        elif "." not in names.head:
            setattr(self, names.head, None)  # tied: `model.lm_head is None` says so
        # Tied, the output head is the embedding's weight itself (F.linear in _logits), one state_dict
        # key. The output matrix is (V, E) as in GPT-2 and HF but stored column-major, an (E, V) tensor
        # seen transposed: a decode step multiplies (B, 1, E) by weight.T, and MKL's kernel for a
        # contiguous (E, V) right operand is faster than for a transposed one (AMD EPYC, 2 threads,
        # fp32: 2.2 ms vs 6.9 ms at V=50257, E=256; 8-12 ms vs 15-24 ms at SmolLM2's V=49152, E=576,
        # batch 1; in bf16 1.0-1.24x slower, a smaller loss on half the bytes). It is the largest
        # matmul of the step. The projections measured no consistent winner and stay row-major.
        # Lookups, load_state_dict (copy_), .to(), to_empty and optimizers keep this layout;
        # state_dict() hands out a row-major copy (_contiguous_weight), so that safetensors.save_file
        # and every other consumer of a state dict get an ordinary (V, E) tensor.
        head = self.output_module
        head.weight = nn.Parameter(torch.empty(arch.n_embd, arch.vocab_size).t())  # (V, E) view
        head.register_state_dict_post_hook(_contiguous_weight)
        self.reset_parameters()

    def _put(self, path: str, module: nn.Module) -> None:
        """Register ``module`` at a dotted ``path`` (``"transformer.wte"``), creating ``nn.ModuleDict`` parents."""
        *parents, leaf = path.split(".")
        owner: nn.Module = self
        for name in parents:
            if name not in owner._modules:
                owner.add_module(name, nn.ModuleDict())
            owner = cast(nn.Module, owner._modules[name])
        owner.add_module(leaf, module)

    # The parts, whatever the family calls them (names.*); looked up on each use, so that a part
    # replaced in place (quantized layers, a swapped attention) is the one used.

    @property
    def token_embedding(self) -> nn.Module:
        """The token embedding: ``nn.Embedding`` ``(V, E)``, or a :class:`~attnlab.quant.QuantEmbedding`."""
        return self.get_submodule(self.arch.names.embed)

    @property
    def blocks(self) -> nn.ModuleList:
        """The blocks, in order."""
        return cast(nn.ModuleList, self.get_submodule(self.arch.names.blocks))

    @property
    def final_norm(self) -> nn.Module:
        """The norm after the last block."""
        return self.get_submodule(self.arch.names.final_norm)

    @property
    def output_module(self) -> nn.Module:
        """The module holding the output matrix: the token embedding when tied, else the head."""
        return self.token_embedding if self.arch.tie_embeddings else self.get_submodule(self.arch.names.head)

    def reset_parameters(self) -> None:
        """N(0, 0.02) weights, zero biases, unit norm weights (GPT-2's and HF Llama's init); with
        ``scaled_residual_init`` (GPT-2), the residual projections get N(0, 0.02 / sqrt(2 n_layer))."""
        residual_std = 0.02 / math.sqrt(2 * self.arch.n_layer)  # two residual branches per block
        residual = (
            ("attn.out_proj", "attn.o_proj", "mlp.c_proj", "mlp.down_proj") if self.arch.scaled_residual_init else ()
        )
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    std = residual_std if residual and name.endswith(residual) else 0.02
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                    bias = getattr(module, "bias", None)  # nn.Embedding has none
                    if bias is not None:
                        nn.init.zeros_(bias)
                elif isinstance(module, (nn.LayerNorm, RMSNorm, nn.RMSNorm)):
                    nn.init.ones_(module.weight)
                    bias = getattr(module, "bias", None)  # RMSNorm, and LayerNorm(bias=False), have none
                    if bias is not None:
                        nn.init.zeros_(bias)

    # -- sizes ---------------------------------------------------------------------------------

    def _quantized_layers(self) -> list[QuantLinear | QuantEmbedding]:
        """The layers holding GGUF blocks, each once (a fused Q|K|V shares its layers' bytes and is left out)."""
        return [m for m in self.modules() if isinstance(m, (QuantLinear, QuantEmbedding)) and not m.is_fusion]

    def num_params(self) -> int:
        """Weights, counting a tied embedding once, and the weights of quantized layers (``dtype="gguf"``) too."""
        quantized = sum(m.rows * m.in_features for m in self._quantized_layers())
        return sum(p.numel() for p in self.parameters()) + quantized

    def weight_bytes(self) -> int:
        """Bytes of every weight as held: float parameters at their itemsize, quantized layers at their blocks' size.
        A decode step reads each of them once."""
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        return params + sum(m.weight_bytes for m in self._quantized_layers())

    @property
    def quantized(self) -> bool:
        """Whether layers hold GGUF blocks (``from_pretrained(..., dtype="gguf")``) rather than float weights."""
        return bool(self._quantized_layers())

    @property
    def output_weight(self) -> Tensor:
        """The ``(V, E)`` matrix that turns the last hidden state into logits (dequantized, a new tensor, when quantized)."""
        head = self.output_module
        if isinstance(head, (QuantEmbedding, QuantLinear)):
            return head.dequantize()
        return cast(Tensor, head.weight)

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """KV-cache bytes one token costs per sequence, all layers: 2 (K, V) * n_layer * G * D * itemsize,
        or with latent attention n_layer * (kv_lora_rank + qk_rope_head_dim) * itemsize."""
        a = self.arch
        assert a.n_kv_head is not None  # DecoderConfig.__post_init__ fills it
        per_layer = (
            2 * a.n_kv_head * a.head_dim if a.latent is None else a.latent.kv_lora_rank + a.latent.qk_rope_head_dim
        )
        return a.n_layer * per_layer * self._kv_dtype().itemsize

    # -- caches --------------------------------------------------------------------------------

    def setup_caches(self, batch_size: int, max_len: int, kv_dtype: torch.dtype | str | None = None) -> nn.ModuleList:
        """One :class:`KVCache` per block, ``(B, G, max_len, D)`` each, on the model's device and dtype (with latent
        attention one :class:`~attnlab.core.mla_cache.MLACache`, ``(B, max_len, kv_lora_rank + qk_rope_head_dim)``).

        ``kv_dtype``: the caches' storage (``"float16"``, ``"bfloat16"``, ``"int8"``, ...; see
        :data:`attnlab.core.kv_cache.KV_DTYPES`); default the dtype K/V are computed in, exact. Reads give the
        keys and values back in that compute dtype (without autograd, into one buffer the layers share:
        :func:`~attnlab.core.kv_cache.share_read_scratch`)."""
        if max_len > self.arch.block_size:
            why = (
                f"the model has no position beyond {self.arch.block_size - 1}"
                if self.arch.position == "learned"
                else "the longest sequence this model was trained for"
            )
            raise ValueError(
                f"max_len={max_len} exceeds block_size={self.arch.block_size}, {why}; "
                f"use max_len <= {self.arch.block_size}."
            )
        device, dtype = self._float_weight().device, self._kv_dtype()  # under autocast, what K/V come out in
        storage = dtype if kv_dtype is None else kv_storage_dtype(kv_dtype)
        if self.arch.latent is not None:
            if storage != dtype:
                raise ValueError(
                    f"kv_dtype={kv_dtype!r} with latent attention: the MLA cache holds the compute dtype {dtype}; "
                    f"leave kv_dtype unset for this model."
                )
            d = self.arch.latent
            return nn.ModuleList(
                MLACache(batch_size, max_len, d.kv_lora_rank, d.qk_rope_head_dim, dtype=dtype, device=device)
                for _ in self.blocks
            )
        caches = nn.ModuleList(
            KVCache(
                batch_size,
                max_len,
                cast(
                    MultiHeadAttention, cast(Block, block).attn
                ).num_kv_heads,  # per block: a swapped-in one may differ
                cast(MultiHeadAttention, cast(Block, block).attn).head_dim,
                dtype=storage,
                compute_dtype=dtype,
                device=device,
            )
            for block in self.blocks
        )
        share_read_scratch(caches)  # a compact cache's reads in the compute dtype: one buffer for every layer
        return caches

    def _float_weight(self) -> Tensor:
        """The final norm's weight: a float parameter in every model, quantized ones included."""
        return cast(Tensor, self.final_norm.weight)

    def _kv_dtype(self) -> torch.dtype:
        """The dtype of the keys and values this model computes now: its own, or under ``torch.autocast``
        the autocast dtype, which the K/V projections return (autocast casts every floating weight but
        float64). The KV cache must hold it, and RoPE's cos/sin must not promote K back to float32."""
        weight = self._float_weight()
        if weight.dtype != torch.float64 and torch.is_autocast_enabled(weight.device.type):
            return torch.get_autocast_dtype(weight.device.type)
        return weight.dtype

    # -- forward -------------------------------------------------------------------------------

    def _check_idx(self, idx: Tensor, positions: Tensor | None) -> None:
        if not isinstance(idx, Tensor) or idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 2:
            raise TypeError(
                f"idx must be an int64 tensor of token ids with shape (B, T), got "
                f"{getattr(idx, 'dtype', type(idx).__name__)} of shape {tuple(getattr(idx, 'shape', ()))}; "
                f"add a batch dimension with idx.unsqueeze(0) or cast with idx.long()."
            )
        T = idx.size(1)
        limit = self.arch.block_size
        # A learned table has block_size rows; RoPE computes any position (untrained past block_size).
        table = self.arch.position == "learned"
        if table and positions is None and T > limit:
            raise ValueError(
                f"idx has T={T} tokens but block_size={limit}; crop it to its last {limit} tokens (idx[:, -{limit}:])."
            )
        if positions is not None and positions.shape[-1] != T:
            raise ValueError(
                f"positions has shape {tuple(positions.shape)}; expected (T,) or (B, T) with T={T}, one position per token."
            )
        # Free on CPU; on a GPU it would be a device sync per call, so generate() checks the prompt once instead.
        if idx.device.type == "cpu":
            check_token_ids(idx, self.arch.vocab_size)
        if table and positions is not None and positions.device.type == "cpu" and positions.numel():
            hi = int(positions.max())
            if hi >= limit or int(positions.min()) < 0:
                raise ValueError(
                    f"positions reach {hi} but block_size={limit} allows 0 .. {limit - 1}; shorten the sequence."
                )

    def forward(
        self,
        idx: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        caches: nn.ModuleList | None = None,
        cache_positions: Tensor | None = None,
        only_last: bool = False,
        document_ids: Tensor | None = None,
        context_parallel: ContextParallelAttention | None = None,
    ) -> Tensor:
        """Logits of the next token at every position.

        Args:
            idx: ``(B, T)`` int64 token ids in ``0 .. vocab_size - 1`` (checked here for CPU tensors,
                by :func:`attnlab.generate` for its prompt on any device).
            key_padding_mask: ``(B, T_k)`` bool, True = padding, over the keys attended: the
                ``T`` tokens of this call without a cache, the ``max_len`` cache slots with one.
            positions: ``(T,)`` or ``(B, T)`` int64 position of each token (per row under left
                padding). Default: ``cache_positions`` if given, else ``0 .. T-1``. A learned
                table refuses positions past ``block_size``; RoPE computes them (untrained there).
            caches: from :meth:`setup_caches`; with ``cache_positions`` ``(T,)`` (the slots this
                call writes) attention runs over the cache in position mode (fixed shapes).
            only_last: return the logits of the last position only, ``(B, 1, V)``: generation
                needs no others, and the output projection is the largest matmul of a step.
            document_ids: ``(B, T)`` ids of packed sequences (no cache): attention never crosses a
                document boundary and positions restart at 0 in each document
                (:func:`attnlab.core.variants.document_positions`), so a packed row gives each
                document the logits it gets alone.
            context_parallel: an :class:`attnlab.distributed.ContextParallel`: ``idx`` (and
                ``key_padding_mask``, ``document_ids``) are this rank's ``cp.shard`` of one long
                sequence; positions come from the layout, attention runs across the ranks, and the
                logits are this rank's positions' (``cp.gather`` them, or take the loss on the shard).

        Returns:
            ``(B, T, V)`` logits (``(B, 1, V)`` with ``only_last``).
        """
        fast = self._fused_decode_inputs()
        if (
            fast is not None
            and caches is not None
            and cache_positions is not None
            and idx.size(1) == 1
            and context_parallel is None
            and document_ids is None
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            return self._fused_decode(fast, idx, positions, key_padding_mask, caches, cache_positions)
        arch = self.arch
        if arch.latent is not None and (context_parallel is not None or document_ids is not None):
            given = "context_parallel" if context_parallel is not None else "document_ids"
            raise ValueError(
                f"{given} is not supported with attention='mla' (multi-head latent attention) yet: it runs "
                f"attnlab's MultiHeadAttention's ring and document masks; call the model without {given}."
            )
        if context_parallel is not None:
            table_rows = arch.block_size if arch.position == "learned" else None
            positions = context_parallel_positions(
                context_parallel, idx, positions, caches, cache_positions, document_ids, table_rows
            )
        if not torch.compiler.is_compiling():
            self._check_idx(idx, positions)
        if document_ids is not None and context_parallel is None:
            if caches is not None or positions is not None:
                raise ValueError(
                    "document_ids packs whole sequences and sets their positions itself; pass it without caches and positions."
                )
            check_document_ids(document_ids, idx.size(0), idx.size(1), idx.size(1), None)
            positions = document_positions(document_ids)  # (B, T), restarting in each document
        if caches is not None and len(caches) != arch.n_layer:
            raise ValueError(
                f"caches has {len(caches)} entries; expected one per layer, {arch.n_layer} (use model.setup_caches)."
            )
        positions, cache_positions = decoder_positions(self._float_weight().device, positions, cache_positions, caches)
        if positions is None:
            positions = cache_positions if cache_positions is not None else torch.arange(idx.size(1), device=idx.device)

        x = self.token_embedding(idx)  # (B, T, E)
        rope = None
        if arch.position == "learned":
            assert arch.names.positions is not None
            x = x + self.get_submodule(arch.names.positions)(positions)  # (B, T, E) + (T, E) or (B, T, E)
        else:
            rope = rope_cos_sin(positions, arch.rope_dim, base=arch.rope_base, dtype=self._kv_dtype())  # (..., T, D)
        if arch.names.embed_dropout is not None:
            x = self.get_submodule(arch.names.embed_dropout)(x)
        B, T = idx.shape
        masks = None
        if context_parallel is None:
            masks = decoder_masks(  # once per call, shared by every layer
                key_padding_mask,
                batch=B,
                heads=arch.n_head,
                q_len=T,
                cache=None if caches is None else cast(KVCache, caches[0]),
                cache_positions=cache_positions,
                dtype=x.dtype,
                device=x.device,
            )
        trim = not torch.compiler.is_compiling() and x.device.type == "cpu" and trims_each_layer()
        for i, block in enumerate(self.blocks):
            x = block(
                x,
                masks,
                rope=rope,
                kv_cache=None if caches is None else caches[i],
                cache_positions=cache_positions,
                document_ids=document_ids,
                context_parallel=context_parallel,
                key_padding_mask=key_padding_mask,
            )  # (B, T, E)
            if trim:  # a long prompt's last prefill calls (attnlab.runtime.heap_trimmed_each_layer)
                release_freed_heap()
        if only_last:
            x = x[:, -1:]  # (B, 1, E)
        return self._logits(self.final_norm(x))  # (B, T, E) @ (E, V) -> (B, T, V)

    def _logits(self, x: Tensor) -> Tensor:
        """``(B, T, E)`` -> ``(B, T, V)``: the output head, tied or its own, float or quantized."""
        head = self.output_module
        if isinstance(head, QuantEmbedding):
            return head.logits(x)
        if isinstance(head, QuantLinear):
            return head(x)
        return F.linear(x, cast(Tensor, head.weight))  # (B, T, E) @ (E, V)

    def fuse_projections(self) -> list[str]:
        """Give every block a fused view of the matmuls that read one input, for inference: Q|K|V in attention,
        gate|up in a SwiGLU MLP (:class:`~attnlab.core.fused.FusedLinearView`); refresh the views already there.

        The projections stay separate modules (LoRA and PEFT find them, the state dict is unchanged); a view
        holds a copy of their weights, used only under ``torch.no_grad()``. A compiled decode step then runs 4
        weight GEMMs a block instead of 6 (GPT-2) or 7 (Llama). Costs the memory of the copied weights.
        :func:`attnlab.generate` calls this before compiled decoding.

        Returns:
            One line per block part left unfused, and why (a LoRA wrapper, a quantized layer, a hook...).
        """
        skipped: list[str] = []
        for i, block in enumerate(cast(list[Block], list(self.blocks))):
            attn, mlp = block.attn, block.mlp
            groups: list[tuple[nn.Module, str, list[nn.Module]]] = []
            if isinstance(attn, MultiHeadAttention):
                groups.append((attn, "qkv_proj", [attn.q_proj, attn.k_proj, attn.v_proj]))
            if isinstance(mlp, SwiGLUMLP):
                groups.append((mlp, "gate_up_proj", [mlp.gate_proj, mlp.up_proj]))
            for owner, slot, parts in groups:
                current = getattr(owner, slot)
                if isinstance(current, FusedLinearView) and list(current.parts) == parts:
                    current.refresh()
                    continue
                if current is not None and not isinstance(current, FusedLinearView):
                    continue  # fused already another way (fuse_quantized's shared blocks)
                why = fusable(parts)
                if why is None:
                    setattr(owner, slot, FusedLinearView(cast(list[nn.Linear], parts)))
                else:
                    setattr(owner, slot, None)
                    skipped.append(f"{self.arch.names.blocks}.{i}: {slot} not fused, {why}")
        return skipped

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """See :func:`attnlab.generate`; returns ``(B, T + new)`` ids, prompt first."""
        return generate(self, idx, max_new_tokens, **kwargs)

    # -- the fused GGUF decode step ------------------------------------------------------------

    @property
    def has_fused_decode(self) -> bool:
        """Whether a decode step (one token per row, KV cache) runs as one C++ call (``dtype="gguf"`` on a CPU with
        AVX-512 VNNI); :func:`attnlab.generate` then has nothing to compile."""
        return self._fused_decode_inputs() is not None

    def _fused_decode_inputs(self) -> tuple[list[Tensor], list[int], list[int]] | None:
        """``(weights, kinds, dims)`` for ``attnlab_quant::llama_decode`` when the model is Llama-shaped (RMSNorm,
        SwiGLU, RoPE, no biases, no dropout) and every block's Q|K|V, out, gate|up and down are tiled
        :class:`~attnlab.quant.QuantLinear` s, as are the head and embedding; else None (the Python forward runs).
        Built once, kept until the model changes (``_fused_cache``)."""
        cached = self.__dict__.get("_fused_cache")
        if cached is not None:
            return cached[0]
        a = self.arch
        result: tuple[list[Tensor], list[int], list[int]] | None = None
        llama_shaped = (
            a.attention == "mha"
            and a.norm == "rmsnorm"
            and a.mlp == "swiglu"
            and a.position == "rotary"
            and not a.attention_bias
            and not a.mlp_bias
            and a.dropout == 0.0
        )
        if llama_shaped and _tiled(self.token_embedding) and _tiled(self.output_module):
            weights: list[Tensor] = []
            kinds: list[int] = []
            for block in cast(list[Block], list(self.blocks)):
                attn, mlp = cast(MultiHeadAttention, block.attn), cast(SwiGLUMLP, block.mlp)
                parts = [attn.qkv_proj, attn.out_proj, mlp.gate_up_proj, mlp.down_proj]
                plain = attn.qk_norm is None and not attn.has_variants and attn.num_heads % attn.num_kv_heads == 0
                if not (plain and all(_tiled(m) for m in parts)):
                    break
                qkv, out, gate_up, down = cast(list[QuantLinear], parts)
                weights += [
                    cast(Tensor, block.attn_norm_module.weight),
                    qkv.blocks,
                    out.blocks,
                    cast(Tensor, block.mlp_norm_module.weight),
                    gate_up.blocks,
                    down.blocks,
                ]
                kinds += [qkv.fmt.ggml_type, out.fmt.ggml_type, gate_up.fmt.ggml_type, down.fmt.ggml_type]
            else:
                embed = cast(QuantEmbedding, self.token_embedding)
                head = cast(QuantLinear | QuantEmbedding, self.output_module)
                weights += [self._float_weight(), head.blocks, embed.blocks]
                kinds += [head.fmt.ggml_type, embed.fmt.ggml_type]
                assert a.n_kv_head is not None
                dims = [a.n_layer, a.n_head, a.n_kv_head, a.head_dim, a.n_embd, a.mlp_hidden, a.vocab_size]
                result = (weights, kinds, dims)
        self.__dict__["_fused_cache"] = (result,)
        return result

    def _fused_decode(
        self,
        fast: tuple[list[Tensor], list[int], list[int]],
        idx: Tensor,
        positions: Tensor | None,
        key_padding_mask: Tensor | None,
        caches: nn.ModuleList,
        cache_positions: Tensor,
    ) -> Tensor:
        """One decode step in C++ (see ``llama_decode`` in attnlab/quant/csrc/qmatmul.cpp); ``(B, 1, V)`` logits."""
        self._check_idx(idx, positions)
        B = idx.size(0)
        first = cast(KVCache, caches[0])
        cache_positions = cache_positions.to(first.k.device)  # the C++ step reads both in CPU memory
        positions = None if positions is None else positions.to(first.k.device)
        if positions is None:
            positions = cache_positions.expand(B, 1)
        pad = key_padding_mask if key_padding_mask is not None else idx.new_zeros(B, first.max_len, dtype=torch.bool)
        weights, kinds, dims = fast
        int8 = first.k_scale is not None  # the int8 cache's scales travel beside its rows
        logits = torch.ops.attnlab_quant.llama_decode(
            idx[:, 0],
            positions.reshape(B, -1)[:, -1],
            cache_positions.reshape(-1)[-1:],
            pad,
            [cast(KVCache, c).k for c in caches],
            [cast(KVCache, c).v for c in caches],
            weights,
            kinds,
            dims,
            self.arch.norm_eps,
            self.arch.rope_base,
            -1,
            [cast(KVCache, c).k_scale for c in caches] if int8 else None,
            [cast(KVCache, c).v_scale for c in caches] if int8 else None,
        )
        return logits[:, None]  # (B, 1, V)


def _tiled(m: object) -> bool:
    """A quantized layer in the tile layout without bias: what the fused C++ decode step reads."""
    return isinstance(m, (QuantLinear, QuantEmbedding)) and m.layout == "tiles" and getattr(m, "bias", None) is None


def fuse_quantized(model: Decoder) -> int:
    """Give every block whose projections are tiled :class:`~attnlab.quant.QuantLinear` s one fused Q|K|V and one
    fused gate|up matmul (their bytes shared, not copied); returns the blocks fused.

    A decode step then calls 4 quantized matmuls per block instead of 7: each call costs a fixed ~7 us
    of dispatch (measured on the CPU at hand), and a wider matrix splits better over the threads.
    Numbers do not change: each output row is the same dot product as before.
    """
    fused = 0
    for block in cast(list[Block], list(model.blocks)):
        attn, mlp = block.attn, block.mlp
        if not isinstance(mlp, SwiGLUMLP) or not isinstance(attn, MultiHeadAttention):
            continue
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        if all(isinstance(m, QuantLinear) and m.layout == "tiles" and m.bias is None for m in qkv + gate_up):
            attn.qkv_proj = fuse_rows(cast(list[QuantLinear], qkv))
            mlp.gate_up_proj = fuse_rows(cast(list[QuantLinear], gate_up))
            fused += 1
    model.__dict__.pop("_fused_cache", None)  # the fused decode's inputs are looked for again
    return fused
