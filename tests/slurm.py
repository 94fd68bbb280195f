"""A real SLURM on this machine for the tests: ``slurmctld`` + ``slurmd`` with a test-owned config.

``scripts/install_slurm.sh`` installs the daemons (Debian's slurm 22.05 and munge). :class:`Slurm`
writes ``slurm.conf`` into a directory of its own (state, spool, logs and pid files there too),
starts ``munged`` if none runs, then both daemons, and waits until the node is idle; every command
the tests run gets ``SLURM_CONF`` pointing at that file. :meth:`Slurm.stop` stops the daemons it
started (also when a test fails). One node (this machine) with all its CPUs, oversubscription on,
finished jobs kept 10 minutes so ``scontrol show job`` still reports their state.

Full accounting needs ``slurmdbd`` and a database, which this harness does not start. It keeps
SLURM's job completion log instead (``JobCompType=jobcomp/filetxt``), which ``sacct --completion``
reads: :meth:`Slurm.sacct_state` is a job's end state as ``sacct`` reports it; :meth:`Slurm.job_state`
reads ``scontrol show job`` (also while the job runs).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Optional

from tiers import full_tier

DAEMONS = ("slurmctld", "slurmd", "munged", "srun", "sbatch", "scontrol")


def unavailable() -> Optional[str]:
    """Why SLURM cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the SLURM tests need root (they start slurmctld and slurmd)"
    missing = [d for d in DAEMONS if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} missing): run scripts/install_slurm.sh"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@full_tier("SLURM daemons")
class Slurm:
    """A one-node SLURM cluster in ``directory``; use as a context manager."""

    def __init__(self, directory: str) -> None:
        self.dir = os.path.abspath(directory)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.host = socket.gethostname()
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._procs: list[str] = []

    def __enter__(self) -> "Slurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        cpus = os.cpu_count() or 1
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=distkit-test
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again once its first run's credentials expired (default 120 s, at least 5)
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=600
SchedulerType=sched/backfill
# a pending job (a requeued one, held until the credentials expired) is looked at every second, not every 30-60 s
SchedulerParameters=bf_interval=1,sched_interval=1
StateSaveLocation={self.dir}/state
SlurmdSpoolDir={self.dir}/spool
SlurmctldPidFile={self.dir}/slurmctld.pid
SlurmdPidFile={self.dir}/slurmd.pid
SlurmctldLogFile={self.dir}/log/slurmctld.log
SlurmdLogFile={self.dir}/log/slurmd.log
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.dir}/log/jobcomp.txt
NodeName={self.host} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES OverSubscribe=YES MaxTime=INFINITE State=UP
""")

    def _ensure_munge(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
            return
        key = "/etc/munge/munge.key"
        if not os.path.exists(key):
            os.makedirs("/etc/munge", exist_ok=True)
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            shutil.chown(key, "munge", "munge")
            os.chmod(key, 0o400)
        os.makedirs("/run/munge", exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _exe("munged")], check=True, capture_output=True)

    def start(self) -> None:
        self._write_conf()
        self._ensure_munge()
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_exe(daemon), "-f", self.conf] if daemon == "slurmctld" else [_exe(daemon), "-f", self.conf],
                           check=True, capture_output=True, env=self.env)
            self._procs.append(daemon)
        deadline = time.time() + 60
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env).stdout
            if out.strip() in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the test SLURM did not come up within 60 s: sinfo says {out.strip()!r}; logs in {self.dir}/log")

    def stop(self) -> None:
        for daemon in ("slurmd", "slurmctld"):
            pidfile = os.path.join(self.dir, f"{daemon}.pid")
            try:
                with open(pidfile) as f:
                    os.kill(int(f.read().strip()), 15)
            except (OSError, ValueError):
                pass
        self._procs.clear()

    def job_state(self, job_id: str) -> str:
        """``JobState`` of a job, from ``scontrol show job``."""
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=self.env).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def sacct_state(self, job_id: str, timeout: float = 10) -> str:
        """A finished job's state as ``sacct --completion`` reports it (from the job completion log,
        which slurmctld writes as the job ends: polled for up to ``timeout`` seconds); "" if absent."""
        deadline = time.time() + timeout
        while True:
            out = subprocess.run(["sacct", "--completion", "-j", job_id, "-n", "-P", "-o", "jobid,state"],
                                 capture_output=True, text=True, env=self.env).stdout
            states = [line.split("|")[1] for line in out.splitlines() if line.split("|")[0] == job_id]
            if states or time.time() > deadline:
                return states[0] if states else ""
            time.sleep(0.2)

    def states_until_end(self, job_id: str, timeout: float) -> list[str]:
        """Every ``JobState`` job ``job_id`` goes through (polled every 0.2 s) until it ends (a requeued job
        passes REQUEUED/PENDING on its way), or ``timeout`` seconds pass; the last one is where it stopped."""
        states: list[str] = []
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_state(job_id)
            if not states or states[-1] != state:
                states.append(state)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            time.sleep(0.2)
        return states

    def wait(self, job_id: str, timeout: float = 300) -> str:
        """Wait until job ``job_id`` has ended (polled every 0.2 s); its final state."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN"):
                return state
            time.sleep(0.2)
        return "TIMEOUT (the test gave up waiting)"
