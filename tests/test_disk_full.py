"""A full disk (issue 39, point 3): refused before work with the figures, or one line at the write that found it,
with nothing half-written and the previous checkpoint intact.

Two ways to fill a disk: a real 2 MiB tmpfs where this machine lets the suite mount one (root; skipped
elsewhere), and an injected ``OSError(ENOSPC)`` at one write site at a time, which always runs. The
injection fails the ``fsync`` of an atomic write (where ext4 and NFS report a full disk for data already
"written"), or a ``write`` part-way through a metrics line (where a tmpfs fails: the page is full).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.cli import main
from attnlab.lab.train_state import CKPT_NAME, read_meta
from attnlab.runtime import (
    DiskFullError,
    UsageError,
    append_whole,
    atomic_write_bytes,
    check_writable_dir,
    disk,
    files,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

# a run of ~0.3 s: 4 steps of a 1-layer, 16-wide TinyGPT on 4-symbol copies, checkpoints at steps 2 and 4
TINY = (
    "--data.batch-size 8 --data.copy-len 4 --model.num-layers 1 --model.embed-dim 16 --steps 4 --eval-every 2 "
    "--ckpt-every 2 --no-progress"
).split()
TRAIN = sys.modules["attnlab.lab.train"]  # the module (attnlab.lab.train is also the function's name)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def fail_fsync(monkeypatch: pytest.MonkeyPatch, name: str, nth: int = 1) -> list[str]:
    """From the ``nth`` on, an ``fsync`` of a file whose path holds ``name`` fails with ENOSPC; returns their paths."""
    real, seen = os.fsync, []

    def fsync(fd: int) -> None:
        path = _fd_path(fd)
        if name in path:
            seen.append(path)
            if len(seen) >= nth:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def fail_write(monkeypatch: pytest.MonkeyPatch, name: str, nth: int, written: int) -> None:
    """The ``nth`` ``os.write`` to a file whose path ends with ``name`` writes ``written`` bytes, and the next fails."""
    real, calls = os.write, []

    def write(fd: int, data: bytes) -> int:
        if _fd_path(fd).endswith(name):
            calls.append(len(data))
            if len(calls) == nth:
                return real(fd, bytes(data)[:written])
            if len(calls) == nth + 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def _train(capsys: pytest.CaptureFixture[str], out: Path, *extra: str) -> tuple[int, str]:
    code = main(["train", *TINY, *extra, "--out-dir", str(out)])
    return code, capsys.readouterr().err


def _leftovers(directory: Path) -> list[str]:
    """Temp files and staging directories of the writes (any ``.*.tmp``)."""
    return sorted(p.name for p in directory.rglob(".*.tmp"))


def _whole_lines(path: Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"metrics.jsonl ends in half a line: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def _resume_command(err: str) -> list[str]:
    return shlex.split(re.search(r"resume with `attnlab (.+?)`", err).group(1))


# -- the three doors: each write is whole or absent, and a full disk is one DiskFullError --------------------------


def test_an_append_refused_part_way_is_cut_back_to_the_line_before(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n')
    fail_write(monkeypatch, "metrics.jsonl", nth=1, written=5)  # 5 bytes land, then the disk is full
    with pytest.raises(DiskFullError) as info:
        append_whole(path, b'{"step": 2, "loss": 1.0}\n')
    assert path.read_text() == '{"step": 1}\n'
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert re.fullmatch(
        rf"no space left on device while writing metrics\.jsonl \(25 B\) to {re.escape(repr(str(tmp_path)))}: "
        r"\d+\.\d [KMGT]iB free there \(shutil\.disk_usage\); free space there, or write to another directory",
        str(info.value),
    ), str(info.value)


def test_an_atomic_write_refused_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("old")
    fail_fsync(monkeypatch, "summary.json")
    with pytest.raises(DiskFullError, match=r"^no space left on device while writing summary\.json \(3 B\) to "):
        atomic_write_bytes(path, b"new")
    assert path.read_text() == "old" and _leftovers(tmp_path) == []


def test_the_write_probe_writes_real_bytes_so_a_full_disk_fails_it(tmp_path, monkeypatch):
    sizes: list[int] = []
    real = os.write

    def write(fd: int, data: bytes) -> int:
        if ".attnlab-write-probe-" in _fd_path(fd):
            sizes.append(len(data))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(UsageError) as info:
        check_writable_dir(tmp_path / "out", "--out-dir")
    assert sizes == [files.PROBE_BYTES] and files.PROBE_BYTES >= 4096
    assert re.fullmatch(
        rf"--out-dir {re.escape(repr(str(tmp_path / 'out')))} cannot be written \(No space left on device, "
        r"\d+\.\d [KMGT]iB free there\); free space there, or pass another --out-dir\.",
        str(info.value),
    )
    assert [p.name for p in (tmp_path / "out").iterdir()] == []  # the probe is gone too


def test_a_saved_model_directory_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    from attnlab import GPTConfig, TinyGPT, load_checkpoint, save_checkpoint

    model = TinyGPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=8))
    seen = fail_fsync(monkeypatch, "config.json")  # the second file of the two: the first is already written
    with pytest.raises(DiskFullError, match=r"^no space left on device while writing model/ \("):
        save_checkpoint(model, tmp_path / "model")
    assert seen and not (tmp_path / "model").exists() and _leftovers(tmp_path) == []
    monkeypatch.undo()
    save_checkpoint(model, tmp_path / "model")  # into an existing directory: both files replaced, or neither
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    torch.nn.init.zeros_(next(model.parameters()))
    fail_fsync(monkeypatch, "config.json")
    with pytest.raises(DiskFullError):
        save_checkpoint(model, tmp_path / "model")
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before
    monkeypatch.undo()
    load_checkpoint(tmp_path / "model")


# -- attnlab train: every write site, one at a time --------------------------------------------------------------


@pytest.mark.parametrize(
    ("site", "fail", "kept"),
    [
        ("config.json", "fsync", r"the run stopped at step 0 of 4, before its first checkpoint; free space there, "),
        ("metrics.jsonl", "write", r"the checkpoint of step 2 of 4, .+, is intact and step 3 since it is lost; "),
        (CKPT_NAME, "fsync", r"the checkpoint of step 2 of 4, .+, is intact and steps 3-4 since it are lost; "),
        ("curve.png", "fsync", r"the checkpoint of step 4 of 4, .+, is intact and training is complete \(resuming "),
        ("model.safetensors", "fsync", r"the checkpoint of step 4 of 4, .+, is intact and training is complete "),
        ("summary.json", "fsync", r"the checkpoint of step 4 of 4, .+, is intact and training is complete "),
    ],
)
def test_a_full_disk_at_each_write_of_train_is_one_line_and_loses_nothing_saved(
    site, fail, kept, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "run"
    if fail == "write":  # the 4th line (step 3): half of it lands, then the disk is full
        fail_write(monkeypatch, site, nth=4, written=20)
    else:
        fail_fsync(monkeypatch, site, nth=2 if site == CKPT_NAME else 1)  # the checkpoint of step 4, not of step 2
    code, err = _train(capsys, out)
    what = "model/" if site == "model.safetensors" else re.escape(site)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.match(
        rf"attnlab: error: no space left on device while writing {what} \(\d+(\.\d)? (B|KiB)\) to "
        rf"{re.escape(repr(str(out)))}: \d+\.\d [KMGT]iB free there \(shutil\.disk_usage\); {kept}",
        err,
    ), err
    if site == "config.json":  # a run that failed before step 1 leaves nothing that blocks its rerun
        assert err.rstrip().endswith(f"--out-dir {out}`") and not (out / "config.json").exists()
        return
    assert _leftovers(out) == [] and (out / "model").exists() == (site == "summary.json")
    assert [r["step"] for r in _whole_lines(out / "metrics.jsonl")][-1] == (2 if site == "metrics.jsonl" else 4)
    assert read_meta(out / CKPT_NAME)["step"] == (2 if site in ("metrics.jsonl", CKPT_NAME) else 4)
    monkeypatch.undo()  # space freed: the printed command finishes the run
    assert main(_resume_command(err)) == 0
    assert (out / "model" / "model.safetensors").is_file() and (out / "summary.json").is_file()
    assert [r["step"] for r in _whole_lines(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_the_run_resumed_after_a_full_disk_ends_bit_equal_to_one_never_stopped(tmp_path, capsys, monkeypatch):
    assert main(["train", *TINY, "--out-dir", str(tmp_path / "straight")]) == 0
    fail_fsync(monkeypatch, CKPT_NAME, nth=2)
    code, err = _train(capsys, tmp_path / "stopped")
    assert code == 1
    monkeypatch.undo()
    assert main(_resume_command(err)) == 0
    straight = load_file(str(tmp_path / "straight" / "model" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "stopped" / "model" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_a_resumed_process_does_not_keep_the_replaced_checkpoint_mapped(tmp_path, capsys):
    """Loading reads the checkpoint into memory: a mapping would hold the old file's blocks after the next save
    (``checkpoint.safetensors (deleted)`` in /proc/PID/maps), so a resume needed 3x the checkpoint on disk."""
    from attnlab.lab.config import load_config
    from attnlab.lab.data import build_task
    from attnlab.lab.models import build_model
    from attnlab.lab.train_state import load_train_state, save_train_state

    out = tmp_path / "run"
    assert main(["train", *TINY, "--out-dir", str(out)]) == 0
    cfg = load_config(out / "config.json")
    task = build_task(cfg.data)
    model = build_model(cfg.model, task.vocab_size, task.block_size + 1)
    groups = [[p for p in model.parameters() if p.dim() >= 2], [p for p in model.parameters() if p.dim() < 2]]
    optimizer = torch.optim.AdamW([{"params": g} for g in groups])
    assert load_train_state(out / CKPT_NAME, model, optimizer) == 4

    def mapped() -> list[str]:
        return [line.strip() for line in Path("/proc/self/maps").read_text().splitlines() if str(out) in line]

    assert mapped() == []
    save_train_state(out / CKPT_NAME, model, optimizer, 4, json.loads((out / "config.json").read_text()))
    assert mapped() == []


# -- before any work: the free space against what the command will write ---------------------------------------


def _little_space(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(disk, "free_bytes", lambda path: free)


def test_train_refuses_a_disk_without_room_for_two_checkpoints_and_its_files(tmp_path, capsys, monkeypatch):
    _little_space(monkeypatch, 100 * 1024)
    out = tmp_path / "run"
    code, err = _train(capsys, out, "--model.embed-dim", "64")
    assert code == 2
    assert re.fullmatch(
        rf"attnlab: error: --out-dir {re.escape(repr(str(out)))} has 100\.0 KiB free \(shutil\.disk_usage\) but this "
        r"run writes about \d+\.\d [KM]iB there \(checkpoint\.safetensors x 2 \(old and new while saving\) \d+\.\d [KM]iB, "
        r"model/ \d+\.\d KiB, metrics\.jsonl \d+\.\d KiB, curve\.png and the small files 512\.0 KiB\); free "
        r"\d+\.\d [KM]iB or more there, or pass another --out-dir\.\n",
        err,
    ), err
    assert not (out / "config.json").exists()


def test_the_estimate_covers_what_a_run_writes(tmp_path):
    """The disk estimate is at least what a finished run holds, plus the second checkpoint of a save."""
    from attnlab.lab.config import load_config
    from attnlab.lab.data import build_task
    from attnlab.lab.footprint import train_footprint

    out = tmp_path / "run"
    assert main(["train", *TINY, "--out-dir", str(out)]) == 0
    cfg = load_config(out / "config.json")
    task = build_task(cfg.data)
    estimate = train_footprint(cfg, task.vocab_size, task.block_size).disk
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert sum(estimate.values()) >= written + (out / CKPT_NAME).stat().st_size
    checkpoint = next(n for k, n in estimate.items() if k.startswith("checkpoint")) // 2
    assert checkpoint >= (out / CKPT_NAME).stat().st_size  # each of the two copies


def test_bench_and_inspect_and_ablate_check_the_space_first(tmp_path, capsys, monkeypatch):
    _little_space(monkeypatch, 1000)
    assert main(["bench", "--lengths", "8", "--tokens", "8", "--out-dir", str(tmp_path / "b")]) == 2
    assert re.fullmatch(
        rf"attnlab: error: --out-dir {re.escape(repr(str(tmp_path / 'b')))} has 1000 B free \(shutil\.disk_usage\) "
        r"but bench writes about 1\.0 MiB there \(bench_attention\.json, \.md, \.png 1\.0 MiB\); free 1023\.0 KiB or "
        r"more there, or pass another --out-dir\.\n",
        capsys.readouterr().err,
    )
    assert main(["ablate-heads", "--train.steps", "4", "--out-dir", str(tmp_path / "a")]) == 2
    assert re.match(
        rf"attnlab: error: --out-dir {re.escape(repr(str(tmp_path / 'a')))} has 1000 B free \(shutil\.disk_usage\) "
        r"but this study \(12 runs to do\) writes about ",
        capsys.readouterr().err,
    )
    assert not (tmp_path / "a" / "config.json").exists()


def test_inspect_checks_the_room_for_its_result_before_the_model_runs(tmp_path, capsys, monkeypatch):
    from attnlab.tools import inspect_cli

    run = tmp_path / "run"
    assert main(["train", *TINY, "--out-dir", str(run)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(inspect_cli, "inspect", lambda *a, **k: pytest.fail("the model ran"))
    _little_space(monkeypatch, 1000)
    assert main(["inspect", "--checkpoint", str(run), "--out-dir", str(tmp_path / "i")]) == 2
    assert re.match(
        rf"attnlab: error: --out-dir {re.escape(repr(str(tmp_path / 'i')))} has 1000 B free \(shutil\.disk_usage\) "
        r"but inspect writes about \d+\.\d MiB there \(heads\.json \d+\.\d KiB, heads\.png 1\.0 MiB, index\.html ",
        capsys.readouterr().err,
    )


def test_a_bench_result_file_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch):
    fail_fsync(monkeypatch, "bench_attention.png")
    args = "--lengths 8 --tokens 8 --runners attnlab floor --repeats 1 --warmup 0 --gemm-size 8 --no-memory --no-train"
    assert main(["bench", *args.split(), "--out-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"attnlab: error: no space left on device while writing bench_attention\.png \(\d+\.\d KiB\) to "
        rf"{re.escape(repr(str(tmp_path)))}: \d+\.\d [KMGT]iB free there \(shutil\.disk_usage\); free space there, "
        r"or write to another directory\n",
        err,
    ), err
    assert _leftovers(tmp_path) == [] and not (tmp_path / "bench_attention.png").exists()


# -- a real full disk: a 2 MiB tmpfs -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 2 MiB tmpfs at ``tmp_path / "disk"``; skipped where this process may not mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` until ``leave`` bytes are free."""
    st = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave)))


