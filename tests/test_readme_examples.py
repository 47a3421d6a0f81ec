"""Every example in README.md runs as written.

README.md is read when the tests run, so a renamed flag breaks this test, not a reader. What counts
as an example:

* each line of a ```` ```bash ```` block (``&&`` chains run in order; ``# comments`` dropped);
* each ``$ command`` line of any other non-Python block; when the lines after it start with
  ``attnlab: error:``, they are the command's documented error: it must exit 2 printing exactly that;
* each inline code span of the prose that is an ``attnlab`` command with at least one flag and no
  placeholder (``--checkpoint DIR`` is syntax, not an example);
* each ```` ```python ```` block, run with :data:`STAND_INS` for the names it uses without defining
  them (``torch_mha``, ``hf_model``, ``x``, ...).

The commands run in README order in one scratch directory, as a reader pasting them would (the
generate example reads the demo's ``runs/demo/model``), through ``attnlab.cli.main`` in-process;
``torchrun`` in a subprocess. Where a command as written takes minutes, :data:`SMALL` adds or
shrinks flags (documented there, one line each); nothing else is changed. Skipped, each with the
reason printed: commands that need a GPU (none on this machine) or the network (``make`` creates
``.venv`` with pip); ``make demo`` runs what it wraps, ``attnlab demo``.

``ATTNLAB_README=path/to/draft.md pytest tests/test_readme_examples.py`` runs a draft instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.cli import main
from smollm2_fixtures import attnlab_smollm2  # imported before any patch: it binds the real loader

ROOT = Path(__file__).resolve().parents[1]
README = Path(os.environ.get("ATTNLAB_README", ROOT / "README.md"))  # another file: try a README edit before saving it

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@dataclasses.dataclass(frozen=True)
class Example:
    line: int  # 1-based line of README.md
    argv: tuple[str, ...]  # the command as written
    expected_error: str | None = None  # documented `attnlab: error: ...` output, if any

    @property
    def id(self) -> str:
        text = re.sub(r"[^\w.=:/|-]+", "_", " ".join(self.argv))
        return f"L{self.line}-{text[:70]}"


def _commands(line: str) -> list[list[str]]:
    """The commands of one shell line: comments dropped, ``&&`` chains split."""
    words = shlex.split(line, comments=True)
    out: list[list[str]] = [[]]
    for w in words:
        if w == "&&":
            out.append([])
        else:
            out[-1].append(w)
    return [c for c in out if c]


def parse_readme(text: str) -> tuple[list[Example], list[tuple[int, str]]]:
    """``(commands, python blocks)`` in README order; commands deduplicated (first kept)."""
    lines = text.splitlines()
    commands: list[Example] = []
    python: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []  # (line, text) outside fences, for inline code spans
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        lang, start = fence.group(1), i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
        body = lines[start:end]
        if lang == "python":
            python.append((start + 1, "\n".join(body)))
        elif lang in ("bash", "sh", "shell", "console"):
            for k, ln in enumerate(body):
                ln = ln.removeprefix("$ ")
                commands += [Example(start + k + 1, tuple(c)) for c in _commands(ln)]
        else:
            for k, ln in enumerate(body):
                if ln.startswith("$ "):
                    after = []
                    for nxt in body[k + 1 :]:
                        if nxt.startswith("$ "):
                            break
                        after.append(nxt)
                    error = "\n".join(after) if after and after[0].startswith("attnlab: error:") else None
                    commands += [Example(start + k + 1, tuple(c), error) for c in _commands(ln[2:])]
        i = end + 1
    # inline spans, possibly broken over two lines of prose: `attnlab train --data.task random ...`
    joined = "\n".join(t for _, t in prose)
    starts = [n for n, _ in prose]
    for m in re.finditer(r"`(attnlab [^`]*--[^`]*)`", joined):
        line = starts[joined.count("\n", 0, m.start())]
        for c in _commands(" ".join(m.group(1).split())):
            if not any(re.fullmatch(r"[A-Z][A-Z_]+", w) for w in c):  # `--checkpoint DIR`: syntax, not an example
                commands.append(Example(line, tuple(c)))
    commands.sort(key=lambda e: e.line)
    seen: set[tuple[str, ...]] = set()
    unique = []
    for e in commands:
        if e.argv not in seen:
            seen.add(e.argv)
            unique.append(e)
    return unique, python


# ---- small settings ----------------------------------------------------------------------------
# What is added to (or shrunk in) a command that takes long as written; nothing else changes.
# attnlab train              --steps 20 (400 by default; a larger --steps N in the README becomes 20)
# torchrun ... attnlab train  the same, plus OMP_NUM_THREADS=1 per process
# attnlab ablate-heads       --train.steps 10 --heads 1 2 (500 steps x 4 head counts x 3 seeds by default)
# attnlab check              --checks parity_self no_causal_leak (24 checks per backend by default)
# attnlab bench              --lengths 64 --repeats 1 --warmup 0 --no-memory --no-train --gemm-size 256
# attnlab bench-decode       --contexts 16 --repeats 1 --no-hf, and 4 new tokens
# attnlab doctor             --no-compile (compiling a function takes ~10 s)
# make demo                  runs `attnlab demo` (make itself first creates .venv with pip: network)


def _cap_steps(argv: list[str], flag: str, n: int) -> list[str]:
    if flag in argv:
        i = argv.index(flag) + 1
        argv[i] = str(min(int(argv[i]), n))
        return argv
    return [*argv, flag, str(n)]


def _add(*flags: str) -> Callable[[list[str]], list[str]]:
    def add(argv: list[str]) -> list[str]:
        extra = [f for f in flags if not f.startswith("--") or f.split()[0] not in argv]
        return argv + [w for f in extra for w in f.split()]

    return add


def _bench_decode(argv: list[str]) -> list[str]:
    help_text = _help("bench-decode")
    new_tokens = "--max-new-tokens" if "--max-new-tokens" in help_text else "--new-tokens"
    return _add("--contexts 16", "--repeats 1", "--no-hf", f"{new_tokens} 4")(argv)


def _help(command: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return buf.getvalue()


SMALL: dict[str, Callable[[list[str]], list[str]]] = {
    "train": lambda argv: _cap_steps(argv, "--steps", 20),
    "ablate-heads": lambda argv: _add("--heads 1 2")(_cap_steps(argv, "--train.steps", 10)),
    "check": _add("--checks parity_self no_causal_leak"),
    "bench": _add("--lengths 64", "--repeats 1", "--warmup 0", "--no-memory", "--no-train", "--gemm-size 256"),
    "bench-decode": _bench_decode,
    "doctor": _add("--no-compile"),
}

# Files the README's commands read, written into the scratch directory first.
FILES = {
    "book.txt": "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40,
    "mine.py": (ROOT / "tests" / "mistake_corpus" / "seed002_as_published.py").read_text(),  # seed 002's module
    "mypkg/__init__.py": "",
    "mypkg/layers.py": (
        "from attnlab import MultiHeadAttention\n\n\n"
        "def make_attention(embed_dim, num_heads, dropout=0.0):\n"
        "    return MultiHeadAttention(embed_dim, num_heads, dropout=dropout)\n"
    ),
}


def _stand_ins() -> dict[str, object]:
    """Names the README's Python blocks use without defining them, bound to small real objects."""
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    import attnlab
    from attnlab import MultiHeadAttention

    ns: dict[str, object] = {"torch": torch, "nn": nn, **{n: getattr(attnlab, n) for n in attnlab.__all__}}
    ns["torch_mha"] = nn.MultiheadAttention(64, 8)  # torch's default: sequence-first
    ns["mha"] = ns["model"] = MultiHeadAttention(64, 8)
    ns["x"] = torch.randn(2, 10, 64)  # (B, T, E)
    ns["query"] = ns["key"] = ns["value"] = torch.randn(10, 2, 64)  # (T, B, E), torch's layout
    ns["pad"] = torch.zeros(2, 10, dtype=torch.bool)  # (B, S), True = padding
    ns["prompt"], ns["next_tok"] = torch.randn(1, 6, 64), torch.randn(1, 1, 64)  # (B, T, E)
    ns["hf_model"] = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=128, bos_token_id=None, eos_token_id=None)
    ).eval()
    ns["idx"] = torch.randint(0, 64, (1, 5))  # (B, T) token ids of hf_model's vocabulary
    return ns


