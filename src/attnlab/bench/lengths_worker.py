"""One runner of ``bench-decode --prompt-lengths`` in a process of its own, so that its peak resident set is its own.

Run as a script (``python lengths_worker.py RUNNER MODEL THREADS N_CTX``), not as a module: the llama.cpp
runner then imports neither torch nor attnlab, as a llama.cpp user's process would not, and may run under
another interpreter (``--llama-python``). RUNNER is ``attnlab``, ``llama.cpp`` or ``llama.cpp-fa`` (its
flash-attention option on). It reads one JSON command a line on stdin and answers one JSON line on stdout:

* ``{"cmd": "generate", "ids": [...], "n": N}``: greedy, N new tokens after the prompt ids; ``{"seconds": s,
  "tokens": [...]}`` (the new tokens), timed inside this process;
* ``{"cmd": "reset_peak"}``: the peak resident set restarts from the current one (``/proc/self/clear_refs``);
* ``{"cmd": "peak"}``: ``{"rss": bytes, "rss_peak": bytes}``.

Its first line says ``{"ready": true, "rss": bytes}`` once the model is loaded, or ``{"error": "..."}``.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["greedy_llama_cpp", "proc_status", "reset_peak_rss"]


def proc_status(key: str) -> int:
    """A byte count of ``/proc/self/status`` (``VmRSS``, ``VmHWM``: the peak resident set); 0 where there is none."""
    try:
        with open("/proc/self/status") as fh:
            m = re.search(rf"{key}:\s+(\d+) kB", fh.read())
    except OSError:
        return 0
    return int(m.group(1)) * 1024 if m else 0


def reset_peak_rss() -> bool:
    """Restart ``VmHWM`` from the current resident set (Linux); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def greedy_llama_cpp(llm: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from a ``llama_cpp.Llama`` after ``prompt``, its state reset first."""
    llm.reset()
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(int(token))
        if len(out) == n:
            break
    return out


def _llama_cpp(path: str, threads: str, n_ctx: int, flash: bool) -> Callable[[list[int], int], list[int]]:
    from llama_cpp import Llama

    params = inspect.signature(Llama.__init__).parameters
    extra: dict[str, Any] = {}
    if "flash_attn_type" in params:  # newer llama.cpp: an enum, -1 auto, 0 off, 1 on
        extra["flash_attn_type"] = 1 if flash else 0
    elif "flash_attn" in params:
        extra["flash_attn"] = flash
    n_threads = None if threads == "auto" else int(threads)
    llm = Llama(model_path=path, n_threads=n_threads, n_ctx=n_ctx, n_batch=n_ctx, verbose=False, **extra)
    return lambda ids, n: greedy_llama_cpp(llm, ids, n)


def _attnlab(path: str, threads: str) -> Callable[[list[int], int], list[int]]:
    import torch

    from attnlab.models.generation import generate
    from attnlab.runtime import release_freed_heap
    from attnlab.runtime.threads import check_threads
    from attnlab.weight_files.pretrained import from_pretrained

    chosen = check_threads("--threads", threads)
    if isinstance(chosen, int):
        torch.set_num_threads(chosen)
    model: Any
    model, _ = from_pretrained(path, dtype="gguf")
    release_freed_heap()

    def run(ids: list[int], n: int) -> list[int]:
        out = generate(model, torch.tensor([ids]), n, temperature=0, threads=chosen if chosen == "auto" else None)
        return [int(t) for t in out[0, len(ids) :]]

    return run


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))  # run as a script, its folder comes first on sys.path,
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # where memory.py would shadow
    runner, path, threads, n_ctx = argv[0], argv[1], argv[2], int(argv[3])
    try:
        if runner == "attnlab":
            run = _attnlab(path, threads)
        else:
            run = _llama_cpp(path, threads, n_ctx, flash=runner == "llama.cpp-fa")
    except Exception as err:  # reported to the parent, which leaves the runner out and says why
        print(json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
        return 1
    print(json.dumps({"ready": True, "rss": proc_status("VmRSS")}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "generate":
            start = time.perf_counter()
            tokens = run(cmd["ids"], cmd["n"])
            answer: dict[str, Any] = {"seconds": time.perf_counter() - start, "tokens": tokens}
        elif cmd["cmd"] == "reset_peak":
            answer = {"ok": reset_peak_rss()}
        else:
            answer = {"rss": proc_status("VmRSS"), "rss_peak": proc_status("VmHWM")}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
