"""How long greedy decoding with a compact KV cache stays with the float32 cache, on SmolLM2 from its GGUF.

For each of 20 fixed chat prompts (10 English, 10 Chinese; SmolLM2's chat template), 64 greedy tokens with the
float32 cache (the reference) and with each compact cache (``--kv-dtypes``, default float16, bfloat16, int8),
on the same ``dtype="gguf"`` model (the fused C++ decode step, which reads the cache in its own bytes). Prints,
per prompt, the index of the first new token that differs from the float32 cache's (64 = all equal), and the
totals: the share of the 64 x 20 positions before the first difference (strict) and the share of positions
whose tokens are equal (positionwise), and teacher-forced: every cache decodes the SAME tokens (the float32
cache's greedy ones fed back), and at each of the 64 positions its argmax is compared with the float32 cache's
(top-1 agreement) and its logits with the float32 cache's (the largest absolute difference). A strict prefix
cascades (one flip makes every later token differ); the teacher-forced figure is the cache's own effect, step by
step. Writes them to ``--out`` as JSON.

``--int8-block N`` sets the int8 cache's block (values per scale, :data:`attnlab.core.kv_cache.INT8_BLOCK`) for
the run, to measure other blocks.

The control (``--control-threads N``, default 2): the float32 cache again with N threads instead of
``--threads``. The split-K kernel then sums in another order, a float32 rounding change and nothing else; with
the model's int8 activations such a change moves a logit by up to ~1 (tests/test_quant_models.py), so the
control's agreement is the floor of what any change to the step can reach. ``--weights float32`` runs the
float32 model dequantized from the same file instead (the PyTorch path, float32 activations; the cache is read
back dequantized): the cache's own effect, without the int8 activations' sensitivity.

    python scripts/kv_cache_agreement.py [--out kv_cache_agreement.json] [--kv-dtypes int8 float16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, cast

import torch
from gguf_greedy_agreement import first_difference  # scripts/ is on the path when this file runs
from torch import Tensor

import attnlab
from attnlab.core import kv_cache
from attnlab.models.generation import decode_step, prefill
from attnlab.quant import kernel_status
from attnlab.runtime import cpu_info

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write a short email asking a colleague for a meeting tomorrow.",
    "List the planets of the solar system in order.",
    "How do I make a cup of green tea?",
    "中国的首都是哪里？",
    "请用一句话介绍长城。",
    "写一首关于秋天的短诗。",
    "什么是人工智能？",
    "请解释一下光合作用。",
    "给我三个学习编程的建议。",
    "为什么天空是蓝色的？",
    "请把这句话翻译成英文：我喜欢喝茶。",
    "介绍一下北京的天气。",
    "怎样做西红柿炒鸡蛋？",
)
NEW = 64


def forced_logits(model: torch.nn.Module, idx: Tensor, tokens: list[int], kv_dtype: str | None) -> Tensor:
    """``(len(tokens), V)`` float32 logits: the prompt ``idx (1, T)`` prefilled, then ``tokens`` fed one by one
    through the cache ``kv_dtype`` (None: float32); row ``i`` is the prediction of ``tokens[i]``."""
    T = idx.size(1)
    S = T + len(tokens)
    m = cast(Any, model)
    pad = torch.zeros(1, S, dtype=torch.bool)  # (1, S): no padding
    positions = torch.arange(S)[None]  # (1, S)
    with torch.no_grad():
        caches = m.setup_caches(1, S) if kv_dtype is None else m.setup_caches(1, S, kv_dtype)
        rows = [prefill(m, idx, positions[:, :T], pad, caches)]  # (1, V)
        for i, t in enumerate(tokens[:-1]):
            s = T + i
            tok = torch.tensor([[t]])  # (1, 1)
            rows.append(decode_step(m, tok, positions[:, s : s + 1], torch.tensor([s]), pad, caches))
    return torch.cat(rows).float()  # (len(tokens), V)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="kv_cache_agreement.json", help="where the JSON goes")
    p.add_argument("--kv-dtypes", nargs="+", default=["float16", "bfloat16", "int8"], help="compact caches to compare")
    p.add_argument("--weights", default="gguf", choices=["gguf", "float32"], help="the model's weights")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: no barrier waits on a busy CPU)")
    p.add_argument("--control-threads", type=int, default=2, help="the control: float32 with this many threads")
    p.add_argument("--int8-block", type=int, default=kv_cache.INT8_BLOCK, help="values per int8 scale")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts only (a quick look)")
    args = p.parse_args(argv)
    kv_cache.INT8_BLOCK = args.int8_block  # read by int8_block() when a cache is built
    torch.set_num_threads(args.threads)
    model, tok = attnlab.from_pretrained("smollm2", dtype=args.weights)
    rows = []
    for text in PROMPTS[: args.prompts]:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        idx = torch.tensor([ids])  # (1, T)
        ref = attnlab.generate(model, idx, NEW, temperature=0)[0, len(ids) :].tolist()
        row: dict[str, object] = {"prompt": text, "float32": tok.decode(ref)}
        base = forced_logits(model, idx, ref, None)  # (NEW, V)
        if base.argmax(-1).tolist() != ref:
            raise SystemExit(f"teacher forcing is not the float32 cache's own decode on {text!r}: a bug in this script")
        for kv in ["control", *args.kv_dtypes]:
            torch.set_num_threads(args.control_threads if kv == "control" else args.threads)
            ours = attnlab.generate(model, idx, NEW, temperature=0, kv_dtype=None if kv == "control" else kv)
            ours = ours[0, len(ids) :].tolist()
            forced = forced_logits(model, idx, ref, None if kv == "control" else kv)  # (NEW, V)
            torch.set_num_threads(args.threads)
            row[kv] = {
                "first_difference": first_difference(ours, ref),
                "equal_positions": sum(a == b for a, b in zip(ours, ref, strict=True)),
                "forced_top1": int((forced.argmax(-1) == base.argmax(-1)).sum()),
                "forced_max_logit_diff": float((forced - base).abs().max()),
                "text": tok.decode(ours),
            }
        rows.append(row)
        cells = " ".join(
            f"{row[kv]['first_difference']:>3}/{row[kv]['forced_top1']:>2}"  # type: ignore[index]
            for kv in ["control", *args.kv_dtypes]
        )
        print(f"{cells}  {text}", flush=True)
    totals = {
        kv: {
            "strict": sum(r[kv]["first_difference"] for r in rows) / (NEW * len(rows)),  # type: ignore[index]
            "positionwise": sum(r[kv]["equal_positions"] for r in rows) / (NEW * len(rows)),  # type: ignore[index]
            "teacher_forced_top1": sum(r[kv]["forced_top1"] for r in rows) / (NEW * len(rows)),  # type: ignore[index]
            "max_logit_diff": max(r[kv]["forced_max_logit_diff"] for r in rows),  # type: ignore[index]
        }
        for kv in ["control", *args.kv_dtypes]
    }
    report = {
        "cpu": cpu_info()["model"],
        "kernels": kernel_status().describe(),
        "weights": args.weights,
        "threads": args.threads,
        "control_threads": args.control_threads,
        "int8_block": args.int8_block,
        "new_tokens": NEW,
        "totals": totals,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    for kv, t in totals.items():
        print(f"{kv}: {100 * t['strict']:.1f}% of the first {NEW} tokens before the first difference, "
              f"{100 * t['positionwise']:.1f}% equal position by position, teacher-forced top-1 "
              f"{100 * t['teacher_forced_top1']:.1f}%, largest logit difference {t['max_logit_diff']:.3f}")  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
