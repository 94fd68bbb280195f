"""distkit as a Lightning strategy: ``Trainer(strategy=DistkitStrategy(...))`` (``pip install 'distkit[lightning]'``).

One config key picks the engine (``distributed.backend``: ddp, mpi, horovod) and the mode (``distributed.reduce_type``:
"grad" = per-step gradient all-reduce, "param" = local steps and periodic parameter averaging, DiLoCo, fragments and
int8 included); the config comes the distkit way: a file, a dict, or the namespace of a parser given to
:func:`distkit.add_arguments` (``--config``, ``++key value``, ``--nprocs N``)::

    parser = argparse.ArgumentParser(); distkit.add_arguments(parser)
    trainer = Trainer(strategy=DistkitStrategy(parser.parse_args()), accelerator="cpu", devices=2)
    fabric = Fabric(strategy=DistkitStrategy(parser.parse_args()), accelerator="cpu", devices=2)

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

import argparse
import contextlib
import os
import shutil
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning.fabric.strategies import ParallelStrategy as FabricParallelStrategy
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn

from distkit.checkpoint.load import relink_given_optimizer
from distkit.config import RunConfig
from distkit.errors import UnsupportedCombination, UsageError
from distkit.integrations.lightning_fabric import (  # noqa: F401 (DistkitFabricStrategy: imported from here)
    REPLICAS_KEY, SIDECAR, DistkitFabricStrategy, _FixedEnvironment, _NoSync, _SessionStep, _Shared, _backward,
    _devices, _join, _reduce, _resolve, _set_ranks, load_sidecar, sync_metrics,
)
from distkit.session import Session


#: ``source`` as DistkitStrategy takes it (distkit.config.arguments.Source), its types in the order LightningCLI
#: should try them: jsonargparse takes the first that parses, and under Source's order the dict of
#: ``--trainer.strategy.source '{"seed": 3}'`` became an argparse.Namespace, read as add_arguments' (its keys ignored)
CLISource = Union[dict, str, Sequence[str], argparse.Namespace, RunConfig, None]


class DistkitStrategy(_Shared, ParallelStrategy):
    """A Lightning ``ParallelStrategy`` whose engine and mode come from distkit's config.

    ``source``: a config file path (or list), a dict (``{"distributed": {"backend": "mpi"}}``), an
    ``argparse.Namespace`` from :func:`distkit.add_arguments`, or a RunConfig; ``keys`` override it. Made under plain
    ``python`` with ``nprocs > 1`` (``--nprocs N``) this call does not return in the launching process: it starts the
    script again as N ranks, waits and exits with their status (as :func:`distkit.init`). LightningCLI:
    ``--trainer.strategy distkit.lightning.DistkitStrategy --trainer.strategy.source CONFIG`` (a file or a JSON dict),
    or ``--trainer.strategy distkit`` (the defaults) in a script that imported :mod:`distkit.lightning`.

    Cross-rank contract: every rank makes it with the same config; Lightning then calls the collectives
    (``setup_environment``, ``setup``, ``optimizer_step``, ``reduce``, ``barrier``, ``broadcast``, ``all_gather``,
    ``save_checkpoint``, ``on_train_end``) on every rank in the same order, as it does for ``DDPStrategy``.
    """

    def __init__(self, source: CLISource = None, **keys: Any) -> None:
        self._cfg, self._engine, env = _resolve(source, keys)
        super().__init__(parallel_devices=_devices(self._cfg, env), cluster_environment=_FixedEnvironment.of(env))
        self._num_nodes = 1
        self.dk: Optional[Session] = None
        self._wrapped: Optional[nn.Module] = None
        self._resume_from: Optional[str] = None
        self._resume_marked = False  # the checkpoint resumed from says every rank's own state is in its sidecar
        self._precision = None  # (read by Fabric's connector before it knows the frontend: see _set_world_ranks)

    # -- topology ------------------------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """True: Lightning then inserts the DistributedSampler and syncs ``self.log(..., sync_dist=True)``."""
        return True

    _LAUNCHER = _SubprocessScriptLauncher

    def set_world_ranks(self) -> None:
        """(Lightning's connector) DDPStrategy's rule under Lightning's own launcher; the launcher's ranks else."""
        _set_ranks(self)

    def _set_world_ranks(self) -> None:
        """``Fabric(strategy=DistkitStrategy(...))``: only Fabric's connector calls this name (the Trainer's calls
        :meth:`set_world_ranks`), after it has given the strategy its accelerator, precision and devices. From here
        on this object is a :class:`DistkitFabricStrategy` (the same config, ranks and devices; its methods have
        Fabric's signatures), so one strategy object serves both frontends without guessing which one calls."""
        precision = self.__dict__.pop("precision", None)  # set by Fabric's connector: Fabric's property holds it
        self.__class__ = DistkitFabricStrategy  # type: ignore[assignment]
        self._precision = precision
        self._backward_sync_control = _NoSync(self)  # type: ignore[arg-type]
        self._set_world_ranks()

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
        assert self.lightning_module is not None
        sync_metrics(self.lightning_module, self.dk)  # torchmetrics over the job's engine (mpi, Horovod)
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

    # Every step inside a forward of the set-up model, as DDPStrategy's run inside the DDP wrapper's forward: what
    # the engine hooks on that forward (the mpi, Horovod and DeepSpeed engines' buffer rule: rank 0's BatchNorm
    # statistics before the forward DDP would broadcast them before) then runs also when the step calls a submodule
    # (self.model(x), Lightning's imagenet template) rather than self(x). Outside a fit (validate, test or predict
    # on their own) the step is called as Lightning calls it: DDPStrategy has no wrapper there either.
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    def _step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and self.model is not None
        if self._wrapped is None or module.trainer.state.fn != TrainerFn.FITTING:
            return getattr(module, name)(*args, **kwargs)
        return self._forward_redirection(self.model, module, name, *args, **kwargs)

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
        """Collective: ``tensor`` reduced over every rank, in place as DDPStrategy's; a non-tensor is returned as is."""
        return _reduce(self.dk, tensor, group, reduce_op)

    def process_dataloader(self, dataloader: object) -> object:
        """(Lightning's data connector, each loader of a stage) Param mode: a ``DataLoader`` without a generator of
        its own gets one, seeded by the run's seed and this rank, for its base seed (its workers' seeds)."""
        if self._param_mode and isinstance(dataloader, DataLoader) and dataloader.generator is None:
            # Each DataLoader iterator draws its base seed from the generator it is given, by default the global
            # one that dropout draws from. A resumed fit makes another number of iterators before its first step
            # than the uninterrupted run made after the checkpoint (a file written at the end of validation: the
            # resumed fit iterates the train loader twice before its first batch, the run once), so the rank's
            # RNG state that the sidecar restored (dk.load) had moved by then (issue 57 D). Off the global
            # stream, it is the model's alone, as in distkit's own loop (distkit.data, issue 36). Grad mode keeps
            # DDPStrategy's stream: Lightning's checkpoints hold no RNG state there either.
            seed = int(os.environ.get("PL_GLOBAL_SEED", self._cfg.seed))  # seed_everything's, else distkit's
            dataloader.generator = torch.Generator().manual_seed(seed * 65_537 + self.global_rank + 1)
        return dataloader

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
        own = self._param_state()
        if own is not None:
            checkpoint[REPLICAS_KEY] = True  # a resume must find every rank's own state (load_sidecar)
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if own is not None:
            self.dk.save(str(filepath) + SIDECAR, own)  # type: ignore[union-attr]

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        if self.is_global_zero:
            shutil.rmtree(str(filepath) + SIDECAR, ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self._resume_from = str(checkpoint_path)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume_marked = bool(checkpoint.get(REPLICAS_KEY, False))
        return checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Collective in param mode: Lightning's optimizer state (rank 0's), then this rank's own state from the
        sidecar, if the checkpoint has one. Lightning's schedulers keep stepping the optimizer that steps."""
        super().load_optimizer_state_dict(checkpoint)
        assert self.dk is not None
        relink_given_optimizer(self.dk)  # (dk.load's own relink: Horovod's optimizer got new param groups)
        own = self._param_state()
        if own is not None:
            load_sidecar(self.dk, self._resume_from or "", own, self._resume_marked)

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
# Fabric accepts a strategy object that is one of its own (an isinstance check); DistkitStrategy becomes
# DistkitFabricStrategy when Fabric's connector sets its ranks (_set_world_ranks above)
FabricParallelStrategy.register(DistkitStrategy)

