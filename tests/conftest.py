"""Shared helpers: tiny dimensions, every mask kind built the same way in every test, and the
device the suite runs on.

The device: ``ATTNLAB_TEST_DEVICE=cuda make test`` or ``pytest --device cuda`` (the option wins;
default ``cpu``) runs the parity, check, KV-cache and generation tests there through the
session fixture ``device``. Their inputs are still drawn on the CPU and moved, so a CPU run
draws exactly the numbers it always drew. A test that only means something on a CPU carries
``@pytest.mark.cpu_only("why")`` and is skipped elsewhere with that reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor

from attnlab.check.suite import LOW_PRECISION_FACTOR, LOW_PRECISION_FLOOR

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two pytest workers on the machine's two cores
    # One thread each, and for the processes they start: OpenMP threads spinning against the other
    # worker's on the same cores slow a step 20-40x (see `one_thread`).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton kernels (tests/function_corpus/triton_*.py) run on the CPU in Triton's interpreter. It is read when
    # triton is imported, and torch's inductor imports triton in some earlier test of the same worker: set here,
    # before any test, or the kernels fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
    os.environ.setdefault("TRITON_INTERPRET", "1")

MASK_KINDS = ("none", "bool", "float", "padding", "causal", "causal+padding", "all")
DEVICE_VARIABLE = "ATTNLAB_TEST_DEVICE"
_DEVICE = pytest.StashKey[torch.device]()


def make_masks(kind: str, B: int, T_q: int, T_k: int, *, dtype=torch.float32, generator=None) -> dict:
    """Keyword arguments for forward(); every row keeps at least one key unless stated."""
    g = generator or torch.Generator().manual_seed(1234)
    kw: dict = {}
    if kind in ("bool", "all"):
        keep = torch.rand(B, T_q, T_k, generator=g) > 0.3
        keep[..., 0] = True  # no fully masked rows here; they are tested on their own
        kw["attn_mask"] = keep
    if kind == "float":
        bias = torch.randn(T_q, T_k, generator=g, dtype=dtype)
        bias[:, 1::3] = float("-inf")
        kw["attn_mask"] = bias
    if kind in ("padding", "causal+padding", "all"):
        pad = torch.zeros(B, T_k, dtype=torch.bool)
        pad[0, -2:] = True  # the first sequence ends with 2 pad tokens
        kw["key_padding_mask"] = pad
    if kind in ("causal", "causal+padding", "all"):
        kw["is_causal"] = True
    return kw


def to_device(kw: dict, device: torch.device) -> dict:
    """Keyword arguments with every tensor moved to ``device`` (a no-op on the CPU)."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kw.items()}


# -- the device -----------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        metavar="DEVICE",
        help=f"run the parity, check, KV-cache and generation tests on DEVICE (cpu, cuda, cuda:N or mps); "
        f"overrides ${DEVICE_VARIABLE}; default cpu",
    )


def available_devices() -> list[str]:
    """The device names this torch build can run on now."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def resolve_test_device(option: str | None, environ: Mapping[str, str]) -> torch.device:
    """The device named by ``--device`` or else ``$ATTNLAB_TEST_DEVICE`` (cpu when neither is set).

    Raises ValueError with one sentence naming the setting, its value, what this machine has, and the fix.
    """
    if option:
        name, named = option, f"--device {option!r}"
        fix = "pass --device with one of those, or leave it out to test on cpu"
    else:
        name = environ.get(DEVICE_VARIABLE) or "cpu"
        named = f"{DEVICE_VARIABLE}={name!r}"
        fix = f"set {DEVICE_VARIABLE} to one of those, or unset it to test on cpu"
    build = "a CPU-only build" if torch.version.cuda is None else f"a CUDA {torch.version.cuda} build"
    has = f"this machine's torch {torch.__version__} ({build}) has {', '.join(available_devices())}"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"{named} is not a torch device name: {has}; {fix}.") from None
    if device.type != "cpu" and str(device) not in available_devices():
        raise ValueError(f"{named} names a device this machine cannot use: {has}; {fix}.")
    return device


def pytest_sessionstart(session: pytest.Session) -> None:
    """Checked once, before collection: a wrong device stops the run with exit code 4 (usage error)."""
    try:
        device = resolve_test_device(session.config.getoption("--device"), os.environ)
    except ValueError as e:
        pytest.exit(str(e), returncode=pytest.ExitCode.USAGE_ERROR)
    session.config.stash[_DEVICE] = device


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """The device under test: build modules and inputs as before, then ``.to(device)``."""
    return pytestconfig.stash[_DEVICE]


def cpu_only_skip_reason(device: torch.device, reasons: list[str | None]) -> str | None:
    """Why a test marked ``cpu_only(reason)`` is skipped on ``device`` (None: it runs)."""
    if not reasons or not all(isinstance(r, str) and r for r in reasons):
        raise ValueError(f"@pytest.mark.cpu_only needs a reason, got {reasons!r}; write @pytest.mark.cpu_only('why').")
    return None if device.type == "cpu" else f"CPU only ({device} under test): {'; '.join(reasons)}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A skip marker on each ``cpu_only`` test when the device is not the CPU (reported at the test); the files in
    the order of tests/durations.json, longest first (see :func:`_longest_first`)."""
    _longest_first(items)
    for item in items:
        reasons = [m.args[0] if m.args else m.kwargs.get("reason") for m in item.iter_markers("cpu_only")]
        try:
            skip = cpu_only_skip_reason(config.stash[_DEVICE], reasons) if reasons else None
        except ValueError as e:
            raise pytest.UsageError(f"{item.nodeid}: {e}") from None
        if skip:
            item.add_marker(pytest.mark.skip(reason=skip))


