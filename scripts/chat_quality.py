"""How well SmolLM2 answers in chat, on each path: attnlab's gguf weights, its float32 weights, and llama.cpp on the
same GGUF file, greedy and sampled. The figures that chose ``attnlab generate --chat``'s sampling defaults
(``docs/howto/real-models.md``, "Chat sampling").

On a fixed set of 22 prompts (12 English, 10 Chinese) in SmolLM2's chat template, every path answers with up to
``--max-new-tokens`` tokens (64), stopping at the end-of-sequence token. Then:

- **agreement**: greedy gguf against greedy float32, per prompt, over the first 64 tokens: the share of positions
  where both chose the same token (up to the first difference both continue from different texts, so the figure
  is the length of the common prefix over 64), and how many prompts agree on all 64;
- **log-likelihood**: the float32 model's mean log-probability per token of each answer, the prompt given (a
  fluency figure computable here; higher is more what the float model itself would say);
- **repetition**: the share of an answer's 4-grams of tokens that already occurred earlier in it; an answer
  **degenerates** when that share exceeds 0.2 (the looping answers of the issue score 0.8 and more; the fluent
  ones here 0 to 0.07).

A loop is very likely under the model that loops, so log-likelihood alone prefers degenerate answers: a path is
judged by how many answers degenerate first, then by its mean log-likelihood over the answers that do not.

llama.cpp runs in its own Python (``--llama-python``, default ``/work/peers/llama-venv/bin/python``, or
``ATTNLAB_LLAMA_PYTHON``), a subprocess fed the same token ids; without it its rows are left out.

    python scripts/chat_quality.py --out runs/chat_quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import attnlab
from attnlab.models.generation import generate_steps
from attnlab.runtime.devices import cpu_info
from attnlab.weight_files.pretrained import smollm2_path

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for sleeping better.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Name three planets of the solar system.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Write one sentence about a cat.",
    "法国的首都是哪里？",
    "请用一句话介绍你自己。",
    "天空为什么是蓝色的？",
    "给我三个学习的建议。",
    "什么是人工智能？",
    "写一句关于春天的话。",
    "一年有几个月？",
    "怎样煮鸡蛋？",
    "水的化学式是什么？",
    "请推荐一本书。",
]
DEGENERATE = 0.2  # share of repeated 4-grams above which an answer is a loop
AGREE_TOKENS = 64


@dataclass(frozen=True)
class Path_:
    """One way of answering: the weights and the sampling."""

    name: str
    weights: str  # "gguf" or "float32" (attnlab), "llama.cpp"
    temperature: float
    top_p: float | None = None
    repetition_penalty: float = 1.0
    top_k: int | None = None


PATHS = [  # the chosen default first, then the references, then the other candidates
    Path_("gguf T=0.2 p=0.9 rp=1.1", "gguf", 0.2, 0.9, 1.1),
    Path_("gguf greedy", "gguf", 0.0),
    Path_("float32 greedy", "float32", 0.0),
    Path_("gguf T=0.2 p=0.9", "gguf", 0.2, 0.9),
    Path_("gguf T=0.2 p=0.9 rp=1.2", "gguf", 0.2, 0.9, 1.2),
]

LLAMA_SIDE = r"""
import json, sys
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["path"], n_ctx=1024, n_threads=job["threads"], seed=job["seed"], verbose=False)
out = {}
for mode in ("greedy", "default"):
    answers = []
    for ids in job["prompts"]:
        llm.reset()
        kw = {"temp": 0.0, "top_k": 1} if mode == "greedy" else {}  # "default": llama-cpp-python's own sampler
        got = []
        for t in llm.generate(ids, reset=True, **kw):
            got.append(int(t))
            if t == job["eos"] or len(got) == job["n"]:
                break
        answers.append(got)
    out[mode] = answers
