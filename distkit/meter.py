"""What a rank's steps cost, as :meth:`distkit.Session.summary` reports it: training samples, compute time
and the time blocked on the training collectives (``compute_fraction`` excludes that wait).

A step's compute time runs from the fetch of its first micro-batch (a :meth:`~distkit.Session.dataloader`
batch that a backward then used; batches of an evaluation loader count for nothing) to the end of its
optimizer step, less the time blocked on communication: what the engine reports as blocked in that window
(``Strategy.blocked_s``: the mpi engine's and Horovod's gradient waits, param mode's averaging, the fsdp
engine's all-gathers in forward and backward and its reduce-scatters) plus,
on engines that wait for their all-reduce inside backward (DDP, DeepSpeed), the time from the last
gradient computed to backward's return. All times: this process's ``time.perf_counter``, seconds."""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch


class StepMeter:
    """The counters of one rank. Not collective; the Session calls it around backward and step."""

    def __init__(self, blocked: Callable[[], float] = lambda: 0.0) -> None:
        """``blocked()``: the engine's seconds blocked on training collectives so far (``Strategy.blocked_s``)."""
        self._blocked = blocked
        #: seconds spent computing steps (see the module docstring), and blocked on training collectives
        self.compute_time_s = 0.0
        self.comm_wait_s = 0.0
        self._pending_samples = 0  # local samples of this step's micro-batches (those a backward used)
        #: (samples, fetch start, blocked() at hand-out) of the newest batch
        self._last_batch: Optional[tuple[int, float, float]] = None
        self._blocked_start: Optional[float] = None  # blocked() when this step's first micro-batch was handed out
        self._t_batch: Optional[float] = None  # when fetching this step's first micro-batch began
        self._step_wait_s = 0.0  # of the step in progress
        self._t_grad_ready: Optional[float] = None  # when the newest gradient was accumulated

    def batch_handed_out(self, n: int, t_fetch: float) -> None:
        """A loader handed out a batch of ``n`` local samples whose fetch began at ``t_fetch``. Counted only
        when a backward uses it."""
        self._last_batch = (n, t_fetch, self._blocked())

    def gradient_ready(self, _param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (a post-accumulate-grad hook)."""
        self._t_grad_ready = time.perf_counter()

    def backward_begins(self) -> None:
        """A backward pass uses the newest batch handed out: its samples count for this step."""
        n, t_fetch, blocked = (self._last_batch if self._last_batch is not None else
                               (0, time.perf_counter(), self._blocked()))
        self._last_batch = None
        self._pending_samples += n
        if self._t_batch is None:
            self._t_batch, self._blocked_start = t_fetch, blocked
        self._t_grad_ready = None

    def backward_ended(self) -> None:
        """Backward returned."""
        if self._t_grad_ready is not None:
            # The engine waited for its all-reduce inside backward: from the last gradient computed to
            # the return is waiting on communication (DDP's reducer finalising its buckets).
            self._step_wait_s += max(0.0, time.perf_counter() - self._t_grad_ready)

    def step_ended(self, engine_wait_s: float) -> int:
        """The optimizer step ended, after ``engine_wait_s`` seconds blocked inside it; returns this step's
        local training samples. The step's wait is what the engine reported as blocked since its first
        micro-batch was handed out (forward, backward and step: FSDP2 gathers parameters in forward), or
        ``engine_wait_s`` where no backward began this step."""
        samples, self._pending_samples = self._pending_samples, 0
        if self._blocked_start is not None:
            self._step_wait_s += self._blocked() - self._blocked_start
            self._blocked_start = None
        else:
            self._step_wait_s += engine_wait_s
        if self._t_batch is not None:
            self.compute_time_s += time.perf_counter() - self._t_batch - self._step_wait_s
            self._t_batch = None
        self.comm_wait_s += self._step_wait_s
        self._step_wait_s = 0.0
        return samples
