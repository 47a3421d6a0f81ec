"""Llama-architecture GGUF files (llama.cpp's format) -> :class:`attnlab.models.llama.Llama` + tokenizer.

Read with the ``gguf`` package (maintained with llama.cpp): :class:`gguf.GGUFReader` maps the
file, :func:`gguf.quants.dequantize` unpacks each tensor (Q4_1, Q8_0, K-quants, F16, ...) to
float32. The weights are copied into a model allocated once in the requested dtype, a slice of
rows at a time, so that loading never holds more than the model plus one slice (and the file's
pages, which the OS maps and may drop).

**Q/K row order.** llama.cpp rotates channel pairs ``(2i, 2i + 1)`` of a head; Hugging Face and
attnlab rotate ``(i, i + D/2)``. llama.cpp's converter therefore permutes the rows of ``attn_q`` and
``attn_k`` within each head (``convert_hf_to_gguf.py``: ``w.reshape(n_head, 2, D/2, E).swapaxes(1, 2)``);
:func:`~attnlab.models.weight_maps.unpermute_qk` applies the inverse as each tensor is copied, as
transformers' GGUF loader does, so that RoPE pairs the same channels as the model was trained with.

**Tokenizer.** Built from the file's own vocabulary, merges, special tokens and chat template
with Hugging Face ``tokenizers`` (the BPE itself) and wrapped in :class:`~attnlab.weight_files.bpe_tokenizer.BPETokenizer`
(transformers' tokenizer API, ``apply_chat_template``, ``decode``, without importing transformers). The pre-tokenizer, which GGUF
names rather than stores (``tokenizer.ggml.pre``), is rebuilt from llama.cpp's definition of that
name; an unknown one is refused rather than guessed.

GGUF tensor names: ``token_embd``, ``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
ffn_norm, ffn_gate, ffn_up, ffn_down}``, ``output_norm``, ``output`` (absent when tied); their
attnlab names are :func:`~attnlab.models.weight_maps.llama_name_from_gguf`.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import re
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from ..models.llama_config import LlamaConfig
from ..models.weight_maps import GGUF_BLOCK_NAMES, llama_name_from_gguf, unpermute_qk
from ..quant import FORMATS, QuantEmbedding, QuantLinear
from ..quant import dequantize as dequantize_kept
from ..runtime import ModelFileError, ModelFileNotFoundError, import_advice
from .bpe_tokenizer import BPETokenizer
from .file_checks import FP16_MAX, check_complete, check_gguf_layout, check_values, field_error

if TYPE_CHECKING:  # annotations only: gguf and transformers are imported when a file is read
    from gguf import GGUFReader, ReaderField, ReaderTensor
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "GGUFError",
    "GGUFNotFoundError",
    "open_gguf",
    "llama_config_from_gguf",
    "check_gguf_tensors",
    "load_gguf_weights",
    "keep_quantized",
    "tokenizer_from_gguf",
    "release_vocabulary",
]

_ROWS_PER_SLICE_BYTES = 4 << 20  # float32 bytes dequantized at a time: bounds the loader's working memory
# The fix for metadata that is absent, mistyped or inconsistent: damage, or a converter's bug.
_FIX_METADATA = (
    "the file is damaged or was written by a faulty converter: copy it again, or convert the model again with "
    "llama.cpp's convert_hf_to_gguf.py"
)
_FIX_DATA = "copy it again (or download it again)"


class GGUFError(ModelFileError):
    """A GGUF file attnlab cannot read: damaged, inconsistent, or of an architecture it does not have."""


class GGUFNotFoundError(GGUFError, ModelFileNotFoundError):
    """A GGUF path where no file is."""


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A :class:`gguf.GGUFReader` on ``path`` (memory-mapped: tensor data is read when touched).

    The header is walked first (:func:`~.file_checks.check_gguf_layout`): the reader trusts every
    length and count in it, and a damaged one would make it fail on a raw ``IndexError`` or loop
    over an array of 2^60 entries.
    """
    path = Path(path)
    if not path.is_file():
        state = "is a directory" if path.is_dir() else "does not exist"
        raise GGUFNotFoundError(
            f"GGUF file {str(path)!r} {state}, expected a .gguf file; pass the path of a .gguf file "
            f"(or 'smollm2', or a Hugging Face directory)."
        )
    try:
        import gguf  # noqa: F401  (each call: the class below is cached, a missing or broken package is not)

        reader_class = _compact_reader()
    except Exception as err:  # not installed, or broken: the advice tells which
        raise GGUFError(import_advice("gguf", f"reading {str(path)!r} needs the gguf package", err)) from None
    check_gguf_layout(path, GGUFError)
    try:
        return reader_class(path)
    except (ValueError, OSError, IndexError, KeyError, struct.error) as e:  # what the walk above does not foresee
        raise GGUFError(
            f"{str(path)!r} is not a readable GGUF file ({e}); it is damaged or was cut short: copy it again."
        ) from None


