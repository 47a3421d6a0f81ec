"""``--target``: what ``attnlab check`` and ``attnlab trace`` run, built from a file path or a module path.

Accepted forms:

- ``path/to/mine.py:Name`` (or ``./mine.py:Name``): the file is imported as it is, its folder on
  ``sys.path`` so that its own imports work;
- ``package.module:Name``: imported from ``PYTHONPATH`` or the current folder.

``Name`` is an ``nn.Module`` class, a factory returning a module or an adapter, or a module
instance. A class or factory is called with whichever of these its signature names, under any of
the usual spellings: the width (``embed_dim``, ``d_model``, ``model_dim``, ``dim``, ``hidden_size``,
d2l's ``num_hiddens`` ...), the heads (``num_heads``, ``n_heads``, ``nhead``, ``heads``, ``h`` ...),
the K/V heads (``num_kv_heads``, ``n_kv_heads`` ...; when required and not given, H/2) and dropout
(``dropout``, ``dropout_p``, ``p`` ...); a required ``layer_idx`` gets 0, a required ``block_size``
(``max_len``, ``context_length`` ...) 1024, a required ``bias`` True. A ``config`` argument
(nanoGPT's, Hugging Face's) gets an object carrying each ``config.X`` that the class's source reads:
``n_embd``, ``hidden_size``, ``n_head``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``attn_pdrop``, ``bias``, ``block_size`` ... (:data:`CONFIG_FIELDS`). Any other
required argument or config field is an error naming it. Lazy weights (``nn.LazyLinear``) are made
by one call. Projection biases that are all zero (the usual init) get small random values, seeded,
so that a bias bug cannot hide.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import itertools
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Literal, cast

import torch
from torch import Tensor, nn

from ..runtime import UsageError
from .adapters import AttentionAdapter
from .device import place, resolve_device, resolve_dtype
from .kv_heads import find_kv_knob, has_kv_knob, set_kv_knob
from .mla import MLAAdapter, find_mla
from .probe import ProbedAdapter, as_adapter, is_lazy, materialise
from .projections import NotAttention

__all__ = ["TargetError", "build_target", "distinct_copies", "load_object", "random_biases"]


class TargetError(UsageError):
    """A ``--target`` that cannot be built; its message is the one line shown to the user."""


ALIASES: dict[str, tuple[str, ...]] = {
    "embed_dim": ("embed_dim", "d_model", "model_dim", "dim", "hidden_size", "hidden_dim", "n_embd", "emb_dim",
                  "embedding_dim", "d_embed", "embed_size", "n_embed", "width", "in_dim", "input_dim"),
    "num_heads": ("num_heads", "n_heads", "n_head", "heads", "nhead", "h", "num_attention_heads", "head_count",
                  "nheads", "num_head"),
    "num_kv_heads": ("num_kv_heads", "n_kv_heads", "num_key_value_heads", "kv_heads", "n_kv_head", "num_kv_head"),
    "dropout": ("dropout", "dropout_p", "p", "attn_dropout", "dropout_rate", "attention_dropout", "drop", "attn_drop",
                "dropout_prob"),
}  # fmt: skip
# Spellings filled with the width too: d2l's (num_hiddens; query_size, key_size, value_size of its older
# MultiHeadAttention), "LLMs from scratch"'s d_in, d_out.
_WIDTH_TOO = ("num_hiddens", "query_size", "key_size", "value_size", "d_in", "d_out")
# Arguments filled only when they have no default: (spellings, value).
_REQUIRED_ONLY: dict[str, tuple[tuple[str, ...], object]] = {
    "layer_idx": (("layer_idx", "layer_id", "layer_number", "layer"), 0),
    "block_size": (("block_size", "max_len", "max_seq_len", "context_length", "max_position_embeddings", "n_ctx",
                    "max_length", "seq_len", "max_seq_length", "n_positions", "context_size"), 1024),
    "bias": (("bias", "qkv_bias", "use_bias", "attention_bias"), True),
    "causal": (("causal", "is_causal"), False),
}  # fmt: skip
_CONFIG_ARGS = ("config", "cfg", "args", "params", "hparams", "model_args", "conf", "configs")


def _config_args(obj: Callable) -> list[str]:
    """The arguments of ``obj`` that take a config object: those of :data:`_CONFIG_ARGS`, any other named
    ``*_config`` / ``*_cfg`` / ``*_args``, or annotated with a plain class of its own file (DBRX's
    ``attn_config: DbrxAttentionConfig``)."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    home = inspect.getmodule(obj)

    def own_class(ann: object) -> bool:
        if isinstance(ann, str):
            ann = getattr(home, ann.split("[")[0].strip(), None)
        return inspect.isclass(ann) and inspect.getmodule(ann) is home and not issubclass(ann, nn.Module)

    return [
        n
        for n, p in params.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and (n in _CONFIG_ARGS or n.endswith(("_config", "_cfg", "_args")) or own_class(p.annotation))
    ]


