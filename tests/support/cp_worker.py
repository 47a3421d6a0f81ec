"""Run under ``torchrun --nproc-per-node N``: every context-parallel case against single-process attention.

``python -m torch.distributed.run --standalone --nproc-per-node N tests/support/cp_worker.py OUT.json``

Each case builds the same module and inputs on every rank (one seed), runs it once on the full
sequence (the reference) and once sharded with ``context_parallel``, and records the largest error
of the output, of dX and of every parameter's gradient (module level), and of out, dQ, dK, dV
(``cp.attend`` against :func:`attnlab.core.variants.variant_math`, function level). Rank 0 writes
one JSON object; ``tests/test_distributed.py`` asserts the bounds. Errors a case expects are caught
on every rank and recorded with their message.
"""

from __future__ import annotations

import datetime
import json
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from attnlab import MultiHeadAttention
from attnlab.core.masks import Masks
from attnlab.core.variants import Structure, alibi_slopes, document_runs, variant_math
from attnlab.distributed import ContextParallel, ring

TILE = ring.TILE
B, E, H = 2, 32, 4
D = E // H


def _inputs(case: dict[str, Any], dtype: torch.dtype) -> tuple[Any, ...]:
    T = case["T"]
    x = torch.randn(B, T, E, dtype=dtype)
    kpm = None
    if case.get("pad"):
        kpm = torch.zeros(B, T, dtype=torch.bool)
        kpm[0, -3:] = True  # right padding
        kpm[1, :2] = True  # left padding
        if case["pad"] == "all":
            kpm[1] = True  # a row whose every key is padding: zeros, not NaN
    docs = None
    if case.get("docs"):
        starts = torch.rand(B, T) < 0.25
        starts[:, 0] = True
        docs = starts.long().cumsum(1) * 7 % 5  # ids repeat: a document is a run, as the module defines it
    return x, kpm, docs


def _module(case: dict[str, Any], dtype: torch.dtype) -> MultiHeadAttention:
    mha = MultiHeadAttention(
        E,
        H,
        num_kv_heads=case.get("G", H),
        window=case.get("window"),
        softcap=case.get("softcap"),
        alibi=case.get("alibi", False),
        sinks=case.get("sinks", False),
        qk_norm=case.get("qk_norm", False),
    ).to(dtype)
    with torch.no_grad():
        for p in mha.parameters():  # nonzero biases, sinks and norm weights: every gradient is exercised
            if p.dim() == 1:
                p.normal_(0.0, 0.5)
    return mha


