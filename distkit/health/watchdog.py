"""Heartbeat watchdog: a stalled rank never hangs the job, and is named.

A rank stopped with SIGSTOP, frozen or cut off from the network does not fail: it stops answering,
and the other ranks wait for it in their next collective. The engines' own timeouts (set from
``distributed.timeout_s``) end the waiting ranks without saying which rank stopped, and one of them
cannot work at all: Horovod's stall check runs in its background thread, which waits in MPI for
the stopped rank too. So every rank of a job with more than one rank runs a :class:`Watchdog`,
one mechanism for every engine and launcher (:class:`~distkit.session.Session` starts it right
after the engine joined its process group and stops it in ``close``):

* **store**: a :class:`torch.distributed.TCPStore` served by rank 0 on a free port. Its address
  reaches the other ranks once, through the engine's own ``broadcast_object``, so the mpi and
  horovod engines need no torch process group (:mod:`distkit.health.store`); with it the job's token,
  which seals every value distkit writes there (:mod:`distkit.health.records`: a value a stranger wrote is ignored).
* **beater thread**: every ``interval = min(1, T / 4)`` seconds it writes this rank's counter
  ``hb/<rank>``, one more, and reads every rank's counter (one ``multi_get``), where ``T`` is
  ``distributed.timeout_s`` (:class:`distkit.health.heartbeat.Heartbeat`, which a Watchdog is).
* **judge thread** (clock only, it never waits on the network): a rank whose counter has not
  changed for ``T`` seconds of this process's monotonic clock (clocks of different hosts need not
  agree), as this rank's own reads saw it, is named; when the store itself has not answered a call
  for ``T`` seconds, its host, rank 0, is. Only what this rank observed counts: while its own
  beater did not run (its process starved, or its main thread holding the GIL in C code), a peer's
  counter was not read, so it cannot have been seen unchanged.
  The judge prints ``distkit: rank K stopped responding: no heartbeat for T s (noticed by rank R)``
  to stderr, records it for distkit's spawner (:func:`distkit.launch.spawner.record_stall`, so the spawner
  names rank K, not the rank that noticed), SIGKILLs rank K when it runs on this host (its process, known by the
  mark it carries, never a pid a record names alone; a stopped
  process never acts on the SIGTERM launchers send it; the job is ending anyway) and ends the job
  through the engine (:meth:`~distkit.backends.base.Strategy.end_job`: ``MPI_Abort`` on the MPI
  engines, ``os._exit(1)`` elsewhere, after which the launcher stops the others).

It tests liveness only: the threads run beside the training loop, so a long step, or a rank whose
main thread hangs with the GIL released, keeps beating; a rank that is alive but never joins a
collective is left to the engine's collective timeout. When a collective does time out, the rank
calls :func:`explain_stall` first: if a heartbeat is late, the judge gets the moment it needs to name
the rank instead of the engine's "timed out". When a connection to a peer broke instead,
:func:`distkit.health.lost.lost_peer_error` asks the heartbeats which rank is gone. At the end of a normal run
the lowest rank of each host sees its host's ranks out (:class:`distkit.health.local_peers.LocalPeers`, which a
Watchdog is too).

Cost: see :mod:`distkit.health.store` (one ``add`` and one ``multi_get`` per rank per interval).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from distkit.errors import RankStalled
from distkit.health.heartbeat import Heartbeat, _who, interval_for
from distkit.health.records import name_thread
from distkit.health.local_peers import LocalPeers
from distkit.health.store import connect_store
from distkit.launch.guard import end_launcher_after
from distkit.launch.procfs import job_rank
from distkit.launch.startup_watch import end_for_stopped_peers
from distkit.launch.netif import host_identity

if TYPE_CHECKING:
    from distkit.health.protocols import StrategyLike

#: a peer whose heartbeat has not changed for this many intervals, after a connection to it broke, is
#: gone (a live rank is seen to beat about once per interval; twice that allows for a busy machine)
LOST_AFTER_INTERVALS = 3.0

_ACTIVE: Optional["Watchdog"] = None
#: seconds :meth:`Watchdog.stop` waits for the beater's store call in flight to return
STOP_JOIN_S = 2.0


#: a pause of the judge's own thread of this many heartbeat intervals (it wakes every half interval) means this
#: process itself did not run: each peer then has :data:`LOST_AFTER_INTERVALS` intervals from that moment to be seen
#: beating (a live peer beats once per interval) before it can be named
OWN_GAP = 3


def ranks_text(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 1, 3``: how the judge and :func:`~distkit.health.lost.lost_peer_error` name ranks."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def active() -> Optional["Watchdog"]:
    """This process's running watchdog (from :func:`start_watchdog` until its :meth:`~Watchdog.stop`), or None.
    Per process: each rank has its own."""
    return _ACTIVE


class Watchdog(Heartbeat, LocalPeers):
    """This rank's heartbeat (:class:`~distkit.health.heartbeat.Heartbeat`) and the judge of everyone else's.
    Made by :func:`start_watchdog`.

    Args:
        store: the job's heartbeat store (rank 0 serves it; every rank holds a client).
        rank, world_size: this rank's place in the job.
        timeout_s: ``distributed.timeout_s``: seconds without a heartbeat after which a rank is named.
        end_job: ends every rank of the job and does not return (``Strategy.end_job``); called with
            exit status 1 from the judge thread.
        startup_s: ``distributed.startup_s()``: the judge's bound instead of ``timeout_s`` until
            :meth:`end_startup` (a rank busy in start-up work on a loaded machine may not beat for seconds:
            an import holds the GIL); None: ``timeout_s`` from the start.
        token: the job's token (:func:`~distkit.health.store.connect_store`); None: this process's own (several
            ranks' watchdogs in one process).
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float,
                 end_job: Callable[[int], None], startup_s: Optional[float] = None,
                 token: Optional[bytes] = None) -> None:
        super().__init__(store, rank, world_size, interval_for(timeout_s), token)
        #: the judge's bound now (seconds) and the config key that sets it; the heartbeat interval is timeout_s's
        self.timeout_s = float(timeout_s)
        self.key = "distributed.timeout_s"
        self._final_s = float(timeout_s)
        if startup_s is not None:
            self.timeout_s, self.key = float(startup_s), "distributed.startup_timeout_s"
        self._meetings = 0  # meet() calls so far: the n-th call of every rank meets the others' n-th
        self.end_job = end_job
        self._lock = threading.Lock()  # the judge fires, or stop() stops it: never both
        self._judge = threading.Thread(target=self._judge_loop, name="distkit-watchdog", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def run(self) -> None:
        """Start the judge and name its thread with this rank's mark (what shows this process to be this rank of
        this job to the ranks of its host: :mod:`distkit.health.records`), publish where this rank runs (sealed),
        then start the heartbeat. Not collective."""
        self._judge.start()
        name_thread(self._judge, self.mark)
        key = _who(self.rank)
        try:
            self.store.set(key, self._seal.seal(key, f"{host_identity()} {os.getpid()}"))
        except BaseException:
            self._stop.set()  # (no judge without a heartbeat)
            raise
        self._beater.start()

    def stop(self, join_s: float = STOP_JOIN_S) -> None:
        """Stop judging, at once, and the heartbeat (normal teardown; idempotent). Not collective. Waits up to
        ``join_s`` seconds for the beater to leave its store call: a daemon thread still inside a torch call
        when the interpreter finalizes is ended by ``pthread_exit`` while C++ unwinds it, which aborts the
        process ("terminate called without an active exception", exit 134 after a complete run: seen when
        rank 0, which serves the store, had left first, so the call failed just then; and after 2 s of a call
        to a live store on a loaded machine, whence the longer ``join_s`` after a run whose ranks met at the end).
        A call still blocked after that (a store whose host froze) is left to the process's end."""
        global _ACTIVE
        with self._lock:
            self._stop.set()
        if _ACTIVE is self:
            _ACTIVE = None
        if self._beater.is_alive() and threading.current_thread() is not self._beater:
            self._beater.join(join_s)
        if self.rank == 0 and len(self._where) < self.world_size and threading.current_thread() is not self._beater:
            # A run shorter than a heartbeat interval can end before the beater learned where the ranks run; no
            # rank would then see its host's peers out, and a peer stopped now would keep the launcher waiting
            # forever (seen under load: torchrun, 6 steps). Rank 0 learns it now from the store it serves itself
            # (a call to another rank's server could block for good on a stopped server: not from here).
            with contextlib.suppress(Exception):
                self.store.set_timeout(datetime.timedelta(seconds=min(self.timeout_s, 5.0)))
                self._learn_where(report=False)

    # -- the judge: clock only ---------------------------------------------------------------
    def end_startup(self) -> None:
        """Judge by ``timeout_s`` from now on (start-up has ended: ``Job._end_startup``), and learn where every rank
        runs now if the beater has not yet. Not collective.

        Why here: the ranks have just met, so every rank's ``who/`` record is written and every rank's beater thread,
        whose name is the mark that lets a peer on this host trust a pid, is alive. Learned later, at the end of a
        run shorter than a heartbeat interval (:meth:`stop`), a peer's beater may have ended already and its mark
        with it: its pid was then dropped, the lowest rank of the host saw no peer to wait for and started no exit
        watcher, and a peer stopped after it left the run kept ``MPI_Finalize`` and mpirun waiting forever (1 run in
        6 of ``DISTKIT_FAULT=1:6:stop:left`` under mpirun, 6 steps)."""
        self.timeout_s, self.key = self._final_s, "distributed.timeout_s"
        if len(self._where) < self.world_size:
            with contextlib.suppress(Exception):  # (the store not answering is the judge's to report)
                self._learn_where()

    def meet(self, what: str, timeout_s: float) -> None:
        """Collective: return once every rank has called it (the n-th call of each rank meets the others' n-th),
        through the heartbeat store. Used during start-up only (Horovod's collectives then, and the end of
        start-up), where ranks legitimately drift by seconds: after the meeting the engine's own wait is short.
        Raises :class:`RankStalled` naming the ranks that did not come within ``timeout_s`` seconds.

        Polls (every 10 ms) rather than ``store.wait``: the store client is shared with the heartbeat thread,
        and a blocking wait would hold its lock, so this rank's heartbeat would stop while it waits. A rank's key
        counts once it holds its sealed value (one a stranger wrote is ignored, in one line)."""
        self._meetings += 1
        keys = [f"meet/{self._meetings}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], self._seal.seal(keys[self.rank], "1"))
        deadline = time.monotonic() + timeout_s

        def came(r: int, raw: Any) -> bool:
            return self._open(keys[r], raw, lambda p: p if p == "1" else None, "not a meeting's mark") is not None

        while True:
            if self.store.check(keys) and all(came(r, v) for r, v in enumerate(self.store.multi_get(keys))):
                return
            if time.monotonic() >= deadline:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k]) or not came(r, self.store.get(k))]
                if not missing:
                    return
                raise RankStalled(f"{ranks_text(missing)} did not reach {what} within {timeout_s:g} s "
                                  f"(distributed.startup_timeout_s; noticed by rank {self.rank}): it hangs, is stopped "
                                  "or died, or its start-up work takes longer; its own output, if any, has the cause",
                                  missing)
            time.sleep(0.01)

    def stalled(self) -> list[int]:
        """The ranks without a heartbeat for ``timeout_s`` seconds (normally none)."""
        return sorted(r for r, age in self.ages().items() if age >= self.timeout_s)

    def _judge_loop(self) -> None:
        woke = time.monotonic()
        while not self._stop.wait(self.interval_s / 2):
            now = time.monotonic()
            if now - woke >= OWN_GAP * self.interval_s:
                # This process did not run for several intervals (frozen itself: SIGSTOP of its whole group or
                # host, then SIGCONT; or starved): every peer's age grew while nobody here could read their beats.
                # They are not blamed for it (issue 36 item 10: a fault-tolerant group woken after a freeze blamed
                # its own rank 1 and exited instead of healing): each gets LOST_AFTER_INTERVALS intervals from now
                # to be seen beating, time for its beater and this rank's to run once. Not a whole timeout_s: on a
                # starved machine such pauses recur, and each would put off naming a rank that really stopped by
                # timeout_s (300 s by default) again.
                grace = now - max(0.0, self.timeout_s - LOST_AFTER_INTERVALS * self.interval_s)
                self._changed = [max(c, grace) for c in self._changed]
                self._last_ok = max(self._last_ok, grace)
                trying = self._trying
                if trying is not None:
                    self._trying = max(trying, grace)
            woke = now
            ranks = self.stalled()
            if ranks:
                self.fire(self.late_with(ranks))

    def late_with(self, ranks: list[int]) -> list[int]:
        """``ranks`` and every other rank whose heartbeat is within one interval of ``timeout_s`` too, or within
        two for a rank on another host than this one that holds one of ``ranks``: ranks that stopped together (a
        frozen or cut-off host) are seen to stop one read of their counters apart, and are named together. Reads
        are one interval apart on an idle machine and further apart on a loaded one: a cut host's two ranks were
        seen more than 1.2 intervals apart beside a full test suite, and only one was named. A live rank is never
        that late: its age stays about one interval, and ``timeout_s`` is at least four intervals. (Not this
        host's ranks: in a one-host job every rank shares the lost one's host.)"""
        hosts = {self._where[r][0] for r in ranks if r in self._where} - {host_identity()}
        near, near_host = self.timeout_s - self.interval_s, self.timeout_s - 2 * self.interval_s
        return sorted(set(ranks) | {r for r, age in self.ages().items()
                                    if age >= near or (age >= near_host and self._where.get(r, ("", 0))[0] in hosts)})

    def fire(self, ranks: list[int]) -> None:
        """Name ``ranks``, record them for the spawner, SIGKILL those on this host, end the job."""
        from distkit.launch.spawner import record_stall

        with self._lock:
            if self._stop.is_set():
                return
            ages = self.ages()
            which = ranks_text(ranks)
            age = max(ages.get(r, self.timeout_s) for r in ranks)
            text = (f"{which} stopped responding: no heartbeat for {age:.1f} s (noticed by rank {self.rank}; "
                    f"{self.key} = {self.timeout_s:g}); ending all {self.world_size} ranks")
            print(f"distkit: {text}", file=sys.__stderr__ or sys.stderr, flush=True)
            record_stall(self.rank, RankStalled(text, ranks))
            here = host_identity()  # (not the host name: hosts may share one)
            if any(self._where.get(r, ("", 0))[0] != here for r in ranks):
                # a rank on another host (or where unknown): its launcher may wait for that host forever. One on
                # this host is SIGKILLed below, and the launcher sees it end: it ends by itself, with its own line
                end_launcher_after(f"{which} stopped responding")
            self.kill_local(ranks)
            self.end_job(1)
            os._exit(1)  # end_job does not return; if an engine's did, this rank still must not

    def lost(self) -> list[int]:
        """The ranks whose heartbeat has stopped: no change for :data:`LOST_AFTER_INTERVALS` intervals.
        Waits until one shows or that long has passed (at most ``5.5 * interval_s`` seconds, about 5.5 s)
        and returns [] when every heartbeat goes on. Not collective.

        The bound: this rank sees a peer's last beat up to one interval after the peer beat (the beater
        reads every interval), and its age (:meth:`ages`) grows with this rank's reads, one interval apart, so a
        peer that died just after beating reaches ``limit`` up to ``limit + 2 * interval_s`` after its death;
        half an interval more for scheduling. (With only half an interval, a host SIGKILLed just after a beat was
        reported as gloo's address, not by rank.)"""
        limit = LOST_AFTER_INTERVALS * self.interval_s
        deadline = time.monotonic() + limit + 2.5 * self.interval_s
        while True:
            gone = sorted(r for r, age in self.ages().items() if age >= limit)
            if gone or time.monotonic() >= deadline or self._stop.is_set():
                return gone
            time.sleep(0.05)

    def explain(self) -> None:
        """See :func:`explain_stall`."""
        now = time.monotonic()
        oldest = max(self.ages().values())
        # Wait only for a late rank the judge will name soon: the engine's timeout (timeout_s too) and the
        # judge fire within about two heartbeat intervals of each other for one stall. A peer that died
        # (its launcher reports it) or a timeout with every heartbeat fresh returns at once.
        soon = self.timeout_s - oldest
        if oldest < 1.5 * self.interval_s or soon > 2 * self.interval_s + 1.0 or self._stop.is_set():
            return
        # the judge names it at the first read after timeout_s (reads are one interval apart); one period more
        deadline = now + max(0.0, soon) + 2 * self.interval_s + 0.5
        while time.monotonic() < deadline and not self._stop.is_set():
            if not any(a >= 1.5 * self.interval_s for a in self.ages().values()):
                return  # the late rank beat again: it was slow, not stalled
            time.sleep(0.05)


