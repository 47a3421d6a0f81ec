"""``attnlab check --device/--dtype`` and ``run_checks(device=, dtype=)``: the suite where the module runs.

On this CPU machine the CPU, float64 and bfloat16 runs are real; the device runs use the ``device``
fixture, so ``ATTNLAB_TEST_DEVICE=cuda pytest tests/test_check*.py`` checks the same modules on a GPU.
A device the machine lacks, a name that is no device and a dtype the suite does not run in are refused
before any work, in one sentence naming the flag, what was given, what this machine has and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention
from attnlab.check import CHECKS, ModuleAdapter, run_checks
from attnlab.check.device import available_devices
from attnlab.check.suite import LOW_PRECISION_FACTOR, LOW_PRECISION_FLOOR, PARITY_TOL, Context
from attnlab.check.target import build_target
from attnlab.cli import main
from attnlab.runtime import UsageError
from check_factories import TinyAttention

CORPUS = Path(__file__).parent / "mistake_corpus"
# Rows that rebuild or lengthen the target, the full Jacobian and the half-precision rows: slow, and
# named by the other rows too (as in test_check_diagnosis.py).
FAST = [
    n
    for n in CHECKS
    if n not in ("odd_lengths", "parity_head_dims", "gradcheck[plain]")
    and not n.startswith(("low_precision_grad", "variant["))
]
BUILD = "a CPU-only build" if torch.version.cuda is None else f"a CUDA {torch.version.cuda} build"
MACHINE = f"this machine's torch {torch.__version__} ({BUILD}) has {', '.join(available_devices())}"
CPU_ONLY_BUILD = pytest.mark.skipif(torch.version.cuda is not None, reason="the message of a CPU-only torch build")


def attnlab_module(backend: str = "math", **kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, dropout=0.1, backend=backend, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return m


def _refused(capsys, *argv: str) -> str:
    """Run ``attnlab check argv``: exit 2 (a usage error), one line on stderr, nothing on stdout; the line."""
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith("attnlab: error: ") and "Traceback" not in err
    return err.removeprefix("attnlab: error: ").rstrip("\n")


# -- refused before any work -----------------------------------------------------------------------
@CPU_ONLY_BUILD
def test_cuda_on_a_machine_without_it_is_refused_with_the_fix(capsys):
    assert _refused(capsys, "--device", "cuda") == (
        f"--device 'cuda' names a device this machine does not have: {MACHINE}; pass --device cpu, or install "
        f"a CUDA build of torch on a machine with an NVIDIA GPU and check there."
    )


def test_a_device_index_past_the_last_is_refused(capsys):
    if "cuda" in available_devices():
        assert _refused(capsys, "--device", "cuda:99") == (
            f"--device 'cuda:99' names a device this machine does not have: {MACHINE}; pass one of those, "
            f"e.g. --device cuda:0."
        )
    else:
        assert _refused(capsys, "--device", "cuda:99").startswith("--device 'cuda:99' names a device this machine")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--device", "gpu"],
            f"--device 'gpu' is not a torch device name; {MACHINE}: pass one of those, e.g. --device cpu (the default).",
        ),
        (
            ["--device", "meta"],
            "--device 'meta' holds no values, and every check measures an error on real numbers, so none can run "
            f"on meta; {MACHINE}: pass one of those, e.g. --device cpu.",
        ),
        (
            ["--dtype", "float8"],
            "--dtype 'float8' is not a dtype attnlab check runs in; expected one of float32, float64, bfloat16, "
            "float16 (float32 is the default): pass one of those, e.g. --dtype bfloat16.",
        ),
    ],
    ids=["not-a-device", "meta", "dtype"],
)
def test_a_wrong_device_or_dtype_is_one_sentence(capsys, argv, message):
    assert _refused(capsys, *argv) == message


def test_the_refusal_comes_before_the_target_is_built(capsys, tmp_path):
    """The device is checked first: a user's file is not imported for a run that cannot happen."""
    marker = tmp_path / "imported"
    mine = tmp_path / "mine.py"
    mine.write_text(f"open({str(marker)!r}, 'w').close()\nfrom torch.nn import MultiheadAttention as M\n")
    assert _refused(capsys, "--target", f"{mine}:M", "--device", "meta").startswith("--device 'meta' holds")
    assert not marker.exists()