class _ArrayParts(Sequence):
    """The ``parts`` of an array field as :class:`gguf.ReaderField` lists them (the field's key, its type, the
    array's item type and length, then each item's arrays), each item's made when it is indexed."""

    def __init__(self, head: list[np.ndarray], per_item: int, item: Callable[[int], list[np.ndarray]], n: int):
        self._head, self._per_item, self._item, self._n = head, per_item, item, n

    def __len__(self) -> int:
        return len(self._head) + self._per_item * self._n

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(f"part {index} of {len(self)}")
        if i < len(self._head):
            return self._head[i]
        item, part = divmod(i - len(self._head), self._per_item)
        return self._item(item)[part]


@functools.cache
def _compact_reader() -> type[GGUFReader]:
    """:class:`gguf.GGUFReader` whose array fields hold one array, or one array of offsets for strings, in place of
    a few numpy views per item (each item's made when read, :class:`_ArrayParts`).

    For SmolLM2's 49k tokens, 49k merges, token types and scores the package's reader made ~500k objects (~160 MB);
    freed after the tokenizer is built they left ~20 MB of Python's object arenas pinned by the few objects made
    meanwhile that stay (measured: 94 arenas of 1 MiB holding 74 MB at the end of loading). The fields read the
    same (``contents()``, ``len(field.data)``, ``types``); other fields are parsed by the package.
    """
    from gguf import GGUFReader, GGUFValueType, ReaderField

    class CompactReader(GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            for _ in range(count):
                start = offs
                key_len, key = self._get_str(offs)
                offs += int(key_len.nbytes + key.nbytes)
                kind = self._get(offs, np.uint32)
                offs += int(kind.nbytes)
                head: list[np.ndarray] = [key_len, key, kind]
                name = str(bytes(key), encoding="utf-8")
                array = self._array_field(start, name, head, offs) if kind[0] == GGUFValueType.ARRAY else None
                if array is None:
                    size, parts, data, types = self._get_field_parts(offs, kind[0])
                    array = size, ReaderField(start, name, head + parts, [i + len(head) for i in data], types)
                self._push_field(array[1], skip_sum=True)
                offs += array[0]
            return offs

        def _array_field(
            self, start: int, name: str, head: list[np.ndarray], offs: int
        ) -> tuple[int, ReaderField] | None:
            """(bytes, field) of an array of scalars or strings at ``offs``; None for arrays of arrays."""
            item_kind = self._get(offs, np.uint32)
            n_items = self._get(offs + 4, np.uint64)
            head = [*head, item_kind, n_items]
            n, first = int(n_items[0]), offs + 12
            if n == 0:  # no item: no item type in ``types`` (as the package's reader)
                return first - offs, ReaderField(start, name, head, [], [GGUFValueType.ARRAY])
            types = [GGUFValueType.ARRAY, GGUFValueType(item_kind[0])]
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(item_kind[0]))
            if scalar is not None:
                values = self._get(first, scalar, n)
                parts = _ArrayParts(head, 1, lambda i: [values[i : i + 1]], n)
                field = ReaderField(start, name, parts, range(len(head), len(parts)), types)  # type: ignore[arg-type]
                return first + int(values.nbytes) - offs, field
            if item_kind[0] != GGUFValueType.STRING:
                return None
            same = (self.byte_order == "I") == (sys.byteorder == "little")
            length = struct.Struct("<Q" if same else ">Q")
            starts = np.empty(n, dtype=np.uint64)
            buffer = self.data.data  # the map's bytes as a memoryview
            at = first
            for i in range(n):
                starts[i] = at
                at += 8 + length.unpack_from(buffer, at)[0]
            if at > len(self.data):
                raise ValueError(f"the strings of field {name!r} end past the end of the file")
            parts = _ArrayParts(head, 2, lambda i: list(self._get_str(int(starts[i]))), n)
            field = ReaderField(start, name, parts, range(len(head) + 1, len(parts), 2), types)  # type: ignore[arg-type]
            return at - offs, field

    return CompactReader


def _path(reader: GGUFReader) -> str:
    """The file a reader maps (``np.memmap.filename``), for messages."""
    return str(getattr(reader.data, "filename", None) or "the GGUF file")


