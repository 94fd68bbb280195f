"""A job's start-up and its bound.

Start-up lasts from launch until the ranks meet after their first optimizer step (``Session.step``): the ranks
import, join the engine, build and broadcast the model, pick a checkpoint, and rank 0 alone writes the run's first
files. On a loaded machine they drift apart by seconds there, legitimately, so every wait of that time is bounded
by ``distributed.startup_s()`` (``startup_timeout_s``; by default the larger of ``timeout_s`` and 60 s), and only
the waits of training by ``distributed.timeout_s``, which may be short to catch stalls fast (:func:`bound`).

``startup_guard``: a bound on an engine's own start-up (``MPI_Init``, ``hvd.init()``), for the MPI engines."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Iterator

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


#: the guard process of :func:`startup_guard`: waits for its stdin to close (the block finished, or the rank
#: died); after the timeout it prints the rank's line (the second one if the rank itself was stopped: state T in
#: /proc/PID/stat, after the parenthesised command name, now or in at least half of the samples taken every 0.2 s
#: while it waited: mpirun ending the job after another rank's guard fired sends SIGCONT first, and a stopped rank
#: woken so just before its own guard looked blamed another rank; seen beside two CPU hogs) and SIGKILLs the rank
_GUARD = """
import os, select, signal, sys, time
pid, timeout, line, stopped = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
def state():
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
end, samples, seen = time.monotonic() + timeout, 0, 0
while True:
    left = end - time.monotonic()
    if left <= 0:
        break
    if select.select([sys.stdin], [], [], min(0.2, left))[0]:
        sys.exit(0)
    samples, seen = samples + 1, seen + (state() in ("T", "t"))
was_stopped = state() in ("T", "t") or (samples > 0 and 2 * seen >= samples)
sys.stderr.write((stopped if was_stopped else line) + chr(10))
sys.stderr.flush()
os.kill(pid, signal.SIGKILL)
"""


@contextlib.contextmanager
def startup_guard(rank: int, timeout_s: float, what: str, hint: str = "") -> Iterator[None]:
    """Bound an engine's start-up (``MPI_Init``, ``hvd.init()``), which no timeout of the engine's own covers
    and which runs before distkit's heartbeat watchdog can start (the watchdog needs the engine to share
    its address): when the block has not finished after ``timeout_s`` seconds (``distributed.startup_s()``), this rank is named in one
    line and ended (SIGKILL); the launcher (mpirun, horovodrun) then ends the job. A rank stopped or
    missing at start-up would otherwise keep every other rank waiting forever. Not collective.

    The guard is a tiny separate process, not a thread: ``MPI_Init`` runs inside the import of mpi4py's
    extension module, which holds the GIL, so no Python thread of this process could run meanwhile."""
    line = (f"distkit: rank {rank}: {what} did not complete within {timeout_s:g} s (distributed.startup_timeout_s) "
            f"(another rank did not start, is stopped, hangs or died{hint}): ending this rank")
    # the guard is not stopped with its rank: a rank stopped during its start-up is named as the cause, not as
    # one that waited for another (its line and a waiting peer's race: whichever guard fires first ends the job)
    stopped = (f"distkit: rank {rank}: stopped (SIGSTOP, a debugger) during {what} for {timeout_s:g} s "
               "(distributed.startup_timeout_s): ending this rank")
    guard = subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), str(timeout_s), line, stopped],
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=sys.__stderr__ or sys.stderr)
    try:
        yield
    finally:
        assert guard.stdin is not None
        guard.stdin.close()  # done: the guard exits at once
        guard.wait()
