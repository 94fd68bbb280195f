"""distkit as a Lightning strategy: ``Trainer(strategy=DistkitStrategy(...))`` (``pip install 'distkit[lightning]'``).

One config key picks the engine (``distributed.backend``: ddp, mpi, horovod) and the mode (``distributed.reduce_type``:
"grad" = per-step gradient all-reduce, "param" = local steps and periodic parameter averaging, DiLoCo, fragments and
int8 included); the config comes the distkit way: a file, a dict, or the namespace of a parser given to
:func:`distkit.add_arguments` (``--config``, ``++key value``, ``--nprocs N``)::

    parser = argparse.ArgumentParser(); distkit.add_arguments(parser)
    trainer = Trainer(strategy=DistkitStrategy(parser.parse_args()), accelerator="cpu", devices=2)

Launch: Lightning's own ``devices=N`` (ddp engine), ``python script.py --nprocs N`` (distkit starts the ranks when the
strategy is made; under ``mpirun`` for mpi/horovod), torchrun, mpirun or srun. Every step goes through one
:class:`distkit.Session` made at the first ``fit``/``validate``/``test`` (collective) and kept for the strategy's
later stages: Lightning's closure runs ``dk.backward``, ``dk.step`` steps (averaging when due in param mode),
accumulation micro-steps run inside ``dk.no_sync``. Refused, one line each before training: deepspeed and fsdp
(Lightning's ``DeepSpeedStrategy``/``FSDPStrategy`` own those), manual optimization or several optimizers,
``precision="16-mixed"`` with a loss scaler, and mpi/horovod under Lightning's own launcher.
Nothing else in distkit imports this module (it imports lightning).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import distkit
from distkit.backends import check_backend, strategy_class
from distkit.components import pick_device
from distkit.config import RunConfig
from distkit.config.arguments import Source, config_from
from distkit.env import ClusterEnv, detect
from distkit.errors import ConfigError, UnsupportedCombination, UsageError
from distkit.guards import install_excepthook
from distkit.session import Session

#: what the lightning side of each refused engine is
_OWN = {"deepspeed": "lightning.pytorch.strategies.DeepSpeedStrategy (Trainer(strategy='deepspeed_stage_2'))",
        "fsdp": "lightning.pytorch.strategies.FSDPStrategy (Trainer(strategy='fsdp'))"}
_OPS = {"mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min"}
#: the per-rank state of a param-mode checkpoint (replicas, optimizer moments, averager) beside Lightning's file
SIDECAR = ".distkit"


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


def _reduce(dk: Optional[Session], tensor: Any, group: Any, reduce_op: Any) -> Any:
    """Collective: ``tensor`` reduced over every rank (a copy); a non-tensor is returned as is."""
    if not isinstance(tensor, torch.Tensor) or dk is None:
        return tensor
    op = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    op = _OPS.get(str(op).lower().replace("redop.", ""))
    if op is None or group is not None:
        raise UsageError(f"DistkitStrategy reduce: op {reduce_op!r} over group {group!r}: distkit reduces over every "
                         "rank with mean, sum, max or min")
    out = tensor.detach().clone()
    if not out.is_floating_point() and op == "mean":
        out = out.float()
    return dk.all_reduce(out, op=op)


def _gather(dk: Optional[Session], tensor: torch.Tensor, sync_grads: bool) -> torch.Tensor:
    """Collective: every rank's ``tensor``, stacked in rank order (no gradient through it)."""
    if sync_grads:
        raise UnsupportedCombination("DistkitStrategy all_gather(sync_grads=True): distkit's engines gather without "
                                     "autograd; use DDPStrategy for a differentiable all_gather")
    if dk is None:
        return tensor.unsqueeze(0)
    return torch.stack(dk.all_gather_object(tensor.detach().cpu())).to(tensor.device)


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