# The fields a config may carry, by what they mean; a callable takes (E, H, G, dropout). The longest
# sequence the checks run is 1024 tokens: a causal buffer of block_size must hold it.
CONFIG_FIELDS: dict[tuple[str, ...], object] = {
    ("n_embd", "n_embed", "hidden_size", "d_model", "dim", "embed_dim", "emb_dim", "num_hiddens", "model_dim",
     "embedding_dim", "d_embed", "embed_size", "width", "hidden_dim", "n_embd_attn"): lambda E, H, G, p: E,
    ("n_head", "n_heads", "num_attention_heads", "num_heads", "nhead", "heads", "n_attn_heads", "head_count",
     "num_head"): lambda E, H, G, p: H,
    ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads", "n_query_groups",
     "num_query_groups", "multi_query_group_num"): lambda E, H, G, p: G,
    ("head_dim", "d_head", "head_size", "d_k", "kv_channels", "attention_head_size", "dim_head"):
        lambda E, H, G, p: E // H,
    ("dropout", "attention_dropout", "attention_probs_dropout_prob", "attn_pdrop", "attn_dropout", "dropout_rate",
     "attn_drop", "attn_dropout_prob", "dropout_p", "attention_dropout_prob", "drop_rate"): lambda E, H, G, p: p,
    ("resid_pdrop", "hidden_dropout_prob", "hidden_dropout", "resid_dropout", "proj_dropout", "embd_pdrop",
     "proj_drop", "output_dropout", "residual_dropout"): 0.0,  # after the out-projection: off, the checks want it exact
    ("bias", "attention_bias", "qkv_bias", "use_bias", "add_bias_linear", "add_qkv_bias", "attn_bias"): True,
    ("block_size", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_len", "context_length",
     "seq_len", "max_seq_length", "max_length", "max_sequence_length"): 1024,
    ("is_causal", "causal", "is_decoder", "use_cache", "output_attentions", "scale_attn_by_inverse_layer_idx",
     "reorder_and_upcast_attn"): False,
    ("scale_attn_weights",): True,
    ("layer_norm_eps", "layer_norm_epsilon", "norm_eps"): 1e-5,
    ("rms_norm_eps",): 1e-6,
    ("initializer_range",): 0.02,
    ("pretraining_tp",): 1,
    ("n_layer", "num_hidden_layers", "num_layers", "n_layers"): 1,
    ("vocab_size",): 256,
    ("position_embedding_type",): "absolute",
    ("_attn_implementation", "attn_implementation"): "eager",
    # multi-head latent attention (DeepSeek-V2/V3's names): small, and unequal, so that a mix-up shows
    ("kv_lora_rank",): lambda E, H, G, p: E // 2,
    ("q_lora_rank",): lambda E, H, G, p: E // 2,
    ("qk_nope_head_dim", "v_head_dim"): lambda E, H, G, p: E // H,
    ("qk_rope_head_dim",): lambda E, H, G, p: max(2, E // H // 2 // 2 * 2),
    ("qk_head_dim",): lambda E, H, G, p: E // H + max(2, E // H // 2 // 2 * 2),
    ("rope_interleave",): True,
    ("rope_theta",): 10000.0,
}  # fmt: skip
_CONFIG_VALUES = {name: value for names, value in CONFIG_FIELDS.items() for name in names}