STAND_INS = sorted(set(_stand_ins()) - {"torch", "nn"})  # documented in the module docstring
COMMANDS, PYTHON_BLOCKS = parse_readme(README.read_text(encoding="utf-8"))


def _skip_reason(argv: tuple[str, ...]) -> str | None:
    if argv[0] == "make":
        if argv[1:] == ("demo",):
            return None
        if argv[1:] == ("test",):
            return "`make test` runs this very suite: it would run itself"
        return f"`{' '.join(argv)}` sets up .venv with pip, outside a test's reach"
    if argv[0] not in ("attnlab", "torchrun"):
        return f"not an attnlab command: {argv[0]}"
    wants_gpu = any(a.startswith("cuda") for a in argv) or "nccl" in argv
    if wants_gpu and not torch.cuda.is_available():
        return "needs a CUDA GPU; this machine has none"
    return None


class Session:
    """Runs the README's commands in order in one scratch directory, each once, lazily: a test of the
    N-th command first runs every command before it (its prerequisites, as for a reader)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.results: dict[int, tuple[int, str, str]] = {}  # index -> (exit code, stdout, stderr)
        for name, content in FILES.items():
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            (workdir / name).write_text(content)

    def result(self, index: int, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
        for i in range(index + 1):
            if i not in self.results and _skip_reason(COMMANDS[i].argv) is None:
                self.results[i] = self._run(COMMANDS[i].argv, capsys)
        return self.results[index]

    def _run(self, argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
        args = ["demo"] if argv[0] == "make" else list(argv[1:])
        if argv[0] == "torchrun":
            at = args.index("attnlab") + 1  # torchrun [its flags] -m attnlab <command> [flags]
            small = SMALL.get(args[at], lambda a: a)(args[at:])
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
            cmd = [sys.executable, "-m", "torch.distributed.run", *args[:at], *small]
            done = subprocess.run(cmd, cwd=self.workdir, env=env, capture_output=True, text=True, timeout=300)
            return done.returncode, done.stdout, done.stderr
        args = SMALL.get(args[0], lambda a: a)(args)
        capsys.readouterr()
        try:
            rc = main(args)
        except SystemExit as e:  # tyro's own usage errors exit 2
            rc = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return rc, out, err


def _one_smollm2(real: Callable[..., Any]) -> Callable[..., Any]:
    """``from_pretrained`` with ``"smollm2"`` (fp32, CPU) served from one loaded copy: the README
    runs several ``--model smollm2`` commands, and each load costs ~10 s on 2 cores."""

    def from_pretrained(source: object, **kwargs: Any) -> Any:
        on_cpu = torch.device(kwargs.get("device") or "cpu").type == "cpu"
        if source == "smollm2" and on_cpu and kwargs.get("dtype", torch.float32) == torch.float32:
            return attnlab_smollm2()
        return real(source, **kwargs)

    return from_pretrained


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from attnlab.models import pretrained

    workdir = tmp_path_factory.mktemp("readme")
    cwd, path = os.getcwd(), list(sys.path)
    os.chdir(workdir)
    patch = pytest.MonkeyPatch()
    patch.setattr(pretrained, "from_pretrained", _one_smollm2(pretrained.from_pretrained))
    try:
        yield Session(workdir)
    finally:
        patch.undo()
        os.chdir(cwd)
        sys.path[:] = path
        sys.modules.pop("mypkg.layers", None)
        sys.modules.pop("mypkg", None)


def test_the_parser_finds_the_readme_examples():
    """Guards the parser, not the README's content: a README whose examples it missed would pass vacuously."""
    subcommands = {e.argv[1] for e in COMMANDS if e.argv[0] == "attnlab" and len(e.argv) > 1}
    assert len(COMMANDS) >= 5 and {"train", "generate"} <= subcommands
    assert any(e.expected_error for e in COMMANDS) and len(PYTHON_BLOCKS) >= 3