class DistkitStrategy(ParallelStrategy):
    """A Lightning ``ParallelStrategy`` whose engine and mode come from distkit's config.

    ``source``: a config file path (or list), a dict (``{"distributed": {"backend": "mpi"}}``), an
    ``argparse.Namespace`` from :func:`distkit.add_arguments`, or a RunConfig; ``keys`` override it. Made under plain
    ``python`` with ``nprocs > 1`` (``--nprocs N``) this call does not return in the launching process: it starts the
    script again as N ranks, waits and exits with their status (as :func:`distkit.init`).

    Cross-rank contract: every rank makes it with the same config; Lightning then calls the collectives
    (``setup_environment``, ``setup``, ``optimizer_step``, ``reduce``, ``barrier``, ``broadcast``, ``all_gather``,
    ``save_checkpoint``, ``on_train_end``) on every rank in the same order, as it does for ``DDPStrategy``.
    """

    def __init__(self, source: Source = None, **keys: Any) -> None:
        self._cfg, self._engine, env = _resolve(source, keys)
        super().__init__(parallel_devices=_devices(self._cfg, env), cluster_environment=_FixedEnvironment.of(env))
        self._num_nodes = 1
        self.dk: Optional[Session] = None
        self._wrapped: Optional[nn.Module] = None
        self._resume_from: Optional[str] = None

    # -- topology ------------------------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """True: Lightning then inserts the DistributedSampler and syncs ``self.log(..., sync_dist=True)``."""
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """(Lightning's connector) DDPStrategy's rule under Lightning's own launcher; the launcher's ranks else."""
        _set_ranks(self)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        _check_launcher(self)
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    # -- the Session -----------------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Collective: join the job (``distkit.init`` with Lightning's ranks), once per strategy."""
        super().setup_environment()
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            raise UnsupportedCombination("DistkitStrategy steps through Lightning's automatic optimization; manual "
                                         "optimization (automatic_optimization = False) needs DDPStrategy "
                                         "(Trainer(strategy='ddp'))")
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            raise UnsupportedCombination("DistkitStrategy with precision='16-mixed' (a GradScaler steps the optimizer "
                                         "itself): use precision='bf16-mixed' or '32-true', or DDPStrategy")
        if self.dk is None:
            self.dk = _join(self)

    def setup(self, trainer: Any) -> None:
        """Collective. Fitting: the optimizer from ``configure_optimizers``, then ``dk.setup`` (rank 0's state
        everywhere, the engine's wrapper or reducer, param mode's averager); Lightning steps its schedulers itself.
        Validating/testing: the model set up by an earlier ``fit``, or rank 0's weights broadcast."""
        assert self.accelerator is not None and self.dk is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            if self._wrapped is not None:
                raise UsageError("DistkitStrategy: a second fit on the same strategy (one model per distkit Session): "
                                 "make a new Trainer with a new DistkitStrategy for it")
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                error = UnsupportedCombination(f"DistkitStrategy steps one optimizer, configure_optimizers returned "
                                               f"{len(self.optimizers)}: use DDPStrategy (Trainer(strategy='ddp'))")
                error.agreed = True  # every rank raises it here
                raise error
            self.dk.set_accumulation(trainer.accumulate_grad_batches)
            self._wrapped, optimizer = self.dk.setup(self.lightning_module, self.optimizers[0])
            self.model, self.optimizers = self._wrapped, [optimizer]
        elif self._wrapped is None:
            module = self.lightning_module
            assert module is not None
            self.dk._strategy.broadcast_tensors([*module.parameters(), *module.buffers()])
        self.setup_precision_plugin()

    @property
    def _param_mode(self) -> bool:
        return self._cfg.distributed.reduce_type == "param"

    # -- the step --------------------------------------------------------------------------------------------------
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``dk.backward`` between Lightning's hooks (grad mode: collective; see :func:`_backward`)."""
        assert self.lightning_module is not None and self.dk is not None
        loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        _backward(self.dk, loss)
        return self.precision_plugin.post_backward(loss, self.lightning_module)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulation micro-steps: backward does not communicate (``dk.no_sync``)."""
        assert self.dk is not None
        with self.dk.no_sync():
            yield

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Collective: the closure, then ``dk.step()`` (through the precision plugin: autocast and hooks as usual)."""
        assert self.dk is not None
        return self.precision_plugin.optimizer_step(_SessionStep(self.dk), model=model or self.lightning_module,
                                                    closure=closure, **kwargs)

    def on_train_end(self) -> None:
        """Collective: ``dk.finish()``: param mode's final sync (every rank the average), grad mode rank 0's buffers."""
        if self.dk is not None and self._wrapped is not None:
            self.dk.finish()

    # -- collectives -----------------------------------------------------------------------------------------------
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        """Collective: ``tensor`` reduced over every rank (a copy); a non-tensor is returned as is."""
        return _reduce(self.dk, tensor, group, reduce_op)

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

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """param mode: restore after ``dk.setup``, whose broadcast would else overwrite the ranks' own replicas."""
        return self._param_mode

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Collective (Lightning calls it on every rank): rank 0 writes Lightning's file; in param mode after
        ``fit`` set up the Session, every rank also writes its replica, optimizer and averager state to
        ``FILE.distkit`` (``dk.save``), which :meth:`load_optimizer_state_dict` restores on resume."""
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self._param_mode and self.dk is not None and self._wrapped is not None:
            self.dk.save(str(filepath) + SIDECAR, {"model": self.dk.model, "optimizer": self.dk.optimizer})

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(str(filepath) + SIDECAR, ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self._resume_from = str(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Collective in param mode: Lightning's optimizer state (rank 0's), then this rank's own state from the
        sidecar, if the checkpoint has one."""
        super().load_optimizer_state_dict(checkpoint)
        side = (self._resume_from or "") + SIDECAR
        if self._param_mode and self.dk is not None and self._wrapped is not None and os.path.isdir(side):
            self.dk.load(side, {"model": self.dk.model, "optimizer": self.dk.optimizer})

    # -- the end ---------------------------------------------------------------------------------------------------
    def teardown(self) -> None:
        """After every fit/validate/test: the LightningModule unwrapped; the Session stays open for the next stage
        (it closes at exit, or with :meth:`close`)."""
        if self.lightning_module is not None:
            self.model = self.lightning_module
        super().teardown()

    def close(self) -> None:
        """Collective: leave the job now (``Session.close``); the strategy cannot run again afterwards."""
        if self.dk is not None:
            self.dk.close()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("distkit", cls, description="distkit's engines and modes (config: distkit's "
                                   "defaults; pass DistkitStrategy(source) for your own)")


if "distkit" not in StrategyRegistry:
    DistkitStrategy.register_strategies(StrategyRegistry)


from distkit.lightning_fabric import DistkitFabricStrategy  # noqa: E402,F401 (its module imports the helpers above)