def random_biases(module: nn.Module, seed: int) -> nn.Module:
    """Projection biases that are all zero get ``0.1 * N(0, 1)`` values (seeded): a bias bug then shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if isinstance(p, nn.parameter.UninitializedParameter):
                continue  # made by the first call: materialise() first
            if name.endswith("bias") and p.dtype.is_floating_point and not bool(p.any()):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


REDRAWN = "_attnlab_redrawn"  # the module attribute naming the layers distinct_copies redrew (see describe_call)


def distinct_copies(module: nn.Module, seed: int) -> list[str]:
    """Redraw, seeded, each ``nn.Linear`` whose weight is all zero or equals an earlier one's; returns their names.

    The Annotated Transformer builds its four projections with ``clones`` (deep copies of one Linear) and
    redraws them only later, in ``make_model``. Built alone, such a module computes Q, K and V with one
    matrix, so a q/k/v mix-up (V through the key projection, K and V swapped) changes nothing and would pass.
    Each copy gets ``nn.Linear``'s own initial distribution, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), weight and bias.
    So does a weight of zeros: AlphaFold's "final" init of the output projection (and its gate's) leaves the module's
    output a constant, which any mistake before it would match.
    """
    g = torch.Generator().manual_seed(seed + 1)
    seen: list[Tensor] = []
    redrawn: list[str] = []
    with torch.no_grad():
        for name, layer in module.named_modules():
            if not isinstance(layer, nn.Linear) or isinstance(layer.weight, nn.parameter.UninitializedParameter):
                continue
            w = layer.weight
            zero = not bool(w.any())
            if zero or any(o.shape == w.shape and torch.equal(o, w) for o in seen):
                bound = 1.0 / math.sqrt(w.shape[1])
                w.copy_((torch.rand(w.shape, generator=g) * 2 - 1) * bound)
                if layer.bias is not None:
                    layer.bias.copy_((torch.rand(layer.bias.shape, generator=g) * 2 - 1) * bound)
                redrawn.append(f"{name} (all zero)" if zero else name)
            seen.append(w.detach().clone())
    if redrawn:
        object.__setattr__(module, REDRAWN, tuple(redrawn))
    return redrawn


def _import_file(spec: str, path: Path) -> ModuleType:
    if not path.is_file():
        raise TargetError(
            f"--target {spec!r}: there is no file {str(path)!r} (looked in {os.getcwd()}); pass the path of "
            f"the .py file that defines your module, e.g. --target path/to/mine.py:MultiHeadAttention."
        )
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the file's own `import helpers` works, as under `python mine.py`
    name = f"_attnlab_target_{path.stem}_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None  # a .py file always has one
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename).resolve() == path.resolve()]
        where = f" at line {frames[-1].lineno}" if frames else ""
        raise TargetError(
            f"--target {spec!r}: importing {path} raised {type(e).__name__}{where}: {e}; "
            f"fix the file so that `python {path}` runs."
        ) from None
    return module


def load_object(spec: str) -> tuple[object, str]:
    """``(the object spec names, its name)``; a :class:`TargetError` for each way that can fail."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        if spec.endswith(".py"):
            raise TargetError(
                f"--target {spec!r} names a file but not what to build in it; add ':ClassName', e.g. "
                f"--target {spec}:MultiHeadAttention."
            )
        raise TargetError(
            f"--target {spec!r} is not 'attnlab', 'torch', 'path/to/file.py:Name' or 'package.module:Name'; "
            f"pass e.g. --target mine.py:MultiHeadAttention."
        )
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _import_file(spec, Path(where))
    else:
        if os.getcwd() not in sys.path:  # as `python -m` would: the user's own package in the current folder
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise TargetError(
                f"--target {spec!r}: module {where!r} cannot be imported ({e}); check that it is on PYTHONPATH, "
                f"or pass the file's path: --target path/to/{where.rsplit('.', 1)[-1]}.py:{attr}."
            ) from None
        except Exception as e:
            raise TargetError(f"--target {spec!r}: importing {where} raised {type(e).__name__}: {e}.") from None
    if not hasattr(module, attr):
        classes = [
            n
            for n, v in vars(module).items()
            if inspect.isclass(v) and issubclass(v, nn.Module) and v.__module__ == module.__name__
        ]
        funcs = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module.__name__]
        offer = (
            "; ".join(
                p
                for p in (
                    f"nn.Module classes: {', '.join(classes)}" if classes else "",
                    f"functions: {', '.join(funcs)}" if funcs else "",
                )
                if p
            )
            or "no classes or functions"
        )
        raise TargetError(f"--target {spec!r}: {where} defines no {attr!r} ({offer}); pass one of them after the ':'.")  # fmt: skip
    return getattr(module, attr), attr


def default_kv_heads(num_heads: int) -> int:
    """K/V heads for a module that needs a count and was given none: H/2 (grouped-query, so that a K/V head
    bug shows), or H when H is odd."""
    return num_heads // 2 if num_heads % 2 == 0 and num_heads > 1 else num_heads


def _config_reads(obj: Callable, name: str) -> tuple[list[str], set[str]]:
    """``(the attributes of argument `name` that obj's source reads, those read with a default)``."""
    source = _own_source(obj)
    read = list(dict.fromkeys(re.findall(rf"\b{name}\.([A-Za-z_]\w*)", source)))
    optional = set(re.findall(rf"getattr\(\s*{name}\s*,\s*['\"](\w+)['\"]\s*,", source))
    optional |= set(re.findall(rf"hasattr\(\s*{name}\s*,\s*['\"](\w+)['\"]", source))
    return read, optional


def _own_source(obj: Callable) -> str:
    """The source of ``obj``, of its base classes, and of the classes and functions of its file that it names
    (BertAttention builds BertSelfAttention(config)), transitively: where its config's fields are read. Read once
    per object: every constructor try and rebuild asks again."""
    try:
        return _source_once(obj)
    except TypeError:  # an unhashable callable: read each time
        return _source_once.__wrapped__(obj)


@functools.cache
def _source_once(obj: Callable) -> str:
    home = inspect.getmodule(obj)
    seen: set[int] = set()
    todo: list[object] = [obj]
    sources: list[str] = []
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        try:
            text = inspect.getsource(item)  # type: ignore[arg-type]
        except (OSError, TypeError):
            continue
        sources.append(text)
        if inspect.isclass(item):
            todo += [c for c in item.__mro__[1:] if inspect.getmodule(c) is home]
        for name in set(re.findall(r"\b([A-Za-z_]\w*)\b", text)):
            found = getattr(home, name, None)
            if (inspect.isclass(found) or inspect.isfunction(found)) and inspect.getmodule(found) is home:
                todo.append(found)
    return "\n".join(sources)


