"""``--nprocs`` with an engine whose ranks must be MPI processes (mpi, horovod): distkit starts ``mpirun``.

Open MPI's ``mpirun`` (``prterun``) starts the ranks as its own children and ends the whole job when one of them
fails, with a message of its own (``prterun noticed that process rank 1 with PID 4242 on node vm exited on signal 9
(Killed)``). distkit's spawner names the failed rank in one line of its own under every other launcher it starts
(:func:`distkit.launch.spawner.spawn`), so it does here too: :func:`mpirun` watches mpirun's children while the job
runs (which rank each is, from the ``OMPI_COMM_WORLD_RANK`` it was started with, and the order in which they end),
gives the ranks the same failure directory (:data:`~distkit.launch.spawner.FAILURE_DIR_VAR`: a rank's own error, a
stall a rank's watchdog noticed), and once mpirun has ended non-zero names the rank the spawner's rules name
(:func:`~distkit.launch.spawner.verdict`): ``distkit: rank 1 failed (killed by SIGKILL); mpirun ended the other
ranks``. A rank that died without a word (SIGKILL, a crash) is the first one seen gone: mpirun ends the others only
after it saw that one end (SIGCONT, SIGTERM, and a SIGKILL 0.5 s later), so the order is the order of the failure.
mpirun's exit status is the failed rank's (128 + the signal for a killed one): it says how the rank ended.

Linux only for the watching (``/proc``); elsewhere the job runs as before, with mpirun's message alone.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from distkit.launch import ompi_leftovers
from distkit.launch.procfs import children, environ, state
from distkit.launch.failures import FAILURE_DIR_VAR, verdict


def _threads(nprocs: int) -> str:
    """OMP_NUM_THREADS per rank, as torchrun: the cores shared out, no oversubscription."""
    return str(max(1, (os.cpu_count() or 1) // nprocs))


def mpirun_path() -> Optional[str]:
    """The ``mpirun`` distkit starts: beside this Python first (the venv's Open MPI wheel), then on PATH."""
    return shutil.which("mpirun", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


#: seconds between two looks at mpirun's children (a rank's pid and whether it is still there). mpirun ends the
#: other ranks 0.25 s (SIGTERM) to 0.5 s (SIGKILL) after it saw the first one end, so a look every 0.1 s still sees
#: the failed rank end first; a faster look would cost the job's CPU (the overhead guard times ``--nprocs`` runs)
POLL_S = 0.1


class RankWatch:
    """mpirun's ranks as this process sees them from outside: rank -> pid while each runs, and the order in which
    they ended. Not a child of ours: each is known by the rank number in its environment (``OMPI_COMM_WORLD_RANK``),
    read once per new child of mpirun."""

    def __init__(self, launcher_pid: int) -> None:
        self.launcher_pid = launcher_pid
        self.running: dict[int, int] = {}  # pid -> rank
        self.gone: list[int] = []  # ranks in the order they were seen to end
        self._other: set[int] = set()  # children of mpirun that are no rank (read once, never again)

    def look(self) -> None:
        """One look at mpirun's children: note new ranks, and ranks that ended since the last look."""
        now = {pid for pid in children(self.launcher_pid) if state(pid) not in (None, "Z", "X")}
        for pid in now - self.running.keys() - self._other:
            rank = (environ(pid) or {}).get("OMPI_COMM_WORLD_RANK", "")
            if rank.isdigit():
                self.running[pid] = int(rank)
            else:
                self._other.add(pid)
        for pid in [p for p in self.running if p not in now]:
            rank = self.running.pop(pid)
            if rank not in self.gone:
                self.gone.append(rank)

    def ranks_seen(self) -> list[int]:
        """Every rank seen: those that ended, in that order, then those that were still running at the last look."""
        return self.gone + sorted(set(self.running.values()) - set(self.gone))


def _status_as_code(status: int) -> int:
    """mpirun's exit status as a rank's (``Popen.returncode``): 128 + N is the rank killed by signal N (-N)."""
    if status > 128:
        try:
            return -signal.Signals(status - 128)
        except ValueError:
            pass
    return status


def _any_agreed(failures: str) -> bool:
    """Whether some rank recorded an agreed error (:func:`~distkit.launch.spawner.record_failure`)."""
    for name in os.listdir(failures) if os.path.isdir(failures) else []:
        if name.startswith("rank-"):
            try:
                with open(os.path.join(failures, name)) as f:
                    if json.load(f).get("agreed"):
                        return True
            except (OSError, ValueError, AttributeError):
                continue
    return False


def name_failed_rank(failures: str, watch: RankWatch, status: int) -> Optional[str]:
    """The spawner's line about a job that mpirun ended with ``status`` (non-zero), or None where there is none to
    add: no rank was ever seen (mpirun failed to start them: its message says why), or the ranks stopped with an
    agreed error (rank 0 printed it: a full disk, a preemption). One rank's record of it is enough: mpirun ends the
    others at the first rank that exits non-zero, maybe before they recorded theirs."""
    seen = watch.ranks_seen()
    if not seen or _any_agreed(failures):
        return None
    code = _status_as_code(status)
    rank, _, what = verdict(failures, [(r, code) for r in seen])
    return f"distkit: rank {rank} {what}; mpirun ended the other ranks"


def mpirun(cmd: list[str], nprocs: int, preemptible: bool = False) -> int:
    """``mpirun -np N --bind-to none CMD``: Open MPI starts the ranks and ends the job when one fails; distkit names
    the failed rank after it (see the module's docstring). Returns mpirun's exit status.

    ``--bind-to none``: Open MPI would pin every rank to one core of its own, or all to core 0 when
    it miscounts; the ranks here share the machine's cores like torchrun's. ``--oversubscribe``: more
    ranks than cores is what ``--nprocs`` asked for (as under the spawner); Open MPI refuses it otherwise.

    Signals are passed on to mpirun, which passes them to the ranks. With ``preemptible`` (the ranks
    stop with a checkpoint, :mod:`distkit.health.preemption`) the first SIGTERM goes on as SIGUSR1: mpirun
    forwards SIGUSR1 and waits for the ranks, where on SIGTERM it ends the job itself half a second later
    (docs/failures.md, Preemption).
    """
    exe = mpirun_path()
    if exe is None:
        from distkit.errors import BackendUnavailable

        raise BackendUnavailable("--nprocs with an MPI engine needs Open MPI's mpirun: pip install 'distkit[mpi]' "
                                 "(or launch the ranks yourself with mpirun -np N)")
    failures = tempfile.mkdtemp(prefix="distkit-failures-")
    env = dict(os.environ, **{FAILURE_DIR_VAR: failures})  # (mpirun gives its local ranks its whole environment)
    env.setdefault("OMP_NUM_THREADS", _threads(nprocs))
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without both
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    ompi_leftovers.clear()  # a killed mpirun's session directory fails a new one given its pid
    proc = subprocess.Popen([exe, "-np", str(nprocs), "--oversubscribe", "--bind-to", "none", *cmd], env=env)
    translated: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        if preemptible and signum == signal.SIGTERM and not translated:
            translated.append(signum)
            signum = signal.SIGUSR1
        proc.send_signal(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    watch = RankWatch(proc.pid)
    try:
        while proc.poll() is None:
            watch.look()
            time.sleep(POLL_S)
        status = proc.returncode
        if status > 0:
            line = name_failed_rank(failures, watch, status)
            if line is not None:
                print(line, file=sys.stderr, flush=True)
        return status
    finally:
        shutil.rmtree(failures, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
