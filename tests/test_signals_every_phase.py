"""Every stop signal, in every phase, in every command: one line naming the signal, exit ``128 + signal``, and
for train a checkpoint that resumes to the weights of a run never interrupted.

The phases of ``attnlab train`` are hit with ``tests/support/signal_at.py``, which sends the signal to the
process from inside the function doing the phase (flag parsing, the model build, a step, an evaluation, the
head-score probe, a checkpoint write, the final ``model/`` write, the curve): deterministic, no sleeps. A
closed terminal is a real one: a pseudo-terminal whose master is closed, so the kernel sends the SIGHUP and
every later write to the terminal fails. The other commands are driven in this process, as
``tests/test_interrupts.py`` drives them with SIGTERM.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
import tyro
from safetensors.torch import load_file

import attnlab_launch
from attnlab.cli import main
from attnlab.lab import TrainConfig, train, train_state
from attnlab.lab.stopping import StopSignals, first_signal, signal_slots
from attnlab.lab.train_state import CKPT_NAME
from attnlab.runtime.signals import STOP_SIGNALS, Terminated, interrupt_exit
from test_interrupts import BENCH, _one_interrupt_line

ROOT = Path(__file__).resolve().parents[1]
SIGNAL_AT = ROOT / "tests" / "support" / "signal_at.py"
# dropout 0.1 so that the saved RNG state matters; gpt, so that model/ is written; head scores on (the default)
ARGS = [
    "--steps",
    "12",
    "--eval-every",
    "4",
    "--ckpt-every",
    "6",
    "--model.embed-dim",
    "16",
    "--model.num-layers",
    "1",
    "--data.batch-size",
    "8",
    "--data.copy-len",
    "4",
    "--model.dropout",
    "0.1",
    "--no-progress",
]
STOPPED = re.compile(
    r"^attnlab: (SIG\w+) received: stopped after step (\d+) of 12, checkpoint saved to (\S+); resume with `([^`]+)`$",
    re.M,
)
# phase -> (call of its function that signals, the step the run stops after; None: the run finishes)
PHASES = {
    "build": (1, 0),
    "step": (5, 6),  # step 6 under way (lr_at(5)); 6 is also a periodic checkpoint
    "eval": (2, 4),  # step 4's evaluation (the first is step 0's)
    "head-scores": (2, 4),
    "checkpoint": (1, 6),  # the periodic write at step 6
    "model": (1, None),  # the final model/ write
    "plots": (1, None),  # the curve, at the end
}
OTHERS = [s for s in STOP_SIGNALS if s not in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "200"}


def _signal_at(phase: str, sig: signal.Signals, call: int, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SIGNAL_AT), phase, sig.name, str(call), "--", "train", *ARGS, "--out-dir", str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _attnlab(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "attnlab", *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(run / CKPT_NAME)).items() if k.startswith("model.")}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _attnlab_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("attnlab:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's weights, trained here with one thread as the subprocesses are."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("reference") / "run"
        train(tyro.cli(TrainConfig, args=[*ARGS, "--out-dir", str(out)]), quiet=True)
    finally:
        torch.set_num_threads(threads)
    return _weights(out)


def _check_phase(tmp_path: Path, phase: str, sig: signal.Signals, reference: dict[str, torch.Tensor]) -> None:
    call, stop_step = PHASES[phase]
    run = tmp_path / f"{phase}-{sig.name}"
    done = _signal_at(phase, sig, call, run)
    log = done.stdout + done.stderr
    assert done.returncode == 128 + sig, log
    assert "Traceback" not in log, log
    (line,) = _attnlab_lines(done.stderr)  # one line, and only one
    if stop_step is None:  # the run's last files were being written: they are finished, nothing to resume
        assert line == (
            f"attnlab: {sig.name} received as the run finished: its 12 steps are done and every file is "
            "written; nothing to resume."
        ), log
        assert all((run / name).exists() for name in ("summary.json", "curve.png", "model", CKPT_NAME))
        assert _same(_weights(run), reference)
        return
    (match,) = STOPPED.findall(line)
    name, step, ckpt, resume = match
    assert name == sig.name and int(step) == stop_step and Path(ckpt) == run / CKPT_NAME, line
    assert train_state.read_meta(run / CKPT_NAME)["step"] == stop_step
    assert not (run / "summary.json").exists()
    assert resume == f"attnlab train --out-dir {run} --resume"
    resumed = _attnlab(*shlex.split(resume)[1:])  # the printed command, as printed
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    if stop_step:  # (a checkpoint of step 0 starts the steps from the beginning, without a word)
        assert f"resumed {run / CKPT_NAME} at step {stop_step}" in resumed.stdout
    assert _same(_weights(run), reference), f"{phase}/{sig.name}: not the uninterrupted weights"


# -- in this process: which signals, and how they travel between ranks ---------------------------------


def test_every_stop_signal_sets_the_flag_and_the_handlers_come_back():
    assert {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2} <= set(
        STOP_SIGNALS
    )
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        with StopSignals() as stop:
            os.kill(os.getpid(), sig)
            os.kill(os.getpid(), signal.SIGTERM)  # a second signal while stopping changes nothing
            assert stop.signum == sig and stop.name == sig.name
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_the_console_script_guards_the_same_signals_while_it_imports():
    assert set(attnlab_launch.STOP_SIGNALS) == set(STOP_SIGNALS)


def test_each_rank_signal_has_its_own_slot_and_the_lowest_rank_speaks():
    world = 4
    summed = [sum(x) for x in zip(*(signal_slots(world, r, s) for r, s in enumerate([0, 15, 0, 1])), strict=True)]
    assert summed == [0.0, 15.0, 0.0, 1.0]  # summed, not mixed: SIGTERM on rank 1 and SIGHUP on rank 3
    assert first_signal(summed) == (15, 1)
    assert first_signal([0.0] * world) == (0, -1)
    stop = StopSignals()
    stop.agree(15, 1)
    assert (stop.signum, stop.sender) == (15, " by rank 1")


def test_terminated_names_its_signal():
    assert interrupt_exit(Terminated()) == ("SIGTERM", 143)
    assert interrupt_exit(Terminated(signal.SIGHUP)) == ("SIGHUP", 129)
    assert interrupt_exit(Terminated(signal.SIGUSR1)) == ("SIGUSR1", 138)
    assert interrupt_exit(KeyboardInterrupt()) == ("Ctrl-C", 130)


# -- the other commands: one line naming the signal, 128 + its number ----------------------------------


# make test keeps SIGHUP; the rarer stop signals run in `make test-all` (CI)
@pytest.mark.parametrize(
    "sig", [signal.SIGHUP, *(pytest.param(s, marks=pytest.mark.slow) for s in OTHERS)], ids=lambda s: s.name
)
def test_bench_stops_on_every_stop_signal_with_one_line_naming_it(tmp_path, capsys, monkeypatch, sig):
    from attnlab.bench import attention

    real = attention.attention_flops
    calls: list[int] = []

    def flops(B, T, E):  # once per length, after its timings: the second length is interrupted
        calls.append(T)
        if len(calls) == 2:
            os.kill(os.getpid(), sig)
        return real(B, T, E)

    monkeypatch.setattr(attention, "attention_flops", flops)
    assert main([*BENCH, "--out-dir", str(tmp_path)]) == 128 + sig
    line = _one_interrupt_line(capsys.readouterr().err, "bench", sig.name)
    assert f"interrupted ({sig.name}) after 1 of 2 lengths, marked partial" in line
    assert signal.getsignal(sig) is not None and signal.getsignal(sig) != signal.SIG_IGN


def test_doctor_and_the_rest_restore_every_handler(capsys):
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    main(["doctor"])
    capsys.readouterr()
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


# -- train, in a phase ---------------------------------------------------------------------------------


@pytest.mark.slow  # a whole training run twice; test_every_stop_signal_mid_step covers SIGHUP too, in the slow set
def test_sighup_mid_step_saves_and_resumes_to_the_uninterrupted_weights(tmp_path, reference):
    _check_phase(tmp_path, "step", signal.SIGHUP, reference)


def test_a_signal_while_the_flags_are_parsed_writes_nothing(tmp_path):
    run = tmp_path / "run"
    done = _signal_at("parse", signal.SIGHUP, 1, run)
    assert done.returncode == 129, done.stderr
    assert _attnlab_lines(done.stderr) == ["attnlab: SIGHUP received before train started; nothing was written."]
    assert not run.exists()


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("which", ["hangup", "other"])
def test_every_phase_saves_on_a_stop_signal(tmp_path, reference, phase, which):
    """SIGHUP in every phase, and every other stop signal in turn (each lands in a different phase)."""
    turn = [signal.SIGINT, signal.SIGTERM, *OTHERS]
    sig = signal.SIGHUP if which == "hangup" else turn[list(PHASES).index(phase) % len(turn)]
    _check_phase(tmp_path, phase, sig, reference)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, *OTHERS], ids=lambda s: s.name)
def test_every_stop_signal_mid_step(tmp_path, reference, sig):
    _check_phase(tmp_path, "step", sig, reference)


# -- a terminal that closes ----------------------------------------------------------------------------


def _in_terminal(args: list[str]) -> tuple[subprocess.Popen, int]:
    """``attnlab train`` with a new pseudo-terminal as its controlling terminal and its stdout/stderr (a bar)."""
    master, slave = os.openpty()

    def own_terminal() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "train", *args],
        cwd=ROOT,
        env={**_env(), "TERM": "xterm"},
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=own_terminal,
    )
    os.close(slave)
    return proc, master


@pytest.mark.slow
def test_a_closed_terminal_saves_the_run_and_it_resumes(tmp_path, reference):
    """The terminal goes away (its master closed, as when an ssh session drops): the kernel sends SIGHUP, and
    every write to the terminal now fails with EIO, the progress bar's included. The run still saves."""
    run = tmp_path / "run"
    args = [a for a in ARGS if a != "--no-progress"]
    args[args.index("--steps") + 1] = "400"  # long enough to close the terminal mid-run
    proc, master = _in_terminal([*args, "--out-dir", str(run)])
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (metrics.exists() and metrics.read_text().count("\n") >= 30):
            try:
                os.read(master, 65536)  # drain the bar, as a terminal does
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the run never got going"
            time.sleep(0.01)
    finally:
        os.close(master)  # the hangup
    assert proc.wait(timeout=120) == 129
    step = train_state.read_meta(run / CKPT_NAME)["step"]
    assert 30 <= step < 400
    resumed = _attnlab("train", "--out-dir", str(run), "--resume", "--steps", "400")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed {run / CKPT_NAME} at step {step}" in resumed.stdout
    full = tmp_path / "full"
    assert _attnlab("train", *args, "--no-progress", "--out-dir", str(full)).returncode == 0
    assert _same(_weights(run), _weights(full))
