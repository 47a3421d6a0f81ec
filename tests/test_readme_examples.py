"""Every example in README.md and on every page of the documentation site runs as written.

The README and the English pages of ``docs/`` (in the site's nav order, then any page outside the
nav) are read when the tests run, so a renamed flag breaks this test, not a reader. The Chinese
twins (``*.zh.md``, ``README.zh-CN.md``) hold the same code blocks (tests/test_docs_site.py and
tests/test_readme_zh.py check that), so they are not run twice. What counts as an example:

* each line of a ```` ```bash ```` block (``&&`` chains run in order; ``# comments`` dropped);
* each ``$ command`` line of any other non-Python block; when the lines after it start with
  ``attnlab: error:``, they are the command's documented error: it must exit 2 printing exactly that;
  when the line after the block says ``Exit code N.`` (a check that finds mistakes exits 1), it must
  exit N;
* each inline code span of the prose that is an ``attnlab`` command with at least one flag and no
  placeholder (``--checkpoint DIR`` is syntax, not an example);
The ```` ```python ```` blocks are run by tests/test_doc_blocks.py, as written (each page's in one
namespace, no name supplied from outside); a docs page's ```` ```python exec="on" ```` blocks by the
site's strict build (tests/test_docs_site.py). A quoted output under ``<!-- output: NAME -->`` is
compared with a fresh run by tests/test_doc_blocks.py; here its command's exit code is checked.

The commands run in reading order (README first) in one scratch directory, as a reader pasting them would (the
generate example reads the demo's ``runs/demo/model``), through ``attnlab.cli.main`` in-process;
``torchrun`` in a subprocess. Where a command as written takes minutes, :data:`SMALL` adds or
shrinks flags (documented there, one line each); nothing else is changed. Skipped, each with the
reason printed: commands that need a GPU (none on this machine) or the network (``make`` creates
``.venv`` with pip); ``make demo`` runs what it wraps, ``attnlab demo``.

``ATTNLAB_README=path/to/draft.md pytest tests/test_readme_examples.py`` runs one file (a draft, or
one page) instead.
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
import yaml

from attnlab.cli import main
from smollm2_fixtures import attnlab_smollm2  # imported before any patch: it binds the real loader

ROOT = Path(__file__).resolve().parents[1]
DRAFT = os.environ.get("ATTNLAB_README")  # one file alone: try an edit before saving it


def _nav_pages(nav: object) -> list[str]:
    """The page paths of mkdocs.yml's nav, in reading order."""
    if isinstance(nav, str):
        return [nav] if nav.endswith(".md") else []
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    if isinstance(nav, list):
        return [p for v in nav for p in _nav_pages(v)]
    return []


def sources() -> list[Path]:
    """README.md, then the English docs pages: the nav's order, then the pages outside it."""
    if DRAFT:
        return [Path(DRAFT).resolve()]
    docs = ROOT / "docs"
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    in_nav = [docs / p for p in _nav_pages(config["nav"])]
    rest = sorted(p for p in docs.rglob("*.md") if not p.name.endswith(".zh.md") and p not in in_nav)
    return [ROOT / "README.md", *in_nav, *rest]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@dataclasses.dataclass(frozen=True)
class Example:
    line: int  # 1-based line of its file
    argv: tuple[str, ...]  # the command as written
    expected_error: str | None = None  # documented `attnlab: error: ...` output, if any
    expected_code: int = 0  # the exit status the page states: 2 with an error, else "Exit code N." or 0
    expected_output: str | None = None  # the stdout the page quotes under a `$ command` line, whole, if any
    source: str = "README.md"  # the file, relative to the repository

    @property
    def id(self) -> str:
        text = re.sub(r"[^\w.=:/|-]+", "_", " ".join(self.argv))
        return f"{_short(self.source)}:L{self.line}-{text[:70]}"


