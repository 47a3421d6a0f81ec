"""The device the suite runs on: ``ATTNLAB_TEST_DEVICE`` or ``--device`` picks it (cpu by default), a
name that is wrong or absent here stops pytest before collection with one sentence and exit code 4,
and a ``cpu_only`` test is skipped on any other device with its reason.

The exits and the skip are seen from outside: pytest runs in subprocesses on a two-test file next to
a copy of tests/conftest.py. A CUDA session is simulated on this CPU by a plugin loaded before the
conftest that makes torch report one GPU; nothing in that session touches it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE_VARIABLE, cpu_only_skip_reason, resolve_test_device

ROOT = Path(__file__).resolve().parents[1]

TWO_TESTS = """
import pytest


def test_sees_the_device(device):
    assert device.type == "cuda"


@pytest.mark.cpu_only("reads the CPU's own behaviour")
def test_cpu_specific():
    pass
"""

FAKE_CUDA = '''
"""Loaded with -p before any conftest: torch reports one CUDA GPU (nothing in the session uses it)."""
import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
'''

NEVER_HERE = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: absent on every machine


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Three pytest sessions, run side by side (each spends its time importing torch)."""
    here = tmp_path_factory.mktemp("device_sessions")
    shutil.copy(ROOT / "tests" / "conftest.py", here / "conftest.py")
    (here / "test_two.py").write_text(TWO_TESTS)
    (here / "fake_cuda.py").write_text(FAKE_CUDA)
    base = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml")]
    base += ["--rootdir", str(here)]
    runs = {
        "invalid": ([], {DEVICE_VARIABLE: "tpu"}),
        "unavailable": ([], {DEVICE_VARIABLE: NEVER_HERE}),
        # --device wins over the variable, which alone would stop the run
        "fake_cuda": (["-p", "fake_cuda", "--device", "cuda"], {DEVICE_VARIABLE: "tpu"}),
    }
    procs = {
        name: subprocess.Popen(
            [*base, *extra, str(here / "test_two.py")],
            cwd=here,  # `python -m` puts it on sys.path: -p fake_cuda imports from there
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, (extra, env) in runs.items()
    }
    done = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out)
    return done


HAS = r"this machine's torch \S+ \([^)]*\) has cpu(, [\w:]+)*"


def test_the_default_is_cpu_and_the_option_wins_over_the_variable():
    assert resolve_test_device(None, {}) == torch.device("cpu")
    assert resolve_test_device(None, {DEVICE_VARIABLE: ""}) == torch.device("cpu")
    assert resolve_test_device("cpu", {DEVICE_VARIABLE: "tpu"}) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--device 'tpu' is not a torch device name: .*; pass --device with one"):
        resolve_test_device("tpu", {})


@pytest.mark.slow  # three pytest sessions in subprocesses (~9 s of make test); test_cpu_only_skip_logic stays quick
def test_an_invalid_name_stops_pytest_with_one_sentence(sessions):
    run = sessions["invalid"]
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout
    sentence = rf"Exit: {DEVICE_VARIABLE}='tpu' is not a torch device name: {HAS}; set {DEVICE_VARIABLE} to one of those, or unset it to test on cpu\.\n"
    assert re.search(sentence, run.stdout), run.stdout
    assert "passed" not in run.stdout and "test_two" not in run.stdout  # stopped before collection


@pytest.mark.slow  # three pytest sessions in subprocesses (~9 s of make test); test_cpu_only_skip_logic stays quick
def test_a_device_this_machine_lacks_stops_pytest_with_one_sentence(sessions):
    run = sessions["unavailable"]
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout
    sentence = rf"Exit: {DEVICE_VARIABLE}='{NEVER_HERE}' names a device this machine cannot use: {HAS}; set {DEVICE_VARIABLE} to one of those"
    assert re.search(sentence, run.stdout), run.stdout


@pytest.mark.slow  # three pytest sessions in subprocesses (~9 s of make test); test_cpu_only_skip_logic stays quick
def test_cpu_only_tests_are_skipped_elsewhere_with_their_reason(sessions):
    run = sessions["fake_cuda"]
    assert run.returncode == pytest.ExitCode.OK, run.stdout
    assert re.search(
        r"SKIPPED \[1\] test_two\.py:\d+: CPU only \(cuda under test\): reads the CPU's own behaviour", run.stdout
    )
    assert "1 passed, 1 skipped" in run.stdout  # test_sees_the_device got cuda


def test_cpu_only_skip_logic():
    assert cpu_only_skip_reason(torch.device("cpu"), ["why"]) is None
    assert (
        cpu_only_skip_reason(torch.device("cuda:1"), ["why", "and why"]) == "CPU only (cuda:1 under test): why; and why"
    )
    assert cpu_only_skip_reason(torch.device("mps"), ["why"]) == "CPU only (mps under test): why"
    with pytest.raises(ValueError, match=r"@pytest.mark.cpu_only needs a reason, got \[None\]"):
        cpu_only_skip_reason(torch.device("cuda"), [None])
