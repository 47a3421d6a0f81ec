"""``Llama``: the Llama family's decoder-only language model, its attention being attnlab's.

Reads top-down: RMSNorm, MLP, block, model. Shapes: B batch, T tokens of this call, E = n_embd,
F = intermediate_size, V = vocab_size, H = n_head, G = n_kv_head, D = E // H. Token ids are
int64 ``(B, T)``.

Exactly Hugging Face's ``LlamaForCausalLM`` (SmolLM2, TinyLlama, Llama 2/3 without RoPE scaling):
token embedding with no position table, pre-RMSNorm blocks, grouped-query attention with rotary
embeddings on Q and K (theta ``rope_base``), SwiGLU MLP, final RMSNorm, output head tied to the
embedding or its own matrix. Differs from :class:`attnlab.TinyGPT` only where Llama differs
from GPT-2; attention, KV cache, masks and :func:`attnlab.generate` are the same code.

RoPE: attnlab's :func:`attnlab.core.rope.apply_rope` rotates channel pair ``(c, c + D/2)``, which
is Hugging Face's ``rotate_half`` (``cat(-x2, x1)``) with ``cos``/``sin`` = ``cat(freqs, freqs)``,
so HF Llama weights load as they are. GGUF files store Q/K rows in llama.cpp's interleaved
pair order; :func:`attnlab.models.weight_maps.unpermute_qk` puts them back into this order on load.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import ContextParallelAttention, MultiHeadAttention
from ..core.kv_cache import KVCache, decoder_positions
from ..core.masks import Masks, decoder_masks
from ..core.rope import rope_cos_sin
from ..quant.layers import QuantEmbedding, QuantLinear, fuse_rows
from .generation import check_token_ids, generate
from .gpt import _contiguous_weight
from .llama_config import LlamaConfig
from .parallel import context_parallel_positions

__all__ = ["LlamaConfig", "RMSNorm", "MLP", "Block", "Llama", "fuse_quantized"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, normalised in float32 as Hugging Face does.

    The normalised value is cast back to the input dtype *before* the weight multiplies it
    (HF's ``LlamaRMSNorm``), so that bf16 outputs round exactly as HF's do.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()  # (B, T, E)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # (B, T, E) / (B, T, 1)
        return self.weight * normed.to(x.dtype)  # (E,) * (B, T, E)

    def extra_repr(self) -> str:
        return f"{self.weight.size(0)}, eps={self.eps}"


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, E -> F -> E."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.mlp_bias)

        # Optional: one module computing [gate | up] in a single matmul (fuse_quantized), weights shared.
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, 2F) -> 2 x (B, T, F)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, E) -> (B, T, F) -> (B, T, E)


class Block(nn.Module):
    """Pre-RMSNorm block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)  # HF: input_layernorm
        self.attn = MultiHeadAttention(
            config.n_embd, config.n_head, num_kv_heads=config.n_kv_head, bias=config.attention_bias
        )
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)  # HF: post_attention_layernorm
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        masks: Masks | None,
        rope: tuple[Tensor, Tensor],
        *,
        kv_cache: KVCache | None = None,
        cache_positions: Tensor | None = None,
        context_parallel: ContextParallelAttention | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """``masks``: causal (+ padding), converted once per model call; ``rope``: ``(cos, sin)`` of this call's positions.
        With ``context_parallel``, ``masks`` is None and ``key_padding_mask`` is this rank's shard."""
        if context_parallel is not None:
            a = self.attn(
                self.attn_norm(x),
                is_causal=True,
                key_padding_mask=key_padding_mask,
                rope=rope,
                context_parallel=context_parallel,
            )  # (B, L, E): this rank's positions, attending over the whole sequence
        else:
            a = self.attn(
                self.attn_norm(x), attn_mask=masks, kv_cache=kv_cache, cache_positions=cache_positions, rope=rope
            )  # (B, T, E)
        x = x + a
        return x + self.mlp(self.mlp_norm(x))  # (B, T, E)


