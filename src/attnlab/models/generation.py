"""Autoregressive generation for any :class:`CausalLM` (``attnlab.TinyGPT`` is one): prefill, decode steps, sampling (``attnlab.generate``).

Shapes: B batch, T prompt length (left-padded to the longest), S = T + max_new_tokens cache
slots, V vocabulary. Slot ``s`` of every row holds token ``s`` of the padded sequence; a row's
*position* (what ``wpe``/RoPE see) is its slot minus its padding, as Hugging Face derives
``position_ids = attention_mask.cumsum(-1) - 1``.

With the cache, both the prefill and each decode step run the KV cache in position mode
(:mod:`attnlab.core.kv_cache`): every step has the same shapes, so :func:`decode_step` compiles once
with ``torch.compile(fullgraph=True)``; the padding mask covers all ``S`` slots and never changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol, cast

import torch
from torch import Tensor, nn

from ..core.kv_cache import KVCache, RollingKVCache
from ..core.mla_cache import MLACache
from ..runtime import LimitError, UsageError, check_range, heap_trimmed_each_layer, release_freed_heap
from ..runtime.threads import ThreadChooser, Threads, check_threads, free_cpus, resolve_threads

__all__ = [
    "CausalLM",
    "MIN_TEMPERATURE",
    "check_count",
    "check_temperature",
    "check_token_ids",
    "readable_int",
    "left_pad",
    "PREFILL_CHUNK",
    "PREFILL_FIRST",
    "prefill",
    "decode_step",
    "sample_next",
    "generate_steps",
    "generate",
    "compiled_decode_step",
    "compiled_cache_len",
]


class _HasBlockSize(Protocol):
    @property
    def block_size(self) -> int: ...  # longest sequence the model has positions for


class CausalLM(Protocol):
    """What generation needs of a decoder: its config's ``block_size``, per-layer KV caches, and
    a forward over token ids at explicit positions. ``TinyGPT`` satisfies it; so can any model
    written the same way, without this module importing it."""

    @property
    def config(self) -> _HasBlockSize: ...

    def setup_caches(self, batch_size: int, max_len: int) -> nn.ModuleList: ...

    def __call__(
        self,
        idx: Tensor,
        *,
        positions: Tensor | None = ...,
        key_padding_mask: Tensor | None = ...,
        caches: nn.ModuleList | None = ...,
        cache_positions: Tensor | None = ...,
        only_last: bool = ...,
    ) -> Tensor: ...


def check_token_ids(idx: Tensor, vocab_size: int, name: str = "idx") -> None:
    """Raise ``ValueError`` naming the first id of ``idx`` outside ``0 .. vocab_size - 1``, its place and the fix.

    Reads two numbers back from the tensor (a device sync on a GPU): call it once per prompt,
    not per decode step. An id out of range would otherwise be an ``IndexError`` from the
    embedding on a CPU and a device-side assert, fatal to the CUDA context, on a GPU.
    """
    if idx.numel() == 0:
        return
    lo, hi = (int(v) for v in idx.aminmax())  # 3-5 us on a (1, 1) CPU tensor, measured
    if lo >= 0 and hi < vocab_size:
        return
    where = tuple(int(i) for i in ((idx < 0) | (idx >= vocab_size)).nonzero()[0])  # the first one, (row, position)
    bad = int(idx[where])
    place = str(list(where))
    fix = (
        f"encode the text with the model's own tokenizer, or build the model with GPTConfig(vocab_size={bad + 1}) or more"
        if bad >= vocab_size
        else "token ids are >= 0; pad with a real id (attnlab.left_pad's pad_token_id=0) and flag it in key_padding_mask"
    )
    raise ValueError(
        f"{name} holds token id {bad} at {place}, outside the model's vocabulary of {vocab_size} ids "
        f"(0 .. {vocab_size - 1}); {fix}."
    )


def left_pad(prompts: Sequence[Sequence[int] | Tensor], pad_token_id: int = 0) -> tuple[Tensor, Tensor]:
    """Stack prompts of different lengths, padded on the left: ``(idx (B, T), key_padding_mask (B, T))``.

    Left, so that every row's last prompt token sits in the same column and all rows decode
    in lockstep; ``key_padding_mask`` is True on the padding.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(
            "prompts must be a non-empty list of non-empty token-id sequences; every row needs at least one token."
        )
    T = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T), pad_token_id, dtype=torch.long)  # (B, T)
    pad = torch.ones(len(prompts), T, dtype=torch.bool)  # (B, T)
    for b, p in enumerate(prompts):
        idx[b, T - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        pad[b, T - len(p) :] = False
    return idx, pad


def positions_from_padding(key_padding_mask: Tensor) -> Tensor:
    """``(B, T)`` position of each token: count of real tokens before it; padding gets 0 (as HF)."""
    real = (~key_padding_mask).long()  # (B, T)
    return (real.cumsum(-1) - 1).clamp(min=0)  # (B, T)


# Queries per prefill call (see :func:`prefill`, chunk="auto"), issue 51. A prompt without padding runs its first
# PREFILL_FIRST tokens in one call (SDPA's causal path, no mask: the least attention work), then PREFILL_CHUNK a call;
# a padded one runs PREFILL_CHUNK a call from the start, its masks B x 512 x T x 6 bytes (bool keep, bool opened,
# float32 bias), 96 MB at T = 8192 for each row, where one call would take 16x that.
# Why chunks: one call over T tokens holds about ten (T, n_embd) float32 activations at once (the residual, its norm,
# Q|K|V, Q and K after RoPE, the cache's keys and values read back in float32, the attention's context, its merged
# heads, the output projection), ~190 MB for SmolLM2 at 8192 tokens on top of its 189 MB float16 cache. A chunk of 512
# holds ~12 MB of them, plus its causal mask over the slots filled so far (512 x T bool, and the float32 copy SDPA
# makes of it in each layer: 21 MB at T = 8192). The first call may be larger: the cache's pages become resident as
# they are written, so at 2048 tokens the call's work memory and the filled cache together stay under the end's,
# provided the freed work memory goes back to the OS (malloc_trim after the first call; without it the peak at 8184
# tokens was 23 MB higher than with 512 a call throughout).
# Since the cache buffers come from lazy_zeros (attnlab.core.kv_cache), their pages do become resident only as written
# (torch.zeros had made the whole cache resident before the first token). Each chunk's freed work memory is trimmed
# after the call (malloc_trim: the chunks' sizes grow with the slots filled, and glibc's heap grew by their freed,
# fragmented holes), a compact cache is read back into one buffer the layers share (share_read_scratch), and the chunk's
# causal mask is converted to float once per call (decoder_masks), not by SDPA in every layer. Measured at 8184 tokens
# + 8 (the bench-decode worker, 2 threads): int8 cache peak RSS ~600 -> 535 MB, float16 655 -> 617 MB (the same greedy
# tokens as before), with the tokenizer no longer importing
# transformers (-30 MB before the prompt).
# Why not smaller chunks: each call reads the whole cache so far back in the compute dtype (a float16 or int8 cache is
# converted again per chunk), and SDPA with a mask computes the whole chunk x filled rectangle where the causal call
# skips the blocks above the diagonal (T x 256 more score entries in all at 512); both grow as chunks shrink. The
# quantized matmuls take x 4 rows at a time, so their speed does not depend on it; the MLP's own row limit
# (attnlab.models.blocks.MLP_ROWS) is the same 512.
# The chunks give the whole call's numbers bit for bit on a CPU (SmolLM2's GGUF at 1024 tokens: logits and cache
# equal; greedy tokens equal at 2048 and 8184): torch's CPU flash kernel walks the keys in the same blocks with or
# without the mask, and a masked key adds exactly 0. Two mask-free calls joined by their log-sum-exp (the chunk's keys
# causal, the earlier ones unmasked) were faster (1.05x the whole prompt's attention against 1.22x, T = 4096 in 512s,
# one thread, loaded machine) but not equal: SmolLM2 turned their 1e-7 into logits 0.5 apart and changed the greedy
# tokens of random prompts.
# The cost, measured (AMD EPYC Zen 4, 2 threads, quiet, SmolLM2 GGUF, 7000 tokens, one process alternating): one call
# 18.1 and 19.4 s, chunked 22.7 and 22.6 s (about 20% slower); chunks of 1024 gave 21.5 s, of 2048 24.4 s, so the
# masked calls, not their number, cost it. Peak RSS at 7000 tokens went from 806 to 673 MB with it.
PREFILL_CHUNK = 512
PREFILL_FIRST = 2048
# Not fewer rows as the keys grow: chunks of 448 down to 256 rows past 4096 keys (the mask and activations halved at
# the end: peak RSS at 8184 + 8 with the int8 cache 481 MB instead of 509) gave SmolLM2's logits up to 0.55 away from
# those of 512-row chunks at 8184 tokens with the int8 cache (equal at 4200 tokens), so they were left out (issue 51).


def prefill(
    model: CausalLM,
    idx: Tensor,
    positions: Tensor,
    key_padding_mask: Tensor,
    caches: nn.ModuleList,
    *,
    chunk: int | Literal["auto"] | None = "auto",
) -> Tensor:
    """Run the prompt ``idx (B, T)`` through the model, filling cache slots ``0 .. T-1``.

    ``key_padding_mask`` is ``(B, S)`` over all cache slots. Returns the last position's logits ``(B, V)``.

    The caches are filled in append mode (:mod:`attnlab.core.kv_cache`), ``chunk`` queries a call (None: the
    whole prompt in one call; ``"auto"``: without padding the first :data:`PREFILL_FIRST` tokens in one call, then
    :data:`PREFILL_CHUNK` a call; with padding :data:`PREFILL_CHUNK` a call). Each call attends over the slots
    filled so far, never over the empty rest of the ``S``-slot buffers, so no mask of ``T x S`` is built. A
    prompt in one call without padding runs SDPA's causal path with no mask tensor at all; a later chunk needs its causal mask ``(chunk, filled)``, and padding a mask
    ``(B, 1, chunk, filled)``, which chunks keep small. On a CPU the chunks give the logits and cache of one call
    exactly (see :data:`PREFILL_CHUNK`).
    Caches that only know position mode (a :class:`RollingKVCache`) are filled as before, in one call over
    their whole buffer.
    """
    if chunk is not None and chunk != "auto":
        check_count("chunk", chunk, low=1, hint="or None for the whole prompt in one call, or 'auto'")
    T = idx.size(1)
    if not all(isinstance(c, (KVCache, MLACache)) and not isinstance(c, RollingKVCache) for c in caches):
        slots = torch.arange(T, device=idx.device)  # (T,): position mode over the whole buffer
        logits = model(
            idx,
            positions=positions,
            key_padding_mask=key_padding_mask,
            caches=caches,
            cache_positions=slots,
            only_last=True,
        )
        return logits[:, -1]  # (B, V)
    for cache in caches:
        cast(KVCache | MLACache, cache).reset()  # append mode writes from slot 0
    padded = bool(key_padding_mask[:, :T].any())  # one read per prompt; none means no mask at all
    if chunk == "auto":
        chunk, first = PREFILL_CHUNK, (PREFILL_CHUNK if padded else max(PREFILL_CHUNK, PREFILL_FIRST))
    else:
        first = T if chunk is None else chunk
    step = T if chunk is None else chunk
    ends = [*range(min(T, first), T, step), T]  # where each call's tokens end
    for start, end in zip([0, *ends[:-1]], ends, strict=True):
        # the last calls of several, where the cache is fullest, free their work memory layer by layer
        last = end > T - 3 * step and start > 0 and idx.device.type == "cpu"
        with heap_trimmed_each_layer() if last else contextlib.nullcontext():
            logits = model(
                idx[:, start:end],
                positions=positions[:, start:end],
                key_padding_mask=key_padding_mask[:, :end] if padded else None,  # (B, end): the keys attended
                caches=caches,
                only_last=True,
            )
        if end < T and idx.device.type == "cpu":
            release_freed_heap()  # this call's work memory, freed (see PREFILL_CHUNK)
    return logits[:, -1]  # (B, V)


def decode_step(
    model: CausalLM, tok: Tensor, position: Tensor, slot: Tensor, key_padding_mask: Tensor, caches: nn.ModuleList
) -> Tensor:
    """One token per row: ``tok (B, 1)`` at ``position (B, 1)``, written at cache ``slot (1,)``; logits ``(B, V)``.

    Every argument keeps its shape from step to step (the slot is a tensor, not an int), so
    this is the function to compile.
    """
    logits = model(
        tok, positions=position, key_padding_mask=key_padding_mask, caches=caches, cache_positions=slot, only_last=True
    )
    return logits[:, -1]  # (B, V)


_compiled_decode_steps: dict[str | None, Callable[..., Tensor]] = {}


def decode_compile_mode(device: torch.device) -> str | None:
    """The ``torch.compile`` mode of the decode step on ``device``: ``"reduce-overhead"`` on CUDA.

    A decode step of a small model is launch-bound on a GPU (measured on an H200 for a
    124M-parameter model, bf16: 249 kernels a step, 2.7-3.1 ms compiled without graphs, 0.8 ms
    with them). ``reduce-overhead`` records the step once as a CUDA graph and replays it: the
    KV caches are module buffers (static addresses), and every per-step input (token, position
    and slot) is a slice of a tensor already on the device, so a step needs no host-to-device copy.
    Elsewhere the default mode (no graphs exist on CPU).
    """
    return "reduce-overhead" if device.type == "cuda" else None


def compiled_decode_step(device: torch.device | None = None) -> Callable[..., Tensor]:
    """:func:`decode_step` under ``torch.compile(fullgraph=True)`` in :func:`decode_compile_mode`'s mode,
    built once per process and mode."""
    mode = decode_compile_mode(device if device is not None else torch.device("cpu"))
    if mode not in _compiled_decode_steps:
        _compiled_decode_steps[mode] = torch.compile(decode_step, fullgraph=True, mode=mode)
    return _compiled_decode_steps[mode]


def buckets_cache_len(device: torch.device) -> bool:
    """Whether eager decode on ``device`` rounds its cache length up as the compiled path does: on CUDA.

    There every new cache length is a new kernel shape (measured on an H200: an unseen cache length
    made generating 1 token slower than 64, three calls in a row; per-shape kernel plans the suspect).
    The compiled path always rounds, so that its one graph is reused across calls.
    """
    return device.type == "cuda"


def compiled_cache_len(needed: int, block_size: int) -> int:
    """Cache slots for the compiled path: ``needed`` rounded up to a power of two >= 64, capped at ``block_size``.

    The cache buffers are module buffers, whose shapes torch.compile treats as static: every new
    ``max_len`` is a new graph (and ``fullgraph=True`` fails after 8). Rounding up bounds the
    graphs at ~6 per batch size for a 1024-token model; the unused slots are hidden by the
    causal mask of position mode, at the price of attending over up to 2x more slots.
    """
    return min(block_size, max(64, 1 << (needed - 1).bit_length()))


def sample_next(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    repetition_penalty: float = 1.0,
    seen: Tensor | None = None,
) -> Tensor:
    """Next token ``(B,)`` from logits ``(B, V)``: greedy at ``temperature == 0``, else sampled.

    ``top_k`` keeps the k most likely tokens; ``top_p`` keeps the smallest set of most likely
    tokens whose probability reaches p (nucleus). Both may be combined (top-k first).
    ``repetition_penalty`` p > 1 makes each token of ``seen`` ``(B, V)`` bool (the tokens so far) less
    likely, as transformers' ``repetition_penalty`` does (CTRL, Keskar et al. 2019): its logit divided
    by p when positive, multiplied by p when negative; applied before greedy's argmax too.
    """
    if repetition_penalty != 1.0 and seen is not None:
        logits = logits.float()
        penalized = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)  # (B, V)
        logits = torch.where(seen, penalized, logits)
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest logit
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
        probs = sorted_logits.softmax(dim=-1)  # (B, V)
        # Drop a token when the tokens more likely than it already reach top_p; the first always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # (B, V)
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # (B, V) back in vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