def test_a_default_run_is_refused_by_a_2_mib_disk_before_it_writes(small_disk, capsys):
    code, err = _train(capsys, small_disk / "run", "--model.embed-dim", "64", "--steps", "400")
    assert code == 2 and "has 2.0 MiB free (shutil.disk_usage) but this run writes about " in err, err
    assert not (small_disk / "run" / "config.json").exists()


def test_a_full_disk_is_caught_by_the_probe_before_work(small_disk, capsys):
    _fill(small_disk, 0)
    code, err = _train(capsys, small_disk / "run")
    assert code == 2 and err.startswith(f"attnlab: error: --out-dir '{small_disk / 'run'}' cannot be written (No space")
    assert err.endswith("free there); free space there, or pass another --out-dir.\n"), err


def test_metrics_on_a_disk_that_fills_up_mid_run_keep_whole_lines(small_disk, capsys, monkeypatch):
    monkeypatch.setattr(TRAIN, "check_train_fits", lambda *a, **k: None)  # past the estimate, to fill up mid-run
    _fill(small_disk, 12 * 1024)  # config.json's page, then metrics.jsonl fills its pages at some step
    code, err = _train(capsys, small_disk / "run", "--steps", "60", "--ckpt-every", "0", "--eval-every", "30")
    assert code == 1 and "no space left on device while writing metrics.jsonl (" in err, err
    lines = _whole_lines(small_disk / "run" / "metrics.jsonl")
    assert 0 < len(lines) < 61 and [r["step"] for r in lines] == list(range(len(lines)))
    assert _leftovers(small_disk) == []


