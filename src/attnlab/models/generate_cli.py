"""``attnlab generate``: continue a prompt with a saved :class:`attnlab.TinyGPT` checkpoint.

Every flag is checked, and the checkpoint loaded and checked, before anything is printed; each
mistake is one :class:`attnlab.runtime.UsageError` whose suggestion is a command that runs as
it is. The defaults work on every checkpoint the lab writes: the prompt is a symbol of the
model's own alphabet and the number of new tokens is capped by the model's ``block_size``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import torch

from ..runtime import UsageError, check_range, resolve_device
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


def _command(checkpoint: Path, prompt: str | None, **flags: object) -> str:
    """The ``attnlab generate`` command line with these flags, quoted for a POSIX shell."""
    args = ["attnlab", "generate", "--checkpoint", str(checkpoint)]
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
    checkpoint: Path,
    prompt: str = "",
    max_new_tokens: int | None = None,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float | None = None,
    seed: int = 1337,
    device: str = "auto",
    compile: bool = False,
) -> int:
    """Print the prompt and its continuation, token by token, from a TinyGPT checkpoint.

    Args:
        checkpoint: directory written by save_checkpoint (config.json + model.safetensors), e.g. runs/train/model.
        prompt: text to continue, in the checkpoint's alphabet; without a tokenizer, UTF-8 text (256+ ids) or token ids such as '3 14 15'. Empty: one symbol of the model's alphabet (a newline if it has one, else its first; '0' for ids).
        max_new_tokens: tokens to generate; prompt + new tokens must fit in the model's block_size. None: 200, or as many as fit when fewer do (a note on stderr says so).
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
    dev = resolve_device(device)
    model, saved_tokenizer = load_checkpoint(checkpoint, device=dev)  # CheckpointError: a UsageError naming the file
    tokenizer: Tokenizer | _IdText
    if saved_tokenizer is not None:
        tokenizer = saved_tokenizer
    elif model.config.vocab_size >= 256:
        tokenizer = ByteTokenizer()
    else:
        tokenizer = _IdText(model.config.vocab_size)
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
    block = model.config.block_size
    if len(ids) >= block:
        keep_new = max_new_tokens if max_new_tokens is not None and max_new_tokens < block else None
        fitted = _printable_prompt(_fit_prompt(prompt, tokenizer, block - (keep_new or block // 2)), tokenizer)
        raise UsageError(
            f"--prompt is {_tokens(len(ids))} but the model's block_size is {block}, which leaves no room for a new "
            f"token; keep its end: {_command(checkpoint, fitted, max_new_tokens=keep_new)}"
        )
    room = block - len(ids)
    if max_new_tokens is None:
        max_new_tokens = min(DEFAULT_NEW_TOKENS, room)
        if max_new_tokens < DEFAULT_NEW_TOKENS:
            print(
                f"attnlab: note: generating {max_new_tokens} tokens, all that fit in block_size {block} after the "
                f"{_tokens(len(ids))} of the prompt (--max-new-tokens N asks for fewer)",
                file=sys.stderr,
            )
    elif max_new_tokens > room:
        raise UsageError(
            f"--prompt ({_tokens(len(ids))}) + --max-new-tokens {max_new_tokens} = {len(ids) + max_new_tokens} exceeds "
            f"the model's block_size={block}; ask for at most {room}: "
            f"{_command(checkpoint, _printable_prompt(prompt, tokenizer) if prompt.isprintable() else None, max_new_tokens=room)}"
        )

    idx = torch.tensor([ids], dtype=torch.long, device=dev)  # (1, T)
    steps = generate_steps(  # checks the arguments now, before anything is printed
        model,
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
