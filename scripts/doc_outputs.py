"""Regenerate the quoted outputs of the docs, or compare them with a fresh run.

    python scripts/doc_outputs.py                  # rerun every output's command, rewrite its blocks
    python scripts/doc_outputs.py doctor demo      # only these
    python scripts/doc_outputs.py --check          # rerun and compare; exit 1 when a page differs

A page quotes an output in a fenced block right under ``<!-- output: NAME -->`` (scripts/doc_blocks.py
reads the markers); :data:`OUTPUTS` says how NAME is produced: a command run as written from a clean
temporary folder (the files it needs put there first), and which lines of its output the block
shows. The block of a Chinese twin that still equals the English block is rewritten with it, so the
twins' code stays the same (tests/test_docs_site.py, tests/test_readme_zh.py).

Some outputs depend on the machine: speeds, the CPU's kernels, a language model's words on that
CPU's rounding. Their marker says so (``<!-- output: NAME; varies: WHAT -->``) and they are compared
for form: every number may differ, and so may the lines :class:`Output` names as free (a model's
answer). Measured errors of ``attnlab check`` (``2.7e-07``) vary with thread count and CPU too, so
numbers in scientific notation are compared for form in every output. tests/test_doc_blocks.py runs
:func:`compare` for each output (the slow ones among the slow tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_blocks import ROOT, Block, blocks, english_twin, pages

CORPUS = ROOT / "tests" / "mistake_corpus"
# quant.kernel_build's line while another process builds the kernels
KERNEL_WAIT = re.compile(r"attnlab: waiting for .* to finish building the quantized kernels")


def cpu_name() -> str:
    """This machine's CPU model and core count, as a page names where it measured."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def run(
    argv: list[str], *, columns: int = 80, files: dict[str, str] | None = None, before: list[list[str]] = ()
) -> tuple[int, str]:
    """``argv`` (a shell command as written, ``attnlab ...``) run from a clean temporary folder holding
    ``files``, after the commands ``before`` (their output dropped); ``(exit code, stdout and stderr
    interleaved as a terminal shows them)``, lines right-stripped."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}
    # as in an activated virtual environment: its tools (ninja, which builds the quantized kernels) on PATH
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    with tempfile.TemporaryDirectory(prefix="doc-output-") as folder:
        for name, text in (files or {}).items():
            (Path(folder) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(folder) / name).write_text(text)
        for command in [*before, argv]:
            done = subprocess.run(
                [sys.executable, "-m", "attnlab", *command[1:]] if command[0] == "attnlab" else command,
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=1800,  # minutes under load; a hung command still ends
            )
    # a line that says this run waited for another process building the quantized kernels is that machine's
    # moment, not the command's output
    lines = [line.rstrip() for line in done.stdout.splitlines() if not KERNEL_WAIT.match(line)]
    return done.returncode, "\n".join(lines)


def _from(text: str, start: str, end: str | None = None) -> str:
    """The lines of ``text`` from the first that starts with ``start`` (to the first after it that starts
    with ``end``, exclusive)."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = len(lines) if end is None else next(i for i in range(first + 1, len(lines)) if lines[i].startswith(end))
    return "\n".join(lines[first:last]).strip("\n")


def _rows(text: str, names: list[str]) -> list[str]:
    """The table rows of a check's output for the named checks, in ``names``' order."""
    return [next(line for line in text.splitlines() if re.match(rf"│ {re.escape(n)} +│", line)) for n in names]


def _verdict(text: str) -> str:
    """A check's output from its verdict line on."""
    return _from(text, "OK:" if "\nOK:" in text else "FAILED:")


# ---- the outputs ------------------------------------------------------------------------------------

MINE = {"mine.py": (CORPUS / "seed002_as_published.py").read_text(encoding="utf-8")}
CHECK_MINE = "attnlab check --target mine.py:MultiHeadAttention"
CHECK_TORCH = "attnlab check --target torch"
CHAT = 'attnlab generate --model smollm2 --chat --prompt "Explain attention in one paragraph." --temperature 0 --max-new-tokens 100'


def check_mine() -> str:
    _, out = run(shlex.split(CHECK_MINE), columns=100, files=MINE)
    return f"$ {CHECK_MINE}\n...\n{_verdict(out)}"


@functools.cache  # three blocks show parts of one run
def _check_torch() -> str:
    return run(shlex.split(CHECK_TORCH), columns=80)[1]


def check_torch_narrow() -> str:
    out = _check_torch()
    rows = _rows(out, ["padded_kv_nonfinite", "permutation_equivariance", "fully_masked_rows", "mask_semantics"])
    details = _from(out, "padded_kv_nonfinite ", "permutation_equivariance ")
    return "\n".join([f"$ {CHECK_TORCH}", "...", *rows, "...", details, "..."])


