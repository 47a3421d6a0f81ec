"""A rank that dies or stops answering ends the job on every rank within a bounded time, and is named.

Under torchrun, a collective waits for every rank of its group. When one rank's process dies
(``kill -9``, the out-of-memory killer, a crash) its sockets close and gloo fails the others at once
("Connection reset by peer"); when one stops answering (``kill -STOP``, Ctrl-Z, a machine that
hangs) nothing closes, and the others wait for the process group's timeout: 30 minutes by gloo's
default. Measured on this machine's gloo (torch 2.13, two CPU ranks, ``timeout=5 s``): an
all-reduce, a barrier and DDP's bucketed all-reduce in ``backward`` all fail 5.0 s after their peer
was stopped, so the timeout alone bounds the wait; no heartbeat thread is needed to notice a
frozen peer. :func:`join` therefore creates the group with ``timeout = --rank-timeout`` (50 s by
default), and groups made later (``new_group``) get the same one.

What the timeout cannot say is *which* rank failed: gloo's message names an address at best. At
:func:`join` every rank shares its host name and process id (one ``all_gather_object``, once);
after a failed collective, :func:`diagnose` looks at the peers on this host in ``/proc``: a process
gone or a zombie **died**, one in state ``T`` **is stopped** (SIGSTOP, Ctrl-Z). That covers
``torchrun --nproc_per_node N`` on one machine exactly; for ranks on other hosts it says which ranks
it could not look at. The rank that reports is rank 0, or the lowest surviving rank when rank 0 is
the one lost (:attr:`RankFailure.reporter`), so a job prints one line, not one per rank.

The timeout also bounds a rank that is alive but slower than it at a point where the others wait
for it: rank 0 writing a checkpoint longer than ``--rank-timeout`` would end the run. The lab's
checkpoints take milliseconds to seconds; the message says to raise ``--rank-timeout`` where a
slow disk is the cause. A rank that is alive and sends nothing (not stopped, not dead) is reported
as such.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..runtime import check_range

__all__ = [
    "DEFAULT_RANK_TIMEOUT",
    "LOST_EXIT",
    "Job",
    "RankFailure",
    "RankLost",
    "check_rank_timeout",
    "diagnose",
    "ended",
    "join",
    "local_job",
    "mark_left",
    "watch_joining",
]

# Seconds. Survivors then exit within a minute even on a loaded machine (measured: 50.5 s after a SIGSTOP);
# gloo's own default is 30 minutes.
DEFAULT_RANK_TIMEOUT = 50.0
# Exit code of every surviving rank: sysexits.h's EX_TEMPFAIL, "a temporary failure: retry"; resuming is the retry.
LOST_EXIT = 75
_DIED_GRACE_S = 2.0  # a peer whose socket closed may need a moment to show as a zombie in /proc


def check_rank_timeout(seconds: object, flag: str = "--rank-timeout") -> float:
    """``seconds`` as a float if it is a number of seconds a collective may wait (1 to 86400); else UsageError."""
    check_range(
        flag,
        seconds,  # type: ignore[arg-type]  # checked here: from a flag or from a config.json that nothing checked
        low=1,
        high=86400,
        hint=(
            f"pass e.g. {flag} {DEFAULT_RANK_TIMEOUT:g}: how long the ranks wait for one that stopped answering "
            "before they all stop (below a second, ordinary scheduling hiccups would end runs)"
        ),
    )
    return float(seconds)  # type: ignore[arg-type]


@dataclass
class Job:
    """This process's place in a torchrun job: who the other ranks are, and how long a collective may wait."""

    rank: int
    world: int
    timeout_s: float
    peers: list[tuple[str, int]] = field(default_factory=list)  # (host name, pid) of every rank, in rank order

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)


def join(backend: str, timeout_s: float = DEFAULT_RANK_TIMEOUT) -> Job:
    """Join (or adopt) the default process group, with collectives failing after ``timeout_s``; learn the peers."""
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout)
    else:  # a caller's group: its collectives now fail after our timeout too, as this run's rules say
        c10d._set_pg_timeout(timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (socket.gethostname(), os.getpid()))
    return Job(rank, world, timeout_s, [(str(host), int(pid)) for host, pid in gathered])


