"""``--nprocs N``: distkit starts N local ranks itself (perceptrain's ``nprocs``).

Each rank is a fresh ``python -m distkit`` process with torchrun's environment
variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT) plus ``DISTKIT_SPAWN_ID``.
The parent watches them: when one exits non-zero or is killed, it names that rank,
stops the others (SIGTERM, then SIGKILL after a grace period) and returns non-zero.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Optional

#: seconds between SIGTERM and SIGKILL when stopping the surviving ranks
GRACE_S = 5.0


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


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def spawn(argv: list[str], nprocs: int) -> int:
    """Run ``python -m distkit *argv`` as ``nprocs`` ranks; returns the exit status for the CLI."""
    port, spawn_id = free_port(), uuid.uuid4().hex[:12]
    threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DISTKIT_SPAWN_ID=spawn_id)
        env.setdefault("OMP_NUM_THREADS", threads)  # as torchrun: no oversubscription of the cores
        procs.append(subprocess.Popen([sys.executable, "-m", "distkit", *argv], env=env))

    stopping: dict[str, Optional[int]] = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            if stopping["signal"] is not None:
                print(f"distkit: {signal.Signals(stopping['signal']).name} received; stopping all ranks", file=sys.stderr, flush=True)
                _stop(procs)
                return 128 + int(stopping["signal"])
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"distkit: rank {rank} failed ({_describe(code)}); stopping the other ranks", file=sys.stderr, flush=True)
                _stop(procs)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
