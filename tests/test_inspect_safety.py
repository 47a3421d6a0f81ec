"""attnlab inspect fails cleanly: short texts are "too short to tell", limits are refused before the
model runs (or loads) with the number that fits, the three files are written as one set that an
interrupt, an error or a rerun never mixes, and an earlier result is replaced only with --overwrite.

Every CLI run goes through ``attnlab.cli.main`` on a saved TinyGPT (2 layers x 4 heads, context 64).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

import attnlab
import attnlab.heads.page
import attnlab.heads.report
import attnlab.weight_files.pretrained
from attnlab.cli import main
from attnlab.heads import classify, text_scores
from attnlab.heads.report import RESULT_FILES, memory_needed
from attnlab.heads.scores import MIN_PROBE_LEN, MIN_TEXT_ROWS, THRESHOLDS, UNDECIDED
from attnlab.models.gpt import GPTConfig, TinyGPT
from attnlab.runtime import LimitError, Terminated, UsageError
from attnlab.weight_files.saved_model import save_checkpoint

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"
TEXT = "the cat sat on the mat, warm"  # 28 tokens: every score is decided
FAST = ["--probe-len", "8", "--probe-batch", "2"]
SHORT_SCORES = {"prev_token", "sink", "diagonal", "distance", "uniformity"}


def tiny(block_size: int = 64) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=40, block_size=block_size, n_layer=2, n_head=4, n_embd=32)).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tiny(), tmp_path_factory.mktemp("ckpt") / "model", tokenizer=attnlab.CharTokenizer(ALPHABET))


def quiet_main(argv: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


@pytest.fixture(scope="module")
def earlier(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete result (all three files) of one run, copied by each test that needs one there."""
    out = tmp_path_factory.mktemp("earlier") / "result"
    assert quiet_main(["inspect", "--checkpoint", str(ckpt), "--text", TEXT, "--out-dir", str(out), *FAST]) == 0
    return out


