"""Model files checked before any tensor is built from them, in one error vocabulary.

Every loader of :mod:`attnlab.weight_files` (GGUF, Hugging Face directories, attnlab checkpoints) runs
a file through these checks first, so that a damaged, inconsistent or hostile file is one
:class:`~attnlab.runtime.ModelFileError` sentence naming the file, the field or tensor, what was
found, what was expected and the fix, never a raw ``IndexError`` or an allocation the file does
not back:

* :func:`check_gguf_layout` walks a GGUF header (metadata and tensor table) with every length
  and count checked against the file's size, before ``gguf.GGUFReader``, which trusts them (an
  array that claims 2^60 entries makes it loop until memory runs out);
* :func:`safetensors_header` parses the 8-byte length and JSON header of a ``.safetensors``
  file itself, as the format specifies: dtypes, shapes and data offsets that tile the data
  exactly, so a half-written file is named as such and a shape never claims more than the file;
* :func:`check_fits_in_memory`: the weights a config describes against this machine's memory
  (a :class:`~attnlab.runtime.LimitError` with the figures), before the model is allocated;
* :func:`check_values`: the cheap pass over each loaded tensor that catches corruption inside
  the data (bit rot), which no header reveals.

Each check takes ``error``, the loader's own :class:`ModelFileError` subclass (``GGUFError``,
``CheckpointError``), so that callers catching those keep working.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..models.config import GPTConfig
from ..models.llama_config import LlamaConfig
from ..runtime import LimitError, ModelFileError, available_bytes, gib, memory_limit

__all__ = [
    "FP16_MAX",
    "field_error",
    "check_complete",
    "read_json_object",
    "check_gguf_layout",
    "SafetensorsEntry",
    "SafetensorsHeader",
    "safetensors_header",
    "SAFETENSORS_TORCH_DTYPES",
    "llama_weight_count",
    "gpt_weight_count",
    "check_fits_in_memory",
    "check_values",
    "json_field",
    "safetensors_metadata",
]

# The largest finite float16. A weight beyond it cannot be held by the fp16 checkpoints most GGUF
# files are converted from, nor run in fp16; random bytes in a block's fp16 scale exceed it about
# one time in five (see check_values), real weights never come near (SmolLM2's largest is 9.25).
FP16_MAX = 65504.0


def check_complete(
    expected: Iterable[str], loaded: set[str], source: str, implied_by: str, fix: str, error: type[ModelFileError]
) -> None:
    """Refuse a model file that lacks some of the ``expected`` tensors (those ``implied_by`` its config implies),
    naming how many and the first three; ``loaded`` the names it held, ``source`` how the file is named."""
    missing = sorted(set(expected) - loaded)
    if missing:
        raise error(
            f"{source} lacks {len(missing)} tensor(s) its {implied_by} implies, e.g. {missing[:3]}; it is incomplete: "
            f"{fix}."
        )


def field_error(
    file: str | os.PathLike, where: str, found: str, expected: str, fix: str, error: type[ModelFileError]
) -> ModelFileError:
    """The one sentence of every field problem: ``'FILE': WHERE is FOUND, expected EXPECTED; FIX.``"""
    return error(f"{str(file)!r}: {where} is {found}, expected {expected}; {fix}.")


def read_json_object(path: Path, fix: str, error: type[ModelFileError] = ModelFileError) -> dict[str, Any]:
    """The JSON object in ``path``; unreadable, not UTF-8, not JSON or not an object is ``error``."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise error(
            f"{str(path)!r} cannot be read ({e.strerror or e}); make it readable (chmod u+r), or {fix}."
        ) from None
    except UnicodeDecodeError as e:
        raise error(
            f"{str(path)!r} is not valid JSON (not UTF-8 text: {e.reason} at byte {e.start}), expected one JSON object; {fix}."
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(
            f"{str(path)!r} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno} of {len(text)} characters), "
            f"expected one JSON object; {fix}."
        ) from None
    if not isinstance(data, dict):
        raise error(f"{str(path)!r} holds a JSON {type(data).__name__}, expected one JSON object; {fix}.")
    return data


# -- GGUF: the header walked with every length checked --------------------------------------------

# GGUF value types (gguf.constants.GGUFValueType) -> bytes of one scalar; 8 = string, 9 = array
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MIN_BYTES = {**_GGUF_SCALAR_BYTES, _GGUF_STRING: 8, _GGUF_ARRAY: 12}  # the least one value can take
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor of more
_INT64_MAX = (1 << 63) - 1


class _GGUFHeader:
    """A cursor over a GGUF file's bytes that refuses every read past the end, naming what it read."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path, error: type[ModelFileError]) -> None:
        self.buf, self.size, self.path, self.error, self.pos = buf, len(buf), path, error, 0
        self.order = "<"

    def fail(self, problem: str) -> ModelFileError:
        return self.error(
            f"{str(self.path)!r} is not a readable GGUF file ({problem}; {self.size} bytes): it is damaged or was cut "
            f"short, e.g. by an interrupted download or copy; copy it again."
        )

    def need(self, n: int, what: str) -> int:
        """Advance past ``n`` bytes of ``what``; returns where they start."""
        start = self.pos
        if n > self.size - start:
            raise self.fail(f"{what} needs {n} bytes at byte {start}, past the end of the file")
        self.pos = start + n
        return start

    def u32(self, what: str) -> int:
        return int(struct.unpack_from(self.order + "I", self.buf, self.need(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack_from(self.order + "Q", self.buf, self.need(8, what))[0])

    def string(self, what: str) -> bytes:
        n = self.u64(f"the length of {what}")
        return bytes(self.buf[self.need(n, what) : self.pos])

    def skip_value(self, vtype: int, what: str) -> None:
        """Step over one value of GGUF type ``vtype``; an array's count is checked before its loop."""
        if vtype in _GGUF_SCALAR_BYTES:
            self.need(_GGUF_SCALAR_BYTES[vtype], what)
        elif vtype == _GGUF_STRING:
            self.need(self.u64(f"the length of {what}"), what)
        elif vtype == _GGUF_ARRAY:
            item = self.u32(f"the element type of {what}")
            count = self.u64(f"the length of {what}")
            if item not in _GGUF_MIN_BYTES:
                raise self.fail(f"{what} is an array of GGUF type {item}, which does not exist (types are 0-12)")
            if count * _GGUF_MIN_BYTES[item] > self.size - self.pos:  # before the loop: 2^60 entries end here
                raise self.fail(
                    f"{what} claims {count} entries, at least {count * _GGUF_MIN_BYTES[item]} bytes, but only "
                    f"{self.size - self.pos} bytes follow"
                )
            if item in _GGUF_SCALAR_BYTES:
                self.need(count * _GGUF_SCALAR_BYTES[item], what)
            elif item == _GGUF_STRING:  # the vocabulary: 49k strings for SmolLM2, walked in one tight loop
                self._skip_strings(count, what)
            else:
                for i in range(count):
                    self.skip_value(item, f"entry {i} of {what}")
        else:
            raise self.fail(f"{what} has GGUF type {vtype}, which does not exist (types are 0-12)")

    def _skip_strings(self, count: int, what: str) -> None:
        buf, size, pos, fmt = self.buf, self.size, self.pos, self.order + "Q"
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"the length of entry {i} of {what} at byte {pos} is past the end of the file")
            pos += 8 + struct.unpack_from(fmt, buf, pos)[0]
            if pos > size:
                raise self.fail(f"entry {i} of {what} runs past the end of the file")
        self.pos = pos