@dataclass(frozen=True)
class Step:
    """One generated token per row and the logits it was chosen from."""

    tokens: Tensor  # (B,) int64
    logits: Tensor  # (B, V) float, before temperature/top-k/top-p


# The smallest temperature above 0: logits / T is a float32 inf (and its softmax NaN) once a logit passes 3.4e38 * T,
# which at T = 1e-38 is a logit of 3.4 and at 1e-6 one of 3.4e32, which none is. Below it sampling is greedy but in name.
MIN_TEMPERATURE = 1e-6


def readable_int(value: int) -> str:
    """``value`` as typed, or its size when it is too long to read (an int of 400 digits)."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:8]}... (a {len(text) - (text[0] == '-')}-digit integer)"


def check_count(name: str, value: object, *, low: int, high: int | None = None, hint: str = "") -> None:
    """Raise :class:`UsageError` unless ``value`` is an int (not a bool), ``low <= value <= high``.

    ``check_range``'s message, without its float conversion: an int past 1e308 (``--top-k`` and
    400 digits) would be an ``OverflowError`` there, a traceback rather than a sentence.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= low and (high is None or value <= high):
            return
        got = readable_int(value)
    else:
        got = repr(value)
    bounds = f">= {low}" + (f" and <= {high}" if high is not None else "")
    raise UsageError(f"{name} must be an integer {bounds}, got {got}{'; ' + hint if hint else ''}.")


