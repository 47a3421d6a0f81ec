"""Damaged, inconsistent and hostile model files: each one is refused before any tensor is built, as one
sentence naming the file, the field or tensor, and the fix, from ``from_pretrained`` and from the CLI.

Families, each parametrized over its members: every GGUF metadata field the loader reads (missing,
mistyped, zero or negative, inconsistent), the GGUF header's structure (truncation at every part,
absurd counts and shapes, overlapping tensors), bit rot inside GGUF tensor data, every kind of
safetensors header damage, Hugging Face ``config.json`` fields and truncation, tokenizer files,
configs too large for this machine, and sources that are no model at all. The files are tiny and
written here (``write_llama_gguf``, ``save_pretrained`` of a 2-layer model).
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnlab import GPTConfig, TinyGPT, save_checkpoint
from attnlab.cli import main
from attnlab.models.llama import Llama
from attnlab.models.llama_config import LlamaConfig
from attnlab.runtime import LimitError, ModelFileError, ModelFileNotFoundError, UsageError, gib
from attnlab.weight_files import file_checks
from attnlab.weight_files.gguf import GGUFError, GGUFNotFoundError
from attnlab.weight_files.pretrained import from_pretrained
from attnlab.weight_files.saved_model import CheckpointError

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGUFValue  # noqa: E402  (after the skip: gguf is optional)
from gguf import GGUFValueType as T  # noqa: E402

from test_pretrained import hf_llama, write_llama_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

GGUF_FIX = "copy it again"
HF_FIX = "model.save_pretrained(dir)"


def refused(error: type[Exception], load: Callable[[], Any], *parts: str) -> str:
    """The message of the ``error`` that ``load()`` raises: one line holding every one of ``parts``."""
    with pytest.raises(error) as info:
        load()
    message = str(info.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


def cli_error(capsys: pytest.CaptureFixture[str], *argv: str, progress: bool = False) -> str:
    """What ``attnlab ARGV`` prints for a mistake: exit 2 and one line ``attnlab: error: ...``, no traceback
    (and nothing on stdout, unless the command says what it is ``progress``-ing there first)."""
    rc = main(list(argv))
    captured = capsys.readouterr()
    assert rc == 2, captured
    assert "Traceback" not in captured.err and (progress or captured.out == ""), captured
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab: error: "), captured.err
    return lines[0].removeprefix("attnlab: error: ")


# -- GGUF metadata: every field the loader reads ------------------------------------------------------

U32, I32, F32, STR, BOOL = T.UINT32, T.INT32, T.FLOAT32, T.STRING, T.BOOL
V = 262  # tokens of write_llama_gguf's byte-level vocabulary


def value(v: Any, vtype: T, sub: T | None = None) -> GGUFValue:
    return GGUFValue(v, vtype, sub)


# id -> (metadata edit, words the message must hold besides the file name)
GGUF_FIELDS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "architecture missing": ({"general.architecture": None}, ("general.architecture is missing", "'llama'")),
    "architecture not a string": ({"general.architecture": value(5, U32)}, ("general.architecture is the uint32 5",)),
    "embedding_length missing": (
        {"llama.embedding_length": None},
        ("llama.embedding_length is missing, expected a positive integer (the residual width)", GGUF_FIX),
    ),
    "embedding_length a string": (
        {"llama.embedding_length": value("64", STR)},
        ("llama.embedding_length is the string '64', expected an integer",),
    ),
    "embedding_length 0": ({"llama.embedding_length": value(0, U32)}, ("llama.embedding_length is 0",)),
    "head_count missing": ({"llama.attention.head_count": None}, ("llama.attention.head_count is missing",)),
    "head_count 0": ({"llama.attention.head_count": value(0, U32)}, ("llama.attention.head_count is 0", GGUF_FIX)),
    "head_count negative": ({"llama.attention.head_count": value(-4, I32)}, ("llama.attention.head_count is -4",)),
    "head_count not dividing the width": (
        {"llama.attention.head_count": value(3, U32)},
        ("llama.attention.head_count is 3, expected a divisor of llama.embedding_length = 64", GGUF_FIX),
    ),
    "head_count leaving an odd head dim": (
        {"llama.attention.head_count": value(64, U32), "llama.attention.head_count_kv": value(64, U32)},
        ("llama.attention.head_count is 64", "even head dim"),
    ),
    "head_count an array": (
        {"llama.attention.head_count": value([4, 4], T.ARRAY, U32)},
        ("llama.attention.head_count is an array of 2 uint32s, expected an integer",),
    ),
    "head_count_kv 0": ({"llama.attention.head_count_kv": value(0, U32)}, ("llama.attention.head_count_kv is 0",)),
    "head_count_kv not dividing the heads": (
        {"llama.attention.head_count_kv": value(3, U32)},
        ("llama.attention.head_count_kv is 3, expected a divisor of llama.attention.head_count = 4",),
    ),
    "head_count_kv a float": (
        {"llama.attention.head_count_kv": value(2.0, F32)},
        ("llama.attention.head_count_kv is the float32 2.0, expected an integer",),
    ),
    "block_count missing": ({"llama.block_count": None}, ("llama.block_count is missing",)),
    "block_count 0": ({"llama.block_count": value(0, U32)}, ("llama.block_count is 0",)),
    "block_count past the tensors": (
        {"llama.block_count": value(3, U32)},
        ("llama.block_count is 3, expected 2, the blocks the file holds tensors for (blk.0 .. blk.1)",),
    ),
    "block_count absurd": ({"llama.block_count": value(10**12, T.UINT64)}, ("llama.block_count is 1000000000000",)),
    "context_length missing": ({"llama.context_length": None}, ("llama.context_length is missing",)),
    "context_length negative": ({"llama.context_length": value(-1, I32)}, ("llama.context_length is -1",)),
    "feed_forward_length missing": ({"llama.feed_forward_length": None}, ("llama.feed_forward_length is missing",)),
    "feed_forward_length 0": ({"llama.feed_forward_length": value(0, U32)}, ("llama.feed_forward_length is 0",)),
    "feed_forward_length against the tensors": (
        {"llama.feed_forward_length": value(95, U32)},
        ("the shape of tensor 'blk.0.ffn_gate.weight' is (96, 64), expected (95, 64)", GGUF_FIX),
    ),
    "vocab_size 0": ({"llama.vocab_size": value(0, U32)}, ("llama.vocab_size is 0",)),
    "vocab_size against the embedding": (
        {"llama.vocab_size": value(300, U32)},
        ("the shape of tensor 'token_embd.weight' is (262, 64), expected (300, 64)",),
    ),
    "rope dimension_count": ({"llama.rope.dimension_count": value(8, U32)}, ("llama.rope.dimension_count=8",)),
    "key_length": ({"llama.attention.key_length": value(32, U32)}, ("llama.attention.key_length=32",)),
    "value_length a string": (
        {"llama.attention.value_length": value("16", STR)},
        ("llama.attention.value_length is the string '16', expected an integer",),
    ),
    "freq_base below 1": ({"llama.rope.freq_base": value(0.5, F32)}, ("llama.rope.freq_base is 0.5",)),
    "freq_base NaN": ({"llama.rope.freq_base": value(float("nan"), F32)}, ("llama.rope.freq_base is nan",)),
    "freq_base a string": ({"llama.rope.freq_base": value("1e4", STR)}, ("expected a number",)),
    "rms epsilon 0": (
        {"llama.attention.layer_norm_rms_epsilon": value(0.0, F32)},
        ("llama.attention.layer_norm_rms_epsilon is 0.0, expected a finite number > 0",),
    ),
    "rms epsilon inf": (
        {"llama.attention.layer_norm_rms_epsilon": value(float("inf"), F32)},
        ("llama.attention.layer_norm_rms_epsilon is inf",),
    ),
    "rope scaling a number": ({"llama.rope.scaling.type": value(1, U32)}, ("llama.rope.scaling.type is the uint32 1",)),
    "expert_count a string": ({"llama.expert_count": value("8", STR)}, ("llama.expert_count is the string '8'",)),
    "tokenizer model missing": ({"tokenizer.ggml.model": None}, ("tokenizer.ggml.model is missing",)),
    "tokenizer model unknown": ({"tokenizer.ggml.model": value("bert", STR)}, ("a tokenizer of kind 'bert'",)),
    "tokenizer pre a number": ({"tokenizer.ggml.pre": value(3, U32)}, ("tokenizer.ggml.pre is the uint32 3",)),
    "tokens missing": (
        {"tokenizer.ggml.tokens": None},
        ("tokenizer.ggml.tokens is missing, expected the vocabulary, one token per row of token_embd.weight (262)",),
    ),
    "tokens one short": (
        {"tokenizer.ggml.tokens": "one short"},
        ("tokenizer.ggml.tokens is an array of 261 strings, expected the vocabulary, one token per row",),
    ),
    "tokens of integers": (
        {"tokenizer.ggml.tokens": value(list(range(V)), T.ARRAY, U32)},
        ("tokenizer.ggml.tokens is an array of 262 uint32s, expected an array of strings",),
    ),
    "tokens not UTF-8": (
        {"tokenizer.ggml.tokens": "not utf-8"},
        ("tokenizer.ggml.tokens is text that is not UTF-8",),
    ),
    "token types too few": (
        {"tokenizer.ggml.token_type": value([1] * 10, T.ARRAY, I32)},
        ("tokenizer.ggml.token_type is an array of 10 values, expected one per token (262)",),
    ),
    "token types of strings": (
        {"tokenizer.ggml.token_type": value(["1"] * V, T.ARRAY, STR)},
        ("tokenizer.ggml.token_type is an array of 262 strings, expected an array of integers",),
    ),
    "merge without a space": (
        {"tokenizer.ggml.merges": value(["Ġ t", "he"], T.ARRAY, STR)},
        ("entry 1 of tokenizer.ggml.merges is 'he', expected two tokens joined by one space",),
    ),
    "merge outside the vocabulary": (
        {"tokenizer.ggml.merges": value(["Ġ t", "zz qq"], T.ARRAY, STR)},
        ("tokenizer.ggml.merges) make no BPE tokenizer",),
    ),
    "merges of integers": (
        {"tokenizer.ggml.merges": value([1, 2], T.ARRAY, U32)},
        ("tokenizer.ggml.merges is an array of 2 uint32s",),
    ),
    "eos id past the vocabulary": (
        {"tokenizer.ggml.eos_token_id": value(V, U32)},
        ("tokenizer.ggml.eos_token_id is 262, expected an id of the vocabulary, 0 .. 261", GGUF_FIX),
    ),
    "bos id past the vocabulary": ({"tokenizer.ggml.bos_token_id": value(10**6, U32)}, ("bos_token_id is 1000000",)),
    "unk id negative": ({"tokenizer.ggml.unknown_token_id": value(-1, I32)}, ("unknown_token_id is -1",)),
    "pad id past the vocabulary": (
        {"tokenizer.ggml.padding_token_id": value(V + 5, U32)},
        ("padding_token_id is 267",),
    ),
    "eos id a string": ({"tokenizer.ggml.eos_token_id": value("2", STR)}, ("eos_token_id is the string '2'",)),
    "add_bos a number": (
        {"tokenizer.ggml.add_bos_token": value(1, U32)},
        ("add_bos_token is the uint32 1, expected a bool",),
    ),
    "chat template a number": (
        {"tokenizer.chat_template": value(7, U32)},
        ("tokenizer.chat_template is the uint32 7",),
    ),
}


def _special_tokens(kind: str) -> Any:
    """The damaged token lists of GGUF_FIELDS: one short, or one token that is not UTF-8."""
    from test_pretrained import _byte_symbols

    tokens: list[Any] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols(), "Ġt", "he", "Ġthe"]
    if kind == "one short":
        tokens = tokens[:-1]
    else:
        tokens[100] = b"\xff\xfe"
    return value(tokens, T.ARRAY, STR)


def damaged_gguf(path: Path, edits: dict[str, Any], **kw: Any) -> Path:
    metadata = {k: _special_tokens(v) if isinstance(v, str) else v for k, v in edits.items()}
    write_llama_gguf(path, tied=False, metadata=metadata, **kw)
    return path


@pytest.mark.parametrize("case", list(GGUF_FIELDS), ids=list(GGUF_FIELDS))
def test_every_gguf_field_is_checked_and_named(tmp_path, case):
    edits, words = GGUF_FIELDS[case]
    path = damaged_gguf(tmp_path / "tiny.gguf", edits)
    refused(GGUFError, lambda: from_pretrained(path), f"'{path}'", *words)


def test_sentencepiece_scores_of_another_length_are_named(tmp_path):
    path = damaged_gguf(
        tmp_path / "spm.gguf", {"tokenizer.ggml.scores": value([0.0] * 5, T.ARRAY, F32)}, sentencepiece=True
    )
    refused(
        GGUFError,
        lambda: from_pretrained(path),
        "tokenizer.ggml.scores is an array of 5 values, expected one per token",
    )


# the reviewer's GGUF cases, through the command line as well: the same sentence, exit 2
CLI_GGUF = [
    "embedding_length missing",
    "head_count 0",
    "tokens missing",
    "eos id past the vocabulary",
    "head_count not dividing the width",
]


@pytest.mark.parametrize("case", CLI_GGUF)
def test_gguf_field_errors_are_one_line_on_the_command_line(tmp_path, capsys, case):
    edits, words = GGUF_FIELDS[case]
    path = damaged_gguf(tmp_path / "tiny.gguf", edits)
    message = refused(GGUFError, lambda: from_pretrained(path), *words)
    assert cli_error(capsys, "generate", "--model", str(path), "--prompt", "hi") == message


@pytest.mark.parametrize(
    "command", [["inspect", "--model"], ["bench-decode", "--model"]], ids=["inspect", "bench-decode"]
)
def test_inspect_and_bench_decode_print_the_same_sentence(tmp_path, capsys, command):
    path = damaged_gguf(tmp_path / "tiny.gguf", {"llama.attention.head_count": value(0, U32)})
    assert "llama.attention.head_count is 0" in cli_error(capsys, *command, str(path), progress=True)


# -- GGUF structure: truncation, absurd counts and shapes -------------------------------------------


@pytest.fixture(scope="module")
def gguf_template(tmp_path_factory) -> tuple[bytes, Any]:
    """The bytes of an intact tiny GGUF and its layout (offsets of fields, tensor entries and data)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_llama_gguf(path, tied=False)
    reader = gguf.GGUFReader(path)
    layout = {
        "fields": {k: f.offset for k, f in reader.fields.items()},
        "tensors": {
            t.name: (t.field.offset, int(t.data_offset), len(t.shape), t.tensor_type.name) for t in reader.tensors
        },
        "data": int(reader.data_offset),
    }
    return path.read_bytes(), layout


