"""The command line under mistakes and interrupts (issue 12, the commands other than train/ablate-heads/generate).

Every mistake in a flag is one sentence on stderr, ``attnlab: error: <what>, <got>, <fix>``, exit code 2,
no traceback, and it is found before any work starts. Ctrl-C and SIGTERM end a command with one line and
exit codes 130 and 143. Every flag name follows the one vocabulary, and every help text tells the truth.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab.cli as cli
from attnlab.bench import attention as bench_mod
from attnlab.bench import decode as decode_mod
from attnlab.cli import main
from attnlab.runtime import UsageError
from attnlab.tools import trace as trace_mod

CPU_ONLY = "sees no CUDA GPU; use --device cpu (or auto), or install a CUDA build of torch on a machine with a GPU."


def _error(capsys, argv: list[str]) -> str:
    """Run ``attnlab argv``; assert the one-sentence usage error (exit 2, no traceback, no output before it)
    and return its message."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert captured.out == ""  # refused before any work: nothing was printed (nor timed, trained or written)
    assert err.startswith("attnlab: error: "), err
    return err.removeprefix("attnlab: error: ").rstrip("\n")


@pytest.fixture
def no_work(monkeypatch):
    """Make the work itself fail loudly: a usage error must come before any of it."""

    def forbidden(*args, **kwargs):
        raise AssertionError("work started before the flags were checked")

    monkeypatch.setattr(bench_mod, "run_bench", forbidden)
    monkeypatch.setattr(decode_mod, "TinyGPT", forbidden)
    monkeypatch.setattr(trace_mod, "MultiHeadAttention", forbidden)


# -- bench ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--lengths", "0"],
            "--lengths must be an integer >= 1, got 0; each is a sequence length T, e.g. --lengths 128 256.",
        ),
        (["--lengths"], "--lengths got no length; pass sequence lengths, e.g. --lengths 128 256 512."),
        (
            ["--lengths", "64", "--tokens", "32"],
            "--tokens must be an integer >= 64, got 32; B = tokens // T needs at least one sequence of the longest "
            "length 64; pass --tokens 64.",
        ),
        (
            ["--repeats", "0"],
            "--repeats must be an integer >= 1, got 0; the median of the timed repeats is reported.",
        ),
        (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1."),
        (
            ["--embed-dim", "30", "--num-heads", "4"],
            "--embed-dim 30 is not divisible by --num-heads 4; pass --num-heads among its divisors (nearest: [3, 5]).",
        ),
        (
            ["--runners", "attnlab", "nope"],
            "--runners got ['attnlab', 'nope'], expected one or more of attnlab, attnlab-math, attnlab-compiled, "
            "torch-mha, floor, seed-000, flash-attn; e.g. --runners attnlab floor torch-mha.",
        ),
        (
            ["--device", "gpu"],
            "--device 'gpu' is not a device name; use auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.",
        ),
        (
            ["--dtype", "fp8"],
            "--dtype 'fp8' is not a dtype attnlab runs in; use auto (float32 on cpu, bfloat16 on cuda), float32, "
            "bfloat16, float16 or float64.",
        ),
    ],
)
def test_bench_flag_errors(capsys, no_work, tmp_path, flags, message):
    assert _error(capsys, ["bench", "--out-dir", str(tmp_path), *flags]) == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA GPU")
@pytest.mark.parametrize("command", ["bench", "bench-decode"])
def test_cuda_on_a_cpu_build_is_refused_before_work(capsys, no_work, tmp_path, command):
    message = _error(capsys, [command, "--device", "cuda", "--out-dir", str(tmp_path)])
    assert message.startswith("--device 'cuda', but this torch (") and message.endswith(CPU_ONLY)


