"""``attnlab.stream``: whole characters only, the ids and their text in step, the CLI's weights and sampling.

The UTF-8 logic is tested on byte-level tokens made here (a 3-byte character split over two tokens); the real
test streams a Chinese answer from SmolLM2, the model ``attnlab generate --model smollm2`` runs by default.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

import attnlab
from attnlab.core.kv_cache import kv_cache_choice
from attnlab.models.generation import Step, sample_next
from attnlab.runtime import UsageError
from attnlab.tools.stream import CHAT_SAMPLING, CONTINUE_SAMPLING, Sampling, events, sampling
from attnlab.tools.text_stream import Utf8Text
from attnlab.weight_files.precision import choose_weights
from smollm2_fixtures import require_smollm2

# "法国" is E6 B3 95 | E5 9B BD: token 0 ends in the middle of 法, token 1 finishes it and starts 国
TOKENS = {0: b"\xe6\xb3", 1: b"\x95\xe5", 2: b"\x9b\xbd", 3: b"!", 4: b"\xff"}


def _steps(ids: list[int]) -> Iterator[Step]:
    for i in ids:
        yield Step(tokens=torch.tensor([i]), logits=torch.zeros(1, 5))


def test_events_hold_back_half_a_character_and_join_to_the_bytes_decoded():
    got = list(events(_steps([0, 1, 2, 3]), Utf8Text(TOKENS.__getitem__)))
    assert [(e.text, e.token_id, e.tokens, e.held) for e in got] == [
        ("", 0, 1, 1),  # E6 B3: two bytes of three, held
        ("法", 1, 2, 1),  # 95 completes 法; E5 starts 国, held
        ("国", 2, 3, 0),
        ("!", 3, 4, 0),
    ]
    assert "".join(e.text for e in got) == b"".join(TOKENS[i] for i in (0, 1, 2, 3)).decode()
    assert got[0].tokens_per_s == 0.0 and all(e.tokens_per_s > 0 for e in got[1:])
    assert [e.elapsed_s for e in got] == sorted(e.elapsed_s for e in got)


def test_a_byte_that_can_never_be_utf8_is_replaced_at_once_as_decode_does():
    got = list(events(_steps([4, 3]), Utf8Text(TOKENS.__getitem__)))
    assert [e.text for e in got] == ["\ufffd", "!"]  # bytes.decode(errors="replace") gives the same


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    seen = torch.tensor([[True, False, True]])
    assert int(sample_next(logits, temperature=0)[0]) == 0
    assert int(sample_next(logits, temperature=0, repetition_penalty=1.2, seen=seen)[0]) == 1  # 2.0 / 1.2 < 1.9
    # the penalty of a negative logit makes it more negative: the seen token 2 loses to an unseen one
    near = torch.tensor([[-1.0, -1.1, -5.0]])
    assert int(sample_next(near, temperature=0, repetition_penalty=1.2, seen=torch.tensor([[True, False, False]]))) == 1


def test_repetition_penalty_stops_a_greedy_loop_in_generate():
    torch.manual_seed(0)
    model = attnlab.TinyGPT(attnlab.GPTConfig(vocab_size=16, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.tensor([[1, 2, 3]])
    plain = attnlab.generate(model, idx, 40, temperature=0)[0, 3:].tolist()
    guarded = attnlab.generate(model, idx, 40, temperature=0, repetition_penalty=5.0)[0, 3:].tolist()
    assert len(set(plain)) < len(set(guarded))  # a random tiny model loops greedily; the penalty visits more tokens
    with pytest.raises(ValueError, match=r"^repetition_penalty must be a number > 0, got 0; 1.0 is none\.$"):
        attnlab.generate(model, idx, 2, temperature=0, repetition_penalty=0)


def test_sampling_defaults_chat_continuation_and_greedy():
    assert sampling(True) == CHAT_SAMPLING == Sampling(0.2, 200, 0.9, 1.1)
    assert sampling(False) == CONTINUE_SAMPLING == Sampling(0.8, 200, None, 1.0)
    assert sampling(True, greedy=True) == Sampling(0.0, 200, 0.9, 1.0)  # greedy: no penalty unless asked
    assert sampling(True, temperature=0) == Sampling(0.0, 200, 0.9, 1.0)
    assert sampling(True, greedy=True, repetition_penalty=1.3).repetition_penalty == 1.3
    assert sampling(True, top_p=1.0, temperature=0.7) == Sampling(0.7, 200, 1.0, 1.1)
    with pytest.raises(UsageError, match=r"greedy=True takes the most likely token, and temperature=0.5"):
        sampling(True, greedy=True, temperature=0.5)


# -- the real model ------------------------------------------------------------------------------------------------


@functools.cache
def _smollm2() -> tuple[torch.nn.Module, object]:
    return attnlab.from_pretrained("smollm2")  # the default weights: what attnlab generate runs


@pytest.fixture(scope="module")
def smollm2() -> tuple[torch.nn.Module, object]:
    require_smollm2()
    return _smollm2()


def test_from_pretrained_defaults_to_generates_weights_and_says_its_line(smollm2):
    model, _ = smollm2
    choice = choose_weights("auto", task="generate", source="smollm2", device=torch.device("cpu"), flag="dtype")
    line = model.weights_line
    assert line.startswith(f"attnlab: weights {choice.name}") and line.endswith(choice.reason), line
    if choice.name == "gguf":
        assert "blocks as stored" in line


def test_streams_a_chinese_answer_with_no_broken_character(smollm2):
    model, tok = smollm2
    s = attnlab.stream(model, "法国的首都是哪里？请用中文回答。", tokenizer=tok, chat=True, max_new_tokens=48)
    got = list(s)
    pieces = [e.text for e in got]
    assert sum(p.count("\ufffd") for p in pieces) == 0
    assert "".join(pieces) == s.text
    decoded = tok.decode(s.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert s.text == (decoded.rstrip("\ufffd") if s.held else decoded)  # a character cut at the end is left out
    assert any("\u4e00" <= c <= "\u9fff" for c in s.text), s.text  # it answered in Chinese characters
    assert any(e.held and not e.text for e in got), "no character was split over tokens: the test tests nothing"
    _, kv_words = kv_cache_choice("auto", torch.device("cpu"), model.has_fused_decode, "kv_dtype")
    line = model.weights_line.replace("): ", f", {kv_words}): ", 1) if kv_words else model.weights_line
    assert s.prompt_ids and s.sampling == CHAT_SAMPLING and s.weights_line == line  # the KV cache generate runs
    assert got[-1].tokens == len(s.token_ids) and got[-1].tokens_per_s > 0


def test_the_same_seed_streams_the_same_tokens(smollm2):
    model, tok = smollm2
    ask = {"tokenizer": tok, "chat": True, "max_new_tokens": 12, "seed": 7}
    first = attnlab.stream(model, "Name a colour.", **ask)
    first.read()
    second = attnlab.stream(model, "Name a colour.", **ask)
    assert second.read() == first.text and second.token_ids == first.token_ids


def test_greedy_stream_is_attnlab_generate_greedy(smollm2):
    model, tok = smollm2
    s = attnlab.stream(model, "The capital of France is", tokenizer=tok, greedy=True, max_new_tokens=6)
    s.read()
    ids = torch.tensor([s.prompt_ids])
    out = attnlab.generate(model, ids, 6, temperature=0, eos_token_id=tok.eos_token_id)  # type: ignore[attr-defined]
    assert s.token_ids == out[0, ids.size(1) :].tolist()


def test_a_loaded_model_without_a_tokenizer_is_refused(smollm2):
    model, _ = smollm2
    with pytest.raises(UsageError, match=r"^stream\(\) got a loaded Llama and no tokenizer; pass tokenizer=tok"):
        attnlab.stream(model, "hi")


@pytest.mark.slow  # the CLI's chat on the real model; the Chinese stream test above keeps the quick property
def test_the_cli_chat_prints_what_the_python_stream_yields_with_the_same_weights_line(smollm2, capsys):
    """``attnlab generate --chat`` and ``attnlab.stream(..., chat=True)``: the same defaults (weights, sampling,
    seed), so the same answer, and the same weights line (the flag named as each spells it)."""
    from attnlab.cli import main

    model, tok = smollm2
    question = "What is the capital of France?"
    # the stream runs at torch's thread count; the CLI's --threads auto picks the decode's count by timing steps, and
    # a count changes the float sums (1 and 2 threads sample different answers here), so the CLI is given torch's
    threads = ["--threads", str(torch.get_num_threads())]
    assert (
        main(["generate", "--model", "smollm2", "--chat", "--prompt", question, "--max-new-tokens", "16", *threads])
        == 0
    )
    out, err = capsys.readouterr()
    s = attnlab.stream(model, question, tokenizer=tok, chat=True, max_new_tokens=16)
    assert out == s.read() + "\n"
    cli_line = next(line for line in err.splitlines() if line.startswith("attnlab: weights "))
    assert cli_line.replace("--kv-dtype", "kv_dtype").replace("--dtype", "dtype") == s.weights_line
    assert (
        main(
            [
                "generate",
                "--model",
                "smollm2",
                "--chat",
                "--prompt",
                question,
                "--max-new-tokens",
                "8",
                "--greedy",
                *threads,
            ]
        )
        == 0
    )
    greedy = attnlab.stream(model, question, tokenizer=tok, chat=True, max_new_tokens=8, greedy=True)
    assert capsys.readouterr().out == greedy.read() + "\n"