def _short(source: str) -> str:
    return source.removeprefix("docs/").removesuffix(".md")


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
    """``(commands, python blocks)`` of one Markdown file, in its order; commands deduplicated (first kept)."""
    lines = text.splitlines()
    commands: list[Example] = []
    python: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []  # (line, text) outside fences, for inline code spans
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)(.*)$", lines[i])
        if not fence:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, lang, start = fence.group(1), fence.group(2), i + 1
        end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
        body = [ln.removeprefix(indent) for ln in lines[start:end]]
        if re.search(r"\bexec=\"(on|true|1)\"", fence.group(3)):
            pass  # a docs page's markdown-exec block: the site's build runs it and shows its output
        elif lang == "python":
            python.append((start + 1, "\n".join(body)))
        elif lang in ("bash", "sh", "shell", "console"):
            for k, ln in enumerate(body):
                ln = ln.removeprefix("$ ")
                commands += [Example(start + k + 1, tuple(c)) for c in _commands(ln)]
        else:
            # a quoted output under `<!-- output: NAME -->` is compared by tests/test_doc_blocks.py with a fresh
            # run at the page's width; one cut with `...` is not whole
            generated = i > 0 and lines[i - 1].lstrip().startswith("<!-- output:")
            for k, ln in enumerate(body):
                if ln.startswith("$ "):
                    after = []
                    for nxt in body[k + 1 :]:
                        if nxt.startswith("$ "):
                            break
                        after.append(nxt)
                    error = "\n".join(after) if after and after[0].startswith("attnlab: error:") else None
                    code = 2 if error is not None else 0
                    whole = after and error is None and not generated and "..." not in after
                    output = "\n".join(after) if whole else None
                    commands += [Example(start + k + 1, tuple(c), error, code, output) for c in _commands(ln[2:])]
        after_block = next((ln for ln in lines[end + 1 :] if ln.strip()), "")
        stated = re.fullmatch(r"Exit code (\d+)\.", after_block.strip())
        if stated and not lang == "python":
            for k, e in enumerate(commands):
                if e.line > start:
                    commands[k] = dataclasses.replace(e, expected_code=int(stated.group(1)))
        i = end + 1
    # inline spans, possibly broken over two lines of prose: `attnlab train --data.task random ...`
    joined = "\n".join(t for _, t in prose)
    starts = [n for n, _ in prose]
    for m in re.finditer(r"`(attnlab [^`]*--[^`]*)`", joined):
        line = starts[joined.count("\n", 0, m.start())]
        for c in _commands(" ".join(m.group(1).split())):
            if not any(re.fullmatch(r"[A-Z][A-Z_]+(:\w+)?", w) for w in c):  # `--checkpoint DIR`, `FILE:Name`: syntax
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
# attnlab check              --checks parity_self no_causal_leak mask_semantics (24 checks per backend by default)
# attnlab bench              --lengths 64 --repeats 1 --warmup 0 --no-memory --no-train --gemm-size 256
# attnlab bench-decode       --contexts 16 --repeats 1 --no-hf, and 4 new tokens (with --mla: a 1-layer E=64 model, caches of 16 and 32)
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
    if "--mla" in argv:  # the latent-attention model: its own sizes (--mla-config.*), no GPT-2 sweep flags
        return _add(
            "--mla-config.hidden-size 64", "--mla-config.num-heads 4", "--mla-config.kv-lora-rank 16",
            "--mla-config.qk-rope-head-dim 8", "--mla-config.qk-nope-head-dim 8", "--mla-config.v-head-dim 8",
            "--mla-config.num-layers 1", "--mla-config.cache-lens 16 32", "--mla-config.sweep-lens 16",
            "--mla-config.sweep-queries 1", "--repeats 1",
        )(argv)  # fmt: skip
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
    "check": _add("--checks parity_self no_causal_leak mask_semantics"),
    "bench": _add("--lengths 64", "--repeats 1", "--warmup 0", "--no-memory", "--no-train", "--gemm-size 256"),
    "bench-decode": _bench_decode,
    "doctor": _add("--no-compile"),
}