def check_gguf_layout(path: Path, error: type[ModelFileError] = ModelFileError) -> None:
    """Refuse a GGUF file whose header does not fit in it: every length, count and tensor extent checked.

    Walks what ``gguf.GGUFReader`` will trust: the magic and version, each metadata key and value
    (an array's count against the bytes left), each tensor's name, dims (at most 4, a product
    below 2^63), ggml type, offset (aligned, as llama.cpp requires) and data (inside the file, no
    two tensors overlapping). About 20 ms for SmolLM2's 98 MB (its vocabulary is most of the header).
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 24:  # magic, version, tensor count, metadata count
            head = _GGUFHeader(f.read(), path, error)
            raise head.fail("it is shorter than the 24 bytes of a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _walk_gguf(_GGUFHeader(buf, path, error))


def _walk_gguf(h: _GGUFHeader) -> None:
    if bytes(h.buf[:4]) != b"GGUF":
        raise h.fail(f"it starts with {bytes(h.buf[:4])!r}, not the magic b'GGUF'")
    h.pos = 4
    version = h.u32("the version")
    if version & 0xFFFF == 0:  # written on a big-endian machine: GGUFReader reads those too
        h.order, h.pos = ">", 4
        version = h.u32("the version")
    if version not in (2, 3):
        raise h.fail(f"it has GGUF version {version}; attnlab (through the gguf package) reads versions 2 and 3")
    n_tensors, n_kv = h.u64("the tensor count"), h.u64("the metadata count")
    if n_kv * 13 + n_tensors * 24 > h.size - h.pos:  # the least a key-value and a tensor entry take
        raise h.fail(f"it claims {n_kv} metadata entries and {n_tensors} tensors, more than its bytes can hold")
    alignment, keys = 32, set()  # GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = _utf8(h, h.string(f"the key of metadata entry {i}"), f"the key of metadata entry {i}")
        if key in keys:
            raise h.fail(f"metadata key {key!r} appears twice")
        keys.add(key)
        vtype = h.u32(f"the type of metadata key {key!r}")
        if key == "general.alignment":
            if vtype != _GGUF_UINT32:
                raise h.fail(f"general.alignment has GGUF type {vtype}, expected uint32 (4)")
            alignment = h.u32("general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise h.fail(f"general.alignment is {alignment}, expected a power of two")
        else:
            h.skip_value(vtype, f"the value of metadata key {key!r}")
    infos = [_tensor_info(h, i, n_tensors) for i in range(n_tensors)]
    data_start = -(-h.pos // alignment) * alignment
    _check_tensor_extents(h, infos, data_start, alignment)


def _utf8(h: _GGUFHeader, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise h.fail(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _tensor_info(h: _GGUFHeader, i: int, count: int) -> tuple[str, list[int], int, int]:
    """``(name, dims, ggml type, offset)`` of tensor entry ``i``."""
    name = _utf8(h, h.string(f"the name of tensor {i} of {count}"), f"the name of tensor {i}")
    n_dims = h.u32(f"the dimension count of tensor {name!r}")
    if n_dims > _GGUF_MAX_DIMS:
        raise h.fail(f"tensor {name!r} claims {n_dims} dimensions, more than GGML's {_GGUF_MAX_DIMS}")
    dims = [h.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims)]
    return name, dims, h.u32(f"the ggml type of tensor {name!r}"), h.u64(f"the offset of tensor {name!r}")


def _check_tensor_extents(h: _GGUFHeader, infos: list[tuple[str, list[int], int, int]], start: int, align: int) -> None:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    extents = []
    for name, dims, raw_type, offset in infos:
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise h.fail(
                f"tensor {name!r} has ggml type {raw_type}, which the installed gguf package does not know "
                f"(if the file is new, `pip install -U gguf` may read it)"
            ) from None
        elements = math.prod(dims)  # Python ints: a product past 2^64 is seen, not wrapped
        if elements > _INT64_MAX:
            raise h.fail(f"tensor {name!r} claims dims {dims}, {elements:.3g} elements, more than 2^63")
        if dims and dims[0] % block:
            raise h.fail(
                f"tensor {name!r} has a first dimension of {dims[0]}, not a multiple of its type's block of {block}"
            )
        if offset % align:
            raise h.fail(f"tensor {name!r} has offset {offset}, not a multiple of the file's alignment {align}")
        begin = start + offset
        end = begin + elements // block * type_bytes
        if end > h.size:
            raise h.fail(
                f"the data of tensor {name!r} (dims {dims}) spans bytes {begin}..{end}, past the end of the file"
            )
        extents.append((begin, end, name))
    extents.sort()
    for (_, end, first), (begin, _, second) in itertools.pairwise(extents):
        if begin < end:
            raise h.fail(f"the data of tensors {first!r} and {second!r} overlap (bytes {begin}..{end})")


# -- safetensors: the header parsed as the format specifies ---------------------------------------

# safetensors dtype -> bits of one element
_SAFETENSORS_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
# the dtypes a weight can arrive in: the others (ints, fp8, fp4) are not weights attnlab's models hold
SAFETENSORS_TORCH_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors header: its dtype name, shape and byte range within the data."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header: every tensor by name, and the free-form ``__metadata__``."""

    tensors: dict[str, SafetensorsEntry]
    metadata: dict[str, str]


