"""Preemption: a scheduler's SIGTERM or SIGUSR1 ends the run after an agreed step, with a checkpoint.

SLURM (``scancel``, a time limit with ``--signal=USR1@90``, preemption) and Kubernetes send SIGTERM or
SIGUSR1 some seconds before they kill a job. Without a handler Python dies at once, and the run
resumes from its last periodic checkpoint (up to ``checkpoint_every`` steps of every rank's work lost).
With ``preemption = True`` (the default) the first such signal only sets a flag; after every optimizer
step the ranks agree on it (:meth:`Preemption.agreed`: one MAX all-reduce of one number, so every rank
stops after the same step, whichever rank got the signal and when), the Trainer writes a checkpoint of
that step and every rank exits with :class:`~distkit.errors.Preempted` (status 75). ``++resume auto``
then continues bit-identically. A second signal restores the default action: a user who sends it again
means "now".

The all-reduce started after step s is waited for after step s + :data:`LAG`: a signal stops the run at
most LAG + 1 steps after it came. The lag is what lets a slow link carry a background exchange
(``param_sync_overlap``): a small collective sent behind its bytes waits in the link's queue, and a check
waited for at once would hold up every step by that wait.

The launchers pass the signal on: distkit's spawner (``--nprocs``) sends it to every rank and waits for
them (:func:`distkit.launch.spawner.spawn`), ``mpirun`` forwards SIGUSR1, torchrun SIGTERM (then
SIGKILLs after its own 30 s), ``srun`` every signal ``scancel --signal`` names.

Open MPI's ``mpirun`` (``prterun``) is the exception: sent SIGTERM (or SIGINT) itself, or when a rank failed, it
ends the job: SIGCONT and SIGTERM to every rank, SIGKILL 0.5 s later. A checkpoint started on that SIGTERM was cut
off, or, on a fast step, written, and mpirun's exit status and lack of a line were the same either way (issue 62
item 7: one run in several wrote one). So under an Open MPI launcher a SIGTERM that comes with a SIGCONT
(:data:`PAIR_S` apart; a scheduler or an operator signalling the rank itself sends SIGTERM alone) is mpirun ending
the job: it starts no checkpoint, and the rank ends with mpirun's SIGKILL; rank 0 says so in one line. To stop a job
under ``mpirun`` with a checkpoint, send SIGUSR1 to mpirun, or SIGTERM to the ranks (docs/failures.md)."""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from distkit.health.protocols import SessionLike

#: the signals schedulers send before they end a job
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: steps between the start of a check (an all-reduce in the background) and its result
LAG = 2
#: seconds between a SIGCONT and a SIGTERM that make them the pair Open MPI's mpirun sends when it ends the job
#: (measured: 0.25 s apart, then SIGKILL; an operator or a scheduler signalling a rank sends SIGTERM alone)
PAIR_S = 2.0
#: seconds a rank waits for mpirun's SIGKILL after the pair before it ends itself (mpirun sends it 0.5 s after the
#: SIGTERM; an mpirun that never does must not leave the rank training on)
ENDS_WITHIN_S = 3.0
#: rank 0's line when mpirun ends a job whose ranks on this host all still run (it was signalled itself)
MPIRUN_ENDS = ("distkit: mpirun is ending the job (it was sent SIGTERM or SIGINT, or a rank on another host failed; "
               "it passes SIGTERM on and SIGKILLs the ranks 0.5 s later): no checkpoint is written; ++resume auto "
               "continues from the last one. To stop a job under mpirun with a checkpoint, send SIGUSR1 to mpirun "
               "(docs/failures.md)")
#: what a timeout in a check names
WHAT = "the preemption check after the step (distkit.health.preemption)"