# Files the README's commands read, written into the scratch directory first.
FILES = {
    "book.txt": "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40,
    "mine.py": (ROOT / "tests" / "mistake_corpus" / "seed002_as_published.py").read_text(),  # seed 002's module
    **{  # the mistakes the check pages run `attnlab check --target` on, at the paths they name
        f"tests/mistake_corpus/{f.name}": f.read_text()
        for f in sorted((ROOT / "tests" / "mistake_corpus").glob("*.py"))
    },
    "mypkg/__init__.py": "",
    "mypkg/layers.py": (
        "from attnlab import MultiHeadAttention\n\n\n"
        "def make_attention(embed_dim, num_heads, dropout=0.0):\n"
        "    return MultiHeadAttention(embed_dim, num_heads, dropout=dropout)\n"
    ),
}


def _collect() -> tuple[list[Example], list[tuple[str, int, str]]]:
    """Every file's examples in reading order; a command already run by an earlier file is not rerun."""
    commands: list[Example] = []
    python: list[tuple[str, int, str]] = []
    seen: set[tuple[str, ...]] = set()
    for path in sources():
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        file_commands, file_python = parse_readme(path.read_text(encoding="utf-8"))
        for e in file_commands:
            if e.argv not in seen:
                seen.add(e.argv)
                commands.append(dataclasses.replace(e, source=name))
        python += [(name, line, code) for line, code in file_python]
    return commands, python