def test_the_parser_reads_every_form():
    text = (
        "Run `attnlab train --steps 5\n--seed 1` or `attnlab doctor` or `attnlab generate --checkpoint DIR`.\n"
        "```bash\nattnlab train --out-dir 'a b'   # a comment\nmake demo && attnlab trace\n```\n"
        "```\n$ attnlab generate --checkpoint nowhere\nattnlab: error: no such thing\n$ attnlab trace\n```\n"
        "```python\nprint(1)\n```\n"
    )
    commands, python = parse_readme(text)
    assert [(e.line, e.argv, e.expected_error) for e in commands] == [
        (1, ("attnlab", "train", "--steps", "5", "--seed", "1"), None),  # the other two: a name, and syntax
        (4, ("attnlab", "train", "--out-dir", "a b"), None),
        (5, ("make", "demo"), None),
        (5, ("attnlab", "trace"), None),
        (8, ("attnlab", "generate", "--checkpoint", "nowhere"), "attnlab: error: no such thing"),
    ]  # the second `attnlab trace` is the first one again
    assert python == [(13, "print(1)")]


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[e.id for e in COMMANDS])
def test_readme_command_runs(session, capsys, index):
    example = COMMANDS[index]
    reason = _skip_reason(example.argv)
    if reason:
        pytest.skip(reason)
    rc, out, err = session.result(index, capsys)
    where = f"README.md line {example.line}: {shlex.join(example.argv)}"
    if example.expected_error is not None:
        assert (rc, err.rstrip("\n")) == (2, example.expected_error), f"{where}\n{err}"
    else:
        errors = "\n".join(dict.fromkeys(ln.strip() for ln in (out + err).splitlines() if "error:" in ln))
        assert rc == 0, (
            f"{where} exited {rc}\n{errors}\n--- stdout (end)\n{out[-1500:]}\n--- stderr (end)\n{err[-1500:]}"
        )


@pytest.mark.parametrize("line, code", PYTHON_BLOCKS, ids=[f"L{n}" for n, _ in PYTHON_BLOCKS])
def test_readme_python_block_runs(line, code):
    namespace = _stand_ins()
    try:
        exec(compile(code, f"README.md (python block at line {line})", "exec"), namespace)
    except NameError as e:
        pytest.fail(
            f"README.md python block at line {line}: {e}; add a stand-in to STAND_INS or define it in the block"
        )