def safetensors_header(path: Path, fix: str, error: type[ModelFileError] = ModelFileError) -> SafetensorsHeader:
    """The header of the safetensors file ``path``, refused unless its tensors tile the data exactly.

    The format: 8 bytes (little-endian u64) of header length N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
    data, whose bytes the tensors cover in order with no hole and no overlap. Checked here:
    truncation anywhere, a length past the file, JSON, every dtype, shape and offset, and that
    ``prod(shape) * itemsize`` equals each tensor's extent (Python ints: no shape can overflow).
    Reads only the header, so a file claiming terabytes costs nothing.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 <= n <= min(size - 8, _SAFETENSORS_MAX_HEADER):
                raise _safetensors_fail(path, size, _length_problem(n, size), fix, error)
            raw = f.read(n)
    except OSError as e:
        raise error(
            f"{str(path)!r} cannot be read ({e.strerror or e}); make it readable (chmod u+r) or {fix}."
        ) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _safetensors_fail(path, size, f"its {n}-byte header is not JSON ({e})", fix, error) from None
    if not isinstance(header, dict):
        raise _safetensors_fail(path, size, f"its header is a JSON {type(header).__name__}, not an object", fix, error)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _safetensors_fail(path, size, "its __metadata__ is not an object of strings", fix, error)
    data_bytes = size - 8 - n
    tensors = {name: _entry(name, spec, data_bytes, path, size, fix, error) for name, spec in header.items()}
    _check_tiling(tensors, data_bytes, path, size, fix, error)
    return SafetensorsHeader(tensors, metadata)


def _length_problem(n: int, size: int) -> str:
    if n < 0:
        return "it is shorter than the 8 bytes that give the header's length"
    if n > _SAFETENSORS_MAX_HEADER:
        return (
            f"its first 8 bytes give a header of {n} bytes, more than safetensors' limit of {_SAFETENSORS_MAX_HEADER}"
        )
    return f"its first 8 bytes give a header of {n} bytes, past the end of the file"


def _safetensors_fail(path: Path, size: int, problem: str, fix: str, error: type[ModelFileError]) -> ModelFileError:
    return error(
        f"{str(path)!r} is not a readable safetensors file ({problem}; {size} bytes): it is damaged or was cut short, "
        f"e.g. by an interrupted copy; {fix}."
    )


def _entry(
    name: str, spec: Any, data_bytes: int, path: Path, size: int, fix: str, error: type[ModelFileError]
) -> SafetensorsEntry:
    """One header entry, checked: a known dtype, a shape of non-negative ints, offsets inside the data."""

    def fail(problem: str) -> ModelFileError:
        return _safetensors_fail(path, size, f"tensor {name!r} {problem}", fix, error)

    if not isinstance(spec, dict):
        raise fail(f"has header entry {spec!r}, not an object with dtype, shape and data_offsets")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in _SAFETENSORS_BITS:
        raise fail(f"has dtype {dtype!r}, not one of safetensors' {sorted(_SAFETENSORS_BITS)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise fail(f"has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise fail(f"has data_offsets {offsets!r}, not [begin, end] in bytes")
    begin, end = offsets
    if begin > end or end > data_bytes:
        raise fail(f"has data_offsets [{begin}, {end}] but the data after the header holds {data_bytes} bytes")
    claimed_bits = math.prod(shape) * _SAFETENSORS_BITS[dtype]  # Python ints: no product overflows
    if claimed_bits != 8 * (end - begin):
        claimed = f"{claimed_bits / 8:.0f}" if claimed_bits < 8 * 10**12 else f"{claimed_bits / 8:.3g}"
        raise fail(f"has shape {shape} of {dtype}, {claimed} bytes, but its data_offsets span {end - begin} bytes")
    return SafetensorsEntry(dtype, tuple(shape), begin, end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_tiling(
    tensors: Mapping[str, SafetensorsEntry],
    data_bytes: int,
    path: Path,
    size: int,
    fix: str,
    error: type[ModelFileError],
) -> None:
    """The tensors cover the data in order, with no overlap, no hole and nothing after (as safetensors requires)."""
    covered, last = 0, None
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin < covered:
            problem = f"tensors {last!r} and {name!r} overlap (bytes {entry.begin}..{covered} of the data)"
            raise _safetensors_fail(path, size, problem, fix, error)
        if entry.begin > covered:
            problem = f"bytes {covered}..{entry.begin} of the data, before tensor {name!r}, belong to no tensor"
            raise _safetensors_fail(path, size, problem, fix, error)
        covered, last = entry.end, name
    if covered != data_bytes:
        problem = f"its header describes {covered} bytes of data but {data_bytes} follow it"
        raise _safetensors_fail(path, size, problem, fix, error)


# -- memory: what a config asks for, against what this machine has ---------------------------------


def llama_weight_count(c: LlamaConfig) -> int:
    """The parameters of ``Llama(c)``, from the config alone (no model is built)."""
    E, F, kv = c.n_embd, c.intermediate_size, c.n_kv_head * c.head_dim
    attention = 2 * E * E + 2 * E * kv + (2 * E + 2 * kv if c.attention_bias else 0)  # q, o, k, v
    mlp = 3 * E * F + (2 * F + E if c.mlp_bias else 0)  # gate, up, down
    head = 0 if c.tie_embeddings else c.vocab_size * E
    return c.vocab_size * E + head + c.n_layer * (attention + mlp + 2 * E) + E  # + the norms


def gpt_weight_count(c: GPTConfig) -> int:
    """The parameters of ``TinyGPT(c)``, from the config alone (no model is built)."""
    E, kv = c.n_embd, (c.n_kv_head or c.n_head) * c.head_dim
    bias = 1 if c.bias else 0
    attention = 2 * E * E + 2 * E * kv + bias * (2 * E + 2 * kv)  # q, out, k, v
    mlp = 8 * E * E + bias * 5 * E  # c_fc E -> 4E, c_proj 4E -> E
    norms = (1 + bias) * E
    positions = c.block_size * E if c.position == "learned" else 0
    return c.vocab_size * E + positions + c.n_layer * (attention + mlp + 2 * norms) + norms


def _memory_source(device: torch.device) -> str:
    """Where :func:`attnlab.runtime.available_bytes` reads ``device``'s free memory, for messages."""
    limit = memory_limit(device)  # the tightest of MemAvailable, a cgroup limit and ulimit -v, and which it was
    return "no figure" if limit is None else limit[1]