@CPU_ONLY_BUILD
def test_the_api_refuses_in_its_own_words():
    """``run_checks`` raises UsageError (a ValueError) naming its argument as Python writes it."""
    with pytest.raises(UsageError) as e:
        run_checks(TinyAttention(), device="cuda")
    assert str(e.value) == (
        f"device='cuda' names a device this machine does not have: {MACHINE}; pass device='cpu', or install a "
        f"CUDA build of torch on a machine with an NVIDIA GPU and check there."
    )
    with pytest.raises(ValueError, match=r"^dtype='int8' is not a dtype attnlab check runs in; expected one of "):
        run_checks(TinyAttention(), dtype="int8")


def test_an_adapter_that_cannot_move_is_refused_with_the_fix():
    class Fixed(ModuleAdapter):
        to = None  # type: ignore[assignment]  # an adapter of the protocol without to()

    with pytest.raises(ValueError) as e:
        run_checks(Fixed(TinyAttention()), dtype=torch.float64)
    assert str(e.value) == (
        "device='cpu', dtype=float64: the target TinyAttention is on cpu in float32 and its adapter has no "
        "to(device, dtype); move the module it wraps there before wrapping it, or give the adapter a to() "
        "(see attnlab.check.adapters)."
    )


# -- the same verdicts in float64 and bfloat16 ------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("make", [lambda: attnlab_module("math"), TinyAttention], ids=["attnlab", "tiny"])
def test_a_correct_module_passes_in_float64_and_bfloat16(make, dtype):
    module = make()
    report = run_checks(module, dtype=dtype, checks=[*FAST, "odd_lengths", "parity_head_dims"])
    assert report.ok, [(r.name, r.measured, r.tolerance, r.detail) for r in report.failures]
    assert report.config["dtype"] == str(dtype).removeprefix("torch.") and report.config["device"] == "cpu"
    assert next(module.parameters()).dtype == torch.float32  # checked as a copy: the caller's module stays
    if dtype == torch.float64:  # float32's bounds hold: float64 has room to spare
        assert report["parity_self"].tolerance == PARITY_TOL and report["parity_self"].measured < 1e-12


def test_the_half_dtype_rule_is_flash_attentions():
    """In bfloat16 a figure may be 2x plain PyTorch's worst error in bfloat16 (+ the floor): rounding, not
    a float32 bound that no bfloat16 module could meet. float32 keeps its own bounds."""
    wide = Context(ModuleAdapter(attnlab_module()))
    half = Context(ModuleAdapter(attnlab_module().to(torch.bfloat16)))
    assert wide.tol(PARITY_TOL) == PARITY_TOL
    plain = half.plain_error()
    assert 1e-3 < plain < 3e-2  # bfloat16 keeps 8 bits: ~4e-3 per rounding
    assert half.tol(PARITY_TOL) == LOW_PRECISION_FACTOR * plain + LOW_PRECISION_FLOOR
    assert half.tol(PARITY_TOL, grads=True) == LOW_PRECISION_FACTOR * half.plain_error(grads=True) + LOW_PRECISION_FLOOR


@pytest.mark.parametrize("dtype", [None, "float64", "bfloat16"])
@pytest.mark.parametrize(
    ("name", "mistake"),
    [
        ("seed002_scale_embed_dim", "scale_embed_dim"),  # recomputed
        ("torchlike_padding_on_queries", "padding_on_queries"),
        ("gqa_gqa_kv_heads_tiled", "gqa_kv_heads_tiled"),
        ("torchlike_fully_masked_nan", "fully_masked_nan"),  # probed
        ("torchlike_dropout_no_rescale", "dropout_no_rescale"),
        ("seed002_view_not_contiguous", "view_not_contiguous"),  # its exception
    ],
)
def test_a_mistake_is_named_the_same_in_every_dtype(name, mistake, dtype):
    """The diagnosis recomputes its hypotheses on a float32 copy in a half dtype: the same mistake comes first,
    and every failing row sits under a cause. (Run over the whole corpus while this was written: the same
    causes in float64 and bfloat16 as in float32 for all 58 modules.)"""
    kv = 2 if name.startswith("gqa") else None
    target = build_target(
        f"{CORPUS / name}.py:MultiHeadAttention", embed_dim=32, num_heads=4, num_kv_heads=kv, dropout=0.1, seed=0
    )
    report = run_checks(target, dtype=dtype, checks=FAST)
    assert [c.id for c in report.diagnosis][:1] == [mistake], [(c.id, c.explains) for c in report.diagnosis]
    explained = {n for c in report.diagnosis for n in c.explains}
    assert explained == {r.name for r in report.failing}  # hardening notes included


