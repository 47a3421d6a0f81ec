"""bench-decode --prompt-lengths: its flag's parsing, its table, and the worker protocol's memory readings."""

from __future__ import annotations

import pytest

from attnlab.bench.decode_lengths import lengths_markdown, parse_lengths
from attnlab.bench.lengths_worker import proc_status, reset_peak_rss
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
    block = bytearray(64 * 2**20)  # 64 MiB touched
    block[::4096] = b"x" * len(block[::4096])
    assert proc_status("VmHWM") >= before + 60 * 2**20 - 1
    del block
    assert reset_peak_rss() and proc_status("VmHWM") <= proc_status("VmRSS") + 8 * 2**20
