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

Here: the schedule (when to sync) and the plain sync. Its parts: :mod:`.fragments` (the cut and the step rule),
:mod:`.outer` (the outer optimizer), :mod:`.exchange` (the pseudo-gradient exchanges: compressed, overlapped),
:mod:`.state` (checkpoints); :class:`Reducer`, the collectives they all call.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch import nn

from distkit.sync.exchange import InFlight, PseudoGradientExchanges
from distkit.sync.fragments import check_fragments, cut, due_by_step, fragment_indices, step_offsets
from distkit.sync.outer import outer_sgd, outer_step, outer_update
from distkit.sync.state import AveragerState


class Reducer(Protocol):
    """The collectives the sync code calls on its ``strategy`` (the averager's, and the compressed exchange's,
    :class:`distkit.sync.compression.Exchange`): the members of the engines' Strategy
    (:class:`distkit.backends.base.Strategy`) it uses, with their contracts, which Strategy satisfies as it is (an
    engine may pass another object that has them, e.g. an averager of its own that stands in for its strategy)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Collective: every rank must call it, in the same order. In place; op is sum|mean|max|min."""

    def average_parameters(self, params: list[torch.Tensor], is_param: Optional[list[bool]] = None) -> Optional[bool]:
        """Collective: every rank must call it, in the same order. Sets each tensor to its mean over ranks.
        ``is_param``: which of ``params`` are parameters rather than floating buffers, where they are views
        (fragments of param_sync_fragments); None = ``isinstance(t, nn.Parameter)``. Returns False where the mean
        was not applied (a fault-tolerant sync that did not commit: the tensors are as they were), else True or None.

        With replica groups the ranks of a group hold the same tensors, so the mean over ranks is the mean over
        groups: it is taken over this rank's cross group, one copy of the model per link instead of one per rank;
        the floating buffers, which differ inside a group, over the group's ranks and then across the groups."""

    def averaging_size(self) -> int:
        """How many copies of the parameters the averaging averages: the replica groups, else the ranks."""

    def start_all_to_all(self, rows: torch.Tensor) -> Any:
        """Collective over the ranks the parameters are averaged over (this rank's cross group with replica
        groups, else every rank; :meth:`averaging_size` of them, in rank order): ``rows`` (p, m) uint8, row j for
        member j, started in the background: returns a handle whose ``wait()`` returns (p, m), row j the row
        member j sent to this rank (``param_sync_overlap``). Every rank starts and waits for its exchanges in the
        same order."""

    def start_all_gather(self, row: torch.Tensor) -> Any:
        """Collective over the same ranks as :meth:`start_all_to_all`: ``row`` (m,) uint8 from each, started in
        the background: returns a handle whose ``wait()`` returns (p, m), row j member j's. Every rank starts and
        waits for its exchanges in the same order."""