@pytest.mark.parametrize("command", ["bench", "bench-decode"])
def test_an_unwritable_out_dir_is_found_before_any_work(capsys, no_work, tmp_path, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    message = _error(capsys, [command, "--out-dir", str(blocker / "results")])
    assert message == (
        f"--out-dir {str(blocker / 'results')!r} cannot be written (Not a directory); "
        "pass a directory you can write to."
    )
    assert _error(capsys, [command, "--out-dir", str(blocker)]) == (
        f"--out-dir {str(blocker)!r} is a file, expected a directory; pass a directory path."
    )


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16), ("float64", torch.float64)]
)
def test_bench_takes_dtype_short_names(tmp_path, name, dtype):
    device, got = bench_mod.validate(bench_mod.BenchConfig(dtype=name, device="cpu", out_dir=tmp_path))
    assert (device, got) == (torch.device("cpu"), dtype)


def test_bench_float16_on_cpu_runs_every_runner_but_seed_000():
    """Tried: float16 runs on a CPU; only seed 000's module cannot (its -1e9 fill overflows float16)."""
    cfg = bench_mod.BenchConfig(embed_dim=16, num_heads=2, runners=("attnlab", "floor", "seed-000"))
    runners, skipped = bench_mod.build_runners(cfg, torch.device("cpu"), torch.float16)
    assert set(runners) == {"attnlab", "floor"}
    assert skipped == {
        "seed-000": "seed 000 fills masked scores with -1e9, which float16 cannot hold (its max is 65504)"
    }
    x = torch.randn(2, 8, 16, dtype=torch.float16)
    torch.testing.assert_close(runners["attnlab"](x, 8), runners["floor"](x, 8), atol=2e-3, rtol=2e-3)


# -- bench-decode ----------------------------------------------------------------------------------------------------
WHY_TWO = "the per-token latency is (t(n) - t(1)) / (n - 1), which needs n >= 2"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--contexts", "0"],
            "--contexts must be an integer >= 1, got 0; each is a prompt length, e.g. --contexts 64 256.",
        ),
        (["--contexts"], "--contexts got no length; pass prompt lengths, e.g. --contexts 64 256 1024."),
        (
            ["--max-new-tokens", "1"],
            f"--max-new-tokens must be an integer >= 2, got 1; {WHY_TWO}; pass --max-new-tokens 2.",
        ),
        (
            ["--recompute-max-new-tokens", "1"],
            f"--recompute-max-new-tokens must be an integer >= 2, got 1; {WHY_TWO}; pass --recompute-max-new-tokens 2.",
        ),
        (["--repeats", "0"], "--repeats must be an integer >= 1, got 0; the median of the timed repeats is reported."),
        (["--num-layers", "0"], "--num-layers must be an integer >= 1, got 0."),
        (
            ["--embed-dim", "30", "--num-heads", "4"],
            "--embed-dim 30 is not divisible by --num-heads 4; pass --num-heads among its divisors (nearest: [3, 5]).",
        ),
        (["--vocab-size", "1"], "--vocab-size must be an integer >= 2, got 1; GPT-2's is 50257."),
        (["--threads", "0"], "--threads must be an integer >= 1, got 0; or leave it out for torch's choice."),
        (
            ["--device", "gpu"],
            "--device 'gpu' is not a device name; use auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps.",
        ),
    ],
)
def test_bench_decode_flag_errors(capsys, no_work, tmp_path, flags, message):
    assert _error(capsys, ["bench-decode", "--out-dir", str(tmp_path), *flags]) == message


# -- trace -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seq-len", "-1"], "--seq-len must be an integer >= 1, got -1; it is T_q, the number of query positions."),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0."),
        (["--context-len", "0"], "--context-len must be an integer >= 1, got 0; leave it out for self-attention."),
        (
            ["--num-kv-heads", "9"],
            "--num-kv-heads must be an integer >= 1 and <= 8, got 9; leave it out for MHA.",
        ),
        (
            ["--pad", "11"],
            "--pad must be an integer >= 0 and <= 10, got 11; it counts padded keys out of the T_k = 10 of a sequence.",
        ),
        (["--dropout", "1"], "--dropout must be a number >= 0 and < 1, got 1.0."),
    ],
)
def test_trace_flag_errors(capsys, no_work, flags, message):
    assert _error(capsys, ["trace", *flags]) == message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--num-heads", "6"],
            "--embed-dim 64 is not divisible by --num-heads 6: every head gets embed_dim // num_heads dims; "
            "choose --num-heads among the divisors of 64 (nearest: [4, 8]) or change --embed-dim to a multiple of 6.",
        ),
        (
            ["--num-kv-heads", "3"],
            "--num-heads 8 is not divisible by --num-kv-heads 3: each K/V head serves an equal group of query heads; "
            "choose --num-kv-heads among [1, 2, 4, 8].",
        ),
    ],
)
def test_trace_module_errors_name_the_flags(capsys, flags, message):
    assert _error(capsys, ["trace", *flags]) == message