def test_the_cli_runs_the_target_in_the_dtype_asked(capsys):
    code = main(
        ["check", "--json", "--backend", "sdpa", "--dtype", "float64", "--checks", "parity_self", "grad_parity"]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"]
    (report,) = data["reports"]
    assert (report["config"]["device"], report["config"]["dtype"]) == ("cpu", "float64")
    assert report["results"][1]["detail"].startswith("float64 input grads vs float64")


def test_the_table_says_where_it_ran_when_not_the_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the caption on one line
    assert main(["check", "--backend", "math", "--dtype", "float64", "--checks", "parity_self"]) == 0
    out = capsys.readouterr().out
    assert "B=2 T=7 seed=0 on cpu in float64 torch " in out
    assert main(["check", "--backend", "math", "--checks", "parity_self"]) == 0
    assert "B=2 T=7 seed=0 torch " in capsys.readouterr().out  # cpu and float32: nothing to say


def test_build_target_and_diagnose_take_the_same_arguments():
    """The pieces the CLI wraps: the target built and moved before it is probed, and a report diagnosed
    in another dtype naming the same mistake."""
    from attnlab.check.diagnose import diagnose

    spec = f"{CORPUS / 'seed002_scale_embed_dim.py'}:MultiHeadAttention"
    target = build_target(spec, embed_dim=32, num_heads=4, num_kv_heads=None, dropout=0.1, seed=0, dtype="float64")
    assert target.projections().q_weight.dtype == torch.float64
    report = run_checks(target, checks=["parity_self", "parity_masked"], diagnose=False)
    assert report.config["dtype"] == "float64" and not report.ok
    causes = diagnose(target, report, dtype="bfloat16")  # hypotheses on a float32 copy of the bfloat16 module
    assert [c.id for c in causes] == ["scale_embed_dim"]
    with pytest.raises(UsageError, match=r"^--device 'meta' holds no values"):  # --target's builder: flags
        build_target(spec, embed_dim=32, num_heads=4, num_kv_heads=None, dropout=0.1, seed=0, device="meta")


def test_a_user_file_is_checked_in_bfloat16_from_the_cli(capsys):
    path = CORPUS / "seed002_correct.py"
    code = main(["check", "--json", "--target", f"{path}:MultiHeadAttention", "--dtype", "bf16", "--checks", *FAST])
    data = json.loads(capsys.readouterr().out)
    (report,) = data["reports"]
    assert code == 0, [r for r in report["results"] if r["status"] == "fail"]
    assert report["config"]["dtype"] == "bfloat16"


# -- on the device under test (ATTNLAB_TEST_DEVICE=cuda: a GPU) -----------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: attnlab_module("sdpa", num_kv_heads=2),
        lambda: nn.MultiheadAttention(16, 4, batch_first=True),
        TinyAttention,
    ],
    ids=["attnlab-sdpa-gqa", "torch", "tiny"],
)
def test_modules_are_checked_on_the_device_under_test(make, dtype, device):
    """A CPU module moved by ``run_checks(device=...)``: every row and the reference run there. torch's own
    module keeps its known findings (NaN in fully masked and NaN-padded rows, test_check.py)."""
    torch.manual_seed(0)
    report = run_checks(make(), device=device, dtype=dtype, checks=FAST)
    assert report.config["device"] == str(torch.empty(0, device=device).device)
    known = {"fully_masked_rows", "padded_kv_nonfinite"} if isinstance(make(), nn.MultiheadAttention) else set()
    assert {r.name for r in report.failures} <= known, [
        (r.name, r.measured, r.tolerance, r.detail) for r in report.failures
    ]


def test_the_cli_checks_on_the_device_under_test(capsys, device):
    code = main(["check", "--json", "--device", str(device), "--checks", "parity_self", "parity_masked", "grad_parity"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"], data
    assert {r["config"]["device"] for r in data["reports"]} == {str(torch.empty(0, device=device).device)}