class Llama(nn.Module):
    """A Llama-family decoder with attnlab attention; ``model(idx)`` returns logits ``(B, T, V)``.

    Build one from real weights with :func:`attnlab.weight_files.pretrained.from_pretrained` (a GGUF
    file, a Hugging Face directory); ``Llama(config)`` alone is randomly initialised.

    Args:
        config: a :class:`LlamaConfig`, kept whole as ``model.config``.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)  # (V, E)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        # Tied: the output head is embed.weight itself (F.linear in forward), one state_dict key.
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # The output matrix is (V, E) as in Hugging Face but stored column-major, an (E, V) tensor
        # seen transposed, as TinyGPT's: the (B, 1, E) @ (E, V) of a decode step, the largest matmul
        # of the step, ran 1.2-2x faster that way with MKL on this CPU (SmolLM2, V=49152, E=576,
        # 2 threads, fp32: 8-12 ms vs 15-24 ms at batch 1, 32-36 ms vs 43 ms at batch 8; in bf16
        # it measured 1.0-1.24x slower, a smaller loss on half the bytes). The projections measured
        # no consistent winner (noise above the difference) and stay row-major.
        # state_dict() hands out a row-major copy (gpt._contiguous_weight); copy_, .to() and
        # to_empty keep this layout.
        head = self.embed if self.lm_head is None else self.lm_head
        head.weight = nn.Parameter(torch.empty(config.n_embd, config.vocab_size).t())  # (V, E) view
        head.register_state_dict_post_hook(_contiguous_weight)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Hugging Face Llama's init: N(0, 0.02) weights, zero biases, unit RMSNorm weights."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, mean=0.0, std=0.02)
                    bias = getattr(module, "bias", None)  # nn.Embedding has none
                    if bias is not None:
                        nn.init.zeros_(bias)
                elif isinstance(module, RMSNorm):
                    nn.init.ones_(module.weight)

    def num_params(self) -> int:
        """Weights, counting a tied embedding once, and the weights of quantized layers (``dtype="gguf"``) too."""
        quantized = sum(m.rows * m.in_features for m in self._quantized_layers())
        return sum(p.numel() for p in self.parameters()) + quantized

    def _quantized_layers(self) -> list[QuantLinear | QuantEmbedding]:
        """The layers holding GGUF blocks, each once (a fused Q|K|V shares its layers' bytes and is left out)."""
        return [m for m in self.modules() if isinstance(m, (QuantLinear, QuantEmbedding)) and not m.is_fusion]

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
        head = self.embed if self.lm_head is None else self.lm_head
        if isinstance(head, (QuantEmbedding, QuantLinear)):
            return head.dequantize()
        return head.weight

    def _logits(self, x: Tensor) -> Tensor:
        """``(B, T, E)`` -> ``(B, T, V)``: the output head, tied or its own, float or quantized."""
        head = self.embed if self.lm_head is None else self.lm_head
        if isinstance(head, QuantEmbedding):
            return head.logits(x)
        if isinstance(head, QuantLinear):
            return head(x)
        return F.linear(x, head.weight)  # (B, T, E) @ (E, V)

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """KV-cache bytes one token costs per sequence, all layers: 2 (K, V) * n_layer * G * D * itemsize."""
        c = self.config
        return 2 * c.n_layer * c.n_kv_head * c.head_dim * self.norm.weight.element_size()

    def setup_caches(self, batch_size: int, max_len: int) -> nn.ModuleList:
        """One :class:`KVCache` per block, ``(B, G, max_len, D)`` each, on the model's device and dtype."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds block_size={self.config.block_size}, the longest sequence this model "
                f"was trained for; use max_len <= {self.config.block_size}."
            )
        c = self.config
        return nn.ModuleList(
            KVCache(
                batch_size, max_len, c.n_kv_head, c.head_dim, dtype=self._kv_dtype(), device=self.norm.weight.device
            )
            for _ in range(c.n_layer)
        )

    def _kv_dtype(self) -> torch.dtype:
        """The dtype K/V come out in: the model's own, or under ``torch.autocast`` the autocast dtype
        (see ``TinyGPT._kv_dtype``); the cache and RoPE's cos/sin must match it. Read from the final norm's
        weight, a float parameter in every model (quantized ones included)."""
        weight = self.norm.weight
        if weight.dtype != torch.float64 and torch.is_autocast_enabled(weight.device.type):
            return torch.get_autocast_dtype(weight.device.type)
        return weight.dtype

    def _check_idx(self, idx: Tensor, positions: Tensor | None) -> None:
        if not isinstance(idx, Tensor) or idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 2:
            raise TypeError(
                f"idx must be an int64 tensor of token ids with shape (B, T), got "
                f"{getattr(idx, 'dtype', type(idx).__name__)} of shape {tuple(getattr(idx, 'shape', ()))}; "
                f"add a batch dimension with idx.unsqueeze(0) or cast with idx.long()."
            )
        if positions is not None and positions.shape[-1] != idx.size(1):
            raise ValueError(
                f"positions has shape {tuple(positions.shape)}; expected (T,) or (B, T) with T={idx.size(1)}, one position per token."
            )
        if idx.device.type == "cpu":  # free on CPU; generate() checks the prompt once on any device
            check_token_ids(idx, self.config.vocab_size)

    def forward(
        self,
        idx: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        positions: Tensor | None = None,
        caches: nn.ModuleList | None = None,
        cache_positions: Tensor | None = None,
        only_last: bool = False,
        context_parallel: ContextParallelAttention | None = None,
    ) -> Tensor:
        """Logits of the next token at every position.

        Args:
            idx: ``(B, T)`` int64 token ids in ``0 .. vocab_size - 1``.
            key_padding_mask: ``(B, T_k)`` bool, True = padding, over the keys attended: the
                ``T`` tokens of this call without a cache, the ``max_len`` cache slots with one.
            positions: ``(T,)`` or ``(B, T)`` int64 position of each token (per row under left
                padding). Default: ``cache_positions`` if given, else ``0 .. T-1``. RoPE has no
                table, so positions past ``block_size`` compute; the model was not trained there.
            caches: from :meth:`setup_caches`; with ``cache_positions`` ``(T,)`` (the slots this
                call writes) attention runs over the cache in position mode (fixed shapes).
            only_last: the logits of the last position only, ``(B, 1, V)``: generation needs no
                others, and the output projection is the largest matmul of a step.
            context_parallel: an :class:`attnlab.distributed.ContextParallel`: ``idx`` and
                ``key_padding_mask`` are this rank's ``cp.shard`` of one long sequence; RoPE gets each
                token's true position from the layout, and attention runs across the ranks.

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
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):
            return self._fused_decode(fast, idx, positions, key_padding_mask, caches, cache_positions)
        if context_parallel is not None:
            positions = context_parallel_positions(
                context_parallel, idx, positions, caches, cache_positions, None, None
            )
        if not torch.compiler.is_compiling():
            self._check_idx(idx, positions)
        if caches is not None and len(caches) != self.config.n_layer:
            raise ValueError(
                f"caches has {len(caches)} entries; expected one per layer, {self.config.n_layer} (use model.setup_caches)."
            )
        positions, cache_positions = decoder_positions(self.norm.weight.device, positions, cache_positions, caches)
        if positions is None:
            positions = cache_positions if cache_positions is not None else torch.arange(idx.size(1), device=idx.device)

        x = self.embed(idx)  # (B, T, E)
        rope = rope_cos_sin(
            positions, self.config.head_dim, base=self.config.rope_base, dtype=self._kv_dtype()
        )  # (..., T, D) each
        B, T = idx.shape
        masks = None
        if context_parallel is None:
            masks = decoder_masks(  # once per call, shared by every layer
                key_padding_mask,
                batch=B,
                heads=self.config.n_head,
                q_len=T,
                cache=None if caches is None else cast(KVCache, caches[0]),
                cache_positions=cache_positions,
                dtype=x.dtype,
                device=x.device,
            )
        for i, block in enumerate(self.layers):
            x = block(
                x,
                masks,
                rope,
                kv_cache=None if caches is None else caches[i],
                cache_positions=cache_positions,
                context_parallel=context_parallel,
                key_padding_mask=key_padding_mask,
            )  # (B, T, E)
        if only_last:
            x = x[:, -1:]  # (B, 1, E)
        x = self.norm(x)
        return self._logits(x)  # (B, T, E) @ (E, V) -> (B, T, V)

    @property
    def has_fused_decode(self) -> bool:
        """Whether a decode step (one token per row, KV cache) runs as one C++ call (``dtype="gguf"`` on a CPU with
        AVX-512 VNNI); :func:`attnlab.generate` then has nothing to compile."""
        return self._fused_decode_inputs() is not None

    def _fused_decode_inputs(self) -> tuple[list[Tensor], list[int], list[int]] | None:
        """``(weights, kinds, dims)`` for ``attnlab_quant::llama_decode`` when every block's Q|K|V, out, gate|up and
        down are tiled :class:`~attnlab.quant.QuantLinear` s without bias and the head and embedding are tiled;
        else None (the Python forward runs). Built once, kept until the model changes (``_fused_cache``)."""
        cached = self.__dict__.get("_fused_cache")
        if cached is not None:
            return cached[0]
        weights: list[Tensor] = []
        kinds: list[int] = []
        result: tuple[list[Tensor], list[int], list[int]] | None = None

        def tiled(m: object) -> bool:
            return (
                isinstance(m, (QuantLinear, QuantEmbedding))
                and m.layout == "tiles"
                and getattr(m, "bias", None) is None
            )

        head = self.embed if self.lm_head is None else self.lm_head
        ok = tiled(self.embed) and tiled(head) and not self.config.attention_bias and not self.config.mlp_bias
        for block in cast(list[Block], list(self.layers)):
            if not ok:
                break
            attn, mlp = block.attn, block.mlp
            parts = [attn.qkv_proj, attn.out_proj, mlp.gate_up_proj, mlp.down_proj]
            plain = attn.qk_norm is None and not attn.has_variants and attn.num_heads % attn.num_kv_heads == 0
            if not (plain and all(tiled(m) for m in parts)):
                ok = False
                break
            qkv, out, gate_up, down = cast(list[QuantLinear], parts)
            weights += [
                block.attn_norm.weight,
                qkv.blocks,
                out.blocks,
                block.mlp_norm.weight,
                gate_up.blocks,
                down.blocks,
            ]
            kinds += [qkv.fmt.ggml_type, out.fmt.ggml_type, gate_up.fmt.ggml_type, down.fmt.ggml_type]
        if ok:
            embed, head_q = cast(QuantEmbedding, self.embed), cast(QuantLinear | QuantEmbedding, head)
            weights += [self.norm.weight, head_q.blocks, embed.blocks]
            kinds += [head_q.fmt.ggml_type, embed.fmt.ggml_type]
            c = self.config
            dims = [c.n_layer, c.n_head, c.n_kv_head, c.head_dim, c.n_embd, c.intermediate_size, c.vocab_size]
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
            self.config.norm_eps,
            self.config.rope_base,
        )
        return logits[:, None]  # (B, 1, V)

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """See :func:`attnlab.generate`; returns ``(B, T + new)`` ids, prompt first."""
        return generate(self, idx, max_new_tokens, **kwargs)


def fuse_quantized(model: Llama) -> int:
    """Give every block whose projections are tiled :class:`~attnlab.quant.QuantLinear` s one fused Q|K|V and one
    fused gate|up matmul (their bytes shared, not copied); returns the blocks fused.

    A decode step then calls 4 quantized matmuls per block instead of 7: each call costs a fixed ~7 us
    of dispatch (measured on the CPU at hand), and a wider matrix splits better over the threads.
    Numbers do not change: each output row is the same dot product as before.
    """
    fused = 0
    for block in cast(list[Block], list(model.layers)):
        attn, mlp = block.attn, block.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        if all(isinstance(m, QuantLinear) and m.layout == "tiles" and m.bias is None for m in qkv + gate_up):
            attn.qkv_proj = fuse_rows(cast(list[QuantLinear], qkv))
            mlp.gate_up_proj = fuse_rows(cast(list[QuantLinear], gate_up))
            fused += 1
    model.__dict__.pop("_fused_cache", None)  # the fused decode's inputs are looked for again
    return fused