def check_temperature(name: str, temperature: float, hint: str) -> None:
    """Raise :class:`UsageError` unless ``temperature`` is 0 (greedy) or a finite number >= :data:`MIN_TEMPERATURE`.

    NaN, inf and negatives are refused by ``check_range``; a positive temperature below the floor
    divides the logits into float32 infinities, whose softmax is NaN and whose sampling fails
    mid-stream (``torch.multinomial``: "probability tensor contains either inf, nan or element < 0").
    """
    check_range(name, temperature, low=0, hint=hint)
    if 0 < temperature < MIN_TEMPERATURE:
        raise UsageError(
            f"{name} must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature!r}: dividing the logits "
            f"by less overflows float32 and sampling fails; pass 0 for greedy decoding."
        )


def _check_generate_args(
    model: CausalLM,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    key_padding_mask: Tensor | None,
    repetition_penalty: float = 1.0,
) -> None:
    """Every argument checked once per call, before the first step: the per-token loop checks nothing.

    The messages are those of ``attnlab generate`` for the same mistake, with the Python names.
    """
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"idx must be an int64 tensor (B, T) of prompt token ids, got "
            f"{getattr(idx, 'dtype', type(idx).__name__)} of shape {tuple(getattr(idx, 'shape', ()))}; "
            f"for one prompt use torch.tensor([ids]), for several use attnlab.left_pad(prompts)."
        )
    check_count("max_new_tokens", max_new_tokens, low=0)
    check_temperature("temperature", temperature, hint="0 is greedy")
    if top_k is not None:
        check_count("top_k", top_k, low=1, hint="or None for no limit")
    if top_p is not None:
        check_range("top_p", top_p, low=0, high=1, low_inclusive=False, hint="or None for no limit")
    check_range("repetition_penalty", repetition_penalty, low=0, low_inclusive=False, hint="1.0 is none")
    T, block = idx.size(1), model.config.block_size
    if T + max_new_tokens > block:
        fixes = []  # only the fixes that work alone: one that cannot fit is no advice
        if max_new_tokens < block:
            fixes.append(f"keep the prompt's last {block - max_new_tokens} tokens (idx[:, -{block - max_new_tokens}:])")
        if T < block:
            fixes.append(f"ask for at most {block - T} new tokens")
        if not fixes:
            fixes.append(
                f"keep the prompt's last {block - block // 2} tokens and ask for at most {block // 2} new tokens"
            )
        raise LimitError(
            f"prompt length {T} + max_new_tokens {readable_int(max_new_tokens)} = {readable_int(T + max_new_tokens)} exceeds "
            f"block_size={block}, the longest sequence the model has positions for; {' or '.join(fixes)}."
        )
    vocab_size = getattr(model.config, "vocab_size", None)  # part of GPTConfig, not of the CausalLM protocol
    if isinstance(vocab_size, int):
        check_token_ids(idx, vocab_size)  # once per call, on any device; decode steps feed back sampled ids
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool or key_padding_mask.shape != idx.shape):
        raise ValueError(
            f"key_padding_mask must be bool with the prompt's shape (B, T) = {tuple(idx.shape)} (True = padding), "
            f"got {key_padding_mask.dtype} of shape {tuple(key_padding_mask.shape)}; attnlab.left_pad builds both."
        )
    if key_padding_mask is not None and bool(key_padding_mask[:, -1].any()):
        raise ValueError(
            "key_padding_mask marks a row's last prompt token as padding; prompts must be padded on the "
            "left so that every row's last token is real (use attnlab.left_pad)."
        )