def test_a_full_disk_in_a_study_says_what_its_run_kept_and_resumes_the_study(tmp_path, capsys, monkeypatch):
    out = tmp_path / "study"
    args = ["ablate-heads", "--heads", "1", "2", "--train.steps", "4", "--train.eval-every", "2"]
    args += ["--train.ckpt-every", "2", "--train.model.embed-dim", "8", "--train.data.n-pairs", "2"]
    args += ["--train.data.batch-size", "8", "--out-dir", str(out)]
    fail_fsync(monkeypatch, CKPT_NAME, nth=2)  # the first run's checkpoint of step 4: the one of step 2 is kept
    assert main(args) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"attnlab: error: no space left on device while writing {CKPT_NAME} \([\d.]+ KiB\) to "
        rf"{re.escape(repr(str(out / 'runs' / 'heads-1-seed-0')))}: [\d.]+ [KMGT]iB free there \(shutil\.disk_usage\); "
        r"run heads=1 seed=0 \(0 of 6 runs finished\): the checkpoint of step 2 of 4, .+, is intact and steps 3-4 "
        rf"since it are lost; free space there, then resume the study with `attnlab ablate-heads --out-dir {out} "
        r"--resume`\n",
        err,
    ), err
    monkeypatch.undo()
    assert main(["ablate-heads", "--out-dir", str(out), "--resume"]) == 0
    assert (out / "ablation.json").is_file()


def test_a_file_size_limit_is_named_as_such(tmp_path):
    """``ulimit -f``: Python ignores SIGXFSZ, so the write fails with EFBIG, said as the limit it is."""
    code = (
        "import resource, sys; from attnlab.runtime import atomic_write_bytes, DiskFullError\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (10000, 10000))\n"
        "try:\n    atomic_write_bytes(sys.argv[1], bytes(20000))\n"
        "except DiskFullError as e:\n    print(e.errno, e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "big.bin")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        f"{errno.EFBIG} the file grew past `ulimit -f` (9.8 KiB) while writing big.bin (19.5 KiB) to {str(tmp_path)!r}: "
    ), done.stdout
    assert done.stdout.rstrip().endswith("; raise the limit (`ulimit -f unlimited`) in the shell that runs attnlab")
    assert list(tmp_path.iterdir()) == []
