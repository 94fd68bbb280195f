"""The heartbeat store: a :class:`torch.distributed.TCPStore` served by rank 0 on a free port, one client per rank.

Its address reaches the other ranks once, through the engine's own ``broadcast_object``, so the mpi and horovod
engines need no torch process group. It listens on loopback when every rank is on rank 0's host, else on the
address rank 0 advertises: the interface toward ``MASTER_ADDR`` (a host name may resolve to loopback), else the
host's own address; never on every interface where that address is known (issue 59).

The store is torch's: it cannot refuse a peer that reaches it. Rank 0 also makes the job's token here
(:func:`distkit.health.records.new_token`) and sends it with the address, through the same broadcast; every value
distkit writes to the store is sealed with it and a value that fails its seal is ignored
(:mod:`distkit.health.records`).

Cost: per heartbeat interval each rank sends one ``set`` and one ``multi_get`` of ``world_size`` keys to rank 0's
store (``world_size**2`` key reads and as many HMACs per interval in all: fine for hundreds of ranks).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

from distkit.health import faults
from distkit.health.records import new_token
from distkit.launch import startup_watch
from distkit.launch.netif import host_identity, is_ip, reachable_address, serve_store

if TYPE_CHECKING:
    from distkit.health.protocols import StrategyLike


def connect_store(strategy: StrategyLike, timeout_s: float,
                  startup_s: Optional[float] = None) -> Optional[tuple[Any, bytes]]:
    """Collective (one ``strategy.broadcast_object``, two ``all_gather_object``; more than one rank): this rank's
    client of the heartbeat store (rank 0's is the server itself) and the job's token (rank 0's, the same on every
    rank: :mod:`distkit.health.records`), on every rank; None on every rank when the store
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
    faults.maybe_fire(strategy.rank, 0, "store")  # (a test's rank stopped after its engine's start-up, before this)
    # Under the MPI engines nothing else bounds these collectives for a rank stopped just before them: MPI has no
    # timeout and Horovod's stall check waits in MPI for that rank too (a Horovod job under mpirun waited forever).
    # The start-up guard does, in a process of its own, and names a stopped rank of this host.
    bounded = (startup_watch.guard(strategy.rank, timeout.total_seconds(), "the heartbeat store's set-up")
               if strategy.name in ("mpi", "horovod") else contextlib.nullcontext())
    with bounded:
        one_host = len(set(strategy.all_gather_object(host_identity()))) == 1
        if strategy.rank == 0:
            try:
                # The address the others reach: the interface toward MASTER_ADDR (a host name may resolve
                # to loopback), else the host's own address; the store listens there only (loopback on one host).
                addr = reachable_address(os.environ.get("MASTER_ADDR")) or _my_address()
                bind = "127.0.0.1" if one_host else addr if is_ip(addr) else ""
                store = serve_store(bind, 0, None, timeout)
                where = {"host": host_identity(), "port": int(store.port), "addr": addr, "bind": bind,
                         "token": new_token().hex()}
                faults.note_store(addr if bind == "" else bind, int(store.port))
            except Exception as e:  # noqa: BLE001 - reported below, the run goes on without a watchdog
                error = f"{type(e).__name__}: {e}"
        where = strategy.broadcast_object(where, 0)
        if strategy.rank != 0 and where is not None:
            local = where["host"] == host_identity() and where["bind"] in ("127.0.0.1", "")
            addr = "127.0.0.1" if local else where["addr"]
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
    return store, bytes.fromhex(where["token"])
