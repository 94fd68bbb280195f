"""Periodic parameter averaging ("param" mode), shared by every backend.

Contract (all ranks): every rank calls :meth:`ParamAverager.after_step` once per
optimizer step and :meth:`final_sync` once at the end; the decision to sync is the same
on every rank because it depends only on the step count, or, for the time-based rule, on
the *maximum* elapsed time over ranks (one 8-byte all-reduce per step), never on one
rank's own clock.

What is averaged: every parameter and every floating-point buffer (e.g. BatchNorm
running statistics). Integer buffers and optimizer state stay local (as in RETURNN and
torch's ``PeriodicModelAverager``): after a sync each rank's optimizer keeps its own
moments. Memory: one temporary flat copy of the averaged tensors per sync; with the outer
optimizer, one persistent copy of the parameters (the anchor) plus its momentum buffer.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from distkit.backends.base import Strategy


class ParamAverager:
    """Average ``tensors`` over ranks every ``sync_step`` steps or every ``sync_time_diff`` seconds.

    Args:
        strategy: provides ``average_parameters`` and ``all_reduce`` (collectives).
        tensors: the model's parameters and floating buffers, in a fixed order on every rank.
        sync_step: optimizer steps between syncs (>= 1). Ignored when ``sync_time_diff`` is set.
        sync_time_diff: seconds between syncs, or None.
        outer_optimizer: ``{"class": "nesterov", "lr": 0.7, "momentum": 0.9}`` (DiLoCo/SlowMo):
            the averaged update ``anchor - mean`` is applied to the anchor as a pseudo-gradient
            with Nesterov SGD instead of being taken as is. None = plain averaging.
    """

    def __init__(self, strategy: "Strategy", tensors: list[torch.Tensor], sync_step: int,
                 sync_time_diff: Optional[float] = None, outer_optimizer: Optional[dict[str, Any]] = None) -> None:
        if sync_step < 1:
            raise ValueError(f"sync_step must be >= 1, got {sync_step}")
        self.strategy = strategy
        self.tensors = tensors
        self.sync_step = sync_step
        self.sync_time_diff = sync_time_diff
        self.steps_since_sync = 0
        self.num_syncs = 0
        self.wait_s = 0.0  #: seconds spent in the averaging exchange (blocked on communication)
        self._last_sync = time.monotonic()
        self._outer: Optional[torch.optim.Optimizer] = None
        self._anchor: list[torch.Tensor] = []
        if outer_optimizer is not None:
            self._anchor = [t.detach().clone() for t in tensors]
            momentum = float(outer_optimizer.get("momentum", 0.9))
            # torch refuses nesterov without momentum; with momentum 0 both are plain SGD anyway.
            self._outer = torch.optim.SGD(self._anchor, lr=float(outer_optimizer.get("lr", 0.7)),
                                          momentum=momentum, nesterov=momentum > 0)

    def _due(self) -> bool:
        if self.sync_time_diff is None:
            return self.steps_since_sync >= self.sync_step
        elapsed = torch.tensor([time.monotonic() - self._last_sync], dtype=torch.float64)
        self.strategy.all_reduce(elapsed, op="max")
        return float(elapsed.item()) >= self.sync_time_diff

    def after_step(self) -> bool:
        """Collective. Count one optimizer step; sync if due. Returns whether it synced."""
        self.steps_since_sync += 1
        if not self._due():
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Collective: average now (and apply the outer optimizer if configured)."""
        t0 = time.perf_counter()
        self.strategy.average_parameters(self.tensors)
        self.wait_s += time.perf_counter() - t0  # the exchange, counted as waiting on communication
        if self._outer is not None:
            with torch.no_grad():
                for a, t in zip(self._anchor, self.tensors, strict=True):
                    a.grad = a - t  # pseudo-gradient: how far the average moved, negated
                self._outer.step()
                for a, t in zip(self._anchor, self.tensors, strict=True):
                    t.copy_(a)
        self.steps_since_sync = 0
        self.num_syncs += 1
        self._last_sync = time.monotonic()

    def final_sync(self) -> None:
        """Collective: sync unless the last step already did, so every rank ends with the same model."""
        if self.steps_since_sync > 0:
            self.sync()

    def restart(self) -> None:
        """Not collective: begin a new averaging period from the current tensors (after weights were
        loaded from elsewhere, e.g. a checkpoint of another layout): no steps since a sync, the
        anchor set to the current tensors, the outer optimizer's momentum cleared."""
        self.steps_since_sync = 0
        self._last_sync = time.monotonic()
        if self._outer is not None:
            with torch.no_grad():
                for a, t in zip(self._anchor, self.tensors, strict=True):
                    a.copy_(t)
            self._outer.state.clear()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"steps_since_sync": self.steps_since_sync, "num_syncs": self.num_syncs}
        if self._outer is not None:
            state["anchor"] = [a.detach().clone() for a in self._anchor]
            state["outer"] = self._outer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_since_sync = int(state["steps_since_sync"])
        self.num_syncs = int(state["num_syncs"])
        if self._outer is not None and "anchor" in state:
            with torch.no_grad():
                for a, v in zip(self._anchor, state["anchor"], strict=True):
                    a.copy_(v)
            self._outer.load_state_dict(state["outer"])
        self._last_sync = time.monotonic()
