"""How long attnlab's ``dtype="gguf"`` model and llama.cpp stay with the float32 model, on the same chat prompts.

For each fixed chat prompt (SmolLM2's chat template), 32 greedy tokens from three runners on the same
GGUF file: attnlab's float32-dequantized model (the reference), attnlab's ``dtype="gguf"`` model (the
file's blocks, int8 activations) and llama.cpp (llama-cpp-python, when it imports). Prints, per prompt,
the index of the first new token that differs from the float32 model's (32 = all equal), and the logits'
distance to the float32 model on the prompt's own tokens (teacher-forced, last 12 positions). Writes
the table and the CPU it ran on to ``--out`` as JSON.

    python scripts/gguf_greedy_agreement.py [--out docs/bench/gguf_agreement.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import attnlab
from attnlab.quant import kernel_status
from attnlab.runtime import cpu_info
from attnlab.weight_files.pretrained import smollm2_path

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Name three primary colors.",
    "What is 12 times 7?",
)
NEW = 32


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first position where ``a`` and ``b`` differ; their length when they agree throughout."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def llama_cpp_runner(path: Path, threads: int):
    """Greedy tokens and the prompt's logits from llama.cpp, or None (with the reason on stderr) when it is missing."""
    try:
        from llama_cpp import Llama as LlamaCpp
    except Exception as err:
        print(f"llama.cpp left out: llama_cpp does not import ({type(err).__name__})", file=sys.stderr)
        return None
    llm = LlamaCpp(model_path=str(path), n_threads=threads, n_ctx=512, n_batch=512, logits_all=True, verbose=False)

    def run(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        llm.reset()
        llm.eval(ids)
        logits = torch.tensor(llm.scores[: len(ids)])  # (T, V): the prompt's own positions
        llm.reset()
        out: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            out.append(int(token))
            if len(out) == NEW:
                break
        return out, logits

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gguf_agreement.json", help="where the JSON goes")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads and llama.cpp's threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = smollm2_path()
    # the reference: float32 by name, since from_pretrained's default ("auto") is gguf on a CPU
    mf, tok = attnlab.from_pretrained("smollm2", dtype="float32")
    mq, _ = attnlab.from_pretrained("smollm2", dtype="gguf")
    peer = llama_cpp_runner(path, torch.get_num_threads())
    rows = []
    for text in PROMPTS:
        chat = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]
        idx = torch.tensor([ids])
        with torch.no_grad():
            ref_logits, q_logits = mf(idx)[0], mq(idx)[0]  # (T, V)
        ref = attnlab.generate(mf, idx, NEW, temperature=0)[0, len(ids) :].tolist()
        ours = attnlab.generate(mq, idx, NEW, temperature=0)[0, len(ids) :].tolist()
        row = {
            "prompt": text,
            "float32": tok.decode(ref),
            "gguf_first_difference": first_difference(ours, ref),
            "gguf_text": tok.decode(ours),
            "gguf_logit_max": (q_logits - ref_logits)[-12:].abs().max().item(),
            "gguf_logit_mean": (q_logits - ref_logits)[-12:].abs().mean().item(),
        }
        if peer is not None:
            theirs, peer_logits = peer(ids)
            row |= {
                "llama_cpp_first_difference": first_difference(theirs, ref),
                "llama_cpp_text": tok.decode(theirs),
                "llama_cpp_logit_max": (peer_logits - ref_logits)[-12:].abs().max().item(),
                "llama_cpp_logit_mean": (peer_logits - ref_logits)[-12:].abs().mean().item(),
            }
        rows.append(row)
        peer_cell = f"{row['llama_cpp_first_difference']:>3}" if peer is not None else "  -"
        print(f"{row['gguf_first_difference']:>3} {peer_cell}  {text}")
    report = {
        "cpu": cpu_info() | {"flags": [f for f in cpu_info()["flags"] if f.startswith(("avx", "amx", "fma", "f16c"))]},
        "kernels": kernel_status().describe(),
        "threads": torch.get_num_threads(),
        "new_tokens": NEW,
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"first differing new token (of {NEW}): gguf, llama.cpp; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