def check_torch() -> str:
    out = _check_torch()
    rows = _rows(out, ["parity_masked", "low_precision[bf16]", "fully_masked_rows", "mask_semantics"])
    return "\n".join([f"$ {CHECK_TORCH}", "...", *rows, "...", _verdict(out)])


def check_torch_peer() -> str:
    out = _check_torch()
    rows = _rows(out, ["padded_kv_nonfinite", "dropout_rate"])
    verdict = _from(_verdict(out), "OK:" if "\nOK:" in out else "FAILED:", "skipped")
    return "\n".join([f"$ {CHECK_TORCH}", "...", *rows, "...", verdict, "..."])


def demo() -> str:
    _, out = run(["attnlab", "demo"], columns=80)
    return _from(out, "=== 3.")


# step 3 of `attnlab demo` alone (its training run, into runs/demo): the demo's other steps take minutes
DEMO_TRAINING = (
    "from pathlib import Path; from attnlab.lab.train import train; from attnlab.tools.demo import _demo_run; "
)
DEMO_TRAINING += "train(_demo_run(Path('runs/demo'), 0), overwrite=True)"
INSPECT_DEMO = "attnlab inspect --checkpoint runs/demo --out-dir runs/inspect-demo"


def inspect_demo() -> str:
    _, out = run(shlex.split(INSPECT_DEMO), before=[[sys.executable, "-c", DEMO_TRAINING]])
    return f"$ {INSPECT_DEMO}\n{_from(out, 'demo (lab run)', 'wrote ')}\n..."


def doctor() -> str:
    _, out = run(["attnlab", "doctor", "--recheck-compile"], columns=80)
    return f"$ attnlab doctor --recheck-compile\n{out}"


@functools.cache  # the README's chat, and its first line on the weights page
def readme_chat() -> str:
    _, out = run(shlex.split(CHAT), columns=10_000)
    return f"$ {CHAT}\n{out}"


def weights_lines() -> str:
    """The line on stderr that says which weights ran: generate's (from the README's chat) and inspect's."""
    import torch

    from attnlab.weight_files.precision import choose_weights
    from attnlab.weight_files.pretrained import smollm2_path

    generate = next(line for line in readme_chat().splitlines() if line.startswith("attnlab: weights"))
    inspect = choose_weights(task="inspect", source=smollm2_path(), device=torch.device("cpu")).line()
    return f"{generate}\n{inspect}"


def bench_window_goals() -> str:
    """The two lines under the window benchmark's goals, recomputed from docs/bench_window.json."""
    import json

    from attnlab.bench.window import WindowResult, WindowRow, window_goals

    data = json.loads((ROOT / "docs" / "bench_window.json").read_text(encoding="utf-8"))
    data.pop("goals")
    result = WindowResult(**{**data, "rows": [WindowRow(**row) for row in data["rows"]]})
    return "\n".join(line for line in window_goals(result).splitlines() if line.startswith("  "))


def _code_above(page: str, name: str) -> str:
    """The ``python`` block right above the output block marked ``name`` on ``page``: the code that prints it."""
    found = blocks(ROOT / page)
    at = next(i for i, b in enumerate(found) if (b.marker("output") or "").split(";")[0].strip() == name)
    code = found[at - 1]
    assert at > 0 and code.lang == "python", f"{page}: the output {name!r} has no python block above it"
    return code.body


def hf_trace() -> str:
    """What the Hugging Face page's trace example prints, run as written."""
    _, out = run([sys.executable, "-c", _code_above("docs/howto/huggingface.md", "hf_trace")])
    return out


# a line of the demo's output that is none of its fixed lines: SmolLM2's answer
DEMO_ANSWER = r"(?!attnlab: |\$ |=== |done|  \w+\| -> |.* {2,}runs/).*"


@dataclasses.dataclass(frozen=True)
class Output:
    """How one quoted output is produced, and how much of it is this machine's."""

    produce: Callable[[], str]
    slow: bool = False  # minutes, or a real model: among the slow tests
    varies: bool = False  # by machine: numbers compared for form
    free: tuple[str, ...] = ()  # regexes of whole lines that may read anything (a model's answer)


OUTPUTS: dict[str, Output] = {
    "check_mine": Output(check_mine, slow=True),
    "check_torch_narrow": Output(check_torch_narrow, slow=True),
    "check_torch": Output(check_torch, slow=True),
    "check_torch_peer": Output(check_torch_peer, slow=True),
    # the training stops at 95% accuracy after a number of steps that varies; SmolLM2's answer varies by CPU, and
    # the speed line by whether llama.cpp is installed
    "demo": Output(demo, slow=True, varies=True, free=(r"step +\d+/\d+ .*", r"speed: .*", DEMO_ANSWER)),
    # the quantized kernels' row names this CPU's instructions and its cache folder, wrapped under the row
    "doctor": Output(doctor, slow=True, varies=True, free=(r"\[[ a-z.]+\] quantized kernels .*", r" {30,}\S.*")),
    "readme_chat": Output(readme_chat, slow=True, varies=True, free=(r"(?!attnlab: |\$ ).*",)),
    "inspect_demo": Output(inspect_demo, slow=True, varies=True),
    "weights_lines": Output(weights_lines, slow=True, varies=True),
    "bench_window_goals": Output(bench_window_goals),
    "hf_trace": Output(hf_trace, slow=True),  # a subprocess importing transformers and building GPT-2, ~7 s
}


