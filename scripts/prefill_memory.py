"""Resident memory of an attnlab process through SmolLM2's GGUF load and a generation at each prompt length (issue 51).

    PYTHONPATH=src python scripts/prefill_memory.py --kv-dtype float16 --lengths 32,2048,8128

Prints the RSS (anonymous and file-backed) after ``import torch``, after ``from_pretrained(dtype="gguf")`` and after
``release_freed_heap()``, then per length the peak RSS (``VmHWM``, restarted before each) of a greedy generation of
``--new-tokens`` tokens. RSS is not disturbed by other load on the machine; the seconds printed beside it are.
"""

from __future__ import annotations

import argparse
import re
import time


def rss_line() -> str:
    """RSS of this process in MB, split into anonymous and file-backed pages (``/proc/self/smaps_rollup``)."""
    with open("/proc/self/smaps_rollup") as fh:
        text = fh.read()
    rss, anon = (int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) // 1024 for k in ("Rss", "Anonymous"))  # type: ignore[union-attr]
    return f"RSS {rss} MB (anon {anon}, file {rss - anon})"


def status_mb(key: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(rf"{key}:\s+(\d+) kB", fh.read()).group(1)) // 1024  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-dtype", default="float16", help="the KV cache: float32, float16, bfloat16 or int8")
    parser.add_argument("--lengths", default="32,2048,8128", help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    print("import torch:", rss_line())
    from attnlab.models.generation import generate
    from attnlab.runtime import release_freed_heap
    from attnlab.weight_files.pretrained import from_pretrained, smollm2_path

    torch.set_num_threads(args.threads)
    model, _ = from_pretrained(smollm2_path(), dtype="gguf")
    print("loaded:", rss_line(), f"(peak {status_mb('VmHWM')} MB)")
    release_freed_heap()
    print("after release_freed_heap():", rss_line())
    kv = None if args.kv_dtype == "float32" else args.kv_dtype
    for length in (int(x) for x in args.lengths.split(",")):
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # VmHWM restarts from the current RSS
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        start = time.perf_counter()
        generate(model, ids, args.new_tokens, temperature=0, kv_dtype=kv)
        print(
            f"prompt {length} + {args.new_tokens} new, KV cache {args.kv_dtype}: peak {status_mb('VmHWM')} MB, "
            f"after {rss_line()}; {time.perf_counter() - start:.1f} s (timing disturbed by load)"
        )


if __name__ == "__main__":
    main()
