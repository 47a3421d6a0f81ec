"""bench-decode --prompt-lengths: its flag's parsing, its table, the worker protocol (timed runs, memory readings);
with --batch-size, each runner's batched greedy rows against its own batch-1 rows (attnlab in this process; llama.cpp
through the workers, where ATTNLAB_LLAMA_PYTHON or /work/peers/llama-venv/bin/python has llama-cpp-python)."""

from __future__ import annotations

import io
import json
import mmap
import os
from pathlib import Path

import pytest
import torch

from attnlab.bench.decode_lengths import (
    Worker,
    lengths_markdown,
    parse_lengths,
    prompt_rows,
    ratios_markdown,
    run_repeats,
    same_share,
    summarize_runs,
)
from attnlab.bench.lengths_worker import proc_status, reset_peak_rss, serve, timed_tokens
from attnlab.cli import main
from attnlab.runtime import UsageError

# The interpreter whose llama_cpp the llama.cpp parity test runs (llama-cpp-python is no dependency of attnlab)
LLAMA_PYTHON = Path(os.environ.get("ATTNLAB_LLAMA_PYTHON", "/work/peers/llama-venv/bin/python"))


def test_lengths_take_commas_spaces_or_both():
    assert parse_lengths(("32,128,512", "2048 7000")) == (32, 128, 512, 2048, 7000)
    for bad in ("32,x", "0", "-5"):
        with pytest.raises(UsageError, match=r"--prompt-lengths takes prompt lengths >= 1 separated by commas"):
            parse_lengths((bad,))


def test_prompt_lengths_need_a_model(capsys):
    assert main(["bench-decode", "--prompt-lengths", "32,128"]) == 2
    assert "--prompt-lengths measures a GGUF model against llama.cpp: pass --model smollm2" in capsys.readouterr().err


# One runner's figures at one length, as bench_decode_lengths keeps them (the keys the tables read)
RUN = {
    "ttft_s": 0.5,
    "prefill_tokens_per_s": 64.0,
    "decode_tokens_per_s": 20.0,
    "peak_rss_bytes": 5e8,
    "bandwidth_fraction": 0.3,
    "same_tokens": 1.0,
}


def test_table_has_a_row_per_length_and_runner_and_no_rate_where_noise_left_none():
    run = RUN
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


def test_batch_is_checked_and_needs_prompt_lengths(capsys):
    assert main(["bench-decode", "--batch-size", "3"]) == 2
    assert (
        "--batch-size 3 sets the prompts each length decodes at once with --prompt-lengths; without it, pass "
        "--batch-sizes (e.g. --batch-sizes 1 8)." in capsys.readouterr().err
    )
    assert main(["bench-decode", "--model", "/nowhere/m.gguf", "--prompt-lengths", "32", "--batch-size", "0"]) == 2
    assert "--batch-size must be an integer >= 1, got 0" in capsys.readouterr().err


def test_batch_rows_differ_and_row_zero_is_the_batch_1_prompt():
    rows = prompt_rows(100, 16, 3, seed=4)
    assert len(rows) == 3 and all(len(r) == 16 and all(0 <= t < 100 for t in r) for r in rows)
    assert len({tuple(r) for r in rows}) == 3
    assert prompt_rows(100, 16, 1, seed=4) == rows[:1]


def test_a_batched_run_stamps_steps_and_its_rate_counts_every_row():
    ticks = iter([0.0, 1.0, 1.25, 1.5])
    answer = timed_tokens(lambda: iter([[1, 2], [3, 4], [5, 6], [7, 8]]), 3, clock=lambda: next(ticks))
    assert answer == {"first_s": 1.0, "last_s": 1.5, "tokens": [[1, 2], [3, 4], [5, 6]]}
    figures = summarize_runs([answer], batch=2)
    assert figures["decode_tokens_per_s"] == pytest.approx(2 * 2 / 0.5)  # 2 steps of 2 rows in 0.5 s
    assert figures["tokens_produced"] == [3]  # steps
    assert summarize_runs([answer])["decode_tokens_per_s"] == pytest.approx(2 / 0.5)
    assert same_share([[1, 2], [3, 9]], [[1, 2], [3, 4]]) == 0.75  # row by row, step by step
    assert same_share([5, 6], [5, 7]) == 0.5