class Preemption:
    """This rank's record of a preemption signal (install with :meth:`install`, remove with :meth:`remove`).
    Not collective, except :meth:`agreed`."""

    def __init__(self) -> None:
        self.received: Optional[int] = None  # the first signal's number
        self._previous: dict[int, Any] = {}
        self._checks: deque[Any] = deque()  # the checks in flight, oldest first (handles; see agreed)
        self._seen: dict[int, float] = {}  # SIGTERM and SIGCONT: when each was last handled (monotonic)
        self._pid = 0  # the process that installed the handlers

    def install(self) -> None:
        """Catch :data:`SIGNALS` in this process (the main thread only can: elsewhere it does nothing)."""
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: the signals keep their default action
                return
        from distkit.launch.guard import MPI_DAEMONS, launcher_daemon

        self._pid = os.getpid()  # (a fork of this process, a data loader's worker, inherits the handlers: not it)
        if launcher_daemon() in MPI_DAEMONS:  # (its SIGCONT tells mpirun's SIGTERM apart: the module's docstring)
            self._previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, self._on_continue)

    def remove(self) -> None:
        """Give the signals back their earlier handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM:
            self._seen[signum] = time.monotonic()
            if self._launcher_ends():
                return
        if self.received is None:
            self.received = signum
            # a second signal acts as if none were caught: the user (or scheduler) means now
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def _on_continue(self, signum: int, _frame: Any) -> None:
        """SIGCONT (handled only under an Open MPI launcher): with a SIGTERM, mpirun is ending the job."""
        self._seen[signum] = time.monotonic()
        self._launcher_ends()

    def _launcher_ends(self) -> bool:
        """When a SIGCONT and a SIGTERM came :data:`PAIR_S` apart (in either order: Python runs the handlers of
        signals that arrived together in the order of their numbers): mpirun is ending the job. Forget the SIGTERM
        as a preemption (no checkpoint is started, so none is cut off halfway or written by chance) and leave the
        end to mpirun's SIGKILL; if that has not come after :data:`ENDS_WITHIN_S`, the SIGTERM again, under the
        handler it had before this one (the default: the rank ends). Not at once: a rank of this host that ended
        now would look, to rank 0's look at its peers (:func:`_say_mpirun_ends`), like a rank that failed.
        Returns whether it was that pair."""
        term, cont = self._seen.get(signal.SIGTERM), self._seen.get(signal.SIGCONT)
        if term is None or cont is None or abs(term - cont) > PAIR_S or os.getpid() != self._pid:
            return False
        self._seen.clear()
        if self.received == signal.SIGTERM:
            self.received = None
        signal.signal(signal.SIGTERM, self._previous.get(signal.SIGTERM) or signal.SIG_DFL)
        _say_mpirun_ends()
        timer = threading.Timer(ENDS_WITHIN_S, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()
        return True

    def agreed(self, dk: SessionLike) -> Optional[str]:
        """Collective (every rank, after the same step): the name of a signal some rank had received when the
        check :data:`LAG` calls before this one started, or None. Starts this call's check (one all-reduce of
        one float, in the background) and waits for that earlier one: every rank gets the same answer at the
        same step, and the wait is one that had LAG steps to arrive."""
        mine = float(self.received or 0)
        if dk.world_size == 1:
            return signal.Signals(int(mine)).name if mine else None
        with dk._collective(WHAT):
            self._checks.append(dk._strategy.start_all_reduce(torch.tensor([mine]), op="max"))
            if len(self._checks) <= LAG:
                return None
            got = float(self._checks.popleft().wait().item())
        return signal.Signals(int(got)).name if got else None

    def settle(self, dk: SessionLike) -> None:
        """Collective (every rank, at the same point: the end of the loop, a stop): wait for the checks still
        in flight (their answers no longer matter; an engine must not be torn down under them)."""
        with dk._collective(WHAT):
            while self._checks:
                self._checks.popleft().wait()


def _say_mpirun_ends() -> None:
    """Rank 0, when mpirun ends the job and every rank of this host still runs (no rank here failed: mpirun was
    signalled): :data:`MPIRUN_ENDS`, written straight into mpirun's own stderr (what the rank writes to its own goes
    through mpirun, which drops it while it ends the job). Best effort; nothing where a rank of this host has ended
    (mpirun's message and distkit's line about that rank say why the job ends)."""
    from distkit.launch.procfs import children, environ, state

    if os.environ.get("OMPI_COMM_WORLD_RANK") != "0":
        return
    parent = os.getppid()
    local = [pid for pid in children(parent) if "OMPI_COMM_WORLD_RANK" in (environ(pid) or {})]
    if len(local) != int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "0") or 0) or \
            any(state(pid) in (None, "Z", "X") for pid in local):
        return
    try:  # append: "w" would truncate a launcher's stderr that is a file (the job's log)
        with open(f"/proc/{parent}/fd/2", "a") as err:
            err.write(MPIRUN_ENDS + "\n")
    except OSError:
        pass
