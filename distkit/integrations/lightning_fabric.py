"""distkit under Lightning Fabric: ``Fabric(strategy=DistkitStrategy(...))`` (or this module's
``DistkitFabricStrategy``, both imported from :mod:`distkit.lightning`), and what
:class:`~distkit.lightning.DistkitStrategy` shares with it: the config, the ranks, the launch, the Session's start and
the collectives (all on ``lightning.fabric``'s pieces, which the Trainer's strategies are built on too).

A class of its own: the Trainer's and Fabric's strategy bases share method names with other signatures and meanings
(``backward(loss, optimizer)`` against ``backward(tensor, module)``, ``optimizer_step(optimizer, closure)`` against
``optimizer_step(optimizer)``, ``save_checkpoint(checkpoint, path)`` against ``save_checkpoint(path, state)``,
``precision_plugin`` against ``precision``). A ``DistkitStrategy`` handed to Fabric turns into this class at the one
call only Fabric's connector makes (``_set_world_ranks``), so no method has to guess its frontend.

    fabric = Fabric(strategy=DistkitFabricStrategy(args), accelerator="cpu", devices=2)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)   # dk.setup: the engine's wrapper, param mode's averager
    fabric.backward(loss)                               # dk.backward
    optimizer.step()                                    # dk.step: step, zero_grad, averaging when due
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed

import distkit
from distkit.backends import check_backend, strategy_class
from distkit.components import pick_device
from distkit.config import RunConfig
from distkit.config.arguments import Source, config_from
from distkit.env import ClusterEnv, detect
from distkit.errors import CheckpointError, ConfigError, UnsupportedCombination, UsageError
from distkit.health.guards import install_excepthook
from distkit.session import Session
from distkit.integrations.session_optimizer import SessionOptimizer

#: what the lightning side of each refused engine is
_OWN = {"deepspeed": "lightning.pytorch.strategies.DeepSpeedStrategy (Trainer(strategy='deepspeed_stage_2'))",
        "fsdp": "lightning.pytorch.strategies.FSDPStrategy (Trainer(strategy='fsdp'))"}
_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
#: the per-rank state of a param-mode checkpoint (replicas, optimizer moments, averager) beside Lightning's file
SIDECAR = ".distkit"
#: the key a param-mode checkpoint of the Lightning bridges carries (``True``): every rank's own state is in
#: ``PATH.distkit``, so a resume without that directory would start every rank from rank 0's replica
REPLICAS_KEY = "distkit_replicas_in_sidecar"


def load_sidecar(dk: Any, path: str, own: dict[str, Any], marked: bool) -> None:
    """Collective where ``marked`` (the same on every rank: read from the one checkpoint file): this rank's own state
    from ``path`` + :data:`SIDECAR` into ``own`` (``dk.load``). A checkpoint marked as written in param mode whose
    directory any rank cannot find stops every rank with one line (:class:`~distkit.errors.CheckpointError`, agreed)
    instead of resuming every replica from rank 0's: a different run, unseen (0.51 apart in a test). Unmarked (grad
    mode, another strategy, or written before the mark): the directory is loaded if there, else the ranks start
    from the file's one model, as Lightning's own strategies do."""
    side = path + SIDECAR
    here = os.path.isdir(side)
    if marked:
        missing = dk.all_reduce(torch.tensor([0.0 if here else 1.0]), op="max")
        if float(missing[0]) > 0:
            error = CheckpointError(f"{path} was saved in param mode with each rank's own replica, optimizer and "
                                    f"averager state in {side}, which {'this' if not here else 'another'} rank cannot "
                                    f"find: put that directory beside the checkpoint where every rank reads it, or "
                                    f"resume from a checkpoint that has it")
            error.agreed = True  # every rank raises it here, after the all-reduce
            raise error
    if here:
        dk.load(side, own)


class _FixedEnvironment(ClusterEnvironment):
    """The ranks a launcher outside Lightning started (``--nprocs``, torchrun, mpirun, srun), as distkit's
    :func:`~distkit.env.detect` read them: Lightning starts no processes and sets no ranks."""

    def __init__(self, env: ClusterEnv) -> None:
        super().__init__()
        self.env = env

    @classmethod
    def of(cls, env: Optional[ClusterEnv]) -> Optional["_FixedEnvironment"]:
        return cls(env) if env is not None else None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self.env.master_addr or "127.0.0.1"

    @property
    def main_port(self) -> int:
        return self.env.master_port or 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.env.world_size

    def set_world_size(self, size: int) -> None:
        pass  # (fixed by the launcher)

    def global_rank(self) -> int:
        return self.env.rank

    def set_global_rank(self, rank: int) -> None:
        rank_zero_only.rank = self.env.rank

    def local_rank(self) -> int:
        return self.env.local_rank

    def node_rank(self) -> int:
        return self.env.node_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_devices * num_nodes != self.env.world_size:
            raise ConfigError(f"Trainer(devices={num_devices}, num_nodes={num_nodes}) but the {self.env.launcher} "
                              f"launcher started {self.env.world_size} ranks on {self.env.num_nodes} node(s): pass "
                              f"num_nodes={self.env.num_nodes} (devices follow the launcher)")

    def teardown(self) -> None:
        pass


def _resolve(source: Source, keys: dict[str, Any]) -> tuple[RunConfig, type, Optional[ClusterEnv]]:
    """The config the distkit way, its engine, and the ranks a launcher outside Lightning started (None: Lightning's
    own launcher starts them, or one process). Under plain ``python`` with ``nprocs > 1`` this process does not
    return: it starts the script again as the ranks (as :func:`distkit.init`)."""
    install_excepthook(lambda: Session.current)  # a refusal below: one line and exit 2, not a traceback
    cfg, _ = config_from(source, **keys)
    check_backend(cfg)
    engine = cfg.distributed.backend
    if engine in _OWN:
        raise UnsupportedCombination(f"DistkitStrategy cannot hand engine '{engine}' to Lightning (the engine owns the "
                                     f"model wrapper and its checkpoints): use {_OWN[engine]}")
    if cfg.precision != "32":
        raise ConfigError(f"DistkitStrategy: precision {cfg.precision!r} in distkit's config: set it on the Trainer or "
                          "Fabric instead (precision='bf16-mixed') and leave distkit's at '32'")
    env = detect(os.environ)
    if env.launcher == "single" and cfg.nprocs > 1:
        distkit.init(cfg)  # starts the script again as nprocs ranks and exits with their status
    return cfg, strategy_class(engine), env if env.launcher != "single" else None


def _devices(cfg: RunConfig, env: Optional[ClusterEnv]) -> Optional[list[torch.device]]:
    """One device per local rank of an outside launcher (Lightning's connector then keeps them); None: Lightning's."""
    if env is None:
        return None
    return [pick_device(cfg.device, env.local_rank, env.local_world_size)] * env.local_world_size


def _check_launcher(strategy: Any) -> None:
    """The MPI engines need ranks an MPI launcher started: refused under Lightning's own ``devices=N`` launcher."""
    ce = strategy.cluster_environment
    ranks = strategy.num_processes * strategy.num_nodes
    if not isinstance(ce, _FixedEnvironment) and ranks > 1 and strategy._engine.local_launcher == "mpirun" \
            and not ce.creates_processes_externally:
        raise UnsupportedCombination(f"engine '{strategy._cfg.distributed.backend}' needs MPI ranks, which "
                                     f"devices={strategy.num_processes} alone does not start: run `python SCRIPT "
                                     f"--nprocs {ranks}` (distkit starts mpirun) or `mpirun -np {ranks} python SCRIPT`")


def _set_ranks(strategy: Any) -> None:
    """DDPStrategy's rule under Lightning's own launcher; the outside launcher's ranks else."""
    ce = strategy.cluster_environment
    if ce is not None and not isinstance(ce, _FixedEnvironment):
        ce.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        ce.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = strategy.global_rank


def _join(strategy: Any) -> Session:
    """Collective: ``distkit.init`` with the strategy's ranks (Lightning's, or the outside launcher's)."""
    ce = strategy.cluster_environment
    env = ce.env if isinstance(ce, _FixedEnvironment) else ClusterEnv(
        strategy.global_rank, strategy.local_rank, strategy.world_size, strategy.num_processes, strategy.node_rank,
        strategy.num_nodes, ce.main_address, ce.main_port, "env", None, None)
    dk = distkit.init(strategy._cfg, env=env)
    reset_seed()  # Lightning's seed_everything wins over the Session's cfg.seed, as in DDPStrategy
    return dk


def _every_rank(group: Any) -> bool:
    """Whether ``group`` means every rank: None, or torch.distributed's WORLD group, which Fabric's ``all_reduce``
    and Lightning's logging pass when the user named none (on the ddp and fsdp engines it is the job's group; on
    the MPI engines torch.distributed has none and WORLD is None)."""
    if group is None:
        return True
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and group is dist.group.WORLD


def _reduce(dk: Optional[Session], tensor: Any, group: Any, reduce_op: Any) -> Any:
    """Collective: ``tensor`` reduced over every rank, in place and returned, as Lightning's DDP does it
    (``_sync_ddp``: the reduction, then a mean divides in place: an integer tensor keeps its dtype, the quotient
    truncated); a non-tensor is returned as is."""
    if not isinstance(tensor, torch.Tensor) or dk is None:
        return tensor
    op = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    op = _OPS.get(str(op).lower().replace("redop.", ""))
    if op is None or not _every_rank(group):
        raise UsageError(f"DistkitStrategy reduce: op {reduce_op!r} over group {group!r}: distkit reduces over every "
                         "rank with mean, sum, max or min")
    out = dk.all_reduce(tensor.detach().clone(), op="sum" if op == "mean" else op)
    with torch.no_grad():
        tensor.copy_(out)
        if op == "mean":  # Lightning's order: the sum, then the division in place
            if tensor.is_floating_point():
                tensor.div_(dk.world_size)
            else:
                tensor.copy_(tensor / dk.world_size)
    return tensor


def _gather(dk: Optional[Session], tensor: torch.Tensor, sync_grads: bool) -> torch.Tensor:
    """Collective: every rank's ``tensor``, stacked in rank order (no gradient through it)."""
    if sync_grads:
        raise UnsupportedCombination("DistkitStrategy all_gather(sync_grads=True): distkit's engines gather without "
                                     "autograd; use DDPStrategy for a differentiable all_gather")
    if dk is None:
        return tensor.unsqueeze(0)
    return torch.stack(dk.all_gather_object(tensor.detach().cpu())).to(tensor.device)


def sync_metrics(module: nn.Module, dk: Session) -> None:
    """torchmetrics' ``Metric`` objects inside ``module`` sync their states over the job's engine, as under DDP.

    A Metric syncs through torch.distributed's collectives when a process group exists (``compute()``, which
    Lightning's logging calls at the end of an epoch). On the ddp, fsdp and DeepSpeed engines that group is the job's;
    on the mpi and Horovod engines there is none, so each rank would log its own value (rank 0 0.0 and rank 1 1.0
    where DDP logs 0.5). There each Metric gathers through ``dk.all_gather_object`` instead (collective, as
    torchmetrics' own: every rank computes the metric at the same point)."""
    import torch.distributed as dist

    if dk.world_size <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    try:
        from torchmetrics import Metric
    except ImportError:  # (Lightning installs torchmetrics; a script without it has no Metric to sync)
        return

    def gather(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        return [t.to(tensor.device) for t in dk.all_gather_object(tensor.detach().cpu())]

    for m in module.modules():
        if isinstance(m, Metric):
            m.dist_sync_fn = gather
            m.distributed_available_fn = lambda: True


def _backward(dk: Session, loss: torch.Tensor) -> None:
    """``dk.backward`` (grad mode: collective); outside ``no_sync`` the reduced gradients are waited for, so that
    hooks and Lightning's clipping see what DDP shows them (the mpi engine and Horovod reduce in the background)."""
    dk.backward(loss)
    if dk._strategy.outside_no_sync:
        dk._strategy.wait_for_gradients(dk.model, dk.optimizer)


class _SessionStep:
    """The optimizer as Lightning's precision plugin sees it: ``step(closure)`` runs the closure (training_step,
    ``dk.backward``, Lightning's clipping and hooks), then ``dk.step()`` (collective: optimizer step, zero_grad,
    param mode's averaging when due); every other attribute is the optimizer's own."""

    def __init__(self, dk: Session) -> None:
        self._dk = dk

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        out = closure() if closure is not None else None
        self._dk.step()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dk.optimizer, name)


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: accumulation micro-steps without communication (``dk.no_sync``)."""

    def __init__(self, strategy: "DistkitFabricStrategy") -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        dk = self._strategy.dk
        return dk.no_sync() if enabled and dk is not None else contextlib.nullcontext()


class _Shared:
    """What both strategies define alike (first in their bases, so these win over Lightning's abstract ones): the
    devices and rank counts Lightning reads, the launcher (``_LAUNCHER``: the Trainer's or Fabric's subprocess
    launcher class) and the collectives without a reduction op."""

    _LAUNCHER: Any
    _num_nodes: int
    _launcher: Any
    dk: Optional[Session]
    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Optional[ClusterEnvironment]
    local_rank: int
    global_rank: int
    world_size: int

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:  # (the Trainer's connector sets it; Fabric's sets _num_nodes)
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        _check_launcher(self)
        self._launcher = self._LAUNCHER(self.cluster_environment, self.num_processes, self.num_nodes)

    def _param_state(self) -> Optional[dict[str, Any]]:
        """What a param-mode checkpoint keeps per rank beside the framework's file (``dk.save``/``dk.load`` of
        ``PATH.distkit``): this rank's replica and optimizer (with the averager's state); None in grad mode (every
        rank holds the same) or before the model was set up."""
        dk = self.dk
        if dk is None or dk.cfg.distributed.reduce_type != "param" or dk._model is None:
            return None
        return {"model": dk.model, "optimizer": dk.optimizer}

    def barrier(self, name: Optional[str] = None) -> None:
        """Collective (a no-op before the Session exists)."""
        if self.dk is not None:
            self.dk.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Collective: ``src``'s picklable ``obj``."""
        return self.dk.broadcast_object(obj, src) if self.dk is not None else obj

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        """Collective: every rank's ``tensor``, stacked in rank order (no gradient through it)."""
        return _gather(self.dk, tensor, sync_grads)


