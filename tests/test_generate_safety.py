"""``attnlab generate --model/--checkpoint`` and ``--chat`` at their edges: no stdin, stdin that is not
UTF-8, interrupts in every phase, half characters at the end of a stream, every flag at and past its
bound, and prompts or conversations that fill the model's context.

A tiny random Llama and a tiny byte-level BPE tokenizer (trained here, GPT-2's byte alphabet) stand
in for SmolLM2: ``from_pretrained("smollm2")`` answers with them, so the command takes the path it
takes for the real model. Where the text must be exact, ``generate_steps`` is replaced by a script
of token ids.
"""

from __future__ import annotations

import io
import os
import random
import re
import sys
from types import SimpleNamespace

import pytest
import torch

import attnlab
from attnlab import GPTConfig, TinyGPT, save_checkpoint
from attnlab.cli import main
from attnlab.models.generation import MIN_TEMPERATURE, Step
from attnlab.models.llama import Llama
from attnlab.models.llama_config import LlamaConfig
from attnlab.runtime import LimitError, Terminated, UsageError
from attnlab.tools import generate_cli, text_stream
from attnlab.weight_files import pretrained

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = ["The capital of France is Paris. Say hi. naïve café ☕ 日本語 ok"] * 8
INTERRUPTS = [(KeyboardInterrupt, "Ctrl-C", 130), (Terminated, "SIGTERM", 143)]
NO_LINES = "--chat without --prompt answers one user turn per line of stdin, and stdin"


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE tokenizer of 300 ids: the 256 byte tokens, 3 special ones, 41 merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    special = ["<|end|>", "<|user|>", "<|assistant|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=alphabet, special_tokens=special, show_progress=False
    )
    tk.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|end|>", chat_template=TEMPLATE, clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="module")
def byte_fallback_tok():
    """A SentencePiece-style tokenizer: byte tokens <0x00> .. <0xFF> decoded by ByteFallback, not byte-level BPE."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "▁": 258, "H": 259, "i": 260}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", clean_up_tokenization_spaces=False)


def tiny_llama(vocab_size: int, block_size: int = 48) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, block_size=block_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32
    )
    return Llama(config).eval()


@pytest.fixture
def served(monkeypatch, tok):
    """``from_pretrained("smollm2")`` answers with the tiny model and tokenizer; ``.loads`` lists the loads,
    ``.on_load`` runs at each (to play an interrupt or a slow writer)."""
    state = SimpleNamespace(model=tiny_llama(len(tok)), tok=tok, loads=[], on_load=None)

    def fake(source, **kwargs):
        state.loads.append(source)
        if state.on_load is not None:
            state.on_load()
        return state.model, state.tok

    monkeypatch.setattr(pretrained, "from_pretrained", fake)
    return state


class Script:
    """``generate_steps`` replaced by token ids, one list per call; an exception in a list is raised there
    (an interrupt in that phase). ``.calls``: each call's prompt ids, new-token count and keyword arguments."""

    def __init__(self, *answers: list) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[list[int], int, dict]] = []

    def __call__(self, lm, idx, n, **kwargs):
        self.calls.append((idx[0].tolist(), n, kwargs))
        answer = self.answers[len(self.calls) - 1]

        def steps():
            for item in answer[:n] if all(isinstance(t, int) for t in answer) else answer:
                if isinstance(item, BaseException) or (isinstance(item, type) and issubclass(item, BaseException)):
                    raise item
                yield Step(torch.tensor([item]), torch.zeros(1, 1))

        return steps()


def script(monkeypatch, *answers: list) -> Script:
    fake = Script(*answers)
    monkeypatch.setattr(generate_cli, "generate_steps", fake)
    return fake


