"""Checkpoints (safetensors + json, atomic), tokenizers, and ``attnlab generate`` run in-process."""

from __future__ import annotations

import json
import os
import shlex

import pytest
import torch

from attnlab import ByteTokenizer, CharTokenizer, GPTConfig, TinyGPT, generate, load_checkpoint, save_checkpoint
from attnlab.cli import main
from attnlab.weight_files.saved_model import CheckpointError

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

    def crash(fd):
        raise OSError("disk full")  # the new bytes are in the temp file, not yet renamed over the old one

    monkeypatch.setattr(os, "fsync", crash)
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


def _suggested_command(err: str) -> list[str]:
    """The ``attnlab ...`` command an error line suggests, as argv for main()."""
    assert err.startswith("attnlab: error: ") and err.count("\n") == 1, err
    args = shlex.split(err[err.index(": attnlab generate ") + 2 :])
    assert args[:2] == ["attnlab", "generate"]
    return args[1:]


# (flags after --checkpoint, the start of the error's sentence)
CLI_MISTAKES = {
    "too many new tokens": (
        ["--prompt", "to be", "--max-new-tokens", "100"],
        "--prompt (5 tokens) + --max-new-tokens 100 = 105 exceeds the model's block_size=64; ask for at most 59: ",
    ),
    "too many, default prompt": (
        ["--max-new-tokens", "100"],
        "--prompt (1 token) + --max-new-tokens 100 = 101 exceeds the model's block_size=64; ask for at most 63: ",
    ),
    "prompt too long": (
        ["--prompt", "to be or not " * 6],
        "--prompt is 78 tokens but the model's block_size is 64, which leaves no room for a new token; keep its end: ",
    ),
    "prompt outside the alphabet": (["--prompt", "Zen?"], "--prompt 'Zen?' uses '?Z', outside the model's alphabet"),
    "control characters outside the alphabet": (["--prompt", "\x07\t"], "--prompt '\\x07\\t' uses "),
}


