"""Horovod (``horovod.torch``), RETURNN's ``use_horovod = True``; launched by ``mpirun`` or ``horovodrun``.

grad mode: ``hvd.DistributedOptimizer`` (its gradient hooks start an all-reduce as soon as
each gradient is ready; ``backward_passes_per_step`` = ``accum_grad_multiple_step``;
``hvd.Average``, or ``hvd.Sum`` with ``horovod_avg_grad = False``; fp16 compression with
``horovod_compression = "fp16"``). param mode: the plain optimizer and
:class:`~distkit.sync.averager.ParamAverager`, averaging with one flat ``hvd.allreduce``.
param mode with replica groups (:mod:`distkit.sync.replicas`): static Horovod process sets, one per
replica group and one per cross group; ``hvd.DistributedOptimizer`` on the rank's group set,
the averager's ``hvd.allreduce`` on its cross group set.
Both modes start from rank 0's parameters and buffers (``hvd.broadcast_parameters``).

Which engine runs is decided once, when the registry imports this module: the registry
entry ``HorovodStrategy`` is :class:`HorovodEngine` when ``horovod.torch`` imports, else
:class:`HorovodFallback`, distkit's mpi engine (same modes and keys, same math), which
says so in one line at start and in ``summary.json``'s ``backend_impl``. With
``horovod_require = True`` the fallback refuses to start (exit 2, with the install command).
Nothing outside this module knows about the fallback.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch
from torch import nn

from distkit.health import faults
from distkit.errors import BackendUnavailable, UnsupportedCombination, UsageError
from distkit.launch.netif import openmpi_interface_hint
from distkit.health.watchdog import end_local_peers

from .buffers import DDPBufferRule
from .base import Strategy
from .horovod_collectives import HorovodCollectives, _Handle
from .parts import drop_globally_unused, param_averager, persistent_buffers, report_failure, unused_parameters
from . import startup
from .startup import startup_guard
from .wait_guard import WaitGuard
from .mpi import MPIStrategy
from .mpi_setup import mpi_impl

INSTALL_HINT = "build and install it with `make horovod` (runs scripts/build_horovod.sh .venv, ~3 min once, then cached)"


def _import_horovod() -> tuple[Any, Optional[str]]:
    """``(horovod.torch, None)``, or ``(None, why)`` when it cannot be imported (absent or a broken build)."""
    try:
        import horovod.torch as hvd
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError/undefined symbol from a build for another torch
        return None, f"{type(e).__name__}: {e}"
    return hvd, None


class HorovodEngine(HorovodCollectives, Strategy):
    """The real Horovod. Every rank runs under ``mpirun -np N`` or ``horovodrun -np N``."""

    name = "horovod"
    local_launcher = "mpirun"

    def init(self) -> None:
        hvd, why = _import_horovod()
        if hvd is None:  # only if horovod broke between config check and start
            raise BackendUnavailable(f"horovod is not importable ({why}): {INSTALL_HINT}")
        self.hvd = hvd
        # Horovod's own hang guard: a collective some rank never joins shuts Horovod down after
        # this long (the waiting ranks then raise, and abort() ends the job). Horovod ignores the
        # shutdown time unless the stall check (default 60 s) runs at least as often.
        # Gloo's timeout under horovodrun --gloo (Horovod's default: 30 s) bounds its rendezvous in hvd.init
        # too, where the others may still be importing torch: distributed.startup_s(), at least timeout_s.
        # The user's own settings in the environment win. A rank that is stopped (SIGSTOP) or cut off
        # stalls the others' background threads too, so no stall check runs: distkit.health.watchdog names it.
        timeout = max(int(self.cfg.distributed.timeout_s), 1)
        startup_s = self.cfg.distributed.startup_s()
        if "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in os.environ:
            os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(timeout)
            os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(min(60, timeout)))
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(max(timeout, int(startup_s + 0.5))))
        # On CPU Horovod's background thread waits for the reductions inside Open MPI, polling the training's own
        # core unless told to yield (read by MPI_Init in hvd.init): 30 % shorter steps here (benchmarks/README.md,
        # "Horovod: the 3 % found and removed"). Scheduling only. The user's own setting wins.
        if self.device.type == "cpu":
            os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        # hvd.init() waits for its background thread's first collectives, which never complete where
        # Open MPI's TCP transport dials an interface the other hosts cannot reach, or a rank is stopped
        # or missing; no stall check runs that early. After distributed.startup_s() this rank says so and
        # exits non-zero: mpirun then ends the job. A slow start is not a stall: the bound is start-up's own.
        process_sets = self._make_process_sets(hvd)
        with startup_guard(self.rank, startup_s, "horovod's init", openmpi_interface_hint(self.env)):
            faults.maybe_fire(self.rank, 0, "init")
            hvd.init(process_sets=process_sets or None)
        self._initialized = True
        # Horovod's Gloo controller (horovodrun --gloo) runs no stall check: distkit bounds the waits (wait_guard)
        self._guard = WaitGuard(self.rank, lambda: startup.bound(self.cfg.distributed)[0],
                                lambda: startup.bound_text(self.cfg.distributed),
                                "a rank hangs or is slow: Horovod's stall check does not run under its Gloo "
                                "controller", end_local_peers) if hvd.gloo_enabled() and self.world_size > 1 else None
        if (hvd.size(), hvd.rank()) != (self.world_size, self.rank):
            raise UnsupportedCombination(
                f"horovod found rank {hvd.rank()} of {hvd.size()} but the {self.env.launcher} launcher says rank "
                f"{self.rank} of {self.world_size}: launch Horovod with mpirun -np {self.world_size} or "
                f"horovodrun -np {self.world_size} (not --nprocs)")
        self._grad_bytes = 0
        self._synchronized = False
        self._buffers: list[torch.Tensor] = []
        self._buffer_hook: Any = None
        self._micro = 0  # backward passes since the last reduction (Horovod's backward_passes_per_step)
        self._trainable: list[tuple[str, nn.Parameter]] = []
        self._seen: set[int] = set()  # parameters whose gradient arrived since the last reduction
        self._grad_hooks: list[Any] = []
        #: parameters that held a reduced gradient from an earlier reduction of this step (several backward
        #: passes outside no_sync): find_unused_parameters never drops those
        self._had_grad: dict[int, bool] = {}
        self._optimizer: Any = None

    def _make_process_sets(self, hvd: Any) -> list[Any]:
        """Set ``self._group_set`` (where gradients are reduced and buffers broadcast: this rank's replica group,
        else every rank) and ``self._cross_set`` (where the averager averages: this rank's cross group, else
        every rank); return the process sets ``hvd.init`` must create. Static sets, not ``add_process_set``:
        those need ``HOROVOD_DYNAMIC_PROCESS_SETS`` and a collective each. Every rank passes every group's set
        and every cross group's, in the same order (Horovod's rule: the same list on every rank)."""
        self._group_set: Any = hvd.global_process_set
        self._cross_set: Any = hvd.global_process_set
        self._named = 0  # the background ops started so far (exchanges, start_all_reduce): their names
        if self.replicas is None:
            return []
        world = list(range(self.world_size))

        def process_set(ranks: list[int]) -> Any:
            # One group of all ranks (param_sync_group_size = world size) is the global set: Horovod refuses
            # a set that repeats another, the global one included ("process_sets entry ... is a duplicate").
            return hvd.global_process_set if ranks == world else hvd.ProcessSet(ranks)

        groups = [process_set(ranks) for ranks in self.replicas.groups()]
        crosses = [process_set(ranks) for ranks in self.replicas.crosses()]
        self._group_set, self._cross_set = groups[self.replicas.index], crosses[self.replicas.position]
        return [ps for ps in groups + crosses if ps is not hvd.global_process_set]

    @property
    def _reduces_gradients(self) -> bool:
        """Whether ``hvd.DistributedOptimizer`` reduces gradients: grad mode (over every rank), and param mode
        with replica groups (inside the group; the averager then averages across groups as well)."""
        return self.reduce_type == "grad" or self.replicas is not None

    def teardown(self) -> None:
        if getattr(self, "_initialized", False):
            for h in self._grad_hooks:
                h.remove()
            self._grad_hooks = []
            if self._buffer_hook is not None:
                self._buffer_hook.remove()
            if self._guard is not None:
                self._guard.close()
            self.hvd.shutdown()
            self._initialized = False

    def abort(self) -> None:
        """Print which rank failed and why, then end this process so the launcher ends the others."""
        if not getattr(self, "_initialized", False) or self.world_size == 1:
            return
        self.end_job(report_failure(self.rank, self.world_size, "Horovod"))

    def end_job(self, code: int) -> None:
        """``MPI_Abort`` under MPI; else ``os._exit``: the launcher then stops the job (never returns)."""
        sys.stdout.flush()
        if self.hvd.mpi_enabled():
            with contextlib.suppress(ImportError):
                from mpi4py import MPI  # MPI is initialised (by Horovod): this only binds it

                MPI.COMM_WORLD.Abort(code)
        # Gloo (horovodrun --gloo) or no mpi4py: exiting non-zero makes the launcher stop the job.
        # os._exit, not raise: Horovod's atexit shutdown would wait for the ranks we just left.
        os._exit(code)

    def backend_impl(self) -> str:
        import horovod

        ctrl = "MPI" if self.hvd.mpi_enabled() else "Gloo"
        comp = ", fp16 compression" if self.cfg.distributed.compression == "fp16" else ""
        return f"horovod {horovod.__version__} ({ctrl}{comp})"

    # -- setup -------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              lr_scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        hvd, d = self.hvd, self.cfg.distributed
        model.to(self.device)
        self.broadcast_tensors([*model.parameters(), *model.buffers()])
        # DDP's rule for buffers (BatchNorm statistics; distkit.backends.buffers): rank 0's, where DDP would.
        # Only buffers that are model state: a constant (non-persistent) buffer such as a causal mask would
        # cost one Horovod broadcast (a negotiation round with the background thread) per step for nothing.
        self._buffers = persistent_buffers(model)
        if self.reduce_type == "param":
            self.averager = param_averager(self, model)
        if not self._reduces_gradients:
            return model, optimizer
        # With replica groups, as DDP on a process group: the group leader's buffers, inside the group.
        if self._buffers and self.world_size > 1:
            self._buffer_hook = DDPBufferRule(model, self._sync_buffers, lambda: self.outside_no_sync)
        had_state = any(len(s) for s in optimizer.state.values())
        # hvd.Average divides by the size of the process set (the group's, with replica groups).
        opt = hvd.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if d.compression == "fp16" else hvd.Compression.none,
            backward_passes_per_step=self.cfg.accum_grad_multiple_step,
            op=hvd.Average if d.avg_grad else hvd.Sum, process_set=self._group_set)
        # torch's zero_grad(set_to_none=True), the standard idiom, on Horovod's class (whose zero_grad
        # takes no argument): Horovod's check that no reduction is in flight, then torch's own.
        opt.zero_grad = types.MethodType(_zero_grad, opt)  # type: ignore[method-assign]
        self._optimizer = opt
        self._trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._gradient_arrived) for _, p in self._trainable]
        if had_state:
            # Only with existing state: on a fresh optimizer Horovod first takes one step with zero
            # gradients to create the state, which moves Adam's step count and applies weight decay
            # (a different result from DDP). A fresh optimizer has equal (empty) state everywhere.
            # Over every rank, as the parameters above: with replica groups every group starts as rank 0.
            opt.load_state_dict(optimizer.state_dict())
            self._gate("broadcast_optimizer_state")
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        per_elem = 2 if d.compression == "fp16" else None
        self._grad_bytes = sum(p.numel() * (per_elem or p.element_size()) for p in model.parameters() if p.requires_grad)
        return model, opt

    def _sync_buffers(self) -> None:
        # root_rank is a global rank also inside a process set (Horovod checks that it is in the set)
        leader = self.replicas.leader if self.replicas is not None else 0
        self._broadcast(self._buffers, leader, self._group_set)

    def cross_group_mean(self, flat: torch.Tensor) -> None:
        """One ``hvd.allreduce`` (sum) over this rank's cross group, divided by the number of groups."""
        assert self.replicas is not None
        self._gate("allreduce")
        hvd = self.hvd
        self.comm_bytes += flat.numel() * flat.element_size()
        # Named: the name the ranks of a set match on then does not depend on how many other Horovod ops each
        # rank started (an unnamed op is named after this process's handle number).
        out = hvd.allreduce(flat, op=hvd.Sum, name="distkit.cross_group_mean", process_set=self._cross_set)
        with torch.no_grad():
            flat.copy_(out.div_(self.replicas.count))

    def group_mean(self, flat: torch.Tensor) -> None:
        """One ``hvd.allreduce`` (sum) over this rank's replica group, divided by its number of ranks."""
        assert self.replicas is not None
        self._group_all_reduce(flat, "sum").div_(self.replicas.size)

    def start_all_to_all(self, rows: torch.Tensor) -> Any:
        self._gate("alltoall")
        self.comm_bytes += rows.numel() * rows.element_size()
        handle = self.hvd.alltoall_async(rows.contiguous(), name=self._next_name("exchange.a2a"),
                                         process_set=self._cross_set)
        return _Handle(self.hvd, handle, self._bounded)

    def start_all_gather(self, row: torch.Tensor) -> Any:
        self._gate("allgather")
        self.comm_bytes += row.numel() * row.element_size()
        handle = self.hvd.allgather_async(row.contiguous()[None], name=self._next_name("exchange.gather"),
                                          process_set=self._cross_set)
        return _Handle(self.hvd, handle, self._bounded)

    def _group_all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """In place, over the ranks that reduce gradients together (this rank's replica group): the used-mask
        of find_unused_parameters (``drop_globally_unused``), as DDP's on its process group. op is max|min|sum."""
        self._gate("allreduce")
        hvd = self.hvd
        self.comm_bytes += tensor.numel() * tensor.element_size()
        out = hvd.allreduce(tensor.detach(), op={"sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}[op],
                            name="distkit.group_all_reduce", process_set=self._group_set)
        with torch.no_grad():
            tensor.copy_(out)
        return tensor

    # -- per step ----------------------------------------------------------------------
    def _distributed(self, optimizer: torch.optim.Optimizer) -> bool:
        return hasattr(optimizer, "synchronize") and self._reduces_gradients

    def _gradient_arrived(self, p: torch.Tensor) -> None:
        self._seen.add(id(p))

    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        """``loss.backward()``; in grad mode, on the last of ``accum_grad_multiple_step`` passes, the
        gradients are reduced when it returns (as DDP's are), so a plain ``clip_grad_norm_`` between
        backward and step clips what every rank holds (every rank of the group, with replica groups).
        Further passes before the step add their reduced gradients (DDP's result for accumulation without
        ``no_sync``), where Horovod itself would raise."""
        reduces = self._reduces_gradients and self.world_size > 1 and bool(self._trainable)
        if reduces and self._micro + 1 >= self.cfg.accum_grad_multiple_step:
            self._gate("gradient allreduce")  # (start-up only: its hooks submit the reductions during backward)
        loss.backward()
        if not reduces:
            return
        self._micro += 1
        if self._micro >= self.cfg.accum_grad_multiple_step:
            self._synchronized = False  # a new reduction, also after one already finished in this step
            self.wait_for_gradients(model, self._optimizer)

    @contextlib.contextmanager
    def waiting(self, what: str = "Horovod's allreduce") -> Iterator[None]:
        """Strategy's (timed as waiting on communication), and under the Gloo controller bounded (``_guard``)."""
        with super().waiting(), self._bounded(what):
            yield

    def wait_for_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._distributed(optimizer) and not self._synchronized:
            self._check_unused()
            with self.waiting("Horovod's gradient allreduce"):
                optimizer.synchronize()  # type: ignore[attr-defined]
            self.comm_bytes += self._grad_bytes
            if self._find_unused:  # where Horovod filled in zeros; "globally": over the group that reduced
                group: Optional[Callable[[torch.Tensor, str], Any]] = (
                    self._group_all_reduce if self.replicas is not None else None)
                drop_globally_unused(self, [p for _, p in self._trainable], self._seen, self._had_grad, group)
            self._had_grad = {id(p): p.grad is not None for _, p in self._trainable}
            self._synchronized = True  # step() must then skip Horovod's own synchronize
            self._micro = 0
            self._seen = set()

    @property
    def _find_unused(self) -> bool:
        return bool(self.cfg.distributed.options.get("find_unused_parameters", False))

    def _check_unused(self) -> None:
        """As DDP without ``find_unused_parameters``: a parameter that got no gradient is an error (Horovod
        would all-reduce zeros for it, and weight decay or momentum would then move it where DDP does not)."""
        if self._find_unused:
            return
        unused = [n for n, p in self._trainable if id(p) not in self._seen]
        if unused:
            raise unused_parameters(self.rank, unused)

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        self.wait_for_gradients(model, optimizer)  # wait for the reduced gradients, then clip them
        return super().clip_grad_norm(model, optimizer, max_norm)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not self._distributed(optimizer):
            super().step(model, optimizer)
            return
        self.wait_for_gradients(model, optimizer)  # Horovod's own synchronize, timed as waiting
        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            optimizer.step()
        self._synchronized = False
        optimizer.zero_grad()  # sets grads to None
        self._micro, self._seen, self._had_grad = 0, set(), {}
        if self.averager is not None:  # replica groups: the groups average when due (collective)
            self.averager.after_step()

    # no_sync: Horovod counts micro-steps itself (backward_passes_per_step) and sends on the last.


def _zero_grad(self: Any, set_to_none: bool = True) -> None:
    """``zero_grad`` for ``hvd.DistributedOptimizer`` with torch's signature: Horovod's own check that no
    reduction is in flight (its zero_grad takes no argument), then ``torch.optim.Optimizer.zero_grad``."""
    if self._handles:
        raise UsageError("optimizer.zero_grad() between dk.backward and dk.step on Horovod would drop gradients "
                         "that are being reduced: call it after dk.step() (which zeroes them anyway)")
    torch.optim.Optimizer.zero_grad(self, set_to_none=set_to_none)


class HorovodFallback(MPIStrategy):
    """``use_horovod`` without Horovod installed: distkit's mpi engine, same modes, keys and math."""

    name = "horovod"
    #: why ``horovod.torch`` did not import (set when this module is imported)
    reason: ClassVar[str] = ""

    @classmethod
    def check_config(cls, cfg: Any) -> None:
        if cfg.distributed.require_horovod:
            raise BackendUnavailable(f"horovod_require = True but horovod is not importable ({cls.reason}): {INSTALL_HINT}")
        try:
            super().check_config(cfg)
        except BackendUnavailable:
            raise BackendUnavailable(
                f"use_horovod needs Horovod or, as a fallback, mpi4py; neither imports ({cls.reason}): "
                f"{INSTALL_HINT}, or pip install 'distkit[mpi]'") from None

    def init(self) -> None:
        super().init()
        if self.is_main:
            print(f"distkit: horovod is not importable ({self.reason}); running use_horovod on distkit's mpi "
                  "engine (same modes and keys; horovod_require = True makes this an error)", flush=True)

    def backend_impl(self) -> str:
        return f"{mpi_impl()} (horovod fallback: horovod not importable)"


def _select() -> type[Strategy]:
    hvd, why = _import_horovod()
    if hvd is not None:
        return HorovodEngine
    HorovodFallback.reason = why or "unknown"
    return HorovodFallback


#: The registry's "horovod" entry: the real engine when ``horovod.torch`` imports, else the fallback.
HorovodStrategy: type[Strategy] = _select()
