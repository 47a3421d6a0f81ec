"""Which masks a model gets under ``attn_implementation="attnlab"``: the one guard for models whose
attention never calls a function by name.

transformers 5 lets any registered name be set on any model: it checks a custom name against no
property of the model class. Most models dispatch their attention through
``ALL_ATTENTION_FUNCTIONS`` and call attnlab's function. Others (BLOOM, MPNet, Falcon, GPT-Neo,
DeBERTa-v2 in transformers 5.24) compute attention inline and never do. They still build their
masks with ``create_causal_mask`` / ``create_bidirectional_mask``, which pick the mask function
registered under the same name. If that were ``sdpa_mask`` (bool, True = may attend), their
inline code would *add* it to the scores as HF's eager masks are added: every kept key +1, every
blocked one +0, so padding would silently stop blocking anything.

So :func:`attnlab_mask` gives such a model HF's eager mask (float, 0 keeps, the dtype's minimum
blocks), exactly what it gets under ``"eager"``, and warns once that attnlab does not run there.
Every other model gets ``sdpa_mask`` as before; attnlab's attention function takes both forms.
"""

from __future__ import annotations

import sys
import warnings
from functools import cache
from typing import Any

__all__ = ["calls_attention_by_name", "attnlab_mask"]


@cache
def _model_class_calls_by_name(model_type: str) -> bool | None:
    """True/False for a model type transformers knows, None when it cannot tell (a remote-code model)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type)
    if not isinstance(name, str):
        return None
    try:
        cls = getattr(transformers, name)
    except (AttributeError, ImportError, RuntimeError):
        return None
    module = sys.modules.get(cls.__module__)
    if module is None:
        return None
    # A modeling file that dispatches by name imports the registry; one that computes inline does not.
    return "ALL_ATTENTION_FUNCTIONS" in vars(module)


def calls_attention_by_name(config: Any) -> bool | None:
    """Whether the model built from ``config`` calls its attention through transformers' registry.

    Decided from the modeling module of ``config.model_type``'s base class (None: unknown, e.g. a
    model from remote code; it is then assumed to call by name, as transformers assumes).
    """
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not model_type:
        return None
    return _model_class_calls_by_name(model_type)


@cache
def _warn_inline(model_type: str) -> None:
    warnings.warn(
        f"attn_implementation='attnlab' was set on a {model_type!r} model, whose attention is computed inline "
        f"(transformers' modeling_{model_type.replace('-', '_')}.py never calls an attention function by name): "
        f"attnlab's attention does not run there. The model was given HF's eager mask, so its results are "
        f"those of attn_implementation='eager'; load it with attn_implementation='eager' to silence this, "
        f"or use attnlab.swap(model) for the modules attnlab recognises.",
        UserWarning,
        stacklevel=4,
    )


def attnlab_mask(*args: Any, **kwargs: Any) -> Any:
    """The mask function registered under ``"attnlab"``: ``sdpa_mask``, or ``eager_mask`` for a model
    whose attention is inline (see the module docstring). Same signature as transformers' mask
    functions; ``config`` is the keyword transformers passes."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    config = kwargs.get("config")
    if config is not None and calls_attention_by_name(config) is False:
        _warn_inline(str(config.model_type))
        return eager_mask(*args, **kwargs)
    return sdpa_mask(*args, **kwargs)
