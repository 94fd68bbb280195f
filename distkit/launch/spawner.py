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
``mpirun`` instead (:func:`distkit.launch.mpi_launch.mpirun`), which ends the job itself when a rank fails;
distkit names the rank after it the same way.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Optional

from distkit.env import free_port as env_free_port
from distkit.launch.failures import (  # noqa: F401  (the ranks, the watchdog and tests import them from here)
    FAILURE_DIR_VAR, SETTLE_S, _all_agreed, _culprit, _describe, _stalls, connection_lost, lost_a_peer, record_failure,
    record_stall, settle_if_peer, verdict)
from distkit.launch.mpi_launch import _threads, mpirun, mpirun_path  # noqa: F401  (mpirun_path: envreport's)
from distkit.launch.procfs import is_stopped

#: seconds between SIGTERM and SIGKILL when stopping the surviving ranks
GRACE_S = 5.0
#: seconds the spawner waits for the ranks to stop after it passed a preemption signal on to them
#: (schedulers kill a job some seconds after that signal: SLURM's KillWait is 30 s by default)
PREEMPT_WAIT_S = 120.0
def free_port() -> int:
    """A free loopback port for a rendezvous (:func:`distkit.env.free_port`: outside the ephemeral range)."""
    return env_free_port("127.0.0.1")


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
