"""The last moments of a job on one host: a rank that has left the run must also exit.

At the end of a normal run every rank marks itself as leaving and the lowest rank of each host waits for
those marks (:meth:`distkit.health.watchdog.Watchdog.see_local_peers_out`). Between its mark and its exit a rank
still runs the interpreter's teardown and, under ``mpirun``, ``MPI_Finalize``, which waits for every rank of
the job. A rank stopped (SIGSTOP) in that window kept the whole job waiting forever: its peers inside
``MPI_Finalize``, ``mpirun`` for all of them, torchrun for its stopped worker (reproduced every time with
``DISTKIT_FAULT=1:6:stop:left`` under mpirun and the mpi engine; an operator's SIGSTOP the moment
``summary.json`` appeared hit it once in 6 runs). The lowest rank cannot wait for its peers' exit itself
(their ``MPI_Finalize`` waits for its own), so it hands the watch to a small process
(:func:`watch_until_exit`): it polls the host's ranks (itself included) every 50 ms until every one has
exited, and SIGKILLs one that stays stopped for :data:`STOPPED_S`, after one line on the job's stderr naming
it. The launcher then sees a killed rank and ends non-zero. The run's outputs were complete by then.

The watcher is the standard library only (``python -I -S``: it starts in about 20 ms), in its own session
(a SIGINT to the job's terminal group is not for it), with the rank's stderr (its line must reach the job's
log; it ends within 50 ms of the last rank, so it holds a launcher's pipe no longer than the ranks do).
Not collective; best effort: a failure to start it leaves the job as it was before.
"""
from __future__ import annotations

import subprocess
import sys

from distkit.launch.procfs import stat_fields

#: seconds a rank that has left may stay stopped before the watcher ends it (a running one is never touched)
STOPPED_S = 1.0
#: the watcher gives up after this many seconds even if a rank is still there and running (a slow exit, e.g. a
#: tracker's upload, is the rank's business; the watcher must not outlive it by hours)
MAX_S = 3600.0

# python -I -S -c WATCHER STOPPED_S MAX_S RANK:PID:STARTTIME ... (STARTTIME tells a recycled pid apart)
WATCHER = r"""
import os, signal, sys, time
stopped_s, max_s = float(sys.argv[1]), float(sys.argv[2])
ranks = {int(r): (int(p), s) for r, p, s in (a.split(":") for a in sys.argv[3:])}
def state(pid, start):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0] if len(fields) > 19 and fields[19] == start else None
since, end = {}, time.monotonic() + max_s
while ranks and time.monotonic() < end:
    now = time.monotonic()
    for r, (pid, start) in list(ranks.items()):
        st = state(pid, start)
        if st in (None, "Z", "X"):
            del ranks[r]
        elif st not in ("T", "t"):
            since.pop(r, None)
        elif now - since.setdefault(r, now) >= stopped_s:
            try:
                sys.stderr.write(f"distkit: rank {r} stopped responding after it left the run (pid {pid}, stopped "
                                 "before its exit; the run's outputs are complete); ended it: the job exits non-zero\n")
                sys.stderr.flush()
            except OSError:
                pass
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
            del ranks[r]
    time.sleep(0.05)
"""


def watch_until_exit(ranks: dict[int, int]) -> bool:
    """Start the watcher over ``ranks`` (rank -> pid, this host's ranks, the calling one included). Returns
    whether it started. Not collective."""
    args = []
    for rank, pid in sorted(ranks.items()):
        fields = stat_fields(pid)
        if fields is not None and len(fields) > 19:
            args.append(f"{rank}:{pid}:{fields[19]}")
    if not args:
        return False
    try:
        subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHER, f"{STOPPED_S:g}", f"{MAX_S:g}", *args],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except OSError:
        return False
    return True
