"""PyTorch DDP (torch.distributed): gloo on CPU, nccl when the device is CUDA.

grad mode: the model is wrapped in DistributedDataParallel (``distributed.options`` are
passed through: ``bucket_cap_mb``, ``find_unused_parameters``, ...), so backward
all-reduces gradient buckets while it runs. param mode: no wrapper; each rank steps on
its own and :class:`~distkit.sync.averager.ParamAverager` averages with one flat all-reduce.
param mode with replica groups (:mod:`distkit.sync.replicas`): DistributedDataParallel on the
rank's group, the averager's all-reduce on its cross group.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distkit.health import faults
from distkit.config import RunConfig
from distkit.env import resolve_rendezvous
from distkit.errors import PortInUse, RankStalled, UsageError
from distkit.launch.guard import kill_stopped_siblings
from distkit.launch.netif import listen_address, prepare_gloo, serve_store
from distkit.health.watchdog import ranks_text

from .base import Strategy
from .parts import bare_module, param_averager

#: Every process group a DDP wrapper of this process reduces over, referenced from here until the process ends.
#: A gloo group's destructor joins its worker threads, and a worker that is dropping a completed work frees
#: tensors Python saw, which takes the GIL. Destroyed from Python (its own object, torch's registry in
#: ``destroy_process_group``) the destructor runs with the GIL released; destroyed because DDP's reducer, its last
#: owner, was freed (the Trainer or a script dropping the wrapper after ``close``), it runs holding the GIL and
#: deadlocks if a worker is still dropping work. Seen once in a whole test run (py-spy of the hung rank, a run
#: that had ended well: ``~ProcessGroupGloo`` in ``thread::join`` <- ``~Reducer`` <- the wrapper freed after
#: ``Trainer.fit``; the worker in ``~AsyncBroadcastWork`` -> ``decref_pyobject`` -> take the GIL), where a
#: 50 ms sleep before the teardown was meant to let the workers drain. Kept here, the reducer never holds the
#: last reference; the groups end with the process (a ``distkit`` rank ends by ``os._exit``; a script's
#: interpreter frees them from Python at exit, long after their last work).
_KEPT_GROUPS: list[Any] = []
#: the store key prefix each rank sets once it reached the rendezvous store (see init); per torchrun
#: restart, as its agent's store outlives the workers it restarts
_ARRIVED = f"distkit/arrived/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


#: the store key under which rank 0 publishes its job's identity (see :func:`job_identity`), per torchrun restart
_JOB = f"distkit/job/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def job_identity(launcher: str, job_id: Optional[str], world_size: int, output_dir: Optional[str],
                 program: str) -> str:
    """What every rank of one job has in common and another job on the same rendezvous port most likely does
    not: the launcher and its job id (where it gives one; the deepspeed launcher does not), the world size,
    ``output_dir`` as configured and the program's file name (``sys.argv[0]``'s). Not the command line nor
    absolute paths: a job's hosts may be started from different directories, or with a config path spelled
    differently, and must still meet. Two jobs alike in all of these would also share their output
    directory, which its lock refuses."""
    return json.dumps({"launcher": launcher, "job_id": job_id, "world_size": world_size, "output_dir": output_dir,
                       "program": os.path.basename(program)})


def _same_job(store: Any, rank: int, identity: str) -> Optional[str]:
    """Rank 0 publishes ``identity``; every other rank reads rank 0's (waiting up to the store's timeout) and
    returns it when it differs from its own (the rendezvous belongs to another job), else None. Before a
    rank writes anything else to the store: a stranger leaves the other job's rendezvous untouched."""
    if rank == 0:
        store.set(_JOB, identity)
        return None
    theirs = store.get(_JOB).decode()
    return theirs if theirs != identity else None


