"""A launcher must not outlive a job whose ranks were lost.

When a host freezes or its link is cut, distkit's ranks notice within ``distributed.timeout_s``
(:mod:`distkit.health.watchdog`), name the lost ranks and exit non-zero. Their launchers do not always
follow: Open MPI's ``mpirun`` (``prterun``) orders every daemon to kill its ranks and then waits for
the lost host's daemon to confirm, forever (measured: still running at 300 s), and the cut-off
host's ``prted`` waits for ``mpirun``; torchrun's agent on a host whose peer host vanished waits for
its rendezvous store up to its own barrier timeout (40 s and more). ``SIGTERM`` does not end a
waiting ``prterun`` (it forwards the signal to the ranks and goes on waiting).

So a rank that ends the job because other ranks are lost calls :func:`end_launcher_after` once: a
small watcher process, detached from the rank (its own session, no inherited pipes, so it never
keeps the launcher's output open), waits ``grace_s`` seconds for the rank's launcher daemon (its
parent) to exit as it should, and only if it is still there writes one line into the launcher's own
stderr, sends SIGTERM and, half a second later, SIGKILL. ``mpirun`` then exits non-zero (137) on the
launching host instead of hanging; the ranks' own lines name the lost ranks.

Only the launcher daemons that are known to wait for a lost host are touched: Open MPI's
(``prterun``, ``prted``, ``mpirun``, ``mpiexec``, ``orterun``, ``orted``) and a torchrun agent that
may not restart its workers (``TORCHELASTIC_MAX_RESTARTS`` = 0; an elastic agent with restarts left
is the user's choice of recovery and is left alone). distkit's own spawner and SLURM's ``srun``
already end their jobs. Not collective; best effort (a failure to start the watcher is ignored: the
ranks have already reported the loss)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional

from distkit.launch.procfs import stat_fields

#: Open MPI launcher daemons (PRRTE of Open MPI 5, ORTE of Open MPI 4) that wait for a lost host
MPI_DAEMONS = frozenset({"prterun", "prted", "mpirun", "mpiexec", "orterun", "orted"})
#: seconds a launcher may take to end on its own after its rank noticed lost peers (it normally
#: needs well under one: it sees the rank exit and stops the others)
GRACE_S = 3.0

_ARMED = False

# The watcher: python -I -S -c WATCHER PID STARTTIME GRACE NAME WHY. Only the standard library, no
# distkit import (it must start in milliseconds and survive the rank), so its own /proc parsing (as
# distkit.launch.procfs). STARTTIME guards against a recycled pid.
WATCHER = r"""
import os, signal, sys, time
pid, start, grace, name, why = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return fields[0] != "Z" and fields[19] == start
    except (OSError, IndexError):
        return False
deadline = time.monotonic() + grace
while time.monotonic() < deadline:
    if not alive():
        sys.exit(0)
    time.sleep(0.1)
try:  # append: "w" would truncate a launcher's stderr that is a file (the job's log, every distkit line in it)
    with open(f"/proc/{pid}/fd/2", "a") as err:
        err.write(f"distkit: {name} (pid {pid}) still running {grace:g} s after its ranks ended ({why}); "
                  f"distkit ends it (it waits for the lost host forever)\n")
except OSError:
    pass
for sig, wait in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 0.0)):
    if not alive():
        break
    try:
        os.kill(pid, sig)
    except OSError:
        break
    time.sleep(wait)
"""


def launcher_daemon(pid: Optional[int] = None, environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """The name of the launcher daemon ``pid`` (default: this process's parent) when it is one that
    waits for a lost host (see the module docstring), else None."""
    pid = os.getppid() if pid is None else pid
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return None
    if comm in MPI_DAEMONS:
        return comm
    is_torchrun = any(a.endswith(b"torchrun") or a == b"torch.distributed.run" for a in argv[:4])
    if is_torchrun and environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return "torchrun"
    return None


def end_launcher_after(why: str, grace_s: float = GRACE_S) -> bool:
    """Once per process: make sure this rank's launcher daemon exits within about ``grace_s`` + 0.5 s of
    now (see the module docstring). ``why`` says in a few words which ranks were lost (it goes into
    the launcher's stderr if the watcher has to act). Returns True when a watcher was started."""
    global _ARMED
    if _ARMED:
        return False
    name = launcher_daemon()
    pid = os.getppid()
    fields = stat_fields(pid)
    if name is None or fields is None or len(fields) < 20:
        return False
    _ARMED = True
    try:
        subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHER, str(pid), fields[19], f"{grace_s:g}", name,
                          why.replace("\n", " ")[:200]],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
    except OSError:
        return False
    return True


def kill_stopped_siblings() -> list[int]:
    """SIGKILL the processes that share this rank's launcher (its parent) and are stopped (SIGSTOP, state
    T): at start-up, before the heartbeat watchdog knows any pid, they are the local ranks that never
    arrived. A stopped process acts on a launcher's SIGTERM only once continued, so torchrun would wait
    30 s before its SIGKILL. Returns their pids. Not collective; never touches a running process."""
    parent, me, killed = os.getppid(), os.getpid(), []
    if parent <= 1:
        return killed
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        fields = stat_fields(int(entry))
        if fields is not None and len(fields) > 1 and fields[1] == str(parent) and fields[0] in ("T", "t"):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except OSError:
                pass
    return killed
