"""Interrupts are never failures: SIGINT and SIGTERM end check, bench and bench-decode with one line, exit 130/143,
and what finished kept and marked partial; the code under test or the runner being timed is never blamed.

(train and ablate-heads: tests/test_lab_interrupt.py; inspect and generate: their own safety tests.)
Signals are sent to this very process (``os.kill(os.getpid(), ...)``) from inside the phase under test:
``attnlab.cli.main`` installs its SIGTERM handler in the main thread, as the console script does.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from functools import partial
from pathlib import Path

import pytest
import torch

from attnlab.check.result import Report
from attnlab.cli import main
from attnlab.runtime import INTERRUPTS, Terminated, import_advice, keep, kept

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")]

# A seed-style module whose forward signals its own process on its Nth call: the interrupt lands mid-row.
MINE = textwrap.dedent(
    """
    import math, os, signal
    import torch
    from torch import nn

    CALLS = [0]
    STOP_AT = {stop_at}
    SIGNUM = {signum}

    class Attn(nn.Module):
        def __init__(self, d_model, num_heads):
            super().__init__()
            self.h, self.d = num_heads, d_model // num_heads
            self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
            self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

        def forward(self, x, mask=None):
            CALLS[0] += 1
            if CALLS[0] == STOP_AT:
                os.kill(os.getpid(), SIGNUM)
            B, T, _ = x.shape
            q, k, v = (w(x).view(B, T, self.h, self.d).transpose(1, 2) for w in (self.w_q, self.w_k, self.w_v))
            s = q @ k.transpose(-2, -1) / math.sqrt(self.d)
            if mask is not None:
                s = s.masked_fill(~mask, float("-inf"))
            a = torch.softmax(s, dim=-1)
            return self.w_o((a @ v).transpose(1, 2).reshape(B, T, -1))
    """
)
ROWS = ["parity_self", "parity_cross", "no_causal_leak", "padding_invariance", "permutation_equivariance"]


def _probe_calls(tmp_path: Path) -> int:
    """How many times building the target calls MINE's forward (check's probe reads its call form and mask
    convention by experiment): an interrupt meant to land mid-row is counted from there."""
    from attnlab.check.target import build_target

    (tmp_path / "probe").mkdir(exist_ok=True)
    spec = _target(tmp_path / "probe", stop_at=-1)
    build_target(spec, embed_dim=16, num_heads=2, num_kv_heads=None, dropout=0.0, seed=0)
    (module,) = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == spec.split(":")[0]]
    return int(module.CALLS[0])


def _target(tmp_path: Path, stop_at: int, signum: int = signal.SIGTERM) -> str:
    path = tmp_path / "mine.py"
    path.write_text(MINE.format(stop_at=stop_at, signum=int(signum)))
    return f"{path}:Attn"


def _one_interrupt_line(err: str, command: str, how: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"attnlab: {command} interrupted ({how}) before it finished; "), err
    assert "Traceback" not in err
    return lines[0]


def test_the_interrupt_types_are_not_exceptions_so_no_broad_except_can_swallow_them():
    assert not issubclass(Terminated, Exception) and not issubclass(KeyboardInterrupt, Exception)
    assert INTERRUPTS == (KeyboardInterrupt, Terminated)
    err = keep(Terminated(), "3 rows in x.json")
    assert kept(err) == "3 rows in x.json" and kept(KeyboardInterrupt()) is None


def _swallows_interrupts(handler: ast.ExceptHandler) -> bool:
    """A bare ``except:`` or ``except BaseException`` (alone or in a tuple) whose body does not re-raise."""
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    broad = handler.type is None or any(isinstance(n, ast.Name) and n.id == "BaseException" for n in names)
    reraises = any(isinstance(node, ast.Raise) and node.exc is None for node in ast.walk(handler))
    return broad and not reraises


def test_no_source_swallows_an_interrupt():
    """The audit, kept: ``except Exception`` lets interrupts through; a bare ``except:`` or ``except BaseException``
    that does not re-raise, or ``suppress(BaseException/KeyboardInterrupt)``, would not."""
    offenders = []
    for path in (ROOT / "src" / "attnlab").rglob("*.py"):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ExceptHandler) and _swallows_interrupts(node):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        for n, line in enumerate(source.splitlines(), 1):
            if re.search(r"suppress\((BaseException|KeyboardInterrupt)", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_the_audit_finds_a_handler_that_swallows():
    tree = ast.parse("try:\n    f()\nexcept BaseException:\n    pass\ntry:\n    f()\nexcept:\n    g()\n    raise\n")
    handlers = [n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler)]
    assert [_swallows_interrupts(h) for h in handlers] == [True, False]


# -- check ------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum, code, how", SIGNALS, ids=["sigterm", "sigint"])
def test_check_interrupted_mid_row_prints_the_rows_done_as_partial_and_blames_nothing(
    tmp_path, capsys, monkeypatch, signum, code, how
):
    monkeypatch.setenv("COLUMNS", "200")
    target = _target(tmp_path, stop_at=_probe_calls(tmp_path) + 3, signum=signum)
    rc = main(["check", "--target", target, "--embed-dim", "16", "--num-heads", "2", "--checks", *ROWS])
    out, err = capsys.readouterr()
    assert rc == code
    line = _one_interrupt_line(err, "check", how)
    done = int(re.search(r"kept the (\d+) check\(s\) done \(printed above\), marked partial", line).group(1))
    assert 0 < done < len(ROWS)
    assert (
        f"PARTIAL (interrupted ({how}) after {done} of {len(ROWS)} checks), so far: 1 passed, 0 failed, 1 skipped"
        in out
    )
    assert "FAIL" not in out and "raised" not in out and "Terminated" not in out + err


def test_check_json_interrupted_is_valid_json_marked_partial_and_not_ok(tmp_path, capsys):
    target = _target(tmp_path, stop_at=_probe_calls(tmp_path) + 11)
    rc = main(["check", "--target", target, "--embed-dim", "16", "--num-heads", "2", "--json"])
    out, err = capsys.readouterr()
    assert rc == 143
    _one_interrupt_line(err, "check", "SIGTERM")
    data = json.loads(out)
    assert data["ok"] is False and data["partial"].startswith("interrupted (SIGTERM) after ")
    rows = data["reports"][0]["results"]
    assert rows and all(r["status"] != "fail" for r in rows)
    assert data["reports"][0]["partial"] == data["partial"]


def test_check_interrupted_in_the_diagnosis_keeps_the_failing_rows_unblamed_by_the_interrupt(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "200")
    """A module with a real mistake (no 1/sqrt(d)): its rows fail on their own; the diagnosis is interrupted."""
    path = tmp_path / "noscale.py"
    path.write_text(MINE.format(stop_at=-1, signum=15).replace(" / math.sqrt(self.d)", ""))

    def interrupted(*args, **kwargs):
        raise Terminated

    monkeypatch.setattr("attnlab.check.cli.diagnosed", interrupted)
    rc = main(["check", "--target", f"{path}:Attn", "--embed-dim", "16", "--num-heads", "2", "--checks", "parity_self"])
    out, err = capsys.readouterr()
    assert rc == 143
    assert "kept the 1 check(s) done (printed above), marked partial" in _one_interrupt_line(err, "check", "SIGTERM")
    assert "parity_self" in out and "FAIL" in out  # the module's own failure stays a failure
    assert "PARTIAL (interrupted (SIGTERM) after 1 of 1 checks)" in out
    assert "Likely cause" not in out


def test_check_interrupted_before_any_row_says_nothing_was_kept(tmp_path, capsys):
    rc = main(["check", "--target", _target(tmp_path, stop_at=1), "--embed-dim", "16", "--num-heads", "2"])
    out, err = capsys.readouterr()
    assert rc == 143
    line = _one_interrupt_line(err, "check", "SIGTERM")
    assert line.endswith(("kept the 0 check(s) done (none had finished), marked partial.", "nothing more was written."))
    assert "│" not in out  # no table of nothing


@pytest.mark.slow
def test_check_killed_from_outside_exits_143_with_one_line(tmp_path):
    """The real thing: another process sends SIGTERM (a CI timeout) while the checks run."""
    path = tmp_path / "slow.py"
    path.write_text(
        MINE.format(stop_at=-1, signum=15).replace(
            "CALLS[0] += 1", "CALLS[0] += 1\n        __import__('time').sleep(0.05)"
        )
    )
    ready = tmp_path / "ready"
    code = (
        "import sys, pathlib; import attnlab.check.suite as s; orig = s.CHECKS['parity_cross']\n"
        f"def hook(ctx):\n    pathlib.Path({str(ready)!r}).touch()\n    return orig(ctx)\n"
        "s.CHECKS['parity_cross'] = hook\n"
        "from attnlab.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "check", "--target", f"{path}:Attn", "--embed-dim", "16", "--num-heads", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"COLUMNS": "120"},
    )
    try:
        for _ in range(600):
            if ready.exists() or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "marked partial" in _one_interrupt_line(err, "check", "SIGTERM")
    assert "PARTIAL" in out and "FAIL" not in out


# -- bench -------------------------------------------------------------------------------------

BENCH = ["bench", "--lengths", "8", "16", "--tokens", "16", "--embed-dim", "16", "--num-heads", "2", "--repeats", "1"]
BENCH += ["--warmup", "0", "--runners", "attnlab", "floor", "--no-memory", "--no-train", "--gemm-size", "64"]


@pytest.mark.slow  # two bench runs; the decode sweep's partial results stay in make test
def test_bench_interrupted_keeps_the_finished_lengths_beside_the_last_full_result(tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "bench_attention.json").write_text('{"earlier": "complete run"}')
    from attnlab.bench import attention

    calls = []
    real = attention.attention_flops

    def flops(B, T, E):  # called once per length, after its timings: the second length is interrupted
        calls.append(T)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(B, T, E)

    monkeypatch.setattr(attention, "attention_flops", flops)
    rc = main([*BENCH, "--out-dir", str(out_dir)])
    err = capsys.readouterr().err
    assert rc == 143
    line = _one_interrupt_line(err, "bench", "SIGTERM")
    assert (
        "interrupted (SIGTERM) after 1 of 2 lengths, marked partial" in line and "bench_attention.partial.json" in line
    )
    assert json.loads((out_dir / "bench_attention.json").read_text()) == {"earlier": "complete run"}
    partial = json.loads((out_dir / "bench_attention.partial.json").read_text())
    assert partial["partial"] == "interrupted (SIGTERM) after 1 of 2 lengths"
    assert {r["T"] for r in partial["rows"]} == {8} and all(r["fwd_ms"] > 0 for r in partial["rows"])
    assert (out_dir / "bench_attention.partial.md").read_text().startswith("PARTIAL: interrupted (SIGTERM)")

    monkeypatch.setattr(attention, "attention_flops", real)  # a complete rerun replaces the partial pair
    assert main([*BENCH, "--out-dir", str(out_dir)]) == 0
    assert not (out_dir / "bench_attention.partial.json").exists()
    assert json.loads((out_dir / "bench_attention.json").read_text())["partial"] is None


def test_bench_interrupted_before_a_length_finished_writes_nothing(tmp_path, capsys, monkeypatch):
    from attnlab.bench import attention

    monkeypatch.setattr(attention, "gemm_gflops", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main([*BENCH, "--out-dir", str(tmp_path)]) == 130
    assert _one_interrupt_line(capsys.readouterr().err, "bench", "Ctrl-C").endswith("nothing more was written.")
    assert not list(tmp_path.glob("bench_attention*"))


def test_partial_window_results_are_saved_by_the_same_path(tmp_path):
    """``bench --variant window`` shares carried_by_interrupts/save_partial; a result that cannot be
    summarised still keeps its JSON."""
    from attnlab.bench.partial import carried_by_interrupts, save_partial
    from attnlab.bench.window import WindowResult, WindowRow

    res = WindowResult({"lengths": [64, 128, 256]}, "cpu", "float32", torch.__version__, 2)
    with pytest.raises(Terminated) as info, carried_by_interrupts(res):
        res.rows.append(WindowRow(64, "flex"))
        raise Terminated
    err = save_partial(info.value, tmp_path, "bench_window", lambda r: 1 / 0)  # a summary needing what is missing
    assert kept(err) == (
        f"interrupted (SIGTERM) after 1 of 3 lengths, marked partial, in {tmp_path / 'bench_window.partial.json'}"
    )
    assert json.loads((tmp_path / "bench_window.partial.json").read_text())["rows"][0]["T"] == 64
    assert not (tmp_path / "bench_window.partial.md").exists()


# -- bench-decode -------------------------------------------------------------------------------

SWEEP = ["bench-decode", "--contexts", "4", "8", "--num-layers", "1", "--num-heads", "2", "--embed-dim", "16"]
SWEEP += ["--vocab-size", "64", "--max-new-tokens", "2", "--recompute-max-new-tokens", "2", "--repeats", "1", "--no-hf"]


def test_bench_decode_sweep_interrupted_keeps_the_finished_contexts(tmp_path, capsys, monkeypatch):
    from attnlab.bench import decode

    seen: set[int] = set()
    real = decode._time

    def timed(fn, n, device):
        idx = fn.args[-1]
        seen.add(idx.size(1))
        if idx.size(1) == 8:  # the second context: interrupted in its warm-up
            raise Terminated
        return real(fn, n, device)

    monkeypatch.setattr(decode, "_time", timed)
    assert main([*SWEEP, "--out-dir", str(tmp_path)]) == 143
    line = _one_interrupt_line(capsys.readouterr().err, "bench-decode", "SIGTERM")
    assert "1 measured context(s), marked partial" in line
    report = json.loads((tmp_path / "decode.partial.json").read_text())
    assert report["partial"] == "interrupted (SIGTERM) after 1 of 2 contexts"
    assert [r["context"] for r in report["results"]] == [4]
    assert not (tmp_path / "decode.json").exists()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from test_bench_decode import _tiny_hf_llama_dir

    return _tiny_hf_llama_dir(tmp_path_factory.mktemp("tiny") / "llama")


def _model(path, *extra: str) -> list[str]:
    return ["bench-decode", "--model", str(path), "--batch-sizes", "1", "--prompt-len", "4", "--max-new-tokens", "3",
            "--repeats", "1", "--threads", "1", "--dtype", "float32", *extra]  # fmt: skip


def test_bench_decode_refuses_a_prompt_past_the_context_before_hf_loads(tiny_llama, tmp_path, capsys, monkeypatch):
    from attnlab.bench import decode

    monkeypatch.setattr(decode, "_load_hf", lambda *a: pytest.fail("HF was loaded for a run that cannot fit"))
    args = _model(tiny_llama, "--out-dir", str(tmp_path))
    args[args.index("--prompt-len") + 1] = "9000"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "attnlab: error: --prompt-len 9000 + --max-new-tokens 3 = 9003 tokens exceeds the context of "
    )
    assert "(64 tokens); pass --prompt-len at most 61." in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
    args[args.index("--prompt-len") + 1], args[args.index("--max-new-tokens") + 1] = "4", "90"  # new tokens alone
    assert main(args) == 2
    assert capsys.readouterr().err.endswith("(64 tokens); pass --max-new-tokens at most 60.\n")
    args[args.index("--prompt-len") + 1] = "70"  # neither alone: both
    assert main(args) == 2
    assert capsys.readouterr().err.endswith("(64 tokens); pass e.g. --prompt-len 32 --max-new-tokens 32.\n")


def test_bench_decode_refuses_a_batch_past_this_machines_memory(tiny_llama, tmp_path, capsys, monkeypatch):
    from attnlab.bench import decode
    from attnlab.runtime import memory

    monkeypatch.setattr(memory, "memory_limit", lambda device: (2 << 20, "MemAvailable in /proc/meminfo"))  # 2 MiB
    monkeypatch.setattr(decode, "_load_hf", lambda *a: pytest.fail("HF was loaded for a run that cannot fit"))
    args = _model(tiny_llama, "--out-dir", str(tmp_path))
    args[args.index("--batch-sizes") + 1] = "4096"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"attnlab: error: --batch-sizes 4096 at 7 tokens \(weights, K/V cache and logits, twice for HF\) needs about "
        r"\d+ MiB but cpu has 2 MiB available \(MemAvailable in /proc/meminfo\); pass --batch-sizes at most \d+ or "
        r"--no-hf\.\n",
        err,
    ), err


def test_a_failing_runner_is_left_out_of_its_row_and_the_others_still_compare(
    tiny_llama, tmp_path, capsys, monkeypatch
):
    from attnlab.bench import decode

    monkeypatch.setenv("COLUMNS", "200")

    def broken(*args, **kwargs):
        raise RuntimeError("kernel refused this shape")

    monkeypatch.setattr(decode, "generate", broken)  # attnlab's runner: the reference of same_tokens before
    assert main(_model(tiny_llama, "--out-dir", str(tmp_path))) == 0
    out = capsys.readouterr().out
    assert "attnlab failed (float32, batch 1), left out: RuntimeError: kernel refused this shape" in out
    report = json.loads((tmp_path / "decode_model.json").read_text())
    assert report["failed"] == {"attnlab": "RuntimeError: kernel refused this shape"}
    (row,) = report["results"]
    assert "attnlab" not in row and row["HF default"]["tokens_per_s"] > 0
    assert row["same_tokens"] == {"HF default": True} and row["same_tokens_reference"] == "HF default"


def test_every_runner_failing_is_one_error_not_an_empty_table(tiny_llama, tmp_path, capsys, monkeypatch):
    from attnlab.bench import decode

    monkeypatch.setattr(decode, "generate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    assert main(_model(tiny_llama, "--no-hf", "--out-dir", str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: bench-decode --model ") and "every runner failed" in err
    assert "attnlab: RuntimeError: no" in err and "Traceback" not in err


@pytest.mark.parametrize("phase", ["load", "warm-up", "timed"])
def test_bench_decode_model_interrupted_in_any_phase_is_an_interrupt_not_a_runner_failure(
    tiny_llama, tmp_path, capsys, monkeypatch, phase
):
    from attnlab.bench import decode

    if phase == "load":
        monkeypatch.setattr(decode, "copy_bandwidth", lambda device: (_ for _ in ()).throw(Terminated()))
    else:
        calls = [0]
        real = decode._time

        def timed(fn, n, device):  # the first run is attnlab's warm-up, the next ones the timed runs
            if isinstance(fn, partial):  # a runner, not the copy-bandwidth probe
                calls[0] += 1
                if phase == "warm-up" or calls[0] == 3:
                    raise Terminated
            return real(fn, n, device)

        monkeypatch.setattr(decode, "_time", timed)
    (tmp_path / "decode_model.json").write_text('{"earlier": "complete run"}')
    assert main(_model(tiny_llama, "--no-hf", "--out-dir", str(tmp_path))) == 143
    captured = capsys.readouterr()
    assert _one_interrupt_line(captured.err, "bench-decode", "SIGTERM").endswith("nothing more was written.")
    assert "failed" not in captured.out and "left out" not in captured.out
    assert json.loads((tmp_path / "decode_model.json").read_text()) == {"earlier": "complete run"}


def test_bench_decode_model_interrupted_after_a_row_keeps_it_marked_partial(tiny_llama, tmp_path, capsys, monkeypatch):
    from attnlab.bench import decode

    real = decode._time

    def timed(fn, n, device):  # batch 1 measures; batch 2 is interrupted in its warm-up
        if isinstance(fn, partial) and fn.args[-1].size(0) == 2:  # partial(generate, model, idx)
            raise KeyboardInterrupt
        return real(fn, n, device)

    monkeypatch.setattr(decode, "_time", timed)
    args = _model(tiny_llama, "--no-hf", "--out-dir", str(tmp_path))
    args[args.index("--batch-sizes") + 1 : args.index("--batch-sizes") + 2] = ["1", "2"]
    assert main(args) == 130
    line = _one_interrupt_line(capsys.readouterr().err, "bench-decode", "Ctrl-C")
    assert f"1 measured row(s), marked partial, in {tmp_path / 'decode_model.partial.json'}" in line
    report = json.loads((tmp_path / "decode_model.partial.json").read_text())
    assert report["partial"] == "interrupted (Ctrl-C) after 1 of 2 rows"
    assert [r["batch"] for r in report["results"]] == [1]
    assert (tmp_path / "decode_model.partial.md").read_text().startswith("PARTIAL: interrupted (Ctrl-C)")
    assert not (tmp_path / "decode_model.json").exists()


# -- pipes and imports --------------------------------------------------------------------------


def test_output_into_a_closed_pipe_ends_quietly():
    """``attnlab check --help | head -1``: the reader closes early; no BrokenPipeError traceback, exit 141."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "check", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the interpreter has even started: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


