"""``startup_guard``: a bound on an engine's start-up (``MPI_Init``, ``hvd.init()``), for the MPI engines."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator


#: the guard process of :func:`startup_guard`: waits for its stdin to close (the block finished, or the rank
#: died); after the timeout it prints the rank's line (the second one if the rank itself is stopped: state T in
#: /proc/PID/stat, after the parenthesised command name) and SIGKILLs the rank
_GUARD = """
import os, select, signal, sys
pid, timeout, line, stopped = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
if not select.select([sys.stdin], [], [], timeout)[0]:
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        state = ""
    sys.stderr.write((stopped if state in ("T", "t") else line) + chr(10))
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
