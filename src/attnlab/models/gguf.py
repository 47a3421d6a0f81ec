"""Llama-architecture GGUF files (llama.cpp's format) -> :class:`attnlab.models.llama.Llama` + tokenizer.

Read with the ``gguf`` package (maintained with llama.cpp): :class:`gguf.GGUFReader` maps the
file, :func:`gguf.quants.dequantize` unpacks each tensor (Q4_1, Q8_0, K-quants, F16, ...) to
float32. The weights are copied into a model allocated once in the requested dtype, a slice of
rows at a time, so that loading never holds more than the model plus one slice (and the file's
pages, which the OS maps and may drop).

**Q/K row order.** llama.cpp rotates channel pairs ``(2i, 2i + 1)`` of a head; Hugging Face and
attnlab rotate ``(i, i + D/2)``. llama.cpp's converter therefore permutes the rows of ``attn_q`` and
``attn_k`` within each head (``convert_hf_to_gguf.py``: ``w.reshape(n_head, 2, D/2, E).swapaxes(1, 2)``);
:func:`unpermute_qk` applies the inverse, as transformers' GGUF loader does, so that RoPE pairs
the same channels as the model was trained with.

**Tokenizer.** Built from the file's own vocabulary, merges, special tokens and chat template
with Hugging Face ``tokenizers`` (the BPE itself) and wrapped in ``transformers``'
``PreTrainedTokenizerFast`` (``apply_chat_template``, ``decode``). The pre-tokenizer, which GGUF
names rather than stores (``tokenizer.ggml.pre``), is rebuilt from llama.cpp's definition of that
name; an unknown one is refused rather than guessed.

GGUF tensor names: ``token_embd``, ``blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output,
ffn_norm, ffn_gate, ffn_up, ffn_down}``, ``output_norm``, ``output`` (absent when tied).
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from ..runtime import UsageError
from .llama_config import LlamaConfig

if TYPE_CHECKING:  # annotations only: gguf and transformers are imported when a file is read
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "GGUFError",
    "open_gguf",
    "llama_config_from_gguf",
    "unpermute_qk",
    "load_gguf_weights",
    "tokenizer_from_gguf",
    "release_vocabulary",
]

_INSTALL = "pip install gguf"
# GGUF name after "blk.N." -> attnlab name after "layers.N."
_BLOCK_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.out_proj",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "embed", "output_norm": "norm", "output": "lm_head"}
_ROWS_PER_SLICE_BYTES = 4 << 20  # float32 bytes dequantized at a time: bounds the loader's working memory


class GGUFError(UsageError):
    """A GGUF file attnlab cannot read: missing, damaged, or of an architecture it does not have."""


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A :class:`gguf.GGUFReader` on ``path`` (memory-mapped: tensor data is read when touched)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {str(path)!r} does not exist or is not a file; pass the path of a .gguf file.")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(
            f"reading {str(path)!r} needs the gguf package, which is not installed; run `{_INSTALL}`."
        ) from None
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:  # the reader checks the magic, version and sizes
        raise GGUFError(
            f"{str(path)!r} is not a readable GGUF file ({e}); it is damaged or was cut short: copy it again."
        ) from None


def _path(reader: GGUFReader) -> str:
    """The file a reader maps (``np.memmap.filename``), for messages."""
    return str(getattr(reader.data, "filename", None) or "the GGUF file")


def release_vocabulary(reader: GGUFReader) -> None:
    """Drop the reader's long metadata arrays (vocabulary, merges, token types), once the tokenizer is built.

    ``GGUFReader`` keeps every string of them as its own small array: ~250k objects, ~160 MB for
    SmolLM2's 49k tokens and 49k merges (measured), as much as a third of the weights. Dropped
    before the weights are loaded, they no longer add to the loading peak.
    """
    for key in [k for k, f in reader.fields.items() if len(f.data) > 1024]:
        del reader.fields[key]


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def llama_config_from_gguf(reader: GGUFReader) -> LlamaConfig:
    """The :class:`LlamaConfig` a llama-architecture GGUF describes; refuses what :class:`Llama` cannot express."""
    path = _path(reader)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"{path!r} holds a model of architecture {arch!r}; attnlab reads llama-architecture GGUF files only "
            f"(Llama, SmolLM2, TinyLlama, Mistral-7B as llama, ...): load this one with Hugging Face transformers "
            f"(AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)) or llama.cpp."
        )
    names = {t.name for t in reader.tensors}
    refusals = [
        ("rope_freqs.weight" in names, "per-frequency RoPE factors (rope_freqs: Llama 3.1-style RoPE scaling)"),
        (
            _field(reader, "llama.rope.scaling.type", "none") not in ("none", None),
            f"RoPE scaling {_field(reader, 'llama.rope.scaling.type')!r}",
        ),
        (_field(reader, "llama.expert_count", 0) > 0, "mixture-of-experts layers (llama.expert_count)"),
    ]
    for refused, what in refusals:
        if refused:
            raise GGUFError(
                f"{path!r} uses {what}, which attnlab's Llama does not implement; use a GGUF of a Llama model without it."
            )
    n_embd = int(_field(reader, "llama.embedding_length"))
    n_head = int(_field(reader, "llama.attention.head_count"))
    head_dim = n_embd // n_head
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        value = _field(reader, key)
        if value is not None and int(value) != head_dim:
            raise GGUFError(
                f"{path!r} has {key}={value} but embedding_length / head_count = {n_embd} // {n_head} = {head_dim}; "
                f"attnlab's Llama rotates and attends over whole heads of n_embd // n_head channels."
            )
    vocab_size = _field(reader, "llama.vocab_size")
    if vocab_size is None:  # older files: the embedding's rows (ggml shapes are (E, V), fastest dim first)
        vocab_size = next(int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight")
    return LlamaConfig(
        vocab_size=int(vocab_size),
        block_size=int(_field(reader, "llama.context_length")),
        n_layer=int(_field(reader, "llama.block_count")),
        n_head=n_head,
        n_kv_head=int(_field(reader, "llama.attention.head_count_kv", n_head)),
        n_embd=n_embd,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names,
    )


def unpermute_qk(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, rows ``(D/2, 2)`` -> ``(2, D/2)``.

    ``w`` is ``(heads * D, ...)`` (a weight ``(heads * D, E)`` or a bias ``(heads * D,)``). llama.cpp
    stored row ``2i + j`` of a head where Hugging Face has row ``j * D/2 + i``.
    """
    D = w.size(0) // heads
    return w.reshape(heads, D // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # (heads, 2, D/2, ...) -> rows


def _attnlab_name(gguf_name: str) -> str | None:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{kind}"
    return None


def _dequantized(data: np.ndarray, qtype: Any) -> Tensor:
    """float32 tensor of a slice of a GGUF tensor's rows (a copy: the file's pages stay read-only)."""
    from gguf.quants import dequantize

    try:
        values = dequantize(data, qtype)
    except NotImplementedError as e:
        raise GGUFError(
            f"{e}: this GGUF's quantization cannot be unpacked by the installed gguf package; run `pip install -U gguf`."
        ) from None
    if not values.flags.writeable:  # F32 tensors come back as views of the read-only map
        values = np.array(values)
    return torch.from_numpy(values)


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


@torch.no_grad()
def load_gguf_weights(reader: GGUFReader, model: nn.Module) -> None:
    """Copy every tensor of ``reader`` into ``model`` (a :class:`Llama` of the matching config), in place.

    Each tensor is dequantized a slice of rows at a time and cast on the copy into the model's dtype
    and device; Q/K rows are put back into Hugging Face's rotary order (:func:`unpermute_qk`).
    """
    config: LlamaConfig = model.config  # type: ignore[assignment]
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for tensor in reader.tensors:
        name = _attnlab_name(tensor.name)
        if name is None or name not in params:
            raise GGUFError(
                f"the GGUF tensor {tensor.name!r} has no place in attnlab's Llama (expected token_embd, output_norm, "
                f"output, blk.N.{{{', '.join(_BLOCK_NAMES)}}}); the file is not a plain Llama model."
            )
        param = params[name]
        shape = tuple(int(s) for s in reversed(tensor.shape))  # ggml lists dims fastest first; torch slowest first
        if shape != tuple(param.shape):
            raise GGUFError(
                f"the GGUF tensor {tensor.name!r} has shape {shape} but its metadata implies {tuple(param.shape)} for "
                f"{name}; the file's metadata and tensors disagree: it is damaged or was written by a buggy converter."
            )
        data = tensor.data.reshape(shape[0], -1) if len(shape) > 1 else tensor.data  # (rows, bytes or values per row)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:  # small: unpermuted whole
            heads = config.n_head if ".attn_q." in tensor.name else config.n_kv_head
            param.copy_(unpermute_qk(_dequantized(data, tensor.tensor_type).reshape(shape), heads))
        else:
            row_bytes = 4 * (shape[1] if len(shape) > 1 else shape[0])
            step = max(1, _ROWS_PER_SLICE_BYTES // row_bytes)
            for start in range(0, shape[0], step):
                param[start : start + step].copy_(
                    _dequantized(data[start : start + step], tensor.tensor_type).reshape(-1, *shape[1:])
                )
        loaded.add(name)
        _drop_pages(reader, tensor.data_offset, tensor.n_bytes)
    missing = sorted(set(params) - loaded)
    if missing:
        raise GGUFError(
            f"the GGUF file lacks {len(missing)} tensor(s) its metadata implies, e.g. {missing[:3]}; it is incomplete."
        )


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


def tokenizer_from_gguf(reader: GGUFReader) -> PreTrainedTokenizerBase:
    """The tokenizer a GGUF file describes, as a ``transformers`` fast tokenizer.

    Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen2, ...) is built here
    from the file's vocabulary, merges, control tokens and chat template. SentencePiece
    vocabularies (``"llama"``: Llama 2, TinyLlama) go to transformers' own GGUF conversion, which
    rebuilds their merges from the token scores.
    """
    path = _path(reader)
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, processors
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise GGUFError(
            f"building the tokenizer of {path!r} needs transformers and tokenizers; run `pip install transformers`."
        ) from None
    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "llama":
        return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    if kind != "gpt2":
        raise GGUFError(
            f"{path!r} has a tokenizer of kind {kind!r} (tokenizer.ggml.model); attnlab builds 'gpt2' (byte-level BPE) "
            f"and 'llama' (SentencePiece) tokenizers; load this one with transformers' AutoTokenizer(gguf_file=...)."
        )
    pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")  # files from before the field: GPT-2's split, as transformers
    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(
            f"{path!r} names the pre-tokenizer {pre!r} (tokenizer.ggml.pre), which attnlab does not know; known: "
            f"{sorted(_PRE_TOKENIZERS)}. A guessed one would split text differently from the model's training: "
            f"load this tokenizer with transformers (AutoTokenizer.from_pretrained(dir, gguf_file=name))."
        )
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    bpe = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            ignore_merges=_PRE_TOKENIZERS[pre][2],
        )
    )
    bpe.pre_tokenizer = _pre_tokenizer(pre)
    bpe.decoder = decoders.ByteLevel()
    # token_type 3 = CONTROL (<|im_start|>, <|endoftext|>): matched whole in text, dropped by decode(skip_special_tokens=True).
    # A file without token types has no control tokens (strict=False: zip stops at the empty list).
    types = _field(reader, "tokenizer.ggml.token_type", [])
    bpe.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=False) if k == 3]
    )

    def special(key: str) -> tuple[str, int] | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if i is None else (tokens[int(i)], int(i))

    bos, eos = special("bos"), special("eos")
    template = "$A:0"  # llama.cpp adds BOS/EOS to every encoded text when the file says so; so does this
    if bos is not None and _field(reader, "tokenizer.ggml.add_bos_token", False):
        template = f"{bos[0]}:0 {template}"
    if eos is not None and _field(reader, "tokenizer.ggml.add_eos_token", False):
        template = f"{template} {eos[0]}:0"
    if template != "$A:0":
        bpe.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[t for t in (bos, eos) if t is not None]
        )
    unk, pad = special("unknown"), special("padding")
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=None if bos is None else bos[0],
        eos_token=None if eos is None else eos[0],
        unk_token=None if unk is None else unk[0],
        pad_token=None if pad is None else pad[0],
        chat_template=_field(reader, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
