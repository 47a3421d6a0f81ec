"""One runner of ``bench-decode --prompt-lengths`` in a process of its own, so that its peak resident set is its own.

Run as a script (``python lengths_worker.py RUNNER MODEL THREADS N_CTX [KV_DTYPE]``), not as a module: the llama.cpp
runner then imports neither torch nor attnlab, as a llama.cpp user's process would not, and may run under
another interpreter (``--llama-python``). RUNNER is ``attnlab``, ``llama.cpp`` or ``llama.cpp-fa`` (its
flash-attention option on); KV_DTYPE, attnlab's only, is the cache's storage (``float16``, ``int8``, ...; leave it
out for the compute dtype). It reads one JSON command a line on stdin and answers one JSON line on stdout:

* ``{"cmd": "generate", "ids": [...], "n": N}``: greedy, up to N new tokens after the prompt ids, in one run whose
  every token is timed as it comes out of the runner's iterator (:func:`timed_tokens`); ``{"first_s": s,
  "last_s": s, "tokens": [...]}``: seconds from the call to the first token (the prefill and its sampling) and to
  the last, and the tokens produced (fewer than N where the runner stopped early);
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
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import IO, Any

__all__ = ["greedy_llama_cpp", "proc_status", "reset_peak_rss", "serve", "timed_tokens"]

# A runner: (prompt ids, new tokens) -> an iterator of the new tokens, each yielded as soon as it is chosen.
Runner = Callable[[list[int], int], Iterable[int]]


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


def timed_tokens(
    start: Callable[[], Iterable[int]], n: int, clock: Callable[[], float] = time.perf_counter
) -> dict[str, Any]:
    """Up to ``n`` tokens of the iterator ``start()`` returns, each stamped when it comes out; one run.

    Returns ``{"first_s", "last_s", "tokens"}``: seconds from the call of ``start`` to the first token (time to
    first token: the prefill and the first sampling) and to the last (None for both where none came), and the
    tokens produced. The decode rate of the run is ``(len(tokens) - 1) / (last_s - first_s)``: the prefill is in
    neither end, so its noise does not enter it.
    """
    t0 = clock()
    tokens: list[int] = []
    first = last = None
    it = iter(start())
    try:
        for token in it:
            last = clock() - t0
            first = last if first is None else first
            tokens.append(int(token))
            if len(tokens) >= n:
                break
    finally:
        close = getattr(it, "close", None)  # a generator's clean-up (thread counts put back) now, not at GC
        if close is not None:
            close()
    return {"first_s": first, "last_s": last, "tokens": tokens}


def greedy_llama_cpp(llm: Any, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from a ``llama_cpp.Llama`` after ``prompt``, its state reset first."""
    return list(_llama_cpp_tokens(llm, prompt, n))


def _llama_cpp_tokens(llm: Any, prompt: list[int], n: int) -> Iterator[int]:
    """``llm``'s greedy tokens after ``prompt`` as its ``generate`` iterator yields them, its state reset first (no
    prefix of an earlier prompt reused); stops after ``n``, before evaluating the last one."""
    llm.reset()
    produced = 0
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        yield int(token)
        produced += 1
        if produced == n:
            return


def _llama_cpp(path: str, threads: str, n_ctx: int, flash: bool) -> Runner:
    from llama_cpp import Llama

    params = inspect.signature(Llama.__init__).parameters
    extra: dict[str, Any] = {}
    if "flash_attn_type" in params:  # newer llama.cpp: an enum, -1 auto, 0 off, 1 on
        extra["flash_attn_type"] = 1 if flash else 0
    elif "flash_attn" in params:
        extra["flash_attn"] = flash
    n_threads = None if threads == "auto" else int(threads)
    llm = Llama(model_path=path, n_threads=n_threads, n_ctx=n_ctx, n_batch=n_ctx, verbose=False, **extra)
    return lambda ids, n: _llama_cpp_tokens(llm, ids, n)


def _attnlab(path: str, threads: str, kv_dtype: str | None) -> Runner:
    import torch

    from attnlab.models.generation import generate_steps
    from attnlab.runtime import release_freed_heap
    from attnlab.runtime.threads import check_threads
    from attnlab.weight_files.pretrained import from_pretrained

    chosen = check_threads("--threads", threads)
    if isinstance(chosen, int):
        torch.set_num_threads(chosen)
    model: Any
    model, _ = from_pretrained(path, dtype="gguf")
    release_freed_heap()

    def run(ids: list[int], n: int) -> Iterator[int]:
        steps = generate_steps(
            model,
            torch.tensor([ids]),
            n,
            temperature=0,
            threads=chosen if chosen == "auto" else None,
            kv_dtype=kv_dtype,
        )
        return (int(step.tokens[0]) for step in steps)

    return run


def serve(run: Runner, lines: Iterable[str], out: IO[str], clock: Callable[[], float] = time.perf_counter) -> None:
    """Answer each JSON command of ``lines`` (see the module's docstring) on ``out``, one line each."""
    for line in lines:
        cmd = json.loads(line)
        if cmd["cmd"] == "generate":
            answer = timed_tokens(partial(run, cmd["ids"], cmd["n"]), cmd["n"], clock)
        elif cmd["cmd"] == "reset_peak":
            answer = {"ok": reset_peak_rss()}
        else:
            answer = {"rss": proc_status("VmRSS"), "rss_peak": proc_status("VmHWM")}
        print(json.dumps(answer), file=out, flush=True)


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))  # run as a script, its folder comes first on sys.path,
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # where memory.py would shadow
    runner, path, threads, n_ctx = argv[0], argv[1], argv[2], int(argv[3])
    kv_dtype = argv[4] if len(argv) > 4 else None
    try:
        if runner == "attnlab":
            run = _attnlab(path, threads, kv_dtype)
        else:
            run = _llama_cpp(path, threads, n_ctx, flash=runner == "llama.cpp-fa")
    except Exception as err:  # reported to the parent, which leaves the runner out and says why
        print(json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
        return 1
    print(json.dumps({"ready": True, "rss": proc_status("VmRSS")}), flush=True)
    serve(run, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