def release_vocabulary(reader: GGUFReader) -> None:
    """Drop the reader's long metadata arrays (vocabulary, merges, token types), once the tokenizer is built.

    The package's ``GGUFReader`` kept every string of them as its own small arrays (~500k objects, ~160 MB for
    SmolLM2's 49k tokens and 49k merges, measured); :func:`open_gguf`'s reader holds each as one array of values or
    of string offsets (:func:`_compact_reader`), under 1 MB. Dropped before the weights are loaded all the same.
    """
    for key in [k for k, f in reader.fields.items() if len(f.data) > 1024]:
        del reader.fields[key]


# -- metadata, each field checked for its type before its value is used ----------------------------

# What a field must hold -> (does a GGUF type list match, the words for it)
_INTS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})  # GGUFValueType: UINT8 .. INT64
_FLOATS = _INTS | {6, 12}  # FLOAT32, FLOAT64 (an integer is a fine float)
_BOOL, _STRING, _ARRAY = 7, 8, 9
_KINDS: dict[str, tuple[Callable[[list[int]], bool], str]] = {
    "int": (lambda t: len(t) == 1 and t[0] in _INTS, "an integer"),
    "float": (lambda t: len(t) == 1 and t[0] in _FLOATS, "a number"),
    "bool": (lambda t: t == [_BOOL], "a bool"),
    "str": (lambda t: t == [_STRING], "a string"),
    "str[]": (lambda t: t[:1] == [_ARRAY] and t[1:] in ([], [_STRING]), "an array of strings"),
    "int[]": (lambda t: t[:1] == [_ARRAY] and (len(t) == 1 or (len(t) == 2 and t[1] in _INTS)), "an array of integers"),
    "float[]": (
        lambda t: t[:1] == [_ARRAY] and (len(t) == 1 or (len(t) == 2 and t[1] in _FLOATS)),
        "an array of numbers",
    ),
}


def _describe(field: ReaderField) -> str:
    """A field's type and (short) value in words, for a message about a field of the wrong type."""
    from gguf.constants import GGUFValueType

    types = [GGUFValueType(t).name.lower() for t in field.types]
    if types[0] == "array":
        return f"an array of {len(field.data)} {types[-1] if len(types) > 1 else 'value'}s"
    try:
        value = field.contents()
    except UnicodeDecodeError:
        value = "(not UTF-8)"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"the {types[0]} {shown}"


def _checked_field(reader: GGUFReader, key: str, kind: str) -> Any:
    """Metadata field ``key`` (its value not yet decoded), refused unless it holds ``kind`` ("int", "str[]", ...);
    None if absent."""
    field = reader.fields.get(key)
    matches, words = _KINDS[kind]
    if field is not None and not matches([int(t) for t in field.types]):
        raise field_error(_path(reader), key, _describe(field), words, _FIX_METADATA, GGUFError)
    return field


def _field(reader: GGUFReader, key: str, kind: str, default: Any = None) -> Any:
    """The value of metadata ``key`` if it holds ``kind`` ("int", "str[]", ...), ``default`` if absent."""
    field = _checked_field(reader, key, kind)
    if field is None:
        return default
    words = _KINDS[kind][1]  # what the field should hold, in words
    try:
        return field.contents()
    except UnicodeDecodeError as e:
        raise field_error(
            _path(reader), key, f"text that is not UTF-8 ({e.reason})", f"{words} in UTF-8", _FIX_METADATA, GGUFError
        ) from None


def _array_length(reader: GGUFReader, key: str, kind: str) -> int | None:
    """The length of array field ``key`` if it holds ``kind``, without decoding its values; None if absent."""
    field = _checked_field(reader, key, kind)
    return None if field is None else len(field.data)


def _positive(reader: GGUFReader, key: str, why: str, default: int | None = None) -> int:
    """A positive integer field; absent is an error unless there is a ``default``."""
    value = _field(reader, key, "int", default)
    if value is None or value <= 0:
        found = "missing" if value is None else str(value)
        raise field_error(_path(reader), key, found, f"a positive integer ({why})", _FIX_METADATA, GGUFError)
    return int(value)


def _number(reader: GGUFReader, key: str, default: float, low: float, why: str) -> float:
    """A finite number field above ``low``; ``default`` when absent."""
    value = float(_field(reader, key, "float", default))
    if not (math.isfinite(value) and value > low):
        raise field_error(
            _path(reader), key, f"{value!r}", f"a finite number > {low:g} ({why})", _FIX_METADATA, GGUFError
        )
    return value


