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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from distkit.errors import ConfigError

if TYPE_CHECKING:
    from distkit.backends.base import Strategy


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


@dataclass
class _InFlight:
    """An exchange of param_sync_overlap in the background: its fragments (None: all), the tensors it averages,
    the step it started at, the local tensors then, and the exchange itself."""

    fragments: Optional[list[int]]
    params: list[int]
    start: int
    snapshot: list[torch.Tensor]
    exchange: Any

    def state(self) -> dict[str, Any]:
        """For this rank's checkpoint file: enough to start the same collective again on resume."""
        e = self.exchange
        return {"fragments": self.fragments, "params": self.params, "start": self.start,
                "snapshot": [t.detach().clone() for t in self.snapshot], "codec": e.codec, "n": e.n,
                "rows": e.rows if e.phase == 1 else None, "mine": e.mine if e.phase == 2 else None}

    @classmethod
    def resume(cls, strategy: Any, state: dict[str, Any]) -> "_InFlight":
        """Collective: the exchange of :meth:`state`, started again at the phase it was in (every rank of the
        group resumes from the same step, so they start the same collectives in the same order)."""
        from distkit.sync.compression import Exchange

        x = torch.zeros(state["n"])
        exchange = Exchange(strategy, x, state["codec"], rows=state["rows"], mine=state["mine"])
        return cls(state["fragments"], state["params"], state["start"], state["snapshot"], exchange)