def start_watchdog(strategy: StrategyLike, timeout_s: float, startup_s: Optional[float] = None) -> Optional[Watchdog]:
    """Collective (one ``strategy.broadcast_object``, one ``all_gather_object``: :func:`~distkit.health.store.connect_store`):
    start this rank's watchdog; None for a single rank, or when the store cannot be served or reached (rank 0 and
    each rank that failed print one line; the job runs on without it, with the engines' own timeouts).

    Args:
        strategy: the engine, already initialised (its collectives work).
        timeout_s: ``distributed.timeout_s`` (seconds, > 0).
        startup_s: ``distributed.startup_s()``: the judge's bound until start-up ends (:meth:`Watchdog.end_startup`).
    """
    global _ACTIVE
    if strategy.world_size == 1:
        return None
    connected = connect_store(strategy, timeout_s, startup_s)
    if connected is None:
        return None
    store, token = connected
    watchdog = Watchdog(store, strategy.rank, strategy.world_size, timeout_s, strategy.end_job, startup_s, token)
    watchdog.run()
    _ACTIVE = watchdog
    return watchdog


def explain_stall() -> None:
    """Where a rank gives up waiting for a peer (a collective timed out, an engine's watchdog fired):
    if some rank's heartbeat is late and will reach ``timeout_s`` within two intervals and 1 s, wait
    until the judge names it (at most that, plus two intervals and 0.5 s); the judge then ends the job
    and this never returns. Returns at once otherwise: every heartbeat fresh (the peer is alive: hung
    in Python, or failed on its own, which its launcher reports). Not collective.

    Without a watchdog (before it started: the collectives that set up its store), a rank of this job on this host
    that is stopped is the cause under an MPI launcher: it is named and ended, and this rank with it
    (:func:`distkit.launch.startup_watch.end_for_stopped_peers`; no return then), as the start-up guard, which
    bounds the same wait, would. Returns at once where none is (or no MPI launcher started this rank)."""
    if _ACTIVE is not None:
        _ACTIVE.explain()
        return
    mine = job_rank(dict(os.environ))
    if mine is not None:
        end_for_stopped_peers(mine[1], "a collective before the heartbeat watchdog ran", "its bound on that wait")


def end_local_peers() -> None:
    """SIGKILL the other ranks on this host that the watchdog knows (a rank that ends the job on its own bound,
    :mod:`distkit.backends.wait_guard`, whose peers hang alive: left to their launcher, which may take seconds to
    end a rank whose main thread never runs, their own judges would first name this rank, gone, as the one that
    stopped responding). Not collective; nothing without a watchdog."""
    watchdog = _ACTIVE
    if watchdog is not None:
        watchdog.kill_local([r for r in sorted(watchdog._where) if r != watchdog.rank])