def test_a_batch_table_says_its_rates_count_every_row():
    rows = [{"length": 32, "attnlab": RUN}]
    assert lengths_markdown(rows, ["attnlab"], batch=8).splitlines()[0] == (
        "batch 8: prefill and decode tokens/s count all 8 rows"
    )
    assert lengths_markdown(rows, ["attnlab"]).startswith("| prompt |")  # batch 1: the table as before


def test_ratios_are_over_llama_cpps_faster_setting_for_each_rate():
    off = RUN | {"decode_tokens_per_s": 8.0, "prefill_tokens_per_s": 40.0}
    fa = RUN | {"decode_tokens_per_s": 10.0, "prefill_tokens_per_s": 16.0}
    noisy = RUN | {"decode_tokens_per_s": None}
    results = [
        {"length": 32, "attnlab": RUN, "llama.cpp": off, "llama.cpp-fa": fa},
        {"length": 128, "attnlab": noisy, "llama.cpp": off, "llama.cpp-fa": fa},
    ]
    lines = ratios_markdown(results, ["attnlab", "llama.cpp", "llama.cpp-fa"]).splitlines()
    assert lines[0] == "| prompt | decode: attnlab / llama.cpp's best | prefill: attnlab / llama.cpp's best |"
    assert lines[2] == "| 32 | 2.00x (llama.cpp FA) | 1.60x (llama.cpp) |"  # 20 / 10 and 64 / 40
    assert lines[3] == "| 128 | - | 1.60x (llama.cpp) |"
    assert ratios_markdown(results, ["attnlab"]) == ""  # no llama.cpp ran: nothing to compare


def _gguf_path() -> Path:
    from smollm2_fixtures import require_smollm2

    require_smollm2()
    from attnlab.weight_files.pretrained import smollm2_path

    return smollm2_path()


@pytest.mark.slow
def test_attnlab_batched_rows_equal_its_batch_1_rows(one_thread):
    from attnlab.models.decoder import Decoder
    from attnlab.models.generation import generate
    from attnlab.weight_files.pretrained import from_pretrained

    model, _ = from_pretrained(_gguf_path(), dtype="gguf")
    if not model.has_fused_decode:
        pytest.skip("the fused decode step needs the compiled kernels (AVX-512 VNNI)")
    rows = torch.tensor(prompt_rows(model.config.vocab_size, 16, 3, seed=0))
    fused = []
    step = Decoder._fused_decode
    original = step

    def counted(self, *args, **kwargs):
        fused.append(args[1].size(0))  # idx: the rows of this step
        return original(self, *args, **kwargs)

    try:
        Decoder._fused_decode = counted  # type: ignore[method-assign]
        batched = generate(model, rows, 4, temperature=0, kv_dtype="float16")
    finally:
        Decoder._fused_decode = step  # type: ignore[method-assign]
    assert fused == [3, 3, 3]  # every decode step of the batch ran the one-call C++ step, all rows at once
    for r in range(3):
        alone = generate(model, rows[r : r + 1], 4, temperature=0, kv_dtype="float16")
        assert torch.equal(batched[r : r + 1], alone), r


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_PYTHON.is_file(), reason=f"no llama-cpp-python interpreter at {LLAMA_PYTHON}")
@pytest.mark.parametrize("runner", ["llama.cpp", "llama.cpp-fa"])
def test_llama_cpp_batched_rows_equal_its_batch_1_rows(runner):
    path = _gguf_path()
    rows = prompt_rows(49152, 16, 3, seed=0)
    batched = Worker(runner, str(LLAMA_PYTHON), path, "1", 32, batch=3)
    single = Worker(runner, str(LLAMA_PYTHON), path, "1", 32)
    try:
        assert batched.error is None and single.error is None, (batched.error, single.error)
        steps = batched.ask(cmd="generate", ids=rows, n=5)["tokens"]  # llama.cpp's multi-sequence batch
        assert len(steps) == 5 and all(len(step) == 3 for step in steps)
        for r, row in enumerate(rows):
            alone = single.ask(cmd="generate", ids=row, n=5)["tokens"]  # llama-cpp-python's Llama.generate
            assert [step[r] for step in steps] == alone, r
        assert batched.ask(cmd="generate", ids=rows, n=5)["tokens"] == steps  # a second run starts afresh
    finally:
        batched.close()
        single.close()
