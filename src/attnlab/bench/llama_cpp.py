"""llama.cpp (llama-cpp-python) on a GGUF file, as attnlab's peer: ``bench-decode``'s llama.cpp column and the
speed line of ``attnlab demo`` run it through :func:`llama_cpp_runner`, so both measure the same thing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from .lengths_worker import greedy_llama_cpp

__all__ = ["llama_cpp_runner"]


def llama_cpp_runner(path: Path, n_ctx: int, threads: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """llama.cpp (llama-cpp-python) on the same GGUF file, greedy, ``n`` new tokens after the prompt ids; ``(1, T + n)``.

    Batch 1 only: llama-cpp-python's API decodes one sequence at a time. Its log output is silenced.
    """
    from llama_cpp import Llama as LlamaCpp

    llm = LlamaCpp(model_path=str(path), n_threads=threads, n_ctx=n_ctx, n_batch=n_ctx, verbose=False)

    def run(idx: torch.Tensor, n: int) -> torch.Tensor:
        prompt = idx[0].tolist()
        return torch.tensor([prompt + greedy_llama_cpp(llm, prompt, n)])

    return run
