"""Start-up cost of ``distkit train --nprocs N``: ranks forked from the launcher vs new interpreters.

    python benchmarks/startup.py [--pairs 5] [--nprocs 2] [--steps 20] [--engine ddp]

Runs the same short job (``configs/demo.py``: the digits task, ``--steps`` steps) alternately with
the ranks forked from the checked launching process (the default, :mod:`distkit.launch.forkrank`) and
with ``DISTKIT_RANK_START=exec`` (each rank a new ``python -m distkit``), ``--pairs`` times each,
and reports the median wall time of the whole command and the CPU time of it and its children
(user + system, from ``os.wait4``). Both runs of a pair must end with the same ``param_checksum``
(the start mode must not change the result); a pair that differs is an error.

Writes ``benchmarks/results/startup.json``.

``--first-step`` measures instead the **time to the first step** of ``distkit train`` on ``--engine`` in
``--mode`` grad or param against a hand-written loop: raw DDP under torchrun by default (``raw_ddp.py``), or with
``--baseline engine`` the engine's own (``raw_mpi.py``, ``raw_horovod.py``, ``raw_deepspeed.py`` under its
launcher); ``overhead.py``'s workload, charlm ``--size`` with ``--steps`` steps, alternating the two ``--pairs``
times: seconds from the launch of the command to the end of rank 0's first optimizer step (both sides record
``time.perf_counter()``, the system's monotonic clock, so the launcher's and the rank's instants compare), and
the whole command's wall time. Where both sides do the same work (the engine's own loop, grad mode) each pair
must end with the same ``param_checksum``. Writes ``benchmarks/results/first_step_<engine>[_param][_vs_<engine>].json``.
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
    p.add_argument("--engine", default="ddp", choices=("ddp", "deepspeed", "mpi", "horovod"),
                   help="forked vs new interpreters: ddp or deepspeed (mpi and horovod ranks are started by mpirun); "
                        "--first-step: any")
    p.add_argument("--first-step", action="store_true",
                   help="time to the first step against the engine's hand-written loop (--engine: any of the four)")
    p.add_argument("--size", default="small", choices=("small", "medium", "large"), help="--first-step: charlm size")
    p.add_argument("--mode", default="grad", choices=("grad", "param"),
                   help="--first-step: distkit's mode (param: param_sync_step 10)")
    p.add_argument("--baseline", default="ddp", choices=("ddp", "engine"),
                   help="--first-step: raw DDP under torchrun (issue 37's yardstick, the default) or the engine's "
                        "own hand-written loop under its launcher (then, in grad mode, the parameters must agree)")
    p.add_argument("--out", default=None, help="default results/startup.json, or first_step_<engine>.json")
    a = p.parse_args()
    if a.pairs < 1 or a.nprocs < 2 or a.steps < 1:
        print("startup: --pairs and --steps must be >= 1, --nprocs >= 2", file=sys.stderr)
        return 2
    if a.first_step:
        return first_step(a)
    if a.engine not in ("ddp", "deepspeed"):
        print(f"startup: forked vs new interpreters needs an engine distkit's spawner starts (ddp, deepspeed), "
              f"not {a.engine}; --first-step takes any", file=sys.stderr)
        return 2
    a.out = a.out or os.path.join(RESULTS, "startup.json")
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


def first_step(a: argparse.Namespace) -> int:
    """``--first-step``: distkit train against the hand-written loop, under the same launcher, alternately."""
    import overhead  # a sibling module (benchmarks/ is on sys.path)

    be = overhead.BACKENDS[a.engine]
    base = overhead.BACKENDS[a.engine if a.baseline == "engine" else "ddp"]
    # the same work on both sides only for the engine's own hand-written loop in grad mode (param mode averages
    # parameters instead; another engine's loop may round differently): then the checksums must agree
    same_work = base is be and a.mode == "grad"
    distributed = {"reduce_type": a.mode, **({"param_sync_step": 10} if a.mode == "param" else {})}
    args = argparse.Namespace(size=a.size, seq_len=64, batch_size=32, steps=a.steps, lr=0.1, seed=42,
                              bucket_cap_mb=25.0, zero_stage=2, threads=1, run_timeout=600.0, what_if=None,
                              nprocs=a.nprocs)
    runs: dict[str, list[dict[str, Any]]] = {"raw": [], "distkit": []}
    with tempfile.TemporaryDirectory(prefix="first_step_") as work:
        for i in range(a.pairs):
            for side in ("raw", "distkit") if i % 2 == 0 else ("distkit", "raw"):  # alternate who goes first
                rec = (overhead.run_raw(base, args, work, f"{side}-{i}") if side == "raw" else
                       overhead.run_distkit(be, args, work, f"{side}-{i}", distributed=distributed))
                r = {"first_step_s": rec["ends"][0] - rec["launched_at"], "wall_s": rec["process_wall_s"],
                     "checksum": rec["param_checksum"]}
                runs[side].append(r)
                print(f"pair {i + 1}/{a.pairs} {side:7}: first step at {r['first_step_s']:.2f} s, whole command "
                      f"{r['wall_s']:.2f} s", flush=True)
            if same_work and runs["raw"][-1]["checksum"] != runs["distkit"][-1]["checksum"]:
                print(f"startup: pair {i + 1}: distkit and the hand-written loop ended with different parameters",
                      file=sys.stderr)
                return 1
    med = {side: {k: statistics.median(r[k] for r in rs) for k in ("first_step_s", "wall_s")}
           for side, rs in runs.items()}
    result = {"workload": f"charlm {a.size}, {a.steps} steps, {a.nprocs} ranks, engine {a.engine} ({a.mode} mode) "
                          f"under {be.launcher_name}; baseline: raw_{base.name}.py under {base.launcher_name}",
              "engine": a.engine, "mode": a.mode, "baseline": f"raw_{base.name}", "same_work_checked": same_work,
              "median": med, "first_step_ratio": med["distkit"]["first_step_s"] / med["raw"]["first_step_s"],
              "wall_ratio": med["distkit"]["wall_s"] / med["raw"]["wall_s"], "runs": runs}
    out = a.out or os.path.join(RESULTS, f"first_step_{a.engine}{'_param' if a.mode == 'param' else ''}"
                                         f"{'' if base.name == 'ddp' else '_vs_' + base.name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("median", "first_step_ratio", "wall_ratio")}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
