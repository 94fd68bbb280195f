"""Fault-tolerant replica groups with torchft (``fault_tolerance = {...}``, param mode).

Each replica group is a launch of its own (its own ``torchrun`` / ``mpirun`` / ``--nprocs`` / SLURM job
step) with ``fault_tolerance.replica_id`` = its index. Inside a group the chosen engine reduces gradients
every step (as replica groups in one job do, :mod:`distkit.sync.replicas`); across groups, param mode: every
``param_sync_step`` steps each rank averages its parameters and floating buffers with the ranks at its
position in the other groups, through torchft's :class:`torchft.manager.Manager`:

* the Manager asks the lighthouse (``torchft_lighthouse``, ``distkit lighthouse``) for a *quorum* of the
  groups alive at that sync; a group that died is not in it, so the others average without it;
* the average goes over torchft's reconfigurable gloo group of the quorum (with ``param_sync_compression``, the
  parameters as each group's encoded pseudo-gradient, :mod:`distkit.ft.codec_exchange`); the Manager's
  ``should_commit`` then agrees whether every participant completed it. A sync that failed (a group died
  mid-exchange) is not applied: every group keeps its own model and tries again at the next sync;
* a group that (re)starts, or that fell behind (missed a sync), *heals* at its first quorum: it receives
  a live group's state (model, optimizer, averager, step and sample counters) over torchft's HTTP
  transport, and from then on syncs with the others.

Data: group ``i`` of ``num_replicas`` trains on the slices that ranks ``i * G .. i * G + G - 1`` of one
job of ``num_replicas * G`` ranks would, so with no failure a fault-tolerant run equals the same replica
groups in one job (:mod:`distkit.sync.replicas`). What a failure costs: the dead group's steps since its last
sync, and each survivor's sync in flight when it died (skipped, not lost: the local steps stay).

Cross-rank contract: every rank of every group calls :meth:`FaultTolerance.average` at every sync (collective
across the groups through torchft). A group that starts later, or restarts, trains from the start until its
first sync, where it heals: its first period is lost (torchft's LocalSGD does the same).

Beside it: :mod:`distkit.ft.watch` (what a rank inside a sync watches: the lighthouse, its own clock),
:mod:`distkit.ft.state` (the training state a heal carries, and each group's data slices) and
:mod:`distkit.ft.torchft_parts` (torchft's parts, adapted: log lines, quorums, heal server, gloo group).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import sys
import threading
import time
import urllib.parse
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch.distributed import ReduceOp

from distkit.health import faults
from distkit.sync.averager import unflatten_into
from distkit.sync.compression import codec_of
from distkit.errors import LighthouseLost
from distkit.ft import checks, gate
from distkit.ft.checks import CONNECT_TIMEOUT_S
from distkit.ft.codec_exchange import CodecExchange
from distkit.ft.late import LateMerge
from distkit.ft.state import load_training_state, training_state
from distkit.ft.torchft_parts import (QuorumsSeen, TorchftLines, groups_of, heal_transport, manager_server_on,
                                     quiet_heal_server, quorum_gloo)
from distkit.ft.watch import (FROZEN_S, PROBE_TIMEOUT_S, TICK_S, WATCH_INTERVAL_S, Watch, groups_named_ago,
                              lighthouse_answers, lighthouse_status, stale_heartbeats)

if TYPE_CHECKING:
    from distkit.backends.base import Strategy
    from distkit.ft.state import SessionView

class FaultTolerance:
    """This rank's torchft Manager, and the syncs through it.

    Args:
        strategy: the engine, initialised (its collectives work over this rank's group, the launch).
        ft: the validated ``fault_tolerance`` dict.
        timeout_s: ``distributed.timeout_s``: the bound of one exchange across groups (seconds).
        state_dict, load_state_dict: this rank's whole training state for a healing group, and its inverse
            (model, optimizer, averager, counters): served to, or received from, the same rank of a live group.
        step_of: the number of the step whose sync this is (recorded with each sync's outcome).
        samples_of: the samples this group has trained on so far (``fault_tolerance.late = 'merge'``: the weight of
            its pseudo-gradient is the samples since its last merged sync).
        final_of: whether this sync is the run's last (``late = 'merge'``: it waits for every group that heartbeats).
    """

    def __init__(self, strategy: "Strategy", ft: dict[str, Any], timeout_s: float,
                 state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None],
                 step_of: Callable[[], int], samples_of: Callable[[], int] = lambda: 0,
                 final_of: Callable[[], bool] = lambda: False) -> None:
        import torch.distributed as dist
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        from distkit.env import _my_address
        from distkit.launch.netif import is_ip, reachable_address, serve_store

        self.replica_id, self.num_replicas = int(ft["replica_id"]), int(ft["num_replicas"])
        self.url, self._rank, self._end_job = ft["lighthouse"], strategy.rank, strategy.end_job
        self._strategy = strategy
        url = urllib.parse.urlparse(ft["lighthouse"])
        here = reachable_address(url.hostname) or _my_address()
        #: the lighthouse's token (its gate lets only holders in; it also seals the heal requests), None without
        self._token = checks.token_of(ft)
        # torchft's Manager cannot prove the token itself: it is given a loopback port of this process whose
        # connections are carried to the gate after the proof (distkit.ft.gate)
        self._tunnel = gate.Tunnel(url.hostname or "", url.port or 80, self._token) if self._token else None
        timeout = datetime.timedelta(seconds=float(timeout_s))
        # torchft's own logs (every quorum, every commit) go to its loggers; distkit reports the membership itself
        for name in ("torchft_quorums", "torchft_commits"):
            logging.getLogger(name).setLevel(logging.WARNING)
        # torchft's Manager logs: a warning at every new quorum that means nothing without NCCL (CPU) is dropped,
        # a handled failure's traceback becomes one distkit line (its real warnings stay)
        logging.getLogger("torchft.manager").addFilter(TorchftLines(self.replica_id, self._rank, lambda: self._step_of()))
        # The group's store for torchft (its manager's address; the cross-group gloo group of a quorum meets in
        # the store of one member, so it must be reachable from the other groups' hosts): served by this group's
        # rank 0, found by the others with one broadcast.
        self._store = None
        where = None
        if strategy.rank == 0:
            # on the address the other groups are told (a single-host job's is loopback), not on every interface
            self._store = serve_store(here if is_ip(here) else "", 0, None, timeout)
            where = (here, int(self._store.port))
        host, port = strategy.broadcast_object(where, 0) if strategy.world_size > 1 else where
        #: how many heals this rank went through (the caller re-seeks its data when it grows)
        self.heals = 0
        self._step_of = step_of
        self._load_state_dict = load_state_dict
        #: a live group's state received at this sync, applied only once the whole group committed it
        self._received: Optional[dict[str, Any]] = None

        def load(state: dict[str, Any]) -> None:
            # torchft calls this inside should_commit on the ranks whose fetch succeeded: a rank whose source died
            # mid-heal has none. So nothing collective here: the group applies it after a committed should_commit
            # (which every rank of the group reaches, and which fails for all of them if one rank's fetch failed)
            # copied (deepcopy keeps tensors that share memory shared): the tensors arrive over the HTTP
            # response's read-only bytes, and the optimizer's load keeps CPU tensors as they are, then steps them
            self._received = copy.deepcopy(state)

        # torchft's HTTP transport builds the received tensors on the response's bytes (torch.frombuffer), which
        # torch warns are not writable: the heal's callback copies them (copy.deepcopy) before anything writes into them
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                                module=r"torch\.distributed\._serialization")
        os.environ.setdefault("TORCHFT_QUORUM_RETRIES", "0")  # a failed quorum is reported, not retried silently
        connect = datetime.timedelta(seconds=min(float(ft.get("connect_timeout_s", CONNECT_TIMEOUT_S)), float(timeout_s)))
        self._pg = quorum_gloo(ProcessGroupGloo, timeout, connect)
        bind = here if is_ip(here) else ""  # where torchft's servers of this rank listen: the address it is known by
        with manager_server_on(bind):  # (torchft's Manager server: on every interface otherwise)
            self.manager = Manager(
                pg=self._pg, load_state_dict=load, state_dict=state_dict,
                # a live group's state read weights-only, its server on the address the other groups are told
                checkpoint_transport=heal_transport(timeout, bind, self._token),
                # async quorum: a healing group takes no part in the average of the sync it joins at (its tensors are
                # zeroed and not counted), receives it, and gets the rest of a live group's state at should_commit
                min_replica_size=int(ft.get("min_replicas", 1)), use_async_quorum=True, timeout=timeout,
                quorum_timeout=datetime.timedelta(seconds=float(ft.get("quorum_timeout_s", 600))),
                connect_timeout=datetime.timedelta(seconds=PROBE_TIMEOUT_S * 2),
                rank=strategy.rank, world_size=strategy.world_size, store_addr=host, store_port=port,
                lighthouse_addr=self._tunnel.url if self._tunnel else ft["lighthouse"], replica_id=f"distkit_group_{self.replica_id}", hostname=here,
                # every group starts from the same model (the seed, and rank 0's broadcast inside the group): no heal
                # at step 0, which would replace the other groups' first period by one group's
                init_sync=False)
        # torchft's Manager drops each quorum's answer once it has configured itself: kept, for the groups' names
        self._quorums = QuorumsSeen(self.manager._client)
        self.manager._client = self._quorums
        quiet_heal_server(self.manager, f"group {self.replica_id} rank {strategy.rank}")
        #: every sync's outcome: {"step", "groups" (how many took part), "members" (the quorum's groups, healing ones
        #: included), "committed", "healed" (this group healed), "healed_from" (the groups its ranks' states came from),
        #: "gave_up", "ahead_without" and "late_merged" (this group's counts so far, below); with late = 'merge' also
        #: "late" (this group merged a late pseudo-gradient here) and "grace_wait_s" (its wait in the grace window)}
        self.syncs: list[dict[str, Any]] = []
        self.wait_s = 0.0  #: seconds in quorums and exchanges across groups
        #: committed syncs that went ahead with fewer than num_replicas groups, and late pseudo-gradients merged (a
        #: late group's, counted by every group of the sync it merged at): in each sync record
        self.ahead_without, self.late_merged = 0, 0
        #: ``fault_tolerance.late``: "heal" (a group left out of a sync heals at its next one: its period is
        #: replaced) or "merge" (its pseudo-gradient is merged at the next sync it joins, weighted by its samples)
        self.late = (LateMerge(self.manager, samples_of, ft, strategy.rank, final_of)
                     if ft.get("late", "heal") == "merge" else None)
        self._quorum_timeout_s = float(ft.get("quorum_timeout_s", 600))
        #: ``param_sync_compression``: the compressed exchange of the averager's parameters across the groups
        #: (:mod:`distkit.ft.codec_exchange`; set by :func:`join`), None: the fp32 average
        self.codec: Optional[CodecExchange] = None

    def average(self, tensors: list[torch.Tensor]) -> bool:
        """Collective: set ``tensors`` to their mean over the groups in this sync's quorum, if every participant
        completed the exchange (``should_commit``); else leave them as they were. Returns whether it committed.
        A rank that heals at this sync takes no part in the average, receives it, and gets the rest of a live
        group's state once the whole group committed (``load_state_dict``, collective over the group; ``heals``
        then grows); a heal that failed on any rank of the group is undone on all of them and retried at the
        next sync. With :attr:`codec` the averager's parameters among ``tensors`` are exchanged encoded instead
        (:mod:`distkit.ft.codec_exchange`: their result is ``anchor - mean`` of the decoded pseudo-gradients), the
        rest averaged in fp32, both in this sync's quorum."""
        if not tensors:
            return True
        t0, heals = time.perf_counter(), self.heals
        why = lighthouse_answers(self.url, self._token)
        if why is not None:
            raise self._lost(why)
        before = {"step": self.manager.current_step(), "batches_committed": self.manager.batches_committed()}
        # late = 'merge': the members of the last quorum ask together, within the grace window (distkit.ft.late)
        graced = (self.late.arrive(lambda: lighthouse_status(self.url, self._token), self.replica_id, before["step"],
                                   self._quorum_timeout_s) if self.late is not None else 0.0)
        with torch.no_grad(), self._watching_lighthouse(self._quorums.count) as watch:
            self.manager.start_quorum()
            if self.late is not None:
                self.late.asked()
            pending = self.codec.prepare(tensors) if self.codec is not None else None
            plain = tensors if pending is None else [tensors[k] for k in pending.plain]
            flat = torch.cat([t.detach().reshape(-1) for t in plain]) if plain else None
            self.manager.wait_quorum()  # (allreduce's first act; here so that a test can freeze a group after it)
            faults.maybe_fire(self._rank, self._step_of(), "exchange")
            merging = (self.late.payload(flat, self._quorums.last, before["step"])
                       if self.late is not None and flat is not None else None)
            works: list[Any] = []
            if merging is not None:  # late = 'merge': the weighted pseudo-gradients summed (a late group's counted too)
                with self.late.participating():  # type: ignore[union-attr]
                    works.append(self._allreduce(merging, ReduceOp.SUM))
            elif flat is not None:
                works.append(self._allreduce(flat, ReduceOp.AVG))  # AVG: sum over the participants, / their number
            if pending is not None:  # the encodings all-gathered: each participant's in its slot, summed
                slot = self.manager.participating_rank() if self.manager.is_participating() else None
                works.append(self._allreduce(self.codec.slots(pending, slot, self.manager.num_participants()),  # type: ignore[union-attr]
                                             ReduceOp.SUM))
            gave_up = None
            for work in works:  # (once one is given up, the sync fails: the rest is not waited for)
                gave_up = self._wait_exchange(work, watch) if gave_up is None else gave_up
            if gave_up is not None:  # the sync fails on every rank of this group (should_commit agrees so)
                self.manager.report_error(RuntimeError(gave_up))
                self._pg.keep_alive()
            committed = self.manager.should_commit()
            received, self._received = self._received, None
            quorum = self._quorums.last
            members = groups_of(quorum.replica_ids) if quorum is not None else []
            healed_from: list[int] = []
            if committed and received is not None:  # every rank of this group received a live group's state
                self._load_state_dict(received)  # collective over this group
                self.heals += 1
                # torchft spreads a group's ranks over the live groups: each rank's source, named (a heal is rare)
                src = quorum.recover_src_replica_rank if quorum is not None else None
                mine = groups_of([quorum.replica_ids[src]])[0] if src is not None else -1
                gathered = self._strategy.all_gather_object(mine) if self._strategy.world_size > 1 else [mine]
                healed_from = sorted({g for g in gathered if g >= 0})
            elif not committed and self.manager.current_step() != before["step"]:
                # a heal that failed on some rank (its source died mid-heal): torchft already moved the step of the
                # ranks whose fetch succeeded; every rank goes back, so the group heals whole at its next sync
                self.manager.load_state_dict(before)
            groups, late = self.manager.num_participants(), 0
            if self.late is not None:
                if not committed:
                    self.late.failed()
                elif merging is None:  # the plain average (the first sync): where the next pseudo-gradients start
                    self.late.committed(flat, quorum)
                else:
                    flat, groups, late = self.late.merged(merging, received is not None, quorum)
                    self.late.dump(self.replica_id, self._rank, self._step_of(), members, flat)
            if committed:
                if flat is not None:
                    unflatten_into(flat, plain)
                if pending is not None:
                    self.codec.committed(pending, tensors, received is not None, self.replica_id, self._rank,  # type: ignore[union-attr]
                                         self._step_of())
                if groups < self.num_replicas:
                    self.ahead_without += 1
                self.late_merged += late
        self.wait_s += time.perf_counter() - t0
        self.syncs.append({"step": self._step_of(), "groups": groups, "members": members,
                           "committed": bool(committed), "healed": self.heals > heals, "healed_from": healed_from,
                           "gave_up": gave_up, "ahead_without": self.ahead_without, "late_merged": self.late_merged,
                           # late = 'merge': this group merged late here; how long it waited for the others to arrive
                           **({"late": bool(merging is not None and self.late.was_late),
                               "grace_wait_s": round(graced, 3)} if self.late is not None else {})})
        return committed

    def _allreduce(self, tensor: torch.Tensor, op: Any) -> Any:
        """torchft's all-reduce of ``tensor`` over this sync's participants, started; its bytes counted in the
        engine's ``comm_bytes`` (what the averager's ``sync_bytes`` sums): the whole buffer, as every engine counts
        what it hands to a collective."""
        self._strategy.comm_bytes += tensor.numel() * tensor.element_size()
        return self.manager.allreduce(tensor, reduce_op=op)

    def _wait_exchange(self, work: Any, watch: "Watch") -> Optional[str]:
        """Wait for this sync's exchange across the groups to complete, or give it up: None when it completed
        (or failed, which torchft records: a group that died closes its connections), else why it was given up.

        Given up when a group of the quorum stopped heartbeating (the lighthouse counts it as gone: a frozen
        group keeps its connections open, and the exchange would wait for ``distributed.timeout_s``), or when
        this process itself was stopped inside the sync for :data:`FROZEN_S` or more (the others may have given
        it up meanwhile). Gloo cannot cancel the exchange: it stays pending on this rank (``keep_alive``)."""
        inner = getattr(work, "_work", None)  # the gloo work inside torchft's _ManagedWork
        future = inner.get_future() if hasattr(inner, "get_future") else None
        if future is None:  # torchft's no-op work (this sync had already failed), or another torchft
            work.wait()
            return None
        ended = threading.Event()
        future.add_done_callback(lambda _: ended.set())
        while True:
            done = ended.wait(TICK_S)
            stopped = watch.stopped_s()
            if stopped >= FROZEN_S:
                return (f"this group was stopped for {stopped:.1f} s inside it (SIGSTOP, a debugger or a starved "
                        "machine) and may have been left out: it heals from the others at its next sync")
            if done:
                work.wait()  # (returns at once: torchft's continuation, the division by the participants)
                return None
            if watch.lost is not None:
                return watch.lost

    def _lost(self, why: str) -> LighthouseLost:
        return LighthouseLost(f"rank {self._rank} of replica group {self.replica_id}: the lighthouse {self.url} stopped "
                              f"answering at the sync of step {self._step_of()} ({why}); no sync can commit without "
                              "it: restart it (`distkit lighthouse`) and then this group with ++resume auto, or let "
                              "the groups still running heal it")

    @contextlib.contextmanager
    def _watching_lighthouse(self, quorums_before: int) -> Iterator["Watch"]:
        """While this rank is inside a sync (a quorum, an exchange), two threads of pure Python (nothing of
        torch's runs in them):

        * every :data:`WATCH_INTERVAL_S` the lighthouse's /status page: a lighthouse that stops answering (two
          probes in a row) ends this rank with :meth:`_lost`'s line (the quorum would wait for
          ``quorum_timeout_s``); a group of this sync's quorum (the first one the lighthouse answered after
          ``quorums_before``) that the page marks as gone sets ``lost``, and the exchange is given up;
        * every :data:`TICK_S` the clock: how long this process was stopped (``stopped_s``)."""
        state = Watch()
        done = threading.Event()

        def watch() -> None:
            misses = 0
            while not done.wait(WATCH_INTERVAL_S):
                why, status = lighthouse_status(self.url, self._token)
                misses = misses + 1 if why is not None else 0
                if why is not None and misses >= 2 and not done.is_set():
                    print(f"distkit: error: {self._lost(why)}", file=sys.__stderr__ or sys.stderr, flush=True)
                    self._end_job(1)
                quorum = self._quorums.last if self._quorums.count > quorums_before else None
                if quorum is not None and state.lost is None:
                    stale = stale_heartbeats(status)
                    gone = [(g, stale[r]) for g, r in zip(groups_of(quorum.replica_ids), quorum.replica_ids)
                            if r in stale and g != self.replica_id]
                    if gone:
                        state.lost = (f"{groups_named_ago(gone)} stopped heartbeating inside it (the lighthouse "
                                      "counts it as gone): the groups still alive go on without it")

        def tick() -> None:
            while not done.wait(TICK_S):
                now, cpu = time.monotonic(), time.process_time()
                stopped = state.off(now, cpu)
                # written in this order, read in the other by stopped_s(): who sees the new ``last`` sees the rest
                if stopped > state.stopped:
                    state.stopped = stopped
                state.last_cpu = cpu
                state.last = now

        threads = [threading.Thread(target=watch, name="distkit-lighthouse-watch", daemon=True),
                   threading.Thread(target=tick, name="distkit-stop-watch", daemon=True)]
        for thread in threads:
            thread.start()
        try:
            yield state
        finally:
            done.set()
            for thread in threads:
                thread.join()

    def membership_changes(self) -> list[dict[str, Any]]:
        """The syncs at which the groups changed (their number or which; and the first), with heals and skipped
        syncs."""
        out, last = [], None
        for s in self.syncs:
            if (s["groups"], s["members"]) != last or not s["committed"] or s["healed"]:
                out.append(s)
            last = s["groups"], s["members"]
        return out

    def shutdown(self) -> None:
        """Leave the quorum (the lighthouse stops waiting for this group at once). Not collective."""
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - best effort at the end of the run
            pass
        if self._tunnel is not None:
            self._tunnel.close()
        return None


# -- the Session's side (its own code, kept here; it knows the Session by ft.state's protocol) --------------------
def join(session: "SessionView") -> FaultTolerance:
    """Collective over this group, after ``session.setup``: this rank's Manager, handed to the engine (whose
    ``average_parameters`` then goes through it)."""
    ft = FaultTolerance(session._strategy, session.cfg.fault_tolerance or {}, float(session.cfg.distributed.timeout_s),
                        lambda: training_state(session), lambda state: load_training_state(session, state),
                        lambda: session.num_steps + 1, lambda: session.num_samples,
                        lambda: session.cfg.max_steps is not None and session.num_steps + 1 >= session.cfg.max_steps)
    session._strategy.ft = ft
    codec = codec_of(session.cfg.distributed)
    if codec != "none" and session._strategy.averager is not None:
        ft.codec = CodecExchange(session._strategy.averager, codec)
    return ft
