"""``attnlab.stream``: generation from Python as ``attnlab generate`` streams it: the same weights, the same
sampling defaults, the same text, one :class:`StreamEvent` per new token.

The text of each event is whole UTF-8 characters only (:mod:`.text_stream`): a Chinese character whose three
bytes arrive over two tokens is in the event of the second, never as U+FFFD. The loop is
:func:`attnlab.models.generation.generate_steps`, and :func:`events` is the one place its tokens become text
and rates: ``attnlab generate`` prints the events that ``attnlab.stream`` yields.

Sampling (:func:`sampling`): a chat answer samples as SmolLM2's model card recommends (temperature 0.2, top-p
0.9; neither its ``generation_config.json`` nor its GGUF file carries sampling values) with a repetition penalty
of 1.1 (:data:`CHAT_SAMPLING`); a continuation samples at temperature 0.8 among the top 200 tokens, as
``attnlab generate`` always has (:data:`CONTINUE_SAMPLING`); ``greedy=True`` (or temperature 0) is plain argmax.
``scripts/chat_quality.py`` measured the choice (``docs/howto/real-models.md``, "Chat sampling").
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.kv_cache import kv_cache_choice, kv_values_per_position
from ..models.generation import Step, generate_steps
from ..runtime import LimitError, UsageError
from ..weight_files.precision import WeightChoice, loaded_weights_detail, weights_name
from ..weight_files.pretrained import from_pretrained
from .text_stream import TextStream, hf_text

__all__ = ["CHAT_SAMPLING", "CONTINUE_SAMPLING", "DEFAULT_NEW_TOKENS", "Sampling", "Stream", "StreamEvent", "events"]

DEFAULT_NEW_TOKENS = 200  # new tokens when none are asked for, if the model has room


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen (the arguments of :func:`attnlab.generate` of the same names)."""

    temperature: float  # 0: greedy
    top_k: int | None  # sample among the k most likely (None: all)
    top_p: float | None  # within the nucleus of mass p (None: all)
    repetition_penalty: float  # > 1: tokens already in the text less likely (1.0: none)


# SmolLM2-Instruct's card samples at temperature 0.2 and top-p 0.9; the penalty of 1.1 is the one measured to stop
# greedy's loops without costing fluency (scripts/chat_quality.py). top_k 200 is generate's, and at temperature 0.2
# the nucleus is far smaller than 200 tokens, so it changes nothing.
CHAT_SAMPLING = Sampling(temperature=0.2, top_k=200, top_p=0.9, repetition_penalty=1.1)
CONTINUE_SAMPLING = Sampling(temperature=0.8, top_k=200, top_p=None, repetition_penalty=1.0)  # generate's, unchanged


def sampling(
    chat: bool,
    *,
    greedy: bool = False,
    temperature: float | None = None,
    top_k: int | None = 200,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
) -> Sampling:
    """The sampling of one stream: what was asked, the rest from :data:`CHAT_SAMPLING` (``chat``) or
    :data:`CONTINUE_SAMPLING`. ``greedy`` (or ``temperature=0``) is argmax with no repetition penalty unless one
    is asked for; ``top_p=None`` takes the default (pass 1.0 for no limit)."""
    base = CHAT_SAMPLING if chat else CONTINUE_SAMPLING
    if greedy and temperature not in (None, 0, 0.0):
        raise UsageError(
            f"greedy=True takes the most likely token, and temperature={temperature!r} asks to sample; pass one of them."
        )
    t = 0.0 if greedy else base.temperature if temperature is None else temperature
    if repetition_penalty is None:
        repetition_penalty = 1.0 if t == 0 else base.repetition_penalty
    return Sampling(t, top_k, base.top_p if top_p is None else top_p, repetition_penalty)


@dataclass(frozen=True)
class StreamEvent:
    """One new token and the text it completes."""

    text: str  # the whole characters this token completes: "" while a character's bytes are still arriving
    token_id: int  # the token chosen at this step
    tokens: int  # new tokens so far, this one included
    held: int  # the last tokens, half a character, whose text is not in any event yet
    elapsed_s: float  # since the stream started: the prompt's prefill and every token so far
    tokens_per_s: float  # decode rate so far: the tokens after the first over the time since the first (0.0 at it)