def test_a_transformers_broken_by_another_package_names_that_package_not_install_transformers():
    def fails_inside_torchvision():
        exec(compile("raise RuntimeError('operator torchvision::nms does not exist')", "ops.py", "exec"),
             {"__name__": "torchvision.ops"})  # fmt: skip

    try:
        fails_inside_torchvision()
    except RuntimeError as err:
        advice = import_advice("transformers", "attnlab.hf.register() needs transformers 5", err, min_major=5)
    from importlib.metadata import version

    assert advice == (
        f"attnlab.hf.register() needs transformers 5; transformers {version('transformers')} is installed but failed "
        "to import (RuntimeError: operator torchvision::nms does not exist), which comes from 'torchvision', not from "
        "transformers: repair or uninstall that package (a torchvision built for another torch, say: pip uninstall "
        "torchvision) and retry."
    )


def test_import_advice_tells_missing_and_old_apart(monkeypatch):
    from importlib import metadata

    def version(name):
        if name == "absent":
            raise metadata.PackageNotFoundError(name)
        return "4.57.1"

    monkeypatch.setattr(metadata, "version", version)
    err = ModuleNotFoundError("No module named 'absent'", name="absent")
    assert import_advice("absent", "X needs absent", err) == (
        "X needs absent, and absent is not installed; install it with pip install absent."
    )
    assert import_advice("transformers", "X needs transformers 5", ImportError("x"), min_major=5) == (
        "X needs transformers 5, and transformers 4.57.1 is installed; upgrade it with pip install -U 'transformers>=5'."
    )