def run(capsys: pytest.CaptureFixture[str], ckpt: Path, out: Path, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["inspect", "--checkpoint", str(ckpt), "--out-dir", str(out), *FAST, *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every entry of ``directory`` (hidden ones too) with its bytes: what a reader would find there."""
    return {p.name: p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(directory.iterdir())}


def stamps(directory: Path) -> set[str]:
    """The run ids the result's files carry: one id when they are one set."""
    ids = set()
    if (directory / "heads.json").exists():
        ids.add(json.loads((directory / "heads.json").read_text())["written"]["id"])
    if (directory / "heads.png").exists():
        ids.add(re.search(r"run (\w+)", Image.open(directory / "heads.png").text["Comment"]).group(1))  # type: ignore[union-attr]
    if (directory / "index.html").exists():
        meta = re.search(r'id="attnlab-meta">(.*?)</script>', (directory / "index.html").read_text()).group(1)  # type: ignore[union-attr]
        ids.add(json.loads(meta)["written"]["id"])
    return ids


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the model fails the test: what is checked must be refused before it."""

    def loaded(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(attnlab.weight_files.pretrained, "from_pretrained", loaded)


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Running the model fails the test."""

    def ran(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model ran")

    monkeypatch.setattr(attnlab.heads.report, "run_and_capture", ran)


# ---- too short to tell ----


def test_the_minimums_follow_from_the_thresholds_on_the_real_scores() -> None:
    """At its minimum, a head with no preference scores past the margin (half a one-key threshold,
    twice the local one) through text_scores itself, and one row fewer it does not; a head with half
    of each row on one key falls under the uniform threshold exactly from uniformity's minimum."""
    assert MIN_TEXT_ROWS == {"entropy": 1, "uniformity": 19, "distance": 15, "sink": 7, "prev_token": 7, "diagonal": 7}
    assert MIN_PROBE_LEN == 4
    rule = {score: value for _, score, _, value in THRESHOLDS}

    def even(t: int) -> dict[str, float]:  # every row spreads over the keys it sees
        w = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
        return {k: float(v) for k, v in text_scores(w[None, None]).items()}

    def half_on_one(t: int) -> float:  # half of each row on key 0, the rest spread over the others
        w = torch.zeros(t, t)
        for i in range(1, t):
            w[i, 1 : i + 1] = 0.5 / i
            w[i, 0] = 0.5
        w[0, 0] = 1.0
        return float(text_scores(w[None, None])["uniformity"])

    for score in ("prev_token", "sink", "diagonal"):
        rows = MIN_TEXT_ROWS[score]
        bound = rule["sink" if score == "sink" else "prev_token"] / 2
        assert even(rows + 1)[score] <= bound < even(rows)[score]
    rows = MIN_TEXT_ROWS["distance"]
    assert even(rows)["distance"] < 2 * rule["distance"] <= even(rows + 1)["distance"]
    rows = MIN_TEXT_ROWS["uniformity"]
    assert half_on_one(rows + 1) < rule["uniformity"] <= half_on_one(rows)


def test_a_two_token_text_names_no_text_kind() -> None:
    """The reviewer's case: 2 tokens made 6 previous-token heads. Now every text score but entropy is
    NaN with its reason, and each head is induction, duplicate (the probe decides those) or undecided."""
    report = attnlab.inspect(tiny(), [3, 5], probe_len=8, probe_batch=2)
    assert set(report.too_short) == SHORT_SCORES
    assert "needs a text of at least 8 tokens" in report.too_short["prev_token"]
    assert all(torch.isnan(report.scores[s]).all() for s in SHORT_SCORES)
    assert not torch.isnan(report.scores["entropy"]).any() and not torch.isnan(report.scores["induction"]).any()
    kinds = {k for row in report.kinds for k in row}
    assert kinds <= {"induction", "duplicate", UNDECIDED} and UNDECIDED in kinds
    with pytest.raises(UsageError, match="prev_token is too short to tell on this text"):
        report.top("prev_token")
    data = report.to_json()
    assert data["scores"]["prev_token"] == [[None] * 4] * 2 and data["too_short"] == report.too_short
    assert json.loads(json.dumps(data, allow_nan=False))  # strict JSON: no NaN in heads.json


@pytest.mark.parametrize(("n_tokens", "short"), [(7, SHORT_SCORES), (8, {"distance", "uniformity"}), (20, set())])
def test_each_score_is_decided_from_its_minimum(n_tokens: int, short: set[str]) -> None:
    report = attnlab.inspect(tiny(), list(range(1, n_tokens + 1)), left_pad=3, probe_len=8, probe_batch=2)
    assert set(report.too_short) == short  # padding is not counted
    assert (UNDECIDED in {k for row in report.kinds for k in row}) <= bool(short)


def test_a_probe_shorter_than_four_is_too_short_to_tell() -> None:
    short = attnlab.inspect(tiny(), list(range(1, 21)), probe_len=3, probe_batch=2)
    assert set(short.too_short) == {"duplicate", "induction"} and "repeats 3" in short.too_short["induction"]
    assert {k for row in short.kinds for k in row} == {UNDECIDED}  # induction is the first rule
    assert attnlab.inspect(tiny(), list(range(1, 21)), probe_len=4, probe_batch=2).too_short == {}
    capped = attnlab.inspect(tiny(block_size=6), [1, 2, 3, 4, 5, 6], probe_len=50, probe_batch=2)
    assert capped.probe["n"] == 3 and capped.probe["requested_n"] == 50 and "induction" in capped.too_short


def test_classify_stops_at_an_undecided_rule_but_keeps_a_rule_met_before_it() -> None:
    names = ("induction", "duplicate", "prev_token", "sink", "distance", "uniformity")
    scores = {n: torch.zeros(1, 3) for n in names}
    scores["distance"] += 10.0
    scores["induction"][0, 0] = 0.9  # met before the NaN rules: still induction
    scores["prev_token"][:] = math.nan
    scores["uniformity"][0, 2] = 0.9  # would be uniform, but prev_token comes first and is unknown
    assert classify(scores) == [["induction", UNDECIDED, UNDECIDED]]


def test_the_cli_marks_short_scores_in_every_output(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.axes import Axes

    titles: list[str] = []
    real_title = Axes.set_title

    def set_title(ax: Axes, label: str, *args: Any, **kwargs: Any) -> Any:
        titles.append(label)
        return real_title(ax, label, *args, **kwargs)

    monkeypatch.setattr(Axes, "set_title", set_title)
    rc, out, err = run(capsys, ckpt, tmp_path / "o", "--text", "ab")
    assert rc == 0, err
    assert "too short to tell on this text of 2 tokens" in out
    assert "previous-token (prev_token >= 0.5): too short to tell (prev_token needs a text of at least 8 tokens" in out
    assert "local (distance <= 2): too short to tell" in out and "uniform (uniformity >= 0.8): too short to tell" in out
    assert re.search(r"^layer .* undec$", out, re.M) and re.search(r"^total( +0){7} +8$", out, re.M)
    data = json.loads((tmp_path / "o" / "heads.json").read_text())
    assert data["scores"]["sink"] == [[None] * 4] * 2 and set(data["too_short"]) == SHORT_SCORES
    assert {k for row in data["kinds"] for k in row} <= {"induction", "duplicate", UNDECIDED}
    meta = re.search(r'id="attnlab-meta">(.*?)</script>', (tmp_path / "o" / "index.html").read_text()).group(1)  # type: ignore[union-attr]
    assert json.loads(meta)["too_short"] == data["too_short"] and json.loads(meta)["scores"]["distance"][0][0] is None
    assert "prev_token: too short to tell" in titles and "induction" in titles  # heads.png's panels


# ---- limits, before the model runs ----


def test_a_text_past_the_context_is_refused_before_the_model_runs(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "a" * 65)
    assert rc == 2
    assert err == (
        "attnlab: error: the text has 65 tokens, past the model's context of 64 tokens (its config.block_size); "
        "at most 64 tokens of text fit: shorten it.\n"
    )
    assert not (tmp_path / "o").exists()  # the directory it created is gone again
    with pytest.raises(LimitError, match=r"text has 65 tokens, past the model's context of 64 tokens") as caught:
        attnlab.inspect(tiny(), [1] * 65)
    assert isinstance(caught.value, ValueError)
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "a" * 60, "--left-pad", "10")
    assert "the text has 60 tokens and --left-pad adds 10: 70 in all, past the model's context of 64" in err
    assert "at most 54 tokens of text fit beside --left-pad 10: shorten the text or the padding" in err


def test_left_pad_counts_in_max_tokens_and_alone_is_refused_before_loading(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "abc", "--left-pad", "5000")
    assert rc == 2 and "--left-pad 5000 leaves no room for the text under --max-tokens 2048" in err
    assert "--left-pad can be at most 2046" in err and not (tmp_path / "o").exists()
    with pytest.raises(LimitError, match="left_pad 5000 leaves no room for the text under max_tokens 2048"):
        attnlab.inspect(tiny(), [1, 2, 3], left_pad=5000)
    with pytest.raises(LimitError, match=r"has 30 tokens and left_pad adds 5: 35 in all, more than max_tokens 32"):
        attnlab.inspect(tiny(), [1] * 30, left_pad=5, max_tokens=32)


def test_memory_past_what_is_available_is_refused_with_what_fits(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_run: None
) -> None:
    avail = 300_000
    monkeypatch.setattr(attnlab.heads.report, "available_memory", lambda: avail)
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "a" * 60)
    assert rc == 2 and err.count("\n") == 1
    need = memory_needed([4, 4], 40, 60, 8, 2)
    assert f"inspecting 60 tokens keeps about {need / 1e6:.1f} MB in memory (2 layers x 4 heads x 60^2 x 4 bytes" in err
    assert "more than the 0.3 MB this machine has available" in err
    fits = int(re.search(r"at most (\d+) tokens \(text and --left-pad together\) fit", err).group(1))  # type: ignore[union-attr]
    assert memory_needed([4, 4], 40, fits, 8, 2) <= avail < memory_needed([4, 4], 40, fits + 1, 8, 2)
    with pytest.raises(LimitError, match="more than the 0.3 MB this machine has available"):
        attnlab.inspect(tiny(), [1] * 60, probe_len=8, probe_batch=2)


def test_a_huge_probe_batch_is_refused_before_loading(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "abc", "--probe-batch", str(10**12))
    assert rc == 2 and "even a model of one layer and one head would keep about" in err
    assert "the probe alone does not fit: --probe-batch" in err and "Traceback" not in err


def test_a_probe_too_long_for_memory_suggests_a_shorter_probe_not_a_batch_of_zero(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_run: None
) -> None:
    """--probe-len capped at half the context can alone be too much: the fix is a shorter probe."""
    avail = 300_000
    monkeypatch.setattr(attnlab.heads.report, "available_memory", lambda: avail)
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "abcdefgh", "--probe-len", "32", "--probe-batch", "1")
    assert rc == 2 and "the probe alone does not fit: --probe-len " in err and "--probe-batch 0" not in err
    fits = int(re.search(r"--probe-len (\d+) at most could \(with --probe-batch 1\)", err).group(1))  # type: ignore[union-attr]
    assert memory_needed([4, 4], 40, 2, fits, 1) <= avail < memory_needed([4, 4], 40, 2, fits + 1, 1)


def test_a_text_the_shell_could_not_decode_is_named_by_its_byte(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_run: None
) -> None:
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "caf\udce9!")  # argv's surrogateescape of b"caf\xe9!"
    assert rc == 2 and "the text is not UTF-8 text: byte 0xe9 at character 3 (after 'caf'); pass it as UTF-8" in err


