"""``open_gguf``'s reader (array fields held compactly) reads every field as the ``gguf`` package's reader does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from attnlab.weight_files.gguf import open_gguf  # noqa: E402


def _write(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_string("test.text", "héllo")
    w.add_array("test.strings", ["a", "", "Ġthe", "<|im_end|>", "ünï"])
    w.add_array("test.ints", [3, -1, 7])
    w.add_array("test.floats", [0.5, -2.25])
    w.add_array("test.bools", [True, False, True])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_bool("test.flag", True)
    w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _value(field: object, index: int | slice) -> object:
    try:
        return field.contents(index)  # type: ignore[attr-defined]
    except Exception as e:  # the same failure from both readers counts as the same reading
        return type(e).__name__


def test_fields_read_as_the_package_reader(tmp_path: Path) -> None:
    path = tmp_path / "fields.gguf"
    _write(path)
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, expected in theirs.fields.items():
        field = ours.fields[key]
        assert (field.offset, field.name, list(field.types)) == (expected.offset, expected.name, list(expected.types))
        assert list(field.data) == list(expected.data), key
        assert len(field.parts) == len(expected.parts), key
        for a, b in zip(field.parts, expected.parts, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), key
        for index in (slice(None), slice(1, None, 2), 0, -1):
            assert _value(field, index) == _value(expected, index), (key, index)
    assert ours.fields["test.strings"].contents() == ["a", "", "Ġthe", "<|im_end|>", "ünï"]
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)


def test_strings_past_the_end_are_refused(tmp_path: Path) -> None:
    """A string array whose last length runs past the file is a ValueError, as the package's reader fails too."""
    path = tmp_path / "cut.gguf"
    _write(path)
    reader = gguf.GGUFReader(path)
    field = reader.fields["test.strings"]
    last_length = field.parts[field.data[-1] - 1]  # the uint64 length before the last string's bytes
    at = int(last_length.ctypes.data - reader.data.ctypes.data)
    del reader, field, last_length
    raw = bytearray(path.read_bytes())
    raw[at : at + 8] = (len(raw)).to_bytes(8, "little")
    path.write_bytes(raw)
    from attnlab.weight_files.gguf import _compact_reader

    with pytest.raises(ValueError, match="past the end of the file"):
        _compact_reader()(path)
