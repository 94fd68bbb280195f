"""The Session's optimizer as the framework bridges (:mod:`distkit.lightning`, :mod:`distkit.hf`) hand it to Lightning
Fabric, Accelerate and ``transformers.Trainer``: one ``torch.optim.Optimizer`` whose ``step()`` is ``dk.step()``."""
from __future__ import annotations

from typing import Any

import torch

from distkit.errors import UnsupportedCombination


class SessionOptimizer(torch.optim.Optimizer):
    """The Session's optimizer as a framework steps it: ``step()`` is ``dk.step()`` (the optimizer's step, zero_grad,
    and in param mode the averaging when due: collective). An ``Optimizer`` (without its constructor, as
    Accelerate's own ``AcceleratedOptimizer``) so that Accelerate prepares it, an LR scheduler accepts it and
    Fabric can wrap it; the parameter groups, state and state dicts are the wrapped optimizer's (``inner``).

    Its methods call ``inner``'s explicitly: Fabric wraps an optimizer in a class made on the fly that derives from
    the optimizer's own class, and Horovod's ``DistributedOptimizer`` calls ``super(self.__class__, self)``, which
    under such a subclass recurses without end (``zero_grad``: RecursionError); this class stands between them."""

    def __init__(self, optimizer: torch.optim.Optimizer, dk: Any) -> None:  # noqa: D107 - no super().__init__ on purpose
        self.inner, self._dk = optimizer, dk

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.inner.defaults = defaults

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise UnsupportedCombination("DistkitTrainer: an optimizer step with a closure (LBFGS) is not supported: "
                                         "use a first-order optimizer")
        self._dk.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.inner.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"distkit({self.inner!r})"