def _vocab_rows(reader: GGUFReader) -> int:
    """The vocabulary size: ``llama.vocab_size``, or in older files the rows of ``token_embd.weight``."""
    rows = next((int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight" and len(t.shape) == 2), None)
    if reader.fields.get("llama.vocab_size") is not None or rows is None:
        return _positive(reader, "llama.vocab_size", "the rows of token_embd.weight, which this file lacks")
    return rows


def _check_refusals(reader: GGUFReader, names: set[str]) -> None:
    """Refuse what attnlab's Llama cannot express, by name (the file is fine; attnlab lacks the feature)."""
    path = _path(reader)
    arch = _field(reader, "general.architecture", "str")
    if arch is None:
        raise field_error(path, "general.architecture", "missing", "'llama'", _FIX_METADATA, GGUFError)
    if arch != "llama":
        raise GGUFError(
            f"{path!r} holds a model of architecture {arch!r}; attnlab reads llama-architecture GGUF files only "
            f"(Llama, SmolLM2, TinyLlama, Mistral-7B as llama, ...): load this one with Hugging Face transformers "
            f"(AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)) or llama.cpp."
        )
    scaling = _field(reader, "llama.rope.scaling.type", "str", "none")
    refusals = [
        ("rope_freqs.weight" in names, "per-frequency RoPE factors (rope_freqs: Llama 3.1-style RoPE scaling)"),
        (scaling != "none", f"RoPE scaling {scaling!r}"),
        (_field(reader, "llama.expert_count", "int", 0) > 0, "mixture-of-experts layers (llama.expert_count)"),
    ]
    for refused, what in refusals:
        if refused:
            raise GGUFError(
                f"{path!r} uses {what}, which attnlab's Llama does not implement; use a GGUF of a Llama model without it."
            )


def _check_heads(reader: GGUFReader, n_embd: int, n_head: int, n_kv_head: int) -> int:
    """The head dim ``n_embd // n_head``, refused unless heads split the width evenly, as RoPE and GQA need."""
    path, head_dim = _path(reader), n_embd // n_head
    if n_embd % n_head or head_dim % 2:
        raise field_error(
            path,
            "llama.attention.head_count",
            str(n_head),
            f"a divisor of llama.embedding_length = {n_embd} leaving an even head dim (got {n_embd / n_head:g}; RoPE "
            f"rotates channel pairs)",
            _FIX_METADATA,
            GGUFError,
        )
    if n_head % n_kv_head:
        raise field_error(
            path,
            "llama.attention.head_count_kv",
            str(n_kv_head),
            f"a divisor of llama.attention.head_count = {n_head} (each K/V head serves n_head / n_kv_head query heads)",
            _FIX_METADATA,
            GGUFError,
        )
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        value = _field(reader, key, "int")
        if value is not None and value != head_dim:
            raise GGUFError(
                f"{path!r} has {key}={value} but embedding_length / head_count = {n_embd} // {n_head} = {head_dim}; "
                f"attnlab's Llama rotates and attends over whole heads of n_embd // n_head channels, so it cannot run "
                f"this model: load it with llama.cpp or transformers."
            )
    return head_dim


def _check_block_count(reader: GGUFReader, n_layer: int) -> None:
    """``llama.block_count`` against the blocks the file holds tensors for (before a model of that depth is built)."""
    blocks = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    held = 1 + max(blocks, default=-1)
    if held != n_layer:
        raise field_error(
            _path(reader),
            "llama.block_count",
            str(n_layer),
            f"{held}, the blocks the file holds tensors for (blk.0 .. blk.{held - 1})",
            _FIX_METADATA,
            GGUFError,
        )


def llama_config_from_gguf(reader: GGUFReader) -> LlamaConfig:
    """The :class:`LlamaConfig` a llama-architecture GGUF describes; refuses what :class:`Llama` cannot express.

    Every field read is checked for its type, presence and range (sizes positive, heads dividing
    the width, K/V heads dividing the heads, RoPE base > 1), and ``llama.block_count`` against the
    tensors, so that a damaged header is a :class:`GGUFError` naming the field, not a raw error.
    """
    names = {t.name for t in reader.tensors}
    _check_refusals(reader, names)
    n_embd = _positive(reader, "llama.embedding_length", "the residual width")
    n_head = _positive(reader, "llama.attention.head_count", "the query heads")
    n_kv_head = _positive(reader, "llama.attention.head_count_kv", "the key/value heads", default=n_head)
    _check_heads(reader, n_embd, n_head, n_kv_head)
    n_layer = _positive(reader, "llama.block_count", "the decoder blocks")
    _check_block_count(reader, n_layer)
    try:
        return LlamaConfig(
            vocab_size=_vocab_rows(reader),
            block_size=_positive(reader, "llama.context_length", "the longest sequence the model was trained on"),
            n_layer=n_layer,
            n_head=n_head,
            n_kv_head=n_kv_head,
            n_embd=n_embd,
            intermediate_size=_positive(reader, "llama.feed_forward_length", "the MLP's hidden width"),
            rope_base=_number(reader, "llama.rope.freq_base", 10000.0, 1.0, "RoPE's theta, 10000 to 500000 in Llamas"),
            norm_eps=_number(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5, 0.0, "RMSNorm's epsilon"),
            tie_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
        )
    except ValueError as e:  # LlamaConfig's own checks, should a future field escape the ones above
        raise GGUFError(f"{_path(reader)!r}: its metadata makes no valid LlamaConfig ({e}); {_FIX_METADATA}.") from None


def _dequantized(data: np.ndarray, tensor: ReaderTensor, path: str) -> Tensor:
    """float32 tensor of a slice of a GGUF tensor's rows (a copy: the file's pages stay read-only), checked for
    the NaN, inf and impossible magnitudes that damaged bytes put there (:func:`~.file_checks.check_values`)."""
    from gguf.quants import dequantize

    try:
        with np.errstate(all="ignore"):  # damaged scales overflow; check_values names the tensor instead of a warning
            values = dequantize(data, tensor.tensor_type)
    except NotImplementedError as e:
        raise GGUFError(
            f"{e}: this GGUF's quantization cannot be unpacked by the installed gguf package; run `pip install -U gguf`."
        ) from None
    if not values.flags.writeable:  # F32 tensors come back as views of the read-only map
        values = np.array(values)
    result = torch.from_numpy(values)
    check_values(result, tensor.name, path, _FIX_DATA, FP16_MAX, GGUFError)
    return result


def _drop_pages(reader: GGUFReader, offset: int, nbytes: int) -> None:
    """Tell the OS that the file pages of one copied tensor are no longer needed (``MADV_DONTNEED``).

    They are clean page cache, but while mapped they count in the process's resident memory:
    the whole file (98 MB for SmolLM2) on top of the weights at the end of loading. Where the
    platform or numpy does not offer it, nothing is done.
    """
    raw = getattr(reader.data, "_mmap", None)  # np.memmap's mmap.mmap
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if raw is None or advice is None:
        return
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(offset + nbytes, len(raw))
    if end > start:
        raw.madvise(advice, start, end - start)


def check_gguf_tensors(reader: GGUFReader, model: nn.Module) -> list[tuple[ReaderTensor, nn.Parameter]]:
    """Pair every tensor of ``reader`` with the parameter of ``model`` it loads into; refuse any mismatch.

    ``model`` may live on the meta device: :func:`~attnlab.weight_files.pretrained.from_pretrained` calls
    this before the model's memory exists, so that a file whose tensors disagree with its metadata
    costs no allocation. Every parameter must receive exactly one tensor of its shape.
    """
    path = _path(reader)
    params = dict(model.named_parameters())
    plan, loaded = [], set()
    for tensor in reader.tensors:
        name = llama_name_from_gguf(tensor.name)
        if name is None or name not in params:
            raise GGUFError(
                f"{path!r}: the GGUF tensor {tensor.name!r} has no place in attnlab's Llama (expected token_embd, "
                f"output_norm, output, blk.N.{{{', '.join(GGUF_BLOCK_NAMES)}}}); the file is not a plain Llama model: "
                f"load it with llama.cpp or transformers."
            )
        shape = tuple(int(s) for s in reversed(tensor.shape))  # ggml lists dims fastest first; torch slowest first
        if shape != tuple(params[name].shape):
            raise field_error(
                path,
                f"the shape of tensor {tensor.name!r}",
                str(shape),
                f"{tuple(params[name].shape)}, what the metadata (llama.*) implies for {name}",
                _FIX_METADATA,
                GGUFError,
            )
        plan.append((tensor, params[name]))
        loaded.add(name)
    fix = "copy it again, or convert the model again with llama.cpp's convert_hf_to_gguf.py"
    check_complete(params, loaded, repr(path), "metadata", fix, GGUFError)
    return plan


def keep_quantized(reader: GGUFReader, model: nn.Module) -> dict[str, str]:
    """Replace each ``nn.Linear`` / ``nn.Embedding`` of ``model`` whose GGUF tensor is Q4_0, Q4_1 or Q8_0 by a
    :class:`~attnlab.quant.QuantLinear` / :class:`~attnlab.quant.QuantEmbedding` of that format, on the
    model's device (meta too); returns ``{attnlab module name: format}``. Tensors of other types (F32
    norms, F16, K-quants) stay float parameters, loaded dequantized. Call it after
    :func:`check_gguf_tensors` (names and shapes checked) and before :func:`load_gguf_weights`."""
    kept: dict[str, str] = {}
    for tensor in reader.tensors:
        name = llama_name_from_gguf(tensor.name)
        fmt = FORMATS.get(tensor.tensor_type.name)
        if name is None or fmt is None or not name.endswith(".weight") or len(tensor.shape) != 2:
            continue
        path = name.removesuffix(".weight")
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        device = next(old.parameters()).device
        if isinstance(old, nn.Linear):
            new: nn.Module = QuantLinear(
                old.in_features, old.out_features, fmt, bias=old.bias is not None, device=device
            )
        elif isinstance(old, nn.Embedding):
            new = QuantEmbedding(old.num_embeddings, old.embedding_dim, fmt, device=device)
        else:  # pragma: no cover - every 2-D tensor of a Llama GGUF is a Linear's or the Embedding's
            continue
        setattr(parent, child, new)
        kept[path] = fmt.name
    return kept


def _copy_blocks(
    reader: GGUFReader, tensor: ReaderTensor, layer: QuantLinear | QuantEmbedding, heads: int | None
) -> None:
    """A quantized tensor's bytes into ``layer.blocks`` as stored (Q/K rows put back into HF's rotary order, whole
    rows of blocks being moved), each slice checked for damaged scales by dequantizing it."""
    path = _path(reader)
    rows = layer.blocks.size(0)
    raw = np.asarray(tensor.data).reshape(rows, -1)  # (rows, row bytes), a view of the read-only map
    if raw.shape != tuple(layer.blocks.shape):
        raise GGUFError(
            f"{path!r}: tensor {tensor.name!r} holds {tuple(raw.shape)} bytes of blocks, expected "
            f"{tuple(layer.blocks.shape)} for {layer.fmt.name}; {_FIX_METADATA}."
        )
    step = max(1, _ROWS_PER_SLICE_BYTES // (4 * layer.in_features))
    for start in range(0, rows, step):
        piece = layer.blocks[start : start + step]
        piece.copy_(torch.from_numpy(np.array(raw[start : start + step])))  # a copy: the map is read-only
        check_values(
            dequantize_kept(piece, layer.fmt, layer.in_features), tensor.name, path, _FIX_DATA, FP16_MAX, GGUFError
        )
    if heads is not None:
        layer.blocks.copy_(unpermute_qk(layer.blocks.clone(), heads))


@torch.no_grad()
def load_gguf_weights(reader: GGUFReader, model: nn.Module, layout: str | None = None) -> None:
    """Copy every tensor of ``reader`` into ``model`` (a :class:`Llama` of the matching config), in place.

    Each tensor is dequantized a slice of rows at a time, checked for damaged values while the slice
    is in cache, and cast on the copy into the model's dtype and device; Q/K rows are put back into
    Hugging Face's rotary order (:func:`~attnlab.models.weight_maps.unpermute_qk`). Quantized layers
    (:func:`keep_quantized`) get the file's blocks, then are packed in ``layout``
    (:meth:`attnlab.quant.QuantLinear.pack`; default the best this CPU runs).
    """
    config: LlamaConfig = model.config  # type: ignore[assignment]
    path = _path(reader)
    if not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules()):
        check_gguf_tensors(reader, model)  # names and shapes (from_pretrained checked them on its meta model already)
    params = dict(model.named_parameters())
    for tensor in reader.tensors:
        name = llama_name_from_gguf(tensor.name) or ""
        heads = None
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            heads = config.n_head if ".attn_q." in tensor.name else config.n_kv_head
        layer = model.get_submodule(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if isinstance(layer, (QuantLinear, QuantEmbedding)):  # kept as the file stores it (keep_quantized)
            _copy_blocks(reader, tensor, layer, heads)
            layer.pack(layout)
            _drop_pages(reader, tensor.data_offset, tensor.n_bytes)
            continue
        param = params.get(name)
        if param is None:
            raise GGUFError(f"{path!r}: the GGUF tensor {tensor.name!r} has no place in this model; {_FIX_METADATA}.")
        shape = tuple(param.shape)
        data = tensor.data.reshape(shape[0], -1) if len(shape) > 1 else tensor.data  # (rows, bytes or values per row)
        if heads is not None:  # small: unpermuted whole
            param.copy_(unpermute_qk(_dequantized(data, tensor, path).reshape(shape), heads))
        else:
            row_bytes = 4 * (shape[1] if len(shape) > 1 else shape[0])
            step = max(1, _ROWS_PER_SLICE_BYTES // row_bytes)
            for start in range(0, shape[0], step):
                param[start : start + step].copy_(
                    _dequantized(data[start : start + step], tensor, path).reshape(-1, *shape[1:])
                )
        _drop_pages(reader, tensor.data_offset, tensor.n_bytes)


# llama.cpp's pre-tokenizers (llama-vocab.cpp, by their `tokenizer.ggml.pre` name), as Hugging Face
# `tokenizers` pieces: (digits split one by one first, split regex or None for GPT-2's, ignore_merges).
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, tuple[bool, str | None, bool]] = {
    "gpt-2": (False, None, False),
    "smollm": (True, None, False),  # SmolLM/SmolLM2: every digit its own piece, then GPT-2's regex
    "starcoder": (True, None, False),
    "llama-bpe": (False, _LLAMA3_SPLIT, True),  # Llama 3: whole words in the vocabulary win over merges
    "qwen2": (False, _QWEN2_SPLIT, False),
}


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    digits, split, _ = _PRE_TOKENIZERS[pre]
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:  # ByteLevel's own regex is GPT-2's
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


@dataclass
class _Vocabulary:
    """A GGUF file's tokenizer metadata, checked: what :func:`tokenizer_from_gguf` builds from."""

    kind: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]  # one per row of token_embd.weight
    types: list[int]  # empty, or one per token (3 = CONTROL)
    merges: list[str]  # "a b" pairs, in merge order
    specials: dict[str, int]  # "bos", "eos", "unknown", "padding" -> an id of the vocabulary
    add_bos: bool  # tokenizer.ggml.add_bos_token: llama.cpp starts every encoded text with BOS
    add_eos: bool  # tokenizer.ggml.add_eos_token: and ends it with EOS


def _read_vocabulary(reader: GGUFReader) -> _Vocabulary:
    """Every tokenizer field :func:`tokenizer_from_gguf` reads, checked before the tokenizer is built: types,
    one token per embedding row, token types and scores one per token, merges as pairs, special ids in range."""
    path = _path(reader)
    kind = _field(reader, "tokenizer.ggml.model", "str")
    if kind is None:
        expected = "the tokenizer's kind, 'gpt2' (byte-level BPE) or 'llama' (SentencePiece)"
        raise field_error(path, "tokenizer.ggml.model", "missing", expected, _FIX_METADATA, GGUFError)
    if kind not in ("gpt2", "llama"):
        raise GGUFError(
            f"{path!r} has a tokenizer of kind {kind!r} (tokenizer.ggml.model); attnlab builds 'gpt2' (byte-level BPE) "
            f"and 'llama' (SentencePiece) tokenizers; load this one with transformers' AutoTokenizer(gguf_file=...)."
        )
    rows = _vocab_rows(reader)
    tokens = _field(reader, "tokenizer.ggml.tokens", "str[]")
    if tokens is None or len(tokens) != rows:
        found = "missing" if tokens is None else f"an array of {len(tokens)} strings"
        expected = f"the vocabulary, one token per row of token_embd.weight ({rows})"
        raise field_error(path, "tokenizer.ggml.tokens", found, expected, _FIX_METADATA, GGUFError)
    for key, kind_of in (("tokenizer.ggml.token_type", "int[]"), ("tokenizer.ggml.scores", "float[]")):
        count = _array_length(reader, key, kind_of)
        if count is not None and count != len(tokens):
            raise field_error(
                path,
                key,
                f"an array of {count} values",
                f"one per token ({len(tokens)})",
                _FIX_METADATA,
                GGUFError,
            )
    merges: list[str] = _field(reader, "tokenizer.ggml.merges", "str[]", [])
    bad = next((i for i, m in enumerate(merges) if not 0 < m.find(" ") < len(m) - 1), None)
    if bad is not None:
        raise field_error(
            path,
            f"entry {bad} of tokenizer.ggml.merges",
            repr(merges[bad]),
            "two tokens joined by one space (e.g. 'Ġ t')",
            _FIX_METADATA,
            GGUFError,
        )
    specials = {}
    for key in ("bos", "eos", "unknown", "padding"):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id", "int")
        if i is not None and not 0 <= i < len(tokens):
            raise field_error(
                path,
                f"tokenizer.ggml.{key}_token_id",
                str(i),
                f"an id of the vocabulary, 0 .. {len(tokens) - 1} (tokenizer.ggml.tokens)",
                _FIX_METADATA,
                GGUFError,
            )
        if i is not None:
            specials[key] = int(i)
    types = _field(reader, "tokenizer.ggml.token_type", "int[]", [])
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", "bool", False)
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token", "bool", False)
    return _Vocabulary(kind, tokens, types, merges, specials, add_bos, add_eos)


def tokenizer_from_gguf(reader: GGUFReader) -> BPETokenizer | PreTrainedTokenizerBase:
    """The tokenizer a GGUF file describes, with ``transformers``' tokenizer API.

    Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen2, ...) is built here
    from the file's vocabulary, merges, control tokens and chat template, as a
    :class:`~attnlab.weight_files.bpe_tokenizer.BPETokenizer` (Hugging Face ``tokenizers`` without importing
    transformers, which builds its ``PreTrainedTokenizerFast`` on demand: ``tok.hf``). SentencePiece
    vocabularies (``"llama"``: Llama 2, TinyLlama) go to transformers' own GGUF conversion, which
    rebuilds their merges from the token scores. Every field is checked first, so that a damaged
    one is a :class:`GGUFError` naming it rather than an ``IndexError`` from deep in the build.
    """
    path = _path(reader)
    vocab = _read_vocabulary(reader)
    if vocab.kind == "llama":
        try:
            from transformers import AutoTokenizer
        except Exception as err:  # not installed, or broken by a package it imports: the advice tells which
            need = f"building the SentencePiece tokenizer of {path!r} needs transformers"
            raise GGUFError(import_advice("transformers", need, err)) from None
        try:
            return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
        except Exception as e:  # transformers' GGUF conversion raises many kinds; the file is what is wrong
            raise GGUFError(
                f"{path!r}: transformers could not build its SentencePiece tokenizer ({type(e).__name__}: {e}); "
                f"{_FIX_METADATA}."
            ) from None
    pre = _field(reader, "tokenizer.ggml.pre", "str", "gpt-2")  # files from before the field: GPT-2's split
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(
            f"{path!r} names the pre-tokenizer {pre!r} (tokenizer.ggml.pre), which attnlab does not know; known: "
            f"{sorted(_PRE_TOKENIZERS)}. A guessed one would split text differently from the model's training: "
            f"load this tokenizer with transformers (AutoTokenizer.from_pretrained(dir, gguf_file=name))."
        )
    try:
        import tokenizers  # noqa: F401
    except Exception as err:
        need = f"building the tokenizer of {path!r} needs tokenizers"
        raise GGUFError(import_advice("tokenizers", need, err)) from None
    try:
        bpe = _byte_level_bpe(vocab, pre)
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of tokens outside the vocabulary
        raise GGUFError(
            f"{path!r}: its vocabulary and merges (tokenizer.ggml.tokens, tokenizer.ggml.merges) make no BPE "
            f"tokenizer ({e}); {_FIX_METADATA}."
        ) from None
    token = {key: vocab.tokens[i] for key, i in vocab.specials.items()}
    return BPETokenizer(  # transformers' API without importing transformers (its PreTrainedTokenizerFast on demand)
        bpe,
        bos_token=token.get("bos"),
        eos_token=token.get("eos"),
        unk_token=token.get("unknown"),
        pad_token=token.get("padding"),
        chat_template=_field(reader, "tokenizer.chat_template", "str"),
    )


def _byte_level_bpe(vocab: _Vocabulary, pre: str) -> Any:
    """A ``tokenizers.Tokenizer`` of a checked byte-level BPE vocabulary, with llama.cpp's BOS/EOS habits."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    bpe = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(vocab.tokens)},
            merges=[(a, b) for a, _, b in (m.partition(" ") for m in vocab.merges)],
            fuse_unk=False,
            ignore_merges=_PRE_TOKENIZERS[pre][2],
        )
    )
    bpe.pre_tokenizer = _pre_tokenizer(pre)
    bpe.decoder = decoders.ByteLevel()
    # token_type 3 = CONTROL (<|im_start|>, <|endoftext|>): matched whole in text, dropped by decode(skip_special_tokens=True).
    # A file without token types has no control tokens (strict=False: zip stops at the empty list).
    bpe.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(vocab.tokens, vocab.types, strict=False)
            if k == 3
        ]
    )
    ends = {key: (vocab.tokens[i], i) for key, i in vocab.specials.items() if key in ("bos", "eos")}
    template = "$A:0"  # llama.cpp adds BOS/EOS to every encoded text when the file says so; so does this
    if "bos" in ends and vocab.add_bos:
        template = f"{ends['bos'][0]}:0 {template}"
    if "eos" in ends and vocab.add_eos:
        template = f"{template} {ends['eos'][0]}:0"
    if template != "$A:0":
        bpe.post_processor = processors.TemplateProcessing(single=template, special_tokens=list(ends.values()))
    return bpe