def flat_mean(tensors: list[torch.Tensor], mean: Callable[[torch.Tensor], Any],
              dtype: Optional[torch.dtype] = None) -> None:
    """Set each of ``tensors`` to ``mean`` of it, with one call on all of them concatenated (``mean`` is a
    collective that averages a flat tensor in place, e.g. an all-reduce over ranks), in ``dtype`` (default:
    the tensors' own) and copied back into each tensor's dtype. Costs one copy of their total size."""
    if not tensors:
        return
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1) if dtype is None else t.detach().reshape(-1).to(dtype) for t in tensors])
        mean(flat)
        unflatten_into(flat, tensors)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` (``tensors`` concatenated, as :func:`flat_mean` builds it) back into each tensor, in its dtype."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one flat float32 copy."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


class ParamAverager(PseudoGradientExchanges, AveragerState):
    """Average ``tensors`` over ranks every ``sync_step`` steps or every ``sync_time_diff`` seconds.

    Args:
        strategy: the collectives (:class:`Reducer`): ``average_parameters`` and ``all_reduce``, and the compressed
            exchange's.
        tensors: the model's parameters and floating buffers, in a fixed order on every rank.
        sync_step: optimizer steps between syncs (>= 1). Ignored when ``sync_time_diff`` is set.
        sync_time_diff: seconds between syncs, or None.
        outer_optimizer: ``{"class": "nesterov", "lr": 0.7, "momentum": 0.9}`` (DiLoCo/SlowMo):
            the averaged update ``anchor - mean`` is applied to the anchor as a pseudo-gradient
            with Nesterov SGD instead of being taken as is. None = plain averaging.
        names: the model's name for each of ``tensors`` (``state_dict`` keys), so that the averager's
            state can go into a checkpoint's portable part by name (:meth:`portable_state`).
        fragments: F >= 1 (Streaming DiLoCo): the tensors, in their fixed order, are cut into F contiguous
            runs of whole tensors of near-equal size (``fragment_sizes``); fragment i syncs at steps ``s`` with
            ``s >= i*H//F`` and ``(s - i*H//F) % H == 0`` (step rule), or the fragments sync in turn, one every
            ``sync_time_diff / F`` seconds (time rule). Each fragment still syncs every H steps; the bytes per
            sync event fall about F-fold. F = 1 is the whole model at once (today's code path, unchanged).
        fragment_sizes: per tensor, the size the cut goes by (default: its number of elements). An engine whose
            tensors are this rank's parts of the parameters (ZeRO's masters) passes the whole parameters'
            sizes, so that every engine and rank cuts the model at the same parameters.
    """

    def __init__(self, strategy: Reducer, tensors: list[torch.Tensor], sync_step: int,
                 sync_time_diff: Optional[float] = None, outer_optimizer: Optional[dict[str, Any]] = None,
                 names: Optional[list[str]] = None, fragments: int = 1,
                 fragment_sizes: Optional[list[int]] = None, compression: str = "none",
                 error_feedback: bool = True, overlap: int = 0) -> None:
        if sync_step < 1:
            raise ValueError(f"sync_step must be >= 1, got {sync_step}")
        check_fragments(fragments, sync_step, sync_time_diff, len(tensors))
        if names is not None and len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        self.strategy = strategy
        self.tensors = tensors
        self.names = names
        self.sync_step = sync_step
        self.sync_time_diff = sync_time_diff
        self.steps_since_sync = 0
        self.num_syncs = 0
        self.wait_s = 0.0  #: seconds spent in the averaging exchange (blocked on communication)
        #: bytes this rank handed to the syncs' collectives since this process started (the engine's ``comm_bytes``
        #: counted inside each sync: the codec's true encoded size, the floating buffers' fp32 and, with replica
        #: groups, every exchange a sync makes; not the time rule's 8-byte clock all-reduce), and the sync events
        #: (fragments due at one step: one event) since this process started: :attr:`bytes_per_sync`. Per rank,
        #: not saved in checkpoints (a resumed process counts from 0)
        self.sync_bytes = 0
        self.process_syncs = 0
        #: the same bytes since the run started: saved in this rank's checkpoint file (as ``sync_bytes``), so that a
        #: resumed run continues it (with :attr:`num_syncs`, the sync events since the run started: :meth:`metrics`,
        #: what distkit's Trainer writes into metrics.jsonl). It starts at 0 again where a checkpoint has no count
        #: (one from before it) or only its portable part is loaded (another engine or world size, which sends other
        #: bytes per sync)
        self.run_sync_bytes = 0
        #: whose ``comm_bytes`` counts them: the strategy given here (an engine's averager that then stands in for its
        #: strategy, as DeepSpeed's does, still sends through the engine's collectives, which count there)
        self._bytes_counter: Any = strategy
        self._last_sync = time.monotonic()
        self.fragments = fragments
        #: optimizer steps counted since the start (the fragment schedule's clock; saved in checkpoints)
        self.steps = 0
        #: per fragment: steps since it last synced
        self.fragment_since = [0] * fragments
        self._next_fragment = 0  # time rule: the fragment whose turn is next
        #: per fragment, the indices of its tensors
        self.fragment_tensors = cut(fragment_sizes or [t.numel() for t in tensors], fragments)
        #: tensors outside the model averaged plainly at every sync (modules given to ``dk.keep_in_sync``)
        self.extra: list[torch.Tensor] = []
        #: ... of which this rank holds a shard (a sharded copy's parameters): averaged as the model's parameters are
        self.extra_shards: list[torch.Tensor] = []
        self._outer: Optional[torch.optim.Optimizer] = None
        #: the model as of the last sync: what the pseudo-gradient ``anchor - local`` is taken from (the outer
        #: optimizer's parameters; with compression also without it). One copy of the averaged tensors.
        self._anchor: list[torch.Tensor] = []
        self.compression = compression
        self.error_feedback = error_feedback and compression != "none"
        #: per parameter tensor: what the last exchange could not send of this rank's pseudo-gradient (the codec's
        #: rounding), added to the next one (error feedback); None until the first compressed sync. Per rank.
        self._error: Optional[list[torch.Tensor]] = None
        #: param_sync_overlap: steps an exchange runs in the background before its result is applied
        self.overlap = overlap
        self._in_flight: list[InFlight] = []
        if outer_optimizer is not None or compression != "none" or overlap > 0:
            self._anchor = [t.detach().clone() for t in tensors]
        if outer_optimizer is not None:
            self._outer = outer_sgd(self._anchor, outer_optimizer)

    def _due(self) -> bool:
        if self.sync_time_diff is None:
            return self.steps_since_sync >= self.sync_step
        elapsed = torch.tensor([time.monotonic() - self._last_sync], dtype=torch.float64)
        self.strategy.all_reduce(elapsed, op="max")
        return float(elapsed.item()) >= self.sync_time_diff

    def after_step(self) -> bool:
        """Collective. Count one optimizer step; sync if due (with fragments: the fragments due). Returns whether
        it synced."""
        self.steps_since_sync += 1
        self.steps += 1
        if self.overlap > 0:
            self.fragment_since = [n + 1 for n in self.fragment_since]
            with self._counting():
                self._progress()
            due = self._due_fragments() if self.fragments > 1 else [0] if self._due() else []
            if due:
                with self._counting():
                    self._start(due if self.fragments > 1 else None)
            return bool(due)
        if self.fragments == 1:
            if not self._due():
                return False
            with self._counting():
                self.sync()
            return True
        self.fragment_since = [n + 1 for n in self.fragment_since]
        due = self._due_fragments()
        if due:
            with self._counting():
                self.sync(due)
        return bool(due)

    @property
    def bytes_per_sync(self) -> float:
        """Mean bytes this rank handed to the collectives per sync event since this process started (0.0 before
        the first). With overlap an exchange's second phase counts at the step it starts, after its sync event."""
        return self.sync_bytes / self.process_syncs if self.process_syncs else 0.0

    def metrics(self) -> dict[str, int]:
        """For a metrics record (distkit's Trainer, ``distkit plot``): ``sync_bytes`` and ``syncs``, this rank's
        bytes handed to the syncs' collectives and the sync events since the run started, a resume continuing them
        (:attr:`run_sync_bytes`, :attr:`num_syncs`). Not collective."""
        return {"sync_bytes": self.run_sync_bytes, "syncs": self.num_syncs}

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        """Add the bytes the engine counts (its strategy's ``comm_bytes``, where it keeps one) inside the block to
        :attr:`sync_bytes`."""
        before = int(getattr(self._bytes_counter, "comm_bytes", 0))
        try:
            yield
        finally:
            sent = int(getattr(self._bytes_counter, "comm_bytes", 0)) - before
            self.sync_bytes += sent
            self.run_sync_bytes += sent

    def fragment_offsets(self) -> list[int]:
        """Step rule: fragment i first syncs at step ``i*H//F``, then every H steps."""
        return step_offsets(self.sync_step, self.fragments)

    def _due_fragments(self) -> list[int]:
        if self.sync_time_diff is None:
            return due_by_step(self.steps, self.sync_step, self.fragments)
        elapsed = torch.tensor([time.monotonic() - self._last_sync], dtype=torch.float64)
        self.strategy.all_reduce(elapsed, op="max")  # the same decision on every rank
        return [self._next_fragment] if float(elapsed.item()) >= self.sync_time_diff / self.fragments else []

    def is_parameter(self, index: int) -> bool:
        """Whether ``self.tensors[index]`` is a parameter (averaged over replica groups' cross groups) rather than a
        floating buffer (averaged over every rank); engines whose tensors are not the parameters override it."""
        return isinstance(self.tensors[index], nn.Parameter)

    def sync(self, fragments: Optional[list[int]] = None) -> None:
        """Collective: average now (and apply the outer optimizer if configured); ``fragments``: only those
        fragments' tensors (every rank passes the same), None = the whole model."""
        if self.compression != "none":  # the background exchange, started and applied at once
            self._start(fragments if fragments is not None and self.fragments > 1 else None, at_once=True)
            self._apply(self._in_flight.pop())
            return
        if fragments is not None and self.fragments > 1:
            self._sync_fragments(fragments)
            return
        t0 = time.perf_counter()
        applied = self._average(list(range(len(self.tensors))))
        self.wait_s += time.perf_counter() - t0  # the exchange, counted as waiting on communication
        # a fault-tolerant sync that did not commit left every tensor as it was: no outer step either, so that every
        # group keeps its anchor and momentum (the same in all of them) and the next sync's pseudo-gradient holds the
        # whole period. (Stepped with its own local pseudo-gradient, each surviving group's anchor went its own way
        # and the groups never held one model again.)
        if self._outer is not None and applied:
            outer_step(self._outer, self._anchor, self.tensors, [self.is_parameter(i) for i in range(len(self.tensors))])
        self._synced(None)
        self._updated()

    def _sync_fragments(self, fragments: list[int]) -> None:
        """Collective: average ``fragments``' tensors in one exchange; with the outer optimizer, its Nesterov step
        on those parameters' anchors (torch SGD's own formula, with their momentum buffers), then each parameter set
        to its anchor (floating buffers keep their average)."""
        index = fragment_indices(self.fragment_tensors, fragments)
        tensors = [self.tensors[i] for i in index]
        t0 = time.perf_counter()
        self._average(index)
        self.wait_s += time.perf_counter() - t0
        if self._outer is not None:
            with torch.no_grad():
                for i, t in zip(index, tensors, strict=True):
                    if not self.is_parameter(i):  # a floating buffer keeps its average (outer.py)
                        self._anchor[i].copy_(t)
                        continue
                    # pseudo-gradient: how far the average moved, negated
                    outer_update(self._outer, self._anchor[i], self._anchor[i] - t)
                    self.tensors[i].copy_(self._anchor[i])
        self._synced(fragments)
        self._updated()

    def in_sync(self) -> bool:
        """Whether every rank holds the same averaged tensors now: the last sync covered every fragment and no
        exchange is in flight (the same answer on every rank: the schedule is)."""
        return self.steps_since_sync == 0 and not any(self.fragment_since) and not self._in_flight

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` (a module given to ``dk.keep_in_sync``: its floating parameters and buffers) at
        every sync from now on, with the model."""
        self.extra.extend(tensors)

    def _average(self, index: list[int]) -> bool:
        """Collective: average ``self.tensors[i]`` for ``i`` in ``index`` and the kept modules
        (``dk.keep_in_sync``) in one :meth:`Strategy.average_parameters` call. The kept modules go in as one
        float32 buffer: averaged over every rank, with replica groups over the group then across the groups, and
        under fault_tolerance across the groups in the same torchft exchange as the model (a second exchange would
        be a second quorum); their shards, where a kept module is sharded, as a second one averaged as the model's
        parameters (across the groups only: the ranks of a group hold different shards). They are averaged at
        every sync, whatever fragment is due. Returns whether the mean was applied (False: a fault-tolerant sync
        that did not commit, the tensors as they were)."""
        tensors = [self.tensors[i] for i in index]
        kinds = [self.is_parameter(i) for i in index]
        kept = [(into, kind) for into, kind in ((self.extra, False), (self.extra_shards, True)) if into]
        flats = [_flat(into) for into, _ in kept]
        tensors, kinds = [*tensors, *flats], [*kinds, *(kind for _, kind in kept)]
        applied = self.strategy.average_parameters(tensors, kinds) if tensors else True
        for flat, (into, _) in zip(flats, kept, strict=True):
            unflatten_into(flat, into)
        return applied is not False

    def _synced(self, fragments: Optional[list[int]]) -> None:
        """The counters after a sync of ``fragments`` (None: the whole model), or the start of its exchange."""
        for k in fragments if fragments is not None else range(self.fragments):
            self.fragment_since[k] = 0
        if fragments is not None:
            self._next_fragment = (max(fragments) + 1) % self.fragments
        self.steps_since_sync = 0
        self.num_syncs += 1
        self.process_syncs += 1
        self._last_sync = time.monotonic()

    def _updated(self) -> None:
        """The averaged tensors changed (a sync, or an overlapped exchange applied): engines whose model weights
        are copies of them (DeepSpeed's masters) rewrite the weights here."""

    def final_sync(self) -> None:
        """Collective: sync unless the last step already did, so every rank ends with the same model (with
        fragments: every fragment with steps since its last sync, in one exchange; with overlap, the exchanges
        in flight are applied first, then every fragment with local progress is synced without overlap)."""
        with self._counting():
            self._final_sync()

    def _final_sync(self) -> None:
        if self.overlap > 0:
            for f in self._in_flight:
                self._apply(f)
            self._in_flight = []
            stale = [k for k, n in enumerate(self.fragment_since) if n > 0]
            if stale:
                self._start(stale if self.fragments > 1 else None, at_once=True)
                self._apply(self._in_flight.pop())
            return
        if self.fragments > 1:
            stale = [k for k, n in enumerate(self.fragment_since) if n > 0]
            if stale:
                self.sync(stale)
            return
        if self.steps_since_sync > 0:
            self.sync()

    def restart(self) -> None:
        """Not collective: begin a new averaging period from the current tensors (after weights were
        loaded from elsewhere, e.g. a checkpoint of another layout): no steps since a sync, the
        anchor set to the current tensors, the outer optimizer's momentum cleared."""
        self.steps_since_sync = 0
        self.fragment_since = [0] * self.fragments
        self._last_sync = time.monotonic()
        self._error = None
        self._in_flight = []  # the weights came from elsewhere: an exchange of the old ones would undo them
        with torch.no_grad():
            for a, t in zip(self._anchor, self.tensors if self._anchor else [], strict=True):
                a.copy_(t)
        if self._outer is not None:
            self._outer.state.clear()