def test_hf_register_raises_the_advice_when_the_import_breaks(monkeypatch):
    import builtins

    import attnlab.hf

    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "transformers":
            raise OSError("libcudart.so.12: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match=r"is installed but failed to import \(OSError: libcudart") as info:
        attnlab.hf.register()
    assert "pip install 'transformers>=5'" not in str(info.value)


def test_the_demo_interrupted_in_its_training_says_how_the_run_was_saved(tmp_path, capsys, monkeypatch):
    """The demo's training obeys the lab's stop (finish the step, save); its line, not a generic one, is printed."""
    import importlib

    from attnlab.lab.stopping import TrainingInterrupted

    lab_train = importlib.import_module("attnlab.lab.train")  # the module; attnlab.lab.train is also the function

    line = "attnlab: train stopped by SIGTERM at step 3; the checkpoint is saved: resume with attnlab train --resume"

    def stopped(*args, **kwargs):
        raise TrainingInterrupted(line, signum=signal.SIGTERM, step=3)

    monkeypatch.setattr(lab_train, "train", stopped)
    monkeypatch.setattr("attnlab.check.run_checks", lambda *a, **k: Report("skipped here", []))  # step 2: 25 s
    assert main(["demo", "--out-dir", str(tmp_path / "demo")]) == 143
    err = capsys.readouterr().err
    assert err == line + "\n"


def test_loaders_give_the_same_import_advice(tmp_path, monkeypatch):
    """A missing gguf package: install it; transformers present but broken under a GGUF or HF load: not reinstall."""
    import builtins
    from importlib import metadata

    from attnlab.runtime import ModelFileError
    from attnlab.weight_files.pretrained import from_pretrained

    real_import, real_version = builtins.__import__, metadata.version

    def fake_import(name, *args, **kwargs):
        if name == "gguf":
            raise ModuleNotFoundError("No module named 'gguf'", name="gguf")
        return real_import(name, *args, **kwargs)

    def fake_version(name):
        if name == "gguf":
            raise metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(metadata, "version", fake_version)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelFileError) as info:
        from_pretrained(tmp_path / "m.gguf")
    assert str(info.value) == (
        f"reading {str(tmp_path / 'm.gguf')!r} needs the gguf package, and gguf is not installed; install it with "
        "pip install gguf."
    )


@pytest.mark.parametrize("signum, code, how", SIGNALS, ids=["sigterm", "sigint"])
def test_a_signal_while_the_console_script_starts_is_one_line_not_a_traceback(signum, code, how):
    """The seconds of `import attnlab` (torch, its compiler) are a phase too: the launcher holds them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from attnlab_launch import main; sys.exit(main())", "check"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    subprocess.run(["sleep", "0.7"])  # torch alone takes longer than this to import
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code
    assert err == f"attnlab: interrupted ({how}) while starting, before any work; nothing was written.\n"
    assert out == ""


def test_the_console_script_is_the_launcher():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "attnlab"]
    assert script.value == "attnlab_launch:main"


def test_a_decode_shorter_than_the_prefills_noise_is_a_flagged_floor_not_a_negative_rate(
    tiny_llama, tmp_path, capsys, monkeypatch
):
    # measured in a loaded make test-all: the 1-token run took longer than the 3-token run, and HF's rate was
    # printed as -1051.8 tokens/s; the step is the difference of the two runs, which such noise makes negative
    from attnlab.bench import decode

    real = decode._time

    def noisy(fn, k, device):
        t, out = real(fn, k, device)
        return (t + 1.0 if k == 1 else t), out  # the 1-token run the slower one by a second

    monkeypatch.setattr(decode, "_time", noisy)
    assert main(_model(tiny_llama, "--out-dir", str(tmp_path), "--no-hf")) == 0
    out = capsys.readouterr().out
    assert "the decode took less than the prefill's run-to-run noise" in " ".join(out.split())
    (row,) = json.loads((tmp_path / "decode_model.json").read_text())["results"]
    assert row["attnlab"]["decode_unresolved"] is True and row["attnlab"]["tokens_per_s"] > 0