def _err(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max of |a - b| / (2e-6 + 1e-5 |b|): <= 1 is PyTorch's fp32 bar)."""
    d = (a.detach().double() - b.detach().double()).abs()
    return float(d.max()), float((d / (2e-6 + 1e-5 * b.double().abs())).max())


def module_case(case: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    torch.manual_seed(case.get("seed", 0))
    mha = _module(case, dtype)
    x, kpm, docs = _inputs(case, dtype)
    x.requires_grad_(True)
    causal = case["causal"]
    ref = mha(x, is_causal=causal, key_padding_mask=kpm, document_ids=docs)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    g_ref = {n: p.grad.clone() for n, p in mha.named_parameters()}
    gx_ref = x.grad.clone()
    mha.zero_grad()
    x.grad = None
    cp = ContextParallel(layout=case["layout"], method=case["method"], record_events=case.get("events", False))
    x_l = cp.shard(x, dim=1)
    extra: dict[str, Any] = {}
    if kpm is not None:
        extra["key_padding_mask"] = cp.shard(kpm, dim=1)
    if docs is not None:
        extra["document_ids"] = cp.shard(docs, dim=1)
    cp.reset_stats()
    y_l = mha(x_l, is_causal=causal, context_parallel=cp, **extra)
    fwd_bytes, pairs = cp.stats.bytes_sent, cp.stats.pairs  # before the backward adds its bytes
    y = cp.gather(y_l, dim=1)
    (y * w).sum().backward()
    cp.all_reduce_grads(mha)
    gx = x.grad.clone()
    dist.all_reduce(gx)  # each rank's x.grad holds its own positions (dQ here, dK/dV home from the ring)
    out = {"out": _err(y, ref), "dx": _err(gx, gx_ref)}
    out["params"] = {n: _err(p.grad, g_ref[n]) for n, p in mha.named_parameters()}
    if dtype == torch.float32:  # flash-attention's rule: both fp32 runs against the fp64 truth
        truth = _module(case, torch.float64)
        truth.load_state_dict(mha.state_dict())
        x64 = x.detach().double().requires_grad_(True)
        y64 = truth(x64, is_causal=causal, key_padding_mask=kpm, document_ids=None if docs is None else docs)
        (y64 * w.double()).sum().backward()
        t = {n: p.grad for n, p in truth.named_parameters()}
        out["params_vs_truth"] = {
            n: (_err(p.grad, t[n])[0], _err(g_ref[n], t[n])[0]) for n, p in mha.named_parameters()
        }  # (context parallel, single process) max abs error against fp64
        out["dx_vs_truth"] = (_err(gx, x64.grad)[0], _err(gx_ref, x64.grad)[0])
    out["nan"] = bool(torch.isnan(y).any() or torch.isnan(gx).any())
    every = [None] * cp.world
    stats = cp.stats
    dist.all_gather_object(
        every,
        {
            "pairs": pairs,
            "fwd_bytes": fwd_bytes,
            "bytes": stats.bytes_sent,
            "blocks": stats.blocks,
            "skipped": stats.skipped,
        },
    )
    out["ranks"] = every
    out["L"] = cp.plan().local
    if case.get("events"):
        out["events"] = cp.stats.events
    return out


def function_case(case: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``cp.attend`` on raw q, k, v against variant_math on the full sequence: out, dQ, dK, dV."""
    torch.manual_seed(case.get("seed", 0) + 1)
    T, G = case["T"], case.get("G", H)
    q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, G, T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, G, T, D, dtype=dtype, requires_grad=True)
    _, kpm, docs = _inputs(case, dtype)
    sinks = torch.randn(H, dtype=dtype, requires_grad=True) if case.get("sinks") else None
    alibi = alibi_slopes(H).to(dtype) if case.get("alibi") else None
    scale = D**-0.5
    st = Structure(
        q_pos=torch.arange(T),
        k_pos=torch.arange(T),
        causal=case["causal"],
        window=case.get("window"),
        softcap=case.get("softcap"),
        alibi=alibi,
        sinks=sinks,
        q_doc=None if docs is None else document_runs(docs),
        k_doc=None if docs is None else document_runs(docs),
    )
    masks = Masks(keep=None if kpm is None else ~kpm[:, None, None, :], empty_rows=True)
    ref, _ = variant_math(q, k, v, masks, st, scale=scale)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    grads_ref = [t.grad.clone() for t in (q, k, v)] + ([sinks.grad.clone()] if sinks is not None else [])
    for t in (q, k, v, sinks):
        if t is not None:
            t.grad = None
    cp = ContextParallel(layout=case["layout"], method=case["method"])
    shards = [cp.shard(t, dim=2) for t in (q, k, v)]
    y_l = cp.attend(
        *shards,
        scale=scale,
        is_causal=case["causal"],
        key_padding_mask=None if kpm is None else cp.shard(kpm, dim=1),
        document_ids=None if docs is None else cp.shard(docs, dim=1),
        window=case.get("window"),
        softcap=case.get("softcap"),
        alibi=alibi,
        sinks=sinks,
    )
    y = cp.gather(y_l, dim=2)
    (y * w).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for g in grads:
        dist.all_reduce(g)
    if sinks is not None:
        g = sinks.grad.clone()
        dist.all_reduce(g)  # a parameter: each rank holds its queries' share
        grads.append(g)
    names = ["dq", "dk", "dv", "dsinks"]
    out = {"out": _err(y, ref)}
    out.update({names[i]: _err(g, r) for i, (g, r) in enumerate(zip(grads, grads_ref, strict=True))})
    return out


def model_case(case: dict[str, Any]) -> dict[str, Any]:
    """A decoder (TinyGPT with learned or rotary positions, Llama) sharded: logits and every parameter gradient."""
    from attnlab import GPTConfig, TinyGPT
    from attnlab.models.llama import Llama, LlamaConfig

    torch.manual_seed(5)
    T, V, G = case["T"], 50, case["G"]
    if case["model"] == "llama":
        model: Any = Llama(LlamaConfig(vocab_size=V, n_layer=2, n_head=4, n_kv_head=G, n_embd=32, intermediate_size=64))
    else:
        position = "rotary" if case["model"] == "gpt-rotary" else "learned"
        config = GPTConfig(
            vocab_size=V, block_size=T, n_layer=2, n_head=4, n_kv_head=G, n_embd=32, dropout=0.0, position=position
        )
        model = TinyGPT(config)
    model = model.double()
    idx = torch.randint(0, V, (B, T))
    kpm = torch.zeros(B, T, dtype=torch.bool)
    kpm[1, :3] = True
    ref = model(idx, key_padding_mask=kpm)
    w = torch.randn_like(ref)
    (ref * w).sum().backward()
    g_ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    cp = ContextParallel(layout=case["layout"], method=case["method"])
    logits = cp.gather(model(cp.shard(idx), key_padding_mask=cp.shard(kpm), context_parallel=cp))
    (logits * w).sum().backward()
    cp.all_reduce_grads(model)
    return {
        "out": _err(logits, ref),
        "params": {n: _err(p.grad, g_ref[n]) for n, p in model.named_parameters()},
    }


def cases(N: int, quick: bool) -> list[dict[str, Any]]:
    """The families: methods x layouts x causal x MHA/GQA/MQA x even/uneven T, then each variant.

    ``quick`` (the 4-process run in CI) keeps one GQA head count and the uneven length of the first family."""
    out: list[dict[str, Any]] = []
    even = 4 * N  # divisible by 2N: no padding
    for method in ("ring", "alltoall"):
        for layout in ("zigzag", "contiguous"):
            for causal in (False, True):
                for G in (H // 2,) if quick else (H, H // 2, 1):
                    for T in (even + 3,) if quick else (even, even + 3):
                        out.append(dict(method=method, layout=layout, causal=causal, G=G, T=T, dtype="float64"))
            variants: list[dict[str, Any]] = [
                dict(window=3),
                dict(window=2 * N + 1, G=2),
                dict(softcap=2.0),
                dict(alibi=True),
                dict(sinks=True),
                dict(docs=True),
                dict(pad="some"),
                dict(pad="all", G=2),
                dict(qk_norm=True),
                dict(window=4, docs=True, pad="some", alibi=True),
            ]
            for i, var in enumerate(variants):
                case = dict(method=method, layout=layout, causal=True, G=H, T=even + 1 + 2 * (i % 2), dtype="float64")
                out.append({**case, **var, "seed": i})
            out.append(
                dict(
                    method=method, layout=layout, causal=False, G=H, T=even + 3, pad="some", alibi=True, dtype="float64"
                )
            )
            for causal in (False, True):
                G = 2 if method == "ring" else H  # alltoall: G divisible by N = 4 too
                out.append(dict(method=method, layout=layout, causal=causal, G=G, T=6 * N + 5, dtype="float32", seed=3))
    for layout in ("zigzag", "contiguous"):  # chunks longer than a tile: tiles of 3 rows (ring.TILE patched)
        for extra in ({}, {"window": 5, "pad": "some"}, {"causal": False}):
            out.append(
                {**dict(method="ring", layout=layout, causal=True, G=2, T=8 * N + 3, dtype="float64", tile=3), **extra}
            )
    out.append(dict(method="ring", layout="zigzag", causal=True, G=2, T=even, dtype="float64", events=True))
    for layout in ("zigzag", "contiguous"):  # causal balance on a longer sequence
        out.append(dict(method="ring", layout=layout, causal=True, G=H, T=16 * N, dtype="float64", balance=True))
    for model in ("gpt-learned", "gpt-rotary", "llama"):
        for method, layout in (("ring", "zigzag"), ("alltoall", "contiguous")):
            G = 2 if method == "ring" else H  # GQA on the ring; alltoall needs G divisible by N
            out.append(dict(model=model, method=method, layout=layout, G=G, T=6 * N + 1, dtype="float64"))
    return out


def errors(cp_world: int) -> dict[str, str]:
    """Each refusal's message, raised on every rank."""
    got: dict[str, str] = {}
    rank = dist.get_rank()
    mha = MultiHeadAttention(E, H).double()
    x = torch.randn(B, 8 * cp_world, E, dtype=torch.float64)

    def catch(name: str, fn: Any) -> None:
        try:
            fn()
            got[name] = "no error"
        except ValueError as err:
            got[name] = str(err)

    cp = ContextParallel()
    x_l = cp.shard(x)
    kpm = torch.zeros(B, x.size(1), dtype=torch.bool)
    catch("full_mask", lambda: mha(x_l, key_padding_mask=kpm, context_parallel=cp))
    catch("full_input", lambda: mha(x, context_parallel=cp))
    other = x if rank == 0 else torch.randn(B, 8 * cp_world + 2 * cp_world, E, dtype=torch.float64)
    catch("lengths", lambda: mha(cp.shard(other), context_parallel=cp))  # ranks shard sequences of different T
    cp.shard(x)
    short = x_l[:, :-1] if rank == 1 else x_l
    catch("one_rank_short", lambda: mha(short, context_parallel=cp))  # only rank 1's shard is wrong
    catch("gather_short", lambda: cp.gather(short))
    a2a = ContextParallel(method="alltoall")
    a2a.shard(x)
    mqa = MultiHeadAttention(E, H, num_kv_heads=1).double()
    catch("alltoall_heads", lambda: mqa(x_l, context_parallel=a2a))
    return got


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, N = dist.get_rank(), dist.get_world_size()
    results: dict[str, Any] = {"world": N, "cases": []}
    for case in cases(N, quick="--quick" in sys.argv):
        dtype = getattr(torch, case["dtype"])
        entry: dict[str, Any] = {"case": case}
        ring.TILE = case.get("tile", TILE)
        try:
            if "model" in case:
                entry["model"] = model_case(case)
                results["cases"].append(entry)
                continue
            entry["module"] = module_case(case, dtype)
            entry["function"] = function_case(case, dtype)
        except ValueError as err:
            entry["refused"] = str(err)
        except Exception:
            entry["crash"] = traceback.format_exc()
        results["cases"].append(entry)
    results["errors"] = errors(N)
    every: list[Any] = [None] * N
    dist.all_gather_object(every, results["errors"])
    results["errors_by_rank"] = every
    if rank == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
