"""The start-up guard (:func:`guard`): a bound on the start-up waits that nothing else can watch, in a process of its
own, this file run as a script.

An MPI engine's start-up (``MPI_Init``, ``hvd.init()``) waits for every rank with no timeout of its own, and holds
the GIL meanwhile, so no thread of the rank can watch it; nor can anything watch the first collectives after it,
which share the heartbeat store's address (:func:`distkit.health.store.connect_store`: Horovod's stall check waits
in MPI for a stopped rank too, and under mpirun such a job waited forever). This tiny process does (``python -I -S
THIS_FILE PID TIMEOUT RANK WHAT HINT``, started by the rank, its stdin a pipe from the rank). It waits for its stdin
to close (the block finished, or the rank died); after TIMEOUT seconds it names the rank to blame in one line and
ends the rank (SIGKILL), and the launcher (mpirun, horovodrun) then ends the job:

* the rank itself is stopped (SIGSTOP, a debugger): state T in ``/proc/PID/stat``, now or in at least half of the
  samples taken every 0.2 s while it waited (mpirun ending the job after another rank's guard fired sends SIGCONT
  first, and a stopped rank woken so just before its own guard looked blamed another rank; seen beside two CPU
  hogs): ``distkit: rank 1: stopped (SIGSTOP, a debugger) during ...``;
* another rank of the job on this host is stopped (:func:`end_for_stopped_peers`: a rank stopped before it reached
  its own guard, importing torch, has no guard to name it; before, only the waiting rank was named, as one that
  waited): ``distkit: rank 1 stopped responding during start-up: ... (noticed by rank 0; ...)``;
* else the rank waited for a peer that did not start, hangs, died or runs on another host: ``distkit: rank 0: ...
  did not complete within ...``.

Runs with ``-I -S`` (no site, no user paths: it starts in milliseconds beside every rank's start-up) and imports
nothing of distkit until it fires; then only :mod:`distkit.launch.procfs` and :mod:`distkit.launch.failures`, which
import no torch."""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

#: seconds between two looks at whether this rank is stopped while the guard waits
SAMPLE_S = 0.2
#: seconds to wait for a stopped peer that was SIGKILLed to be gone before this rank ends: the launcher then sees
#: the stopped rank end first (``horovodrun`` names the first rank that ended, mpirun the first it saw)
PEER_GONE_S = 2.0
#: seconds after the stopped peer is gone before this rank ends: the launcher's own look at its ranks (mpirun's;
#: horovodrun's, one thread per rank through a shell and a middleman process) sees that one first
SETTLE_S = 0.3

#: monotonic deadline of the guard that bounds this process's wait now (0.0: none): a thread of the rank whose own
#: bound on the same wait expired leaves the naming to it, so one line names the stopped rank, not two
_GUARDED_UNTIL = 0.0
#: held by the thread of this process that names stopped peers (a waiting thread and the failing main thread may
#: both look): the other waits to be ended with the process
_NAMING = threading.Lock()


@contextlib.contextmanager
def guard(rank: int, timeout_s: float, what: str, hint: str = "") -> Iterator[None]:
    """Bound the block (start-up waits of rank ``rank`` that no timeout covers) by ``timeout_s`` seconds, in a
    process of its own (the module's docstring); ``what`` names the block in the line, ``hint`` adds to the reasons
    of a rank that waited (", or Open MPI dials an interface ..."). Not collective.

    The guard is not stopped with its rank: a rank stopped during the block is named as the cause, not as one that
    waited for another (its line and a waiting peer's race: whichever guard fires first ends the job)."""
    global _GUARDED_UNTIL
    outer, _GUARDED_UNTIL = _GUARDED_UNTIL, time.monotonic() + timeout_s
    proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(timeout_s),
                             str(rank), what, hint],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=sys.__stderr__ or sys.stderr)
    try:
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # done: the guard exits at once
        proc.wait()
        _GUARDED_UNTIL = outer