# -- check, demo, doctor ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seq-len", "3"], "--seq-len must be an integer >= 4, got 3; the checks pad 3 tokens and split halves."),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0."),
        (["--dropout", "1.5"], "--dropout must be a number >= 0 and < 1, got 1.5."),
        (
            ["--embed-dim", "30"],
            "--embed-dim 30 is not divisible by --num-heads 4; pass --num-heads among its divisors (nearest: [3, 5]).",
        ),
        (
            ["--num-kv-heads", "3"],
            "--num-heads 4 is not divisible by --num-kv-heads 3; pass --num-kv-heads among [1, 2, 4].",
        ),
        (
            ["--checks", "parity"],
            "--checks got unknown names ['parity'], expected names among ['parity_self', 'parity_cross', "
            "'parity_masked', 'parity_head_dims', 'odd_lengths', 'low_precision[bf16]', 'low_precision[fp16]', "
            "'low_precision_grad[bf16]', 'low_precision_grad[fp16]', 'gradcheck[plain]', 'gradcheck[causal]', "
            "'gradcheck[padding]', 'grad_parity', 'no_causal_leak', 'padding_invariance', 'padded_kv_nonfinite', "
            "'permutation_equivariance', 'fully_masked_rows', 'mask_semantics', 'attention_weights', 'scale_attribute', 'kv_cache', 'determinism', "
            "'deterministic_backward', 'dropout_off_in_eval', 'dropout_rate', 'variant[window]', 'variant[softcap]', 'variant[alibi]', "
            "'variant[sinks]', 'variant[documents]', 'variant[rolling_cache]']; e.g. --checks parity_self.",
        ),
    ],
)
def test_check_flag_errors(capsys, flags, message):
    assert _error(capsys, ["check", *flags]) == message