json.dump(out, sys.stdout)
"""


def repeated_4grams(ids: list[int]) -> float:
    """The share of the 4-grams of ``ids`` that already occurred earlier in it (0 for fewer than 5 tokens)."""
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


@torch.no_grad()
def mean_log_likelihood(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> float:
    """The model's mean log-probability per token of ``answer`` after ``prompt`` (natural log)."""
    if not answer:
        return float("nan")
    idx = torch.tensor([prompt + answer])
    logits = model(idx)[0, len(prompt) - 1 : -1].float()  # (len(answer), V): each answer token's prediction
    logp = logits.log_softmax(-1).gather(-1, torch.tensor(answer)[:, None])
    return float(logp.mean())


def answer(model: torch.nn.Module, ids: list[int], path: Path_, n: int, eos: int, seed: int) -> list[int]:
    steps = generate_steps(
        model,
        torch.tensor([ids]),
        n,
        temperature=path.temperature,
        top_k=path.top_k,
        top_p=path.top_p,
        repetition_penalty=path.repetition_penalty,
        eos_token_id=eos,
        generator=torch.Generator().manual_seed(seed),
    )
    return [int(s.tokens[0]) for s in steps]


def llama_answers(python: str, prompts: list[list[int]], n: int, eos: int, seed: int) -> dict[str, list[list[int]]]:
    job = {"path": str(smollm2_path()), "prompts": prompts, "n": n, "eos": eos, "seed": seed, "threads": 1}
    done = subprocess.run(
        [python, "-c", LLAMA_SIDE], input=json.dumps(job), capture_output=True, text=True, check=True, timeout=1800
    )
    return json.loads(done.stdout)