def check_fits_in_memory(weights: int, dtype: torch.dtype, device: torch.device, source: str, sizes: str) -> None:
    """A :class:`LimitError` with the figures when ``weights`` parameters in ``dtype`` exceed what ``device`` has.

    ``sizes`` names the config's fields that give the count (``"hidden_size=..., ..."``), so that
    the user sees which number is absurd, or which model is too large for this machine.
    """
    free = available_bytes(device)
    need = weights * dtype.itemsize
    if free is None or need <= free:
        return
    fix = "load a smaller model, or use a machine with more memory"
    if dtype.itemsize > 2 and weights * 2 <= free:
        fix = f"pass dtype=torch.bfloat16 ({gib(weights * 2)}), {fix}"
    raise LimitError(
        f"{source} describes a model of {weights:.4g} weights ({sizes}), {gib(need)} in {str(dtype).removeprefix('torch.')}, "
        f"but {device} has {gib(free)} available ({_memory_source(device)}); it does not fit: {fix}."
    )


# -- values: corruption inside the data, which no header shows -------------------------------------


def _extremes(values: Tensor) -> tuple[float, float]:
    """``(min, max)`` of a tensor, NaN if it holds one: numpy's single-threaded SIMD reduction where it can read
    the memory (0.45 ms per 4 MB; torch's 2-thread ``aminmax`` measured 7 ms on 2 busy cores), else ``aminmax``."""
    if values.device.type == "cpu" and values.dtype in (torch.float16, torch.float32, torch.float64):
        array = values.detach().numpy()
        with np.errstate(invalid="ignore"):
            return float(array.min()), float(array.max())
    low, high = torch.aminmax(values)
    return float(low), float(high)