def _shares_dropout(obj: Callable, name: str) -> bool:
    """Whether ``name.dropout`` also feeds a dropout after the out-projection (nanoGPT's ``resid_dropout``)."""
    pattern = rf"(resid|proj|out|hidden)\w*\s*=\s*(nn\.)?Dropout\(\s*{name}\.dropout\b"
    return re.search(pattern, _own_source(obj)) is not None


def _make_config(spec: str, obj: Callable, param: inspect.Parameter, wanted: dict[str, object]) -> object:
    """The config object for argument ``param``: each field the source reads, filled (see :data:`CONFIG_FIELDS`)."""
    E, H = cast(int, wanted["embed_dim"]), cast(int, wanted["num_heads"])
    G = cast(int | None, wanted.get("num_kv_heads")) or default_kv_heads(H)
    p = cast(float, wanted.get("dropout") or 0.0)
    read, optional = _config_reads(obj, param.name)
    if _shares_dropout(obj, param.name):
        p = 0.0  # nanoGPT's config.dropout also drops the output: the rate checks would see both; off
    default = param.default if param.default is not inspect.Parameter.empty else None
    known = {
        f: v(E, H, G, p) if callable(v) else v for f in read if (v := _CONFIG_VALUES.get(f, _MISSING)) is not _MISSING
    }
    config = (
        copy.copy(default) if default is not None else _annotated_default(obj, param, read, known) or SimpleNamespace()
    )
    unknown: list[str] = []
    guessed: list[str] = []
    for field in read:
        value = _CONFIG_VALUES.get(field, _MISSING)
        if value is _MISSING and not hasattr(config, field) and field not in optional:
            guessed.append(field)  # a field no list names: tried by experiment (see _constructor_kwargs)
            value = _candidates(field, E, H, G)[0]
        if value is _MISSING:
            if field not in optional and not hasattr(config, field):
                unknown.append(field)
            continue
        try:
            setattr(config, field, value(E, H, G, p) if callable(value) else value)
        except (AttributeError, TypeError):  # a frozen dataclass: a namespace with its fields instead
            config = SimpleNamespace(**{**vars(config), field: value(E, H, G, p) if callable(value) else value})
    if unknown:
        raise _unfillable(spec, obj, param.name, unknown)
    if guessed:
        try:
            config.__dict__["_attnlab_guessed"] = guessed
        except (AttributeError, TypeError):
            pass
    return config


_MISSING = object()


def _unfillable(spec: str, obj: Callable, arg: str, fields: list[str]) -> TargetError:
    what = getattr(obj, "__name__", "it")
    return TargetError(
        f"--target {spec!r}: {what}() reads {', '.join(f'{arg}.{f}' for f in fields)} from its {arg!r} argument, "
        f"which check cannot fill (it fills the width, heads, K/V heads, head_dim, dropout, bias and block_size "
        f"under their usual names, and tries sizes and flags for the rest by experiment; none made it run as "
        f"attention); give {arg} a default object that has them, or point --target at a factory: "
        f"def make(embed_dim, num_heads): return {what}(...)."
    )


def _annotated_default(
    obj: Callable, param: inspect.Parameter, read: list[str], known: dict[str, object] | None = None
) -> object | None:
    """A config built from its own class's defaults: the class ``param`` is annotated with (Mistral's ``args:
    ModelArgs``), else the class of ``obj``'s file that builds with no arguments and carries the most of the
    fields ``obj`` reads (at least half); None when there is none. The ``known`` fields its constructor takes are
    handed to it, so that the fields it derives from them (gpt-fast's ``__post_init__``: K/V heads, head_dim)
    follow."""
    home = inspect.getmodule(obj)
    ann = param.annotation
    if isinstance(ann, str):  # from __future__ import annotations: look the name up where obj lives
        ann = getattr(home, ann.split("[")[0].strip(), None)
    classes = [ann] if inspect.isclass(ann) and ann not in (int, float, str, bool, dict, object, param.empty) else []
    if not classes and home is not None and read:
        scored = []
        for _, c in inspect.getmembers(home, inspect.isclass):
            if inspect.getmodule(c) is home and not issubclass(c, nn.Module):
                have = sum(hasattr(c, f) or f in getattr(c, "__dataclass_fields__", {}) for f in read)
                if have * 2 >= len(read):
                    scored.append((have, c))
        classes = [c for _, c in sorted(scored, key=lambda t: -t[0])]
    for c in classes:
        try:
            takes = inspect.signature(c).parameters
            kw = {k: v for k, v in (known or {}).items() if k in takes}
        except (TypeError, ValueError):
            kw = {}
        for args in (kw, {}) if kw else ({},):
            try:
                return c(**args)
            except Exception:
                continue
    return None


