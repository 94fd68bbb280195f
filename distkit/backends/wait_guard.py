"""A bound for an engine's blocking waits where the engine has none of its own: MPI's collectives (the mpi engine),
Horovod under ``horovodrun --gloo``.

MPI has no timeout: a collective a peer never joins waits forever. Under mpirun Horovod's stall inspector shuts
Horovod down when some ranks submitted an op and others did not for ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``
(distkit sets ``timeout_s``), and the waiting ranks raise; under its Gloo controller no stall check runs (measured:
``benchmarks/stall_matrix.py --faults hang --cases horovod-horovodrun``, a rank hanging alive after step 5 kept the
job waiting until the benchmark killed it at 90 s). A rank that hangs alive keeps its heartbeat beating, so
distkit's watchdog rightly does not call it stalled. This guard bounds the waits themselves: the engine marks each
wait (:meth:`WaitGuard.waiting`), a daemon thread looks every quarter of the bound (at most 1 s), and a wait older
than the bound in force (:func:`distkit.backends.startup.bound`: start-up's until the ranks met after their first
step, then ``timeout_s``) first lets the heartbeat watchdog name a stalled peer (:func:`distkit.health.watchdog.explain_stall`:
a peer whose heartbeat is late is the cause, named by the judge, which ends the job), else prints one line and ends
the job the engine's way (MPI_Abort; Horovod: this rank exits 2 and its launcher ends the rest, the other ranks on
this host ended first, ``before_exit``: a peer that hangs alive would otherwise outlive the launcher's first signal
and its watchdog name this rank, gone, as the one that stopped responding). The thread only reads two attributes
the waiting thread sets, so a wait costs nothing more.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional

from distkit.health.watchdog import explain_stall


class WaitGuard:
    """Ends the job (one line on stderr: ``distkit: rank R: WHAT did not complete within BOUND (WHY): ENDING``) when
    one wait marked with :meth:`waiting` lasts longer than ``bound()`` seconds. ``bound_text()`` names the bound in
    force (``distributed.timeout_s = 4 s``); ``end`` ends the job and does not return (default: this rank exits 2,
    its launcher ends the others). Not collective; one per rank, its thread started at the first wait."""

    def __init__(self, rank: int, bound: Callable[[], float], bound_text: Callable[[], str], why: str,
                 before_exit: Callable[[], None] = lambda: None, end: Optional[Callable[[], None]] = None,
                 ending: str = "ending this rank") -> None:
        self.rank, self._bound, self._bound_text, self._why = rank, bound, bound_text, why
        self._before_exit, self._end, self._ending = before_exit, end or (lambda: os._exit(2)), ending
        self._since: Optional[float] = None
        self._what = ""
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark a blocking wait (an inner wait's mark ends with it, the outer keeps its own)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="distkit-wait-guard", daemon=True)
            self._thread.start()
        outer = (self._since, self._what)
        self._since, self._what = time.monotonic(), what
        try:
            yield
        finally:
            self._since, self._what = outer

    def close(self) -> None:
        """Stop the thread (the engine's teardown: no wait is marked any more)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, max(self._bound() / 4, 0.05))):
            since, what = self._since, self._what
            if since is not None and time.monotonic() - since > self._bound():
                explain_stall()  # a stalled peer: the heartbeat watchdog names it and ends the job (no return)
                sys.stderr.write(f"distkit: rank {self.rank}: {what} did not complete within {self._bound_text()} "
                                 f"({self._why}): {self._ending}\n")
                sys.stderr.flush()
                self._before_exit()
                # the waiting thread sits in the engine's C++ wait: no exception can reach it
                self._end()
