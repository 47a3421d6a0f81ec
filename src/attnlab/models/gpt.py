"""``TinyGPT``: GPT-2's decoder-only language model, its attention being attnlab's.

Reads top-down: config, MLP, block, model. Shapes: B batch, T tokens of this call, E = n_embd,
V = vocab_size, H = n_head, G = n_kv_head, D = E // H. Token ids are int64 ``(B, T)``.

Exactly GPT-2 (token + learned position embeddings, pre-LayerNorm blocks, tanh-GELU MLP of
width 4E, final LayerNorm, output embedding tied to the token embedding), with two options
GPT-2 lacks: ``n_kv_head < n_head`` (grouped-query attention, a smaller KV cache) and
``position="rotary"`` (RoPE on Q and K instead of the ``wpe`` table).
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.attention import ContextParallelAttention, MultiHeadAttention
from ..core.kv_cache import KVCache, decoder_positions
from ..core.masks import Masks, decoder_masks
from ..core.rope import rope_cos_sin
from ..core.validation import check_document_ids
from ..core.variants import document_positions
from .config import GPTConfig
from .generation import check_token_ids, generate
from .parallel import context_parallel_positions
from .weight_maps import gpt2_weights_from_hf

__all__ = ["GPTConfig", "MLP", "Block", "TinyGPT"]


class MLP(nn.Module):
    """GPT-2's feed-forward: E -> 4E, tanh-approximated GELU (GPT-2's ``gelu_new``), 4E -> E."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, E) -> (B, T, 4E) -> (B, T, E)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.attn = MultiHeadAttention(
            config.n_embd, config.n_head, num_kv_heads=config.n_kv_head, dropout=config.dropout, bias=config.bias
        )
        self.resid_dropout = nn.Dropout(config.dropout)  # GPT-2's dropout after the attention's c_proj
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        masks: Masks | None,
        *,
        kv_cache: KVCache | None = None,
        cache_positions: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        document_ids: Tensor | None = None,
        context_parallel: ContextParallelAttention | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """``masks``: causal (+ padding) masks, converted once per model call by :class:`TinyGPT`; None
        with ``context_parallel``, where ``key_padding_mask`` is this rank's shard and causality is the ring's."""
        # document_ids only when packing: a swapped-in attention module need not know the argument
        extra: dict[str, Any] = {} if document_ids is None else {"document_ids": document_ids}
        if context_parallel is not None:
            extra.update(context_parallel=context_parallel, key_padding_mask=key_padding_mask, is_causal=True)
        a = self.attn(
            self.ln_1(x),
            attn_mask=masks,
            kv_cache=kv_cache,
            cache_positions=cache_positions,
            rope=rope,
            **extra,
        )  # (B, T, E)
        x = x + self.resid_dropout(a)
        return x + self.mlp(self.ln_2(x))  # (B, T, E)


def _contiguous_weight(module: nn.Module, state_dict: dict[str, Tensor], prefix: str, local_metadata: object) -> None:
    """State-dict hook of ``wte``: its column-major weight leaves as a contiguous ``(V, E)`` copy.

    A copy of V x E values per ``state_dict()`` call (what saving does anyway), in exchange for a
    state dict that ``safetensors.torch.save_file`` accepts as it is. With ``keep_vars=True`` the
    caller asked for the parameter itself, so it is left alone.
    """
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is not None and not isinstance(value, nn.Parameter) and not value.is_contiguous():
        state_dict[key] = value.contiguous()