def _longest_first(items: list[pytest.Item]) -> None:
    """Sort ``items`` by their file's seconds in tests/durations.json, longest first (a file not listed last; each
    file's tests keep their order). `make test` passes ``--no-loadscope-reorder``, so its two workers take files in
    this order: a long file then starts early instead of running alone at the end, which xdist's own order (most
    tests first) did with test_smollm2.py's 5 tests of 41 s. scripts/test_durations.py rewrites the file."""
    path = Path(__file__).with_name("durations.json")
    seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


@pytest.fixture
def device_with_float64(device: torch.device) -> torch.device:
    """``device`` for a test that computes in float64 (a float64 reference, gradcheck): skipped on
    MPS, which has no float64."""
    if device.type == "mps":
        pytest.skip("mps has no float64, which this test computes in")
    return device


# -- low precision --------------------------------------------------------------------------------
def _max_err(got: Tensor, reference: Tensor) -> float:
    return (got.double() - reference.double()).abs().max().item()


def low_precision_tol(plain: Tensor, reference: Tensor, floor: float = LOW_PRECISION_FLOOR) -> float:
    """flash-attention's rule, as ``attnlab check`` applies it (attnlab.check.suite): in fp16/bf16 a
    kernel's max abs error against a float64 ``reference`` may be at most twice the error of
    ``plain`` PyTorch attention run in the same low precision, plus a small absolute ``floor`` so
    that two near-zero errors do not fail on noise."""
    return LOW_PRECISION_FACTOR * _max_err(plain, reference) + floor


def assert_low_precision_close(
    got: Tensor, plain: Tensor, reference: Tensor, *, floor: float = LOW_PRECISION_FLOOR, name: str = "output"
) -> None:
    """``got`` within :func:`low_precision_tol` of ``reference``; the message gives both errors."""
    err, plain_err = _max_err(got, reference), _max_err(plain, reference)
    tol = low_precision_tol(plain, reference, floor)
    assert err <= tol, f"{name}: error {err:.2e} > {LOW_PRECISION_FACTOR:g} x plain {plain_err:.2e} + {floor:g}"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from 2 threads, and OpenMP threads spinning against another
    process's on the same 2 cores slow a step 20-40x (measured): one thread keeps tests steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the documentation site -------------------------------------------------------------------------
@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The documentation site built once (``mkdocs build --strict``) for every docs test: its directory
    and the build's log (stdout and stderr together). Skipped, with the install command, without the
    ``docs`` extra."""
    from docs_site import DOCS_INSTALL, build_site, missing_docs_modules

    missing = missing_docs_modules()
    if missing:
        pytest.skip(f"the docs extra is not installed (no {', '.join(missing)}): {DOCS_INSTALL}")
    # Under pytest-xdist the docs test files may run on different workers; they share one build (about a
    # minute of CPU; 12 min of wall on 2 cores under load 14) through the session's common temp directory,
    # the first worker building it while the other waits on the lock.
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    site, log_file = shared / "docs-site", shared / "docs-site.log"
    with FileLock(str(shared / "docs-site.lock")):
        if not log_file.is_file():
            log_file.write_text(build_site(site))
    return site, log_file.read_text()


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (the scripts folder is not a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
