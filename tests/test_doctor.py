"""attnlab doctor on this machine: the findings it must print, and its exit code."""

from __future__ import annotations

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