def check_values(
    values: Tensor, tensor: str, file: str | os.PathLike, fix: str, bound: float, error: type[ModelFileError]
) -> None:
    """Refuse a tensor holding NaN, inf or ``|w| > bound``: what random bytes (bit rot, a bad copy) put there.

    One min/max pass (NaN propagates into both ends, so it is seen too), about 0.5 ms per 4 MB,
    on a slice still in cache. Random bytes in a Q8_0/Q4_1 block's fp16 scale
    are inf or NaN one time in 32; with ``bound = FP16_MAX``, a scale of 2^9 or more (Q8_0: 127
    * 2^9 > 65504) is caught too, about one block in four, so a 4 KiB page of random bytes (100+
    blocks) goes unseen with odds below 1e-12. In float32 tensors, about half of random values
    exceed 65504.
    """
    if values.numel() == 0 or not values.is_floating_point():
        return
    low, high = _extremes(values)
    if math.isfinite(low) and math.isfinite(high) and -bound <= low and high <= bound:  # False for NaN
        return
    if math.isnan(low) or math.isnan(high):
        found = "NaN"
    elif math.isinf(low) or math.isinf(high):
        found = "an infinite value"
    else:
        found = f"a weight of {max(-low, high):.3g}"
    expected = "finite weights" if math.isinf(bound) else f"finite weights within ±{bound:g} (float16's range)"
    raise error(
        f"{str(file)!r}: tensor {tensor!r} holds {found}, expected {expected}: the file's data is damaged (bit rot "
        f"or a bad copy) though its header is whole; {fix}."
    )


