"""The mpi engine's gradient reducer (see :mod:`distkit.backends.mpi`): every ``param.grad`` a view into a
flat bucket, each bucket all-reduced with a non-blocking ``Iallreduce`` as soon as backward filled it.
Apart from the engine, as it knows nothing of start-up, launch or checkpoints: only the communicator
and the parameters."""
from __future__ import annotations

import contextlib
import time
from typing import Any, Optional, Protocol

import torch
from torch import nn


from .parts import drop_globally_unused, unused_parameters


class EngineView(Protocol):
    """What the reducer uses of the mpi engine (:class:`~distkit.backends.mpi.MPIStrategy` has it): the engine
    module imports this one, never the other way round."""

    MPI: Any  # mpi4py's MPI module
    comm: Any  # the job's communicator
    comm_bytes: int  # bytes this rank sent in collectives (the reducer adds its buckets')
    rank: int
    world_size: int

    @property
    def device(self) -> torch.device:
        """The model's device (buckets are staged on the host for MPI)."""

    def group_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective over this rank's replica group."""

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """Time spent inside counts as blocked on communication."""

    def watch(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Blocking MPI calls inside end the job after the bound in force, naming ``what``."""


#: size cap of the first gradient bucket (torch DDP's _DEFAULT_FIRST_BUCKET_BYTES)
FIRST_BUCKET_BYTES = 2 ** 20
#: longest sleep between two tests of outstanding requests while waiting (seconds): Open MPI's own
#: Wait spins on a core, which on a shared machine takes CPU from the ranks that compute
WAIT_BACKOFF_MAX_S = 5e-4


def wait_all(MPI: Any, requests: list[Any]) -> None:
    """Wait for ``requests`` without spinning: test, then sleep 10 us doubling up to
    :data:`WAIT_BACKOFF_MAX_S` (the GIL is released while sleeping). Adds at most that much latency."""
    delay = 1e-5
    while requests and not MPI.Request.Testall(requests):
        time.sleep(delay)
        delay = min(delay * 2, WAIT_BACKOFF_MAX_S)


def _np(t: torch.Tensor) -> Any:
    """A numpy view of a contiguous CPU tensor (shares memory: MPI reads and writes the tensor)."""
    return t.detach().reshape(-1).numpy()


class _Bucket:
    """Gradients of a few parameters laid out in one flat buffer."""

    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        # CUDA tensors need a host copy (a CUDA-aware MPI is not assumed); on CPU there is none.
        self.host = self.flat if device.type == "cpu" else torch.zeros_like(self.flat, device="cpu").pin_memory()
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready = 0
        self.request: Any = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class GradReducer:
    """Mean (or sum) of gradients over ranks, all-reduced bucket by bucket during backward.

    Cross-rank contract: every rank registers the same parameters in the same order and
    runs backward over the same parameters each step (gradients never produced are
    all-reduced as zeros in :meth:`finish`). Memory: the buckets are the gradients (no
    second copy); the optimizer must not replace ``param.grad`` (no torch optimizer does).

    Args:
        strategy: the MPI strategy (communicator, world size, byte count).
        params: parameters that require grad, in registration order.
        bucket_cap_mb: bucket size in MiB; a parameter larger than that gets a bucket of its own.
        average: divide the sum by the number of ranks reduced over.
        comm, size: the communicator to reduce over and its size (the strategy's, every rank; a replica
            group's with replica groups).
    """

    def __init__(self, strategy: EngineView, params: list[nn.Parameter], bucket_cap_mb: float, average: bool,
                 names: Optional[list[str]] = None, find_unused: bool = False, comm: Any = None,
                 size: Optional[int] = None) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.s, self.average = strategy, average
        self.comm = comm if comm is not None else strategy.comm
        self.size = size if size is not None else strategy.world_size
        self.enabled = True  # False inside no_sync(): hooks then only accumulate
        self.params = params
        self.names = names or [f"parameter {i}" for i in range(len(params))]
        #: DDP's find_unused_parameters: a parameter no rank used in a step keeps ``grad = None`` (so the
        #: optimizer skips it: no weight decay, no momentum), as DDP leaves it; without it a parameter
        #: that got no gradient is an error, as under DDP (which fails one step later)
        self.find_unused = find_unused
        self._seen: set[int] = set()  # ids of the parameters whose gradient arrived in this round
        cap = bucket_cap_mb * 2 ** 20
        self.buckets: list[_Bucket] = []
        group: list[nn.Parameter] = []
        for p in reversed(params):
            # As DDP: the first bucket (the last layers, ready first) is at most 1 MiB, so its all-reduce
            # starts early in backward even when the whole model would fit into one bucket_cap_mb bucket.
            limit = min(cap, FIRST_BUCKET_BYTES) if not self.buckets else cap
            if group and (p.dtype != group[0].dtype or
                          sum(q.numel() * q.element_size() for q in group) + p.numel() * p.element_size() > limit):
                self.buckets.append(_Bucket(group, strategy.device))
                group = []
            group.append(p)
        if group:
            self.buckets.append(_Bucket(group, strategy.device))
        self._where = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # index of the next bucket to start (buckets start in order on every rank)
        self.reduced = False  # finish() ran since the last zero()
        self._had_grad: dict[int, bool] = {}  # per parameter: it had a reduced gradient from an earlier round
        self.attach()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    def attach(self) -> None:
        """Make each ``param.grad`` the view of its bucket (accumulation then writes into the bucket)."""
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                if p.grad is not v:
                    if p.grad is not None:
                        v.copy_(p.grad)
                    p.grad = v

    def _hook(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        self._seen.add(id(p))
        b = self._where[id(p)]
        b.ready += 1
        if b.ready == len(b.params):
            if 0 < self._next and self.size > 1:
                # Open MPI has no progress thread: a started Iallreduce only advances inside MPI calls.
                # One non-blocking Testall per bucket filled (not per gradient: that cost 8.5 % CPU per
                # step on a shared machine) lets the buckets already sent progress during backward.
                self.s.MPI.Request.Testall([b.request for b in self.buckets[:self._next] if b.request is not None])
            # Start every bucket that is full, in order; a later full bucket waits for earlier ones.
            while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
                self._start(self.buckets[self._next])
                self._next += 1

    def _start(self, b: _Bucket) -> None:
        if b.host is not b.flat:
            b.host.copy_(b.flat)
        if self.size > 1:
            b.request = self.comm.Iallreduce(self.s.MPI.IN_PLACE, _np(b.host), op=self.s.MPI.SUM)
            self.s.comm_bytes += b.nbytes

    def finish(self) -> None:
        """Start what backward did not (unused parameters), wait for all, scale. Once per round
        (a backward outside no_sync); the engine calls it when that backward returns, so that
        ``param.grad`` holds the reduced gradient from then on, as under DDP (a plain
        ``torch.nn.utils.clip_grad_norm_`` then clips what every rank holds)."""
        if self.reduced:
            return
        if not self.find_unused:
            unused = [n for n, p in zip(self.names, self.params) if id(p) not in self._seen]
            if unused:
                raise unused_parameters(self.s.rank, unused)
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
            self._next += 1
        with self.s.watch("Iallreduce (gradient buckets)"), self.s.waiting():
            wait_all(self.s.MPI, [b.request for b in self.buckets if b.request is not None])
        for b in self.buckets:
            b.request = None
            if b.host is not b.flat:
                b.flat.copy_(b.host)
            if self.average and self.size > 1:
                b.flat.div_(self.size)
        if self.find_unused:  # (attach() makes a dropped gradient a bucket view again before the next backward)
            drop_globally_unused(self.s, self.params, self._seen, self._had_grad, self.s.group_all_reduce)
        self.reduced = True

    @property
    def started(self) -> bool:
        """A round is in flight or reduced: a further backward before the step must begin a new round."""
        return self._next > 0 or self.reduced

    def new_round(self) -> None:
        """A second backward before the step (outside no_sync): finish the round in flight, then count
        again over the reduced gradients. The next round all-reduces ``mean(g1) + g2_r``, so the result is
        ``mean(g1) + mean(g2)``: what DDP gives for two backward passes without ``no_sync``."""
        self.finish()
        self._had_grad = {id(p): p.grad is not None for p in self.params}
        self._next, self.reduced = 0, False
        self._seen = set()
        for b in self.buckets:
            b.ready = 0

    def zero(self) -> None:
        """zero_grad for the next step: the gradients stay bucket views."""
        self._next, self.reduced = 0, False
        self._seen = set()
        self._had_grad = {}
        for b in self.buckets:
            b.flat.zero_()
            b.ready = 0
        self.attach()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
