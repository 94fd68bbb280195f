"""The engine and the Session as :mod:`distkit.health` sees them: the members it uses, as protocols.

distkit.health sits below the engines (:mod:`distkit.backends`) and the Session (:mod:`distkit.session`), which
use it; it never imports them, not even for types. :class:`distkit.backends.base.Strategy` satisfies
:class:`StrategyLike` and :class:`distkit.session.Session` satisfies :class:`SessionLike` structurally (they do not
name these protocols). Each protocol lists exactly the members distkit.health uses, with the contract the original
documents: add a member here when a module of distkit.health starts using one.

Data members are read-only properties here (the engine's ``name`` and ``fixed_accumulation`` are class attributes,
the Session's topology is properties; each satisfies a read-only property), except the engine's collectives and
topology, :class:`distkit.env.Collectives`, which every part below the engines shares.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

from distkit.env import Collectives

if TYPE_CHECKING:
    import contextlib

    import torch
    from torch import nn


class StrategyLike(Collectives, Protocol):
    """The engine this rank joined (:class:`distkit.backends.base.Strategy`): its collectives and topology
    (:class:`distkit.env.Collectives`, which code below the engines shares) and the members below. Used by the watchdog
    (:func:`distkit.health.watchdog.start_watchdog`, :func:`distkit.health.store.connect_store`), the guards
    (:mod:`distkit.health.guards`) and preemption's check (:mod:`distkit.health.preemption`, through
    :attr:`SessionLike._strategy`). Topology is read-only after construction."""

    @property
    def name(self) -> str:
        """The engine's name (ddp, deepspeed, horovod, mpi): a class attribute, the same on every rank."""

    @property
    def fixed_accumulation(self) -> bool:
        """Whether the engine takes exactly ``accum_grad_multiple_step`` backward passes per optimizer step
        (DeepSpeed); elsewhere any number adds up as under DDP. A class attribute, the same on every rank."""

    def backend_impl(self) -> str:
        """What really runs, with versions, e.g. 'torch 2.13.0 DDP (gloo)'. Not collective."""

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "max") -> Any:
        """Collective, started in the background (op sum|max|min): a handle whose ``wait()`` returns the reduced
        tensor; every rank starts and waits for these in the same order, between its other collectives."""

    def end_job(self, code: int) -> None:
        """End this rank now, from any thread, and make the job end (never returns; ``MPI_Abort`` on the MPI
        engines, ``os._exit(code)`` elsewhere, which the launcher notices). Not collective."""


class SessionLike(Protocol):
    """This rank's open session (:class:`distkit.session.Session`): used by the guards (:mod:`distkit.health.guards`:
    the exception hook, the raw-clip guard) and preemption's check (:mod:`distkit.health.preemption`)."""

    @property
    def current(self) -> Optional[SessionLike]:
        """The session of this process, if any: a class attribute (read as ``type(session).current``), None once
        it closed. Per process."""

    @property
    def rank(self) -> int:
        """This rank's global rank (the engine's): each rank's own, fixed for the session."""

    @property
    def world_size(self) -> int:
        """The number of ranks in the job (the engine's): the same on every rank."""

    @property
    def backend(self) -> str:
        """The engine's name: ddp, deepspeed, horovod or mpi (the same on every rank)."""

    @property
    def _strategy(self) -> StrategyLike:
        """The engine this rank joined (made and initialised by the session; collective to make)."""

    def unwrap(self, model: Optional[nn.Module] = None) -> nn.Module:
        """The bare ``nn.Module`` inside the engine's wrapper (DDP, DeepSpeedEngine), the set-up model's by
        default; not collective."""

    def abort(self) -> None:
        """This rank failed: make sure no other rank waits for it (MPI engines end the job). Not collective;
        called from an ``except`` block. A later :meth:`close` then leaves without waiting for the others."""

    def close(self) -> None:
        """Leave the process group; idempotent. Collective after a normal run (the ranks leave together: a
        barrier, bounded by ``distributed.timeout_s``); after :meth:`abort` it leaves at once."""

    def _collective(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Not collective itself: around a collective every rank runs, names it ``what`` in a timeout (a
        :class:`~distkit.errors.CollectiveTimeout` instead of the engine's "timed out")."""