# -- JSON configs: typed fields ---------------------------------------------------------------------

_REQUIRED: Any = object()
# What a JSON config field must hold -> (does a value match, the words for it)
_JSON_KINDS: dict[str, tuple[Any, str]] = {
    "positive int": (lambda v: _is_count(v) and v > 0, "a positive integer"),
    "positive int or null": (lambda v: v is None or (_is_count(v) and v > 0), "a positive integer or null"),
    "positive number": (lambda v: _is_number(v) and v > 0, "a positive finite number"),
    "number": (lambda v: _is_number(v), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "a JSON object"),
}


def json_field(
    config: Mapping[str, Any],
    key: str,
    want: str,
    file: str | os.PathLike,
    fix: str,
    why: str = "",
    default: Any = _REQUIRED,
    within: str = "",
) -> Any:
    """``config[key]`` if it holds ``want`` (a key of ``_JSON_KINDS``); ``default`` when absent, an error if none.

    ``within`` names the object ``config`` sits in (``"rope_parameters"``), for the message.
    """
    matches, words = _JSON_KINDS[want]
    expected, where = f"{words} ({why})" if why else words, f"{within}.{key}" if within else key
    if key not in config:
        if default is _REQUIRED:
            raise field_error(file, where, "missing", expected, fix, ModelFileError)
        return default
    value = config[key]
    if not matches(value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise field_error(file, where, shown, expected, fix, ModelFileError)
    return value


def safetensors_metadata(path: Path) -> dict[str, Any] | None:
    """The ``__metadata__`` of a safetensors header, unchecked, or None: what wrote the file (``{"format": "pt"}``
    for Hugging Face), readable even when the rest of the file is damaged."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(min(n, _SAFETENSORS_MAX_HEADER))).get("__metadata__")
    except (OSError, ValueError, AttributeError):
        return None
    return meta if isinstance(meta, dict) else None