class DistkitFabricStrategy(_Shared, ParallelStrategy):
    """A Fabric ``ParallelStrategy`` whose engine and mode come from distkit's config (the arguments and the
    launch of :class:`~distkit.lightning.DistkitStrategy`).

    Cross-rank contract: ``fabric.launch()`` joins the job (collective); ``fabric.setup(model, optimizer)``,
    ``optimizer.step()``, ``fabric.backward`` in grad mode, ``all_reduce``/``barrier``/``broadcast``/``all_gather``
    and ``fabric.save``/``fabric.load`` are collective: every rank calls them in the same order.
    """

    def __init__(self, source: Source = None, **keys: Any) -> None:
        self._cfg, self._engine, env = _resolve(source, keys)
        super().__init__(parallel_devices=_devices(self._cfg, env), cluster_environment=_FixedEnvironment.of(env))
        self._num_nodes = 1
        self._backward_sync_control = _NoSync(self)
        self.dk: Optional[Session] = None

    _LAUNCHER = _SubprocessScriptLauncher

    def _set_world_ranks(self) -> None:
        _set_ranks(self)

    def setup_environment(self) -> None:
        """Collective (``fabric.launch()``): join the job, once."""
        super().setup_environment()
        if getattr(self.precision, "scaler", None) is not None:
            raise UnsupportedCombination("DistkitFabricStrategy with precision='16-mixed' (a GradScaler steps the "
                                         "optimizer itself): use precision='bf16-mixed' or '32-true'")
        if self.dk is None:
            self.dk = _join(self)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Any],
                                    scheduler: Optional[Any] = None) -> tuple[nn.Module, list[Any], Optional[Any]]:
        """Collective: ``dk.setup(module, optimizer)``, one model and one optimizer per strategy."""
        if self.dk is None:
            raise UsageError("fabric.setup() before fabric.launch(): call fabric.launch() first")
        if len(optimizers) != 1:
            raise UnsupportedCombination(f"DistkitFabricStrategy steps one optimizer, fabric.setup got "
                                         f"{len(optimizers)}: set up one, or use Fabric(strategy='ddp')")
        wrapped, optimizer = self.dk.setup(module, optimizers[0])
        sync_metrics(module, self.dk)
        return wrapped, [SessionOptimizer(optimizer, self.dk)], scheduler  # (Fabric subclasses it: see there)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Collective: a module without an optimizer (evaluation): rank 0's weights everywhere."""
        if self.dk is None:
            raise UsageError("fabric.setup() before fabric.launch(): call fabric.launch() first")
        self.dk._strategy.broadcast_tensors([*module.parameters(), *module.buffers()])
        sync_metrics(module, self.dk)
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        raise UsageError("DistkitFabricStrategy sets up model and optimizer together: fabric.setup(model, optimizer)")

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def backward(self, tensor: torch.Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """``dk.backward`` between the precision plugin's hooks (grad mode: collective)."""
        assert self.dk is not None
        self.precision.pre_backward(tensor, module)
        _backward(self.dk, tensor)
        self.precision.post_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Collective: ``dk.step()`` (optimizer step, zero_grad, param mode's averaging when due)."""
        assert self.dk is not None
        return self.precision.optimizer_step(_SessionStep(self.dk), **kwargs)

    def all_reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean") -> Any:
        return _reduce(self.dk, tensor, group, reduce_op)

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Any]] = None) -> None:
        """Collective (``fabric.save``): rank 0 writes Fabric's file; in param mode every rank also writes its own
        replica, optimizer and averager state to ``PATH.distkit``, which :meth:`load_checkpoint` restores."""
        own = self._param_state()
        # (marked: a resume must find every rank's own state, load_sidecar)
        super().save_checkpoint(path, state if own is None else {**state, REPLICAS_KEY: True}, storage_options, filter)
        if own is not None:
            self.dk.save(str(path) + SIDECAR, own)  # type: ignore[union-attr]

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Collective in param mode: Fabric's load (rank 0's state), then this rank's own state if saved."""
        rest = super().load_checkpoint(path, state, strict, weights_only)
        marked = bool(rest.pop(REPLICAS_KEY, False)) if isinstance(rest, dict) else False
        own = self._param_state()
        if own is not None and isinstance(state, dict):
            load_sidecar(self.dk, str(path), own, marked)
        return rest

    def close(self) -> None:
        """Collective: leave the job now (``Session.close``)."""
        if self.dk is not None:
            self.dk.close()
