"""Start a ``--nprocs`` rank as a fork of the launching process instead of a new interpreter.

The launching process (``distkit train CONFIG --nprocs N``) has already imported torch and
distkit and checked the config. A rank started with ``python -m distkit ...`` imports them
again: 1.5 s of CPU per rank on this 2-core machine, paid N times at once before the first
step. A fork starts from the imported state and runs :func:`distkit.commands.cli.main` with the rank's
environment, as the new interpreter would.

When it is safe, and only then (:func:`can_fork`): no Python thread besides the main one, CUDA
not initialised (a forked CUDA context is unusable), no module of the user's own code imported
by the launcher (any file outside the Python installation, the virtual environment and distkit:
its import-time code ran without the rank's environment, and importing it again could register
things twice, e.g. ``transformers.AutoConfig.register``), a POSIX ``os.fork``, and
``DISTKIT_RANK_START`` not set to ``exec``. Otherwise, and for users' own scripts, the rank is a
new interpreter (:func:`distkit.launch.spawner.spawn`). Config files are executed, not imported: each
rank executes its config again either way.

What differs from a new interpreter, and how it is made the same:
- the environment: the rank's variables go into ``os.environ`` (C ``getenv`` sees them);
- torch's thread count was read from ``OMP_NUM_THREADS`` when the launcher imported torch: set
  again from the rank's value;
- exit: the launcher's ``atexit`` handlers are not the rank's (they are cleared at the fork); the
  rank runs the ones registered while it ran, flushes logging and stdio, and ends with
  ``os._exit`` so that no frame of the launcher's (its ``finally`` blocks) runs in the rank;
- an uncaught exception goes to ``sys.excepthook`` (distkit's, for users' own loops) and exits 1;
  an uncaught KeyboardInterrupt ends the rank by SIGINT, as Python does.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, NoReturn, Optional

#: set to ``exec`` to start every rank as a new interpreter (the fallback; the old behaviour)
START_VAR = "DISTKIT_RANK_START"


class ForkedRank:
    """A rank started by :func:`start`: the part of :class:`subprocess.Popen`'s interface the spawner
    uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``: negative
    for a signal, as Popen's)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def can_fork() -> bool:
    """Whether a rank may be a fork of this process (see the module docstring)."""
    if os.environ.get(START_VAR, "").strip().lower() == "exec" or not hasattr(os, "fork"):
        return False
    if threading.active_count() != 1:  # a fork copies only the calling thread: another one's locks stay held
        return False
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return False
    return not _user_modules()


def _user_modules() -> list[str]:
    """Names of loaded modules whose file is the user's own code: outside the Python installation,
    the virtual environment (sys.prefix), site directories and distkit itself."""
    import site

    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                            # distkit itself: the package above this folder
                                            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                            *site.getsitepackages(), site.getusersitepackages()) if p}
    names = []
    for name, mod in list(sys.modules.items()):
        # Read from the module's own dict, past any __getattr__/__getattribute__ it defines: a lazy module's
        # attribute access imports its target (SpeechBrain's LazyModule raised ImportError for k2_fsa, ending
        # every --nprocs start in a process that had imported speechbrain), and distkit's own deferred modules
        # load on any attribute but their metadata.
        try:
            path = object.__getattribute__(mod, "__dict__").get("__file__")
        except (AttributeError, TypeError):  # an object in sys.modules without a dict: no file of the user's
            continue
        # __main__ is the command that started the launcher (distkit's); a relative __file__ is no file
        # (torch.ops, torch.classes: "_ops.py", "_classes.py")
        if not isinstance(path, str) or not os.path.isabs(path) or name in ("__main__", "__mp_main__"):
            continue
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in roots):
            names.append(name)
    return names


def preimport(engine: tuple[str, ...] = ()) -> None:
    """Import the engine's modules (``Strategy.before_forks``) in the launching process (before :func:`start`); a
    failure is left to the rank, and what follows it is not imported. ``torch._dynamo`` is deferred first
    (:func:`distkit.launch.lazy_import.defer_dynamo`: the ranks inherit the deferral) unless the engine lists it: then it is
    imported here, once, not once per rank (N ranks importing it at once on fewer cores than N wait for each other)."""
    import importlib

    from distkit.launch import lazy_import

    if "torch._dynamo" not in engine:
        lazy_import.defer_dynamo()
    for name in engine:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank imports it itself and reports what fails there
            return


def start(target: Callable[[], int], env: dict[str, str]) -> ForkedRank:
    """Fork; in the child, take ``env`` as the environment, run ``target()`` and exit with its status.
    Returns the child in the parent; never returns in the child."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else the child would print the parent's buffered text again
    pid = os.fork()
    if pid:
        return ForkedRank(pid)
    code = 1
    try:
        atexit._clear()  # the launcher's handlers are not this rank's
        os.environ.clear()
        os.environ.update(env)
        torch = sys.modules.get("torch")
        if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
        code = target()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        try:
            sys.excepthook(*sys.exc_info())
        except BaseException:
            pass
        code = 1
    end_process(code)  # (never unwinds into the launcher's frames)


def end_process(code: int) -> NoReturn:
    """End this process as the interpreter would, but without its teardown of every module (seconds of CPU for
    torch's): the ``atexit`` handlers, ``logging``'s, the MPI library's ``MPI_Finalize`` where mpi4py started
    it (mpi4py runs it from the C-level exit hook, which ``os._exit`` skips; ``mpirun`` reports a rank that
    exits without it as a failure), the standard streams flushed, then ``os._exit``. For a process whose own
    work is complete: a forked rank, or a training rank whose Session has closed."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
    except BaseException:
        pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        try:
            if mpi.Is_initialized() and not mpi.Is_finalized():
                mpi.Finalize()
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    if code < 0:  # died of a signal (KeyboardInterrupt): end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)
