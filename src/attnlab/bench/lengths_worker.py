"""One runner of ``bench-decode --prompt-lengths`` in a process of its own, so that its peak resident set is its own.

Run as a script (``python lengths_worker.py RUNNER MODEL THREADS N_CTX BATCH [KV_DTYPE]``), not as a module: the
llama.cpp runner then imports neither torch nor attnlab, as a llama.cpp user's process would not, and may run
under another interpreter (``--llama-python``). RUNNER is ``attnlab``, ``llama.cpp`` or ``llama.cpp-fa`` (its
flash-attention option on); N_CTX the positions one sequence needs; BATCH the sequences decoded at once (1: one
prompt, as ``attnlab generate`` and llama-cpp-python's ``Llama.generate`` run it; more: attnlab's batched
``generate_steps``, and llama.cpp's own multi-sequence batching, :class:`LlamaCppBatch`); KV_DTYPE, attnlab's only,
is the cache's storage (``float16``, ``int8``, ...; leave it out for the compute dtype). It reads one JSON command
a line on stdin and answers one JSON line on stdout:

* ``{"cmd": "generate", "ids": [...], "n": N}``: greedy, up to N new tokens after the prompt ids (with BATCH > 1,
  a list of BATCH rows of ids), in one run whose every step is timed as it comes out of the runner's iterator
  (:func:`timed_tokens`); ``{"first_s": s, "last_s": s, "tokens": [...]}``: seconds from the call to the first
  token (the prefill and its sampling) and to the last, and the tokens produced, one per step (with BATCH > 1,
  one list of BATCH tokens per step; fewer than N steps where the runner stopped early); attnlab's may add
  ``"kv": "int8"`` (or null: the compute dtype), the cache of that run in place of KV_DTYPE;
* ``{"cmd": "reset_peak"}``: the peak resident set restarts from the current one (``/proc/self/clear_refs``);
* ``{"cmd": "peak"}``: ``{"rss": bytes, "rss_peak": bytes}``.

Its first line says ``{"ready": true, "rss": bytes}`` once the model is loaded, or ``{"error": "..."}``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import IO, Any

__all__ = ["LlamaCppBatch", "greedy_llama_cpp", "proc_status", "reset_peak_rss", "serve", "timed_tokens"]

# A runner: (prompt ids, new tokens) -> an iterator of the new tokens, each yielded as soon as it is chosen; batched,
# (rows of prompt ids, new tokens) -> an iterator of one list of tokens (one per row) per step.
Runner = Callable[[Any, int], Iterable[Any]]


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
    tokens produced (an int per step, or a list of ints where a batched runner yields one per row). The decode
    rate of the run is ``(len(tokens) - 1) / (last_s - first_s)`` steps a second: the prefill is in neither end,
    so its noise does not enter it.
    """
    t0 = clock()
    tokens: list[Any] = []
    first = last = None
    it = iter(start())
    try:
        for token in it:
            last = clock() - t0
            first = last if first is None else first
            tokens.append([int(t) for t in token] if isinstance(token, (list, tuple)) else int(token))
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


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null meanwhile: what a C library writes there directly, unseen."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class LlamaCppBatch:
    """llama.cpp decoding ``batch`` sequences at once through its own multi-sequence batching (llama-cpp-python's
    low-level API: ``Llama`` has no batched generation), greedy on each.

    One context of ``n_seq_max = batch`` sequences, each its own K/V stream (``kv_unified`` off, llama.cpp's
    default and its advice for sequences that share no prefix) of ``n_ctx`` positions. A run clears the memory,
    sends every row's prompt in one ``llama_decode`` call (row ``r`` as sequence ``r``, logits kept for its last
    token only; llama.cpp splits the call into its physical batches of ``n_ubatch``, 512), then one call a step
    holding each row's last token, and takes each row's argmax of ``llama_get_logits_ith`` (the first maximum,
    as llama.cpp's greedy sampler). Threads as ``Llama`` sets them: ``threads`` (auto: half the CPUs) for
    one-token batches and the CPU count for larger ones (``n_threads_batch``, which every batched step uses),
    or ``threads`` for both where given.
    """

    def __init__(self, path: str, threads: str, n_ctx: int, batch: int, flash: bool) -> None:
        import logging
        import multiprocessing

        import llama_cpp as lc
        import numpy as np

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback's level: errors only
        self.lc, self.np, self.batch = lc, np, batch
        with _quiet_stderr():  # llama.cpp's loading notes, as Llama(verbose=False) silences them
            lc.llama_backend_init()
            self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        params = lc.llama_context_default_params()
        params.n_seq_max = batch
        n_ctx = -(-n_ctx // 256) * 256  # llama.cpp pads a sequence's context to 256 (and warns where it must)
        params.n_ctx = batch * n_ctx  # split evenly between the sequences (kv_unified off)
        params.n_batch = batch * n_ctx  # every prompt in one llama_decode call
        params.n_ubatch = min(512, params.n_batch)  # Llama's default physical batch
        params.kv_unified = False
        cpus = multiprocessing.cpu_count()
        params.n_threads = max(cpus // 2, 1) if threads == "auto" else int(threads)
        params.n_threads_batch = cpus if threads == "auto" else int(threads)
        params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        with _quiet_stderr():
            self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context of {batch} sequences of {n_ctx} positions")
        self.capacity = batch * n_ctx
        self.llama_batch = lc.llama_batch_init(self.capacity, 0, 1)

    def _fill(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """The batch's tokens: ``(token, position, sequence, logits kept)`` each."""
        b = self.llama_batch
        for i, (token, pos, seq, keep) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = keep
        b.n_tokens = len(entries)
        code = self.lc.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for a batch of {len(entries)} tokens")

    def _argmax(self, index: int) -> int:
        logits = self.np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))
        return int(logits.argmax())

    def tokens(self, rows: list[list[int]], n: int) -> Iterator[list[int]]:
        """Greedy tokens after each row's prompt, one list (a token per row) per step; stops after ``n`` steps,
        before evaluating the last."""
        if len(rows) != self.batch or len({len(r) for r in rows}) != 1:
            raise ValueError(f"expected {self.batch} prompts of one length, got lengths {[len(r) for r in rows]}")
        length = len(rows[0])
        if len(rows) * length > self.capacity:
            raise ValueError(f"{len(rows)} prompts of {length} tokens exceed the context's {self.capacity}")
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        self._fill([(t, p, r, p == length - 1) for r, row in enumerate(rows) for p, t in enumerate(row)])
        step = [self._argmax((r + 1) * length - 1) for r in range(len(rows))]
        for i in range(n):
            yield step
            if i == n - 1:
                return
            self._fill([(t, length + i, r, True) for r, t in enumerate(step)])
            step = [self._argmax(r) for r in range(len(rows))]

    def close(self) -> None:
        self.lc.llama_batch_free(self.llama_batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def _attnlab(path: str, threads: str, kv_dtype: str | None, batched: bool = False) -> Runner:
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

    def run(ids: list[int] | list[list[int]], n: int, kv: str | None = kv_dtype) -> Iterator[Any]:
        rows = ids if batched else [ids]
        steps = generate_steps(
            model,
            torch.tensor(rows),
            n,
            temperature=0,
            threads=chosen if chosen == "auto" else None,
            kv_dtype=kv,
        )
        return (step.tokens.tolist() if batched else int(step.tokens[0]) for step in steps)

    return run


def serve(run: Runner, lines: Iterable[str], out: IO[str], clock: Callable[[], float] = time.perf_counter) -> None:
    """Answer each JSON command of ``lines`` (see the module's docstring) on ``out``, one line each."""
    for line in lines:
        cmd = json.loads(line)
        if cmd["cmd"] == "generate":
            more = {"kv": cmd["kv"]} if "kv" in cmd else {}  # attnlab's alone
            answer = timed_tokens(partial(run, cmd["ids"], cmd["n"], **more), cmd["n"], clock)
        elif cmd["cmd"] == "reset_peak":
            answer = {"ok": reset_peak_rss()}
        else:
            answer = {"rss": proc_status("VmRSS"), "rss_peak": proc_status("VmHWM")}
        print(json.dumps(answer), file=out, flush=True)


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))  # run as a script, its folder comes first on sys.path,
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # where memory.py would shadow
    runner, path, threads, n_ctx, batch = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    kv_dtype = argv[5] if len(argv) > 5 else None
    try:
        if runner == "attnlab":
            run = _attnlab(path, threads, kv_dtype, batched=batch > 1)
        elif batch > 1:
            run = LlamaCppBatch(path, threads, n_ctx, batch, flash=runner == "llama.cpp-fa").tokens
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
