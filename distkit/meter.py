"""What a rank's steps cost, as :meth:`distkit.Session.summary` reports it: training samples, compute time
and the time blocked on the training collectives (``compute_fraction`` excludes that wait).

A step's compute time runs from the fetch of its first micro-batch (a :meth:`~distkit.Session.dataloader`
batch that a backward then used; batches of an evaluation loader count for nothing) to the end of its
optimizer step, less the time blocked on communication: what the engine reports as blocked
(``Strategy.blocked_s``: the mpi engine's and Horovod's gradient waits, param mode's averaging) plus,
on engines that wait for their all-reduce inside backward (DDP, DeepSpeed), the time from the last
gradient computed to backward's return. All times: this process's ``time.perf_counter``, seconds."""
from __future__ import annotations

import time
from typing import Optional

import torch


class StepMeter:
    """The counters of one rank. Not collective; the Session calls it around backward and step."""

    def __init__(self) -> None:
        #: seconds spent computing steps (see the module docstring), and blocked on training collectives
        self.compute_time_s = 0.0
        self.comm_wait_s = 0.0
        self._pending_samples = 0  # local samples of this step's micro-batches (those a backward used)
        self._last_batch: Optional[tuple[int, float]] = None  # (samples, fetch start) of the newest batch
        self._t_batch: Optional[float] = None  # when fetching this step's first micro-batch began
        self._step_wait_s = 0.0  # of the step in progress
        self._t_grad_ready: Optional[float] = None  # when the newest gradient was accumulated

    def batch_handed_out(self, n: int, t_fetch: float) -> None:
        """A loader handed out a batch of ``n`` local samples whose fetch began at ``t_fetch``. Counted only
        when a backward uses it."""
        self._last_batch = (n, t_fetch)

    def gradient_ready(self, _param: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (a post-accumulate-grad hook)."""
        self._t_grad_ready = time.perf_counter()

    def backward_begins(self) -> None:
        """A backward pass uses the newest batch handed out: its samples count for this step."""
        n, t_fetch = self._last_batch if self._last_batch is not None else (0, time.perf_counter())
        self._last_batch = None
        self._pending_samples += n
        if self._t_batch is None:
            self._t_batch = t_fetch
        self._t_grad_ready = None

    def backward_ended(self, engine_wait_s: float) -> None:
        """Backward returned, after ``engine_wait_s`` seconds the engine reported as blocked inside it."""
        self._step_wait_s += engine_wait_s  # engines that wait for their reduction in backward
        if self._t_grad_ready is not None:
            # The engine waited for its all-reduce inside backward: from the last gradient computed to
            # the return is waiting on communication (DDP's reducer finalising its buckets).
            self._step_wait_s += max(0.0, time.perf_counter() - self._t_grad_ready)

    def step_ended(self, engine_wait_s: float) -> int:
        """The optimizer step ended, after ``engine_wait_s`` seconds blocked inside it; returns this step's
        local training samples."""
        samples, self._pending_samples = self._pending_samples, 0
        self._step_wait_s += engine_wait_s
        if self._t_batch is not None:
            self.compute_time_s += time.perf_counter() - self._t_batch - self._step_wait_s
            self._t_batch = None
        self.comm_wait_s += self._step_wait_s
        self._step_wait_s = 0.0
        return samples
