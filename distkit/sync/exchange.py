"""param mode's pseudo-gradient exchanges (``param_sync_compression``, ``param_sync_overlap``): at a sync each rank
sends its pseudo-gradient ``anchor - local`` (plus its error feedback) through
:class:`distkit.sync.compression.Exchange`, at once or in the background for ``overlap`` steps; the mean moves the
anchor (plainly, or as the outer optimizer's gradient) and each tensor becomes the new anchor plus the progress its
rank made meanwhile (the merge rule).

Collective: every rank of the averaging group starts, moves on and applies the same exchanges at the same steps, in
the same order (they depend only on the step count). Per rank: the error feedback and the payloads in flight (saved
in that rank's checkpoint file only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from distkit.sync.compression import Exchange
from distkit.sync.fragments import fragment_indices
from distkit.sync.outer import outer_update


@dataclass
class InFlight:
    """An exchange of param_sync_overlap in the background: its fragments (None: all), the tensors it averages,
    the step it started at, the local tensors then, and the exchange itself."""

    fragments: Optional[list[int]]
    params: list[int]
    start: int
    snapshot: list[torch.Tensor]
    exchange: Any
    #: where ``params``' elements lie in the exchange's mean, when not in its order (an exchange resumed from a
    #: checkpoint whose tensors were laid out otherwise: DeepSpeed's flat partitions before its per-parameter views)
    order: Optional[torch.Tensor] = None

    def state(self) -> dict[str, Any]:
        """For this rank's checkpoint file: enough to start the same collective again on resume."""
        e = self.exchange
        return {"fragments": self.fragments, "params": self.params, "start": self.start,
                "snapshot": [t.detach().clone() for t in self.snapshot], "codec": e.codec, "n": e.n,
                "rows": e.rows if e.phase == 1 else None, "mine": e.mine if e.phase == 2 else None,
                **({"order": self.order} if self.order is not None else {})}

    def result(self) -> torch.Tensor:
        """The exchange's mean, in ``params``' order."""
        mean = self.exchange.result()
        return mean if self.order is None else mean[self.order]

    @classmethod
    def resume(cls, strategy: Any, state: dict[str, Any]) -> "InFlight":
        """Collective: the exchange of :meth:`state`, started again at the phase it was in (every rank of the
        group resumes from the same step, so they start the same collectives in the same order)."""
        x = torch.zeros(state["n"])
        exchange = Exchange(strategy, x, state["codec"], rows=state["rows"], mine=state["mine"])
        return cls(state["fragments"], state["params"], state["start"], state["snapshot"], exchange,
                   state.get("order"))


class PseudoGradientExchanges:
    """The exchanges of :class:`~distkit.sync.averager.ParamAverager` (a base class of it): its methods work on the
    averager's tensors, anchor, outer optimizer, error feedback (``_error``), exchanges in flight (``_in_flight``)
    and counters."""

    if TYPE_CHECKING:  # the averager's own (ParamAverager.__init__ and methods), used here
        strategy: Any  # a distkit.sync.averager.Reducer (passed on to compression.Exchange, which takes any)
        tensors: list[torch.Tensor]
        fragment_tensors: list[list[int]]
        compression: str
        error_feedback: bool
        overlap: int
        steps: int
        wait_s: float
        _anchor: list[torch.Tensor]
        _outer: Optional[torch.optim.Optimizer]
        _error: Optional[list[torch.Tensor]]
        _in_flight: list[InFlight]

        def is_parameter(self, index: int) -> bool: ...
        def _average(self, index: list[int]) -> bool: ...
        def _synced(self, fragments: Optional[list[int]]) -> None: ...
        def _updated(self) -> None: ...

    def _average_buffers(self, fragments: Optional[list[int]]) -> list[int]:
        """Collective, for the pseudo-gradient exchanges (compressed, overlapped): average ``fragments``' floating
        buffers (None: all fragments) and the kept modules plainly, now (small, and no pseudo-gradient); return the
        indices of the parameter tensors this rank holds a part of, which the exchange then sends."""
        index = list(range(len(self.tensors))) if fragments is None else \
            fragment_indices(self.fragment_tensors, fragments)
        self._average([i for i in index if not self.is_parameter(i)])
        return [i for i in index if self.is_parameter(i) and self.tensors[i].numel() > 0]

    def _start(self, fragments: Optional[list[int]], at_once: bool = False) -> None:
        """Collective: start the exchange of ``fragments``' tensors (None: all): floating buffers averaged now
        (small), each rank's pseudo-gradient (``anchor - local``, plus its error feedback) sent in the
        background (:class:`distkit.sync.compression.Exchange`, fp32 unless compressed; with ``compression``, what
        crosses the link is its encoding, and error feedback keeps what it could not carry); the local tensors
        are remembered, to keep the progress made until the result is applied (:meth:`_apply`). ``at_once``:
        the caller applies it before the next step (the blocking compressed sync, the final sync), so there is
        no progress to keep."""
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
        self._in_flight.append(InFlight(fragments, params, self.steps, snapshot, exchange))
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

    def _apply(self, f: InFlight) -> None:
        """Collective: the exchange's mean pseudo-gradient moves the anchor (plainly, or as the outer optimizer's
        gradient) and each tensor becomes the new anchor plus the progress this rank made since the exchange
        started (the merge rule: no local step is lost; it goes into the next exchange's pseudo-gradient).
        Started ``at_once`` (no snapshot): each tensor becomes the new anchor."""
        t0 = time.perf_counter()
        mean = f.result()
        self.wait_s += time.perf_counter() - t0
        with torch.no_grad():
            offset = 0
            for k, i in enumerate(f.params):
                t, n = self.tensors[i], self.tensors[i].numel()
                g = mean[offset:offset + n].view_as(t).to(t.dtype)
                if self._outer is not None:
                    outer_update(self._outer, self._anchor[i], g)
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