# ---- comparing and rewriting ------------------------------------------------------------------------

SCI = r"[-+]?\d(?:\.\d+)?e[-+]\d+"
# in an output that varies by machine, words that name the machine's kernels: any words may stand there
MACHINE_WORDS = re.compile(r"(?<=int8 tiles on )[^);]+")
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?"


def form(text: str, output: Output) -> re.Pattern[str]:
    """A pattern that ``text`` matches, and so does any run of the same output that differs only where it may:
    measured errors (scientific notation), with ``varies`` every number, the ``free`` lines whole; line
    breaks may move (a longer number rewraps a paragraph)."""
    parts = []
    for line in text.splitlines():
        if any(re.fullmatch(free, line) for free in output.free):
            parts.append(r"(?:[^\n]*(?:\n|$))*?")  # any lines, as few as fit
            continue
        pieces = MACHINE_WORDS.split(line) if output.varies else [line]
        pattern = "[^);]+".join(re.sub(rf"({NUMBER if output.varies else SCI})|(\s+)|(.)", _token, p) for p in pieces)
        parts.append(pattern + r"\s*")
    return re.compile("".join(parts) + r"\Z")


def _token(m: re.Match[str]) -> str:
    if m[1]:
        return NUMBER if re.fullmatch(NUMBER, m[1]) else re.escape(m[1])
    if m[2]:
        return r"\s+"
    return re.escape(m[3])


def marked(name: str) -> list[Block]:
    """The English blocks marked ``<!-- output: name ... -->``."""
    return [
        b
        for path in pages()
        if not (path.name.endswith(".zh.md") or path.name.endswith(".zh-CN.md"))
        for b in blocks(path)
        if (b.marker("output") or "").split(";")[0].strip() == name
    ]


def compare(name: str, fresh: str) -> list[str]:
    """How each block marked ``name`` differs from ``fresh`` (a new run's text); empty when none does."""
    output = OUTPUTS[name]
    problems = []
    for block in marked(name):
        marker = block.marker("output") or ""
        if output.varies != ("varies:" in marker):
            problems.append(f"{block.id}: the marker must say `varies: ...` exactly when the output varies by machine")
        if not form(block.body.rstrip("\n"), output).match(fresh.rstrip("\n") + "\n"):
            problems.append(f"{block.id}: the page shows\n{block.body}\n--- a fresh run printed\n{fresh}")
    return problems


def rewrite(name: str, fresh: str) -> list[Path]:
    """Writes ``fresh`` into every block marked ``name``, and into the Chinese twins' copies of those blocks."""
    changed = []
    for block in marked(name):
        old = block.body
        targets = [ROOT / block.page]
        for path in pages():
            rel = path.relative_to(ROOT).as_posix()
            if rel != block.page and english_twin(rel) == block.page:
                targets.append(path)
        for path in targets:
            text = path.read_text(encoding="utf-8")
            new_text = _replace_body(text, old, fresh.rstrip("\n") + "\n")
            if new_text != text:
                path.write_text(new_text, encoding="utf-8")
                changed.append(path)
    return changed


def _replace_body(text: str, old: str, new: str) -> str:
    """``text`` with the block whose body is ``old`` given the body ``new`` (the first such block)."""
    at = text.find("\n" + old)
    while at >= 0:
        opening = text.rfind("\n", 0, at) + 1
        if text[opening:at].startswith("```"):
            return text[: at + 1] + new + text[at + 1 + len(old) :]
        at = text.find("\n" + old, at + 1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"outputs to regenerate (default: all): {', '.join(OUTPUTS)}")
    parser.add_argument("--check", action="store_true", help="compare with a fresh run; change nothing")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(OUTPUTS))
    if unknown:
        parser.error(f"no output named {', '.join(unknown)}; the outputs are {', '.join(OUTPUTS)}")
    failed = 0
    for name in args.names or OUTPUTS:
        fresh = OUTPUTS[name].produce()
        if args.check:
            problems = compare(name, fresh)
            failed += bool(problems)
            print("\n".join(problems) or f"{name}: as on the page")
        else:
            changed = rewrite(name, fresh)
            print(f"{name}: " + (", ".join(p.relative_to(ROOT).as_posix() for p in changed) or "unchanged"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
