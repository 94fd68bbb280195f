"""The Strategy interface every engine implements (DESIGN.md section 2).

A Strategy owns one engine's process group and the wrapping of model and optimizer
for the mode ("grad" or "param"). The training loop talks only to this interface.
Collectives must be called by every rank, in the same order.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterator, Optional

import torch
from torch import nn

from distkit.sync.averager import flat_mean
from distkit.config import RunConfig
from distkit.env import ClusterEnv
from distkit.errors import ConfigError, UnsupportedCombination
from distkit.sync.replicas import ReplicaGroups, replica_groups
from distkit import portable
from distkit.portable import optimizer_state_by_name

from .parts import bare_module, persistent_buffers


class _Done:
    """A collective that completed when it was started (:meth:`Strategy.start_all_reduce`'s default)."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def wait(self) -> torch.Tensor:
        return self.out


class Strategy(ABC):
    """One engine in one mode. Topology attributes are read-only after construction."""

    #: what the caller is doing while it runs a collective, for the engines' own timeout lines (set by
    #: ``Job._collective``; None elsewhere)
    doing: Optional[str] = None
    #: collective: the ranks meet (``Watchdog.meet`` through the heartbeat store, bounded by
    #: ``distributed.startup_s()``; the argument names the point in a timeout), for an engine whose own waits
    #: cannot take start-up's bound (Horovod's stall inspector); set by the Job, None without a watchdog
    meet: Optional[Callable[[str], None]] = None

    name: ClassVar[str]
    supported_modes: ClassVar[frozenset[str]] = frozenset({"grad", "param"})
    #: how ``--nprocs N`` starts local ranks for this engine: "spawn" (distkit's spawner, torchrun's
    #: variables) or "mpirun" (engines whose ranks must be MPI processes)
    local_launcher: ClassVar[str] = "spawn"
    #: True where the engine steps the LR scheduler itself inside ``step`` (DeepSpeed)
    steps_scheduler: ClassVar[bool] = False
    #: the engine applies ``precision`` itself (DeepSpeed's bf16/fp16 blocks): no autocast or GradScaler around it
    handles_precision: ClassVar[bool] = False
    #: the engine takes exactly ``accum_grad_multiple_step`` backward passes per optimizer step (DeepSpeed
    #: counts micro-steps to find its accumulation boundary); elsewhere any number adds up as under DDP
    fixed_accumulation: ClassVar[bool] = False

    @classmethod
    def before_forks(cls, cfg: RunConfig) -> tuple[str, ...]:
        """Modules every rank of this engine imports before its first step, for ``distkit train --nprocs N`` to import
        once in the launching process before it forks the N ranks (:func:`distkit.launch.forkrank.preimport`), instead of N
        times at once; may set what their import reads from the environment (which the ranks inherit). Default:
        none."""
        return ()

    def note_loader_batch(self, batch_size: int) -> None:
        """A ``dk.dataloader`` of ``batch_size`` samples per rank per micro-step was made (the first one made before
        :meth:`setup` is, in the scripts we know, the training loader). Default: nothing to do with it."""

    def check_accumulation(self, steps: int) -> None:
        """Raise ConfigError when ``accum_grad_multiple_step = steps``, set after start-up
        (``dk.set_accumulation``), contradicts the engine's own config. Default: any value is fine."""

    @property
    def grads_in_params(self) -> bool:
        """Whether, after a backward outside ``no_sync``, ``param.grad`` of the bare model holds the reduced
        gradient the optimizer will use (so ``torch.nn.utils.clip_grad_norm_`` on it is right). False
        where the engine keeps gradients elsewhere (ZeRO's partitions)."""
        return True

    def __init__(self, cfg: RunConfig, env: ClusterEnv, device: torch.device) -> None:
        self.cfg = cfg
        self.env = env
        self.device = device
        self.rank, self.local_rank, self.world_size = env.rank, env.local_rank, env.world_size
        self.reduce_type = cfg.distributed.reduce_type
        #: False inside the Session's ``no_sync`` (accumulation micro-steps): DDP's buffer rule reads it
        #: (:mod:`distkit.backends.buffers`) on the engines that do not wrap the model in DDP
        self.outside_no_sync = True
        #: payload bytes this rank handed to collectives (not wire bytes), for summary.json
        self.comm_bytes = 0
        #: seconds this rank was blocked waiting for gradient collectives outside ``backward`` (the
        #: mpi engine's and Horovod's waits; DDP and DeepSpeed wait inside backward, which the
        #: Session times); param mode's averaging counts in ``averager.wait_s``
        self.comm_wait_s = 0.0
        self.averager: Any = None  # set by setup() in param mode
        #: param mode with ``param_sync_group_size`` > 1: the replica groups (gradients reduced inside this
        #: rank's group every step, the groups averaged every param_sync_step); None: every rank its own
        #: replica, or grad mode. Raises the agreed UnsupportedCombination when the size does not divide.
        if cfg.fault_tolerance:  # each replica group is a launch of its own: this world is one group
            cfg.distributed.param_sync_group_size = self.world_size
        self.replicas: Optional[ReplicaGroups] = replica_groups(
            self.reduce_type, cfg.distributed.param_sync_group_size, self.rank, self.world_size)
        #: fault-tolerant replica groups (``fault_tolerance``): the syncs across groups go through torchft
        #: (:class:`distkit.ft.groups.FaultTolerance`, set by the Session after setup); None otherwise
        self.ft: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Raise UnsupportedCombination/BackendUnavailable before start if ``cfg`` cannot work."""
        if cfg.distributed.reduce_type not in cls.supported_modes:
            raise UnsupportedCombination(
                f"backend '{cls.name}' does not support reduce_type '{cfg.distributed.reduce_type}': "
                f"use one of {', '.join(sorted(cls.supported_modes))}")
        d = cfg.distributed
        if d.reduce_type == "grad" and d.param_sync_group_size != 1:
            raise ConfigError("'distributed.param_sync_group_size' only applies to reduce_type 'param': remove it")
        if d.reduce_type == "param" and cfg.nprocs > 1 and cfg.nprocs % d.param_sync_group_size:
            raise UnsupportedCombination(f"param_sync_group_size {d.param_sync_group_size} does not divide the world "
                                         f"size {cfg.nprocs} (nprocs): use a divisor of the number of ranks")

    # -- lifecycle ---------------------------------------------------------------
    @abstractmethod
    def init(self) -> None:
        """Collective: join the process group (every rank)."""

    @abstractmethod
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              lr_scheduler: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Collective: broadcast rank 0's initial state and wrap model/optimizer for the mode.

        ``lr_scheduler`` is handed to engines that step it themselves (:attr:`steps_scheduler`);
        the others ignore it (the caller steps it after :meth:`step`).
        """

    def engine_defines_optimizer(self) -> bool:
        """True where the engine's own config builds the optimizer (DeepSpeed's ``optimizer`` block):
        ``setup`` then takes ``optimizer=None``."""
        return False

    def end_startup(self) -> None:
        """Start-up has ended (:mod:`distkit.backends.startup`; the ranks just met): bound the engine's own waits
        by ``distributed.timeout_s`` from now on, where they had start-up's bound. Not collective. Default:
        nothing (an engine that reads :func:`distkit.backends.startup.bound` at each wait)."""

    def before_last_meet(self) -> None:
        """Called on every rank after a normal run, just before the ranks' last meeting (a barrier: no rank passes it
        before every rank made this call), and before :meth:`teardown`. Default: nothing."""

    def teardown(self) -> None:
        """Leave the process group; idempotent."""

    def abort(self) -> None:
        """This rank failed: make sure the others do not wait for it (e.g. MPI_Abort). Not collective."""

    def end_job(self, code: int) -> None:
        """End this rank now, from any thread, and make the job end (never returns). Not collective.
        Default: ``os._exit(code)``, which the launcher notices; MPI engines override with ``MPI_Abort``."""
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)

    def backend_impl(self) -> str:
        """What really runs, with versions, e.g. 'torch 2.13.0 DDP (gloo)'."""
        return self.name

    # -- per step ------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's bare module inside any wrapper (``torch.compile``'s too)."""
        return bare_module(model)

    def forward_is_collective(self, model: nn.Module) -> bool:
        """True where a forward pass communicates (ZeRO-3 gathers parameters in it): evaluation then
        runs the same number of forward passes on every rank."""
        return False

    def copies_refused(self, model: nn.Module) -> Optional[str]:
        """Why a copy of the set-up model (an EMA's ``AveragedModel``, ``copy.deepcopy``) registered with
        ``dk.keep_in_sync`` cannot follow it, with the fix; None where it can (the parameters are whole)."""
        return None

    def backward(self, loss: torch.Tensor, model: nn.Module) -> None:
        loss.backward()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for accumulation micro-steps that must not communicate."""
        return contextlib.nullcontext()

    def wait_for_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Return when the gradients of this step are reduced (grad mode) and may be read or rescaled;
        engines that reduce asynchronously until their step (Horovod, the mpi engine) finish that here."""

    #: True where the gradient collective is waited for inside ``backward`` (DDP's reducer, DeepSpeed's
    #: engine): the Session then counts the time from the last gradient computed to backward's return
    #: as waiting on communication.
    reduces_in_backward: bool = False

    @property
    def blocked_s(self) -> float:
        """Seconds blocked on the training collectives so far: :attr:`comm_wait_s` plus param mode's averaging."""
        return self.comm_wait_s + (self.averager.wait_s if self.averager is not None else 0.0)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent inside counts as blocked on communication (:attr:`comm_wait_s`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.comm_wait_s += time.perf_counter() - t0

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip the (already reduced, in grad mode) gradients to ``max_norm``; returns the norm before."""
        return float(torch.nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm))

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Optimizer step + zero_grad; in param mode the averager syncs when due (collective)."""
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.averager is not None:
            self.averager.after_step()

    def finish(self, model: nn.Module) -> None:
        """Collective: end of training, after which every rank holds the same model state. param mode:
        the final sync (parameters and floating buffers averaged). grad mode: parameters are equal
        already; persistent buffers (BatchNorm statistics) were last updated by each rank's own forward
        pass, so rank 0's are broadcast (the values DDP would broadcast before the next forward)."""
        if self.averager is not None:
            self.averager.final_sync()
            return
        buffers = persistent_buffers(self.unwrap(model))
        if buffers and self.world_size > 1:
            self.broadcast_tensors(buffers)

    # -- state (checkpoints, checksums) ------------------------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's model + optimizer state for a checkpoint (a picklable dict)."""
        return {"model": self.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; a None entry is left as it is."""
        if state.get("model") is not None:
            self.unwrap(model).load_state_dict(state["model"])
        if state.get("optimizer") is not None:
            optimizer.load_state_dict(state["optimizer"])

    def portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                       keep: Callable[[str], bool]) -> portable.State:
        """Collective where state is sharded (ZeRO): the engine-neutral state for ``distkit.portable``.

        Returns ``(model, optim_state, groups)``: the bare model's ``state_dict`` entries whose name
        ``keep`` accepts (whole, on the CPU), the optimizer state by parameter name for those
        parameters (``optim_state[name][key]``), and the param groups (hyper-parameters, ``params``
        as names). Every rank must call it; ``keep`` must accept each name on one rank at least."""
        module = self.unwrap(model)
        sd = {k: v for k, v in module.state_dict().items() if keep(k)}
        if optimizer is None:
            return sd, {}, []
        state, groups = optimizer_state_by_name(optimizer.state_dict(), portable.group_names(module, optimizer))
        return sd, {n: s for n, s in state.items() if keep(n)}, groups

    def load_portable_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                            sd: dict[str, torch.Tensor], optim_state: dict[str, dict[str, Any]],
                            groups: list[dict[str, Any]]) -> None:
        """Collective where state is sharded: restore what :meth:`portable_state` returned (every name),
        whichever engine, world size and mode wrote it."""
        portable.restore(self.unwrap(model), optimizer, sd, optim_state, groups)

    #: True where each rank of a group holds its own part of the state (fsdp's shards): a group that heals
    #: (fault_tolerance) takes each rank's from the same rank of a live group, not rank 0's everywhere
    heals_rank_by_rank: ClassVar[bool] = False

    def heal_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> portable.State:
        """Not collective (torchft's quorum thread asks for it): this rank's model and optimizer state by name
        for the same rank of a group that heals, as :meth:`portable_state` (default: it, whole on every rank)."""
        return self.portable_state(model, optimizer, lambda name: True)

    def load_heal_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], state: portable.State) -> None:
        """Not collective where :attr:`heals_rank_by_rank`: restore :meth:`heal_state`'s output."""
        self.load_portable_state(model, optimizer, *state)

    #: True where :meth:`save_engine_files` writes the whole resumable model and optimizer state
    #: (DeepSpeed): a same-layout resume then reads nothing else for them.
    engine_files: bool = False

    def save_engine_files(self, directory: str, model: nn.Module) -> None:
        """Collective: engines with their own checkpoint format write it into ``directory`` (default: nothing)."""

    def load_engine_files(self, directory: str, model: nn.Module) -> None:
        """Collective: read what :meth:`save_engine_files` wrote (default: nothing)."""

    def full_named_parameters(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective where parameters are sharded: every parameter, whole, in a fixed order."""
        yield from self.unwrap(model).named_parameters()

    # -- collectives -----------------------------------------------------------------
    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective: every rank must call it, in the same order. In place; op is sum|mean|max|min."""

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "max") -> Any:
        """:meth:`all_reduce` (op sum|max|min) started in the background: a handle whose ``wait()`` returns the
        reduced tensor (``tensor`` itself or a copy: use what ``wait()`` returns). Every rank starts and waits
        for these in the same order, between its other collectives. Default: done at once (engines whose
        small collectives cannot overlap)."""
        return _Done(self.all_reduce(tensor, op))

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective: every rank must call it, in the same order. Returns ``src``'s object."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Collective: every rank must call it, in the same order. Returns one object per rank."""

    @abstractmethod
    def barrier(self) -> None:
        """Collective: every rank must call it, in the same order."""

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Collective: every rank must call it, in the same order. Overwrites ``tensors`` with ``src``'s.

        Default: through ``broadcast_object`` (pickled, slow); backends override with a tensor broadcast.
        """
        values = self.broadcast_object([t.detach().cpu() for t in tensors] if self.rank == src else None, src)
        with torch.no_grad():
            for t, v in zip(tensors, values, strict=True):
                t.copy_(v)

    def average_parameters(self, params: list[torch.Tensor], is_param: Optional[list[bool]] = None) -> bool:
        """Collective: every rank must call it, in the same order. Sets each tensor to its mean over ranks.
        ``is_param``: which of ``params`` are parameters rather than floating buffers, where they are views
        (fragments of param_sync_fragments); None = ``isinstance(t, nn.Parameter)``. Returns whether the mean was
        applied: always, except under fault_tolerance at a sync that did not commit (the tensors are left as they
        were; the parameter averager then skips its outer step too).

        One flat all-reduce (torch ``model_averaging/utils.py`` pattern); costs one extra copy
        of the tensors' total size, temporarily. With replica groups the ranks of a group hold the same
        tensors, so the mean over ranks is the mean over groups: it is taken over this rank's cross group
        (:meth:`cross_group_mean`), one copy of the model per link instead of one per rank; the floating
        buffers, which differ inside a group, over the group's ranks (:meth:`group_mean`) and then across the
        groups: the order fault-tolerant groups take (each group its own ranks, torchft the groups), so one job
        of replica groups and the same groups under fault_tolerance round alike, bit for bit.
        """
        kinds = is_param if is_param is not None else [isinstance(t, nn.Parameter) for t in params]
        buffers = [t for t, p in zip(params, kinds, strict=True) if not p]
        if self.ft is not None:  # across groups through torchft; the buffers first over this group's ranks
            if self.world_size > 1:
                flat_mean(buffers, lambda flat: self.all_reduce(flat, op="mean"))
            return bool(self.ft.average(params))
        if self.replicas is None:
            flat_mean(params, lambda flat: self.all_reduce(flat, op="mean"))
            return True
        # The parameters over the cross group. The floating buffers (BatchNorm statistics) over every rank, in two
        # stages: each rank's own forward updated them, so the ranks of a group hold different ones. One average
        # over every rank would be the same mean rounded differently from a fault-tolerant group's, which averages
        # over its own ranks and then hands the result to torchft (a max difference of 1e-8 after the first
        # sync grew to 8e-2 at step 300 of a BatchNorm model). The same rule on every engine.
        flat_mean([t for t, p in zip(params, kinds, strict=True) if p], self.cross_group_mean)
        flat_mean(buffers, self.group_mean)
        flat_mean(buffers, self.cross_group_mean)
        return True

    # -- param mode's compressed exchange (param_sync_compression, distkit.sync.compression) ---------------------
    def averaging_size(self) -> int:
        """How many copies of the parameters the averaging averages: the replica groups, else the ranks."""
        return self.replicas.count if self.replicas is not None else self.world_size

    def exchange_all_to_all(self, rows: torch.Tensor) -> torch.Tensor:
        """Collective over the ranks the parameters are averaged over (this rank's cross group with replica
        groups, else every rank; :meth:`averaging_size` of them, in rank order): ``rows`` (p, m) uint8, row j for
        member j; returns (p, m), row j the row member j sent to this rank."""
        return self.start_all_to_all(rows).wait()  # type: ignore[no-any-return]

    def exchange_all_gather(self, row: torch.Tensor) -> torch.Tensor:
        """Collective over the same ranks as :meth:`exchange_all_to_all`: ``row`` (m,) uint8 from each; returns
        (p, m), row j member j's."""
        return self.start_all_gather(row).wait()  # type: ignore[no-any-return]

    def start_all_to_all(self, rows: torch.Tensor) -> Any:
        """:meth:`exchange_all_to_all` started in the background: returns a handle whose ``wait()`` returns its
        result (``param_sync_overlap``). Every rank starts and waits for its exchanges in the same order."""
        raise NotImplementedError(f"the {self.name} engine has no compressed exchange")

    def start_all_gather(self, row: torch.Tensor) -> Any:
        """:meth:`exchange_all_gather` started in the background (see :meth:`start_all_to_all`)."""
        raise NotImplementedError(f"the {self.name} engine has no compressed exchange")

    def group_mean(self, flat: torch.Tensor) -> None:
        """Collective over this rank's replica group (every rank of the group calls it, in the same order): ``flat``
        (in place) becomes its mean over the group's ranks, a sum divided by their number. Engines that support
        ``param_sync_group_size`` > 1 implement it."""
        raise NotImplementedError(f"the {self.name} engine has no replica groups")

    def cross_group_mean(self, flat: torch.Tensor) -> None:
        """Collective over this rank's cross group (:meth:`ReplicaGroups.cross`; every rank calls it, in the
        same order): ``flat`` (in place) becomes its mean over the replica groups. Engines that support
        ``param_sync_group_size`` > 1 implement it."""
        raise NotImplementedError(f"the {self.name} engine has no replica groups")