def generate_steps(
    model: CausalLM,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    key_padding_mask: Tensor | None = None,
    compile: bool = False,
    threads: Threads = None,
    kv_dtype: torch.dtype | str | None = None,
    repetition_penalty: float = 1.0,
) -> Iterator[Step]:
    """An iterator of one :class:`Step` per new token; stops early once every row has emitted ``eos_token_id``.

    Arguments as :func:`generate`. The arguments are checked here, at the call, not at the first
    ``next()``. Runs without autograd; the caller's grad mode is untouched between steps.

    With ``compile=True`` Dynamo checks its guards at every step (0.7 ms a step at batch 1 and
    1.1 ms at batch 8 for SmolLM2 on a CPU). ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``
    after the first step would save that, but the stance is process-global: another thread's
    compiled code would run unguarded meanwhile, so attnlab does not use it.
    """
    _check_generate_args(model, idx, max_new_tokens, temperature, top_k, top_p, key_padding_mask, repetition_penalty)
    threads = check_threads("threads", threads)
    if compile and not use_cache:
        raise ValueError(
            "compile=True with use_cache=False: only the cached decode step has fixed shapes to compile; pass use_cache=True."
        )
    counts = resolve_threads(threads) if idx.device.type == "cpu" else ()  # decode steps timed on a CPU only
    chooser = ThreadChooser(counts, free=free_cpus) if len(counts) > 1 else None
    steps = _steps(
        model,
        idx,
        max_new_tokens,
        temperature,
        top_k,
        top_p,
        eos_token_id,
        use_cache,
        generator,
        key_padding_mask,
        compile,
        kv_dtype,
        chooser,
        repetition_penalty,
    )
    return _threaded(steps, counts) if counts else steps


