"""The heartbeat store: a :class:`torch.distributed.TCPStore` served by rank 0 on a free port, one client per rank.

Its address reaches the other ranks once, through the engine's own ``broadcast_object``, so the mpi and horovod
engines need no torch process group. Rank 0 advertises the interface toward ``MASTER_ADDR`` (a host name may
resolve to loopback), else the host's own address; a rank on rank 0's host connects to 127.0.0.1.

Cost: per heartbeat interval each rank sends one ``add`` and one ``multi_get`` of ``world_size`` keys to rank 0's
store (``world_size**2`` key reads per interval there: fine for hundreds of ranks).
"""
from __future__ import annotations

import datetime
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

from distkit.launch.netif import host_identity, reachable_address

if TYPE_CHECKING:
    from distkit.health.protocols import StrategyLike


def connect_store(strategy: StrategyLike, timeout_s: float, startup_s: Optional[float] = None) -> Optional[Any]:
    """Collective (one ``strategy.broadcast_object``, one ``all_gather_object``; more than one rank): this rank's
    client of the heartbeat store (rank 0's is the server itself), on every rank; None on every rank when the store
    cannot be served or some rank cannot reach it (rank 0 and each rank that failed print one line: the job runs
    on without a watchdog, with the engines' own timeouts).

    Args:
        strategy: the engine, already initialised (its collectives work).
        timeout_s: ``distributed.timeout_s`` (seconds, > 0).
        startup_s: ``distributed.startup_s()`` (seconds): connecting is start-up, so the store's calls are bounded by
            the larger of the two.
    """
    import torch.distributed as dist

    from distkit.env import _my_address

    # (connecting is start-up: its bound)
    timeout = datetime.timedelta(seconds=max(float(timeout_s), float(startup_s or 0.0)))
    store, where, error = None, None, ""
    if strategy.rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
            # The address the others reach: the interface toward MASTER_ADDR (a host name may resolve
            # to loopback), else the host's own address.
            where = {"host": host_identity(), "port": int(store.port),
                     "addr": reachable_address(os.environ.get("MASTER_ADDR")) or _my_address()}
        except Exception as e:  # noqa: BLE001 - reported below, the run goes on without a watchdog
            error = f"{type(e).__name__}: {e}"
    where = strategy.broadcast_object(where, 0)
    if strategy.rank != 0 and where is not None:
        addr = "127.0.0.1" if where["host"] == host_identity() else where["addr"]
        try:
            store = dist.TCPStore(addr, where["port"], None, False, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            error = f"cannot reach rank 0's heartbeat store at {addr}:{where['port']}: {type(e).__name__}: {e}"
    ok = strategy.all_gather_object(store is not None)
    if not all(ok):
        if error or strategy.rank == 0:
            print(f"distkit: rank {strategy.rank}: no stall watchdog ({error or 'a rank cannot reach the store'}); "
                  f"a stopped rank is noticed only by the engine's timeout", file=sys.stderr, flush=True)
        return None
    return store