class Stdin(io.StringIO):
    """Text on stdin; ``tty``: a terminal; ``fail``: what the n-th ``readline`` raises instead (1-based)."""

    def __init__(self, text: str = "", *, tty: bool = False, fail: dict[int, BaseException] | None = None) -> None:
        super().__init__(text)
        self.tty, self.fail, self.reads = tty, fail or {}, 0

    def isatty(self) -> bool:
        return self.tty

    def readline(self, *args) -> str:  # type: ignore[override]
        self.reads += 1
        if self.reads in self.fail:
            raise self.fail[self.reads]
        return super().readline(*args)


def ids_of(tok, token: str) -> int:
    return tok.convert_tokens_to_ids(token)


# The first line on stderr once a model is loaded (tests/test_weights_choice.py tests what it says).
WEIGHTS_LINE = re.compile(r"^attnlab: weights [^\n]*\n")


def run(capsys, *args: str) -> tuple[int, str, str]:
    """``attnlab generate *args``: its exit code, stdout, and stderr after the weights line."""
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, WEIGHTS_LINE.sub("", err, count=1)


def one_error(err: str) -> str:
    """The message of the one ``attnlab: error:`` line ``err`` must be."""
    assert err.count("\n") == 1 and err.startswith("attnlab: error: "), err
    return err[len("attnlab: error: ") : -1]


# -- --chat and stdin ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stdin, why",
    [
        (lambda: io.StringIO(""), "has no lines"),
        (lambda: io.StringIO("\nnever read\n"), "starts with an empty line, which ends the conversation"),
        (lambda: open(os.devnull), "has no lines"),  # `</dev/null`
        (lambda: None, "is closed"),  # `0<&-`: Python sets sys.stdin to None
    ],
    ids=["empty", "empty-first-line", "dev-null", "closed"],
)
def test_chat_without_turns_on_stdin_is_an_error_before_the_model_loads(served, capsys, monkeypatch, stdin, why):
    stream = stdin()
    monkeypatch.setattr(sys, "stdin", stream)
    try:
        code, out, err = run(capsys, "--model", "smollm2", "--chat")
    finally:
        if stream is not None:
            stream.close()
    assert (code, out, served.loads) == (2, "", [])
    assert one_error(err) == (
        f"{NO_LINES} {why}; pipe the turns in (printf 'What is the capital of France?\\nAnd of Italy?\\n' | "
        "attnlab generate --model smollm2 --chat), or pass --prompt TEXT for one turn."
    )


def test_chat_from_a_pipe_not_yet_written_reads_it_after_loading(served, tok, capsys, monkeypatch):
    """A writer still starting (nothing in the pipe yet) is not waited for before the model loads."""
    r, w = os.pipe()
    stdin = os.fdopen(r, encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)

    def writer_starts_now():
        os.write(w, b"Say hi\n")
        os.close(w)

    served.on_load = writer_starts_now
    steps = script(monkeypatch, tok("ok")["input_ids"] + [tok.eos_token_id])
    try:
        code, out, err = run(capsys, "--model", "smollm2", "--chat")
    finally:
        stdin.close()
    assert (code, out) == (0, "ok\n") and "tokens/s" in err
    assert steps.calls[0][0] == generate_cli._chat_ids(tok, [{"role": "user", "content": "Say hi"}])