def local_job(timeout_s: float) -> Job:
    """This job as far as this host shows it, for a failure before :func:`join` could share the peers: the
    other processes started by the same parent (torchrun's agent) for the same rendezvous (``MASTER_ADDR``,
    ``MASTER_PORT``), found in ``/proc``. Ranks not found there are listed with an unknown host."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    ours = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    host, parent = socket.gethostname(), os.getppid()
    peers: list[tuple[str, int]] = [("?", 0)] * world
    peers[rank] = (host, os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != parent or int(stat.parent.name) == os.getpid():
                continue
            env = dict(
                var.decode(errors="replace").split("=", 1)
                for var in (stat.parent / "environ").read_bytes().split(b"\0")
                if b"=" in var
            )
        except (OSError, ValueError, IndexError):
            continue
        if all(env.get(k) == v for k, v in ours.items()) and env.get("RANK", "").isdigit():
            r = int(env["RANK"])
            if 0 <= r < world:
                peers[r] = (host, int(stat.parent.name))
    return Job(rank, world, timeout_s, peers)


@dataclass
class RankFailure:
    """What :func:`diagnose` found: the ranks lost and how, in words."""

    lost: list[int]  # ranks that died or stopped; empty when no local peer could be blamed
    what: str  # "rank 1 (pid 2957) died: its process ended without a word (kill -9, a crash or ...)"
    stopped_pids: list[int]  # pids still present but stopped: a resume must wait for them to end
    world: int

    @property
    def reporter(self) -> int:
        """The rank that prints the line: 0, or the lowest rank not lost."""
        return min((r for r in range(self.world) if r not in self.lost), default=0)


class RankLost(RuntimeError):
    """Another rank died or stopped answering; this rank stopped too. ``str(err)`` is the line to print
    (on :attr:`RankFailure.reporter` only: ``announce``), and every rank exits with :data:`LOST_EXIT`."""

    exit_code = LOST_EXIT

    def __init__(self, line: str, *, failure: RankFailure, announce: bool) -> None:
        super().__init__(line)
        self.line, self.failure, self.announce = line, failure, announce


def _state(pid: int) -> str:
    """The state letter of ``pid`` in ``/proc`` ("R", "S", "T", "Z", ...); "" when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0]  # the command name, in parentheses, may hold spaces


def _store() -> dist.Store | None:
    try:
        store = c10d._get_default_store()
        store.set_timeout(timedelta(seconds=2))  # a store host that is itself gone must not hold the report up
        return store
    except Exception:  # no group, or a store that cannot be reached: diagnose from /proc alone
        return None


def mark_left(job: Job) -> None:
    """Record in the job's store that this rank is leaving because another failed: the ranks that see its
    sockets close next must not report it as the one that died."""
    store = _store()
    if store is not None:
        try:
            store.set(f"attnlab/left/{job.rank}", "1")
        except Exception:  # the store's host is gone too: the others will diagnose from /proc
            pass


def _left(ranks: list[int]) -> set[int]:
    """Those of ``ranks`` that recorded (:func:`mark_left`) that they left because of another rank."""
    store = _store()
    if store is None or not ranks:
        return set()
    try:
        return {r for r in ranks if store.check([f"attnlab/left/{r}"])}
    except Exception:
        return set()


_JOIN_POLL_S = 0.2  # how often a joining rank looks at its peers in /proc
_UNSEEN_S = 2.0  # a peer torchrun started on this host but never seen in /proc for this long has ended


def _joining_failure(rank: int, world: int, seen: dict[int, int], missing: dict[int, float]) -> RankFailure | None:
    """The peers of this host that ended while the group formed: one seen and now gone (or a zombie), or one never
    seen for :data:`_UNSEEN_S` where torchrun started every rank here (``LOCAL_WORLD_SIZE == WORLD_SIZE``)."""
    now = time.monotonic()
    dead = [r for r, pid in seen.items() if _state(pid) in ("", "Z", "X", "x")]
    dead += [r for r, since in missing.items() if r not in seen and now - since >= _UNSEEN_S]
    if not dead:
        return None
    dead.sort()
    r = dead[0]
    pid = f"pid {seen[r]}" if r in seen else "pid unknown: it ended before this rank could see it"
    what = (
        f"rank {r} ({pid}) died while the ranks were still joining, before the process group formed (kill -9, a "
        "crash or the out-of-memory killer)"
    )
    if len(dead) > 1:
        what += f"; also lost: rank{'s' if len(dead) > 2 else ''} {_ranks(dead[1:])}"
    return RankFailure(dead, what, [], world)


