"""The lost-peer error: which rank is gone when this rank's connection to a peer broke.

An engine that loses a peer (it died, was killed, its host went down) fails with "connection closed by peer",
reset or refused, naming an address at best. :func:`lost_peer_error` asks this process's watchdog
(:func:`distkit.health.watchdog.active`) whose heartbeat has stopped and turns the failure into a
:class:`~distkit.errors.RankLost` naming the rank and its host. A stall (no answer, no broken connection) is the
judge's (:mod:`distkit.health.watchdog`), not this.
"""
from __future__ import annotations

from typing import Optional

from distkit.errors import RankLost, RankStalled
from distkit.health.watchdog import active, explain_stall, ranks_text
from distkit.launch.guard import end_launcher_after
from distkit.launch.netif import host_identity

#: what :func:`lost_peer_error` found (kept after the watchdog stops: the failure is reported later)
_LOST: Optional[RankLost] = None
_LOOKED = False  # lost_peer_error looked already (it waits once per process)


def lost_peer_error(exc: BaseException) -> Optional[RankLost]:
    """Where a rank failed because its connection to a peer broke ("connection closed by peer", reset,
    refused: :func:`distkit.launch.spawner.connection_lost`; not a timeout): the rank that is gone, as a
    :class:`RankLost` naming it and its host, for this rank to report instead of the engine's message
    (which names an address at best). Watches the heartbeats until a rank's has stopped
    (:meth:`Watchdog.lost <distkit.health.watchdog.Watchdog.lost>`, a few seconds at most), once per process: later
    calls return the same answer at once. None when no heartbeat stopped (the peer is alive: it failed on its own
    and its launcher reports it), when ``exc`` is not a broken connection, or when no watchdog runs. Not
    collective."""
    global _LOST, _LOOKED
    from distkit.launch.spawner import connection_lost

    watchdog = active()
    if watchdog is None:  # (before the watchdog ran: a stopped rank of this host is the cause; named, no return)
        explain_stall()
    if _LOOKED or isinstance(exc, RankStalled) or not connection_lost(exc):
        return _LOST
    if watchdog is not None:
        _LOOKED = True
        ranks = watchdog.lost()
        if not ranks:
            return None
        where = [watchdog._where.get(r, ("", 0)) for r in ranks]
        hosts = sorted({host.split("|")[0] for host, _ in where if host})
        which = ranks_text(ranks)
        on = f" (host {', '.join(hosts)})" if hosts else ""
        if any(host != host_identity() for host, _ in where):  # (one of this host: its launcher saw it end)
            end_launcher_after(f"{which}{on} gone")
        _LOST = RankLost(
            f"{which}{on} is gone: the connection to it closed and its heartbeat stopped (noticed by rank "
            f"{watchdog.rank}): it died, was killed, or its host went down; its own output, if any, has "
            f"the cause (this rank's error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})",
            ranks)
    return _LOST
