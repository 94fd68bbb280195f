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
them (:func:`distkit.launch.spawner.spawn`), ``mpirun`` forwards SIGTERM and SIGUSR1, torchrun SIGTERM (then
SIGKILLs after its own 30 s), ``srun`` every signal ``scancel --signal`` names."""
from __future__ import annotations

import signal
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from distkit.health.protocols import SessionLike

#: the signals schedulers send before they end a job
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: steps between the start of a check (an all-reduce in the background) and its result
LAG = 2
#: what a timeout in a check names
WHAT = "the preemption check after the step (distkit.health.preemption)"


class Preemption:
    """This rank's record of a preemption signal (install with :meth:`install`, remove with :meth:`remove`).
    Not collective, except :meth:`agreed`."""

    def __init__(self) -> None:
        self.received: Optional[int] = None  # the first signal's number
        self._previous: dict[int, Any] = {}
        self._checks: deque[Any] = deque()  # the checks in flight, oldest first (handles; see agreed)

    def install(self) -> None:
        """Catch :data:`SIGNALS` in this process (the main thread only can: elsewhere it does nothing)."""
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: the signals keep their default action
                return

    def remove(self) -> None:
        """Give the signals back their earlier handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum
            # a second signal acts as if none were caught: the user (or scheduler) means now
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

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