# the words _guess reads a size off: a head's size, a width
_HEAD_SIZES = frozenset({"d_k", "d_v", "dk", "dim_head", "d_head"})
_WIDTH_WORDS = frozenset("dim size state feat feats width channels hidden embd embed model features units".split())


def _guess(name: str, E: int, H: int, G: int) -> object:
    """A value for a size no list names, from what its name suggests: tried, and kept only when the module
    then runs as attention (see :func:`_constructor_kwargs`); ``_MISSING`` when nothing is suggested."""
    key = name.lower()
    words = set(re.split(r"[_\d]+", key))
    if ("head" in key and words & {"size", "dim", "d", "channels", "width"}) or key in _HEAD_SIZES:
        return E // H
    if "kv" in key or "group" in key:
        return G
    if "head" in key or key in ("h", "nh"):
        return H
    if words & {"window", "len", "length", "ctx", "max", "block", "positions", "pos", "context"}:
        return 1024
    if words & _WIDTH_WORDS:
        return E
    if words & {"theta", "base"}:
        return 10000.0
    if words & {"eps", "epsilon"}:
        return 1e-5
    if words & {"drop", "dropout", "p", "pdrop", "rate"}:
        return 0.0
    if words & {"bias", "causal", "flash"}:
        return key.endswith("bias")
    return _MISSING


