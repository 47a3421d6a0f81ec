"""``BPETokenizer``: a GGUF file's byte-level BPE tokenizer without importing ``transformers`` (issue 51).

:func:`attnlab.weight_files.gguf.tokenizer_from_gguf` builds the BPE itself with Hugging Face ``tokenizers``;
wrapping it in transformers' ``PreTrainedTokenizerFast`` imported transformers (with huggingface_hub, httpx,
yaml, ...), which left ~25 MB more resident in a process that generates from SmolLM2's GGUF (measured: 384 MB
after loading with it, 358 MB with this class). This class answers what attnlab and its users call on the
tokenizer (``encode``, ``__call__``, ``decode``, ``apply_chat_template``, the special tokens and their ids,
``convert_ids_to_tokens`` ...) from the same ``tokenizers`` object, with the same ids and text; anything else
(``save_pretrained``, ``batch_decode``, a chat template call with ``tools`` ...) is answered by the transformers
tokenizer built from that object on first use (:attr:`BPETokenizer.hf`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

__all__ = ["BPETokenizer"]

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` with transformers' tokenizer API for the calls attnlab makes.

    Args:
        backend: the ``tokenizers.Tokenizer`` (its control tokens added as special tokens already).
        bos_token, eos_token, unk_token, pad_token: the special tokens' text, or None; each is made a special
            token of ``backend`` where it is not one (what ``PreTrainedTokenizerFast`` does with them).
        chat_template: the Jinja chat template, or None.
    """

    clean_up_tokenization_spaces = False  # decode returns the bytes' text as it is
    is_fast = True

    def __init__(
        self,
        backend: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        from tokenizers import AddedToken

        self._backend = backend
        self._specials = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "unk_token": unk_token,
            "pad_token": pad_token,
        }
        self.chat_template = chat_template
        self._hf: Any = None
        self._template: Any = None
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        missing = [t for t in self._specials.values() if t is not None and backend.token_to_id(t) not in special]
        if missing:  # as PreTrainedTokenizerFast does: matched whole in text, dropped by skip_special_tokens
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])

    # -- what transformers' tokenizers have ---------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` underneath (as ``PreTrainedTokenizerFast.backend_tokenizer``)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Entries of the base vocabulary (special tokens added on top not counted)."""
        return int(self._backend.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: v for k, v in self._specials.items() if v is not None}

    def __getattr__(self, name: str) -> Any:
        # bos_token / bos_token_id and the others, then anything else from the transformers tokenizer
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _SPECIALS:
            return self._specials[name]
        if name.endswith("_id") and name[:-3] in _SPECIALS:
            token = self._specials[name[:-3]]
            return None if token is None else self._backend.token_to_id(token)
        return getattr(self.hf, name)

    @property
    def hf(self) -> Any:
        """The same tokenizer as transformers' ``PreTrainedTokenizerFast`` (built, and transformers imported, on
        first use): for the rest of transformers' API."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(
                tokenizer_object=self._backend,
                chat_template=self.chat_template,
                clean_up_tokenization_spaces=False,
                **self.special_tokens_map,
            )
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """The ids of ``text`` (with BOS/EOS where the file says llama.cpp adds them, unless
        ``add_special_tokens=False``)."""
        if kwargs:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens, **kwargs))
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """``{"input_ids": [...], "attention_mask": [...]}`` of one text; other options go to :attr:`hf`."""
        kwargs.pop("verbose", None)
        if kwargs or not isinstance(text, str):
            return self.hf(text, add_special_tokens=add_special_tokens, **kwargs)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """The text of ``ids`` (a list, or a tensor of one row or a single id)."""
        if kwargs:
            return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs))
        return str(self._backend.decode(_id_list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return [self._backend.id_to_token(i) for i in _id_list(ids) if not (skip_special_tokens and i in special)]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._backend.get_vocab(with_added_tokens=True))

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        return_tensors: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """The conversation in the chat template, as transformers renders it (a sandboxed Jinja environment with
        ``trim_blocks`` and ``lstrip_blocks``), then its ids without BOS/EOS added. ``tools``, ``documents``,
        batches of conversations and the other options of transformers' method go to :attr:`hf`."""
        plain = all(isinstance(m, Mapping) for m in conversation) and not ({"tools", "documents"} & kwargs.keys())
        rare = {"continue_final_message", "return_assistant_tokens_mask", "chat_template", "padding", "truncation"}
        if not plain or rare & kwargs.keys() or return_tensors not in (None, "pt"):
            return self.hf.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=tokenize,
                return_dict=return_dict,
                return_tensors=return_tensors,
                **kwargs,
            )
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (the GGUF file holds no tokenizer.chat_template).")
        text = self._compiled_template().render(
            messages=[dict(m) for m in conversation],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
            **kwargs,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        mask = [1] * len(ids)
        if return_tensors == "pt":
            import torch

            out: dict[str, Any] = {"input_ids": torch.tensor([ids]), "attention_mask": torch.tensor([mask])}  # (1, T)
        else:
            out = {"input_ids": ids, "attention_mask": mask}
        return out if return_dict else out["input_ids"]

    def _compiled_template(self) -> Any:
        if self._template is None:
            import jinja2
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise jinja2.exceptions.TemplateError(message)

            def tojson(
                x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
            ) -> str:
                return json.dumps(
                    x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
                )

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
            )
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template or "")  # None is refused before this
        return self._template

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, added={len(self) - self.vocab_size}, specials={self.special_tokens_map})"


def _id_list(ids: Any) -> list[int]:
    """Token ids as a flat list of ints: from a list, a tensor (one row or one id) or one int."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]
