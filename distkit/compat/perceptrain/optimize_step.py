"""perceptrain's ``optimize_step`` (same signature, closure-based), on distkit's Session.

``from distkit.compat.perceptrain.optimize_step import optimize_step`` replaces
``from perceptrain.optimize_step import optimize_step``. Inside
:meth:`distkit.compat.perceptrain.Trainer.fit` the ``optimizer`` it receives is a
:class:`DistkitOptimizer`: ``optimizer.step(closure)`` runs the step the engine's way
(``dk.step()``: DDP / mpi / Horovod gradient reduction, DeepSpeed's engine step,
param-mode averaging), and ``backward`` inside the closure goes through ``dk.backward``.

Closure optimizers (``torch.optim.LBFGS``) evaluate the closure several times per step. In grad
mode every evaluation all-reduces the gradients, and the value the closure returns to the
optimizer is the loss *averaged over ranks*: with identical parameters, gradients and loss
values every rank takes the same line-search path, so all ranks call the closure the same
number of times (a rank-local loss would let ranks diverge and hang in the next all-reduce).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.nn import Module

from distkit.errors import UnsupportedCombination

__all__ = ["DistkitOptimizer", "optimize_step"]


def _current_session() -> Any:
    from distkit.session import Session

    dk = Session.current
    return dk if dk is not None and getattr(dk, "_model", None) is not None else None


def _to(xs: Any, device: Optional[torch.device], dtype: Optional[torch.dtype]) -> Any:
    """``xs`` (tensor, tuple, list, dict) on ``device``; floating tensors cast to ``dtype``."""
    if isinstance(xs, torch.Tensor):
        if dtype is not None and xs.is_floating_point():
            return xs.to(device=device, dtype=dtype)
        return xs.to(device) if device is not None else xs
    if isinstance(xs, dict):
        return {k: _to(v, device, dtype) for k, v in xs.items()}
    if isinstance(xs, (list, tuple)):
        return type(xs)(_to(v, device, dtype) for v in xs) if not hasattr(xs, "_fields") else \
            type(xs)(*(_to(v, device, dtype) for v in xs))
    return xs


def needs_closure(optimizer: Any) -> bool:
    """True for optimizers that evaluate the closure more than once per step (LBFGS)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return isinstance(optimizer, torch.optim.LBFGS) or isinstance(inner, torch.optim.LBFGS)


class DistkitOptimizer:
    """The optimizer as ``optimize_step`` sees it inside ``Trainer.fit``: a proxy whose ``step(closure)``
    and ``zero_grad()`` take distkit's path; every other attribute is the real optimizer's
    (``param_groups``, ``state``, ``state_dict()``, ...).

    * ``step()`` without a closure (``loss.backward()`` already ran): ``dk.step()``.
    * ``step(closure)``, one-evaluation optimizers (SGD, Adam, ...): the closure once (forward and
      backward), then ``dk.step()``; returns the closure's value.
    * ``step(closure)``, LBFGS: ``dk.step()`` with the optimizer's own ``step(closure')``, where
      ``closure'`` runs the closure, waits for the reduced gradients and, in grad mode with several
      ranks, returns the loss averaged over ranks. Runs on ddp and mpi (grad and param mode) and
      horovod in param mode; elsewhere :class:`~distkit.errors.UnsupportedCombination`.
    """

    def __init__(self, dk: Any, optimizer: Any) -> None:
        self._dk, self._opt = dk, optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._opt, name)

    def __repr__(self) -> str:
        return f"DistkitOptimizer({self._opt!r})"

    @property
    def _engine(self) -> Any:
        return self._dk._strategy  # distkit-internal: the engine's gradient reducer (see docs/perceptrain.md)

    def zero_grad(self, set_to_none: bool = True) -> None:
        engine = self._engine
        if self._dk.backend == "deepspeed":
            return  # the engine zeroes its gradients in its step
        reducer = getattr(engine, "reducer", None)
        if reducer is not None:  # the mpi engine in grad mode: gradients are views of its buckets, keep them
            reducer.zero()
            return
        self._opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        dk = self._dk
        if closure is None:
            dk.step()
            return None
        if not needs_closure(self._opt):
            value = closure()
            dk.step()
            return value
        grad_mode = dk.cfg.distributed.reduce_type == "grad"
        if dk.backend == "deepspeed" or (dk.backend == "horovod" and grad_mode):
            raise UnsupportedCombination(
                f"{type(self._opt).__name__} (an optimizer that evaluates its closure several times per step) runs on "
                f"the ddp and mpi engines (and horovod in param mode), not on {dk.backend} in {dk.cfg.distributed.reduce_type} "
                "mode: use TrainConfig(backend='gloo') or backend='mpi', or a one-evaluation optimizer such as Adam")
        engine, model, real = self._engine, dk.model, self._opt

        def synced() -> float:
            value = closure()
            engine.wait_for_gradients(model, real)  # mpi engine: the buckets' all-reduce done and averaged
            value = float(value.detach() if isinstance(value, torch.Tensor) else value)
            if grad_mode and dk.world_size > 1:
                # Identical on every rank: so is LBFGS's line search, and with it the number of closure calls.
                value = float(dk.all_reduce(torch.tensor([value], dtype=torch.float64), op="mean")[0])
            return value

        own = real.__dict__.get("step")  # e.g. an LR scheduler's wrapper on the instance
        bound = own if own is not None else real.step
        result: dict[str, Any] = {}

        def step_with_closure(*_args: Any, **_kwargs: Any) -> Any:
            result["value"] = bound(synced)
            return result["value"]

        real.step = step_with_closure  # dk.step() calls optimizer.step(): with the closure this time
        try:
            dk.step()
        finally:
            if own is None:
                del real.step
            else:
                real.step = own
        return result.get("value")


def optimize_step(
    model: Module,
    optimizer: Any,
    loss_fn: Callable,
    xs: Any,
    device: Optional[torch.device] = None,
    dtype: Optional[torch.dtype] = None,
) -> tuple[Any, dict]:
    """perceptrain's default torch optimize step with a closure: ``loss, metrics = loss_fn(xs, model)``,
    backward, ``optimizer.step(closure)``. Returns the (last evaluated) loss and metrics.

    Inside :meth:`Trainer.fit` the backward is ``dk.backward(loss)`` and the step is distkit's
    (see :class:`DistkitOptimizer`); outside a distkit session it is plain PyTorch, as in perceptrain.
    """
    dk = _current_session()
    xs = _to(xs, device, dtype)
    loss: Any = None
    metrics: dict = {}

    def closure() -> Any:
        nonlocal loss, metrics
        optimizer.zero_grad()
        loss, metrics = loss_fn(xs, model)
        if dk is not None:
            dk.backward(loss)
        else:
            loss.backward(retain_graph=True)
        return loss.item()

    optimizer.step(closure)
    return loss, metrics