def _patched(tmp_path: Path, blob: bytes | bytearray) -> Path:
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(blob))
    return path


def _tensor_entry(layout: dict, name: str) -> dict[str, int]:
    """Byte offsets of the parts of tensor ``name``'s entry in the header."""
    start, _, n_dims, _ = layout["tensors"][name]
    dims = start + 8 + len(name) + 4
    return {"n_dims": dims - 4, "dims": dims, "type": dims + 8 * n_dims, "offset": dims + 8 * n_dims + 4}


def _array_count(key: str) -> Callable[[dict], int]:
    """Where the u64 count of metadata array ``key`` is (after its key, value type and item type)."""
    return lambda layout: layout["fields"][key] + 8 + len(key) + 4 + 4


_tokens_count = _array_count("tokenizer.ggml.tokens")


def _cut(at: Callable[[bytes, dict], int]) -> Callable[[bytes, dict], bytes]:
    return lambda blob, layout: blob[: at(blob, layout)]


def _put(at: Callable[[dict], int], fmt: str, *v: int) -> Callable[[bytes, dict], bytes]:
    def patch(blob: bytes, layout: dict) -> bytes:
        b = bytearray(blob)
        struct.pack_into(fmt, b, at(layout), *v)
        return bytes(b)

    return patch


def _rename(old: bytes, new: bytes) -> Callable[[bytes, dict], bytes]:
    return lambda blob, layout: blob.replace(old, new, 1)


