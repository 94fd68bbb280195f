"""Typed errors. Every user-facing error names the problem and the fix.

The CLI turns any :class:`DistkitError` raised before training starts into one line on
stderr and exit status 2 (bad input); errors during training exit with status 1.
"""
from __future__ import annotations


class DistkitError(Exception):
    """Base class of every error distkit raises on purpose."""

    exit_code: int = 2
    #: every rank raised this same error at the same point, agreed by a collective (a full disk while
    #: saving, a checkpoint that does not fit): rank 0 reports it once, the others end quietly
    agreed: bool = False
    #: its one line was printed already (an agreed error is reported by rank 0 before the ranks meet at the end)
    reported: bool = False


def report_agreed(error: DistkitError, rank: int) -> None:
    """Rank 0 prints the one line of an agreed error (every rank raised it together); the others print nothing.

    Called before the ranks leave together (their last barrier), not after: a launcher that ends the job when its
    first rank exits non-zero (mpirun, srun) would otherwise kill rank 0 before the line, once another rank
    already left with the error's status (seen: a preemption under mpirun, exit 75, no line)."""
    if rank == 0 and not error.reported:
        import sys

        # a preemption is no error: the run stopped as asked, its checkpoint written
        what = "" if isinstance(error, Preempted) else "error: "
        print(f"distkit: {what}{error}", file=sys.__stderr__ or sys.stderr, flush=True)
    error.reported = True


class ConfigError(DistkitError):
    """A config file, config key or command-line flag is wrong. The text says how to fix it."""


class BackendUnavailable(DistkitError):
    """The selected engine (or a piece it needs) is not installed; the text gives the install command."""


class UnsupportedCombination(DistkitError):
    """The requested backend/mode/launcher combination cannot work; the text says why and what works."""


class RankFailure(DistkitError):
    """Another rank failed or was killed; the text names the rank."""

    exit_code = 1


class CollectiveTimeout(DistkitError):
    """A collective did not complete within ``distributed.timeout_s`` seconds."""

    exit_code = 1


class LighthouseLost(DistkitError):
    """The torchft lighthouse of fault-tolerant replica groups stopped answering: no sync can commit, so the
    group stops rather than train on alone unseen; the text says how to go on."""

    exit_code = 1


class HealMismatch(DistkitError):
    """A fault-tolerant replica group healed, but the state it holds afterwards is not the state the live
    group sent (an engine that restores part of it): the group stops instead of training on a different
    model or optimizer state unseen; the text names the parts that differ."""

    exit_code = 1


class UsageError(DistkitError):
    """The distkit API was called in a way that cannot work (e.g. ``dk.step()`` before ``dk.setup()``);
    the text says which call to make instead."""


class CheckpointError(DistkitError):
    """A checkpoint cannot be written or read (unwritable directory, missing or damaged files). The
    previous checkpoint is intact; the text names the path and the fix."""


class RankStalled(RankFailure):
    """A rank stopped responding: its heartbeat did not change for ``distributed.timeout_s`` seconds
    (stopped with SIGSTOP, frozen, or cut off from the network). The text names it; ``stalled_ranks``
    lists the global ranks (see :mod:`distkit.health.watchdog`)."""

    def __init__(self, message: str, stalled_ranks: list[int]) -> None:
        super().__init__(message)
        self.stalled_ranks = list(stalled_ranks)


class RankLost(RankStalled):
    """A rank is gone: this rank's connection to a peer closed (reset, refused) and a rank's heartbeat
    stopped with it: it died, was killed, or its host went down or was cut off. The text names it;
    ``stalled_ranks`` lists the global ranks (see :func:`distkit.health.lost.lost_peer_error`)."""


class NonFiniteLoss(DistkitError):
    """The training loss became NaN or infinite (:meth:`distkit.Session.backward`): training stops at that
    step, before its optimizer step, so no later checkpoint holds the diverged model. The text names the
    rank and the step. A failure during training, not bad input: exit status 1."""

    exit_code = 1


class PortInUse(ConfigError):
    """The rendezvous port the launcher chose is taken (another job on the host): the text names the flag
    that gives this job its own."""


class OutputError(DistkitError):
    """A run's own output file (``summary.json``, ``config.resolved.json``) cannot be written (a full
    disk, a read-only directory). The file written before, if any, is intact; the text names the path
    and the fix."""


class UnusedParameters(UsageError):
    """A parameter that requires grad got no gradient in a step where the engine cannot leave it alone as
    DDP does (without ``find_unused_parameters``; on DeepSpeed always). The text names the parameters."""


class Preempted(DistkitError):
    """The run was asked to stop (SIGTERM or SIGUSR1: a scheduler's preemption or time limit) and stopped
    after an agreed step with a checkpoint of it (see :mod:`distkit.health.preemption`). Exit status 75
    (``EX_TEMPFAIL``: try again), on which ``distkit sbatch --requeue``'s script requeues the job; the text
    names the step, the checkpoint and how to continue."""

    exit_code = 75


#: what an exception raised without a message means, for the line that names a failed rank
_NO_MESSAGE: tuple[tuple[type[BaseException], str], ...] = (
    (MemoryError, "out of memory (the allocation failed; reduce batch_size or the model, or free memory)"),
    (RecursionError, "maximum recursion depth exceeded"),
    (KeyboardInterrupt, "interrupted"),
)


def describe(exc: BaseException) -> str:
    """``"Type: message"`` for a line naming a failed rank; an exception raised without a message (``MemoryError()``
    gave "rank 1 failed: MemoryError: ") says what it means instead."""
    text = str(exc).strip()
    if not text:
        text = next((why for kind, why in _NO_MESSAGE if isinstance(exc, kind)), "(raised without a message)")
    return f"{type(exc).__name__}: {text}"
