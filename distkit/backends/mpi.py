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
:class:`~distkit.averaging.ParamAverager`, averaging with one flat ``Allreduce``.

Failures: an exception on one rank calls ``MPI_Abort`` (mpi4py's default would leave the
other ranks blocked in a collective forever); a rank stuck in one collective longer than
``distributed.timeout_s`` is aborted by a watchdog thread. A killed rank is noticed by
``mpirun``, which ends the job naming the rank.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import time
from typing import Any, Iterator, Optional

import torch
from torch import nn

from distkit import faults
from distkit.errors import BackendUnavailable, UnsupportedCombination
from distkit.netif import openmpi_interface_hint
from distkit.watchdog import explain_stall

from .base import Strategy, param_averager, persistent_buffers, report_failure, startup_guard
from .mpi_reducer import GradReducer, _np, wait_all

INSTALL_HINT = "pip install 'distkit[mpi]' (mpi4py + the Open MPI wheel), then launch with mpirun -np N"


#: Open MPI's all-reduce for large messages, chosen before MPI starts (unless the user chose, by
#: ``mpirun --mca`` or the environment). Its non-blocking all-reduce (libnbc, the gradient buckets)
#: picks by default, for 2 ranks, an algorithm that sends the data one way and then back: 1.1 s
#: for 7.3 MB on a 100 Mbit/s link where gloo's ring takes 0.65 s; libnbc's ring takes 0.65 s too,
#: and on one host (shared memory) 16 ms either way (measured: benchmarks/slow_link.py, and
#: mpi4py ``Iallreduce`` between two network namespaces). The ring is bandwidth-optimal for
#: any number of ranks. Large blocking all-reduces go through the same path (:data:`NONBLOCKING_MIN_BYTES`).
MCA_DEFAULTS = {"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "1"}  # 1 = ring
#: all-reduces of at least this many bytes use ``Iallreduce`` + wait (libnbc's ring), smaller ones
#: ``Allreduce`` (latency-bound: Open MPI's tuned choice is right for them)
NONBLOCKING_MIN_BYTES = 1 << 16


def import_mpi() -> Any:
    """mpi4py's MPI module (initialises MPI on first import, with :data:`MCA_DEFAULTS` unless set), or
    BackendUnavailable with the fix."""
    for key, value in MCA_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise BackendUnavailable(f"the mpi engine needs mpi4py ({e}): {INSTALL_HINT}") from None
    return MPI


def mpi_impl() -> str:
    """e.g. "mpi4py 4.1.2 (Open MPI v5.0.11)"."""
    import mpi4py

    MPI = import_mpi()
    lib = MPI.Get_library_version().strip().split(",")[0].splitlines()[0]
    return f"mpi4py {mpi4py.__version__} ({lib})"


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
        # timeout of their own, before distkit's heartbeat watchdog can start: bounded by timeout_s.
        with startup_guard(self.rank, float(self.cfg.distributed.timeout_s), "MPI start-up (MPI_Init, MPI_Comm_dup)",
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
        self.reducer: Optional[GradReducer] = None
        self._buffers: list[torch.Tensor] = []
        self._buffer_hook: Any = None
        self._watch_what: Optional[str] = None
        self._watch_since = 0.0
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch_loop, name="distkit-mpi-watchdog", daemon=True)
        if size > 1:
            self._watchdog.start()
        # Our own communicator: user code on COMM_WORLD never interleaves with ours. The first call
        # that needs the ranks' TCP connections: where they cannot be made (an interface the other
        # hosts cannot reach), it would wait forever; init's start-up guard bounds it.
        self.comm = self.MPI.COMM_WORLD.Dup()

    def teardown(self) -> None:
        if getattr(self, "_stop", None) is None:
            return
        self._stop.set()
        if self._watchdog.is_alive():
            self._watchdog.join(timeout=5)
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None
        if self._buffer_hook is not None:
            self._buffer_hook.remove()
            self._buffer_hook = None
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
    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        """Blocking MPI calls inside this block are aborted after ``timeout_s`` (MPI has no timeout)."""
        # what the caller was doing, when it said (Job._collective): "Allreduce(max) in the preemption check"
        self._watch_what = f"{what} in {self.doing}" if self.doing else what
        self._watch_since = time.monotonic()
        try:
            yield
        finally:
            self._watch_what = None

    def _watch_loop(self) -> None:
        timeout = float(self.cfg.distributed.timeout_s)
        while not self._stop.wait(min(1.0, timeout / 4)):
            what = self._watch_what
            if what is not None and time.monotonic() - self._watch_since > timeout:
                explain_stall()  # a stalled rank: the heartbeat watchdog names it and ends the job (no return)
                print(f"distkit: rank {self.rank}: {what} did not complete within distributed.timeout_s = "
                      f"{timeout:g} s (another rank hangs or died{openmpi_interface_hint(self.env)}): aborting all "
                      f"{self.world_size} MPI ranks", file=sys.stderr, flush=True)
                self.MPI.COMM_WORLD.Abort(1)

    # -- setup -------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              lr_scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        model.to(self.device)
        d = self.cfg.distributed
        # rank 0's initial parameters and buffers everywhere (as DDP's constructor does).
        self.broadcast_tensors([*model.parameters(), *model.buffers()])
        if self.reduce_type == "grad":
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
            odd = sorted({str(p.dtype) for p in params if p.dtype in (torch.float16, torch.bfloat16)})
            if odd:
                raise UnsupportedCombination(f"the mpi engine all-reduces fp32/fp64 gradients; the model has {', '.join(odd)} "
                                             "parameters: keep fp32 master parameters (autocast) or use ddp")
            self.reducer = GradReducer(self, params, d.bucket_cap_mb, bool(d.avg_grad), names=[n for n, _ in named],
                                       find_unused=bool(d.options.get("find_unused_parameters", False)))
            # DDP semantics for buffers (BatchNorm statistics): rank 0's, before every training forward.
            # Only buffers that are model state: a constant (non-persistent) buffer such as a causal mask
            # would cost one Bcast per step for nothing (it was broadcast once above).
            self._buffers = persistent_buffers(model)
            if self._buffers and self.world_size > 1:
                self._buffer_hook = model.register_forward_pre_hook(self._sync_buffers)
            return model, optimizer
        self.averager = param_averager(self, model)
        return model, optimizer

    def _sync_buffers(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self.broadcast_tensors(self._buffers)

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

    # -- collectives -------------------------------------------------------------------
    def _op(self, op: str) -> Any:
        return {"sum": self.MPI.SUM, "mean": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective: every rank must call it, in the same order. In place; op is sum|mean|max|min."""
        if self.world_size == 1:
            return tensor
        direct = tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.dtype not in (torch.bfloat16, torch.float16)
        buf = tensor if direct else tensor.detach().to("cpu", torch.float64 if tensor.is_floating_point() else tensor.dtype).contiguous()
        self.comm_bytes += tensor.numel() * tensor.element_size()
        with self.watch(f"Allreduce({op})"):
            if buf.numel() * buf.element_size() >= NONBLOCKING_MIN_BYTES:  # libnbc's ring (MCA_DEFAULTS)
                wait_all(self.MPI, [self.comm.Iallreduce(self.MPI.IN_PLACE, _np(buf), op=self._op(op))])
            else:
                self.comm.Allreduce(self.MPI.IN_PLACE, _np(buf), op=self._op(op))
        if op == "mean":
            buf.div_(self.world_size)
        if not direct:
            with torch.no_grad():
                tensor.copy_(buf)
        return tensor

    def average_parameters(self, params: list[torch.Tensor]) -> None:
        """Collective: every rank must call it, in the same order. One flat ``Allreduce`` of all ``params``."""
        super().average_parameters(params)  # cat -> all_reduce(mean) (one Allreduce) -> copy back

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: every rank must call it, in the same order. Returns ``src``'s object."""
        if self.world_size == 1:
            return obj
        with self.watch("bcast"):
            return self.comm.bcast(obj, root=src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Collective: every rank must call it, in the same order. Returns one object per rank."""
        if self.world_size == 1:
            return [obj]
        with self.watch("allgather"):
            return list(self.comm.allgather(obj))

    def barrier(self) -> None:
        """Collective: every rank must call it, in the same order."""
        if self.world_size > 1:
            with self.watch("Barrier"):
                self.comm.Barrier()

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Collective: every rank must call it, in the same order. ``Bcast`` of each tensor's memory."""
        if self.world_size == 1:
            return
        with self.watch("Bcast"), torch.no_grad():
            for t in tensors:
                direct = t.device.type == "cpu" and t.is_contiguous() and t.dtype not in (torch.bfloat16, torch.float16)
                buf = t.detach() if direct else t.detach().to("cpu", torch.float32 if t.is_floating_point() else t.dtype).contiguous()
                self.comm_bytes += t.numel() * t.element_size()
                self.comm.Bcast(_np(buf), root=src)
                if not direct:
                    t.copy_(buf)