def test_demo_refuses_an_unwritable_out_dir_before_the_tour(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert _error(capsys, ["demo", "--out-dir", str(blocker)]) == (
        f"--out-dir {str(blocker)!r} is a file, expected a directory; pass a directory path."
    )


@pytest.mark.parametrize("train", [True, False])
def test_demo_refuses_a_negative_seed_under_its_own_flag_before_the_tour(capsys, train):
    """It used to trace and verify for ~24 s, then name --data.seed (its training run's flag, not the demo's)."""
    flags = ["demo", "--seed", "-1"] + ([] if train else ["--no-train"])
    assert _error(capsys, flags) == "--seed must be an integer >= 0, got -1; pass e.g. --seed 0."


def test_demo_never_replaces_a_run_that_is_not_a_demo_run(capsys, tmp_path):
    from attnlab.lab.config import TrainConfig, save_config
    from attnlab.tools.demo import _check_out_dir, _demo_run

    run = tmp_path / "train"
    save_config(TrainConfig(steps=3, out_dir=run), run / "config.json")
    assert _error(capsys, ["demo", "--out-dir", str(run)]) == (
        f"--out-dir {str(run)!r} holds a run that is not a demo run (its config.json is not the demo's), and the "
        f"demo replaces what it finds; run it in another directory: attnlab demo --out-dir {tmp_path / 'train-2'}"
    )
    assert (run / "config.json").exists()
    demo_run = tmp_path / "demo"
    save_config(_demo_run(demo_run, seed=0), demo_run / "config.json")
    _check_out_dir(demo_run, seed=0)  # a demo's own run is replaced: no error
    _check_out_dir(demo_run, seed=3)  # so is a demo run made with another seed
    _check_out_dir(tmp_path / "fresh", seed=0)


def test_old_flag_names_are_gone(capsys):
    """The one vocabulary: the old spellings are unknown flags (tyro's exit 2), never silently accepted."""
    for argv in (
        ["trace", "--batch", "2"],
        ["trace", "--kv-heads", "2"],
        ["check", "--batch", "2"],
        ["bench", "--out", "x"],
        ["bench-decode", "--new-tokens", "3"],
        ["bench-decode", "--n-layer", "1"],
        ["demo", "--out", "x"],
        ["doctor", "--no-no-compile"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
    capsys.readouterr()


FORBIDDEN = re.compile(
    r"--(n-embd|n-head|n-kv-head|n-layer|kv-heads|batch|out|new-tokens|recompute-new-tokens|run-dir|no-no-[\w-]+)\b(?!-)"
)


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("bench", ["--embed-dim", "--num-heads", "--out-dir", "--device", "--dtype"]),
        (
            "bench-decode",
            [
                *("--max-new-tokens", "--recompute-max-new-tokens", "--num-layers", "--num-heads", "--embed-dim"),
                *("--vocab-size", "--device", "--dtype", "--out-dir", "--compile, --no-compile", "--hf, --no-hf"),
            ],
        ),
        ("trace", ["--batch-size", "--num-kv-heads", "--embed-dim", "--num-heads", "--causal, --no-causal"]),
        ("check", ["--batch-size", "--num-kv-heads", "--embed-dim", "--json, --no-json"]),
        ("doctor", ["--compile, --no-compile"]),
        ("demo", ["--out-dir", "--train, --no-train"]),
    ],
)
def test_help_uses_the_one_flag_vocabulary(capsys, monkeypatch, command, flags):
    monkeypatch.setenv("COLUMNS", "200")  # tyro's help box: no wrapping inside a flag list
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in flags:
        assert flag in text, (command, flag)
    assert not FORBIDDEN.search(text), FORBIDDEN.search(text)


# -- the entry point -------------------------------------------------------------------------------------------------
def test_lab_commands_share_the_error_handling(capsys, monkeypatch):
    def mistake(argv):
        raise UsageError("--steps must be an integer >= 1, got -5.")

    monkeypatch.setattr(cli, "lab_main", mistake)
    assert _error(capsys, ["train", "--steps", "-5"]) == "--steps must be an integer >= 1, got -5."


def test_debug_env_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("ATTNLAB_DEBUG", "1")
    with pytest.raises(UsageError, match="--seq-len must be an integer >= 1, got 0"):
        main(["trace", "--seq-len", "0"])


@pytest.mark.parametrize("command", ["trace", "train"])
def test_ctrl_c_in_process_is_one_line_and_130(capsys, monkeypatch, command):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trace_mod, "MultiHeadAttention", interrupted)
    monkeypatch.setattr(cli, "lab_main", interrupted)  # escaping train's own handling: still one line
    assert main([command]) == 130
    err = capsys.readouterr().err
    assert err == f"attnlab: {command} interrupted (Ctrl-C) before it finished; nothing more was written.\n"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or command == "train"  # the SIGTERM handler is undone


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code", "how"), [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_a_signal_ends_bench_with_one_line(tmp_path, sig, code, how):
    """A real signal to a real process: the exit code a shell expects, one line on stderr, no traceback."""
    argv = [sys.executable, "-m", "attnlab", "bench", "--lengths", "16", "--tokens", "16", "--repeats", "1000000"]
    argv += ["--embed-dim", "8", "--num-heads", "2", "--gemm-size", "16", "--no-memory", "--no-train"]
    argv += ["--runners", "attnlab", "--out-dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "ATTNLAB_DEBUG"} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # a shell's background job ignores SIGINT, and Python then never raises KeyboardInterrupt: restore it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("device cpu")  # it is working: timing from now on
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    # the last line is ours; a loaded machine may add an unrelated warning above it, never a traceback
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == f"attnlab: bench interrupted ({how}) before it finished; nothing more was written."
    assert not list(Path(tmp_path).iterdir())  # nothing half-written
