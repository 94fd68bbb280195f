"""Why a rank failed, as the ranks record it for distkit's spawner, and which rank the spawner names.

Under distkit's spawner (``--nprocs``: :func:`distkit.launch.spawner.spawn`, and mpirun started by it,
:func:`distkit.launch.mpi_launch.mpirun`) every rank gets :data:`FAILURE_DIR_VAR`, a directory where a rank that
fails writes when and why (:func:`record_failure`), and a rank whose watchdog saw another stop responding writes
which one (:func:`record_stall`). Once the job has failed the spawner reads them (:func:`verdict`) to name the rank
whose error came first and was its own, not one that only lost its peer. Elsewhere (torchrun, a user's mpirun)
the records are not written.
"""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

#: seconds the spawner waits after the first failed rank for the others' failure records (see _culprit)
SETTLE_S = 1.0
#: where a spawned rank records why it failed (set by the spawner)
FAILURE_DIR_VAR = "DISTKIT_FAILURE_DIR"
#: words of errors a rank gets when its connection to another rank broke (that rank died or went away)
_CLOSED_WORDS = ("closed by peer", "connection reset", "connection refused", "broken pipe")
#: words of errors a rank gets because another rank failed (its connection broke, a collective timed out)
_PEER_WORDS = (*_CLOSED_WORDS, "timed out", "timeout", "another rank")


def record_failure(rank: int, exc: BaseException) -> None:
    """Under distkit's spawner: note when and why this rank failed, so the spawner names the rank whose
    error came first and was its own, not one that only lost its peer (no-op elsewhere)."""
    directory = os.environ.get(FAILURE_DIR_VAR)
    if not directory:
        return
    from distkit.errors import describe

    text, peer = describe(exc), lost_a_peer(exc)
    try:
        with open(os.path.join(directory, f"rank-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "time": time.time(), "peer": peer, "error": text[:300],
                       "agreed": bool(getattr(exc, "agreed", False))}, f)
    except OSError:
        pass  # best effort: the spawner then names the first rank it saw fail


def record_stall(rank: int, exc: BaseException, how: str = "") -> None:
    """Under distkit's spawner: rank ``rank`` saw the ranks in ``exc.stalled_ranks`` stop responding
    (:class:`~distkit.errors.RankStalled`); the spawner names them, since a stopped rank records
    nothing itself (no-op elsewhere). A file of its own, so a failure recorded by the same rank at
    the same moment cannot overwrite it. ``how``: what the spawner's line says they did (default: no heartbeat for
    ``distributed.timeout_s``; the start-up guard's "during start-up: stopped ...",
    :mod:`distkit.launch.startup_watch`)."""
    directory = os.environ.get(FAILURE_DIR_VAR)
    if not directory:
        return
    try:
        with open(os.path.join(directory, f"stalled-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "time": time.time(), "stalled": list(getattr(exc, "stalled_ranks", [])),
                       "error": f"{type(exc).__name__}: {exc}"[:300], "how": how[:300]}, f)
    except OSError:
        pass


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is what a rank gets when *another* rank failed (its connection closed, a collective
    timed out, it stopped responding), rather than an error of its own."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return type(exc).__name__ in ("CollectiveTimeout", "RankStalled", "RankLost") or any(w in text for w in _PEER_WORDS)


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says this rank's connection to another rank broke (closed, reset, refused)."""
    text = str(exc).lower()
    return any(w in text for w in _CLOSED_WORDS)


def settle_if_peer(exc: BaseException, world_size: int) -> None:
    """A rank that failed only because a peer did waits :data:`SETTLE_S` before exiting, so that any
    launcher (distkit's spawner, torchrun, whose "Root Cause" is the earliest failure in whole seconds
    with ties going to the lowest rank) sees the rank that really failed exit first."""
    if world_size > 1 and lost_a_peer(exc):
        time.sleep(SETTLE_S)


def _stalls(directory: str) -> list[dict[str, Any]]:
    """The stall records (:func:`record_stall`) in ``directory``, earliest first."""
    found = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith("stalled-"):
            try:
                with open(os.path.join(directory, name)) as f:
                    found.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(found, key=lambda r: r["time"])


def verdict(directory: str, failed: list[tuple[int, int]]) -> tuple[int, int, str]:
    """``(rank, exit status, what happened)`` for the spawner's line about the failed job: the rank
    :func:`_culprit` names, "stopped responding" only when no error of its own was recorded for it and
    another rank saw its heartbeat stop (a rank with an ordinary exception is also seen as lost by its
    peers once it has exited: that must not turn its own error into "stopped responding")."""
    rank, code = _culprit(directory, failed)
    try:
        with open(os.path.join(directory, f"rank-{rank}.json")) as f:
            own = not json.load(f)["peer"]
    except (OSError, ValueError, KeyError):
        own = False
    stalls = [s for s in _stalls(directory) if rank in s["stalled"]]
    if stalls and not own:
        how = stalls[0].get("how") or "no heartbeat for distributed.timeout_s"
        return rank, code, f"stopped responding ({how}; noticed by rank {stalls[0]['rank']})"
    return rank, code, f"failed ({_describe(code)})"


def _culprit(directory: str, failed: list[tuple[int, int]]) -> tuple[int, int]:
    """The failed rank to name: the earliest with an error of its own; else the first rank another one
    saw stop responding (it may still run: stopped); else one that died without recording anything
    (killed, crashed); else the earliest; else the first the spawner saw."""
    records = []
    for rank, code in failed:
        try:
            with open(os.path.join(directory, f"rank-{rank}.json")) as f:
                records.append((json.load(f), code))
        except (OSError, ValueError):
            continue
    own = sorted((r["time"], r["rank"], c) for r, c in records if not r["peer"])
    if own:
        return own[0][1], own[0][2]
    for stall in _stalls(directory):
        if stall["stalled"]:
            return int(stall["stalled"][0]), dict(failed).get(int(stall["stalled"][0]), 1)
    recorded = {r["rank"] for r, _ in records}
    silent = [(r, c) for r, c in failed if r not in recorded]
    if silent:
        return silent[0]
    if records:
        first = min(records, key=lambda rc: rc[0]["time"])
        return first[0]["rank"], first[1]
    return failed[0]


def _all_agreed(directory: str, nprocs: int) -> bool:
    """Whether every rank recorded the same agreed error (:attr:`DistkitError.agreed`)."""
    for rank in range(nprocs):
        try:
            with open(os.path.join(directory, f"rank-{rank}.json")) as f:
                if not json.load(f).get("agreed"):
                    return False
        except (OSError, ValueError):
            return False
    return True


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
