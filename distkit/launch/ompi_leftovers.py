"""Open MPI's session directories left behind by a killed ``mpirun``, removed before they break the next one.

Open MPI 5's ``mpirun`` (PRRTE, with PMIx 5.0) writes its session directory as
``$TMPDIR/ompi.<pid of mpirun>`` (``prte.<pid>`` under ``prterun``), holding PMIx's rendezvous files
``pmix.<host>.tool``, ``pmix.<host>.tool.<pid>`` and ``pmix.<host>.tool.<nspace>``. It removes it when
it ends, but not when it is SIGKILLed (a scheduler's timeout, the OOM killer, ``kill -9``, a test
harness). PMIx 5.0 creates those files with ``O_EXCL`` and refuses to start when one exists, so a
later ``mpirun`` given the same pid fails at once with exit status 213 and only

    The PMIx server's listener thread failed to start. We cannot continue.

Pids come round again: where ``kernel.pid_max`` is 32768 (these machines, many containers) after
a few tens of thousands of processes or threads. Newer PMIx reclaims a file whose recorded pid is
no longer running; :func:`clear` does the same for the whole directory, before distkit's launcher
starts ``mpirun`` and when a job's first rank on a host starts under one (so a job started by
hand with ``mpirun`` clears what an earlier killed one left for the jobs after it).
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from typing import Optional

_SESSION_DIR = re.compile(r"(?:ompi|prte)\.(\d+)")


def _tmpdir() -> str:
    """Where PRRTE puts session directories: its ``prte_tmpdir_base`` if set, else $TMPDIR or /tmp."""
    for var in ("PRTE_MCA_prte_tmpdir_base", "OMPI_MCA_prte_tmpdir_base"):
        if os.environ.get(var):
            return os.environ[var]
    return tempfile.gettempdir()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (as any user: EPERM means it does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear(tmpdir: Optional[str] = None) -> list[str]:
    """Remove this user's Open MPI session directories whose ``mpirun`` is no longer running.

    A directory is removed only when its name is ``ompi.<pid>`` or ``prte.<pid>``, it belongs to
    this user, it holds PMIx's ``pmix.<host>.tool.<pid>`` file for that pid with this host's name
    (so it is a session directory, and one of this host: where $TMPDIR is shared between hosts,
    another host's pids are not ours to judge; its files could not collide with ours either, as
    their names hold its host name) and no process ``pid`` exists. A directory of a running
    ``mpirun`` is never touched. Never raises: a directory that cannot be read or removed is left
    as it is. Returns the directories removed.
    """
    base = tmpdir or _tmpdir()
    try:
        entries = os.listdir(base)
    except OSError:
        return []
    removed = []
    uid = os.getuid() if hasattr(os, "getuid") else None
    full = socket.gethostname()
    hosts = {full, full.split(".")[0]}  # PMIx drops the domain unless told to keep it
    for entry in entries:
        m = _SESSION_DIR.fullmatch(entry)
        if m is None:
            continue
        pid, path = int(m.group(1)), os.path.join(base, entry)
        try:
            st = os.lstat(path)
            if (uid is not None and st.st_uid != uid) or not os.path.isdir(path) or os.path.islink(path):
                continue
            inside = set(os.listdir(path))
        except OSError:
            continue
        if not any(f"pmix.{host}.tool.{pid}" in inside for host in hosts) or _running(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed
