"""This rank's heartbeat in the job's heartbeat store, and what it has read of every other rank's.

The store I/O half of the watchdog (:class:`distkit.health.watchdog.Watchdog` is a :class:`Heartbeat`): the
**beater thread** adds 1 to this rank's counter ``hb/<rank>`` every ``interval = min(1, T / 4)`` seconds
(``T``: ``distributed.timeout_s``) and reads every rank's counter (one ``multi_get``), noting on this process's
monotonic clock when it saw each counter change (clocks of different hosts need not agree). From those reads
:meth:`Heartbeat.ages` says how long each peer was seen silent; the judge (clock only) decides from the ages.

Keys in the store: ``hb/<rank>`` (the counter), ``who/<rank>`` (``"<host identity> <pid>"``, set once by
:meth:`Watchdog.run <distkit.health.watchdog.Watchdog.run>`, read here once every rank beat).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

#: seconds between heartbeats at most (also the judge's period)
MAX_INTERVAL_S = 1.0


def interval_for(timeout_s: float) -> float:
    """Seconds between heartbeats for ``distributed.timeout_s = timeout_s``: ``min(1, T / 4)``."""
    return min(MAX_INTERVAL_S, timeout_s / 4)


def _key(rank: int) -> str:
    return f"hb/{rank}"


class Heartbeat:
    """This rank's counter in the heartbeat store and the last value and change time of every rank's, as this
    rank's own reads saw them. Not collective: every rank runs one against the same store.

    Args:
        store: the job's heartbeat store (rank 0 serves it; every rank holds a client).
        rank, world_size: this rank's place in the job.
        interval_s: seconds between heartbeats (:func:`interval_for`).
    """

    def __init__(self, store: Any, rank: int, world_size: int, interval_s: float) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s = interval_s
        now = time.monotonic()
        self._values: list[Optional[bytes]] = [None] * world_size
        #: monotonic time at which this rank last saw each rank's counter change (or the start)
        self._changed = [now] * world_size
        #: monotonic time of the last store round trip that completed: each peer's counter is known up to it
        self._last_ok = now
        #: monotonic start of the first store call since the last that completed (None while they complete)
        self._trying: Optional[float] = None
        self._keys = [_key(r) for r in range(world_size)]  # every rank's heartbeat counter
        self._where: dict[int, tuple[str, int]] = {}  # rank -> (hostname, pid), once every rank beat
        self._stop = threading.Event()
        self._beater = threading.Thread(target=self._beat_loop, name="distkit-heartbeat", daemon=True)

    # -- the beater: store I/O ---------------------------------------------------------------
    def _beat_loop(self) -> None:
        seen = [False] * self.world_size
        while not self._stop.is_set():
            if not self.beat(seen):
                # The connection to the store is broken (its host died or closed it): a TCPStore client does not
                # reconnect, so every further call fails too, each printing torch's 22-line C++ warning before
                # distkit's line. No more calls: the judge names rank 0 after timeout_s.
                self._stop.wait()
                return
            self._stop.wait(self.interval_s)

    def beat(self, seen: list[bool]) -> bool:
        """One heartbeat: add 1 to this rank's counter and read every counter that exists (``seen``: the ranks
        known to have beaten, updated in place). A call that fails leaves the judge to decide (the store's host is
        gone or not answering). Returns False once the connection to the store is broken for good."""
        keys = self._keys
        if self._trying is None:
            self._trying = time.monotonic()
        try:
            self.store.add(keys[self.rank], 1)
            if not all(seen):  # at start: a rank that never beat must not block the read
                seen[:] = [s or self.store.check([k]) for s, k in zip(seen, keys)]
            if all(seen) and len(self._where) < self.world_size:  # (again at the next beat if it failed)
                self._learn_where()
            ranks = [r for r in range(self.world_size) if seen[r]]
            values = self.store.multi_get([keys[r] for r in ranks])
        except Exception as e:  # noqa: BLE001 - the store's host is gone or not answering: the judge decides
            return type(e).__name__ != "DistNetworkError"
        now = time.monotonic()
        for r, v in zip(ranks, values):
            if v != self._values[r]:
                self._values[r], self._changed[r] = v, now
        self._last_ok, self._trying = now, None
        return True

    def _learn_where(self) -> None:
        for r, v in enumerate(self.store.multi_get([f"who/{r}" for r in range(self.world_size)])):
            host, _, pid = v.decode().rpartition(" ")
            self._where[r] = (host, int(pid))

    # -- what this rank saw: clock only ------------------------------------------------------
    def ages(self) -> dict[int, float]:
        """Seconds each other rank's heartbeat was seen unchanged: from the read that first saw its counter's
        value to this rank's latest read (which saw the same value). Time in which this rank did not read (its
        beater did not run: its process starved or stopped, its main thread holding the GIL in C code) counts for
        no one until the next read, which either sees a new beat or confirms the silence: a rank's own delay is
        never charged to a peer (a starved rank 0 whose judge ran before its beater named a live rank 1 after a
        complete run beside a loaded suite). While the store does not answer a call, only rank 0 (its host) is
        aged, since that call began: the others' counters cannot be read."""
        now = time.monotonic()
        trying = self._trying
        if self.rank != 0 and trying is not None and now - trying >= self.interval_s * 1.5:
            return {0: now - trying}
        return {r: max(0.0, self._last_ok - self._changed[r]) for r in range(self.world_size) if r != self.rank}