def test_chat_from_a_pipe_that_ends_empty_after_loading_is_the_same_error(served, capsys, monkeypatch):
    r, w = os.pipe()
    stdin = os.fdopen(r, encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    served.on_load = lambda: os.close(w)
    try:
        code, out, err = run(capsys, "--model", "smollm2", "--chat")
    finally:
        stdin.close()
    assert (code, out, served.loads) == (2, "", ["smollm2"])
    assert one_error(err).startswith(f"{NO_LINES} has no lines; pipe the turns in")


def test_chat_at_a_terminal_ends_quietly_on_ctrl_d_with_its_line_ended(served, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", Stdin("", tty=True))
    assert run(capsys, "--model", "smollm2", "--chat") == (0, "> \n", "")


# -- text that is not UTF-8 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["--model", "--checkpoint"])
def test_a_prompt_with_bytes_the_shell_could_not_decode_names_the_byte_and_its_place(served, tmp_path, capsys, source):
    where = "smollm2" if source == "--model" else str(tmp_path)
    code, out, err = run(capsys, source, where, "--prompt", "abc\udcff\udcfeé")  # argv bytes ff fe, surrogateescaped
    assert (code, out, served.loads) == (2, "", [])
    assert one_error(err) == (
        "--prompt is not UTF-8 text: bytes 0xff 0xfe at character 3 (after 'abc'); pass it as UTF-8 "
        "(convert other text with iconv -f ITS-ENCODING -t UTF-8)."
    )


@pytest.mark.parametrize(
    "stdin, message",
    [
        (
            lambda: io.TextIOWrapper(io.BytesIO(b"Say hi\nab\xffc\n"), encoding="utf-8"),
            "stdin line 2 is not UTF-8 text: byte 0xff at byte 2 (after 'ab')",
        ),
        (lambda: Stdin("Say hi\nx\udcfe\n"), "stdin line 2 is not UTF-8 text: byte 0xfe at character 1 (after 'x')"),
        (
            lambda: Stdin("Say hi\n", fail={2: UnicodeDecodeError("utf-8", b"zz\xc3(", 2, 3, "invalid")}),
            "stdin line 2 is not UTF-8 text: byte 0xc3 at byte 2 of the block read",
        ),
    ],
    ids=["bytes", "surrogates", "decode-error"],
)
def test_a_stdin_line_that_is_not_utf8_names_its_line_and_byte_and_keeps_the_answers(
    served, tok, capsys, monkeypatch, stdin, message
):
    monkeypatch.setattr(sys, "stdin", stdin())
    script(monkeypatch, tok("ok")["input_ids"] + [tok.eos_token_id])
    code, out, err = run(capsys, "--model", "smollm2", "--chat")
    assert (code, out) == (2, "ok\n")  # the first turn was answered
    assert err.splitlines()[-1] == (
        f"attnlab: error: {message}; pass it as UTF-8 (convert other text with iconv -f ITS-ENCODING -t UTF-8)."
    )


def test_a_first_stdin_line_that_is_not_utf8_is_refused_before_loading(served, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xe9t\xe9\n"), encoding="utf-8"))  # Latin-1
    code, out, err = run(capsys, "--model", "smollm2", "--chat")
    assert (code, out, served.loads) == (2, "", [])
    assert one_error(err).startswith("stdin line 1 is not UTF-8 text: byte 0xe9 at byte 0;")


# -- never half a character ----------------------------------------------------------------------------------------


def test_byte_level_text_matches_the_tokenizers_decode_and_holds_back_only_a_cut_character(tok):
    """Random ids, special ones among them: what is printed, then the bytes held back, is ``decode`` of them all."""
    from tokenizers import pre_tokenizers

    assert set(text_stream.byte_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())
    token_bytes = text_stream.byte_level_bytes(tok)
    assert token_bytes is not None
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tok) + 3) for _ in range(rng.randrange(1, 12))]  # a few past the vocabulary
        text = text_stream.Utf8Text(token_bytes)
        printed = "".join(text.push(i) for i in ids)
        whole = tok.decode(ids, skip_special_tokens=True)
        if text.held:
            assert whole == printed + "\ufffd" and text.held <= 3  # one U+FFFD: a character begun, not finished
        else:
            assert whole == printed


def test_streaming_stops_short_of_a_character_cut_by_max_new_tokens_and_says_so(served, tok, capsys, monkeypatch):
    sun = tok("日")["input_ids"]  # 'æĹ', '¥': bytes e6 97, then a5
    assert len(sun) == 2 and tok.decode(sun[:1]) == "\ufffd"
    ids = tok("ok ")["input_ids"] + sun[:1]
    script(monkeypatch, ids)
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", "Say", "--max-new-tokens", str(len(ids)))
    assert (code, out) == (0, "Sayok \n")  # what --max-new-tokens cut is not printed as U+FFFD
    assert err.splitlines()[0] == (
        f"attnlab: note: the text ends in half a UTF-8 character (bytes 0xe6 0x97, the last 1 token), left out: "
        f"--max-new-tokens {len(ids)} stopped it there; ask for more tokens to see it whole."
    )