def _state(pid: int) -> str:
    """Process ``pid``'s state letter ("" when it is gone): read here without distkit's procfs (not imported yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _wait(pid: int, timeout: float) -> tuple[bool, bool]:
    """Wait up to ``timeout`` s for stdin to close: (whether it closed, whether rank ``pid`` was stopped: now or in
    at least half of the samples)."""
    end, samples, seen = time.monotonic() + timeout, 0, 0
    while True:
        left = end - time.monotonic()
        if left <= 0:
            break
        if select.select([sys.stdin], [], [], min(SAMPLE_S, left))[0]:
            return True, False
        samples, seen = samples + 1, seen + (_state(pid) in ("T", "t"))
    return False, _state(pid) in ("T", "t") or (samples > 0 and 2 * seen >= samples)


def _launch() -> tuple[Any, Any]:
    """distkit's procfs and failures modules (run as a script under ``-I``: the package's parent put on sys.path)."""
    try:
        from distkit.launch import failures, procfs
    except ImportError:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from distkit.launch import failures, procfs
    return procfs, failures


def stopped_peers(rank: int) -> dict[int, tuple[int, str]]:
    """rank -> (pid, start time) of every other rank of this process's job on this host that is stopped (SIGSTOP:
    state T); {} outside an MPI launcher (:func:`distkit.launch.procfs.local_ranks`). The guard's environment is its
    rank's (inherited)."""
    procfs, _ = _launch()
    found = {}
    for r, pid in procfs.local_ranks(dict(os.environ)).items():
        fields = procfs.stat_fields(pid)
        if r != rank and fields is not None and len(fields) > 19 and fields[0] in ("T", "t"):
            found[r] = (pid, fields[19])
    return found


def end_for_stopped_peers(rank: int, what: str, bound: str, pid: int = 0) -> None:
    """If another rank of this job on this host is stopped (:func:`stopped_peers`), name it in one line (``distkit:
    rank 1 stopped responding during start-up: stopped (SIGSTOP, a debugger) while rank 0 waited for it in WHAT
    (noticed by rank 0; BOUND); ending it and this rank``), record it for distkit's spawner
    (:func:`distkit.launch.failures.record_stall`: under ``--nprocs`` its line names it too), SIGKILL it, and once it
    is gone (the launcher sees it end first) SIGKILL this rank (process ``pid``; 0: this process): does not return
    then (the guard exits). Returns at once where none is stopped. A stopped process never acts on a
    launcher's SIGTERM (``horovodrun`` waits 5 s before its SIGKILL), hence the SIGKILL. Not collective: the guard
    calls it, and a rank whose own bound on a wait expired before the heartbeat watchdog ran
    (:func:`distkit.health.watchdog.explain_stall`), which leaves it to the guard while one bounds its wait."""
    if not pid:
        while _GUARDED_UNTIL and time.monotonic() < _GUARDED_UNTIL + PEER_GONE_S + SETTLE_S + 1.0:
            time.sleep(0.05)  # the guard names it and ends this process (it returns if the wait ended first)
        if not _NAMING.acquire(blocking=False):
            time.sleep(PEER_GONE_S + SETTLE_S + 1.0)  # another thread names it and ends this process
            return
    peers = stopped_peers(rank)
    if not peers:
        if not pid:
            _NAMING.release()
        return
    procfs, failures = _launch()
    names = sorted(peers)
    who = f"rank {names[0]}" if len(names) == 1 else "ranks " + ", ".join(map(str, names))
    how = f"during start-up: stopped (SIGSTOP, a debugger) while rank {rank} waited for it in {what}"

    class _Stall(Exception):
        stalled_ranks = names

    failures.record_stall(rank, _Stall(f"{who} stopped responding {how}"), how)
    # (the line first: the launcher may end this rank's output with the job)
    sys.stderr.write(f"distkit: {who} stopped responding {how} (noticed by rank {rank}; {bound}); "
                     "ending it and this rank\n")
    sys.stderr.flush()
    for peer, start in peers.values():  # (checked against its start time, through a pidfd)
        procfs.signal_process(peer, start)
    end = time.monotonic() + PEER_GONE_S
    while time.monotonic() < end and any(_state(peer) not in ("", "Z", "X") for peer, _ in peers.values()):
        time.sleep(0.05)
    time.sleep(SETTLE_S)
    with contextlib.suppress(OSError):
        os.kill(pid or os.getpid(), signal.SIGKILL)
    sys.exit(1)  # (the guard's own end; a rank that SIGKILLed itself never gets here)


def main(argv: list[str]) -> int:
    """``PID TIMEOUT RANK WHAT HINT``: guard rank RANK's process PID through its block WHAT (the module's
    docstring). Returns the exit status (0: the block finished in time)."""
    pid, timeout, rank, what, hint = int(argv[0]), float(argv[1]), int(argv[2]), argv[3], argv[4]
    done, was_stopped = _wait(pid, timeout)
    if done:
        return 0
    if was_stopped:
        line = (f"distkit: rank {rank}: stopped (SIGSTOP, a debugger) during {what} for {timeout:g} s "
                "(distributed.startup_timeout_s): ending this rank")
    else:
        end_for_stopped_peers(rank, what, f"distributed.startup_timeout_s = {timeout:g}", pid)  # (no return if one is)
        line = (f"distkit: rank {rank}: {what} did not complete within {timeout:g} s (distributed.startup_timeout_s) "
                f"(another rank did not start, is stopped, hangs or died{hint}): ending this rank")
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