class TinyGPT(nn.Module):
    """GPT-2 with attnlab attention; ``model(idx)`` returns logits ``(B, T, V)``.

    Args:
        config: a :class:`GPTConfig`, kept whole as ``model.config``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, eps=1e-5, bias=config.bias),
            )
        )
        if config.position == "learned":
            self.transformer["wpe"] = nn.Embedding(config.block_size, config.n_embd)
        # The output embedding is wte itself (F.linear in forward), not a second nn.Linear
        # sharing its storage: one state_dict key, so safetensors can save it as is.
        # wte.weight is (V, E) as in GPT-2 but stored column-major, an (E, V) tensor seen
        # transposed: decoding multiplies one row x (1, E) by weight.T, and MKL's kernel for a
        # contiguous (E, V) right operand is ~3x faster than for a transposed one (measured on
        # AMD EPYC, V=50257, E=256: 2.2 ms vs 6.9 ms), the largest matmul of a decode step.
        # Lookups, load_state_dict (copy_), .to() and optimizers all keep this layout; state_dict()
        # hands out a row-major copy (see _contiguous_weight), so that safetensors.save_file and
        # every other consumer of a state dict get an ordinary (V, E) tensor.
        wte = cast(nn.Embedding, self.transformer.wte)
        wte.weight = nn.Parameter(torch.empty(config.n_embd, config.vocab_size).t())  # (V, E) view
        wte.register_state_dict_post_hook(_contiguous_weight)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's init: N(0, 0.02) weights, zero biases, residual projections N(0, 0.02 / sqrt(2 n_layer))."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)  # two residual branches per block
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    is_residual = name.endswith(("attn.out_proj", "mlp.c_proj"))
                    nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else 0.02)
                    bias = getattr(module, "bias", None)  # nn.Embedding has none
                    if bias is not None:
                        nn.init.zeros_(bias)
                elif isinstance(module, nn.LayerNorm):
                    nn.init.ones_(module.weight)
                    if module.bias is not None:
                        nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """Parameters, counting the tied embedding once."""
        return sum(p.numel() for p in self.parameters())

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """KV-cache bytes one token costs per sequence, all layers: 2 (K, V) * n_layer * G * D * itemsize."""
        c = self.config
        assert c.n_kv_head is not None  # GPTConfig.__post_init__ fills it
        itemsize = cast(nn.Embedding, self.transformer.wte).weight.element_size()
        return 2 * c.n_layer * c.n_kv_head * c.head_dim * itemsize

    def setup_caches(self, batch_size: int, max_len: int) -> nn.ModuleList:
        """One :class:`KVCache` per block, ``(B, G, max_len, D)`` each, on the model's device and dtype."""
        if max_len > self.config.block_size:
            raise ValueError(
                f"max_len={max_len} exceeds block_size={self.config.block_size}: the model has no position "
                f"beyond {self.config.block_size - 1}; use max_len <= {self.config.block_size}."
            )
        weight = cast(nn.Embedding, self.transformer.wte).weight
        return nn.ModuleList(
            KVCache(
                batch_size,
                max_len,
                cast(Block, block).attn.num_kv_heads,
                cast(Block, block).attn.head_dim,
                dtype=self._kv_dtype(),  # under torch.autocast: the autocast dtype, what K/V come out in
                device=weight.device,
            )
            for block in cast(nn.ModuleList, self.transformer.h)
        )

    def _kv_dtype(self) -> torch.dtype:
        """The dtype of the keys and values this model computes now: its own, or under ``torch.autocast``
        the autocast dtype, which the K/V projections return (autocast casts every floating weight but
        float64). The KV cache must hold it, and RoPE's cos/sin must not promote K back to float32."""
        weight = cast(nn.Embedding, self.transformer.wte).weight
        device_type = weight.device.type
        if weight.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return weight.dtype

    def _check_idx(self, idx: Tensor, positions: Tensor | None) -> None:
        if not isinstance(idx, Tensor) or idx.dtype not in (torch.int64, torch.int32) or idx.dim() != 2:
            raise TypeError(
                f"idx must be an int64 tensor of token ids with shape (B, T), got "
                f"{getattr(idx, 'dtype', type(idx).__name__)} of shape {tuple(getattr(idx, 'shape', ()))}; "
                f"add a batch dimension with idx.unsqueeze(0) or cast with idx.long()."
            )
        T = idx.size(1)
        if positions is None and T > self.config.block_size:
            raise ValueError(
                f"idx has T={T} tokens but block_size={self.config.block_size}; crop it to its last "
                f"{self.config.block_size} tokens (idx[:, -{self.config.block_size}:])."
            )
        if positions is not None and positions.shape[-1] != T:
            raise ValueError(
                f"positions has shape {tuple(positions.shape)}; expected (T,) or (B, T) with T={T}, one position per token."
            )
        # Free on CPU; on a GPU it would be a device sync per call, so generate() checks the prompt once instead.
        if idx.device.type == "cpu":
            check_token_ids(idx, self.config.vocab_size)
        if positions is not None and positions.device.type == "cpu" and positions.numel():
            hi = int(positions.max())  # free on CPU; skipped on GPU to avoid a device sync per step
            if hi >= self.config.block_size or int(positions.min()) < 0:
                raise ValueError(
                    f"positions reach {hi} but block_size={self.config.block_size} allows 0 .. "
                    f"{self.config.block_size - 1}; shorten the sequence."
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
                padding). Default: ``cache_positions`` if given, else ``0 .. T-1``.
            caches: from :meth:`setup_caches`; with ``cache_positions`` ``(T,)`` (the slots this
                call writes) attention runs over the cache in position mode (fixed shapes).
            document_ids: ``(B, T)`` ids of packed sequences (no cache): attention never crosses a
                document boundary and positions restart at 0 in each document
                (:func:`attnlab.core.variants.document_positions`), so a packed row gives each
                document the logits it gets alone.
            only_last: return the logits of the last position only, ``(B, 1, V)``: generation
                needs no others, and the output projection is the largest matmul of a step.
            context_parallel: an :class:`attnlab.distributed.ContextParallel`: ``idx`` (and
                ``key_padding_mask``, ``document_ids``) are this rank's ``cp.shard`` of one long
                sequence; positions come from the layout, attention runs across the ranks, and the
                logits are this rank's positions' (``cp.gather`` them, or take the loss on the shard).

        Returns:
            ``(B, T, V)`` logits (``(B, 1, V)`` with ``only_last``).
        """
        if context_parallel is not None:
            positions = context_parallel_positions(
                context_parallel, idx, positions, caches, cache_positions, document_ids, self.config.block_size
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
        if caches is not None and len(caches) != self.config.n_layer:
            raise ValueError(
                f"caches has {len(caches)} entries; expected one per layer, {self.config.n_layer} (use model.setup_caches)."
            )
        wte = cast(nn.Embedding, self.transformer.wte)
        positions, cache_positions = decoder_positions(wte.weight.device, positions, cache_positions, caches)
        if positions is None:
            positions = cache_positions if cache_positions is not None else torch.arange(idx.size(1), device=idx.device)

        x = wte(idx)  # (B, T, E)
        rope = None
        if self.config.position == "learned":
            x = x + cast(nn.Embedding, self.transformer.wpe)(positions)  # (B, T, E) + (T, E) or (B, T, E)
        else:
            rope = rope_cos_sin(
                positions, self.config.head_dim, base=self.config.rope_base, dtype=self._kv_dtype()
            )  # (..., T, D) each
        x = cast(nn.Dropout, self.transformer.drop)(x)
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
        for i, block in enumerate(cast(nn.ModuleList, self.transformer.h)):
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
        if only_last:
            x = x[:, -1:]  # (B, 1, E)
        x = cast(nn.LayerNorm, self.transformer.ln_f)(x)
        return F.linear(x, wte.weight)  # (B, T, E) @ (E, V) -> (B, T, V): tied output embedding

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """See :func:`attnlab.generate`; returns ``(B, T + new)`` ids, prompt first."""
        return generate(self, idx, max_new_tokens, **kwargs)

    @classmethod
    def from_hf_gpt2(cls, model_or_state_dict, *, n_head: int | None = None) -> TinyGPT:
        """A TinyGPT with the weights of a Hugging Face ``GPT2LMHeadModel`` (or its state dict).

        A state dict does not say how many heads it has: pass ``n_head`` with one.
        """
        config, state_dict = gpt2_weights_from_hf(model_or_state_dict, n_head=n_head)
        model = cls(config)
        missing = sorted(set(model.state_dict()) - set(state_dict))
        if missing:
            raise KeyError(
                f"the GPT-2 weights lack {missing[:4]}{' ...' if len(missing) > 4 else ''}; expected a complete GPT2LMHeadModel state dict."
            )
        model.load_state_dict(state_dict, strict=True)
        return model