def _all_here() -> bool:
    """Whether torchrun started every rank on this host (``LOCAL_WORLD_SIZE == WORLD_SIZE``): its agent starts them as
    siblings, so one never seen in /proc has ended (another launcher may start them apart, where only a rank seen and
    gone counts)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


@contextmanager
def watch_joining(timeout_s: float, lost: Callable[[Job, RankFailure], None]) -> Iterator[None]:
    """While the block joins the process group, watch this host's other ranks; call ``lost(job, failure)`` (from
    a thread: it must end the process) when one dies before the group forms.

    Until every rank has joined, no collective exists to fail: ``init_process_group`` waits in C++ for the
    missing rank (up to ``--rank-timeout``, where Python's signal handlers cannot run), and torchrun's agent
    SIGKILLs the waiting ranks 30 s after its SIGTERM, so that the user saw only torchrun's ``ChildFailedError``.
    The peers are the processes torchrun started for the same rendezvous (:func:`local_job`).
    """
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    all_here = _all_here()
    done = threading.Event()
    seen: dict[int, int] = {}
    missing: dict[int, float] = {}

    def watch() -> None:
        while not done.wait(_JOIN_POLL_S):
            job = local_job(timeout_s)
            now = time.monotonic()
            for r, (_, pid) in enumerate(job.peers):
                if r == rank:
                    continue
                if pid:
                    seen.setdefault(r, pid)
                elif all_here:
                    missing.setdefault(r, now)
            failure = _joining_failure(rank, world, seen, missing)
            if failure is not None and not done.is_set():
                job.peers = [(h, seen.get(r, pid)) for r, (h, pid) in enumerate(job.peers)]
                lost(job, failure)
                return

    thread = threading.Thread(target=watch, name="attnlab-join-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _timed_out(err: BaseException) -> bool:
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def diagnose(job: Job, err: BaseException, *, grace_s: float | None = None) -> RankFailure | None:
    """Why a collective failed with ``err``, if a peer is to blame; None when every peer looks well and the
    error is not a timeout (a bug to report as it is, not a lost rank).

    ``grace_s``: how long to wait for a peer whose socket just closed to show as dead in ``/proc``
    (default: 2 s after a connection error, none after a timeout). ``err`` may also be the interrupt
    torchrun sends the survivors when it sees a rank die (``grace_s=0``: that rank is already reaped).
    """
    host = socket.gethostname()
    unseen = [r for r, (h, _) in enumerate(job.peers) if h == "?" and r != job.rank]
    if unseen and _all_here():  # a rank killed while the group formed, before this one saw it (CI, a loaded machine)
        what = (
            f"rank {unseen[0]} (pid unknown: it ended before this rank could see it) died: its process ended without "
            "a word (kill -9, a crash or the out-of-memory killer)"
        )
        if len(unseen) > 1:
            what += f"; also lost: rank{'s' if len(unseen) > 2 else ''} {_ranks(unseen[1:])}"
        return RankFailure(unseen, what, [], job.world)
    local = {r: pid for r, (h, pid) in enumerate(job.peers) if h == host and r != job.rank}
    remote = [r for r, (h, _) in enumerate(job.peers) if h != host]
    if grace_s is None:
        grace_s = 0.0 if _timed_out(err) else _DIED_GRACE_S
    deadline = time.monotonic() + grace_s
    while True:
        states = {r: _state(pid) for r, pid in local.items()}
        dead = [r for r, s in states.items() if s in ("", "Z", "X", "x")]
        stopped = [r for r, s in states.items() if s in ("T", "t")]
        if dead or stopped or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    followers = _left(dead)  # ranks that left because of another's failure, not by failing themselves
    dead = [r for r in dead if r not in followers]
    local = {r: pid for r, pid in local.items() if r not in followers}
    wait = f"no answer for {job.timeout_s:g} s, --rank-timeout {job.timeout_s:g}"
    if dead:
        r = dead[0]
        what = (
            f"rank {r} (pid {local[r]}) died: its process ended without a word (kill -9, a crash or the "
            "out-of-memory killer)"
        )
        more = [x for x in dead + stopped if x != r]
        if more:
            what += f"; also lost: rank{'s' if len(more) > 1 else ''} {', '.join(map(str, more))}"
        return RankFailure(sorted(dead + stopped), what, [local[x] for x in stopped], job.world)
    if stopped:
        r = stopped[0]
        what = f"rank {r} (pid {local[r]}) stopped answering: the process is stopped (SIGSTOP or Ctrl-Z; {wait})"
        if len(stopped) > 1:
            what += f"; ranks {', '.join(map(str, stopped[1:]))} are stopped too"
        return RankFailure(stopped, what, [local[x] for x in stopped], job.world)
    if not _timed_out(err):
        if not remote or not isinstance(err, RuntimeError):
            return None  # every peer is alive and running: not a lost rank
        what = (
            f"the connection to another rank failed ({_first_line(err)}); {_unseen(remote)}: their logs say which "
            "one ended"
        )
        return RankFailure([], what, [], job.world)
    others = [r for r in range(job.world) if r != job.rank]
    if len(others) == 1 and not remote:
        r = others[0]
        what = (
            f"rank {r} (pid {local.get(r, '?')}, still running) sent nothing ({wait}): it is stuck, or busy for "
            "longer than that; if it was only slow (a checkpoint on a slow disk), raise --rank-timeout"
        )
        return RankFailure([r], what, [], job.world)
    where = "every rank is running"
    if remote:
        where = _unseen(remote)
    what = (
        f"a rank sent nothing ({wait}); {where}: one is stuck, or busy for longer than that (raise --rank-timeout "
        "if it was only slow)"
    )
    return RankFailure([], what, [], job.world)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _unseen(ranks: list[int]) -> str:
    """``"ranks 2, 3 run on other hosts, where this rank cannot look"`` (or are nowhere to be found on this one)."""
    return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} run on other hosts, where this rank cannot look"


def _first_line(err: BaseException) -> str:
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line if len(line) <= 160 else line[:157] + "..."


def ended(job: Job, failure: RankFailure) -> str:
    """What a resume must wait for: ``" once pid 2957 has ended (torchrun ends it within 30 s, or kill -9 2957)"``."""
    if not failure.stopped_pids:
        return ""
    pids = " ".join(map(str, failure.stopped_pids))
    return f" once pid {pids} has ended (torchrun ends it within 30 s; or kill -9 {pids})"
