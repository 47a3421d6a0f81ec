"""Checkpoints (safetensors + json, atomic), tokenizers, and ``attnlab generate`` run in-process."""

from __future__ import annotations

import json

import pytest
import torch

from attnlab import ByteTokenizer, CharTokenizer, GPTConfig, TinyGPT, generate, load_checkpoint, save_checkpoint
from attnlab.cli import main
from attnlab.models.saved_model import CheckpointError

TEXT = "to be, or not to be: that is the question.\n"


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def char_model(**overrides) -> tuple[TinyGPT, CharTokenizer]:
    tok = CharTokenizer.from_text(TEXT)
    kw = dict(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=32) | overrides
    return TinyGPT(GPTConfig(**kw)).eval(), tok


@pytest.mark.parametrize("flags", [{}, {"n_kv_head": 1, "position": "rotary", "bias": False}])
def test_round_trip_keeps_logits_config_and_tokenizer(tmp_path, flags):
    model, tok = char_model(**flags)
    save_checkpoint(model, tmp_path / "ckpt", tokenizer=tok)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # no temp files left
    loaded, tok2 = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == model.config and not loaded.training
    assert isinstance(tok2, CharTokenizer) and tok2.chars == tok.chars
    idx = torch.tensor([tok.encode("to be")])
    torch.testing.assert_close(loaded(idx), model(idx), atol=0, rtol=0)


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    model, tok = char_model()
    save_checkpoint(model, tmp_path, tokenizer=tok)
    before = (tmp_path / "model.safetensors").read_bytes()
    real_write_bytes = type(tmp_path).write_bytes

    def crash(path, data):
        real_write_bytes(path, data[:10])  # half a file on disk, then the failure
        raise OSError("disk full")

    monkeypatch.setattr(type(tmp_path), "write_bytes", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(TinyGPT(model.config), tmp_path, tokenizer=tok)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_load_errors_are_one_clear_sentence(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"does not exist or is not a directory; pass the directory that save_checkpoint wrote"
    ):
        load_checkpoint(tmp_path / "nowhere")
    model, tok = char_model()
    save_checkpoint(model, tmp_path, tokenizer=tok)
    meta = json.loads((tmp_path / "config.json").read_text())
    meta["config"]["n_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"has config keys \['n_experts'\] that GPTConfig does not know"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "pickle"}))
    with pytest.raises(CheckpointError, match="has format 'pickle', expected 'attnlab.TinyGPT'"):
        load_checkpoint(tmp_path)


def test_tokenizers_round_trip_and_refuse_unknown_characters():
    tok = CharTokenizer.from_text(TEXT)
    assert tok.decode(tok.encode("not to be")) == "not to be"
    assert tok.encode("\n ") == [0, 1]  # sorted alphabet: ids do not depend on the order of the text
    assert CharTokenizer.from_text(TEXT[::-1]).chars == tok.chars
    with pytest.raises(ValueError, match=r"1 character\(s\) outside the tokenizer's alphabet, e.g. 'Z'"):
        tok.encode("Zen")
    byte = ByteTokenizer()
    text = "naïve café 東京"
    assert byte.decode(byte.encode(text)) == text and max(byte.encode(text)) < 256


def test_cli_generate_prints_the_greedy_continuation(tmp_path, capsys):
    model, tok = char_model()
    save_checkpoint(model, tmp_path, tokenizer=tok)
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path),
                "--prompt",
                "to be",
                "--max-new-tokens",
                "12",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    expected = generate(model, torch.tensor([tok.encode("to be")]), 12, temperature=0)[0].tolist()
    assert out == tok.decode(expected) + "\n"


def test_cli_sampling_repeats_with_a_seed_and_uses_bytes_without_a_tokenizer(tmp_path, capsys):
    model = TinyGPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16)).eval()
    save_checkpoint(model, tmp_path)  # no tokenizer: UTF-8 bytes
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "héllo", "--max-new-tokens", "20", "--top-k", "50"]
    outs = []
    for seed in ("1", "1", "2"):
        assert main([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2]
    assert all(o.startswith("héllo") for o in outs)


def test_cli_errors_are_one_line_not_a_traceback(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "does not exist or is not a directory" in err and "Traceback" not in err and err.count("\n") == 1
    model, tok = char_model()
    save_checkpoint(model, tmp_path, tokenizer=tok)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "to be", "--max-new-tokens", "100"]) == 2
    captured = capsys.readouterr()
    assert "prompt length 5 + max_new_tokens 100 = 105 exceeds block_size=64" in captured.err
    assert captured.out == ""  # nothing printed before the error
