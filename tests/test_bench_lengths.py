"""bench-decode --prompt-lengths: its flag's parsing, its table, the worker protocol (timed runs, memory readings)."""

from __future__ import annotations

import io
import json
import mmap

import pytest

from attnlab.bench.decode_lengths import lengths_markdown, parse_lengths, run_repeats, summarize_runs
from attnlab.bench.lengths_worker import proc_status, reset_peak_rss, serve, timed_tokens
from attnlab.cli import main
from attnlab.runtime import UsageError


def test_lengths_take_commas_spaces_or_both():
    assert parse_lengths(("32,128,512", "2048 7000")) == (32, 128, 512, 2048, 7000)
    for bad in ("32,x", "0", "-5"):
        with pytest.raises(UsageError, match=r"--prompt-lengths takes prompt lengths >= 1 separated by commas"):
            parse_lengths((bad,))


def test_prompt_lengths_need_a_model(capsys):
    assert main(["bench-decode", "--prompt-lengths", "32,128"]) == 2
    assert "--prompt-lengths measures a GGUF model against llama.cpp: pass --model smollm2" in capsys.readouterr().err


def test_table_has_a_row_per_length_and_runner_and_no_rate_where_noise_left_none():
    run = {
        "ttft_s": 0.5,
        "prefill_tokens_per_s": 64.0,
        "decode_tokens_per_s": 20.0,
        "peak_rss_bytes": 5e8,
        "bandwidth_fraction": 0.3,
        "same_tokens": 1.0,
    }
    noisy = run | {"decode_tokens_per_s": None, "bandwidth_fraction": None, "same_tokens": 0.25}
    table = lengths_markdown([{"length": 32, "attnlab": run, "llama.cpp-fa": noisy}], ["attnlab", "llama.cpp-fa"])
    lines = table.splitlines()
    assert lines[2] == "| 32 | attnlab | 0.50 | 64 | 20.0 | 500 | 30% | 100% |"
    assert lines[3] == "| 32 | llama.cpp FA | 0.50 | 64 | - | 500 | - | 25% |"


def test_peak_rss_restarts_from_the_current_resident_set():
    if not reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs on this system")
    before = proc_status("VmHWM")
    # Fresh anonymous pages, not the heap: in a long-lived worker malloc may hand back 64 MiB that is already
    # resident (CI saw VmHWM not move at all), which would test the allocator rather than the reset.
    block = mmap.mmap(-1, 64 * 2**20)
    for page in range(0, len(block), 4096):
        block[page] = 1  # 64 MiB touched
    assert proc_status("VmHWM") >= before + 60 * 2**20 - 1
    block.close()
    assert reset_peak_rss() and proc_status("VmHWM") <= proc_status("VmRSS") + 8 * 2**20


def test_one_run_stamps_its_first_and_last_token_and_counts_what_came():
    ticks = iter([10.0, 12.5, 12.75, 13.0, 13.25])  # the call, then one reading per token
    answer = timed_tokens(lambda: iter([7, 8, 9, 10, 11, 12]), 4, clock=lambda: next(ticks))
    assert answer == {
        "first_s": 2.5,
        "last_s": 3.25,
        "tokens": [7, 8, 9, 10],
    }  # stopped at n, not at the iterator's end
    ticks = iter([0.0, 1.0, 1.5])
    short = timed_tokens(lambda: iter([5, 6]), 8, clock=lambda: next(ticks))  # a runner that stops early (eos)
    assert short == {"first_s": 1.0, "last_s": 1.5, "tokens": [5, 6]}


def test_the_runner_generator_is_closed_when_n_tokens_came():
    closed = []

    def tokens():
        try:
            yield from range(100)
        finally:
            closed.append(True)  # generate_steps puts torch's thread count back here

    assert timed_tokens(tokens, 3)["tokens"] == [0, 1, 2]
    assert closed == [True]


class FakeWorker:
    """A runner that answers ``generate`` with canned stamps, as lengths_worker.serve would."""

    def __init__(self, name, answers, log):
        self.name, self.answers, self.log = name, list(answers), log

    def ask(self, **cmd):
        assert cmd == {"cmd": "generate", "ids": [1, 2, 3], "n": 5}  # the same prompt and count for every runner
        self.log.append(self.name)
        return self.answers.pop(0)


def test_repeats_alternate_the_runners_and_rates_come_from_one_run_each():
    log = []
    fast = [
        {"first_s": 2.0, "last_s": 2.4, "tokens": [1, 2, 3, 4, 5]},  # 4 steps in 0.4 s: 10 tok/s
        {"first_s": 9.0, "last_s": 9.2, "tokens": [1, 2, 3, 4, 5]},  # a slow prefill (9 s) leaves the rate alone
        {"first_s": 3.0, "last_s": 3.5, "tokens": [1, 2, 3, 4, 5]},  # 8 tok/s
    ]
    early = [{"first_s": 1.0, "last_s": 1.3, "tokens": [1, 2, 3, 4]}] * 3  # stopped after 4: 3 steps, 10 tok/s
    workers = {"attnlab": FakeWorker("attnlab", fast, log), "llama.cpp": FakeWorker("llama.cpp", early, log)}
    runs = run_repeats(workers, [1, 2, 3], 5, 3)
    assert log == ["attnlab", "llama.cpp", "llama.cpp", "attnlab", "attnlab", "llama.cpp"]  # rotated each repeat
    figures = summarize_runs(runs["attnlab"])
    assert figures["ttft_s"] == 3.0 and figures["tokens_produced"] == [5, 5, 5]
    assert figures["decode_tokens_per_s"] == pytest.approx(10.0)  # the median of 10, 20, 8
    assert summarize_runs(runs["llama.cpp"])["decode_tokens_per_s"] == pytest.approx(10.0)  # (4 - 1) / 0.3
    one = summarize_runs([{"first_s": 1.0, "last_s": 1.0, "tokens": [4]}])
    assert one["decode_tokens_per_s"] is None and one["ttft_s"] == 1.0


def test_the_worker_answers_each_command_on_one_line():
    out = io.StringIO()
    lines = [json.dumps({"cmd": "generate", "ids": [3, 4], "n": 2}) + "\n", json.dumps({"cmd": "peak"}) + "\n"]
    ticks = iter([0.0, 0.5, 0.75])
    serve(lambda ids, n: iter([ids[0] + 1, ids[1] + 1, 99]), lines, out, clock=lambda: next(ticks))
    first, peak = (json.loads(line) for line in out.getvalue().splitlines())
    assert first == {"first_s": 0.5, "last_s": 0.75, "tokens": [4, 5]}
    assert set(peak) == {"rss", "rss_peak"}
