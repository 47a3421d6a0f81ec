"""Run ``attnlab check`` on every module of the style corpora under tests/ as written, and score what it says.

For each corpus file this runs ``python -m attnlab check --target FILE:TARGET`` with no other option (or
``attnlab trace --target ...`` with --trace), two at a time at most, and records the exit code, the wall time,
whether the module was called as written, the first 'Likely cause' id, and whether that matches the file's EXPECTED
(pass -> exit 0; a mistake -> the first cause is that mistake); with --trace, the stage of the first departure. Prints a table and a summary (overall and per
corpus; repaired twins, the ``*_repaired.py`` files, are counted apart as well: each one flagged is a false alarm),
and writes JSON.

The corpora (``--corpus``, repeatable; all by default): style_corpus (the six named styles), style_corpus_more
(HF GPT-2, minGPT, timm ViT), style_corpus_mla (multi-head latent attention), style_corpus_wild (20 styles no
other corpus covers, from fairseq and Whisper to Swin and Falcon, each mistake with its repaired twin),
style_corpus_fresh3 (eight more, written to measure the gap: MPT, OLMo-2, StableLM, Baichuan, InternLM2, ChatGLM,
DINOv2's MemEffAttention, BART) and style_corpus_fresh4 (nine more: diffusers' AttnProcessor, BEiT, the Set
Transformer, SegFormer, a Keras port, Cohere, DBRX, audiocraft, Llama 3.2 Vision's cross-attention) and
style_corpus_fresh5 (CodeGen's grouped qkv rows, Phi-3's sliced qkv, an mlx-lm port, GPT-2 at its own initialisation)
and style_corpus_fresh6 (OPT, Granite's attention_multiplier, OpenFold's gated attention, ESM-2's time-first rotary,
Persimmon's per-head fused qkv with qk LayerNorms and partial rotary, Gemma 3's own sliding causal mask).
style_corpus_fresh and style_corpus_fresh2 are scored by naming them.

Usage:
    python scripts/check_style_trial.py [--corpus NAME ...] [--files GLOB] [--out PATH] [--trace] [--jobs N] [--timeout S]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPORA = (
    "style_corpus",
    "style_corpus_more",
    "style_corpus_mla",
    "style_corpus_wild",
    "style_corpus_fresh3",
    "style_corpus_fresh4",
    "style_corpus_fresh5",
    "style_corpus_fresh6",
)

# an argparse/tyro usage refusal: "error: ..." at the start of a line, or after "attnlab check: "
_USAGE_ERROR = re.compile(r"^(?:\S*attnlab[^\n:]*:\s*)?error:", re.MULTILINE)
# where the tool says its own code broke rather than the module's
_INTERNAL = re.compile(r"Traceback \(most recent call last\)|internal error", re.IGNORECASE)
_CAUSE_ID = re.compile(r"\[([a-z][a-z0-9_]*)\]$")
# attnlab trace's verdict: the first reference stage the module never produces, or the exception it raised
_DEPARTURE = re.compile(r"^\s*>> first departure: the reference's (\w+)", re.MULTILINE)
_RAISED = re.compile(r"^\s*>> raised ", re.MULTILINE)


def constants(path: Path) -> dict[str, str]:
    """The module-level string constants EXPECTED, TARGET, STYLE, CALL, read without importing the file."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in {"EXPECTED", "TARGET", "STYLE", "CALL"} and isinstance(node.value, ast.Constant):
                out[name] = str(node.value.value)
    return out


