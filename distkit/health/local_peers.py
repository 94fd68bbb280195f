"""The end of the job on this host: every rank here must have left, and none may be left stopped.

A run is over after the engine's teardown, but the job is not until every rank has exited: a rank stopped
(SIGSTOP) or hung now would keep its launcher (mpirun, torchrun, distkit's spawner) waiting forever once the
others have gone. The lowest rank of each host sees its host's ranks out (:meth:`LocalPeers.see_local_peers_out`),
from the ranks' places (host identity, pid) that the heartbeat learned from the store's ``who/<rank>`` keys
(:class:`distkit.health.heartbeat.Heartbeat`). The marks are local to the host (:mod:`distkit.launch.procfs`), never
store keys: the store's server, rank 0, may have left already.

Only a process known to be a rank of this job is ever signalled: one whose pid this host's ranks saw carry the
rank's mark when they learned the places (:mod:`distkit.health.records`), and that is still the same process (its
start time). A record that names some other pid (forged, stale, a bug) names a process that is never touched.

:class:`LocalPeers` is a part of :class:`distkit.health.watchdog.Watchdog` (a mixin; it holds no state of its own).
"""
from __future__ import annotations

import os
import sys
import time

from distkit.launch import procfs
from distkit.launch.netif import host_identity


class LocalPeers:
    """The ranks on this host, as far as this rank has learned where the ranks run: their end. Not collective."""

    #: this rank (set by the heartbeat)
    rank: int
    #: rank -> (host identity, pid), once every rank beat (learned by the heartbeat; pid 0: not known to be the rank)
    _where: dict[int, tuple[str, int]]

    def is_rank(self, r: int) -> bool:  # (the heartbeat's: whether rank r's pid is still its marked process)
        raise NotImplementedError

    def kill_rank(self, r: int) -> bool:  # (the heartbeat's: SIGKILL rank r's process if is_rank(r))
        raise NotImplementedError

    def leave(self) -> None:
        """Mark this rank as leaving (after its engine's teardown), for :meth:`reap_local_peers`: the mark is
        this process's name (:func:`distkit.launch.procfs.mark_left`), local to the host. Not a key in the heartbeat
        store: its server, rank 0, may be gone by now (on another host it can leave first), and a peer whose
        exit then waits on this host's reaper (MPI_Finalize under mpirun is collective) would deadlock with
        a reaper that waits for its mark or its exit."""
        procfs.mark_left()

    def _local_ranks(self) -> list[int]:
        """The ranks on this host (as far as this rank has learned where the ranks run, and their processes carried
        their marks; this rank itself), in order."""
        here = host_identity()
        return sorted(r for r, (host, pid) in self._where.items() if host == here and (pid > 0 or r == self.rank))

    def reap_local_peers(self, timeout_s: float) -> list[int]:
        """The end of a run, on the lowest rank of this host only: wait until every other rank on this host
        has left (marked by :meth:`leave`) or exited. A peer that is stopped (SIGSTOP, state T) for a
        second, or still there after ``timeout_s``, would keep the launcher (mpirun, torchrun, the
        spawner) waiting forever once the others have gone: it is SIGKILLed and returned. Not collective;
        the other ranks return [] at once (only one rank per host waits, so none waits for a waiter)."""
        local = self._local_ranks()
        if not local or local[0] != self.rank:
            return []
        peers = {r: self._where[r][1] for r in local if r != self.rank}
        deadline, stopped_since = time.monotonic() + timeout_s, {}
        killed: list[int] = []
        while peers:
            now = time.monotonic()
            for r, pid in list(peers.items()):
                state = procfs.state(pid)
                if state in (None, "Z") or procfs.has_left(pid) or not self.is_rank(r):  # (gone, or its pid reused)
                    del peers[r]
                    continue
                if state in ("T", "t"):
                    stopped_since.setdefault(r, now)
                else:
                    stopped_since.pop(r, None)
                if now - stopped_since.get(r, now) >= 1.0 or now >= deadline:
                    if self.kill_rank(r):
                        killed.append(r)
                    del peers[r]
            if peers:  # (no sleep after the last: the launcher may stop this rank any moment after its peer died)
                time.sleep(0.05)
        return killed

    def see_local_peers_out(self, timeout_s: float, watch_exit: bool = True) -> None:
        """The end of a normal run, after the engine's teardown: the run is over, but the job is not until
        every rank has left; a rank stopped now would keep the launcher waiting forever once the others are
        gone. Marks this rank as leaving; the lowest rank of each host then waits for its host's ranks
        (:meth:`reap_local_peers`) and, if it had to end any, says so in one line and exits with status 1
        (the run's outputs are complete). The lowest rank then hands the watch over the host's ranks, itself
        included, to a watcher process until they have exited (:mod:`distkit.launch.exit_watch`: a rank stopped
        between its mark and its exit kept ``MPI_Finalize`` and the launcher waiting forever); not with
        ``watch_exit`` False (a launcher that does it itself). Not collective."""
        self.leave()
        killed = self.reap_local_peers(timeout_s)
        local = self._local_ranks()
        if watch_exit and not killed and len(local) > 1 and local[0] == self.rank:
            from distkit.launch import exit_watch

            exit_watch.watch_until_exit({r: self._where[r][1] for r in local if r == self.rank or self.is_rank(r)})
        if killed:
            names = ", ".join(str(r) for r in killed)
            print(f"distkit: rank{'s' * (len(killed) > 1)} {names} stopped responding while the job ended (after "
                  f"the last collective); ended {'them' if len(killed) > 1 else 'it'}: the run's outputs are "
                  "complete, the job exits non-zero", file=sys.__stderr__ or sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)

    def kill_local(self, ranks: list[int]) -> None:
        """SIGKILL those of ``ranks`` that run on this host (their processes as learned: :meth:`is_rank`), never
        this process."""
        for r in ranks:
            self.kill_rank(r)