@pytest.mark.parametrize("mistake", list(CLI_MISTAKES))
def test_cli_errors_are_one_line_and_their_suggestion_runs_as_is(tmp_path, capsys, mistake):
    flags, start = CLI_MISTAKES[mistake]
    model, tok = char_model()
    save_checkpoint(model, tmp_path, tokenizer=tok)
    assert main(["generate", "--checkpoint", str(tmp_path), "--device", "cpu", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("attnlab: error: " + start), (
        captured.err
    )  # nothing printed before the error
    assert main(_suggested_command(captured.err)) == 0
    assert capsys.readouterr().out


def test_cli_input_errors_before_loading(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "does not exist or is not a directory" in err and "Traceback" not in err and err.count("\n") == 1
    for flags, message in [
        (
            ["--max-new-tokens", "0"],
            "--max-new-tokens must be an integer >= 1, got 0; or leave it out for all that fit.",
        ),
        (["--temperature", "-1"], "--temperature must be a number >= 0, got -1.0; 0 is greedy, 0.8 the default."),
        (["--top-k", "0"], "--top-k must be an integer >= 1, got 0; or pass --top-k None for no limit."),
        (["--top-p", "1.5"], "--top-p must be a number > 0 and <= 1, got 1.5; or pass --top-p None for no limit."),
        (["--device", "gpu"], "--device 'gpu' is not a device name; use auto"),
    ]:  # checked before the checkpoint is even looked at
        assert main(["generate", "--checkpoint", str(tmp_path / "missing"), *flags]) == 2
        assert capsys.readouterr().err.startswith(f"attnlab: error: {message}")


def _lab_config(tmp_path, task: str, **data):
    """A tiny TrainConfig for ``task``, whatever the lab calls its fields (the flag vocabulary renames
    ``run_dir``/``n_embd``/... while this test is written: it takes the names that exist)."""
    from dataclasses import fields

    from attnlab.lab import DataConfig, ModelConfig, TrainConfig

    def pick(cls, *names):
        have = {f.name for f in fields(cls)}
        return next(n for n in names if n in have)

    model = {pick(ModelConfig, "num_layers", "n_layer"): 1, pick(ModelConfig, "embed_dim", "n_embd"): 16}
    model[pick(ModelConfig, "num_heads", "n_head")] = 2
    run = {pick(TrainConfig, "out_dir", "run_dir"): tmp_path / task}
    return TrainConfig(
        steps=2,
        eval_every=1,
        ckpt_every=0,
        progress=False,
        data=DataConfig(task=task, batch_size=8, **data),
        model=ModelConfig(**model),
        **run,
    )


LAB_TASKS = {  # task -> (DataConfig overrides, what the default prompt is)
    "copy": ({}, "a"),
    "recall": ({}, "a"),
    "random": ({}, "!"),
    "random-no-tokenizer": ({"task": "random", "vocab_size": 100}, "0"),  # more ids than printable characters
    "text": ({"text_path": "book.txt"}, "\n"),
}


@pytest.mark.parametrize("task", list(LAB_TASKS))
def test_cli_defaults_work_on_every_checkpoint_the_lab_writes(tmp_path, capsys, monkeypatch, task):
    from attnlab.lab import train

    data, prompt = LAB_TASKS[task]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "book.txt").write_text("to be, or not to be: that is the question.\n" * 20)
    if "text_path" in data:
        data = {**data, "text_path": tmp_path / data["text_path"]}
    data = {"task": task, **data}
    result = train(_lab_config(tmp_path, **data), quiet=True)
    model_dir = result.run_dir / "model"
    block = load_checkpoint(model_dir)[0].config.block_size
    assert main(["generate", "--checkpoint", str(model_dir)]) == 0  # every option at its default
    captured = capsys.readouterr()
    assert captured.out.startswith(prompt)
    assert captured.err == (
        f"attnlab: note: generating {block - 1} tokens, all that fit in block_size {block} after the 1 token of the "
        f"prompt (--max-new-tokens N asks for fewer)\n"
    )
    text = captured.out[len(prompt) : -1]
    assert len(text.split()) == block - 1 if task == "random-no-tokenizer" else len(text) == block - 1


def test_cli_ctrl_c_keeps_the_printed_text_and_exits_130_without_a_traceback(tmp_path, capsys, monkeypatch):
    from attnlab.models.generation import Step
    from attnlab.tools import generate_cli

    model, tok = char_model()
    save_checkpoint(model, tmp_path, tokenizer=tok)

    def interrupted(*args, **kwargs):
        def steps():
            yield Step(tokens=torch.tensor([tok.encode("t")[0]]), logits=torch.zeros(1, tok.vocab_size))
            raise KeyboardInterrupt  # as Ctrl-C during the second step

        return steps()

    monkeypatch.setattr(generate_cli, "generate_steps", interrupted)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "to be", "--max-new-tokens", "9"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "to bet\n" and captured.err == (
        "attnlab: generate interrupted (Ctrl-C) before it finished; kept the prompt and 1 new token, printed above.\n"
    )


def test_cli_without_a_tokenizer_and_under_256_ids_reads_and_writes_token_ids(tmp_path, capsys):
    model = TinyGPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=16)).eval()
    save_checkpoint(model, tmp_path)  # no tokenizer, too few ids for UTF-8 bytes
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(tmp_path),
                "--prompt",
                "3 14 15",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    expected = generate(model, torch.tensor([[3, 14, 15]]), 5, temperature=0)[0, 3:].tolist()
    assert capsys.readouterr().out == "3 14 15" + "".join(f" {i}" for i in expected) + "\n"
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "3 abc 150"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "attnlab: error: --prompt '3 abc 150' is not token ids: expected token ids 0 .. 99 separated by spaces;"
    )
    assert main(_suggested_command(err)) == 0  # ... --prompt 3