def events(steps: Iterator[Step], text: TextStream, start: float | None = None) -> Iterator[StreamEvent]:
    """Each step of ``steps`` (batch 1) as a :class:`StreamEvent`; ``start``: when the stream began (default: now)."""
    start = time.perf_counter() if start is None else start
    first = start
    for n, step in enumerate(steps, 1):
        token = int(step.tokens[0])  # reads the token back: the step has finished, on any device
        now = time.perf_counter()
        if n == 1:
            first = now
        piece = text.push(token)
        rate = (n - 1) / (now - first) if n > 1 and now > first else 0.0
        yield StreamEvent(piece, token, n, text.held, now - start, rate)


class Stream:
    """The events of one generation, as they come; what it generated so far is on the stream itself.

    Iterate it once: ``for event in attnlab.stream(...): print(event.text, end="", flush=True)``.
    """

    def __init__(
        self,
        steps: Iterator[Step],
        text: TextStream,
        *,
        prompt_ids: list[int],
        weights_line: str,
        sampling: Sampling,
    ) -> None:
        self.prompt_ids = prompt_ids  # the prompt's token ids (in the chat template for a chat)
        self.weights_line = weights_line  # "attnlab: weights gguf (...): why": the line attnlab generate prints
        self.sampling = sampling
        self.token_ids: list[int] = []  # the new tokens so far (the end-of-sequence token included when it came)
        self.text = ""  # their text so far: every event's text joined
        self._text = text
        self._events = events(steps, text)
        self.last: StreamEvent | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> StreamEvent:
        event = next(self._events)
        self.token_ids.append(event.token_id)
        self.text += event.text
        self.last = event
        return event

    @property
    def held(self) -> int:
        """Tokens at the end that are half a UTF-8 character, left out of :attr:`text` (a character cut short)."""
        return self._text.held

    def read(self) -> str:
        """Run the stream to its end; its text."""
        for _ in self:
            pass
        return self.text


def _weights_line(model: nn.Module, kv_words: str) -> str:
    """The weights line of a model from :func:`from_pretrained` (it says why), or what a given model holds; with
    ``kv_words`` (the KV cache's, from :func:`kv_cache_choice`) among the details, as ``attnlab generate`` says it."""
    detail = ", ".join(part for part in (loaded_weights_detail(model), kv_words) if part)
    choice = getattr(model, "weights_choice", None)
    if isinstance(choice, WeightChoice):
        return choice.line(detail)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    what = "gguf" if loaded_weights_detail(model) else weights_name(dtype)
    return f"attnlab: weights {what}{f' ({detail})' if detail else ''}: the model as it was given"


