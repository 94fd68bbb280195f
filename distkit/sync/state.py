"""What param mode's averager keeps in a checkpoint: its counters and, per rank, its anchor, outer optimizer state,
error feedback and exchanges in flight (:meth:`AveragerState.state_dict`, in that rank's file); and the portable part,
by the model's tensor names, that any engine and world size can continue from (:meth:`AveragerState.portable_state`).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from distkit.sync.exchange import InFlight


class AveragerState:
    """The checkpoint state of :class:`~distkit.sync.averager.ParamAverager` (a base class of it): its methods work
    on the averager's counters, anchor, outer optimizer, error feedback and exchanges in flight. Engines whose
    tensors are not the whole parameters (shards, ZeRO's masters) override :meth:`_by_name` and :meth:`_from_name`."""

    if TYPE_CHECKING:  # the averager's own (ParamAverager.__init__ and methods), used here
        strategy: Any  # a distkit.sync.averager.Reducer, passed on to the exchanges it resumes
        names: Optional[list[str]]
        sync_step: int
        fragments: int
        steps_since_sync: int
        num_syncs: int
        run_sync_bytes: int
        steps: int
        fragment_since: list[int]
        _next_fragment: int
        _last_sync: float
        error_feedback: bool
        overlap: int
        _anchor: list[torch.Tensor]
        _outer: Optional[torch.optim.Optimizer]
        _error: Optional[list[torch.Tensor]]
        _in_flight: list[InFlight]

        def restart(self) -> None: ...

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
        # this rank's bytes sent in syncs since the run started (rank file only: they are per rank, and another
        # layout sends other bytes per sync)
        state: dict[str, Any] = {**self._counters(), "sync_bytes": self.run_sync_bytes}
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
        self.run_sync_bytes = int(state.get("sync_bytes", 0))  # (a checkpoint from before the count: from 0)
        if self._anchor and "anchor" in state:
            with torch.no_grad():
                for a, v in zip(self._anchor, state["anchor"], strict=True):
                    a.copy_(v)
        if self._outer is not None and "outer" in state:
            self._outer.load_state_dict(state["outer"])
        self._error = [e.clone() for e in state["error"]] if self.error_feedback and state.get("error") else None
        self._in_flight = [InFlight.resume(self.strategy, f) for f in state.get("in_flight", [])] if self.overlap else []
        self._last_sync = time.monotonic()