def _steps(
    model: CausalLM,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    eos_token_id: int | None,
    use_cache: bool,
    generator: torch.Generator | None,
    key_padding_mask: Tensor | None,
    compile: bool,
    kv_dtype: torch.dtype | str | None,
    chooser: ThreadChooser | None = None,
    repetition_penalty: float = 1.0,
) -> Iterator[Step]:
    B, T = idx.shape
    device = idx.device
    idx = idx.long()
    prompt_pad = (
        torch.zeros(B, T, dtype=torch.bool, device=device) if key_padding_mask is None else key_padding_mask.to(device)
    )
    S = T + max_new_tokens
    if compile or buckets_cache_len(device):  # a few cache sizes for all prompts
        S = compiled_cache_len(S, model.config.block_size)
    pad = torch.cat([prompt_pad, prompt_pad.new_zeros(B, S - T)], dim=1)  # (B, S): new tokens are never padding
    positions = positions_from_padding(pad)  # (B, S): position of every slot, fixed for the whole run
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # (B,)
    if max_new_tokens == 0:
        return

    with torch.no_grad():  # no_grad, not inference_mode: compiled steps mutate the cache buffers
        if use_cache:
            # kv_dtype only where asked: a CausalLM's setup_caches need not take it
            caches = model.setup_caches(B, S) if kv_dtype is None else cast(Any, model).setup_caches(B, S, kv_dtype)
            logits = prefill(model, idx, positions[:, :T], pad, caches)  # (B, V)
            if device.type == "cpu" and T > PREFILL_FIRST:
                # the prefill's freed work memory, which glibc would keep resident for the whole decode
                release_freed_heap()
        else:
            seq = idx  # (B, T), grows by one column per step
            logits = model(seq, positions=positions[:, :T], key_padding_mask=prompt_pad, only_last=True)[
                :, -1
            ]  # (B, V)
    # A model whose decode step is already one compiled call (Llama with dtype="gguf": has_fused_decode) has
    # nothing for torch.compile to gain: its step runs as it is.
    compile = compile and not getattr(model, "has_fused_decode", False)
    if compile and callable(getattr(model, "fuse_projections", None)):
        # Q|K|V and gate|up as one GEMM each in the compiled step; views refreshed from the weights as they are now
        cast(Any, model).fuse_projections()
    step_fn = compiled_decode_step(device) if compile else decode_step
    graphs = compile and decode_compile_mode(device) == "reduce-overhead"
    slots = torch.arange(S, device=device)  # (S,): each step's slot is a view, never a new host tensor
    seen = None  # (B, V) bool: the tokens of each row so far (the prompt's real ones, then the new), for the penalty
    if repetition_penalty != 1.0:
        real = (~prompt_pad).to(torch.int32)  # (B, T)
        seen = torch.zeros(B, logits.size(-1), dtype=torch.int32, device=device).scatter_add_(1, idx, real) > 0

    for i in range(max_new_tokens):
        tok = sample_next(
            logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            repetition_penalty=repetition_penalty,
            seen=seen,
        )  # (B,)
        if seen is not None:
            seen.scatter_(1, tok[:, None], True)
        if eos_token_id is not None:
            tok = tok.masked_fill(finished, eos_token_id)  # a finished row keeps emitting eos
            finished = finished | (tok == eos_token_id)
        yield Step(tokens=tok, logits=logits)
        if i == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
            return
        s = T + i  # slot of the token just chosen
        with torch.no_grad():
            if use_cache:
                args = (model, tok[:, None], positions[:, s : s + 1], slots[s : s + 1], pad, caches)
                # (B, V); with threads="auto", timed at the thread count chosen for it
                logits = step_fn(*args) if chooser is None else chooser.run(partial(step_fn, *args))
                if graphs:  # the graph's output buffer is rewritten by the next replay: keep this step's own copy
                    logits = logits.clone()
            else:  # recompute: the whole sequence again, no cache
                seq = torch.cat([seq, tok[:, None]], dim=1)  # (B, s + 1)
                logits = model(seq, positions=positions[:, : s + 1], key_padding_mask=pad[:, : s + 1], only_last=True)[
                    :, -1
                ]  # (B, V)


