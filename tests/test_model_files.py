"""Model files under damage and mismatch: every broken checkpoint is one sentence naming the file and
what is wrong, from Python and from ``attnlab generate``; a plain ``safetensors.save_file`` of
``state_dict()`` works and loads back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab import CharTokenizer, GPTConfig, TinyGPT, load_checkpoint, save_checkpoint
from attnlab.cli import main
from attnlab.weight_files.saved_model import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TEXT = "to be, or not to be: that is the question.\n"


def _saved(directory: Path, **overrides) -> tuple[TinyGPT, CharTokenizer]:
    tok = CharTokenizer.from_text(TEXT)
    kw = dict(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=16) | overrides
    model = TinyGPT(GPTConfig(**kw)).eval()
    save_checkpoint(model, directory, tokenizer=tok)
    return model, tok


def _edit_config(directory: Path, **changes) -> None:
    meta = json.loads((directory / "config.json").read_text())
    meta["config"].update(changes)
    (directory / "config.json").write_text(json.dumps(meta))


def _truncate(d: Path) -> None:
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 2])


def _garbage(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file" * 10)


def _empty(d: Path) -> None:
    (d / "model.safetensors").write_bytes(b"")


def _other_weights(d: Path) -> None:  # weights of a smaller vocabulary under this config.json
    save_file({"transformer.wte.weight": torch.zeros(3, 16)}, d / "model.safetensors")


def _fuse(d: Path, rows: int | None = None) -> None:  # the layout from before q/k/v were split: one in_proj
    sd = load_file(d / "model.safetensors")
    for i in range(2):
        p = f"transformer.h.{i}.attn."
        for kind in ("weight", "bias"):
            sd[f"{p}in_proj.{kind}"] = torch.cat(
                [sd.pop(f"{p}{proj}.{kind}") for proj in ("q_proj", "k_proj", "v_proj")]
            )
            if rows is not None:
                sd[f"{p}in_proj.{kind}"] = sd[f"{p}in_proj.{kind}"][:rows]
    save_file(sd, d / "model.safetensors")


# (how to damage a saved checkpoint, the words the error must contain)
DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated weights": (
        _truncate,
        r"model.safetensors' is not a readable safetensors file \(.*\): it is damaged or was cut short",
    ),
    "garbage weights": (_garbage, r"model.safetensors' is not a readable safetensors file"),
    "empty weights": (_empty, r"model.safetensors' is not a readable safetensors file \(.*; 0 bytes\)"),
    "missing weights": (lambda d: (d / "model.safetensors").unlink(), r"has no model.safetensors"),
    "missing config": (lambda d: (d / "config.json").unlink(), r"has no config.json"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{'format': "), r"config.json' is not valid JSON"),
    "config not UTF-8": (lambda d: (d / "config.json").write_bytes(b"\xff\xfe{}"), r"config.json' is not valid JSON"),
    "config without a config": (
        lambda d: (d / "config.json").write_text(json.dumps({"format": "attnlab.TinyGPT"})),
        r"config.json' has no 'config' object \(got None\)",
    ),
    "n_embd changed": (
        lambda d: _edit_config(d, n_embd=32),
        r"model.safetensors': transformer.wte.weight has shape \(17, 16\) but config.json says vocab_size=17, "
        r"n_embd=32 -> \(17, 32\); the two files come from different models",
    ),
    "vocab_size changed": (
        lambda d: _edit_config(d, vocab_size=70),
        r"transformer.wte.weight has shape \(17, 16\) but config.json says vocab_size=70, n_embd=16 -> \(70, 16\)",
    ),
    "block_size changed": (
        lambda d: _edit_config(d, block_size=64),
        r"transformer.wpe.weight has shape \(32, 16\) but config.json says block_size=64, n_embd=16 -> \(64, 16\)",
    ),
    "n_kv_head changed": (
        lambda d: _edit_config(d, n_kv_head=2),
        r"transformer.h.0.attn.k_proj.weight has shape \(16, 16\) but config.json says n_kv_head=2, n_head=4, "
        r"n_embd=16 -> \(8, 16\)",
    ),
    "n_layer changed": (
        lambda d: _edit_config(d, n_layer=3),
        r"does not match config.json: it holds 2 blocks \(transformer.h.0 .. h.1\) but config.json says n_layer=3",
    ),
    "position changed": (
        lambda d: _edit_config(d, position="rotary"),
        r"it has transformer.wpe.weight but config.json says position='rotary'",
    ),
    "old fused layout, n_kv_head changed": (
        lambda d: (_fuse(d), _edit_config(d, n_kv_head=1)),
        r"transformer.h.0.attn.in_proj.bias has shape \(48,\) but config.json says n_kv_head=1, n_head=4, "
        r"n_embd=16 -> \(24,\)",
    ),
    "bias changed": (
        lambda d: _edit_config(d, bias=False),
        r"it has biases \(e.g. .*\) but config.json says bias=False",
    ),
    "other weights": (
        _other_weights,
        r"does not match config.json: it holds no transformer blocks \(transformer.h.\*\) but config.json says n_layer=2",
    ),
    "bad config value": (
        lambda d: _edit_config(d, n_head=0),
        r"config.json' holds a config TinyGPT cannot build: GPTConfig.n_head must be a positive int, got 0",
    ),
    "bad dtype": (
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "dtype": "int8"})
        ),
        r"config.json' has dtype 'int8', expected one of",
    ),
    "bad tokenizer": (
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "tokenizer": {"kind": "bpe"}})
        ),
        r"config.json': tokenizer json must be",
    ),
    "tokenizer larger than the model": (
        lambda d: (d / "config.json").write_text(
            json.dumps({**json.loads((d / "config.json").read_text()), "tokenizer": {"kind": "byte"}})
        ),
        r"its tokenizer has 256 ids but config vocab_size=17; the tokenizer belongs to another model",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_or_mismatched_checkpoint_names_the_file_and_the_mismatch(tmp_path, capsys, damage):
    break_it, message = DAMAGE[damage]
    _saved(tmp_path / "ckpt")
    break_it(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(tmp_path / "ckpt")
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    # the same sentence on the command line: exit 2, one line, no traceback
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"attnlab: error: {info.value}\n" and captured.out == ""


def test_wrong_directories_point_at_the_right_one(tmp_path):
    model, _ = _saved(tmp_path / "run" / "model")
    (tmp_path / "run" / "config.json").write_text(json.dumps({"steps": 10, "model": {"kind": "gpt"}}))
    with pytest.raises(
        CheckpointError, match=r"'.*run' is a training run's directory; its model is '.*run/model': pass that"
    ):
        load_checkpoint(tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"is a file; pass the directory holding it, '.*run/model'"):
        load_checkpoint(tmp_path / "run" / "model" / "model.safetensors")
    (tmp_path / "minimal").mkdir()
    (tmp_path / "minimal" / "config.json").write_text(json.dumps({"model": {"kind": "minimal"}}))
    with pytest.raises(
        CheckpointError, match=r"trained seed 002's block \(model.kind 'minimal'\), which is not a TinyGPT"
    ):
        load_checkpoint(tmp_path / "minimal" / "model")
    loaded, _ = load_checkpoint(tmp_path / "run" / "model")  # the right one loads
    torch.testing.assert_close(loaded(torch.tensor([[1, 2]])), model(torch.tensor([[1, 2]])), atol=0, rtol=0)


def test_an_unreadable_config_is_named(tmp_path, monkeypatch):
    _saved(tmp_path)
    real_read_text = Path.read_text

    def denied(self, *args, **kwargs):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)  # chmod 0 does not stop root, who runs CI here
    with pytest.raises(CheckpointError, match=r"config.json' cannot be read \(Permission denied\); make it readable"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("flags", [{}, {"n_kv_head": 1, "position": "rotary", "bias": False}])
def test_state_dict_saves_with_plain_safetensors_and_loads_back(tmp_path, flags):
    model = TinyGPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32, **flags)).eval()
    sd = model.state_dict()
    assert all(v.is_contiguous() for v in sd.values())
    save_file(sd, tmp_path / "model.safetensors")  # raised "non contiguous tensor: transformer.wte.weight" before
    other = TinyGPT(model.config).eval()
    other.load_state_dict(load_file(tmp_path / "model.safetensors"))
    idx = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(other(idx), model(idx), atol=0, rtol=0)
    for m in (model, other):  # the decode-speed layout is kept on both sides: (V, E) seen through (E, V) storage
        w = m.transformer.wte.weight
        assert w.shape == (50, 32) and not w.is_contiguous() and w.t().is_contiguous()
    assert sd["transformer.wte.weight"].data_ptr() != model.transformer.wte.weight.data_ptr()  # a copy, not the weight
    kept = model.state_dict(keep_vars=True)["transformer.wte.weight"]
    assert kept is model.transformer.wte.weight  # keep_vars=True still hands out the parameter itself


def test_state_dict_under_a_prefix_and_in_a_container_is_contiguous():
    model = TinyGPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=8))
    outer = torch.nn.ModuleDict({"lm": model})
    sd = outer.state_dict()
    assert sd["lm.transformer.wte.weight"].is_contiguous()
    torch.testing.assert_close(sd["lm.transformer.wte.weight"], model.transformer.wte.weight, atol=0, rtol=0)


def test_a_checkpoint_in_the_old_fused_layout_still_loads(tmp_path):
    model, _ = _saved(tmp_path)
    _fuse(tmp_path)
    loaded, _ = load_checkpoint(tmp_path)
    idx = torch.randint(0, 17, (2, 9))
    torch.testing.assert_close(loaded(idx), model(idx), atol=0, rtol=0)