def _candidates(name: str, E: int, H: int, G: int) -> list[object]:
    """Values to try for a required argument or config field no list names, the suggested one first."""
    first = _guess(name, E, H, G)
    values: list[object] = [] if first is _MISSING else [first]
    return list(dict.fromkeys([*values, E, H, E // H, G, 1024, False, True, 1.0, 0.0]))


def _takes_module(param: inspect.Parameter) -> bool:
    """Whether ``param`` is annotated as an ``nn.Module`` (a layer handed to the constructor)."""
    ann = param.annotation
    if isinstance(ann, str):
        return ann.split("[")[0].split(".")[-1].strip() == "Module"
    return inspect.isclass(ann) and issubclass(ann, nn.Module)


def _linears(E: int, H: int, G: int, kwargs: dict[str, object]) -> list[nn.Module]:
    """Layers to try for a constructor argument that takes one: E -> E (Q, the output) and E -> G*D (K and V
    of grouped-query attention, when the constructor is handed fewer K/V heads than heads), each its own."""
    kv = next((v for n, v in kwargs.items() if n in ALIASES["num_kv_heads"] and isinstance(v, int)), H)
    widths = dict.fromkeys([E, kv * (E // H), G * (E // H)])
    return [nn.Linear(E, w, bias=False) for w in widths]


# A trial value no attention module needs can still build one: a reduction ratio of 1024 makes SegFormer's
# Conv2d(E, E, kernel_size=1024) 4.3 GB of float32 at E = 32, which took most of check's 22 s there. A trial is first built on
# the meta device, which allocates nothing, and one over this many parameter and buffer elements is not run.
_TRIAL_ELEMENTS = 1 << 24


def _oversized(obj: Callable, kwargs: dict[str, object]) -> bool:
    """Whether ``obj(**kwargs)``, built on the meta device, holds more than ``_TRIAL_ELEMENTS`` elements; False
    where it cannot be built there (it then is built for real)."""
    try:
        with torch.device("meta"), torch.random.fork_rng():
            made = obj(**kwargs)
    except Exception:
        return False
    if not isinstance(made, nn.Module):
        return False
    held = [*made.parameters(), *made.buffers()]
    return sum(t.numel() for t in held) > _TRIAL_ELEMENTS


def _runs(obj: Callable, kwargs: dict[str, object], E: int, H: int, *, square: bool = False) -> bool:
    """Whether ``obj(**kwargs)`` builds a module whose self-attention of ``(2, 7, E)`` returns ``(2, 7, E)``,
    finite, and whose data flow has H heads where it can be read; ``square``: and whose every matrix is
    ``(E, E)``."""
    from .capture import SOFTMAX_OPS, capture
    from .probe import _call, context_required, read_call_form

    if _oversized(obj, kwargs):
        return False
    outs: list[object] = []
    try:
        with torch.random.fork_rng():
            made = obj(**kwargs)
            if not isinstance(made, nn.Module):
                return True
            if square and any(p.dim() == 2 and tuple(p.shape) != (E, E) for p in made.parameters()):
                return False
            made.eval()
            form = context_required(made, read_call_form(made), E)
            x = torch.randn(2, 7, E)
            with torch.no_grad():
                run = lambda: outs.append(_call(made, form, (x, x, x), {}))
                ops = capture(run, {"query": x}, made) if square else (run() or [])
    except Exception:
        return False
    y = outs[0][0] if isinstance(outs[0], tuple | list) else outs[0]
    if square:  # E by E matrices hold H heads of E / H or one of E: the softmax's size tells which
        weights = [op.shape for op in ops if op.func in SOFTMAX_OPS]
        if weights and not any(math.prod(w) == 2 * H * 7 * 7 for w in weights):
            return False
    return isinstance(y, torch.Tensor) and tuple(y.shape) == (2, 7, E) and bool(torch.isfinite(y).all())


def _constructor_kwargs(spec: str, obj: Callable, wanted: dict[str, object]) -> dict[str, object]:
    """The keyword arguments to build ``obj`` with: each of ``wanted`` under the spelling its signature uses,
    a config object for a ``config`` argument, defaults for a required layer index, block size or bias."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return {}
    kwargs: dict[str, object] = {}
    required = {
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    for canonical, value in wanted.items():
        if canonical == "num_kv_heads" and value is None:
            name = next((n for n in ALIASES[canonical] if n in required), None)
            value = default_kv_heads(cast(int, wanted["num_heads"]))  # it needs a count: grouped-query
        else:
            name = next((n for n in ALIASES[canonical] if n in params), None)
        if name is not None and value is not None:
            kwargs[name] = value
    for n in _WIDTH_TOO:
        if n in params and n not in kwargs:
            kwargs[n] = wanted["embed_dim"]
    for names, value in _REQUIRED_ONLY.values():
        for n in names:
            if n in required and n not in kwargs:
                kwargs[n] = value
    for n in _config_args(obj):
        if n not in kwargs:
            try:
                kwargs[n] = _make_config(spec, obj, params[n], wanted)
            except TargetError:
                if params[n].default is inspect.Parameter.empty:
                    raise  # else a config of its own by default: built as it is
    E, H = cast(int, wanted["embed_dim"]), cast(int, wanted["num_heads"])
    G = cast(int | None, wanted.get("num_kv_heads")) or default_kv_heads(H)
    for name, value in list(kwargs.items()):  # config fields no list names: first guesses, then each candidate
        fields = getattr(value, "__dict__", {}).get("_attnlab_guessed")
        if not fields or _runs(obj, kwargs, E, H):
            continue
        for combo in itertools.islice(itertools.product(*(_candidates(f, E, H, G) for f in fields)), 200):
            for f, v in zip(fields, combo, strict=True):
                setattr(value, f, v)
            if _runs(obj, kwargs, E, H):
                break
        else:  # no value of them makes it run as attention: say which fields, as before any was tried
            if name in params and params[name].default is not inspect.Parameter.empty:
                del kwargs[name]  # a config of its own by default (ViT-pytorch's ``config=None``): built as it is
                continue
            raise _unfillable(spec, obj, name, fields)
    unguessable = [n for n in params if n in required and n not in kwargs]
    layers = [n for n in unguessable if _takes_module(params[n])]  # torchtune's q_proj: nn.Module handed in
    if unguessable and len(unguessable) - len(layers) <= 6 and len(layers) <= 4:  # tried, kept where it runs
        options = [_linears(E, H, G, kwargs) if n in layers else _candidates(n, E, H, G) for n in unguessable]
        # beyond three sizes, the first that runs may be any width (OpenFold's Attention(c_q, c_k, c_v,
        # c_hidden, no_heads): c_hidden = E runs, heads of E each): one whose every matrix is E by E is kept first
        square = len(unguessable) - len(layers) > 3
        for strict in (True, False) if square else (False,):
            for combo in itertools.islice(itertools.product(*options), 200 if square else 64):
                trial = {**kwargs, **dict(zip(unguessable, combo, strict=True))}
                if _runs(obj, trial, E, H, square=strict):
                    return trial
    if unguessable:
        what = getattr(obj, "__name__", "it")
        raise TargetError(
            f"--target {spec!r}: {what}() needs {', '.join(repr(n) for n in unguessable)}, which check cannot guess "
            f"(it fills the width, heads, K/V heads and dropout from --embed-dim, --num-heads, --num-kv-heads, --dropout, "
            f"a config object, layer_idx, block_size and bias); "
            f"give them defaults, or point --target at a factory: def make(embed_dim, num_heads): return {what}(...)."
        )
    kwargs = _kv_heads_set(obj, kwargs, E, H, cast(int | None, wanted.get("num_kv_heads")))
    if wanted.get("num_kv_heads") is None and G != H and _takes(obj, "num_kv_heads") and not _runs(obj, kwargs, E, H):
        # H/2 K/V heads were our choice, not asked for: a module that runs only with as many as heads is built so
        whole = _constructor_kwargs(spec, obj, {**wanted, "num_kv_heads": H})
        return whole if _runs(obj, whole, E, H) else kwargs
    return kwargs


def _kv_heads_set(obj: Callable, kwargs: dict[str, object], E: int, H: int, G: int | None) -> dict[str, object]:
    """``kwargs`` with the K/V heads set where no name said which argument or config field counts them: the
    integer whose value makes the module compute G K/V heads, found by experiment (:mod:`.kv_heads`); G (or H/2
    when none was asked) goes there. Unchanged where a named K/V-heads argument or field was filled."""
    kv_fields = next(names for names in CONFIG_FIELDS if "num_key_value_heads" in names)
    configs = {n: _config_reads(obj, n)[0] for n in _config_args(obj) if n in kwargs}
    if any(n in ALIASES["num_kv_heads"] for n in kwargs) or any(f in kv_fields for fs in configs.values() for f in fs):
        return kwargs
    unnamed = {n: [f for f in fs if f not in _CONFIG_VALUES] for n, fs in configs.items()}
    knob = find_kv_knob(obj, kwargs, unnamed, E, H, default_kv_heads(H) if G is None or G >= H else G)
    return kwargs if knob is None else set_kv_knob(kwargs, knob, G or default_kv_heads(H))


def _own_width(spec: str, obj: Callable, wanted: dict[str, object]) -> int | None:
    """The width ``obj`` is built at when it cannot be built at ``wanted``'s: an integer global of its file that
    its source reads under a width's name (``n_embd = 32``), divisible by the heads, at which it runs; None when
    there is none."""
    home, H = inspect.getmodule(obj), cast(int, wanted["num_heads"])
    source = _own_source(obj)
    sentinel = -7  # a width no module has: a name _guess takes for the width answers it
    for name in dict.fromkeys(re.findall(r"\b([A-Za-z_]\w*)\b", source)):
        value = getattr(home, name, None)
        if type(value) is not int or value <= 0 or value % H or value == wanted["embed_dim"]:
            continue
        if _guess(name, sentinel, 3, 5) != sentinel:
            continue
        try:
            _constructor_kwargs(spec, obj, {**wanted, "embed_dim": value})
        except TargetError:
            continue
        return value
    return None


def is_attention_function(obj: object) -> bool:
    """Whether ``obj`` may be an attention function (then :func:`attention_function` decides by experiment): a
    callable that is neither a class nor a module, whose first three positional arguments have no default, none
    of its arguments a module's width or head count (a factory such as ``make(embed_dim, num_heads)`` is built, not called on q, k, v)."""
    if inspect.isclass(obj) or isinstance(obj, nn.Module) or not callable(obj):
        return False
    try:
        params = list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):
        return True  # a builtin (torch's scaled_dot_product_attention): the experiment decides
    widths = set(ALIASES["embed_dim"]) | set(ALIASES["num_heads"]) | {"config", "cfg"}
    if any(p.name in widths for p in params):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3:
        return all(p.default is p.empty for p in positional[:3])  # q, k, v have no defaults
    return any(p.kind == p.VAR_POSITIONAL for p in params)


def build_target(
    spec: str,
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int | None,
    dropout: float,
    seed: int,
    scale: float | None = None,
    mask_convention: Literal["keep", "block"] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    loaded: tuple[object, str] | None = None,
) -> AttentionAdapter:
    """The adapter for ``--target spec``, built at those sizes (see the module docstring), then moved to
    ``device`` in ``dtype`` (each None: where and as it was built) before its call form and mask are probed:
    a module may behave otherwise on another device. An instance named by ``spec`` is copied, not moved.
    ``loaded``: ``load_object(spec)``'s answer when the caller has it (the file is not imported twice)."""
    dev = None if device is None else resolve_device(device, "--device")
    dt = None if dtype is None else resolve_dtype(dtype, dev, "--dtype")
    obj, attr = loaded or load_object(spec)
    wanted: dict[str, object] = {
        "embed_dim": embed_dim,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "dropout": dropout,
    }
    if isinstance(obj, nn.Module):  # an instance: checked at its own size, never rebuilt
        built: object = obj
        factory = None
    elif callable(obj):
        if is_attention_function(obj):
            raise TargetError(
                f"--target {spec!r}: {attr} is an attention function f(q, k, v, ...), not a module to build; "
                f"`attnlab check --target {spec}` checks it (trace and run_checks read nn.Modules)."
            )
        try:
            kwargs = _constructor_kwargs(spec, obj, wanted)
        except TargetError:
            width = _own_width(spec, obj, wanted)  # its width fixed by a global of its file (nanoGPT's n_embd)
            if width is None:
                raise
            wanted["embed_dim"] = embed_dim = width
            kwargs = _constructor_kwargs(spec, obj, wanted)
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        torch.manual_seed(seed)
        try:
            built = obj(**kwargs)
        except Exception as e:  # the user's code: its complaint in one line, not a traceback
            raise TargetError(
                f"--target {spec!r}: {attr}({shown}) raised {type(e).__name__}: {e}; pass sizes it accepts "
                f"(--embed-dim, --num-heads, --num-kv-heads), or point --target at a factory that builds it."
            ) from None
        factory = _canonical_factory(spec, obj)
    else:
        raise TargetError(
            f"--target {spec!r}: {attr} is a {type(obj).__name__}, not an nn.Module class, a factory or a module."
        )
    lazy = isinstance(built, nn.Module) and is_lazy(built)
    if lazy:
        try:
            materialise(
                cast(nn.Module, built), embed_dim
            )  # nn.LazyLinear: one call makes the weights before they are read
        except NotAttention as e:
            raise TargetError(f"--target {spec!r}: {e}; give its layers explicit sizes (nn.Linear).") from None
    if isinstance(built, nn.Module):
        random_biases(built, seed)  # drawn on the CPU, as in every run: then moved
        distinct_copies(built, seed)
        built = place(built, dev, dt, copy_module=built is obj)
    if isinstance(built, nn.Module) and (parts := find_mla(built)) is not None:
        try:
            return MLAAdapter(built, parts, name=attr, seed=seed)  # type: ignore[return-value]
        except ValueError as e:
            raise TargetError(f"--target {spec!r}: read as multi-head latent attention, but {e}.") from None
    if isinstance(built, nn.Module) and not isinstance(built, nn.MultiheadAttention):
        from ..core.attention import MultiHeadAttention

        if not isinstance(built, MultiHeadAttention):
            try:
                # a dropout argument of its own; through a config it may feed other dropouts too: read off the module
                took_dropout = callable(obj) and not isinstance(obj, nn.Module) and _takes(obj, "dropout", config=False)
                probed = ProbedAdapter(
                    built,
                    num_heads=num_heads,
                    scale=scale,
                    mask_convention=mask_convention,
                    name=attr,
                    factory=factory,
                    dropout=dropout if took_dropout else None,  # what it was asked for is the truth
                    embed_dim=embed_dim,
                    materialised=lazy,
                )
            except NotAttention as e:
                raise TargetError(f"--target {spec!r}: {e}.") from None
            _check_runs(spec, probed)
            return probed
    try:
        adapter = cast(AttentionAdapter, place(as_adapter(built, scale=scale), dev, dt))
    except (TypeError, ValueError) as e:  # ValueError: an adapter elsewhere without to(), its message names the fix
        raise TargetError(f"--target {spec!r}: {e}") from None
    if isinstance(adapter, AttentionAdapter) and adapter.factory is None:
        adapter.factory = factory  # the head-dim and head-layout checks rebuild the target through it
    return adapter


def _takes(obj: Callable, canonical: str, *, config: bool = True) -> bool:
    """Whether ``obj`` takes ``canonical`` (a key of :data:`ALIASES`), as an argument or (``config``) a field of
    its config."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False
    spellings = ALIASES[canonical] + (_WIDTH_TOO if canonical == "embed_dim" else ())
    if any(n in params for n in spellings):
        return True
    if not config:
        return False
    fields = {
        "embed_dim": "n_embd",
        "num_heads": "n_head",
        "num_kv_heads": "num_key_value_heads",
        "dropout": "attn_pdrop",
    }  # one spelling of each: the value CONFIG_FIELDS gives it tells the meaning
    meaning = next(names for names in CONFIG_FIELDS if fields[canonical] in names)
    return any(f in meaning for n in _config_args(obj) for f in _config_reads(obj, n)[0])


def _canonical_factory(spec: str, obj: Callable) -> Callable[..., object]:
    """``obj`` behind a factory taking the canonical names, for ``resized``; it takes ``num_kv_heads``
    only when ``obj`` does (a module without K/V heads of its own cannot be rebuilt as GQA)."""

    def build(**wanted: object) -> object:
        built = obj(**_constructor_kwargs(spec, obj, wanted))
        if isinstance(built, nn.Module) and is_lazy(built):
            materialise(built, cast(int, wanted["embed_dim"]))
        if isinstance(built, nn.Module):
            random_biases(built, 0)
            distinct_copies(built, 0)
        return built

    def make(embed_dim: int, num_heads: int, dropout: float = 0.0) -> object:
        return build(embed_dim=embed_dim, num_heads=num_heads, dropout=dropout)

    def make_gqa(embed_dim: int, num_heads: int, num_kv_heads: int, dropout: float = 0.0) -> object:
        return build(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, dropout=dropout)

    if not (_takes(obj, "embed_dim") and _takes(obj, "num_heads")):
        return obj  # it cannot build other sizes: resized() says so, naming what it lacks
    return make_gqa if _takes(obj, "num_kv_heads") or has_kv_knob(obj) else make


@torch.no_grad()
def _check_runs(spec: str, adapter: ProbedAdapter) -> None:
    """One self-attention call: the module must give back ``(B, T, E)``. An exception is left to the checks
    (it is a finding about the module), unless it says the call's arguments are wrong."""
    x = torch.randn(2, 7, adapter.embed_dim).to(adapter.projections().q_weight)
    try:
        out = adapter(x, x, x)
    except TypeError as e:
        if "argument" in str(e):
            raise TargetError(
                f"--target {spec!r}: calling it as {adapter.form.describe()} raised TypeError: {e}; "
                f"attnlab check calls forward(query, key, value), forward(x_query, x_context) or forward(x)."
            ) from None
        return
    except Exception:
        return
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise TargetError(
            f"--target {spec!r}: {adapter.name} is not attention as check reads it: called on query/key/value of "
            f"shape {list(x.shape)} it returned {got}, not {list(x.shape)} (B, T, E)."
        )
