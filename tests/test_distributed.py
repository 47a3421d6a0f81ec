"""Context parallelism (``attnlab.distributed``) against single-process attention, on gloo, 2 and 4 processes.

The multi-process families run in ``tests/support/cp_worker.py`` (one ``torchrun`` per world size,
every case in it); the tests here read its JSON and assert the bounds: fp64 <= 1e-10; fp32 at
PyTorch's context-parallel bar (atol 2e-6, rtol 1e-5) for the output, dX, dQ, dK, dV, and at
flash-attention's rule for parameter gradients (at most 2x the single-process fp32 error against
the fp64 truth). Layout, refusals and in-process errors are tested without spawning.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from attnlab import MultiHeadAttention
from attnlab.distributed import ContextParallel, ShardPlan

ROOT = Path(__file__).resolve().parents[1]
H = 4  # the worker's heads


def _run_worker(tmp: Path, n: int, quick: bool) -> dict[str, Any]:
    out = tmp / f"cp{n}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    cmd += [str(ROOT / "tests" / "support" / "cp_worker.py"), str(out)] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


# N4 is slow (four processes on 2 cores); N2 keeps every property in the quick suite
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["N2", "N4"])
def run(request, tmp_path_factory) -> dict[str, Any]:
    n = request.param
    return _run_worker(tmp_path_factory.mktemp(f"cp{n}"), n, quick=n == 4)


def _computed(run: dict[str, Any]) -> list[dict[str, Any]]:
    crashed = [(e["case"], e["crash"][-1500:]) for e in run["cases"] if "crash" in e]
    assert not crashed, crashed
    return [e for e in run["cases"] if "module" in e]


def _errors(entry: dict[str, Any]) -> dict[str, float]:
    m, f = entry["module"], entry["function"]
    out = {"out": m["out"][0], "dx": m["dx"][0], **{f"grad {n}": v[0] for n, v in m["params"].items()}}
    out.update({f"attend {n}": v[0] for n, v in f.items()})
    return out


def test_float64_equals_single_process_within_1e10(run):
    """Output, dX, every parameter's gradient, and cp.attend's out/dQ/dK/dV (and dsinks), every family."""
    cases = [e for e in _computed(run) if e["case"]["dtype"] == "float64"]
    assert len(cases) >= 40
    assert len([e for e in cases if e["case"].get("tile")]) == 6
    worst = {json.dumps(e["case"]): max(_errors(e).items(), key=lambda kv: kv[1]) for e in cases}
    bad = {c: w for c, w in worst.items() if w[1] > 1e-10}
    assert not bad, bad
    assert not [e["case"] for e in cases if e["module"]["nan"]]
    families = {
        k for e in cases for k in ("window", "softcap", "alibi", "sinks", "docs", "pad", "qk_norm") if k in e["case"]
    }
    assert families == {"window", "softcap", "alibi", "sinks", "docs", "pad", "qk_norm"}
    for e in cases:  # the parameters compared are the module's all: sinks and norms included
        if e["case"].get("sinks"):
            assert "sinks" in e["module"]["params"] and "dsinks" in e["function"]
        if e["case"].get("qk_norm"):
            assert "q_norm.weight" in e["module"]["params"]


def test_float32_meets_pytorch_bar_and_flash_attention_rule(run):
    cases = [e for e in _computed(run) if e["case"]["dtype"] == "float32"]
    assert len(cases) == 8  # methods x layouts x causal
    for e in cases:
        m, f = e["module"], e["function"]
        for name, (_, ratio) in [("out", m["out"]), ("dx", m["dx"])] + [(f"attend {k}", v) for k, v in f.items()]:
            assert ratio <= 1.0, (e["case"], name, ratio)  # |a - b| <= 2e-6 + 1e-5 |b| everywhere
        for name, (cp_err, single_err) in m["params_vs_truth"].items():
            if name == "k_proj.bias":  # its true gradient is exactly 0 (softmax is shift-invariant): noise only
                assert cp_err <= 1e-5, (e["case"], name, cp_err)
            else:
                assert cp_err <= 2 * single_err, (e["case"], name, cp_err, single_err)


def test_refused_exactly_when_alltoall_heads_do_not_divide(run):
    n = run["world"]
    for e in run["cases"]:
        c = e["case"]
        if "model" in c:
            assert "model" in e, e  # the decoders' cases pick head counts every method takes
            continue
        indivisible = c["method"] == "alltoall" and (H % n or c.get("G", H) % n)
        assert ("refused" in e) == bool(indivisible), e
        if indivisible:
            assert e["refused"] == (
                f"method='alltoall' splits the heads over the {n} ranks, so num_heads ({H}) and num_kv_heads "
                f"({c.get('G', H)}) must both be divisible by {n}; use method='ring' (any head count) or a group "
                f"whose size divides both."
            )


def _structural_pairs(T: int, causal: bool, window: int | None) -> int:
    return sum(min(i + 1, window or T) if causal else T for i in range(T))


def test_pairs_over_ranks_are_exactly_the_structures(run):
    """No chunk pair is computed twice or dropped: the ranks' pair counts sum to the structure's, times H."""
    for e in _computed(run):
        c = e["case"]
        total = sum(r["pairs"] for r in e["module"]["ranks"])
        assert total == H * _structural_pairs(c["T"], c["causal"], c.get("window")), c


def test_zigzag_balances_causal_work_exactly(run):
    n = run["world"]
    balance = {e["case"]["layout"]: e for e in _computed(run) if e["case"].get("balance")}
    pairs = {lay: [r["pairs"] for r in e["module"]["ranks"]] for lay, e in balance.items()}
    assert max(pairs["zigzag"]) * n == sum(pairs["zigzag"])  # max / mean = 1.00 exactly
    c = balance["contiguous"]["module"]["L"]
    per_rank = [H * (r * c * c + c * (c + 1) // 2) for r in range(n)]  # r full blocks and the diagonal
    assert pairs["contiguous"] == per_rank
    ratio = max(per_rank) * n / sum(per_rank)
    assert abs(ratio - (2 * n - 1) / n) < 0.05 * (2 * n - 1) / n  # (2N-1)/N, up to the diagonal's half


def test_sliding_window_skips_ring_steps_outside_it(run):
    n = run["world"]
    for e in _computed(run):
        c, ranks = e["case"], e["module"]["ranks"]
        if c["method"] != "ring":
            continue
        skipped = sum(r["skipped"] for r in ranks)
        if c.get("window") == 3 and c["layout"] == "contiguous":
            assert skipped > 0, c
        if c.get("tile"):  # tiles of 3 rows: more blocks than chunk pairs, and the same exact results
            assert sum(r["blocks"] for r in ranks) > ShardPlan(c["T"], n, c["layout"]).num_chunks ** 2 // 2, c
            continue
        if not c["causal"] and c.get("window") is None:  # every key chunk but those wholly past T is computed
            plan = ShardPlan(c["T"], n, c["layout"])
            padding_chunks = sum(1 for i in range(plan.num_chunks) if i * plan.chunk >= c["T"])
            assert skipped == plan.num_chunks * padding_chunks, c
            assert sum(r["blocks"] for r in ranks) == plan.num_chunks * (plan.num_chunks - padding_chunks), c


def test_bytes_sent_follow_the_methods_formulas(run):
    n = run["world"]
    B, D = 2, 8
    for e in _computed(run):
        c = e["case"]
        G, L = c.get("G", H), e["module"]["L"]
        item = 8 if c["dtype"] == "float64" else 4
        kv = 2 * B * G * L * D * item  # one hop of this rank's K and V
        for r in e["module"]["ranks"]:
            if c["method"] == "ring":
                assert r["fwd_bytes"] == (n - 1) * kv, c
                assert r["bytes"] == 2 * (n - 1) * kv + n * kv, c  # backward: K/V again, dK/dV home (N hops)
            else:
                share = B * L * D * item * (n - 1) // n
                assert r["fwd_bytes"] == (2 * H + 2 * G) * share, c  # Q, K, V out, the context back
                assert r["bytes"] == 2 * (2 * H + 2 * G) * share, c  # the backward mirrors each exchange


def test_transfers_are_posted_before_the_compute_they_overlap(run):
    n = run["world"]
    (entry,) = [e for e in _computed(run) if e["case"].get("events")]
    events = [tuple(ev) for ev in entry["module"]["events"]]
    for phase in ("forward", "backward"):
        for s in range(n - 1):
            post, compute, wait = (events.index((w, phase, s)) for w in ("post", "compute", "wait"))
            assert post < compute < wait, (phase, s, events)
    for s in range(n):  # a dK/dV accumulator leaves after its step's compute, and is awaited before the next one's
        sent = events.index(("post", "backward-grads", s))
        assert events.index(("compute", "backward", s)) < sent < events.index(("wait", "backward-grads", s))
        if s + 1 < n:
            assert events.index(("wait", "backward-grads", s)) < events.index(("compute", "backward", s + 1))


def test_models_equal_single_process(run):
    models = [e for e in run["cases"] if "model" in e["case"]]
    assert {e["case"]["model"] for e in models} == {"gpt-learned", "gpt-rotary", "llama"}
    for e in models:
        worst = max([e["model"]["out"][0]] + [v[0] for v in e["model"]["params"].values()])
        assert worst <= 1e-10, (e["case"], worst)


def test_errors_are_raised_on_every_rank(run):
    n = run["world"]
    T, L = 8 * n, 8
    by_rank = run["errors_by_rank"]
    for errs in by_rank:
        assert errs["full_mask"] == (
            f"context_parallel: key_padding_mask has shape (2, {T}); it is shaped for the full sequence: "
            f"pass cp.shard(key_padding_mask, dim=1)."
        )
        assert errs["full_input"] == (
            f"context_parallel: this rank's input has {T} positions (the full sequence's: pass cp.shard(x, dim=1)); "
            f"the last cp.shard split T={T} into {n} shards of {L}. Shard every input of the call with the same cp.shard."
        )
        assert errs["lengths"].startswith(
            "context_parallel: the ranks' shards do not match (rank 0: L=8, B=2, H=4, G=4, D=8, T="
        )
        assert errs["alltoall_heads"].startswith(f"method='alltoall' splits the heads over the {n} ranks")
    refused = "context_parallel: rank 1 refused its inputs (its error says why); this rank stops too, so that no rank waits for the others forever."
    assert by_rank[1]["one_rank_short"].startswith("context_parallel: this rank's input has 7 positions;")
    assert by_rank[1]["gather_short"].startswith("cp.gather: the tensor has 7 positions along dim 1;")
    for rank, errs in enumerate(by_rank):
        if rank != 1:
            assert errs["one_rank_short"] == refused and errs["gather_short"] == refused


# -- in one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("T", [1, 5, 16, 17, 31])
def test_shard_plan_covers_every_position_once_and_round_trips(layout, world, T):
    plan = ShardPlan(T, world, layout)
    assert plan.padded % (2 * world if layout == "zigzag" else world) == 0 and plan.padded >= T
    order = plan.order()
    assert sorted(order.tolist()) == list(range(plan.padded))
    x = torch.randn(2, T, 3)
    parts = torch.cat([plan.shard(x, r, dim=1) for r in range(world)], dim=1)
    assert torch.equal(plan.unshard(parts, dim=1), x)
    for r in range(world):
        assert torch.equal(
            plan.shard(x, r, dim=1)[:, plan.positions(r) < T], x[:, plan.positions(r)[plan.positions(r) < T]]
        )
    if layout == "zigzag":
        assert plan.chunk_ids(0) == (0, 2 * world - 1)


def test_context_parallel_needs_an_initialised_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError) as err:
        ContextParallel()
    assert str(err.value) == (
        "ContextParallel needs an initialised torch.distributed process group, and none is: call "
        "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (GPU) first, as torchrun's "
        "processes do, or run a single process without context_parallel."
    )


@pytest.fixture
def one_rank():
    """A gloo group of one process, torn down after the test (others must not see a group)."""
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield ContextParallel()
    dist.destroy_process_group()


def test_one_rank_is_the_single_process_attention(one_rank):
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, window=3).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    ref = mha(x, is_causal=True)
    got = one_rank.gather(mha(one_rank.shard(x), is_causal=True, context_parallel=one_rank))
    assert (got - ref).abs().max() < 1e-12
    assert mha.last_backend == "context-parallel"


def test_what_context_parallelism_refuses_in_one_sentence(one_rank):
    cp = one_rank
    mha = MultiHeadAttention(16, 4)
    x = cp.shard(torch.randn(2, 8, 16))
    with pytest.raises(
        ValueError,
        match=r"^context_parallel is self-attention over one sharded sequence \(T_q == T_k\); "
        r"this call passed a separate key/value \(T_q=8, T_k=5\)\. Cross-attention is not context-parallel",
    ):
        mha(x, torch.randn(2, 5, 16), context_parallel=cp)
    with pytest.raises(ValueError, match=r"^context_parallel takes no attn_mask: "):
        mha(x, attn_mask=torch.ones(8, 8, dtype=torch.bool), context_parallel=cp)
    with pytest.raises(ValueError, match=r"^need_weights=True with context_parallel: "):
        mha(x, need_weights=True, context_parallel=cp)
    with pytest.raises(ValueError, match=r"^context_parallel with a kv_cache: "):
        mha(x, kv_cache=object(), context_parallel=cp)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^context_parallel in training mode with dropout=0.1: "):
        MultiHeadAttention(16, 4, dropout=0.1)(x, context_parallel=cp)
    with pytest.raises(
        ValueError, match=r"^context_parallel: key_padding_mask must be bool \(True = padding\), got torch.int64"
    ):
        mha(x, key_padding_mask=torch.zeros(2, 8, dtype=torch.long), context_parallel=cp)
    with pytest.raises(ValueError, match=r"^layout must be one of 'zigzag', 'contiguous', got 'striped'\.$"):
        ContextParallel(layout="striped")
    with pytest.raises(ValueError, match=r"^method must be one of 'ring', 'alltoall', got 'tree'\.$"):
        ContextParallel(method="tree")
    fresh = ContextParallel()
    with pytest.raises(ValueError, match=r"^this ContextParallel has not sharded a sequence yet"):
        mha(x, context_parallel=fresh)


def test_a_second_backward_says_why_it_cannot_run(one_rank):
    """The ring lets this rank's K/V go as it passes them on, so retain_graph cannot buy a second backward."""
    mha = MultiHeadAttention(16, 4)
    y = mha(one_rank.shard(torch.randn(2, 8, 16)), is_causal=True, context_parallel=one_rank)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"^context-parallel attention's backward ran twice \(retain_graph=True\)"):
        y.sum().backward()