def cut(sizes: list[int], parts: int) -> list[list[int]]:
    """``range(len(sizes))`` cut into ``parts`` contiguous, non-empty runs of near-equal total size: run k ends
    where the running total comes closest to ``(k+1)/parts`` of the whole (leaving an item for each run after
    it). The same on every rank: it depends only on the sizes, in their fixed order."""
    if not 1 <= parts <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} items into {parts} parts")
    total, n = sum(sizes), len(sizes)
    runs: list[list[int]] = []
    run: list[int] = []
    acc = 0  # the running total, times parts below (integers: the same cut on every machine)
    for i, size in enumerate(sizes):
        k = len(runs)
        if run and k < parts - 1:
            target = (k + 1) * total
            # close before item i: the items left are just enough for the runs left, or taking i would overshoot
            # the target by more than stopping here falls short of it
            if n - i == parts - 1 - k or (acc + size) * parts - target > target - acc * parts:
                runs.append(run)
                run = []
        run.append(i)
        acc += size
        k = len(runs)
        if k < parts - 1 and acc * parts >= (k + 1) * total and n - i - 1 >= parts - 1 - k:
            runs.append(run)
            run = []
    runs.append(run)
    return runs


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

    def __init__(self, strategy: "Strategy", tensors: list[torch.Tensor], sync_step: int,
                 sync_time_diff: Optional[float] = None, outer_optimizer: Optional[dict[str, Any]] = None,
                 names: Optional[list[str]] = None, fragments: int = 1,
                 fragment_sizes: Optional[list[int]] = None, compression: str = "none",
                 error_feedback: bool = True, overlap: int = 0) -> None:
        if sync_step < 1:
            raise ValueError(f"sync_step must be >= 1, got {sync_step}")
        if fragments < 1 or (sync_time_diff is None and fragments > sync_step):
            raise ValueError(f"fragments must be in 1..sync_step ({sync_step}), got {fragments}")
        if fragments > len(tensors):
            error = ConfigError(f"'distributed.param_sync_fragments' ({fragments}) is more than the {len(tensors)} "
                                f"tensors the model averages: set it to at most {len(tensors)}")
            error.agreed = True  # every rank finds it, at the same point: reported once
            raise error
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
        self._in_flight: list[_InFlight] = []
        if outer_optimizer is not None or compression != "none" or overlap > 0:
            self._anchor = [t.detach().clone() for t in tensors]
        if outer_optimizer is not None:
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
        """Collective. Count one optimizer step; sync if due (with fragments: the fragments due). Returns whether
        it synced."""
        self.steps_since_sync += 1
        self.steps += 1
        if self.overlap > 0:
            self.fragment_since = [n + 1 for n in self.fragment_since]
            self._progress()
            due = self._due_fragments() if self.fragments > 1 else [0] if self._due() else []
            if due:
                self._start(due if self.fragments > 1 else None)
            return bool(due)
        if self.fragments == 1:
            if not self._due():
                return False
            self.sync()
            return True
        self.fragment_since = [n + 1 for n in self.fragment_since]
        due = self._due_fragments()
        if due:
            self.sync(due)
        return bool(due)

    def fragment_offsets(self) -> list[int]:
        """Step rule: fragment i first syncs at step ``i*H//F``, then every H steps."""
        return [i * self.sync_step // self.fragments for i in range(self.fragments)]

    def _due_fragments(self) -> list[int]:
        if self.sync_time_diff is None:
            h = self.sync_step
            return [i for i, o in enumerate(self.fragment_offsets()) if self.steps >= max(o, 1) and (self.steps - o) % h == 0]
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
        self._average(list(range(len(self.tensors))))
        self.wait_s += time.perf_counter() - t0  # the exchange, counted as waiting on communication
        if self._outer is not None:
            with torch.no_grad():
                for a, t in zip(self._anchor, self.tensors, strict=True):
                    a.grad = a - t  # pseudo-gradient: how far the average moved, negated
                self._outer.step()
                for a, t in zip(self._anchor, self.tensors, strict=True):
                    t.copy_(a)
        self._synced(None)
        self._updated()

    def _sync_fragments(self, fragments: list[int]) -> None:
        """Collective: average ``fragments``' tensors in one exchange; with the outer optimizer, its Nesterov step
        on those tensors' anchors (torch SGD's own formula, with their momentum buffers)."""
        index = [i for k in fragments for i in self.fragment_tensors[k]]
        tensors = [self.tensors[i] for i in index]
        t0 = time.perf_counter()
        self._average(index)
        self.wait_s += time.perf_counter() - t0
        if self._outer is not None:
            with torch.no_grad():
                for i, t in zip(index, tensors, strict=True):
                    self._outer_step(i, self._anchor[i] - t)  # pseudo-gradient: how far the average moved, negated
        self._synced(fragments)
        self._updated()

    def _outer_step(self, i: int, g: torch.Tensor) -> None:
        """The outer optimizer's step on tensor ``i``'s anchor with pseudo-gradient ``g``, then the tensor set to
        the anchor."""
        self._outer_update(i, g)
        self.tensors[i].copy_(self._anchor[i])

    def _outer_update(self, i: int, g: torch.Tensor) -> None:
        """The outer optimizer's step on tensor ``i``'s anchor with pseudo-gradient ``g`` (torch SGD's own formula,
        with its momentum buffer)."""
        group = self._outer.param_groups[0]  # type: ignore[union-attr]
        lr, momentum = group["lr"], group["momentum"]
        a = self._anchor[i]
        state = self._outer.state[a]  # type: ignore[union-attr]
        if "momentum_buffer" not in state:  # torch's first step: the buffer is the gradient
            state["momentum_buffer"] = g.clone()
        else:
            state["momentum_buffer"].mul_(momentum).add_(g)
        buf = state["momentum_buffer"]
        a.add_(g.add(buf, alpha=momentum) if group["nesterov"] else buf, alpha=-lr)

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """Average ``tensors`` (a module given to ``dk.keep_in_sync``: its floating parameters and buffers) at
        every sync from now on, with the model."""
        self.extra.extend(tensors)

    def _average(self, index: list[int]) -> None:
        """Collective: average ``self.tensors[i]`` for ``i`` in ``index`` and the kept modules
        (``dk.keep_in_sync``) in one :meth:`Strategy.average_parameters` call. The kept modules go in as one
        float32 buffer: averaged over every rank, with replica groups over the group then across the groups, and
        under fault_tolerance across the groups in the same torchft exchange as the model (a second exchange would
        be a second quorum); their shards, where a kept module is sharded, as a second one averaged as the model's
        parameters (across the groups only: the ranks of a group hold different shards). They are averaged at
        every sync, whatever fragment is due."""
        tensors = [self.tensors[i] for i in index]
        kinds = [self.is_parameter(i) for i in index]
        kept = [(into, kind) for into, kind in ((self.extra, False), (self.extra_shards, True)) if into]
        flats = [_flat(into) for into, _ in kept]
        tensors, kinds = [*tensors, *flats], [*kinds, *(kind for _, kind in kept)]
        if tensors:
            self.strategy.average_parameters(tensors, kinds)
        for flat, (into, _) in zip(flats, kept, strict=True):
            unflatten_into(flat, into)

    def _synced(self, fragments: Optional[list[int]]) -> None:
        """The counters after a sync of ``fragments`` (None: the whole model), or the start of its exchange."""
        for k in fragments if fragments is not None else range(self.fragments):
            self.fragment_since[k] = 0
        if fragments is not None:
            self._next_fragment = (max(fragments) + 1) % self.fragments
        self.steps_since_sync = 0
        self.num_syncs += 1
        self._last_sync = time.monotonic()

    def _updated(self) -> None:
        """The averaged tensors changed (a sync, or an overlapped exchange applied): engines whose model weights
        are copies of them (DeepSpeed's masters) rewrite the weights here."""

    def _average_buffers(self, fragments: Optional[list[int]]) -> list[int]:
        """Collective, for the pseudo-gradient exchanges (compressed, overlapped): average ``fragments``' floating
        buffers (None: all fragments) and the kept modules plainly, now (small, and no pseudo-gradient); return the
        indices of the parameter tensors this rank holds a part of, which the exchange then sends."""
        index = list(range(len(self.tensors))) if fragments is None else \
            [i for k in fragments for i in self.fragment_tensors[k]]
        self._average([i for i in index if not self.is_parameter(i)])
        return [i for i in index if self.is_parameter(i) and self.tensors[i].numel() > 0]

    # -- param_sync_overlap: exchanges in the background ----------------------------------------------------
    def _start(self, fragments: Optional[list[int]], at_once: bool = False) -> None:
        """Collective: start the exchange of ``fragments``' tensors (None: all): floating buffers averaged now
        (small), each rank's pseudo-gradient (``anchor - local``, plus its error feedback) sent in the
        background (:class:`distkit.sync.compression.Exchange`, fp32 unless compressed; with ``compression``, what
        crosses the link is its encoding, and error feedback keeps what it could not carry); the local tensors
        are remembered, to keep the progress made until the result is applied (:meth:`_apply`). ``at_once``:
        the caller applies it before the next step (the blocking compressed sync, the final sync), so there is
        no progress to keep."""
        from distkit.sync.compression import Exchange

        t0 = time.perf_counter()
        params = self._average_buffers(fragments)
        with torch.no_grad():
            delta = self._delta(params)
            exchange = Exchange(self.strategy, delta, self.compression if self.compression != "none" else "fp32")
            self._keep_error(params, delta, exchange.sent)
            if self.overlap // 2 == 0:  # tau = 1 (or blocking): the all-to-all now, the all-gather next
                exchange.second()
        self.wait_s += time.perf_counter() - t0
        snapshot = [] if at_once else [self.tensors[i].detach().clone() for i in params]
        self._in_flight.append(_InFlight(fragments, params, self.steps, snapshot, exchange))
        self._synced(fragments)

    def _progress(self) -> None:
        """Collective: move the exchanges in flight on: the second phase starts ``tau // 2`` steps after the
        first, the result is applied ``tau`` steps after the start; the same steps on every rank."""
        for f in list(self._in_flight):
            age = self.steps - f.start
            if age >= self.overlap // 2 and f.exchange.phase == 1:
                t0 = time.perf_counter()
                f.exchange.second()
                self.wait_s += time.perf_counter() - t0
            if age >= self.overlap:
                self._in_flight.remove(f)
                self._apply(f)

    def _apply(self, f: "_InFlight") -> None:
        """Collective: the exchange's mean pseudo-gradient moves the anchor (plainly, or as the outer optimizer's
        gradient) and each tensor becomes the new anchor plus the progress this rank made since the exchange
        started (the merge rule: no local step is lost; it goes into the next exchange's pseudo-gradient).
        Started ``at_once`` (no snapshot): each tensor becomes the new anchor."""
        t0 = time.perf_counter()
        mean = f.exchange.result()
        self.wait_s += time.perf_counter() - t0
        with torch.no_grad():
            offset = 0
            for k, i in enumerate(f.params):
                t, n = self.tensors[i], self.tensors[i].numel()
                g = mean[offset:offset + n].view_as(t).to(t.dtype)
                if self._outer is not None:
                    self._outer_update(i, g)
                else:
                    self._anchor[i].sub_(g)
                t.copy_(self._anchor[i] + (t - f.snapshot[k]) if f.snapshot else self._anchor[i])
                offset += n
        self._updated()

    def _delta(self, params: list[int]) -> torch.Tensor:
        """This rank's pseudo-gradient of tensors ``params`` (flat fp32), plus what the codec held back last time."""
        delta = torch.cat([(self._anchor[i] - self.tensors[i]).reshape(-1).float() for i in params]) \
            if params else torch.zeros(0)
        if self.error_feedback:
            if self._error is None:
                self._error = [torch.zeros(t.numel(), dtype=torch.float32, device=t.device) for t in self.tensors]
            if params:
                delta += torch.cat([self._error[i] for i in params])
        return delta

    def _keep_error(self, params: list[int], delta: torch.Tensor, sent: torch.Tensor) -> None:
        """Error feedback: what of ``delta`` the others did not read (``sent`` is what they read)."""
        if not self.error_feedback:
            return
        offset = 0
        for i in params:
            n = self.tensors[i].numel()
            self._error[i] = delta[offset:offset + n] - sent[offset:offset + n]  # type: ignore[index]
            offset += n

    def final_sync(self) -> None:
        """Collective: sync unless the last step already did, so every rank ends with the same model (with
        fragments: every fragment with steps since its last sync, in one exchange; with overlap, the exchanges
        in flight are applied first, then every fragment with local progress is synced without overlap)."""
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

    def _counters(self) -> dict[str, Any]:
        return {"steps_since_sync": self.steps_since_sync, "num_syncs": self.num_syncs, "steps": self.steps,
                "fragment_since": list(self.fragment_since), "next_fragment": self._next_fragment}

    def _load_counters(self, counters: dict[str, Any]) -> None:
        self.steps_since_sync = int(counters["steps_since_sync"])
        self.num_syncs = int(counters["num_syncs"])
        # a checkpoint from before fragments: its clock from the syncs (exact for the step rule)
        self.steps = int(counters.get("steps", self.num_syncs * self.sync_step + self.steps_since_sync))
        since = counters.get("fragment_since")
        # another number of fragments (or none before): a new period for each, from here
        self.fragment_since = [int(n) for n in since] if since and len(since) == self.fragments else [0] * self.fragments
        self._next_fragment = int(counters.get("next_fragment", 0)) % self.fragments

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._counters()
        if self._anchor:
            state["anchor"] = [a.detach().clone() for a in self._anchor]
        if self._outer is not None:
            state["outer"] = self._outer.state_dict()
        if self._error is not None:  # this rank's own: in its rank file only
            state["error"] = [e.detach().clone() for e in self._error]
        if self._in_flight:  # this rank's payloads: a resume starts the same collectives again (rank file only)
            state["in_flight"] = [f.state() for f in self._in_flight]
        return state

    # -- the portable part of a checkpoint (by name: any engine, world size) ------------------------
    def portable_state(self, keep: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Collective where the tensors are sharded (ZeRO): ``(tensors, counters)`` for a checkpoint's
        portable part. ``tensors``: with the outer optimizer, ``anchor/<name>`` (the model as of the last
        sync, after the outer step) and ``momentum/<name>`` (its momentum buffer, once a sync made one),
        whole, on the CPU; the same on every rank (both change only at a sync, identically everywhere),
        so one rank writes them and the others pass ``keep=False`` (they take no copies; under ZeRO they
        still join the assembly). ``counters``: steps since the last sync, syncs so far, whether an
        outer optimizer ran."""
        counters = {**self._counters(), "outer": self._outer is not None}
        if not self._anchor:
            return {}, counters
        tensors = {f"anchor/{n}": t for n, t in self._by_name(self._anchor, keep).items()}
        if self._outer is None:
            return tensors, counters
        momentum = [self._outer.state.get(a, {}).get("momentum_buffer") for a in self._anchor]
        if all(m is not None for m in momentum):
            tensors.update({f"momentum/{n}": t for n, t in self._by_name(momentum, keep).items()})  # type: ignore[arg-type]
        return tensors, counters

    def load_portable_state(self, tensors: dict[str, torch.Tensor], counters: dict[str, Any]) -> None:
        """Collective where the tensors are sharded: continue from :meth:`portable_state`'s output, which
        any engine and world size may have written, after the model was loaded. The period continues
        (steps since the last sync); the anchor and momentum are restored when both sides use the outer
        optimizer, else the anchor is the loaded model (a new outer optimizer starts without momentum)."""
        self.restart()
        self._load_counters(counters)
        if not self._anchor or not any(k.startswith("anchor/") for k in tensors):
            return
        with torch.no_grad():
            self._from_name({k[len("anchor/"):]: v for k, v in tensors.items() if k.startswith("anchor/")}, self._anchor)
            momentum = {k[len("momentum/"):]: v for k, v in tensors.items() if k.startswith("momentum/")}
            if momentum and self._outer is not None:
                buffers = [torch.zeros_like(a) for a in self._anchor]
                self._from_name(momentum, buffers)
                for a, b in zip(self._anchor, buffers, strict=True):
                    self._outer.state[a]["momentum_buffer"] = b

    def _by_name(self, values: list[torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
        """``values`` (one per averaged tensor, the same shapes) by the model's names, whole, on the CPU
        (empty when not ``keep``)."""
        if self.names is None:
            raise NotImplementedError(f"{type(self).__name__} was built without tensor names")
        return {n: v.detach().cpu().clone() for n, v in zip(self.names, values, strict=True)} if keep else {}

    def _from_name(self, by_name: dict[str, torch.Tensor], into: list[torch.Tensor]) -> None:
        """The inverse of :meth:`_by_name`: copy ``by_name`` into ``into`` (one per averaged tensor)."""
        if self.names is None:
            raise NotImplementedError(f"{type(self).__name__} was built without tensor names")
        for n, t in zip(self.names, into, strict=True):
            t.copy_(by_name[n].to(t.device, t.dtype).view_as(t))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_counters(state)
        if self._anchor and "anchor" in state:
            with torch.no_grad():
                for a, v in zip(self._anchor, state["anchor"], strict=True):
                    a.copy_(v)
        if self._outer is not None and "outer" in state:
            self._outer.load_state_dict(state["outer"])
        self._error = [e.clone() for e in state["error"]] if self.error_feedback and state.get("error") else None
        self._in_flight = [_InFlight.resume(self.strategy, f) for f in state.get("in_flight", [])] if self.overlap else []
        self._last_sync = time.monotonic()


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one flat float32 copy."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])
