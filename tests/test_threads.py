"""The decode thread count: ThreadChooser's choice by experiment (a fake clock stands for the load), and the
--threads / threads= plumbing from the command line to torch."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab import generate
from attnlab.models.decoder import Decoder
from attnlab.models.llama_config import LlamaConfig
from attnlab.runtime import UsageError
from attnlab.runtime.threads import ThreadChooser, candidate_threads, check_threads, free_cpus, resolve_threads
from attnlab.tools.stream import Sampling


class FakeLoad:
    """A clock whose steps cost ``cost[threads]`` seconds: a machine where some counts are slow (a busy core)."""

    def __init__(self, cost: dict[int, float]) -> None:
        self.cost, self.now, self.threads = dict(cost), 0.0, 0
        self.applied: list[int] = []

    def apply(self, n: int) -> None:
        self.threads = n
        self.applied.append(n)

    def clock(self) -> float:
        return self.now

    def step(self) -> int:
        self.now += self.cost[self.threads]
        return self.threads


def chooser(load: FakeLoad, candidates: tuple[int, ...] = (2, 1), **kw: object) -> ThreadChooser:
    return ThreadChooser(candidates, apply=load.apply, clock=load.clock, **kw)  # type: ignore[arg-type]


def test_idle_machine_keeps_two_threads_after_an_alternated_probe():
    load = FakeLoad({2: 0.004, 1: 0.0056})  # 2 threads 1.4x faster, as measured idle
    c = chooser(load)
    ran = [c.run(load.step) for _ in range(6)]
    assert ran == [1, 2, 1, 2, 1, 2]  # alternated, the smallest count first
    assert c.chosen == 2 and not c.probing
    assert [c.run(load.step) for _ in range(31)] == [2] * 31  # no probe before first_recheck steps


def test_busy_core_switches_to_one_thread_and_stops_probing_the_slow_count_early():
    load = FakeLoad({2: 0.100, 1: 0.005})  # beside a busy core: 2 threads 20x slower (issue 51: 0.04-0.14x)
    c = chooser(load)
    ran = [c.run(load.step) for _ in range(2)]
    # 1, then 2, > 3x the best median: no more steps at 2 threads, and nothing left to compare
    assert ran == [1, 2]
    assert c.chosen == 1 and not c.probing
    ran = [c.run(load.step) for _ in range(40)]
    assert ran[:32] == [1] * 32  # the first recheck comes after 32 steps
    assert sum(n == 2 for n, _ in c.history) == 2  # each probe costs one slow step


def test_a_confirmed_choice_probes_ever_less_often():
    load = FakeLoad({2: 0.004, 1: 0.006})
    c = chooser(load, first_recheck=4, max_recheck=16)
    for _ in range(200):
        c.run(load.step)
    steps_at_one = [i for i, (n, _) in enumerate(c.history) if n == 1]
    gaps = [b - a for a, b in itertools.pairwise(steps_at_one) if b - a > 2]
    assert gaps[:3] == sorted(gaps[:3]) and max(gaps) <= 16 + 6  # doubling, capped at max_recheck (+ a probe)


def test_a_sudden_slowdown_starts_a_probe_at_once():
    load = FakeLoad({2: 0.004, 1: 0.006})
    c = chooser(load)
    for _ in range(6):
        c.run(load.step)
    assert c.chosen == 2
    load.cost[2] = 0.08  # another process takes a core
    c.run(load.step)  # 20x the baseline: a probe starts
    assert c.probing
    for _ in range(6):
        c.run(load.step)
    assert c.chosen == 1


def test_busy_cores_seen_now_spare_even_one_slow_step():
    load = FakeLoad({2: 0.100, 1: 0.005})
    free = [1]  # another task runs on one of the 2 CPUs
    c = chooser(load, free=lambda: free[0])
    assert [c.run(load.step) for _ in range(40)] == [1] * 40  # nothing to compare: no probe, no step at 2
    free[0] = 2  # the other task ended: the next check tries 2 threads again
    load.cost[2] = 0.004
    for _ in range(40):
        c.run(load.step)
    assert c.chosen == 2


def test_free_cpus_reads_the_tasks_runnable_now(tmp_path, monkeypatch):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("27.1 25.0 20.3 5/812 4242\n")  # 5 runnable now, whatever the averages say
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert free_cpus(str(loadavg)) == -1  # 3 others on 2 CPUs
    loadavg.write_text("27.1 25.0 20.3 2/812 4242\n")  # ours alone: the averages still say 27
    assert free_cpus(str(loadavg)) == 2
    assert free_cpus(str(tmp_path / "missing")) is None


def test_one_candidate_is_applied_once_and_never_timed_against_another():
    load = FakeLoad({3: 0.01})
    c = chooser(load, (3,))
    assert [c.run(load.step) for _ in range(5)] == [3] * 5 and load.applied == [3]


def test_candidates_and_settings():
    assert candidate_threads(2) == (2, 1) and candidate_threads(1) == (1,) and candidate_threads(8) == (8, 7, 1)
    assert resolve_threads(None) == () and resolve_threads(3) == (3,)
    assert check_threads("--threads", "4") == 4 and check_threads("--threads", "auto") == "auto"
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(UsageError, match=r"--threads must be a thread count >= 1 or 'auto'"):
            check_threads("--threads", bad)
    with pytest.raises(ValueError, match="candidates must be thread counts >= 1"):
        ThreadChooser([0])


def tiny_llama() -> Decoder:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48)
    return Decoder(cfg).eval()


def test_generate_threads_set_for_the_run_and_put_back(monkeypatch):
    model = tiny_llama()
    before = torch.get_num_threads()
    seen: list[int] = []
    real = model.forward

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(model, "forward", spy)
    idx = torch.randint(0, 64, (1, 5))
    out = generate(model, idx, 4, temperature=0, threads=1)
    assert set(seen) == {1} and torch.get_num_threads() == before
    assert torch.equal(out, generate(model, idx, 4, temperature=0))  # the tokens do not depend on the count
    with pytest.raises(UsageError, match="threads must be a thread count"):
        generate(model, idx, 4, threads=0)


def test_generate_auto_times_decode_steps_at_each_count(monkeypatch):
    model = tiny_llama()
    made: list[ThreadChooser] = []

    class Recording(ThreadChooser):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr("attnlab.models.generation.ThreadChooser", Recording)
    monkeypatch.setattr("attnlab.models.generation.free_cpus", lambda: None)  # this machine's load left out
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # as on a 2-core machine
    applied: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    generate(model, torch.randint(0, 64, (1, 5)), 9, temperature=0, threads="auto")
    (c,) = made
    assert len(c.history) == 8  # every decode step, timed
    assert applied[:2] == [1, 2]  # the smallest count first, then the other


def test_cli_threads_flag_reaches_generate(monkeypatch):
    from attnlab.tools import generate_cli

    got: dict[str, object] = {}

    def fake_steps(lm, idx, n, **kw):
        got.update(kw)
        return iter(())

    monkeypatch.setattr(generate_cli, "generate_steps", fake_steps)
    greedy = Sampling(temperature=0.0, top_k=None, top_p=None, repetition_penalty=1.0)
    ask = generate_cli._Ask("--checkpoint", "x", "", False, 3, torch.device("cpu"), greedy, 0, False, "auto", threads=1)
    model = tiny_llama()
    list(ask.steps(model, [1, 2, 3], 3))
    assert got["threads"] == 1
    with pytest.raises(UsageError, match="--threads must be a thread count"):
        generate_cli.generate_command(model="smollm2", prompt="hi", threads="0")  # type: ignore[arg-type]