def first_cause(output: str) -> tuple[str | None, str | None]:
    """(id, text) of cause 1 in the 'Likely cause' section, joining its wrapped lines; (None, None) if absent."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Likely cause")), None)
    if start is None:
        return None, None
    chunk: list[str] = []
    for line in lines[start + 1 :]:
        if not chunk:
            if line.startswith("1. "):
                chunk.append(line[3:].strip())
            continue
        if not line.startswith("   ") or line.lstrip().startswith(("evidence:", "fix:", "see:", "explains:")):
            break
        chunk.append(line.strip())
    if not chunk:
        return None, None
    text = " ".join(chunk)
    m = _CAUSE_ID.search(text)
    if m is None:
        return None, text
    return m.group(1), text[: m.start()].strip()


def run_one(path: Path, trace: bool, timeout: float) -> dict:
    meta = constants(path)
    target = f"{path.relative_to(ROOT)}:{meta.get('TARGET', '?')}"
    cmd = [sys.executable, "-m", "attnlab", "trace" if trace else "check", "--target", target]
    env = dict(os.environ, COLUMNS="200", PYTHONWARNINGS="ignore")  # wide output: fewer wrapped cause lines
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = None
        output = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        output += "\n[trial: timed out]"
    seconds = time.perf_counter() - t0
    usage_refusal = bool(_USAGE_ERROR.search(output))
    internal = bool(_INTERNAL.search(output))
    ran = rc in (0, 1) and not usage_refusal and not internal  # a traceback is no run, whatever the exit code
    cause_id, cause_text = first_cause(output)
    departure = _DEPARTURE.search(output)  # read off the whole output: the tail kept below may have lost it
    expected = meta.get("EXPECTED")
    if trace:
        match = None
    elif expected == "pass":
        match = rc == 0
    else:
        match = ran and cause_id == expected
    return {
        "corpus": path.parent.name,
        "file": path.name,
        "style": meta.get("STYLE"),
        "target": meta.get("TARGET"),
        "expected": expected,
        "command": " ".join(cmd[1:]),
        "exit_code": rc,
        "seconds": round(seconds, 1),
        "ran_as_written": ran,
        "usage_refusal": usage_refusal,
        # the tool broke (a traceback / internal error) yet reported it as the module failing (exit 1)
        "crash_as_module_failure": internal and rc == 1,
        "first_cause": cause_id,
        "first_cause_text": cause_text,
        # trace: the stage of the first departure ("raised" where the module raised; None: every stage reproduced)
        "first_departure": departure.group(1) if departure else ("raised" if _RAISED.search(output) else None),
        "match": match,
        "output_tail": output[-3000:],
    }


def score(rows: list[dict]) -> dict:
    """The trial's figures for these rows: called as written, correct and repaired modules passing, mistakes named."""
    correct = [r for r in rows if r["expected"] == "pass"]
    repaired = [r for r in correct if r["file"].endswith("_repaired.py")]
    mistakes = [r for r in rows if r["expected"] not in (None, "pass")]
    return {
        "files": len(rows),
        "called_as_written": sum(r["ran_as_written"] for r in rows),
        "correct_exit_0": sum(r["exit_code"] == 0 for r in correct),
        "correct_total": len(correct),
        # repaired twins are correct modules too (counted above); flagged, each is a false alarm
        "repaired_exit_0": sum(r["exit_code"] == 0 for r in repaired),
        "repaired_total": len(repaired),
        "mistakes_named_first": sum(bool(r["match"]) for r in mistakes),
        # trace: correct modules traced with no departure, mistakes traced to a departure (or a raise)
        "correct_no_departure": sum(r["ran_as_written"] and not r.get("first_departure") for r in correct),
        "mistakes_departed": sum(r["ran_as_written"] and bool(r.get("first_departure")) for r in mistakes),
        "mistakes_total": len(mistakes),
        "exit_3": sum(r["exit_code"] == 3 for r in rows),
        "crashes_as_module_failures": sum(r["crash_as_module_failure"] for r in rows),
        "usage_refusals": sum(r["usage_refusal"] for r in rows),
    }


def print_score(s: dict, trace: bool) -> None:
    print(f"called as written:            {s['called_as_written']}/{s['files']}")
    if trace:
        print(f"correct modules no departure: {s['correct_no_departure']}/{s['correct_total']}")
        print(f"mistakes departing:           {s['mistakes_departed']}/{s['mistakes_total']}")
        print(f"exit 3 (internal error):      {s['exit_3']}")
    if not trace:
        print(f"correct modules exit 0:       {s['correct_exit_0']}/{s['correct_total']}")
        if s["repaired_total"]:
            print(f"  of which repaired twins:    {s['repaired_exit_0']}/{s['repaired_total']}")
        print(f"mistakes named first:         {s['mistakes_named_first']}/{s['mistakes_total']}")
        print(f"exit 3 (internal error):      {s['exit_3']}")
        print(f"tool crashes as module fails: {s['crashes_as_module_failures']}")
    print(f"usage refusals:               {s['usage_refusals']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="*.py", help="glob inside each corpus folder (default: *.py)")
    ap.add_argument(
        "--corpus",
        action="append",
        default=None,
        help=f"corpus folder under tests/ (repeatable; default: {', '.join(CORPORA)})",
    )
    ap.add_argument("--out", default=str(ROOT / "bench_results" / "check_style_trial.json"))
    ap.add_argument("--trace", action="store_true", help="run 'attnlab trace' instead of 'attnlab check'")
    ap.add_argument("--jobs", type=int, default=2, help="subprocesses at once (at most 2)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per file")
    args = ap.parse_args(argv)

    folders = [ROOT / "tests" / name for name in (args.corpus or CORPORA)]
    files = [f for folder in folders for f in sorted(folder.glob(args.files))]
    if not files:
        print(f"no corpus file matches {args.files!r} in {', '.join(map(str, folders))}", file=sys.stderr)
        return 2
    jobs = max(1, min(2, args.jobs))
    t0 = time.perf_counter()
    rows: list[dict] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for row in pool.map(lambda p: run_one(p, args.trace, args.timeout), files):
            rows.append(row)
            print(f"  done {row['file']} (exit {row['exit_code']}, {row['seconds']}s)", file=sys.stderr, flush=True)

    head = f"{'file':46} {'expected':24} {'exit':>4} {'sec':>6} {'ran':>3}  {'first departure' if args.trace else 'first cause':26} match"
    print(head)
    print("-" * len(head))
    for r in rows:
        match = "-" if r["match"] is None else ("yes" if r["match"] else "no")
        print(
            f"{r['file']:46} {r['expected'] or '?':24} {r['exit_code']!s:>4} {r['seconds']:>6.1f} "
            f"{'yes' if r['ran_as_written'] else 'no':>3}  {(r['first_departure'] if args.trace else r['first_cause']) or '-':26} {match}"
        )

    summary = {"mode": "trace" if args.trace else "check", **score(rows)}
    summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
    corpora = sorted({r["corpus"] for r in rows})
    summary["per_corpus"] = {name: score([r for r in rows if r["corpus"] == name]) for name in corpora}
    print()
    print_score(summary, args.trace)
    print(f"wall time:                    {summary['wall_seconds']} s")
    if len(corpora) > 1:
        for name in corpora:
            print(f"\n[{name}]")
            print_score(summary["per_corpus"][name], args.trace)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    tmp.replace(out)  # never a half-written result
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