# id -> (damage of the intact bytes, words of the message)
GGUF_STRUCTURE: dict[str, tuple[Callable[[bytes, dict], bytes], str]] = {
    "empty": (lambda b, lo: b"", "shorter than the 24 bytes of a GGUF header; 0 bytes"),
    "cut in the magic": (_cut(lambda b, lo: 3), "shorter than the 24 bytes"),
    "cut in the counts": (_cut(lambda b, lo: 20), "shorter than the 24 bytes"),
    "cut after the counts": (_cut(lambda b, lo: 24), "more than its bytes can hold"),
    "cut in a key": (_cut(lambda b, lo: lo["fields"]["tokenizer.ggml.bos_token_id"] + 10), "the key of metadata entry"),
    "cut in the vocabulary": (
        _cut(lambda b, lo: lo["fields"]["tokenizer.ggml.tokens"] + 500),
        "the value of metadata key 'tokenizer.ggml.tokens'",
    ),
    "cut in the tensor table": (
        _cut(lambda b, lo: _tensor_entry(lo, "blk.0.attn_q.weight")["dims"] + 6),
        "tensor 'blk.0.attn_q.weight'",
    ),
    "cut at the data": (_cut(lambda b, lo: lo["data"]), "the data of tensor 'token_embd.weight'"),
    "cut in the data": (_cut(lambda b, lo: (lo["data"] + len(b)) // 2), "past the end of the file"),
    "cut by one byte": (_cut(lambda b, lo: len(b) - 1), "the data of tensor 'output.weight'"),
    "not GGUF": (lambda b, lo: b"PK\x03\x04" + b[4:], "it starts with b'PK\\x03\\x04', not the magic b'GGUF'"),
    "version 99": (_put(lambda lo: 4, "<I", 99), "GGUF version 99"),
    "vocabulary of 2^60 tokens": (_put(_tokens_count, "<Q", 1 << 60), "claims 1152921504606846976 entries"),
    # gguf.GGUFReader loops on this one until memory runs out (MemoryError under a 3 GB ulimit, measured)
    "2^60 uint8s": (
        _put(lambda lo: _array_count("tokenizer.ggml.token_type")(lo) - 4, "<IQ", 0, 1 << 60),
        "claims 1152921504606846976 entries, at least 1152921504606846976 bytes",
    ),
    "an array of a type that does not exist": (
        _put(lambda lo: _tokens_count(lo) - 4, "<I", 77),
        "an array of GGUF type 77, which does not exist",
    ),
    "a million metadata keys": (_put(lambda lo: 16, "<Q", 10**6), "claims 1000000 metadata entries"),
    "a key twice": (_rename(b"tokenizer.ggml.eos_token_id", b"tokenizer.ggml.bos_token_id"), "appears twice"),
    "a key not UTF-8": (_rename(b"general.architecture", b"general.architectur\xff"), "is not UTF-8 text"),
    "a tensor of 5 dims": (
        _put(lambda lo: _tensor_entry(lo, "output_norm.weight")["n_dims"], "<I", 5),
        "claims 5 dimensions, more than GGML's 4",
    ),
    "dims whose product overflows": (
        _put(lambda lo: _tensor_entry(lo, "blk.0.ffn_up.weight")["dims"], "<QQ", 1 << 62, 1 << 62),
        "tensor 'blk.0.ffn_up.weight' claims dims [4611686018427387904, 4611686018427387904], 2.13e+37 elements",
    ),
    "dims larger than the file": (
        _put(lambda lo: _tensor_entry(lo, "blk.0.ffn_up.weight")["dims"] + 8, "<Q", 1 << 40),
        "the data of tensor 'blk.0.ffn_up.weight' (dims [64, 1099511627776]) spans bytes",
    ),
    "an unknown ggml type": (
        _put(lambda lo: _tensor_entry(lo, "blk.0.ffn_up.weight")["type"], "<I", 99),
        "tensor 'blk.0.ffn_up.weight' has ggml type 99",
    ),
    "a quantized row not a whole block": (
        _put(lambda lo: _tensor_entry(lo, "token_embd.weight")["dims"], "<Q", 48),
        "a first dimension of 48, not a multiple of its type's block of 32",
    ),
    "an offset past the end": (
        _put(lambda lo: _tensor_entry(lo, "output.weight")["offset"], "<Q", 1 << 40),
        "the data of tensor 'output.weight' (dims [64, 262]) spans bytes",
    ),
    "an offset not aligned": (
        _put(lambda lo: _tensor_entry(lo, "output.weight")["offset"], "<Q", 3),
        "has offset 3, not a multiple of the file's alignment 32",
    ),
    "two tensors on the same bytes": (
        _put(lambda lo: _tensor_entry(lo, "blk.0.attn_k.weight")["offset"], "<Q", 0),
        "overlap",
    ),
}


@pytest.mark.parametrize("case", list(GGUF_STRUCTURE), ids=list(GGUF_STRUCTURE))
def test_a_damaged_gguf_header_is_refused_before_the_reader_trusts_it(tmp_path, gguf_template, case):
    damage, words = GGUF_STRUCTURE[case]
    blob, layout = gguf_template
    path = _patched(tmp_path, damage(blob, layout))
    refused(GGUFError, lambda: from_pretrained(path), f"'{path}' is not a readable GGUF file (", words, GGUF_FIX)


def test_a_bad_alignment_is_named(tmp_path):
    path = damaged_gguf(tmp_path / "tiny.gguf", {"general.alignment": value(3, U32)})
    refused(GGUFError, lambda: from_pretrained(path), "general.alignment is 3, expected a power of two")


def test_a_truncated_gguf_on_the_command_line(tmp_path, capsys, gguf_template):
    blob, _ = gguf_template
    path = _patched(tmp_path, blob[: len(blob) - 1000])
    message = refused(GGUFError, lambda: from_pretrained(path), "past the end of the file")
    assert cli_error(capsys, "generate", "--model", str(path), "--prompt", "hi") == message


# -- GGUF bit rot: damage inside the data, which no header shows -------------------------------------


def _f16_scale(blob: bytes, layout: dict, tensor: str, bits: int) -> bytes:
    """``blob`` with the fp16 scale of the first quantized block of ``tensor`` set to ``bits``."""
    _, start, _, kind = layout["tensors"][tensor]
    assert kind == "Q8_0"  # a block: fp16 scale d, then 32 int8 values; weight = d * q
    b = bytearray(blob)
    struct.pack_into("<H", b, start, bits)
    return bytes(b)


@pytest.mark.parametrize(
    "bits, words",
    [(0x7C00, "holds an infinite value"), (0x7E00, "holds NaN"), (0x7753, "holds a weight of 3.81e+06")],
    ids=["inf scale", "nan scale", "finite scale of 30000"],
)
def test_one_damaged_block_scale_is_caught(tmp_path, gguf_template, bits, words):
    """A Q8_0 scale of 30000 is a finite float16, but 30000 * 127 is beyond anything fp16 holds: caught by the bound."""
    blob, layout = gguf_template
    path = _patched(tmp_path, _f16_scale(blob, layout, "blk.1.ffn_down.weight", bits))
    refused(GGUFError, lambda: from_pretrained(path), "tensor 'blk.1.ffn_down.weight'", words, "damaged", GGUF_FIX)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_bytes_in_the_middle_of_the_data_are_caught(tmp_path, capsys, gguf_template, seed):
    """Bit rot: the file keeps its size and header, 16 KiB in the middle of the tensor data are random."""
    blob, layout = gguf_template
    middle = (layout["data"] + len(blob)) // 2
    b = bytearray(blob)
    b[middle : middle + 16384] = np.random.default_rng(seed).bytes(16384)
    path = _patched(tmp_path, b)
    message = refused(GGUFError, lambda: from_pretrained(path), f"'{path}': tensor '", "damaged", GGUF_FIX)
    if seed == 0:
        assert cli_error(capsys, "generate", "--model", str(path), "--prompt", "hi") == message


def test_four_mib_of_random_bytes_in_smollm2_are_caught(tmp_path, capsys):
    """The reviewer's case on the real file: full size, 4 MiB in the middle overwritten; it loaded and
    generated nothing (or raised "probability tensor contains inf, nan") before."""
    from attnlab.weight_files.pretrained import smollm2_path
    from smollm2_fixtures import require_smollm2

    require_smollm2()
    path = tmp_path / "smollm2.gguf"
    shutil.copyfile(smollm2_path(), path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(np.random.default_rng(0).bytes(4 << 20))
    message = cli_error(capsys, "generate", "--model", str(path), "--prompt", "hi")
    assert f"'{path}': tensor '" in message and "damaged" in message and GGUF_FIX in message


# -- Hugging Face directories: safetensors headers, config.json, tokenizers --------------------------


@pytest.fixture(scope="module")
def hf_template(tmp_path_factory) -> Path:
    """A save_pretrained directory of a 2-layer Llama (GQA 4/2, width 32): config.json, generation_config.json,
    model.safetensors; copied by each test before it damages it."""
    directory = tmp_path_factory.mktemp("hf") / "llama"
    hf_llama().save_pretrained(directory)
    return directory


@pytest.fixture
def hf_dir(tmp_path, hf_template) -> Path:
    return Path(shutil.copytree(hf_template, tmp_path / "llama"))


def _split_safetensors(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _rewrite(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _edit_entry(name: str, **changes: Any) -> Callable[[dict, bytes], bytes]:
    def edit(header: dict, data: bytes) -> bytes:
        header[name] = {**header[name], **changes}
        return _rewrite(header, data)

    return edit


EMBED = "model.embed_tokens.weight"  # (64, 32) float32: 8192 bytes


def _first_offsets(header: dict) -> list[int]:
    return sorted((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[0])[0]


def _same_bytes_as_first(header: dict, data: bytes) -> bytes:
    """One more tensor placed on the bytes of the first one."""
    first = next(k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][0] == 0)
    header["model.extra"] = dict(header[first])
    return _rewrite(header, data)


def _hole(header: dict, data: bytes) -> bytes:
    """Every tensor shifted 64 bytes on: the first 64 bytes of data belong to none."""
    for k, v in header.items():
        if k != "__metadata__":
            v["data_offsets"] = [o + 64 for o in v["data_offsets"]]
    return _rewrite(header, b"\0" * 64 + data)


# id -> (new bytes of model.safetensors from (header, data) or the file's bytes, words of the message)
SAFETENSORS: dict[str, tuple[Callable[..., bytes], str]] = {
    "empty": (lambda blob: b"", "shorter than the 8 bytes that give the header's length; 0 bytes"),
    "cut in the length": (lambda blob: blob[:5], "shorter than the 8 bytes"),
    "cut in the header": (lambda blob: blob[:100], "past the end of the file"),
    "cut after the header": (
        lambda blob: blob[: 8 + int.from_bytes(blob[:8], "little")],
        "but the data after the header holds 0 bytes",
    ),
    "half-written": (lambda blob: blob[: len(blob) // 2], "but the data after the header holds"),
    "cut by one byte": (lambda blob: blob[:-1], "but the data after the header holds"),
    "trailing bytes": (lambda blob: blob + b"\0" * 100, "describes"),
    "header length of 2^40": (lambda blob: (1 << 40).to_bytes(8, "little") + blob[8:], "more than safetensors' limit"),
    "header not JSON": (lambda blob: (20).to_bytes(8, "little") + b"{not json at all!!!}" + blob, "header is not JSON"),
    "header a list": (lambda blob: _rewrite([1, 2], b""), "its header is a JSON list, not an object"),  # type: ignore[arg-type]
    "metadata not strings": (lambda h, d: _rewrite({**h, "__metadata__": {"format": 1}}, d), "__metadata__"),
    "entry not an object": (lambda h, d: _rewrite({**h, EMBED: 5}, d), f"tensor '{EMBED}' has header entry 5"),
    "unknown dtype": (_edit_entry(EMBED, dtype="F17"), "has dtype 'F17', not one of safetensors'"),
    "shape of strings": (_edit_entry(EMBED, shape=[64, "32"]), "has shape [64, '32'], not a list of non-negative"),
    "negative shape": (_edit_entry(EMBED, shape=[-64, -32]), "has shape [-64, -32]"),
    "one offset": (_edit_entry(EMBED, data_offsets=[0]), "has data_offsets [0], not [begin, end]"),
    "offsets reversed": (_edit_entry(EMBED, data_offsets=[8192, 0]), "has data_offsets [8192, 0]"),
    "offsets past the end": (_edit_entry(EMBED, data_offsets=[0, 10**9]), "data_offsets [0, 1000000000]"),
    "shape against its bytes": (_edit_entry(EMBED, shape=[64, 31]), "has shape [64, 31] of F32, 7936 bytes, but its"),
    "shape whose product overflows": (
        _edit_entry(EMBED, shape=[2**40, 2**40, 2**40]),
        "has shape [1099511627776, 1099511627776, 1099511627776] of F32, 5.32e+36 bytes",
    ),
    "two tensors on the same bytes": (_same_bytes_as_first, "overlap"),
    "a hole": (_hole, "bytes 0..64 of the data, before tensor"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS), ids=list(SAFETENSORS))
def test_every_kind_of_safetensors_damage_is_named(hf_dir, case):
    damage, words = SAFETENSORS[case]
    weights = hf_dir / "model.safetensors"
    blob = weights.read_bytes()
    try:
        damaged = damage(blob)
    except TypeError:  # a damage of (header, data)
        damaged = damage(*_split_safetensors(weights))
    weights.write_bytes(damaged)
    refused(
        ModelFileError,
        lambda: from_pretrained(hf_dir),
        f"'{weights}' is not a readable safetensors file (",
        words,
        "damaged or was cut short",
        HF_FIX,
    )


def test_a_half_written_safetensors_on_the_command_line(hf_dir, capsys):
    """The reviewer's case: it was ``SafetensorError: incomplete metadata``."""
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = refused(ModelFileError, lambda: from_pretrained(hf_dir), "model.safetensors' is not a readable", HF_FIX)
    assert "save_checkpoint" not in message
    assert cli_error(capsys, "generate", "--model", str(hf_dir), "--prompt", "hi") == message


def test_integer_weights_are_named(hf_dir):
    weights = hf_dir / "model.safetensors"
    weights.write_bytes(_edit_entry(EMBED, dtype="I32")(*_split_safetensors(weights)))
    refused(
        ModelFileError, lambda: from_pretrained(hf_dir), f"the dtype of tensor '{EMBED}' is I32, expected a float dtype"
    )


def test_nan_inside_safetensors_data_is_named(hf_dir):
    weights = hf_dir / "model.safetensors"
    header, data = _split_safetensors(weights)
    begin = header["model.norm.weight"]["data_offsets"][0]
    damaged = bytearray(data)
    damaged[begin : begin + 4] = b"\xff\xff\xff\xff"  # a float32 NaN
    weights.write_bytes(_rewrite(header, bytes(damaged)))
    refused(ModelFileError, lambda: from_pretrained(hf_dir), "tensor 'model.norm.weight' holds NaN", HF_FIX)


def _edit_config(directory: Path, **changes: Any) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key, v in changes.items():
        if v is None:
            config.pop(key, None)
        else:
            config[key] = v
    (directory / "config.json").write_text(json.dumps(config))


# id -> (config.json changes (None drops the key), words of the message)
CONFIG_FIELDS: dict[str, tuple[dict[str, Any], str]] = {
    "model_type missing": ({"model_type": None}, "model_type is missing, expected 'llama' or 'gpt2'"),
    "model_type a number": ({"model_type": 5}, "model_type is 5"),
    "hidden_size missing": (
        {"hidden_size": None},
        "hidden_size is missing, expected a positive integer (the residual width)",
    ),
    "hidden_size a string": ({"hidden_size": "32"}, "hidden_size is '32', expected a positive integer"),
    "hidden_size true": ({"hidden_size": True}, "hidden_size is True"),
    "hidden_size 0": ({"hidden_size": 0}, "hidden_size is 0"),
    "vocab_size negative": ({"vocab_size": -64}, "vocab_size is -64"),
    "num_hidden_layers a float": ({"num_hidden_layers": 2.0}, "num_hidden_layers is 2.0"),
    "intermediate_size dropped": ({"intermediate_size": None}, "intermediate_size is missing"),
    "heads not dividing the width": (
        {"num_attention_heads": 3},
        "num_attention_heads is 3, expected a divisor of hidden_size = 32 leaving an even head dim",
    ),
    "heads leaving an odd head dim": (
        {"num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None},
        "even head dim",
    ),
    "kv heads not dividing the heads": (
        {"num_key_value_heads": 3},
        "num_key_value_heads is 3, expected a divisor of num_attention_heads = 4",
    ),
    "kv heads 0": ({"num_key_value_heads": 0}, "num_key_value_heads is 0"),
    "max_position_embeddings 0": ({"max_position_embeddings": 0}, "max_position_embeddings is 0"),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-6}, "rms_norm_eps is -1e-06, expected a positive finite number"),
    "tie_word_embeddings a string": (
        {"tie_word_embeddings": "yes"},
        "tie_word_embeddings is 'yes', expected true or false",
    ),
    "rope_parameters a list": ({"rope_parameters": [10000.0]}, "rope_parameters is [10000.0], expected a JSON object"),
    "rope theta 0": ({"rope_parameters": {"rope_theta": 0, "rope_type": "default"}}, "rope_parameters.rope_theta is 0"),
    "hidden_act a number": ({"hidden_act": 1}, "hidden_act is 1, expected a string"),
    "width against the weights": (
        {"hidden_size": 48, "head_dim": None},
        "but its config.json implies",
    ),
    "layers against the weights": ({"num_hidden_layers": 3}, "lacks 9 tensor(s) its config.json implies"),
}


@pytest.mark.parametrize("case", list(CONFIG_FIELDS), ids=list(CONFIG_FIELDS))
def test_every_config_json_field_is_checked_and_named(hf_dir, case):
    changes, words = CONFIG_FIELDS[case]
    _edit_config(hf_dir, **changes)
    message = refused(ModelFileError, lambda: from_pretrained(hf_dir), str(hf_dir), words, HF_FIX)
    assert "save_checkpoint" not in message


def test_heads_not_dividing_the_width_on_the_command_line(hf_dir, capsys):
    """The reviewer's case: it was transformers' ``StrictDataclassClassValidationError``, naming no file."""
    _edit_config(hf_dir, num_attention_heads=3)
    message = refused(
        ModelFileError, lambda: from_pretrained(hf_dir), f"'{hf_dir / 'config.json'}': num_attention_heads is 3"
    )
    assert cli_error(capsys, "generate", "--model", str(hf_dir), "--prompt", "hi") == message


def test_transformers_own_config_errors_are_rephrased_naming_the_file(hf_dir):
    """A value only transformers checks (here a layer type it does not know) still names config.json."""
    _edit_config(hf_dir, layer_types=["bogus", "bogus"])
    refused(
        ModelFileError,
        lambda: from_pretrained(hf_dir),
        f"'{hf_dir / 'config.json'}' is not a config transformers accepts (",
        HF_FIX,
    )


def test_gpt2_config_fields_are_checked(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    directory = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)).save_pretrained(
        directory
    )
    _edit_config(directory, n_head=3)
    refused(
        ModelFileError, lambda: from_pretrained(directory), "n_head is 3, expected a divisor of n_embd = 32", HF_FIX
    )
    _edit_config(directory, n_head=4, n_embd=None)
    refused(ModelFileError, lambda: from_pretrained(directory), "n_embd is missing, expected a positive integer")


def _truncate_config(fraction: float) -> Callable[[Path], None]:
    def cut(directory: Path) -> None:
        text = (directory / "config.json").read_bytes()
        (directory / "config.json").write_bytes(text[: int(len(text) * fraction)])

    return cut


# id -> damage of an HF directory whose config.json can no longer say what it is
HF_CONFIG_DAMAGE: dict[str, Callable[[Path], None]] = {
    "config cut at 10%": _truncate_config(0.1),
    "config cut at 50%": _truncate_config(0.5),
    "config cut at 99%": _truncate_config(0.99),
    "config empty": _truncate_config(0.0),
    "config random bytes": lambda d: (d / "config.json").write_bytes(np.random.default_rng(0).bytes(200)),
    "config cut at 10%, no generation_config.json": lambda d: (
        _truncate_config(0.1)(d),
        (d / "generation_config.json").unlink(),
    ),
}


@pytest.mark.parametrize("case", list(HF_CONFIG_DAMAGE), ids=list(HF_CONFIG_DAMAGE))
def test_a_damaged_hf_config_gets_the_hugging_face_fix(hf_dir, case):
    """It was sent to load_checkpoint, whose fix (save_checkpoint) is for attnlab's own directories."""
    HF_CONFIG_DAMAGE[case](hf_dir)
    message = refused(
        ModelFileError, lambda: from_pretrained(hf_dir), f"'{hf_dir / 'config.json'}' is not valid JSON (", HF_FIX
    )
    assert "save_checkpoint" not in message


def test_missing_hf_files_are_not_found_errors(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    info = refused(
        ModelFileNotFoundError, lambda: from_pretrained(hf_dir), "has a config.json but no *.safetensors weights"
    )
    assert info
    index = {"weight_map": {EMBED: "model-00001-of-00002.safetensors"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(FileNotFoundError, lambda: from_pretrained(hf_dir), "lists the shard 'model-00001-of-00002.safetensors'")


def test_pickle_weights_are_refused_by_name(hf_dir):
    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    refused(
        ModelFileError, lambda: from_pretrained(hf_dir), "holds pytorch_model.bin (pickle), which attnlab never loads"
    )


# -- tokenizer files of an HF directory -----------------------------------------------------------


@pytest.fixture
def hf_dir_with_tokenizer(hf_dir) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), unk_token="t0"
    )
    tokenizer.save_pretrained(hf_dir)
    assert from_pretrained(hf_dir)[1] is not None  # intact, it loads
    return hf_dir


TOKENIZER_DAMAGE: dict[str, tuple[str, bytes, str]] = {
    "tokenizer.json cut short": ("tokenizer.json", b'{"version": "1.0", "trunc', "tokenizer.json' is not valid JSON ("),
    "tokenizer.json not UTF-8": ("tokenizer.json", b"\xff\xfe\x00", "tokenizer.json' is not valid JSON (not UTF-8"),
    "tokenizer.json a list": (
        "tokenizer.json",
        b"[1, 2]",
        "tokenizer.json' holds a JSON list, expected one JSON object",
    ),
    "tokenizer.json of no tokenizer": (
        "tokenizer.json",
        b'{"model": 5}',
        "transformers could not build its tokenizer (",
    ),
    "tokenizer_config.json empty": ("tokenizer_config.json", b"", "tokenizer_config.json' is not valid JSON ("),
}


@pytest.mark.parametrize("case", list(TOKENIZER_DAMAGE), ids=list(TOKENIZER_DAMAGE))
def test_a_damaged_tokenizer_file_is_named(hf_dir_with_tokenizer, case):
    name, content, words = TOKENIZER_DAMAGE[case]
    (hf_dir_with_tokenizer / name).write_bytes(content)
    refused(ModelFileError, lambda: from_pretrained(hf_dir_with_tokenizer), words, "tokenizer.save_pretrained(dir)")


# -- memory: configs whose weights cannot fit this machine ---------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48),
        LlamaConfig(n_layer=2, tie_embeddings=False, attention_bias=True, mlp_bias=True, n_kv_head=9),
        LlamaConfig(vocab_size=10, n_layer=1, n_head=2, n_kv_head=1, n_embd=8, intermediate_size=3),
    ],
    ids=["gqa", "smollm2-wide-untied-biases", "mqa"],
)
def test_llama_weight_count_is_the_models(config):
    with torch.device("meta"):
        assert file_checks.llama_weight_count(config) == sum(p.numel() for p in Llama(config).parameters())


@pytest.mark.parametrize(
    "flags",
    [{}, {"bias": False, "n_kv_head": 1, "position": "rotary"}, {"n_kv_head": 2}],
    ids=["gpt2", "rotary-mqa-no-bias", "gqa"],
)
def test_gpt_weight_count_is_the_models(flags):
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=4, n_embd=32, **flags)
    with torch.device("meta"):
        assert file_checks.gpt_weight_count(config) == sum(p.numel() for p in TinyGPT(config).parameters())


HUGE = {"hidden_size": 10**6, "head_dim": None, "intermediate_size": 48}


@pytest.mark.parametrize(
    "changes, words",
    [
        (HUGE, "hidden_size=1000000"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
        ({"vocab_size": 10**12}, "vocab_size=1000000000000"),
    ],
    ids=["width 10^6", "10^9 layers", "vocabulary 10^12"],
)
def test_an_hf_config_too_large_for_this_machine_is_refused_quickly(hf_dir, changes, words):
    _edit_config(hf_dir, **changes)
    refused(
        LimitError,
        lambda: from_pretrained(hf_dir),
        f"'{hf_dir / 'config.json'}' describes a model of",
        words,
        "it does not fit",
    )


def test_a_gguf_too_large_for_this_machine_is_refused(tmp_path):
    edits = {"llama.embedding_length": value(10**6, U32), "llama.rope.dimension_count": None}
    path = damaged_gguf(tmp_path / "tiny.gguf", edits)
    # the float model the metadata describes (dtype="gguf", the default where the kernels are built, holds the
    # file's own tensors, so there it is the tensors' shapes that refuse this file)
    refused(
        LimitError, lambda: from_pretrained(path, dtype="float32"), "llama.embedding_length=1000000", "MemAvailable"
    )


def test_an_attnlab_checkpoint_too_large_for_this_machine_is_refused(tmp_path):
    save_checkpoint(TinyGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)), tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["config"]["n_embd"] = 10**6
    (tmp_path / "config.json").write_text(json.dumps(meta))
    refused(LimitError, lambda: from_pretrained(tmp_path), "n_embd=1000000", "does not fit")


def test_the_limit_gives_the_figures_and_a_dtype_that_fits(hf_dir, monkeypatch):
    """With the machine's memory set by hand: refused in float32 with the figures, told that bfloat16 fits."""
    weights = file_checks.llama_weight_count(
        LlamaConfig(
            vocab_size=64,
            block_size=64,
            n_layer=2,
            n_head=4,
            n_kv_head=2,
            n_embd=32,
            intermediate_size=48,
            tie_embeddings=False,
        )
    )
    monkeypatch.setattr(file_checks, "available_bytes", lambda device: 3 * weights)
    need, free = gib(4 * weights), gib(3 * weights)
    message = refused(
        LimitError, lambda: from_pretrained(hf_dir), f"{weights:.4g} weights", f"{need} in float32", f"has {free}"
    )
    assert "pass dtype=torch.bfloat16" in message
    model, _ = from_pretrained(hf_dir, dtype=torch.bfloat16)  # 2 bytes a weight: it fits
    assert model.embed.weight.dtype == torch.bfloat16


# -- sources that are no model file --------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, words",
    [
        (None, "got NoneType None"),
        (5, "got int 5"),
        (b"model.gguf", "got bytes"),
        ("", "got str ''"),
        (["x"], "got list"),
    ],
    ids=["None", "int", "bytes", "empty", "list"],
)
def test_a_source_that_is_no_path_is_a_usage_error(source, words):
    message = refused(
        UsageError,
        lambda: from_pretrained(source),
        "source must be 'smollm2', a .gguf file or a model directory",
        words,
    )
    assert "from_pretrained('smollm2')" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_cuda_on_a_cpu_build_is_a_usage_error(hf_dir):
    """It was ``AssertionError: Torch not compiled with CUDA enabled``, after reading the files."""
    refused(
        UsageError, lambda: from_pretrained(hf_dir, device="cuda"), "device 'cuda', but this torch", "use device cpu"
    )


@pytest.mark.parametrize(
    "device, words", [("tpu", "is not a device name"), (torch.device("meta"), "attnlab runs on cpu, cuda or mps")]
)
def test_other_bad_devices_are_usage_errors(hf_dir, device, words):
    refused(UsageError, lambda: from_pretrained(hf_dir, device=device), words)


def test_missing_files_are_model_file_not_found_errors(tmp_path):
    nowhere, missing = tmp_path / "nowhere", tmp_path / "missing.gguf"
    refused(ModelFileNotFoundError, lambda: from_pretrained(nowhere), f"'{nowhere}'", "nothing is at that path")
    refused(GGUFNotFoundError, lambda: from_pretrained(missing), f"'{missing}' does not exist")
    for source in (nowhere, missing):
        with pytest.raises(FileNotFoundError):
            from_pretrained(source)
    (tmp_path / "empty").mkdir()
    refused(ModelFileNotFoundError, lambda: from_pretrained(tmp_path / "empty"), "has no config.json")


def test_a_damaged_attnlab_checkpoint_keeps_its_own_fix(tmp_path):
    """A directory that save_checkpoint wrote still says save_checkpoint, and bit rot inside it is named."""
    model = TinyGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    save_checkpoint(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    header, data = _split_safetensors(weights)
    begin = header["transformer.ln_f.weight"]["data_offsets"][0]
    damaged = bytearray(data)
    damaged[begin : begin + 4] = struct.pack("<f", float("inf"))
    weights.write_bytes(_rewrite(header, bytes(damaged)))
    refused(
        CheckpointError,
        lambda: from_pretrained(tmp_path),
        "tensor 'transformer.ln_f.weight' holds an infinite value",
        "save_checkpoint",
    )
    for damaged in ('{"format": "attnlab.TinyGPT", "conf', '{"form'):  # the weights' header says who wrote it too
        (tmp_path / "config.json").write_text(damaged)
        refused(
            CheckpointError, lambda: from_pretrained(tmp_path), "config.json' is not valid JSON (", "save_checkpoint"
        )


def test_a_directory_of_nobody_gets_both_fixes(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    refused(
        ModelFileError,
        lambda: from_pretrained(tmp_path),
        "config.json' is not valid JSON (",
        "save_pretrained",
        "save_checkpoint",
    )
