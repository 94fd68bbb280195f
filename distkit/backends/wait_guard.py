"""A bound for an engine's blocking waits where the engine has none of its own: Horovod under ``horovodrun --gloo``.

Under mpirun Horovod's stall inspector shuts Horovod down when some ranks submitted an op and others did not for
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (distkit sets ``timeout_s``), and the waiting ranks raise. Under its Gloo
controller no stall check runs (measured: ``benchmarks/stall_matrix.py --faults hang --cases horovod-horovodrun``,
a rank hanging alive after step 5 kept the job waiting until the benchmark killed it at 90 s; no Horovod stall
warning appeared), and a rank that hangs alive keeps its heartbeat beating, so distkit's watchdog rightly does
not call it stalled. This guard bounds the waits themselves: the engine marks each wait (its ``waiting()``: the
gradient synchronize, the loop's collectives), a daemon thread looks every quarter of the bound (at most 1 s), and
a wait older than the bound in force (:func:`distkit.backends.startup.bound`: start-up's until the ranks met after
their first step, then ``timeout_s``) prints one line and ends this rank with exit status 2; the launcher then ends
the job (the other ranks on this host are ended first, ``before_exit``: a peer that hangs alive would otherwise
outlive the launcher's first signal and its watchdog name this rank, gone, as the one that stopped responding). The
thread only reads two attributes the waiting thread sets, so a wait costs nothing more.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional


class WaitGuard:
    """Ends this rank (exit 2, one line on stderr) when one wait marked with :meth:`waiting` lasts longer than
    ``bound()`` seconds. ``bound_text()`` names the bound in force (``distributed.timeout_s = 4 s``). Not
    collective; one per rank, its thread started at the first wait."""

    def __init__(self, rank: int, bound: Callable[[], float], bound_text: Callable[[], str], why: str,
                 before_exit: Callable[[], None] = lambda: None) -> None:
        self.rank, self._bound, self._bound_text, self._why = rank, bound, bound_text, why
        self._before_exit = before_exit
        self._since: Optional[float] = None
        self._what = ""
        self._thread: Optional[threading.Thread] = None

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Mark a blocking wait (not re-entrant: an inner wait's mark ends with it, the outer keeps its own)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="distkit-wait-guard", daemon=True)
            self._thread.start()
        outer = (self._since, self._what)
        self._since, self._what = time.monotonic(), what
        try:
            yield
        finally:
            self._since, self._what = outer

    def _watch(self) -> None:
        while True:
            bound = self._bound()
            time.sleep(min(1.0, max(bound / 4, 0.05)))
            since, what = self._since, self._what
            if since is not None and time.monotonic() - since > bound:
                sys.stderr.write(f"distkit: rank {self.rank}: {what} did not complete within {self._bound_text()} "
                                 f"({self._why}): ending this rank\n")
                sys.stderr.flush()
                self._before_exit()
                os._exit(2)  # the waiting thread sits in the engine's C++ wait: no exception can reach it
