"""A job's start-up and its bound.

Start-up lasts from launch until the ranks meet after their first optimizer step (``Session.step``): the ranks
import, join the engine, build and broadcast the model, pick a checkpoint, and rank 0 alone writes the run's first
files. On a loaded machine they drift apart by seconds there, legitimately, so every wait of that time is bounded
by ``distributed.startup_s()`` (``startup_timeout_s``; by default the larger of ``timeout_s`` and 60 s), and only
the waits of training by ``distributed.timeout_s``, which may be short to catch stalls fast (:func:`bound`).

``startup_guard``: a bound on an engine's own start-up (``MPI_Init``, ``hvd.init()``), for the MPI engines."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from distkit.health import faults
from distkit.launch import startup_watch

if TYPE_CHECKING:
    from distkit.config.schema import DistributedConfig

#: whether this process's job has ended its start-up (:func:`end`); one job per process, and a new Job starts
#: its own (:func:`begin`)
_ENDED = False


def begin() -> None:
    """A job starts (``Job.__init__``): its waits are start-up's again. Not collective."""
    global _ENDED
    _ENDED = False


def end() -> None:
    """The ranks met after the first optimizer step: from now on waits are bounded by ``timeout_s``. Not
    collective (each rank calls it after the meeting, ``Job._end_startup``)."""
    global _ENDED
    _ENDED = True


def ended() -> bool:
    """Whether start-up has ended (see the module's docstring)."""
    return _ENDED


def bound(d: "DistributedConfig") -> tuple[float, str]:
    """(seconds, config key) that bound a collective now: ``startup_s()`` and ``distributed.startup_timeout_s``
    during start-up, ``timeout_s`` and ``distributed.timeout_s`` after it."""
    if _ENDED:
        return float(d.timeout_s), "distributed.timeout_s"
    return d.startup_s(), "distributed.startup_timeout_s"


def bound_text(d: "DistributedConfig") -> str:
    """``"distributed.timeout_s = 4 s"``, or during start-up ``"distributed.startup_timeout_s = 60 s (start-up)"``:
    what an error names as the bound it hit."""
    seconds, key = bound(d)
    return f"{key} = {seconds:g} s" + ("" if _ENDED else " (start-up, until the ranks' first optimizer step)")


@contextlib.contextmanager
def startup_guard(rank: int, timeout_s: float, what: str, hint: str = "") -> Iterator[None]:
    """Bound an engine's start-up (``MPI_Init``, ``hvd.init()``), which no timeout of the engine's own covers
    and which runs before distkit's heartbeat watchdog can start (the watchdog needs the engine to share
    its address): when the block has not finished after ``timeout_s`` seconds (``distributed.startup_s()``), the
    rank to blame is named in one line (this one, stopped; another of this host, stopped; else this one, which
    waited) and this rank is ended (SIGKILL); the launcher (mpirun, horovodrun) then ends the job. A rank stopped or
    missing at start-up would otherwise keep every other rank waiting forever. Not collective.

    The guard is a tiny separate process (:mod:`distkit.launch.startup_watch`), not a thread: ``MPI_Init`` runs
    inside the import of mpi4py's extension module, which holds the GIL, so no Python thread of this process could
    run meanwhile. Before it starts, the fault point ``start`` (:mod:`distkit.health.faults`): a rank stopped
    there is one stopped before its start-up, as one still importing torch."""
    faults.maybe_fire(rank, 0, "start")
    with startup_watch.guard(rank, timeout_s, what, hint):
        yield