COMMANDS, PYTHON_BLOCKS = _collect()


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
    N-th command first runs every command before it (its prerequisites, as for a reader), but the slow
    ones (:func:`_slow`), which `make test` leaves out."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.results: dict[int, tuple[int, str, str]] = {}  # index -> (exit code, stdout, stderr)
        for name, content in FILES.items():
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            (workdir / name).write_text(content)

    def result(self, index: int, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
        for i in range(index + 1):
            if i < index and _slow(COMMANDS[i].argv):
                continue  # a slow command is no one's prerequisite: what it writes, no later command reads
            if i not in self.results and _skip_reason(COMMANDS[i].argv) is None:
                same = self._same_run(i)
                self.results[i] = self.results[same] if same is not None else self._run(COMMANDS[i].argv, capsys)
        return self.results[index]

    def _same_run(self, index: int) -> int | None:
        """An earlier command with the same words whose result this one can take: one that reads no file of
        the scratch directory (a shipped model, not a run folder or a target), so running it again prints the
        same. Three pages quote the same `generate --model smollm2 --chat` question; it runs once."""
        argv = COMMANDS[index].argv
        if "--model" not in argv or any(a in argv for a in ("--out-dir", "--checkpoint", "--target", "--path")):
            return None
        return next((j for j in self.results if COMMANDS[j].argv == argv), None)

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
def one_smollm2():
    """Every ``from_pretrained("smollm2")`` of the examples, the CLI's and ``attnlab.from_pretrained`` in a
    Python block alike, served from one loaded copy (see :func:`_one_smollm2`)."""
    import attnlab
    from attnlab.weight_files import pretrained

    served = _one_smollm2(pretrained.from_pretrained)
    patch = pytest.MonkeyPatch()
    patch.setattr(pretrained, "from_pretrained", served)
    patch.setattr(attnlab, "from_pretrained", served)
    yield
    patch.undo()


@pytest.fixture(scope="module")
def session(tmp_path_factory, one_smollm2):
    workdir = tmp_path_factory.mktemp("readme")
    cwd, path = os.getcwd(), list(sys.path)
    os.chdir(workdir)
    try:
        yield Session(workdir)
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        sys.modules.pop("mypkg.layers", None)
        sys.modules.pop("mypkg", None)


def test_the_parser_finds_the_readme_examples():
    """Guards the parser, not the pages' content: examples it missed would pass vacuously."""
    if DRAFT:
        pytest.skip("ATTNLAB_README names one file; the guard is about the README and the docs together")
    subcommands = {e.argv[1] for e in COMMANDS if e.argv[0] == "attnlab" and len(e.argv) > 1}
    assert len(COMMANDS) >= 5 and {"train", "generate"} <= subcommands
    assert any(e.expected_error for e in COMMANDS) and len(PYTHON_BLOCKS) >= 3


def test_the_parser_reads_every_form():
    text = (
        "Run `attnlab train --steps 5\n--seed 1` or `attnlab doctor` or `attnlab generate --checkpoint DIR`.\n"
        "```bash\nattnlab train --out-dir 'a b'   # a comment\nmake demo && attnlab trace\n```\n"
        "```\n$ attnlab generate --checkpoint nowhere\nattnlab: error: no such thing\n$ attnlab trace\n```\n"
        "```python\nprint(1)\n```\n"
        '```python exec="on" source="above"\nprint(\'the build runs me\')\n```\n'
        "```diff\n+ self.scale = 1 / math.sqrt(embed_dim)\n```\n"
        "```\n$ attnlab check --target m.py:MHA\nFAILED: 1 passed, 1 failed\n```\n\nExit code 1.\n"
        "See `attnlab trace --target FILE:Name --causal`.\n"
        "!!! note\n    ```python\n    print(2)\n    ```\n"
    )
    commands, python = parse_readme(text)
    assert [(e.line, e.argv, e.expected_error, e.expected_code) for e in commands] == [
        (1, ("attnlab", "train", "--steps", "5", "--seed", "1"), None, 0),  # the other two: a name, and syntax
        (4, ("attnlab", "train", "--out-dir", "a b"), None, 0),
        (5, ("make", "demo"), None, 0),
        (5, ("attnlab", "trace"), None, 0),
        (8, ("attnlab", "generate", "--checkpoint", "nowhere"), "attnlab: error: no such thing", 2),
        (22, ("attnlab", "check", "--target", "m.py:MHA"), None, 1),
    ]  # the second `attnlab trace` is the first one again; `FILE:Name` is syntax
    assert [e.expected_output for e in commands] == [None, None, None, None, None, "FAILED: 1 passed, 1 failed"]
    assert python == [(13, "print(1)"), (30, "print(2)")]  # the exec block is the site build's; a diff is not code


def _slow(argv: tuple[str, ...]) -> bool:
    """A command that takes minutes even with :data:`SMALL`'s flags: among the slow tests (``make test-all``)."""
    if argv[1:4] == ("bench", "--variant", "window"):  # compiles flex kernels at each length
        return True
    if argv[0] == "torchrun":  # several processes training on 2 cores; tests/test_lab_context_parallel.py is quick
        return True
    # a full-size run whose quick form is tested elsewhere at small sizes: tests/test_trace_mla.py runs
    # `trace --mla` on both paths, tests/test_bench_decode.py bench-decode's table at several contexts,
    # tests/test_inspect.py inspect's pages on a small model
    if argv[1:3] == ("trace", "--mla") and "--path" not in argv:
        return True
    if argv[1:2] == ("bench-decode",):
        return "--contexts" in argv
    return argv[1:2] == ("inspect",) and "smollm2" in argv


@pytest.mark.parametrize(
    "index",
    [pytest.param(i, marks=[pytest.mark.slow] if _slow(e.argv) else [], id=e.id) for i, e in enumerate(COMMANDS)],
)
def test_readme_command_runs(session, capsys, index):
    example = COMMANDS[index]
    reason = _skip_reason(example.argv)
    if reason:
        pytest.skip(reason)
    rc, out, err = session.result(index, capsys)
    where = f"{example.source} line {example.line}: {shlex.join(example.argv)}"
    if example.expected_error is not None:
        assert (rc, err.rstrip("\n")) == (2, example.expected_error), f"{where}\n{err}"
    else:
        errors = "\n".join(dict.fromkeys(ln.strip() for ln in (out + err).splitlines() if "error:" in ln))
        assert rc == example.expected_code, (
            f"{where} exited {rc}, not {example.expected_code}\n{errors}\n--- stdout (end)\n{out[-1500:]}\n--- stderr (end)\n{err[-1500:]}"
        )
        if example.expected_output is not None and example.argv[1] not in SMALL:  # SMALL's flags change the output
            assert out.rstrip("\n") == example.expected_output, f"{where} printed\n{out}\nnot what the page shows"