def stream(
    model: str | os.PathLike[str] | nn.Module,
    prompt: str | Sequence[dict[str, str]],
    *,
    tokenizer: Any = None,
    chat: bool | None = None,
    max_new_tokens: int | None = None,
    greedy: bool = False,
    temperature: float | None = None,
    top_k: int | None = 200,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int = 1337,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    kv_dtype: str = "auto",
) -> Stream:
    """Generate from ``prompt`` and yield the text as it comes, as ``attnlab generate --model`` prints it.

    Args:
        model: ``"smollm2"``, a ``.gguf`` file or a Hugging Face directory (loaded by :func:`attnlab.from_pretrained`
            with ``dtype`` and ``device``: the weights ``attnlab generate`` runs, its weights line in
            ``stream.weights_line``), or a model already loaded (then ``tokenizer`` too).
        prompt: text, or a conversation ``[{"role": "user", "content": ...}, ...]`` (a chat).
        tokenizer: the model's ``transformers`` tokenizer; taken from the file when ``model`` is a name or path.
        chat: wrap a text prompt in the model's chat template as one user turn (``attnlab generate --chat``);
            default: True for a conversation, False for text (a continuation, as ``attnlab generate --prompt``).
        max_new_tokens: at most this many new tokens (the end-of-sequence token stops earlier); default 200, or
            all that fit in the model's context.
        greedy: always the most likely token, no repetition penalty (``--temperature 0``).
        temperature: ``None`` takes the default: for a chat :data:`CHAT_SAMPLING`'s 0.2, for a continuation
            :data:`CONTINUE_SAMPLING`'s 0.8.
        top_k: sample among the ``top_k`` most likely tokens (``None``: all of them).
        top_p: the nucleus; ``None`` takes the default (0.9 for a chat, none for a continuation); ``1.0`` is no
            limit.
        repetition_penalty: > 1 makes every token already seen less likely, 1 is none; ``None`` takes the default
            (1.1 for a chat, 1.0 for a continuation, 1.0 when greedy).
        seed: of the sampling generator; the same seed gives the same text.
        dtype: as :func:`attnlab.from_pretrained` takes it (``"auto"``: generate's default, the GGUF's blocks as
            stored on a CPU).
        device: as :func:`attnlab.from_pretrained` takes it.
        kv_dtype: what the KV cache stores, as ``attnlab generate --kv-dtype`` takes it (``"auto"``: generate's
            default, on a CPU with the fused gguf decode step float16, or int8 where the prompt and its new tokens
            would take more than 32 MB of float16 cache, else the compute dtype; ``"float32"``,
            ``"float16"``, ``"bfloat16"``, ``"int8"``); the weights line names a compact cache.

    Returns:
        A :class:`Stream` of :class:`StreamEvent` (``event.text``, ``event.token_id``, ``event.tokens_per_s``),
        which keeps ``token_ids``, ``text``, ``prompt_ids`` and ``weights_line``. The arguments, the prompt's length
        and the model are checked here, before the first event.

    Example::

        s = attnlab.stream("smollm2", "法国的首都是哪里？", chat=True)
        print(s.weights_line)
        for event in s:
            print(event.text, end="", flush=True)
        print(f"\\n{s.last.tokens_per_s:.0f} tokens/s")
    """
    lm: Any  # a CausalLM: Llama or TinyGPT, each with config.block_size
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise UsageError(
                f"stream() got a loaded {type(model).__name__} and no tokenizer; pass tokenizer=tok (from_pretrained "
                f"returns both), or the model's name or path, e.g. stream('smollm2', ...)."
            )
        lm = model
    elif isinstance(model, str | os.PathLike):
        lm, loaded = from_pretrained(model, dtype=dtype, device=device)
        tokenizer = tokenizer if tokenizer is not None else loaded
        if tokenizer is None:
            raise UsageError(
                f"{os.fspath(model)!r} has no tokenizer files; pass tokenizer=..., or save one next to the weights."
            )
    else:
        raise UsageError(
            f"model must be 'smollm2', a .gguf path, a model directory or a loaded model, got {type(model).__name__}."
        )
    conversation = not isinstance(prompt, str)
    chat = conversation if chat is None else chat
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
        if not chat:
            raise UsageError("a conversation (a list of messages) is a chat; pass chat=True or a text prompt.")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("chat=True needs a chat template, and this tokenizer has none; pass chat=False.")
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = list(enc["input_ids"])
    else:
        ids = list(tokenizer(prompt, verbose=False)["input_ids"])
    if not ids:
        raise UsageError("prompt encodes to no tokens; pass some text.")
    block = lm.config.block_size
    room = block - len(ids)
    if room < 1:
        raise LimitError(f"the prompt is {len(ids)} tokens, and the model's context is {block}; shorten it.")
    n = min(DEFAULT_NEW_TOKENS, room) if max_new_tokens is None else max_new_tokens
    how = sampling(
        chat, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty
    )
    dev = next(lm.parameters()).device
    try:
        kv_storage, kv_words = kv_cache_choice(
            kv_dtype,
            dev,
            bool(getattr(lm, "has_fused_decode", False)),
            "kv_dtype",
            slots=len(ids) + n,
            per_slot=kv_values_per_position(lm),
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    steps = generate_steps(
        lm,
        torch.tensor([ids], dtype=torch.long, device=dev),
        n,
        temperature=how.temperature,
        top_k=how.top_k,
        top_p=how.top_p,
        repetition_penalty=how.repetition_penalty,
        eos_token_id=tokenizer.eos_token_id,
        generator=torch.Generator(device=dev).manual_seed(seed),
        kv_dtype=kv_storage,
    )
    line = _weights_line(lm, kv_words)
    return Stream(steps, hf_text(tokenizer), prompt_ids=ids, weights_line=line, sampling=how)
