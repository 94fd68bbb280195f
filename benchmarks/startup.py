"""Start-up cost of ``distkit train --nprocs N``: ranks forked from the launcher vs new interpreters.

    python benchmarks/startup.py [--pairs 5] [--nprocs 2] [--steps 20] [--engine ddp]

Runs the same short job (``configs/demo.py``: the digits task, ``--steps`` steps) alternately with
the ranks forked from the checked launching process (the default, :mod:`distkit.forkrank`) and
with ``DISTKIT_RANK_START=exec`` (each rank a new ``python -m distkit``), ``--pairs`` times each,
and reports the median wall time of the whole command and the CPU time of it and its children
(user + system, from ``os.wait4``). Both runs of a pair must end with the same ``param_checksum``
(the start mode must not change the result); a pair that differs is an error.

Writes ``benchmarks/results/startup.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from runenv import ROOT, child_env

RESULTS = os.path.join(ROOT, "benchmarks", "results")


def one(mode: str, nprocs: int, steps: int, engine: str, out: str) -> dict[str, Any]:
    """One run; its wall time (s), CPU time of the command and its ranks (s) and checksum."""
    env = child_env(DISTKIT_RANK_START=mode)
    cmd = [sys.executable, "-m", "distkit", "train", os.path.join(ROOT, "configs", "demo.py"), "--nprocs", str(nprocs),
           "++max_steps", str(steps), "++output_dir", out, "++progress_bar", "False", "++resume", "none",
           "++distributed", json.dumps({"backend": engine})]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert p.stderr is not None
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {' '.join(cmd)}\n{err[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        checksum = json.load(f)["param_checksum"]
    # wait4's rusage of a child includes its own waited-for children (the ranks)
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "checksum": checksum}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--engine", default="ddp", choices=("ddp", "deepspeed"),
                   help="an engine distkit's spawner starts (mpi and horovod ranks are started by mpirun)")
    p.add_argument("--out", default=os.path.join(RESULTS, "startup.json"))
    a = p.parse_args()
    if a.pairs < 1 or a.nprocs < 2 or a.steps < 1:
        print("startup: --pairs and --steps must be >= 1, --nprocs >= 2", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {"fork": [], "exec": []}
    with tempfile.TemporaryDirectory(prefix="startup_") as work:
        for i in range(a.pairs):
            for mode in ("fork", "exec") if i % 2 == 0 else ("exec", "fork"):  # alternate who goes first
                r = one(mode, a.nprocs, a.steps, a.engine, os.path.join(work, f"{mode}-{i}"))
                runs[mode].append(r)
                print(f"pair {i + 1}/{a.pairs} {mode:4}: {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU", flush=True)
            if runs["fork"][-1]["checksum"] != runs["exec"][-1]["checksum"]:
                print(f"startup: pair {i + 1}: the forked and exec'd runs ended with different parameters",
                      file=sys.stderr)
                return 1
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")} for m, rs in runs.items()}
    result = {"workload": f"configs/demo.py, {a.steps} steps, --nprocs {a.nprocs}, engine {a.engine}",
              "median": med, "wall_ratio_fork_vs_exec": med["fork"]["wall_s"] / med["exec"]["wall_s"],
              "cpu_ratio_fork_vs_exec": med["fork"]["cpu_s"] / med["exec"]["cpu_s"], "runs": runs}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("median", "wall_ratio_fork_vs_exec", "cpu_ratio_fork_vs_exec")}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
