"""attnlab doctor on this machine: the findings it must print, and its exit code."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from attnlab.cli import main
from attnlab.tools import doctor as doctor_mod


def test_doctor_on_this_machine(capsys):
    assert main(["doctor", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
    assert f"({build} build)" in out
    # Kernels are tried for real: on the CPU the math kernel always runs.
    assert "sdpa math @ cpu" in out and "runs" in out
    assert "flash-attn package" in out
    assert out.rstrip().endswith("attnlab can run here.")


def test_sdpa_kernel_probe_reports_failures():
    ran, why = doctor_mod.try_sdpa_kernel("memory-efficient", "cpu")
    assert ran is False and why  # not a CPU kernel: the reason is reported, not raised
    assert doctor_mod.try_sdpa_kernel("math", "cpu") == (True, "")


def test_flash_attn_missing_gets_the_seed_advice(monkeypatch):
    real_find_spec = doctor_mod.importlib.util.find_spec
    monkeypatch.setattr(
        doctor_mod.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a),
    )
    findings = {f.topic: f for f in doctor_mod.diagnose(compile_check=False)}
    fa = findings["flash-attn package"]
    assert fa.detail == "not installed"
    assert "prebuilt wheel" in fa.fix and "from source" in fa.fix


def test_doctor_exits_nonzero_when_attnlab_cannot_run(monkeypatch, capsys):
    monkeypatch.setattr(doctor_mod, "try_attnlab", lambda: (False, "RuntimeError: simulated"))
    assert main(["doctor", "--no-compile"]) == 1
    out = capsys.readouterr().out
    assert "[fail] attnlab" in out and "fix: Reinstall with the pinned torch" in out
    assert "attnlab cannot run here: 1 problem(s) above." in out


def test_compile_probe_works_here():
    assert doctor_mod.try_compile() == (True, "")


def test_doctor_fits_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(  # the long fix text must wrap, not run off the screen
        doctor_mod.importlib.util, "find_spec", lambda name, *a: None
    )
    assert main(["doctor", "--no-compile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    fix = next(i for i, line in enumerate(lines) if line.startswith("       fix: Not needed:"))
    assert lines[fix + 1].startswith(" " * 12) and lines[fix + 1].strip()  # wrapped under its first line


def test_doctor_announces_the_compile_probe_before_running_it(capsys, monkeypatch):
    events: list[str] = []

    def probe():
        events.append(capsys.readouterr().out)  # what was on the screen while the probe ran
        return True, ""

    monkeypatch.setattr(doctor_mod, "try_compile", probe)
    assert main(["doctor"]) == 0
    before, after = events[0], capsys.readouterr().out
    assert before.splitlines()[-1] == "[ .. ] torch.compile                running (compiles a tiny function) ..."
    assert "[  ok] python" in before  # findings are printed as they come, not at the end
    assert after.startswith("[  ok] torch.compile                works (")


def test_doctor_on_a_terminal_replaces_the_running_line(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(doctor_mod, "try_compile", lambda: (True, ""))
    assert main(["doctor"]) == 0
    text = out.getvalue()
    running = "[ .. ] torch.compile                running (compiles a tiny function) ..."
    assert f"{running}\r\x1b[K[  ok] torch.compile " in text  # no newline: the finding overwrites it


def test_iter_findings_yields_as_it_goes(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(doctor_mod, "try_compile", lambda: (seen.append("compile ran"), (True, ""))[1])
    for f in doctor_mod.iter_findings(announce=lambda topic, what: seen.append(f"announce {topic}")):
        seen.append(f.topic)
    assert seen.index("announce torch.compile") == seen.index("compile ran") - 1
    assert seen.index("python") == 0 and seen[-1] == "attnlab"


@pytest.fixture(autouse=True)
def private_compile_cache(tmp_path, monkeypatch):
    """Each test its own remembered-probe file: a cached success from another run must not hide the probe."""
    monkeypatch.setattr(doctor_mod, "compile_cache_path", lambda: tmp_path / "attnlab" / "doctor.json")


def test_a_successful_compile_probe_is_remembered_until_recheck(capsys, monkeypatch):
    calls = []

    def probe():
        calls.append(1)
        return True, ""

    monkeypatch.setattr(doctor_mod, "try_compile", probe)
    assert main(["doctor"]) == 0 and len(calls) == 1
    assert main(["doctor"]) == 0 and len(calls) == 1  # the second run reads the remembered success
    assert "[  ok] torch.compile                works (remembered: " in capsys.readouterr().out
    assert main(["doctor", "--recheck-compile"]) == 0 and len(calls) == 2


def test_a_failed_compile_probe_is_not_remembered(monkeypatch):
    calls = []
    monkeypatch.setattr(doctor_mod, "try_compile", lambda: (calls.append(1), (False, "no compiler"))[1])
    main(["doctor"])
    main(["doctor"])
    assert len(calls) == 2


def test_doctor_reports_the_quantized_kernels_and_the_fallback(monkeypatch):
    from attnlab.quant import kernels
    from attnlab.tools.doctor import diagnose

    found = {f.topic: f for f in diagnose(compile_check=False)}["quantized kernels"]
    assert found.status == ("ok" if kernels.kernel_status().available else "warn")
    off = kernels.KernelStatus(
        False, "none", "building them failed (x); install a C++17 compiler", "/x", fix="install a C++17 compiler"
    )
    monkeypatch.setattr(kernels, "_status", off)
    found = {f.topic: f for f in diagnose(compile_check=False)}["quantized kernels"]
    assert (found.status, found.detail) == ("warn", "building them failed (x); install a C++17 compiler")
    assert found.fix == (
        "dtype='gguf' models run the slower pure-PyTorch path (about 16x slower); install a C++17 compiler."
    )


def test_doctor_checks_what_a_kernel_build_needs(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    from attnlab.tools.doctor import diagnose

    monkeypatch.setenv("ATTNLAB_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "attnlab-no-such-compiler")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    found = {f.topic: f for f in diagnose(compile_check=False)}
    assert found["kernels' folder"].status == "ok" and str(tmp_path) in found["kernels' folder"].detail
    assert found["C++ compiler"].status == "warn"
    assert (
        found["C++ compiler"].fix
        == "Install one (`apt-get install g++`, `xcode-select --install`) or point CXX at one."
    )
    assert (found["ninja"].status, found["ninja"].detail) == (
        "warn",
        "building the kernels needs ninja, which is not installed in this environment",
    )