def _not_arrived(store: Any, world_size: int) -> list[int]:
    """The ranks that never set their arrival key in ``store`` (none when it cannot be asked)."""
    missing = []
    for r in range(world_size):
        try:
            if not store.check([f"{_ARRIVED}{r}"]):
                missing.append(r)
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing to name from here
            return []
    return missing


class _Pending:
    """A torch.distributed collective started with ``async_op``: ``wait()`` returns its output (the process
    group's timeout, ``distributed.timeout_s``, bounds the wait)."""

    def __init__(self, work: Any, out: torch.Tensor) -> None:
        self.work, self.out = work, out

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.out


class DDPStrategy(Strategy):
    """torch.distributed + DistributedDataParallel."""

    #: rank 0's rendezvous store server (init), and this rank's client of it or of the launcher's agent store
    _store_server: Any = None
    _store: Any = None

    name = "ddp"
    reduces_in_backward = True

    @classmethod
    def before_forks(cls, cfg: RunConfig) -> tuple[str, ...]:
        """``torch._dynamo`` in grad mode: DDP's constructor reads ``torch._dynamo.utils``, so every rank would load it
        (1.2-1.4 s of CPU each here); param mode has no DDP wrapper and leaves it deferred
        (:func:`distkit.launch.lazy_import.defer_dynamo`)."""
        return ("torch._dynamo",) if cfg.distributed.reduce_type == "grad" else ()

    def init(self) -> None:
        d = self.cfg.distributed
        self.pg_backend = d.pg_backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if dist.is_initialized():  # the user's script initialised it already (SpeechBrain style)
            return
        faults.maybe_fire(self.rank, 0, "init")
        addr, port = resolve_rendezvous(self.env)
        if self.pg_backend == "gloo":  # across hosts: the interface that reaches MASTER_ADDR, not the host name's
            prepare_gloo(addr)
        # A TCPStore on rank 0. distributed.startup_s() bounds the rendezvous (every rank's arrival: the
        # others may still be importing torch) and every collective of start-up; timeout_s every collective after
        # it (end_startup), so a vanished rank surfaces as an error instead of gloo's 30-minute default hang.
        # Under torchrun the agent already serves the store on MASTER_PORT; rank 0 only connects.
        master = self.rank == 0 and not self.env.agent_store
        startup_s = d.startup_s()
        timeout = datetime.timedelta(seconds=startup_s)
        store = None
        try:
            # wait_for_workers=False: the arrivals are awaited below, and a rank that never arrives is then
            # named from the store (a store that waited itself would leave none to ask)
            bind = addr
            if master:  # listening where the ranks reach it only (loopback on one host), not on every interface
                bind = listen_address(addr, self.env.local_world_size >= self.world_size)
                self._store_server = serve_store(bind, port, self.world_size, datetime.timedelta(seconds=startup_s))
                bind = bind or "127.0.0.1"  # ("": every interface, loopback too)
            # Rank 0 is a client of the server it serves, as the other ranks are (at the address it listens on: its
            # host may resolve MASTER_ADDR to another one): the process groups hold the store they were made with for
            # as long as they live, and DDP's live until the process ends (_KEPT_GROUPS). Holding the server, they
            # kept MASTER_PORT listening after close (and a second session in the process found it taken:
            # PortInUse); holding a client, they keep a closed connection (teardown).
            store = dist.TCPStore(bind, port, self.world_size, is_master=False,
                                  timeout=datetime.timedelta(seconds=startup_s), wait_for_workers=False)
            identity = job_identity(self.env.launcher, self.env.job_id, self.world_size, self.cfg.output_dir,
                                    sys.argv[0] if sys.argv else "")
            theirs = _same_job(store, self.rank, identity)
            if theirs is not None:
                mine, other = json.loads(identity), json.loads(theirs)
                differ = ", ".join(f"{k} {other.get(k)!r} there, {v!r} here" for k, v in mine.items() if other.get(k) != v)
                raise PortInUse(f"rank {self.rank}: the rendezvous at {addr}:{port} (MASTER_ADDR/MASTER_PORT, from the "
                                f"{self.env.launcher} launcher) is another job's ({differ}): left untouched; give this "
                                "job its own port (deepspeed --master_port P, torchrun --master_port P or "
                                "--rdzv-endpoint localhost:0, or MASTER_PORT=P)")
            store.set(f"{_ARRIVED}{self.rank}", "1")
            store.wait([f"{_ARRIVED}{r}" for r in range(self.world_size)])  # (the store's timeout: startup_s)
            self._store = store
            dist.init_process_group(self.pg_backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=timeout)
        except RuntimeError as e:  # DistNetworkError, DistStoreError: RuntimeErrors
            if store is None and master and self._store_server is None and "EADDRINUSE" in str(e):
                # Launchers with a fixed default port (the deepspeed launcher's 29500) collide when two jobs
                # run on one host; the ranks of this job get no store and would wait timeout_s for it.
                raise PortInUse(f"the rendezvous port {port} (MASTER_PORT, from the {self.env.launcher} launcher) is "
                                "in use, probably by another job on this host: give this job its own port (deepspeed "
                                "--master_port P, torchrun --master_port P or --rdzv-endpoint localhost:0, or "
                                "MASTER_PORT=P)") from None
            missing = _not_arrived(store, self.world_size) if store is not None else []
            if not missing:
                raise
            # A rank stopped before it reached the store never acts on its launcher's SIGTERM (torchrun then
            # waits 30 s before SIGKILL): stopped ranks on this host are ended now.
            kill_stopped_siblings()
            raise RankStalled(f"{ranks_text(missing)} did not arrive at start-up within {startup_s:g} s "
                              f"(distributed.startup_timeout_s; noticed by rank {self.rank}): it did not start, is stopped, hangs "
                              "or died; its own output, if any, has the cause", missing) from None
        # Groups created later without a timeout (DeepSpeed's clone of the world group that ZeRO reduces
        # on, FSDP's mesh, distkit's replica groups) would get torch's default (30 minutes for gloo): make it
        # start-up's bound now, timeout_s once start-up ends.
        self._default_timeouts = (c10d.default_pg_timeout, c10d.default_pg_nccl_timeout)
        self._set_default_timeout(timeout)

    def _set_default_timeout(self, timeout: datetime.timedelta) -> None:
        """``timeout`` for the groups created from now on without one of their own."""
        c10d.default_pg_timeout = timeout
        if isinstance(c10d.default_pg_nccl_timeout, datetime.timedelta):
            c10d.default_pg_nccl_timeout = timeout

    def end_startup(self) -> None:
        """timeout_s for every process group of this job (the world's, DDP's, DeepSpeed's, FSDP's mesh, the replica
        groups), the rendezvous store and the groups created later; not for a process group the user's script
        made itself (its timeout is the script's)."""
        if not hasattr(self, "_default_timeouts"):
            return
        timeout = datetime.timedelta(seconds=self.cfg.distributed.timeout_s)
        with warnings.catch_warnings():  # (a group of another backend: "only supported for nccl or gloo")
            warnings.simplefilter("ignore")
            for group in list(c10d._world.pg_map):
                if not c10d._rank_not_in_group(group):
                    c10d._set_pg_timeout(timeout, group)
        self._store.set_timeout(timeout)
        self._set_default_timeout(timeout)

    def before_last_meet(self) -> None:
        """Rank 0 closes the rendezvous store's server before the ranks' last meeting, which no rank leaves before
        rank 0 reached it: a script that starts another session at once (the same MASTER_PORT, from its launcher)
        would otherwise reach the old server in the moment before rank 0 closes it and lose its connection there
        (seen: 1 start in 5 of the conformance script's sessions in a row). Nothing uses the store after start-up
        (gloo's collectives and the meeting's barrier go over gloo's own connections)."""
        self._store_server = None  # (its only reference: the process groups and every rank hold clients)

    def teardown(self) -> None:
        if dist.is_initialized():
            # (the groups DDP's wrappers hold stay referenced from _KEPT_GROUPS: see there)
            dist.destroy_process_group()
        # The rendezvous store goes now, not whenever this strategy is freed: rank 0's store serves its port from a
        # thread of its own, whose destructor joins that thread. Freed later by the cyclic garbage collector, it may
        # be freed in a fork of this process (a DataLoader worker of the user's next loop), where the thread does
        # not exist: the join there is a SIGSEGV (a core of the worker: ~TCPStore -> ~LibUVStoreDaemon ->
        # std::thread::join <- gc's delete_garbage). And a closed Session listens nowhere: the process groups hold
        # only clients of the server (init).
        self._store = self._store_server = None
        if hasattr(self, "_default_timeouts"):
            c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = self._default_timeouts

    def backend_impl(self) -> str:
        return f"torch {torch.__version__} DDP ({getattr(self, 'pg_backend', 'gloo')})"

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              lr_scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        model.to(self.device)
        d = self.cfg.distributed
        if self.reduce_type == "grad" and self.world_size == 1:
            # One process: nothing to reduce, and DDP's wrapper would only add its checks (a model with
            # a parameter some step leaves unused fails under it without find_unused_parameters).
            self._grad_bytes = 0
            return model, optimizer
        if self.reduce_type == "grad":
            # DDP broadcasts rank 0's parameters and buffers in its constructor.
            ids = [self.device.index] if self.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=ids, **d.options)
            _KEPT_GROUPS.append(wrapped.process_group)
            self._watch_forwards(wrapped)
            self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            if self.world_size > 1:  # that broadcast counts as the other engines' start-up broadcast does
                self.comm_bytes += sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
            return wrapped, optimizer
        self.averager = param_averager(self, model)
        self.broadcast_tensors(self.averager.tensors + [b for b in model.buffers() if not b.is_floating_point()])
        if self.replicas is None:
            return model, optimizer
        # Replica groups: DDP on this rank's group (it reduces gradients inside the group and broadcasts the
        # group leader's buffers before each forward); the averager over the cross group. Every rank makes
        # every group, in the same order (torch's rule for new_group); rank 0's state went everywhere above.
        groups = [dist.new_group(ranks) for ranks in self.replicas.groups()]
        crosses = [dist.new_group(ranks) for ranks in self.replicas.crosses()]
        self._group, self._cross = groups[self.replicas.index], crosses[self.replicas.position]
        ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids, process_group=self._group, **d.options)
        _KEPT_GROUPS.append(wrapped.process_group)
        self._watch_forwards(wrapped)
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return wrapped, optimizer

    def _watch_forwards(self, wrapped: DistributedDataParallel) -> None:
        """Note each forward of the wrapper with gradients on: DDP reduces only the gradients of a backward whose
        forward went through it (its forward prepares the reducer), so :meth:`backward` can refuse one that did
        not, which DDP itself lets pass (every rank then steps on its own gradients, silently)."""
        self._forward_seen = False

        def seen(_module: nn.Module, _args: Any) -> None:
            if torch.is_grad_enabled():
                self._forward_seen = True

        wrapped.register_forward_pre_hook(seen)

    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        """``loss.backward()``; UsageError, before it, where ``model`` is DDP's wrapper and no forward went through
        it since the last backward (the forward called ``dk.unwrap(model)`` or a submodule: DDP would reduce none
        of the gradients). Every rank's script does the same, so every rank raises the same line."""
        if isinstance(model, DistributedDataParallel) and loss.requires_grad and not self._forward_seen:
            raise UsageError("dk.backward: this backward's forward did not go through the model dk.setup returned "
                             "(it called dk.unwrap(model) or a submodule of it), so DDP would reduce none of its "
                             "gradients and the ranks would part: call the model dk.setup returned in training "
                             "steps, and dk.unwrap(model) only for evaluation or saving")
        self._forward_seen = False
        loss.backward()

    def group_mean(self, flat: torch.Tensor) -> None:
        """One all-reduce over this rank's replica group, divided by its number of ranks."""
        self.comm_bytes += flat.numel() * flat.element_size()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
        flat.div_(self.replicas.size)  # type: ignore[union-attr]

    def cross_group_mean(self, flat: torch.Tensor) -> None:
        """One all-reduce over this rank's cross group, divided by the number of groups."""
        self.comm_bytes += flat.numel() * flat.element_size()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._cross)
        flat.div_(self.replicas.count)  # type: ignore[union-attr]

    def _averaging_group(self) -> Any:
        """The process group the parameters are averaged over (None: every rank)."""
        return self._cross if self.replicas is not None else None

    def _exchange_ranks(self) -> tuple[list[list[int]], int]:
        """Every averaging group's ranks (every rank makes all of them, in this order) and which one is this rank's."""
        if self.replicas is None:
            return [list(range(self.world_size))], 0
        return self.replicas.crosses(), self.replicas.position

    def _exchange_group(self) -> Any:
        """The averaging group's ranks as a process group of their own, for the compressed and overlapped
        exchange: its own connections. On the default group's connections an exchange in the background holds
        up the small collectives every step makes (the preemption check, the logged loss) behind its bytes:
        measured at 25 Mbit/s (charlm medium, int8, F = 4, tau = 5), 206 samples/s on a shared group against
        217 on a group of its own, unshaped 223. Made at the first exchange, which every rank reaches at the
        same step (making groups is collective)."""
        if getattr(self, "_xgroup", None) is None:
            ranks, mine = self._exchange_ranks()
            self._xgroup = [dist.new_group(r) for r in ranks][mine]
        return self._xgroup

    def start_all_to_all(self, rows: torch.Tensor) -> Any:
        out = torch.empty_like(rows)
        self.comm_bytes += rows.numel() * rows.element_size()
        work = dist.all_to_all_single(out, rows.contiguous(), group=self._exchange_group(), async_op=True)
        return _Pending(work, out)

    def start_all_gather(self, row: torch.Tensor) -> Any:
        out = torch.empty(self.averaging_size() * row.numel(), dtype=row.dtype, device=row.device)
        self.comm_bytes += row.numel() * row.element_size()
        work = dist.all_gather_single(out, row.contiguous(), group=self._exchange_group(), async_op=True)
        return _Pending(work, out.view(-1, row.numel()))

    def unwrap(self, model: nn.Module) -> nn.Module:
        return bare_module(model.module if isinstance(model, DistributedDataParallel) else model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(model, DistributedDataParallel):
            self.comm_bytes += self._grad_bytes  # DDP all-reduced every gradient bucket in backward
        super().step(model, optimizer)

    # -- collectives -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        if getattr(self, "pg_backend", "gloo") == "nccl" and tensor.device.type != "cuda":
            # NCCL reduces CUDA tensors only; counters and losses the loop keeps on the CPU go via the device.
            with torch.no_grad():
                tensor.copy_(self.all_reduce(tensor.to(self.device), op).cpu())
            return tensor
        self.comm_bytes += tensor.numel() * tensor.element_size()
        if op == "mean":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(self.world_size)
        else:
            dist.all_reduce(tensor, op=_OPS[op])
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "max") -> Any:
        if self.world_size == 1 or getattr(self, "pg_backend", "gloo") == "nccl":
            return super().start_all_reduce(tensor, op)  # (NCCL: a CPU tensor goes via the device, blocking)
        self.comm_bytes += tensor.numel() * tensor.element_size()
        return _Pending(dist.all_reduce(tensor, op=_OPS[op], async_op=True), tensor)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        if self.world_size == 1:
            return
        for t in tensors:
            self.comm_bytes += t.numel() * t.element_size()
            dist.broadcast(t.data, src=src)