def test_a_replacement_character_the_model_means_is_printed_at_once_even_at_the_end(served, tok, monkeypatch, capsys):
    """0xff can never be UTF-8, and ef bf bd is U+FFFD itself: both are printed as they come, never held."""
    ff, ef, bf, bd = (ids_of(tok, c) for c in "ÿï¿½")  # GPT-2's byte alphabet: these bytes stand for themselves
    assert tok.decode([ff]) == tok.decode([ef, bf, bd]) == "\ufffd"
    h = tok("h")["input_ids"]
    ids = [*h, ff, *h, ef, bf, bd, ff]
    script(monkeypatch, ids)
    writes: list[str] = []
    stdout = io.StringIO()
    monkeypatch.setattr(stdout, "write", lambda s: writes.append(s) or len(s))
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["generate", "--model", "smollm2", "--prompt", "x", "--max-new-tokens", str(len(ids))]) == 0
    assert [w for w in writes if w] == ["x", "h", "\ufffd", "h", "\ufffd", "\ufffd", "\n"]  # ef, bf: held a step each
    assert "half a UTF-8 character" not in capsys.readouterr().err


def lossy(ids: list[int]) -> str:
    """``bytes.decode(errors="replace")`` of the ids as bytes: the byte-level decoders' rule."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_redecoding_never_prints_text_it_must_take_back_and_never_holds_a_replacement_for_ever():
    """The other tokenizers, on a decoder whose text only grows: what is printed is always a prefix of the
    text so far, what is held back is only U+FFFD, and all the text of 3 tokens ago is printed."""
    rng = random.Random(1)
    pieces = [b"a", "é".encode(), "日".encode(), "😀".encode(), b"\xff", b"\xed\xa2"]
    for _ in range(300):
        ids = [b for _ in range(rng.randrange(1, 6)) for b in rng.choice(pieces)]
        text = text_stream.Redecode(lossy)
        printed = ""
        for n, i in enumerate(ids, 1):
            printed += text.push(i)
            so_far = lossy(ids[:n])
            assert so_far.startswith(printed) and set(so_far[len(printed) :]) <= {"\ufffd"}
            assert len(printed) >= len(lossy(ids[: max(0, n - text_stream.MAX_PENDING)]))
            assert text.held <= text_stream.MAX_PENDING and bool(text.held) == (printed != so_far)
    text = text_stream.Redecode(lossy)
    assert [text.push(b) for b in b"\xff\xff\xff\xffa"] == ["", "", "", "\ufffd", "\ufffd\ufffd\ufffda"]


def test_a_tokenizer_that_is_not_byte_level_streams_by_redecoding(served, byte_fallback_tok, capsys, monkeypatch):
    served.tok = byte_fallback_tok
    served.model = tiny_llama(len(byte_fallback_tok))
    assert text_stream.byte_level_bytes(byte_fallback_tok) is None
    H, i = ids_of(byte_fallback_tok, "H"), ids_of(byte_fallback_tok, "i")
    sun = [2 + b for b in "日".encode()]
    ids = [H, *sun, i, 2 + 0xFF, *sun, i, *sun[:2]]  # ff then 日 is 4 x U+FFFD to ByteFallback; the last 日 cut
    script(monkeypatch, ids)
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", "x", "--max-new-tokens", str(len(ids)))
    assert byte_fallback_tok.decode(ids[:-2]) == "H日i\ufffd\ufffd\ufffd\ufffdi"
    assert (code, out) == (0, "xH日i\ufffd\ufffd\ufffd\ufffdi\n")
    assert "half a UTF-8 character (decoded as U+FFFD, the last 2 tokens), left out" in err


def test_checkpoint_bytes_stream_as_whole_characters(tmp_path, capsys, monkeypatch):
    """A checkpoint without a tokenizer and 256+ ids reads UTF-8 bytes: they stream (they were printed only
    at the end before), a character at a time, an id past 255 as nothing."""
    save_checkpoint(TinyGPT(GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16)), tmp_path)
    ids = [*"é".encode(), 299, *"日".encode()[:2]]
    script(monkeypatch, ids)
    writes: list[str] = []
    stdout = io.StringIO()
    monkeypatch.setattr(stdout, "write", lambda s: writes.append(s) or len(s))
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "a", "--max-new-tokens", "5"]) == 0
    assert [w for w in writes if w] == ["a", "é", "\n"]
    assert "(bytes 0xe6 0x97, the last 2 tokens), left out: --max-new-tokens 5" in capsys.readouterr().err


# -- interrupts ----------------------------------------------------------------------------------------------------


def interrupted(err: str, how: str, kept: str | None) -> None:
    """``err`` ends with the one interrupt line, and has no other."""
    outcome = f"kept {kept}" if kept else "nothing more was written"
    assert err.count("interrupted") == 1
    assert err.splitlines()[-1] == f"attnlab: generate interrupted ({how}) before it finished; {outcome}."


@pytest.mark.parametrize("signal, how, code", INTERRUPTS, ids=["ctrl-c", "sigterm"])
def test_an_interrupt_while_loading_writes_nothing(served, capsys, signal, how, code):
    def interrupt():
        raise signal()

    served.on_load = interrupt
    rc, out, err = run(capsys, "--model", "smollm2", "--prompt", "Say")
    assert (rc, out) == (code, "")
    interrupted(err, how, None)
    assert err.count("\n") == 1


@pytest.mark.parametrize("signal, how, code", INTERRUPTS, ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize(
    "tokens, out, kept",
    [
        ([], "Say\n", "the prompt and no new tokens, printed above"),  # in the prefill
        (["o", "k"], "Sayok\n", "the prompt and 2 new tokens, printed above"),
        (
            ["o", "sun"],
            "Sayo\n",
            "the prompt and 1 new token, printed above (1 token more, half a UTF-8 character, left out)",
        ),
    ],
    ids=["prefill", "streaming", "half-a-character"],
)
def test_an_interrupt_while_generating_keeps_the_text_printed_and_ends_its_line(
    served, tok, capsys, monkeypatch, signal, how, code, tokens, out, kept
):
    ids = [tok("日")["input_ids"][0] if t == "sun" else ids_of(tok, t) for t in tokens]
    script(monkeypatch, [*ids, signal])
    rc, printed, err = run(capsys, "--model", "smollm2", "--prompt", "Say", "--max-new-tokens", "9")
    assert (rc, printed) == (code, out)
    interrupted(err, how, kept)
    assert err.count("\n") == 1  # no rate line, no note: the one interrupt line


@pytest.mark.parametrize("signal, how, code", INTERRUPTS, ids=["ctrl-c", "sigterm"])
def test_an_interrupt_in_a_conversation_keeps_the_answers(served, tok, capsys, monkeypatch, signal, how, code):
    ok = [*tok("ok")["input_ids"], tok.eos_token_id]
    monkeypatch.setattr(sys, "stdin", Stdin("Say hi\nAgain\n"))
    script(monkeypatch, ok, [ids_of(tok, "h"), signal])
    rc, out, err = run(capsys, "--model", "smollm2", "--chat")
    assert (rc, out) == (code, "ok\nh\n")
    interrupted(err, how, "1 answer and 1 token of the next answer, printed above")


@pytest.mark.parametrize("signal, how, code", INTERRUPTS, ids=["ctrl-c", "sigterm"])
def test_an_interrupt_at_the_terminal_prompt_between_turns_ends_the_prompt_line(
    served, tok, capsys, monkeypatch, signal, how, code
):
    monkeypatch.setattr(sys, "stdin", Stdin("Say hi\n", tty=True, fail={2: signal()}))
    script(monkeypatch, [*tok("ok")["input_ids"], tok.eos_token_id])
    rc, out, err = run(capsys, "--model", "smollm2", "--chat")
    assert (rc, out) == (code, "> ok\n> \n")
    interrupted(err, how, "1 answer, printed above")


def test_an_interrupt_in_a_checkpoint_stream_is_the_same_line(tmp_path, capsys, monkeypatch):
    save_checkpoint(TinyGPT(GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16)), tmp_path)
    script(monkeypatch, [*b"hi", Terminated])
    rc, out, err = run(capsys, "--checkpoint", str(tmp_path), "--prompt", "a", "--max-new-tokens", "5")
    assert (rc, out) == (143, "ahi\n")
    interrupted(err, "SIGTERM", "the prompt and 2 new tokens, printed above")


# -- the model's context -------------------------------------------------------------------------------------------


def test_a_prompt_that_fills_the_context_exactly_runs_and_one_token_longer_is_refused(served, tok, capsys):
    block = served.model.config.block_size
    prompt = "ok " * 200
    ids = tok(prompt)["input_ids"]
    fits = tok.decode(ids[: block - 4])
    assert len(tok(fits)["input_ids"]) == block - 4
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", fits, "--max-new-tokens", "4", "--temperature", "0")
    assert code == 0 and out.startswith(fits)
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", fits, "--max-new-tokens", "5")
    assert (code, out) == (2, "")
    assert one_error(err).startswith(
        f"--prompt ({block - 4} tokens) + --max-new-tokens 5 = {block + 1} exceeds the model's block_size={block}; "
        f"ask for at most 4: attnlab generate --model smollm2 --prompt"
    )
    full = tok.decode(ids[:block])
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", full)
    assert one_error(err) == (
        f"--prompt is {block} tokens but the model's block_size is {block}, which leaves no room for a new token; "
        f"keep at most its last {block - 1} tokens."
    )
    almost = tok.decode(ids[: block - 1])  # one token left, and no --max-new-tokens: that one, with a note
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", almost)
    assert code == 0 and "attnlab: note: generating 1 tokens, all that fit in block_size" in err


def test_a_very_long_prompt_is_refused_in_one_short_line(served, capsys):
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", "ok " * 40_000, "--max-new-tokens", "3")
    assert (code, out) == (2, "")
    assert len(one_error(err)) < 200 and "leaves no room for a new token" in err


def test_a_long_prompt_that_fits_is_not_repeated_in_the_suggestion(served, tok, capsys):
    served.model = tiny_llama(len(tok), block_size=512)
    prompt = "x" * 300  # no merges for x: 300 tokens
    assert len(tok(prompt)["input_ids"]) == 300
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", prompt, "--max-new-tokens", "10" + "0" * 400)
    assert (code, out) == (2, "")
    assert one_error(err) == (
        "--prompt (300 tokens) + --max-new-tokens 10000000... (a 402-digit integer) = 10000000... (a 402-digit "
        "integer) exceeds the model's block_size=512; ask for at most 212: pass --max-new-tokens 212"
    )


def test_a_chat_turn_past_the_context_names_its_line_and_keeps_the_conversation(served, tok, capsys, monkeypatch):
    block = served.model.config.block_size
    first = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "ok"}]

    def length(line: str) -> int:
        return len(generate_cli._chat_ids(tok, [*first, {"role": "user", "content": line}]))

    long = next("x" * k for k in range(1, block) if 0 < block - length("x" * k) < 4)  # room for 1 .. 3 tokens
    n = length(long)
    monkeypatch.setattr(sys, "stdin", Stdin(f"Say hi\n{long}\nnever\n"))
    steps = script(monkeypatch, [*tok("ok")["input_ids"], tok.eos_token_id])
    code, out, err = run(capsys, "--model", "smollm2", "--chat", "--max-new-tokens", "4")
    assert (code, out, len(steps.calls)) == (2, "ok\n", 1)
    assert err.splitlines()[-1] == (
        f"attnlab: error: stdin line 2 does not fit: the conversation with it is {n} tokens, and + --max-new-tokens "
        f"4 = {n + 4} exceeds the model's block_size={block}; at most {block - n} new tokens fit (--max-new-tokens "
        f"{block - n}); the 1 answer before it is printed above."
    )


def test_a_chat_turn_that_leaves_no_room_at_all_suggests_a_new_conversation(served, tok, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", Stdin("x" * 60 + "\n"))
    code, out, err = run(capsys, "--model", "smollm2", "--chat")
    assert (code, out) == (2, "")
    assert one_error(err).endswith(
        "which leaves no room for an answer in the model's block_size=48; it is the first line; "
        "start a new conversation from this line (tail -n +1 TURNS.txt | attnlab generate --model smollm2 --chat)."
    )


def test_a_chat_turn_past_the_context_at_a_terminal_is_skipped_and_the_conversation_goes_on(
    served, tok, capsys, monkeypatch
):
    ok = [*tok("ok")["input_ids"], tok.eos_token_id]
    monkeypatch.setattr(sys, "stdin", Stdin("Say hi\n" + "x" * 40 + "\nAgain\n", tty=True))
    steps = script(monkeypatch, ok, ok)
    code, out, err = run(capsys, "--model", "smollm2", "--chat", "--max-new-tokens", "4")
    assert (code, out) == (0, "> ok\n> > ok\n> \n")
    assert "stdin line 2 does not fit" in err and "This line is left out; type a shorter one" in err
    history = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "ok"}]
    assert steps.calls[1][0] == generate_cli._chat_ids(tok, [*history, {"role": "user", "content": "Again"}])


def test_one_chat_turn_past_the_context_counts_the_template(served, capsys):
    code, out, err = run(capsys, "--model", "smollm2", "--chat", "--prompt", "x" * 60)
    assert (code, out) == (2, "")
    assert one_error(err).startswith("--prompt in the chat template is ") and "; shorten it by " in err


# -- every flag at and past its bound ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--max-new-tokens", "0"],
            "--max-new-tokens must be an integer >= 1, got 0; or leave it out for all that fit.",
        ),
        (
            ["--max-new-tokens", "-1"],
            "--max-new-tokens must be an integer >= 1, got -1; or leave it out for all that fit.",
        ),
        (["--temperature", "nan"], "--temperature must be a number >= 0, got nan; 0 is greedy, 0.8 the default."),
        (["--temperature", "inf"], "--temperature must be a number >= 0, got inf; 0 is greedy, 0.8 the default."),
        (["--temperature", "-0.5"], "--temperature must be a number >= 0, got -0.5; 0 is greedy, 0.8 the default."),
        (
            ["--temperature", "1e-40"],
            f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got 1e-40: dividing the logits by less "
            "overflows float32 and sampling fails; pass 0 for greedy decoding.",
        ),
        (["--top-k", "0"], "--top-k must be an integer >= 1, got 0; or pass --top-k None for no limit."),
        (["--top-p", "0"], "--top-p must be a number > 0 and <= 1, got 0.0; or pass --top-p None for no limit."),
        (["--top-p", "1.5"], "--top-p must be a number > 0 and <= 1, got 1.5; or pass --top-p None for no limit."),
        (["--top-p", "nan"], "--top-p must be a number > 0 and <= 1, got nan; or pass --top-p None for no limit."),
        (
            ["--seed", "-1"],
            "--seed must be an integer >= 0 and <= 18446744073709551615, got -1; torch.Generator's seeds are "
            "0 .. 2**64 - 1.",
        ),
        (
            ["--seed", str(2**64)],
            "--seed must be an integer >= 0 and <= 18446744073709551615, got 18446744073709551616; torch.Generator's "
            "seeds are 0 .. 2**64 - 1.",
        ),
        (["--prompt", ""], "--model 'smollm2' needs something to answer: pass --prompt, or --chat for a conversation"),
    ],
)
def test_each_flag_past_its_bound_is_one_line_before_loading(served, capsys, flags, message):
    args = ["--model", "smollm2", *(["--prompt", "Say"] if "--prompt" not in flags else []), *flags]
    code, out, err = run(capsys, *args)
    assert (code, out, served.loads) == (2, "", [])
    assert one_error(err).startswith(message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch build has CUDA")
def test_device_cuda_on_a_cpu_build_is_one_line_before_loading(served, capsys):
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", "Say", "--device", "cuda")
    assert (code, out, served.loads) == (2, "", [])
    assert one_error(err).startswith("--device 'cuda', but this torch (") and "sees no CUDA GPU" in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--seed", str(2**64 - 1)],
        ["--top-k", "1" + "0" * 30, "--top-p", "1"],  # past the vocabulary, and the whole nucleus: no limit
        ["--temperature", str(MIN_TEMPERATURE)],
        ["--temperature", "1e300"],  # as good as uniform
    ],
)
def test_flags_at_their_bounds_generate(served, capsys, flags):
    code, out, err = run(capsys, "--model", "smollm2", "--prompt", "Say", "--max-new-tokens", "3", *flags)
    assert code == 0 and out.startswith("Say") and "tokens/s" in err


def test_compile_with_chat_compiles_every_turn_s_decode_step(served, tok, capsys, monkeypatch):
    """Each turn asks generate_steps to compile; its graph is per cache size, reused by later turns (test_generate)."""
    monkeypatch.setattr(sys, "stdin", Stdin("Say hi\nAgain\n"))
    ok = [*tok("ok")["input_ids"], tok.eos_token_id]
    steps = script(monkeypatch, ok, ok)
    code, out, err = run(capsys, "--model", "smollm2", "--chat", "--compile")
    assert (code, out) == (0, "ok\nok\n")
    assert [kwargs["compile"] for _, _, kwargs in steps.calls] == [True, True]
    assert err.count("after the first step, which compiled in") == 2


def test_the_python_api_refuses_the_same_mistakes_with_the_same_messages():
    model = TinyGPT(GPTConfig(vocab_size=50, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    idx = torch.zeros(1, 3, dtype=torch.long)
    for kwargs, message in [
        ({"temperature": float("nan")}, "temperature must be a number >= 0, got nan; 0 is greedy."),
        ({"temperature": float("inf")}, "temperature must be a number >= 0, got inf; 0 is greedy."),
        ({"temperature": True}, "temperature must be a number >= 0, got True; 0 is greedy."),
        ({"temperature": 1e-40}, f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got 1e-40:"),
        ({"top_k": 0}, "top_k must be an integer >= 1, got 0; or None for no limit."),
        ({"top_k": 2.0}, "top_k must be an integer >= 1, got 2.0; or None for no limit."),
        ({"top_p": 0.0}, "top_p must be a number > 0 and <= 1, got 0.0; or None for no limit."),
        ({"top_p": float("nan")}, "top_p must be a number > 0 and <= 1, got nan; or None for no limit."),
        ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1."),
    ]:
        n = kwargs.pop("max_new_tokens", 2)
        with pytest.raises(UsageError) as caught:
            attnlab.generate(model, idx, n, **kwargs)
        assert str(caught.value).startswith(message), (kwargs, str(caught.value))
    with pytest.raises(LimitError, match=r"max_new_tokens 10000000\.\.\. \(a 31-digit integer\) = "):
        attnlab.generate(model, idx, 10**30)
    assert attnlab.generate(model, idx, 2, top_k=10**400, top_p=1.0).shape == (1, 5)  # no limit, no OverflowError
