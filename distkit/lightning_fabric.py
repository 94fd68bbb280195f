"""distkit under Lightning Fabric: ``Fabric(strategy=DistkitFabricStrategy(...))`` (imported from :mod:`distkit.lightning`).

A class of its own, not :class:`~distkit.lightning.DistkitStrategy` registered as a virtual Fabric strategy: the two
Lightning base classes share method names with other signatures and meanings (``backward(loss, optimizer)`` against
``backward(tensor, module)``, ``optimizer_step(optimizer, closure)`` against ``optimizer_step(optimizer)``,
``save_checkpoint(checkpoint, path)`` against ``save_checkpoint(path, state)``, ``precision_plugin`` against
``precision``), so one object would have to guess its frontend in every one of them. The config, launch, ranks and
collectives are the same code (:mod:`distkit.lightning`'s helpers).

    fabric = Fabric(strategy=DistkitFabricStrategy(args), accelerator="cpu", devices=2)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)   # dk.setup: the engine's wrapper, param mode's averager
    fabric.backward(loss)                               # dk.backward
    optimizer.step()                                    # dk.step: step, zero_grad, averaging when due
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl

from distkit.config.arguments import Source
from distkit.errors import UnsupportedCombination, UsageError
from distkit.lightning import (
    SIDECAR, _FixedEnvironment, _SessionStep, _backward, _check_launcher, _devices, _gather, _join, _reduce,
    _resolve, _set_ranks,
)
from distkit.session import Session


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: accumulation micro-steps without communication (``dk.no_sync``)."""

    def __init__(self, strategy: "DistkitFabricStrategy") -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        dk = self._strategy.dk
        return dk.no_sync() if enabled and dk is not None else contextlib.nullcontext()


class DistkitFabricStrategy(ParallelStrategy):
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

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _set_world_ranks(self) -> None:
        _set_ranks(self)

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        _check_launcher(self)
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

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
        return wrapped, [optimizer], scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Collective: a module without an optimizer (evaluation): rank 0's weights everywhere."""
        if self.dk is None:
            raise UsageError("fabric.setup() before fabric.launch(): call fabric.launch() first")
        self.dk._strategy.broadcast_tensors([*module.parameters(), *module.buffers()])
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

    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
        return _gather(self.dk, tensor, sync_grads)

    def barrier(self, name: Optional[str] = None) -> None:
        if self.dk is not None:
            self.dk.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.dk.broadcast_object(obj, src) if self.dk is not None else obj

    def _param_state(self) -> Optional[dict[str, Any]]:
        dk = self.dk
        if dk is None or dk.cfg.distributed.reduce_type != "param" or dk._model is None:
            return None
        return {"model": dk.model, "optimizer": dk.optimizer}

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Any]] = None) -> None:
        """Collective (``fabric.save``): rank 0 writes Fabric's file; in param mode every rank also writes its own
        replica, optimizer and averager state to ``PATH.distkit``, which :meth:`load_checkpoint` restores."""
        super().save_checkpoint(path, state, storage_options, filter)
        own = self._param_state()
        if own is not None:
            self.dk.save(str(path) + SIDECAR, own)  # type: ignore[union-attr]

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Collective in param mode: Fabric's load (rank 0's state), then this rank's own state if saved."""
        rest = super().load_checkpoint(path, state, strict, weights_only)
        own, side = self._param_state(), str(path) + SIDECAR
        if own is not None and isinstance(state, dict) and os.path.isdir(side):
            self.dk.load(side, own)  # type: ignore[union-attr]
        return rest

    def close(self) -> None:
        """Collective: leave the job now (``Session.close``)."""
        if self.dk is not None:
            self.dk.close()