def chat_ids(tok: object, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn in the model's chat template, the assistant's turn opened."""
    return [
        list(
            tok.apply_chat_template(  # type: ignore[attr-defined]
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for p in prompts
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/chat_quality.json"))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--limit", type=int, default=len(PROMPTS), help="the first N prompts only (a quick look)")
    ap.add_argument(
        "--llama-python",
        default=os.environ.get("ATTNLAB_LLAMA_PYTHON", "/work/peers/llama-venv/bin/python"),
        help="a Python with llama-cpp-python; 'none' leaves llama.cpp out",
    )
    ap.add_argument("--reuse", action="store_true", help="keep the answers --out already holds; run only the others")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--llama-only",
        action="store_true",
        help="run only llama.cpp's answers, into OUT.llama.json (a process of its own, beside the attnlab paths)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llama_file = args.out.with_suffix(".llama.json")
    if args.llama_only:
        from attnlab.weight_files import gguf

        tok = gguf.tokenizer_from_gguf(gguf.open_gguf(smollm2_path()))
        got = llama_answers(
            args.llama_python,
            chat_ids(tok, PROMPTS[: args.limit]),
            args.max_new_tokens,
            int(tok.eos_token_id),
            args.seed,
        )
        llama_file.write_text(
            json.dumps({"llama.cpp greedy": got["greedy"], "llama.cpp default sampling": got["default"]})
        )
        return 0
    f32, tok = attnlab.from_pretrained("smollm2", dtype="float32")
    q, _ = attnlab.from_pretrained("smollm2", dtype="gguf")
    models = {"float32": f32, "gguf": q}
    eos = int(tok.eos_token_id)
    prompts = PROMPTS[: args.limit]
    ids = chat_ids(tok, prompts)
    answers: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    partial = args.out.with_suffix(".partial.json")
    if args.reuse and partial.is_file():
        old = json.loads(partial.read_text())
        answers, seconds = old["ids"], old["seconds"]
    for path in PATHS:
        if path.name in answers:
            continue
        start = time.perf_counter()
        answers[path.name] = [answer(models[path.weights], x, path, args.max_new_tokens, eos, args.seed) for x in ids]
        seconds[path.name] = time.perf_counter() - start
        print(f"chat_quality: {path.name}: {seconds[path.name]:.0f} s", file=sys.stderr, flush=True)
        partial = args.out.with_suffix(".partial.json")  # what a stopped run keeps: --reuse reads it back
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"ids": answers, "seconds": seconds}))
    if llama_file.is_file():  # written by a --llama-only run
        answers.update(json.loads(llama_file.read_text()))
    if "llama.cpp greedy" in answers:
        pass
    elif args.llama_python != "none" and Path(args.llama_python).is_file():
        start = time.perf_counter()
        try:
            got = llama_answers(args.llama_python, ids, args.max_new_tokens, eos, args.seed)
            answers["llama.cpp greedy"], answers["llama.cpp default sampling"] = got["greedy"], got["default"]
        except (subprocess.SubprocessError, OSError, KeyError, ValueError) as e:
            print(f"chat_quality: llama.cpp left out: {e}", file=sys.stderr)
        print(f"chat_quality: llama.cpp: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    else:
        print(f"chat_quality: llama.cpp left out: no Python at {args.llama_python!r}", file=sys.stderr)

    def agree(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a[:AGREE_TOKENS], b[:AGREE_TOKENS], strict=False):
            if x != y:
                break
            n += 1
        return n

    g, f = answers.get("gguf greedy", []), answers.get("float32 greedy", [])
    prefix = [agree(a, b) for a, b in zip(g, f, strict=False)]
    span = [min(AGREE_TOKENS, len(a), len(b)) for a, b in zip(g, f, strict=False)]  # both stop at eos
    whole = [p >= n for p, n in zip(prefix, span, strict=True)]
    rows = []
    for name, outs in answers.items():
        ll = [mean_log_likelihood(f32, x, a) for x, a in zip(ids, outs, strict=True)]
        rep = [repeated_4grams(a) for a in outs]
        fine = [v for v, r in zip(ll, rep, strict=True) if r <= DEGENERATE]
        rows.append(
            {
                "path": name,
                "degenerate": sum(r > DEGENERATE for r in rep),
                "mean_ll_fluent": sum(fine) / len(fine) if fine else float("nan"),
                "mean_ll_all": sum(ll) / len(ll),
                "mean_repeated_4grams": sum(rep) / len(rep),
                "mean_tokens": sum(map(len, outs)) / len(outs),
                "ended": sum(bool(a) and a[-1] == eos for a in outs),
                "seconds": seconds.get(name),
            }
        )
    cpu = cpu_info()
    report = {
        "cpu": f"{cpu['model']} (family {cpu['family']}, model {cpu['model_number']}), {os.cpu_count()} cores",
        "torch": torch.__version__,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "degenerate_threshold": DEGENERATE,
        "greedy_agreement": {
            "tokens": AGREE_TOKENS,
            "mean_common_prefix_share": sum(p / max(n, 1) for p, n in zip(prefix, span, strict=True))
            / max(len(prefix), 1),
            "prompts_identical": sum(whole),
            "common_prefix_per_prompt": prefix,
        },
        "rows": rows,
        "ids": answers,
        "answers": {name: [tok.decode(a, skip_special_tokens=True) for a in outs] for name, outs in answers.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(f"CPU: {report['cpu']}")
    print(
        f"greedy gguf vs float32, first {AGREE_TOKENS} tokens: common prefix {report['greedy_agreement']['mean_common_prefix_share']:.0%} "
        f"on average, identical on {sum(whole)} of {len(prefix)} prompts"
    )
    print(f"{'path':32} degenerate  LL/token (fluent)  LL/token (all)  rep4  tokens  ended")
    for r in rows:
        print(
            f"{r['path']:32} {r['degenerate']:>4}/{len(prompts):<5} {r['mean_ll_fluent']:>17.3f} {r['mean_ll_all']:>15.3f} "
            f"{r['mean_repeated_4grams']:>5.2f} {r['mean_tokens']:>7.1f} {r['ended']:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
