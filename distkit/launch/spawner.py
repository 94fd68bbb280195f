"""``--nprocs N``: distkit starts N local ranks itself (perceptrain's ``nprocs``).

Each rank is a fresh copy of the command (``python -m distkit ...`` for the CLI, the user's
``python train.py ...`` for a script calling :func:`distkit.init`) with torchrun's
environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) plus
``DISTKIT_SPAWN_ID``; where it is safe, a fork of this process that runs the command in place
instead (:mod:`distkit.launch.forkrank`: no second import of torch per rank; a script runs again from its
first line, :func:`script_target`). The parent
watches them: when one exits non-zero or is killed, it names that rank, stops the others
(SIGTERM, then SIGKILL after a grace period) and returns non-zero. A rank that stopped
responding (:mod:`distkit.health.watchdog`: another rank recorded it) is named instead of the rank that
noticed, and killed with SIGKILL at once, as is any rank found stopped (SIGSTOP): a stopped
process never acts on SIGTERM. Engines that need an MPI launcher (mpi, horovod) are started under
``mpirun`` instead (:func:`mpirun`), which does the same watching.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Optional

from distkit.launch import ompi_leftovers
from distkit.launch.procfs import is_stopped

#: seconds between SIGTERM and SIGKILL when stopping the surviving ranks
GRACE_S = 5.0
#: seconds the spawner waits for the ranks to stop after it passed a preemption signal on to them
#: (schedulers kill a job some seconds after that signal: SLURM's KillWait is 30 s by default)
PREEMPT_WAIT_S = 120.0
#: seconds the spawner waits after the first failed rank for the others' failure records (see _culprit)
SETTLE_S = 1.0
#: where a spawned rank records why it failed (set by :func:`spawn`)
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


def record_stall(rank: int, exc: BaseException) -> None:
    """Under distkit's spawner: rank ``rank`` saw the ranks in ``exc.stalled_ranks`` stop responding
    (:class:`~distkit.errors.RankStalled`); the spawner names them, since a stopped rank records
    nothing itself (no-op elsewhere). A file of its own, so a failure recorded by the same rank at
    the same moment cannot overwrite it."""
    directory = os.environ.get(FAILURE_DIR_VAR)
    if not directory:
        return
    try:
        with open(os.path.join(directory, f"stalled-{rank}.json"), "w") as f:
            json.dump({"rank": rank, "time": time.time(), "stalled": list(getattr(exc, "stalled_ranks", [])),
                       "error": f"{type(exc).__name__}: {exc}"[:300]}, f)
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
        return rank, code, f"stopped responding (no heartbeat for distributed.timeout_s; noticed by rank {stalls[0]['rank']})"
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _stop(procs: list[Any], kill: frozenset[int] = frozenset()) -> None:
    """SIGTERM to every rank still running, SIGKILL after :data:`GRACE_S`; SIGKILL at once to the ranks
    in ``kill`` and to stopped ones (a stopped process acts on SIGTERM only once continued)."""
    for rank, p in enumerate(procs):
        if p.poll() is None:
            if rank in kill or is_stopped(p.pid):
                p.kill()
            else:
                p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def relaunch_command() -> list[str]:
    """The command line that started this Python process (script or ``-m module``), to start it again.

    The arguments are the original ones (``sys.orig_argv``): a script that removes distkit's flags from
    ``sys.argv`` before its own parser (nanoGPT's configurator) must get them again in every rank."""
    orig = getattr(sys, "orig_argv", None)
    if orig and len(orig) > 1:
        return [sys.executable, *orig[1:]]
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name[:-len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", name, *sys.argv[1:]]
    return [sys.executable, *sys.argv]


#: interpreter options that take the next argument as their value (``python -W error script.py``)
_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def script_target() -> Optional[Callable[[], int]]:
    """What :func:`relaunch_command` starts, as a function a fork of this process can call instead: the user's
    script (``python script.py ARGS``) or module (``python -m name ARGS``) run again from its first line as
    ``__main__`` (:mod:`runpy`) with the original arguments, as the new interpreter would, but with torch, distkit
    and the engine's modules already imported (about 1.5 s of CPU per rank for torch alone, paid by every rank at
    once on the same cores). :func:`spawn` forks only where :func:`distkit.launch.forkrank.can_fork` allows it: in
    particular not once the script has imported a module of the user's own (a file beside it: its import-time code
    ran here, without the rank's environment), which is left to a new interpreter. None where the command is not
    a script or module (``python -c``, standard input, an interactive session) or is not the one running here."""
    orig = list(getattr(sys, "orig_argv", None) or [])
    main = sys.modules.get("__main__")
    i = 1
    while i < len(orig) and orig[i].startswith("-") and orig[i] not in ("-", "-m", "-c"):
        i += 2 if orig[i] in _OPTIONS_WITH_VALUE else 1
    if main is None or i >= len(orig) or orig[i] in ("-", "-c") or "i" in "".join(
            a[1:] for a in orig[1:i] if a.startswith("-") and not a.startswith("--")):
        return None  # (-i: the new interpreter would stay interactive after the script)
    import runpy

    if orig[i] == "-m":
        spec = getattr(main, "__spec__", None)
        if i + 1 >= len(orig) or spec is None or spec.name not in (orig[i + 1], orig[i + 1] + ".__main__"):
            return None
        name, args = orig[i + 1], orig[i + 2:]

        def run_module() -> int:
            sys.argv = [getattr(main, "__file__", None) or name, *args]
            return _as_main(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True),
                            getattr(main, "__file__", None))
        return run_module
    path, args = orig[i], orig[i + 1:]
    here = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or not isinstance(here, str) or not os.path.isfile(path) \
            or os.path.realpath(here) != os.path.realpath(path):
        return None

    def run_script() -> int:
        sys.argv = [path, *args]
        return _as_main(lambda: runpy.run_path(path, run_name="__main__"), path)
    return run_script


def _as_main(run: Callable[[], Any], path: Optional[str]) -> int:
    """Run ``run`` (the script, by runpy) and return 0, or hand an uncaught exception to ``sys.excepthook`` with
    the traceback starting at the script's own first frame (a new interpreter shows no frame of runpy, the
    spawner or this function) and return 1, as the interpreter does. SystemExit and KeyboardInterrupt go up."""
    try:
        run()
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - what the interpreter does with any uncaught exception
        tb = e.__traceback__
        while tb is not None and path is not None and \
                os.path.realpath(tb.tb_frame.f_code.co_filename) != os.path.realpath(path):
            tb = tb.tb_next
        sys.excepthook(type(e), e, tb if tb is not None else e.__traceback__)
        return 1
    return 0


def _threads(nprocs: int) -> str:
    """OMP_NUM_THREADS per rank, as torchrun: the cores shared out, no oversubscription."""
    return str(max(1, (os.cpu_count() or 1) // nprocs))


#: at most this many local ranks per CPU core (:func:`check_nprocs`)
RANKS_PER_CPU = 64


def check_nprocs(nprocs: int) -> None:
    """ConfigError (exit status 2, before any rank starts) for more local ranks than :data:`RANKS_PER_CPU`
    times the CPU count. Each rank is a whole Python process with torch loaded (hundreds of MB) and all
    start at once: ``--nprocs 10000`` (a typo, or a global count meant for a cluster) would fork until
    fork() or memory fails, leaving thousands of processes to clean up. 64 per core is far past any
    useful oversubscription, and still allows running many small ranks on a small machine for tests."""
    limit = RANKS_PER_CPU * (os.cpu_count() or 1)
    if nprocs > limit:
        from distkit.errors import ConfigError

        raise ConfigError(f"--nprocs {nprocs} is more local ranks than this machine can start ({limit}: "
                          f"{RANKS_PER_CPU} per CPU core, {os.cpu_count() or 1} cores): use at most one rank per "
                          "device or core, and a launcher (torchrun, mpirun, srun) to run more ranks on several hosts")


def run_local(cmd: list[str], nprocs: int, launcher: str, target: Optional[Callable[[], int]] = None,
              preemptible: bool = False, preimport: tuple[str, ...] = ()) -> int:
    """Run ``cmd`` as ``nprocs`` local ranks with ``launcher`` ("spawn" or "mpirun"); returns the exit status.
    ``target``: what ``cmd`` runs, callable in this process (see :func:`spawn`; ``preimport`` too). ``preemptible``:
    the ranks stop with a checkpoint on SIGTERM/SIGUSR1 (:mod:`distkit.health.preemption`): pass those on and wait.
    ConfigError for a number of ranks this machine cannot start (:func:`check_nprocs`)."""
    check_nprocs(nprocs)
    if launcher == "mpirun":
        return mpirun(cmd, nprocs, preemptible)
    return spawn(cmd, nprocs, target, preemptible, preimport)


def mpirun_path() -> Optional[str]:
    """The ``mpirun`` distkit starts: beside this Python first (the venv's Open MPI wheel), then on PATH."""
    return shutil.which("mpirun", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))


def mpirun(cmd: list[str], nprocs: int, preemptible: bool = False) -> int:
    """``mpirun -np N --bind-to none CMD``: Open MPI starts the ranks and ends the job when one fails.

    ``--bind-to none``: Open MPI would pin every rank to one core of its own, or all to core 0 when
    it miscounts; the ranks here share the machine's cores like torchrun's. ``--oversubscribe``: more
    ranks than cores is what ``--nprocs`` asked for (as under the spawner); Open MPI refuses it otherwise.

    Signals are passed on to mpirun, which passes them to the ranks. With ``preemptible`` (the ranks
    stop with a checkpoint, :mod:`distkit.health.preemption`) the first SIGTERM goes on as SIGUSR1: mpirun
    forwards SIGUSR1 and waits for the ranks, where on SIGTERM it also ends the job itself a moment
    later (measured: the ranks' last line lost, its own exit status).
    """
    exe = mpirun_path()
    if exe is None:
        from distkit.errors import BackendUnavailable

        raise BackendUnavailable("--nprocs with an MPI engine needs Open MPI's mpirun: pip install 'distkit[mpi]' "
                                 "(or launch the ranks yourself with mpirun -np N)")
    env = dict(os.environ)
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
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def spawn(cmd: list[str], nprocs: int, target: Optional[Callable[[], int]] = None, preemptible: bool = False,
          preimport: tuple[str, ...] = ()) -> int:
    """Run ``cmd`` as ``nprocs`` ranks (torchrun's environment variables); returns the exit status.

    With ``target`` (a function of this process that does what ``cmd`` would, returning its exit
    status), each rank is a fork of this process that calls it, where that is safe
    (:func:`distkit.launch.forkrank.can_fork`): no second import of torch per rank, nor of ``preimport`` (the engine's
    modules every rank imports: ``Strategy.before_forks``), imported here first. Else a new ``cmd``.

    SIGINT and SIGTERM stop every rank (SIGTERM, then SIGKILL after :data:`GRACE_S`). With ``preemptible``
    (the ranks handle a preemption, :mod:`distkit.health.preemption`) the first SIGTERM or SIGUSR1 is passed on to
    every rank instead, and the ranks are waited for as usual (they stop after an agreed step with a
    checkpoint, status 75), for at most :data:`PREEMPT_WAIT_S`; a second signal stops them at once.
    """
    from distkit.launch import forkrank

    in_place = target if target is not None and forkrank.can_fork() else None
    if in_place is not None and nprocs > 1:
        forkrank.preimport(preimport)
        in_place = in_place if forkrank.can_fork() else None
    port, spawn_id = free_port(), uuid.uuid4().hex[:12]
    threads = _threads(nprocs)
    failures = tempfile.mkdtemp(prefix="distkit-failures-")
    procs: list[Any] = []  # subprocess.Popen or forkrank.ForkedRank: the same calls
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DISTKIT_SPAWN_ID=spawn_id, **{FAILURE_DIR_VAR: failures})
        if not env.get("OMP_NUM_THREADS", "").strip():  # as torchrun: no oversubscription of the cores
            env["OMP_NUM_THREADS"] = threads
        procs.append(forkrank.start(in_place, env) if in_place is not None else subprocess.Popen(cmd, env=env))

    stopping: dict[str, Optional[int]] = {"signal": None}
    passed_on: dict[str, float] = {}  # when a preemption signal was passed on to the ranks

    def on_signal(signum: int, _frame: object) -> None:
        if preemptible and signum != signal.SIGINT and not passed_on:
            passed_on["at"] = time.monotonic()
            for p in procs:
                with contextlib.suppress(OSError):
                    p.send_signal(signum)
            return
        stopping["signal"] = signum

    signals = (signal.SIGINT, signal.SIGTERM, *((signal.SIGUSR1,) if preemptible else ()))
    old = {s: signal.signal(s, on_signal) for s in signals}
    stopped_since = 0.0  # since when every rank still running has been stopped (SIGSTOP)
    try:
        while True:
            if passed_on and time.monotonic() - passed_on["at"] > PREEMPT_WAIT_S:
                stopping["signal"] = signal.SIGTERM  # the ranks did not stop in time: as without preemption
            if stopping["signal"] is not None:
                print(f"distkit: {signal.Signals(stopping['signal']).name} received; stopping all ranks", file=sys.stderr, flush=True)
                _stop(procs)
                return 128 + int(stopping["signal"])
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # The first rank seen dead may only have lost its peer: let the others finish failing
                # (briefly), then name the one whose error came first and was its own. A stopped rank
                # never ends by itself: no waiting for it.
                deadline = time.monotonic() + SETTLE_S
                while time.monotonic() < deadline and any(p.poll() is None and not is_stopped(p.pid) for p in procs):
                    time.sleep(0.05)
                codes = [p.poll() for p in procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if len(failed) == nprocs and _all_agreed(failures, nprocs):
                    return failed[0][1]  # one error every rank agreed on: rank 0 printed it, nothing to add
                rank, code, what = verdict(failures, failed)
                stalled = frozenset(r for s in _stalls(failures) for r in s["stalled"])
                print(f"distkit: rank {rank} {what}; stopping the other ranks", file=sys.stderr, flush=True)
                _stop(procs, stalled)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            left = [r for r, c in enumerate(codes) if c is None]
            if len(left) < nprocs and all(is_stopped(procs[r].pid) for r in left):
                # Some ranks finished (exit 0) and every other one is stopped (SIGSTOP): it will never end by
                # itself, and nothing else is left to notice (its peers' watchdogs are gone). A second to be sure.
                stopped_since = stopped_since or time.monotonic()
                if time.monotonic() - stopped_since >= 1.0:
                    names = ", ".join(str(r) for r in left)
                    print(f"distkit: rank{'s' * (len(left) > 1)} {names} stopped responding (stopped) while the job "
                          "ended, after the other ranks finished; ending it: the job exits non-zero",
                          file=sys.stderr, flush=True)
                    for r in left:
                        with contextlib.suppress(OSError):
                            procs[r].kill()
                        procs[r].wait()
                    return 1
            else:
                stopped_since = 0.0
            time.sleep(0.05)
    finally:
        shutil.rmtree(failures, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
