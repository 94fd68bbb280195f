"""A process's state from Linux's ``/proc/PID/stat``: whether it is stopped (SIGSTOP), a zombie or gone, and its
start time (which tells a recycled pid apart). One parser for the spawner, the watchdog and the launcher guard."""
from __future__ import annotations

import os
import signal
from typing import Optional


def stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/PID/stat`` after the command name (the state first, the start time at index 19),
    or None when the process is gone (or /proc cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def state(pid: int) -> Optional[str]:
    """Process ``pid``'s state letter (R, S, T, Z, ...), or None when it is gone (or unknown)."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, state T; False where unknown)."""
    return state(pid) in ("T", "t")


#: the name a rank gives its process once it has left the run (:func:`mark_left`)
LEFT_NAME = "distkit-left"


def mark_left() -> None:
    """Rename this process (its ``/proc/self/comm``) to :data:`LEFT_NAME`: a mark that a peer on the same host
    reads with :func:`has_left`, kept by the kernel, so it needs no server (a store on rank 0 may be gone by
    then) and cannot fail on a full disk. Best effort (no /proc: no mark, and the peer waits for the exit)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(LEFT_NAME)
    except OSError:
        pass


def has_left(pid: int) -> bool:
    """Whether process ``pid`` has marked itself with :func:`mark_left` (False when it is gone or unknown)."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() == LEFT_NAME
    except OSError:
        return False


def children(ppid: int) -> list[int]:
    """The pids of process ``ppid``'s children ([] where /proc cannot be read)."""

    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        fields = stat_fields(int(name)) if name.isdigit() else None
        if fields and len(fields) > 1 and fields[1] == str(ppid):
            found.append(int(name))
    return found


def environ(pid: int) -> Optional[dict[str, str]]:
    """The environment process ``pid`` was started with (None when it cannot be read: gone, another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return dict(kv.split("=", 1) for kv in data.decode("utf-8", "replace").split("\0") if "=" in kv)


def same_process(pid: int, start: Optional[str]) -> bool:
    """Whether process ``pid`` is still the one that had start time ``start`` (False for a pid that is gone or was
    handed to another process since, and for ``start`` None)."""
    if pid <= 0 or start is None:
        return False
    fields = stat_fields(pid)
    return fields is not None and len(fields) > 19 and fields[19] == start


def signal_process(pid: int, start: Optional[str], sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` to process ``pid`` if it is still the one that had start time ``start``; returns whether it was
    sent. Through a pidfd where Linux has them (5.3): the check and the signal then concern one process, even if
    ``pid`` is handed to another one in between."""
    fd: Optional[int] = None
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        if not same_process(pid, start):
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


#: how one job's ranks on a host are told from every other process there, launcher by launcher (the MPI launchers,
#: whose start-up distkit cannot watch through a store of its own: :mod:`distkit.launch.startup_watch`): the
#: variables whose values together name the job (the same in each of its ranks, another job's differ), and the one
#: that holds the rank. Open MPI (``mpirun``/``prterun``, ``horovodrun`` on MPI) gives every job a PMIx namespace of
#: its own; ``horovodrun --gloo`` one rendezvous server (address and port) per job.
JOB_VARS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("PMIX_NAMESPACE",), "OMPI_COMM_WORLD_RANK"),
    (("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"), "HOROVOD_RANK"),
)


def job_rank(env: dict[str, str]) -> Optional[tuple[str, int]]:
    """(the job's name, the rank) that the environment ``env`` of a process gives it under an MPI launcher
    (:data:`JOB_VARS`), or None where none of them started it."""
    for names, rank_var in JOB_VARS:
        rank = env.get(rank_var, "")
        if rank.isdigit() and all(env.get(n) for n in names):
            return rank_var + "|" + "|".join(env[n] for n in names), int(rank)
    return None


def local_ranks(env: dict[str, str]) -> dict[int, int]:
    """rank -> pid of every rank on this host of the job that ``env`` (a rank's environment) belongs to, this rank's
    own included ({} outside an MPI launcher, or without /proc). A rank's process is the topmost one that carries
    its rank: the processes it starts (the start-up guard, data loader workers) inherit the environment, its
    launcher's shell does not hold it (``horovodrun --gloo`` passes the variables through ``env``). Reads the
    environment of each process of this user, so it is meant for the rare moment a start-up failed."""

    mine = job_rank(env)
    if mine is None:
        return {}
    found: dict[int, tuple[int, int]] = {}  # pid -> (rank, parent pid)
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if not name.isdigit():
            continue
        theirs = job_rank(environ(int(name)) or {})
        fields = stat_fields(int(name))
        if theirs is not None and theirs[0] == mine[0] and fields is not None and fields[0] not in ("Z", "X"):
            found[int(name)] = (theirs[1], int(fields[1]))
    return {rank: pid for pid, (rank, parent) in found.items() if found.get(parent, (-1, 0))[0] != rank}
