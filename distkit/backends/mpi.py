"""MPI through mpi4py: distkit's own bucketed, overlapped gradient reducer. No torch.distributed.

Launch: ``mpirun -np N python -m distkit train cfg.py`` with ``distributed = {"backend": "mpi"}``.

grad mode: :class:`~distkit.backends.mpi_reducer.GradReducer` makes every ``param.grad`` a view into a flat bucket of
about ``distributed.bucket_cap_mb`` MiB (parameters in reverse registration order, as DDP:
that is roughly the order backward produces them). A ``post_accumulate_grad`` hook counts
the gradients of each bucket; a full bucket starts a non-blocking ``Iallreduce(IN_PLACE)``
on the bucket's own memory (no copies between torch and MPI) while backward goes on.
Buckets are started strictly in index order, so every rank issues the same collectives in
the same order (MPI requires it). ``step()`` waits, divides by the world size
(``avg_grad``; sums when False) and steps. param mode: a plain model and
:class:`~distkit.sync.averager.ParamAverager`, averaging with one flat ``Allreduce``. param mode
with replica groups (:mod:`distkit.sync.replicas`): the reducer on the group's communicator (a
``Split`` of distkit's), the averager's ``Allreduce`` on the cross group's.

Failures: an exception on one rank calls ``MPI_Abort`` (mpi4py's default would leave the
other ranks blocked in a collective forever); a rank stuck in one collective longer than
``distributed.timeout_s`` is aborted by a watchdog thread. A killed rank is noticed by
``mpirun``, which ends the job naming the rank.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any, Iterator, Optional

import torch
from torch import nn

from distkit.health import faults
from distkit.errors import BackendUnavailable, UnsupportedCombination
from distkit.launch.netif import openmpi_interface_hint

from .base import Strategy
from .parts import param_averager, persistent_buffers, report_failure
from .buffers import DDPBufferRule
from . import startup
from .startup import startup_guard
from .wait_guard import WaitGuard
from .mpi_reducer import GradReducer, _np, wait_all
from .mpi_setup import INSTALL_HINT, import_mpi, mpi_impl

#: all-reduces of at least this many bytes use ``Iallreduce`` + wait (libnbc's ring), smaller ones
#: ``Allreduce`` (latency-bound: Open MPI's tuned choice is right for them)
NONBLOCKING_MIN_BYTES = 1 << 16


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor`` for MPI to reduce: floats as fp64 (numpy and MPI have no bf16, and fp64
    holds every float dtype's values exactly), other dtypes as they are."""
    return tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else tensor.dtype).contiguous()


class _Request:
    """A nonblocking MPI collective (the compressed exchange's, :meth:`MPIStrategy.start_all_reduce`'s):
    ``wait()`` returns its output (watched: a rank that never answers ends the job after ``timeout_s``, named
    by ``what``). ``buffers`` (send, receive) stay referenced until then: MPI reads and writes them in the
    background."""

    def __init__(self, strategy: "MPIStrategy", request: Any, buffers: tuple[torch.Tensor, torch.Tensor],
                 device: torch.device, what: str) -> None:
        self.strategy, self.request, self.buffers, self.device, self.what = strategy, request, buffers, device, what

    def wait(self) -> torch.Tensor:
        with self.strategy.watch(self.what):
            wait_all(self.strategy.MPI, [self.request])  # (Open MPI's Wait spins on a core while a peer is late)
        return self.buffers[1].to(self.device)