def _threaded(steps: Iterator[Step], counts: tuple[int, ...]) -> Iterator[Step]:
    """``steps`` with a fixed thread count set for them (``counts`` of one), and torch's count put back after."""
    before = torch.get_num_threads()
    if len(counts) == 1:
        torch.set_num_threads(counts[0])  # for the prefill too
    try:
        yield from steps
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def generate(
    model: CausalLM,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    key_padding_mask: Tensor | None = None,
    compile: bool = False,
    threads: Threads = None,
    kv_dtype: torch.dtype | str | None = None,
    repetition_penalty: float = 1.0,
) -> Tensor:
    """Continue ``idx``; returns ``(B, T + n)`` ids: the prompt (with its padding), then the new tokens.

    Args:
        model: a :class:`CausalLM` such as :class:`attnlab.TinyGPT` (put it in ``eval()`` mode for deterministic output).
        idx: ``(B, T)`` int64 prompt ids; rows of different lengths are left-padded
            (:func:`left_pad`) and flagged in ``key_padding_mask``.
        max_new_tokens: tokens to add; ``T + max_new_tokens`` must not exceed ``block_size``.
        temperature: 0 is greedy decoding; otherwise (at least :data:`MIN_TEMPERATURE`) logits are divided
            by it before sampling.
        top_k, top_p: restrict sampling to the k most likely tokens / the nucleus of mass p.
        eos_token_id: a row that emits it keeps emitting it; generation stops early (``n <
            max_new_tokens``) once every row has.
        use_cache: prefill a KV cache, then decode one token per step; False recomputes the
            whole sequence for every token (the reference, and the benchmark's baseline).
        generator: a ``torch.Generator`` for sampling; a fixed seed reproduces the tokens.
        key_padding_mask: ``(B, T)`` bool, True = left padding of the prompt.
        compile: run the decode step under ``torch.compile(fullgraph=True)`` (cached path only).
        threads: CPU threads of the decode steps (:mod:`attnlab.runtime.threads` says what the count does):
            None leaves ``torch.get_num_threads()`` as it is; an int sets it for the run; ``"auto"`` times the
            first steps at every count of :func:`~attnlab.runtime.threads.candidate_threads`, keeps the fastest
            and checks again from time to time (what ``attnlab generate`` does: beside other work that holds a
            core, one thread can be 10x faster than two), the prefill at torch's count. Torch's count is put
            back when the generation ends.
        kv_dtype: the KV cache's storage, ``"float16"``, ``"bfloat16"`` or ``"int8"`` (see
            :class:`attnlab.KVCache`); default the dtype K/V are computed in (exact). Passed to
            ``model.setup_caches``.
        repetition_penalty: > 1 makes every token already in the row (prompt or new) less likely
            (:func:`sample_next`); 1.0, the default, is none.
    """
    steps = [
        s.tokens
        for s in generate_steps(
            model,
            idx,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_token_id=eos_token_id,
            use_cache=use_cache,
            generator=generator,
            key_padding_mask=key_padding_mask,
            compile=compile,
            threads=threads,
            kv_dtype=kv_dtype,
            repetition_penalty=repetition_penalty,
        )
    ]
    if not steps:
        return idx.clone()
    return torch.cat([idx, torch.stack(steps, dim=1).to(idx.dtype)], dim=1)  # (B, T + n)
