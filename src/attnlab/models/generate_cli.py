"""``attnlab generate``: continue a prompt with a saved :class:`attnlab.TinyGPT` checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from .generation import generate_steps
from .saved_model import load_checkpoint
from .tokenizer import ByteTokenizer


def generate_command(
    checkpoint: Path,
    prompt: str = "\n",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    top_p: float | None = None,
    seed: int = 1337,
    compile: bool = False,
) -> int:
    """Print the prompt and its continuation, token by token, from a TinyGPT checkpoint.

    Args:
        checkpoint: directory written by attnlab.models.saved_model.save_checkpoint (config.json + model.safetensors).
        prompt: text to continue; encoded with the checkpoint's tokenizer (UTF-8 bytes if it has none).
        max_new_tokens: tokens to generate; prompt + new tokens must fit in the model's block_size.
        temperature: 0 is greedy; higher is more random.
        top_k: sample among the k most likely tokens only (None: all).
        top_p: sample within the smallest set of tokens whose probability reaches p (None: all).
        seed: seed of the sampling generator; the same seed gives the same text.
        compile: compile the decode step with torch.compile(fullgraph=True) (slow to start, faster per token).
    """
    model, tokenizer = load_checkpoint(checkpoint)  # a CheckpointError is a ValueError: main prints it as one line
    if tokenizer is None:
        if model.config.vocab_size < 256:
            raise ValueError(
                f"checkpoint {str(checkpoint)!r} has no tokenizer and vocab_size={model.config.vocab_size} < 256, so "
                f"text cannot be encoded as bytes; save it with save_checkpoint(model, dir, tokenizer=CharTokenizer(...))."
            )
        tokenizer = ByteTokenizer()
    ids = tokenizer.encode(prompt)
    if not ids:
        raise ValueError("--prompt is empty; pass at least one character to continue.")
    idx = torch.tensor([ids], dtype=torch.long)  # (1, T)
    steps = generate_steps(  # checks the arguments now, before anything is printed
        model,
        idx,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=torch.Generator().manual_seed(seed),
        compile=compile,
    )
    print(prompt, end="", flush=True)
    new: list[int] = []
    for step in steps:
        new.append(int(step.tokens[0]))
        if not isinstance(tokenizer, ByteTokenizer):  # a byte may be half a character: bytes are decoded at the end
            print(tokenizer.decode(new[-1:]), end="", flush=True)
    if isinstance(tokenizer, ByteTokenizer):
        print(tokenizer.decode(new), end="")
    print()
    return 0