class MPIStrategy(Strategy):
    """Data parallelism over MPI with mpi4py (``mpirun -np N``)."""

    name = "mpi"
    local_launcher = "mpirun"

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        super().check_config(cfg)
        # find_spec, not import: importing mpi4py initialises MPI, which a process that is about to
        # start the ranks under mpirun (--nprocs) must not do.
        if importlib.util.find_spec("mpi4py") is None:
            raise BackendUnavailable(f"the mpi engine needs mpi4py: {INSTALL_HINT}")
        if cfg.distributed.compression != "none":
            raise UnsupportedCombination(
                f"compression '{cfg.distributed.compression}' is not implemented by the mpi engine: "
                "remove it, or install real Horovod (scripts/build_horovod.sh, `make horovod`) and use use_horovod = True")

    # -- lifecycle -------------------------------------------------------------------
    def init(self) -> None:
        # MPI_Init (the first import of mpi4py) and the first communication wait for every rank with no
        # timeout of their own, before distkit's heartbeat watchdog can start: bounded by distributed.startup_s().
        with startup_guard(self.rank, self.cfg.distributed.startup_s(), "MPI start-up (MPI_Init, MPI_Comm_dup)",
                           openmpi_interface_hint(self.env)):
            faults.maybe_fire(self.rank, 0, "init")
            self._init_mpi()

    def _init_mpi(self) -> None:
        self.MPI = import_mpi()
        size, rank = self.MPI.COMM_WORLD.Get_size(), self.MPI.COMM_WORLD.Get_rank()
        if (size, rank) != (self.world_size, self.rank):
            launcher = self.env.launcher
            raise UnsupportedCombination(
                f"backend '{self.name}' found MPI rank {rank} of {size} but the {launcher} launcher says rank "
                f"{self.rank} of {self.world_size}: MPI engines need an MPI launcher: "
                f"mpirun -np {self.world_size} python -m distkit train CONFIG (not --nprocs)")
        self.comm: Any = None
        self.group_comm: Any = None  # replica groups only: this rank's group, and its cross group
        self.cross_comm: Any = None
        self.reducer: Optional[GradReducer] = None
        self._buffers: list[torch.Tensor] = []
        self._buffer_hook: Any = None
        # MPI has no timeout: distributed.timeout_s (start-up's bound before the first step) for MPI's waits
        d = self.cfg.distributed
        self._guard = WaitGuard(self.rank, lambda: startup.bound(d)[0], lambda: startup.bound_text(d),
                                f"another rank hangs or died{openmpi_interface_hint(self.env)}",
                                end=lambda: self.MPI.COMM_WORLD.Abort(1),
                                ending=f"aborting all {self.world_size} MPI ranks")
        # Our own communicator: user code on COMM_WORLD never interleaves with ours. The first call
        # that needs the ranks' TCP connections: where they cannot be made (an interface the other
        # hosts cannot reach), it would wait forever; init's start-up guard bounds it.
        self.comm = self.MPI.COMM_WORLD.Dup()

    def teardown(self) -> None:
        if getattr(self, "_guard", None) is None:
            return
        self._guard.close()
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if self._buffer_hook is not None:
            self._buffer_hook.remove()
            self._buffer_hook = None
        for extra in ("group_comm", "cross_comm"):
            if getattr(self, extra, None) is not None:
                getattr(self, extra).Free()
                setattr(self, extra, None)
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def abort(self) -> None:
        """Print which rank failed and why, then MPI_Abort: every rank of the job ends now."""
        if getattr(self, "comm", None) is None or self.world_size == 1:
            return  # single process: the exception propagates as usual
        code = report_failure(self.rank, self.world_size, "MPI")
        self.MPI.COMM_WORLD.Abort(code)

    def end_job(self, code: int) -> None:
        """``MPI_Abort``: every rank of the job ends now (from any thread; never returns)."""
        sys.stdout.flush()
        self.MPI.COMM_WORLD.Abort(code)

    def backend_impl(self) -> str:
        return mpi_impl()

    # -- watchdog: distributed.timeout_s for MPI collectives ----------------------------------
    def watch(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Blocking MPI calls inside this block end the job after the bound in force (MPI has no timeout): the
        heartbeat watchdog names a stalled peer, else one line and MPI_Abort (:mod:`distkit.backends.wait_guard`)."""
        # what the caller was doing, when it said (Job._collective): "Allreduce(max) in the preemption check"
        return self._guard.waiting(f"{what} in {self.doing}" if self.doing else what)

    # -- setup -------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              lr_scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        model.to(self.device)
        d = self.cfg.distributed
        # rank 0's initial parameters and buffers everywhere (as DDP's constructor does).
        self.broadcast_tensors([*model.parameters(), *model.buffers()])
        if self.replicas is not None:
            # Replica groups: gradients reduced inside this rank's group (its own communicator), the averager
            # over the cross group. Split is collective over self.comm, the same order on every rank.
            self.group_comm = self.comm.Split(self.replicas.index, self.rank)
            self.cross_comm = self.comm.Split(self.replicas.position, self.rank)
        if self.reduce_type == "grad" or self.replicas is not None:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
            odd = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
            if odd:
                raise UnsupportedCombination(f"the mpi engine all-reduces fp32/fp64 gradients; the model has {', '.join(odd)} "
                                             "parameters: keep fp32 master parameters (autocast) or use ddp")
            comm, size = (self.comm, self.world_size) if self.replicas is None else (self.group_comm, self.replicas.size)
            self.reducer = GradReducer(self, params, d.bucket_cap_mb, bool(d.avg_grad), names=[n for n, _ in named],
                                       find_unused=bool(d.options.get("find_unused_parameters", False)),
                                       comm=comm, size=size)
            # DDP's rule for buffers (BatchNorm statistics; distkit.backends.buffers): the leader's (rank 0, or the
            # replica group's first rank). Only buffers that are model state: a constant (non-persistent) buffer
            # such as a causal mask would cost one Bcast per step for nothing (it was broadcast once above).
            self._buffers = persistent_buffers(model)
            if self._buffers and size > 1:
                self._buffer_hook = DDPBufferRule(model, self._sync_buffers, lambda: self.outside_no_sync)
            if self.replicas is None:
                return model, optimizer
        self.averager = param_averager(self, model)
        return model, optimizer

    def _sync_buffers(self) -> None:
        if self.replicas is None:
            self.broadcast_tensors(self._buffers)
        else:  # inside the replica group, from its first rank (DDP's rule on a process group)
            self._bcast(self.group_comm, self._buffers, 0)

    # -- per step ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        """``loss.backward()``; in grad mode, outside :meth:`no_sync`, the gradients are reduced when it
        returns (as DDP's are), so code between backward and step (a plain ``clip_grad_norm_``, logging
        of gradient norms) sees what every rank holds. A further backward before the step adds its
        reduced gradient (DDP's result for accumulation without ``no_sync``)."""
        r = self.reducer
        if r is None:
            loss.backward()
            return
        if r.started:
            r.new_round()
        r.attach()  # cheap identity checks; repairs grads a user may have replaced
        loss.backward()
        if r.enabled:
            r.finish()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        assert self.reducer is not None
        self.reducer.enabled = False
        try:
            yield
        finally:
            self.reducer.enabled = True

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Accumulation micro-steps: gradients add up in the buckets, nothing is sent."""
        return self._no_sync() if self.reducer is not None else contextlib.nullcontext()

    def wait_for_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.reducer is not None:
            self.reducer.finish()

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        self.wait_for_gradients(model, optimizer)  # clip the reduced gradient, as every rank holds it
        return super().clip_grad_norm(model, optimizer, max_norm)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.reducer is None:
            super().step(model, optimizer)
            return
        self.reducer.finish()
        optimizer.step()
        self.reducer.zero()  # zero_grad: the grads are bucket views and stay so
        if self.averager is not None:  # replica groups: the groups average when due
            self.averager.after_step()

    # -- collectives -------------------------------------------------------------------
    def _op(self, op: str) -> Any:
        return {"sum": self.MPI.SUM, "mean": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective: every rank must call it, in the same order. In place; op is sum|mean|max|min."""
        if self.world_size == 1:
            return tensor
        return self._allreduce(self.comm, self.world_size, tensor, op)

    def _allreduce(self, comm: Any, size: int, tensor: torch.Tensor, op: str, what: str = "") -> torch.Tensor:
        """All-reduce ``tensor`` in place over ``comm`` (``size`` ranks; ``mean`` divides by it)."""
        direct = tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype not in (torch.bfloat16, torch.float16)
        buf = tensor if direct else _host_buffer(tensor)
        self.comm_bytes += tensor.numel() * tensor.element_size()
        with self.watch(f"Allreduce({op}){what}"):
            if buf.numel() * buf.element_size() >= NONBLOCKING_MIN_BYTES:  # libnbc's ring (mpi_setup.MCA_DEFAULTS)
                wait_all(self.MPI, [comm.Iallreduce(self.MPI.IN_PLACE, _np(buf), op=self._op(op))])
            else:
                comm.Allreduce(self.MPI.IN_PLACE, _np(buf), op=self._op(op))
        if op == "mean":
            buf.div_(size)
        if not direct:
            with torch.no_grad():
                tensor.copy_(buf)
        return tensor

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "max") -> Any:
        if self.world_size == 1:
            return super().start_all_reduce(tensor, op)
        buf = _host_buffer(tensor)
        self.comm_bytes += tensor.numel() * tensor.element_size()
        request = self.comm.Iallreduce(self.MPI.IN_PLACE, _np(buf), op=self._op(op))
        return _Request(self, request, (buf, buf), tensor.device, f"Iallreduce({op})")

    def cross_group_mean(self, flat: torch.Tensor) -> None:
        """One ``Allreduce`` over this rank's cross group (the ranks at its position in every replica group)."""
        assert self.replicas is not None
        self._allreduce(self.cross_comm, self.replicas.count, flat, "mean", " over the replica groups")

    def group_mean(self, flat: torch.Tensor) -> None:
        """One ``Allreduce`` over this rank's replica group, divided by its number of ranks."""
        assert self.replicas is not None
        self._allreduce(self.group_comm, self.replicas.size, flat, "mean", " in the replica group")

    def start_all_to_all(self, rows: torch.Tensor) -> Any:
        comm = self.cross_comm if self.replicas is not None else self.comm
        buf = rows.detach().cpu().contiguous()
        out = torch.empty_like(buf)
        self.comm_bytes += buf.numel()
        return _Request(self, comm.Ialltoall(_np(buf), _np(out)), (buf, out), rows.device,
                        "Ialltoall of the compressed exchange")

    def start_all_gather(self, row: torch.Tensor) -> Any:
        comm = self.cross_comm if self.replicas is not None else self.comm
        buf = row.detach().cpu().contiguous()
        out = torch.empty((self.averaging_size(), buf.numel()), dtype=buf.dtype)
        self.comm_bytes += buf.numel()
        return _Request(self, comm.Iallgather(_np(buf), _np(out)), (buf, out), row.device,
                        "Iallgather of the compressed exchange")

    def group_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective over this rank's replica group (or every rank without replica groups)."""
        if self.replicas is None:
            return self.all_reduce(tensor, op)
        return self._allreduce(self.group_comm, self.replicas.size, tensor, op, " in the replica group")

    def average_parameters(self, params: list[torch.Tensor], is_param: Optional[list[bool]] = None) -> bool:
        """Collective: every rank must call it, in the same order. One flat ``Allreduce`` of all ``params``."""
        return super().average_parameters(params, is_param)  # cat -> all_reduce(mean) (one Allreduce) -> copy back

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: every rank must call it, in the same order. Returns ``src``'s object."""
        if self.world_size == 1:
            return obj
        with self.watch("bcast"):
            self._meet()
            return self.comm.bcast(obj, root=src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Collective: every rank must call it, in the same order. Returns one object per rank."""
        if self.world_size == 1:
            return [obj]
        with self.watch("allgather"):
            self._meet()
            return list(self.comm.allgather(obj))

    def barrier(self) -> None:
        """Collective: every rank must call it, in the same order."""
        if self.world_size > 1:
            with self.watch("Barrier"):
                self._meet()

    def _meet(self) -> None:
        """Wait, sleeping, until every rank has come here (``Ibarrier`` tested with :func:`wait_all`'s backoff).

        Before the object collectives and as the barrier: these are where one rank waits for another's slow work
        (rank 0 writing a checkpoint, evaluating, a framework's first-fit set-up), and Open MPI's blocking calls
        spin on a core while they wait, taking it from the ranks that compute when the cores are shared: rank 0
        waiting 3 s for rank 1 used 3.00 s of CPU in ``Barrier`` and 0.18 s here (``benchmarks/wait_cpu.py``). The
        per-step all-reduces stay blocking (the ranks arrive together; their latency counts)."""
        wait_all(self.MPI, [self.comm.Ibarrier()])

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Collective: every rank must call it, in the same order. ``Bcast`` of each tensor's memory."""
        if self.world_size == 1:
            return
        self._bcast(self.comm, tensors, src)

    def _bcast(self, comm: Any, tensors: list[torch.Tensor], root: int) -> None:
        """``Bcast`` of each tensor's memory over ``comm`` from its rank ``root``."""
        with self.watch("Bcast"), torch.no_grad():
            for t in tensors:
                direct = t.device.type == "cpu" and t.is_contiguous() and t.dtype not in (torch.bfloat16, torch.float16)
                buf = t.detach() if direct else t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype).contiguous()
                self.comm_bytes += t.numel() * t.element_size()
                comm.Bcast(_np(buf), root=root)
                if not direct:
                    t.copy_(buf)
