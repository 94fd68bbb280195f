"""Fault injection for failure tests: real SIGKILLs and exceptions at a chosen step.

``DISTKIT_FAULT="RANK:STEP:KIND[:POINT]"`` (several: separated by commas) makes rank RANK, at optimizer step STEP, ``kill``
itself with SIGKILL, ``raise`` RuntimeError, ``hang`` (sleep forever in the main thread, to test
timeouts: its other threads go on), ``delay`` (sleep 5 s, then go on: a slow rank; ``delay=S`` sleeps S
seconds), ``stop`` itself with SIGSTOP (every thread frozen, as a stalled or cut-off process: see
:mod:`distkit.health.watchdog`) or send itself ``term`` (SIGTERM: a scheduler's preemption signal that reached
this rank alone, at a known step; see :mod:`distkit.health.preemption`). POINT is ``step`` (right after the
optimizer step, the default) or a point inside the checkpoint save of that step
(:func:`distkit.checkpoint.write`, in order): ``rank_file`` (this rank's ``.part`` file
complete, not renamed), ``checkpoint`` (this rank's file in place, before the manifest),
``manifest`` (rank 0: the manifest written, the directory still under its temporary name),
``swap`` (rank 0, re-saving an existing step: the old directory moved aside, the new one not yet
in place), ``latest`` (rank 0: the checkpoint complete, ``latest`` not yet replaced), or ``start`` (with STEP 0: the mpi and
horovod engines, before their start-up guard runs: a rank stopped there is one stopped before its start-up, as one
still importing torch; :func:`distkit.backends.startup.startup_guard`), or ``init``
(with STEP 0: the mpi engine's start-up, before ``MPI_Init``, inside the guard), or ``setup`` (with STEP 0: the trainer's set-up, the
engine joined and the model set up, before rank 0 picks the checkpoint), or ``close`` (the end of the run:
``Session.close`` after its last barrier; STEP = the steps taken), or ``left`` (later in ``Session.close``: the
rank has marked itself as leaving, the engine torn down, its exit next), or ``exchange`` (fault tolerance: inside the
sync of step STEP across replica groups, its quorum formed, the exchange not yet started). Read once
at import; unset in normal runs, where it costs one comparison.

``DISTKIT_FAULT_UNTIL=PATH``: a ``delay`` ends as soon as PATH exists (a test's "wait until the other job is
up", checked every 0.1 s; still at most its S seconds).

``DISTKIT_FAULT_STAMP=PATH``: just before firing, the rank writes ``PID TIME`` (``time.time()``,
seconds) to PATH, so a test can time the job's end from the fault and check that the process is gone.

In both paths ``{step}`` stands for the fault's step: several delays of one rank, each released by its own file.

``DISTKIT_FAULT_STORE=PATH``: rank 0 writes ``HOST PORT`` of the heartbeat store it serves to PATH, so a test can
play a stranger who reaches the store (it learns the address, not the job's token: docs/security.md).
"""
from __future__ import annotations

import os
import signal
import time

_KINDS = ("kill", "raise", "hang", "delay", "stop", "term")
_POINTS = ("step", "rank_file", "checkpoint", "manifest", "swap", "latest", "start", "init", "store", "setup", "close",
           "left", "exchange")


def parse(spec: str) -> list[tuple[int, int, str, str]]:
    """(rank, step, kind, point) of each fault of ``spec`` (the module's docstring); ValueError with the one line
    naming the fix for a spec that is none (a traceback at import before: :func:`check` raises it as bad input)."""
    faults = []
    for one in spec.split(","):
        if not one.strip():
            continue
        p = one.strip().split(":")
        kind, _, seconds = p[2].partition("=") if len(p) > 2 else ("", "", "")
        try:
            ok = 3 <= len(p) <= 4 and int(p[0]) >= 0 and int(p[1]) >= 0 and kind in _KINDS and (
                not seconds or (kind == "delay" and float(seconds) >= 0)) and (len(p) == 3 or p[3] in _POINTS)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"DISTKIT_FAULT={spec!r}: {one.strip()!r} is no fault RANK:STEP:KIND[:POINT] (KIND one of "
                             f"{', '.join(_KINDS)} or delay=S; POINT one of {', '.join(_POINTS)}; several separated by "
                             "commas): fix it, or unset DISTKIT_FAULT (it injects failures for tests)")
        faults.append((int(p[0]), int(p[1]), p[2], p[3] if len(p) > 3 else "step"))
    return faults


_SPEC = os.environ.get("DISTKIT_FAULT", "")
try:
    #: (rank, step, kind, point) of each fault: several are separated by commas
    _FAULTS = parse(_SPEC)
    _BAD = ""
except ValueError as e:  # raised as bad input by check(), where the entry points call it
    _FAULTS, _BAD = [], str(e)
_STAMP = os.environ.get("DISTKIT_FAULT_STAMP", "")
_UNTIL = os.environ.get("DISTKIT_FAULT_UNTIL", "")
_STORE = os.environ.get("DISTKIT_FAULT_STORE", "")
#: seconds a ``delay`` fault sleeps (unless it says: ``delay=S``)
DELAY_S = 5.0


def check() -> None:
    """ConfigError (bad input: one line, exit 2) if ``DISTKIT_FAULT`` is set to no fault spec."""
    if _BAD:
        from distkit.errors import ConfigError

        raise ConfigError(_BAD)


def maybe_fire(rank: int, step: int, point: str = "step") -> None:
    """Fire each configured fault whose rank, step and point these are (a malformed spec: ConfigError)."""
    if _BAD:
        check()
    for f_rank, f_step, kind, f_point in _FAULTS:
        if rank == f_rank and step == f_step and point == f_point:
            _fire(kind, step)


def note_store(host: str, port: int) -> None:
    """Rank 0 serves the heartbeat store at ``host``:``port``: written to ``DISTKIT_FAULT_STORE``'s path if set."""
    if _STORE:
        with open(_STORE + ".tmp", "w") as f:
            f.write(f"{host} {port}\n")
        os.replace(_STORE + ".tmp", _STORE)


def _fire(kind: str, step: int) -> None:
    """Fire one fault of kind ``kind`` (the module's docstring) now, at step ``step``."""
    if _STAMP:
        with open(_STAMP.replace("{step}", str(step)), "w") as f:
            f.write(f"{os.getpid()} {time.time():.3f}\n")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "raise":
        raise RuntimeError(f"injected fault at step {step} (DISTKIT_FAULT={_SPEC})")
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind.startswith("delay"):
        end = time.monotonic() + float(kind.partition("=")[2] or DELAY_S)
        until = _UNTIL.replace("{step}", str(step))
        while time.monotonic() < end and not (until and os.path.exists(until)):
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