# ---- flags at and past their bounds ----


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--probe-len", "1"], "--probe-len must be an integer >= 2, got 1"),
        (["--probe-batch", "0"], "--probe-batch must be an integer >= 1, got 0"),
        (["--page-budget-mb", "-1"], "--page-budget-mb must be a number >= 0, got -1.0"),
        (["--page-budget-mb", "nan"], "--page-budget-mb must be a number >= 0, got nan"),
        (["--max-tokens", "1"], "--max-tokens must be an integer >= 2, got 1"),
        (["--left-pad", "-1"], "--left-pad must be an integer >= 0, got -1"),
        (["--seed", "-1"], "--seed must be an integer >= 0"),
        (["--dtype", "float16"], "--dtype 'float16': inspect runs the model in auto, gguf, float32 or bfloat16"),
        (["--text", "ab", "--text-file", "x.txt"], "give --text or --text-file, not both"),
        (["--text-file", "missing.txt"], "--text-file 'missing.txt' does not exist"),
        (["--text-file", "binary.bin"], "--text-file 'binary.bin' holds NUL bytes: a binary file"),
        (["--text-file", "latin1.txt"], "--text-file 'latin1.txt' is not UTF-8 text (byte 0xe9 at offset 3)"),
        (
            ["--text-file", "huge.txt", "--max-tokens", "2"],
            "holds more than 128 bytes, and --max-tokens 2 fits at most",
        ),
        (["--text-file", "."], "--text-file '.' is a directory"),
        (["--text", "a" * 129, "--max-tokens", "2"], "--text holds more than 128 bytes"),
    ],
)
def test_bad_flags_fail_in_one_line_before_loading(
    args: list[str],
    phrase: str,
    ckpt: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_load: None,
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    Path("latin1.txt").write_bytes("café".encode("latin-1"))
    Path("huge.txt").write_text("a" * 129)
    rc, out, err = run(capsys, ckpt, tmp_path / "o", *args)
    assert rc == 2 and out == ""
    assert err.startswith("attnlab: error: ") and phrase in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_out_dir_a_file_or_unwritable_and_an_empty_text(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "f").write_text("x")
    rc, _, err = run(capsys, ckpt, tmp_path / "f", "--text", TEXT)
    assert rc == 2 and "--out-dir" in err and "is a file, expected a directory" in err
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", "")
    assert rc == 2 and "the text has 0 token(s); inspect needs at least 2" in err and not (tmp_path / "o").exists()
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    # /proc takes no new directories even from root, who writes anywhere else
    unwritable = Path("/proc/attnlab-inspect-test") if os.geteuid() == 0 else locked / "o"
    rc, _, err = run(capsys, ckpt, unwritable, "--text", TEXT)
    assert rc == 2 and f"--out-dir {str(unwritable)!r} cannot be written (" in err


def test_probe_len_past_the_context_is_capped_as_documented(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, ckpt, tmp_path / "o", "--text", TEXT, "--probe-len", "1000", "--page-budget-mb", "0")
    assert rc == 0 and "(--probe-len 1000 capped at half the model's context)" in out
    assert json.loads((tmp_path / "o" / "heads.json").read_text())["probe"]["n"] == 32
    assert 'id="pattern-' not in (tmp_path / "o" / "index.html").read_text()  # budget 0: thumbnails only


# ---- an earlier result ----


def test_a_rerun_refuses_to_replace_an_earlier_result_before_loading(
    ckpt: Path, earlier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    out = tmp_path / "result"
    shutil.copytree(earlier, out)
    before = snapshot(out)
    when = json.loads((out / "heads.json").read_text())["written"]["time"]
    rc, _, err = run(capsys, ckpt, out, "--text", TEXT)
    assert rc == 2
    assert err == (
        f"attnlab: error: --out-dir {str(out)!r} already holds an inspect result (heads.json, heads.png, index.html "
        f"of model, written {when}), and attnlab never replaces one unasked; replace it with --overwrite, or keep "
        f"it and write to --out-dir {str(out) + '-2'!r}.\n"
    )
    assert snapshot(out) == before
    report = attnlab.inspect(tiny(), list(range(1, 21)), probe_len=8, probe_batch=2)
    with pytest.raises(UsageError, match=r"already holds an inspect result .*replace it with overwrite=True"):
        report.save(out)
    assert snapshot(out) == before


def test_overwrite_replaces_the_whole_set_and_no_page_removes_the_old_page(
    ckpt: Path, earlier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result"
    shutil.copytree(earlier, out)
    (old,) = stamps(out)
    rc, printed, err = run(capsys, ckpt, out, "--text", TEXT, "--overwrite", "--no-page")
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["heads.json", "heads.png"]  # no page of the earlier run beside it
    assert "(removed the earlier index.html)" in printed
    (new,) = stamps(out)
    assert new != old
    rc, _, _ = run(capsys, ckpt, out, "--text", TEXT, "--overwrite")
    assert rc == 0 and sorted(p.name for p in out.iterdir()) == sorted(RESULT_FILES) and len(stamps(out)) == 1


# ---- interrupts and errors in every phase ----


def _raiser(exc: type[BaseException], after: int = 0) -> Any:
    """A stand-in that lets ``after`` calls through to ``real`` (set below), then raises ``exc``."""
    calls = {"n": 0}

    def fake(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > after:
            if len(args) > 1 and isinstance(args[1], Path):
                args[1].write_bytes(b"half a file")  # a writer interrupted mid-write leaves something behind
            raise exc()
        return fake.real(*args, **kwargs)  # type: ignore[attr-defined]

    return fake


PHASES = {  # phase -> (module, attribute, calls let through)
    "loading": (attnlab.weight_files.pretrained, "from_pretrained", 0),
    "text pass": (attnlab.heads.report, "run_and_capture", 0),
    "probe pass": (attnlab.heads.report, "run_and_capture", 1),
    "plotting": (attnlab.heads.report, "plot_scores", 0),
    "page writing": (attnlab.heads.page, "write_page", 0),
}


@pytest.mark.parametrize(
    ("phase", "exc"),
    [
        ("loading", KeyboardInterrupt),
        ("loading", Terminated),
        ("text pass", Terminated),
        ("probe pass", KeyboardInterrupt),
        ("plotting", KeyboardInterrupt),
        ("page writing", Terminated),
    ],
)
def test_an_interrupt_in_any_phase_leaves_the_earlier_result_whole(
    phase: str,
    exc: type[BaseException],
    ckpt: Path,
    earlier: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "result"
    shutil.copytree(earlier, out)
    before = snapshot(out)
    module, name, after = PHASES[phase]
    fake = _raiser(exc, after)
    fake.real = getattr(module, name)
    monkeypatch.setattr(module, name, fake)
    rc, _, err = run(capsys, ckpt, out, "--text", TEXT, "--overwrite")
    how, code = ("Ctrl-C", 130) if exc is KeyboardInterrupt else ("SIGTERM", 143)
    assert (rc, err) == (code, f"attnlab: inspect interrupted ({how}) before it finished; nothing more was written.\n")
    assert snapshot(out) == before  # the earlier set, byte for byte, and no staging folder


def test_an_interrupt_into_a_new_out_dir_leaves_nothing(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _raiser(Terminated)
    fake.real = attnlab.heads.report.plot_scores
    monkeypatch.setattr(attnlab.heads.report, "plot_scores", fake)  # with heads.json staged, the plot half-written
    rc, _, err = run(capsys, ckpt, tmp_path / "new" / "result", "--text", TEXT)
    assert rc == 143 and "nothing more was written" in err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(("sig", "code", "how"), [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_while_the_set_moves_in_is_held_until_it_is_whole(
    sig: signal.Signals,
    code: int,
    how: str,
    ckpt: Path,
    earlier: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real signal sent between the first and the second rename: without holding it, the first file
    would be new and the others old."""
    out = tmp_path / "result"
    shutil.copytree(earlier, out)
    (old,) = stamps(out)
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        if Path(dst).parent == out:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(os, "replace", replace)
    rc, _, err = run(capsys, ckpt, out, "--text", TEXT, "--overwrite")
    monkeypatch.setattr(os, "replace", real_replace)
    assert rc == code
    assert err == (
        f"attnlab: inspect interrupted ({how}) before it finished; kept the whole new result in {out} "
        f"(heads.json, heads.png, index.html).\n"
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(RESULT_FILES)
    (new,) = stamps(out)
    assert new != old


def test_an_interrupt_while_printing_says_the_result_was_kept(
    ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: Any, **kwargs: Any) -> list[str]:
        raise KeyboardInterrupt

    monkeypatch.setattr("attnlab.tools.inspect_cli.summary_lines", interrupted)
    rc, _, err = run(capsys, ckpt, tmp_path / "o", "--text", TEXT)
    assert rc == 130 and f"kept the whole new result in {tmp_path / 'o'} (heads.json, heads.png, index.html)" in err
    assert len(stamps(tmp_path / "o")) == 1


def test_a_full_disk_while_writing_replaces_nothing(
    ckpt: Path, earlier: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "result"
    shutil.copytree(earlier, out)
    before = snapshot(out)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(attnlab.heads.report, "plot_scores", full)
    rc, _, err = run(capsys, ckpt, out, "--text", TEXT, "--overwrite")
    assert rc == 2 and "(No space left on device); nothing there was replaced" in err and "Traceback" not in err
    assert snapshot(out) == before


# ---- a damaged lab run ----


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("lab") / "run"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["train", "--out-dir", str(run_dir), "--steps", "2"]) == 0
    return run_dir


def _edited_width(run_dir: Path) -> None:
    config = json.loads((run_dir / "config.json").read_text())
    config["model"]["embed_dim"] *= 2
    (run_dir / "config.json").write_text(json.dumps(config))


def _truncated(run_dir: Path) -> None:
    ckpt = run_dir / "checkpoint.safetensors"
    with open(ckpt, "r+b") as f:
        f.truncate(ckpt.stat().st_size // 2)


def _header_garbage(run_dir: Path) -> None:
    with open(run_dir / "checkpoint.safetensors", "r+b") as f:
        f.write(b"\xff" * 8)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_edited_width, "checkpoint.safetensors does not load into the model its config.json describes ("),
        (_truncated, "is not a readable safetensors file (Error while deserializing header: incomplete metadata"),
        (_header_garbage, "is not a readable safetensors file (Error while deserializing header: header too large"),
    ],
    ids=["config-edited", "truncated", "header"],
)
def test_a_damaged_lab_run_is_one_sentence_with_the_fix(
    lab_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, message: str
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(lab_run, run_dir)
    damage(run_dir)
    rc = main(["inspect", "--checkpoint", str(run_dir), "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("attnlab: error: ") and message in err, err
    assert err.endswith(
        "it cannot be inspected: pass another --checkpoint, or train the run again into a new --out-dir.\n"
    )
    assert not (tmp_path / "o").exists()
