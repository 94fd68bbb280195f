"""Goodput of fault-tolerant replica groups (torchft) against today's restart from a checkpoint.

    python benchmarks/goodput.py [--groups 3] [--steps 1500] [--sync 25] [--every 20,40] [--restart-after 5]
                                 [--checkpoint-every 100] [--size small] [--out results/goodput.json]

Workload: the charlm task (``--size``), ``--groups`` groups of 1 rank, ``--steps`` optimizer steps each, param
mode with a sync every ``--sync`` steps. Two ways to run it, each first without failures and then with a failure
every F seconds (``--every``, a list: the sweep) and the failed part back R seconds later (``--restart-after``):

* **fault-tolerant** (``fault_tolerance``, a ``distkit lighthouse``): every group a process of its own; a failure
  SIGKILLs one random group, which is started again R s later with the same command and heals at its next
  sync; the other groups train on.
* **restart** (today): one job of ``--groups`` ranks (``--nprocs``), checkpoint every ``--checkpoint-every``
  steps; a failure SIGKILLs one random rank, which ends the whole job; R s later it is started again with
  ``++resume auto``.

Goodput = useful samples per second with failures / samples per second without. The restarted job recomputes
what it lost, so all its samples are useful: its goodput is the time without failures / the time with. In the
fault-tolerant run a killed group loses its steps since its last sync and its restart's steps before the heal
(:func:`useful_steps`): ``goodput_ft_useful`` counts only useful samples; ``goodput_ft`` is the plain time ratio
(on a machine with fewer cores than groups it flatters: a dead group leaves its core to the others). Quality: the final eval loss against the run without failures. Failures start F
s after the first launch and stop once a group (or the job) has reached 70 % of its steps, so that no failure
restarts a group whose peers have finished (it would train alone from the start). Writes the JSON (``--out``, default a fresh temp directory) and a
PNG next to it when matplotlib is installed (``pip install 'distkit[bench]'``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from distkit.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
#: no failure once a group (or the job) is this far: a group restarted after the others finished would train alone
#: from the start (there is nobody left to heal from), which measures nothing
LAST_FAILURE = 0.7


def _common(args: argparse.Namespace) -> list[str]:
    return ["train", os.path.join(ROOT, "configs", "returnn_ddp.py"), "++task", "charlm", "++charlm_size", args.size,
            "++max_steps", str(args.steps), "++log_every", "50", "++progress_bar", "False",
            "++distributed", f"{{'reduce_type': 'param', 'param_sync_step': {args.sync}}}"]


def _start(cmd: list[str], log: str) -> "subprocess.Popen[bytes]":
    with open(log, "ab") as f:
        return subprocess.Popen([PY, "-m", "distkit", *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _kill(p: "subprocess.Popen[bytes]") -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _progress(out: str) -> int:
    """The last step in ``out``'s metrics.jsonl (0 when none)."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            steps = [json.loads(line).get("step", 0) for line in f if line.strip()]
    except (OSError, ValueError):
        return 0
    return max(steps, default=0)


def _summary(out: str) -> dict[str, Any]:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def fault_tolerant(args: argparse.Namespace, work: str, every: Optional[float]) -> dict[str, Any]:
    """One fault-tolerant run; a failure every ``every`` seconds (None: none)."""
    port = free_port()
    lh = subprocess.Popen([PY, "-m", "distkit", "lighthouse", "--port", str(port), "--join-timeout", "30",
                           "--heartbeat-timeout", "2"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the lighthouse did not start")
            time.sleep(0.1)
    out = os.path.join(work, "ft" if every is None else f"ft-every{every:g}")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(args.seed)
    cmds = [[*_common(args), "++output_dir", out, "++fault_tolerance",
             f"{{'lighthouse': 'http://127.0.0.1:{port}', 'replica_id': {i}, 'num_replicas': {args.groups}}}"]
            for i in range(args.groups)]
    logs = [os.path.join(out, f"group-{i}.log") for i in range(args.groups)]
    t0 = time.monotonic()
    procs = [_start(c, log) for c, log in zip(cmds, logs)]
    failures: list[dict[str, Any]] = []
    next_failure = t0 + every if every else float("inf")
    down: Optional[tuple[int, float]] = None  # (group, when to start it again)
    try:
        while True:
            now = time.monotonic()
            if down is not None and now >= down[1]:
                procs[down[0]] = _start(cmds[down[0]], logs[down[0]])
                down = None
            done = [p.poll() is not None and p.returncode == 0 for p in procs]
            if all(done) and down is None:
                break
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0) and not (down and down[0] == i) and not any(f["group"] == i and
                                                                                       f["t"] > now - 1 for f in failures):
                    raise RuntimeError(f"group {i} failed on its own (exit {p.returncode}): see {logs[i]}")
            near_end = max(_progress(os.path.join(out, f"group-{i}")) for i in range(args.groups)) >= LAST_FAILURE * args.steps
            if now >= next_failure and down is None and not near_end and not any(done):
                victim = rng.randrange(args.groups)
                _kill(procs[victim])
                failures.append({"t": round(now - t0, 2), "group": victim,
                                 "step": _progress(os.path.join(out, f"group-{victim}"))})
                down = (victim, now + args.restart_after)
                next_failure = now + every  # type: ignore[operator]
            time.sleep(0.2)
        wall = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
        _kill(lh)
    sums = [_summary(os.path.join(out, f"group-{i}")) for i in range(args.groups)]
    return {"wall_s": wall, "failures": failures, "eval_loss": sums[0]["eval_loss"],
            "useful_steps": useful_steps(logs, failures, args.steps, args.sync),
            "same_model": len({s["param_checksum"] for s in sums}) == 1,
            "heals": sum(s["fault_tolerance"]["heals"] for s in sums),
            "membership": sums[0]["fault_tolerance"]["membership"]}


def useful_steps(logs: list[str], failures: list[dict[str, Any]], steps: int, sync: int) -> int:
    """Optimizer steps whose work reached the final model, over the groups, from each group's log (every life of
    it, appended) and the failures: a life counts from its start (step 0, or the step it healed at) to its last
    sync before it was killed (the step of the kill, read from metrics.jsonl every 50 steps, rounded down to a
    sync), or to ``steps`` for the life that finished. What a restarted life trained before its heal was replaced,
    and what a killed life trained after its last sync was lost: neither counts."""
    total = 0
    for g, log in enumerate(logs):
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
        lives: list[int] = []  # the step each life started its useful work at
        for line in lines:
            if line.startswith("distkit: ") and "/param on " in line and " rank(s) via " in line:  # a life starts
                lives.append(0)
            elif line.startswith("distkit: sync at step ") and "healed" in line and lives:
                lives[-1] = int(line.split()[4].rstrip(":"))
        kills = [f["step"] for f in failures if f["group"] == g]
        for i, start in enumerate(lives):
            end = (kills[i] // sync) * sync if i < len(kills) else steps
            total += max(0, end - start)
    return total


def restart(args: argparse.Namespace, work: str, every: Optional[float]) -> dict[str, Any]:
    """One job of ``--groups`` ranks restarted from its last checkpoint after each failure."""
    out = os.path.join(work, "restart" if every is None else f"restart-every{every:g}")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(args.seed)
    cmd = [*_common(args), "--nprocs", str(args.groups), "++output_dir", out, "++checkpoint_every",
           str(args.checkpoint_every)]
    log = os.path.join(out, "job.log")
    t0 = time.monotonic()
    failures: list[dict[str, Any]] = []
    next_failure = t0 + every if every else float("inf")
    proc = _start(cmd, log)
    try:
        while True:
            now = time.monotonic()
            code = proc.poll()
            if code == 0:
                break
            if code is not None:  # (a failure this script caused is followed by the restart at once, below)
                raise RuntimeError(f"the job failed on its own (exit {code}): see {log}")
            near_end = _progress(out) >= LAST_FAILURE * args.steps
            if now >= next_failure and code is None and not near_end:
                ranks = _rank_pids(proc.pid)
                if ranks:
                    victim = rng.choice(ranks)
                    os.kill(victim, signal.SIGKILL)
                    proc.wait()
                    failures.append({"t": round(now - t0, 2), "step": _progress(out)})
                    time.sleep(args.restart_after)
                    proc = _start([*cmd, "++resume", "auto"], log)
                    next_failure = time.monotonic() + every  # type: ignore[operator]
            time.sleep(0.2)
        wall = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            _kill(proc)
    return {"wall_s": wall, "failures": failures, "eval_loss": _summary(out)["eval_loss"]}


def _rank_pids(parent: int) -> list[int]:
    """The pids of the ranks the spawner started (its children)."""
    try:
        with open(f"/proc/{parent}/task/{parent}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def plot(rows: list[dict[str, Any]], out: str, restart_after: float) -> None:
    """The sweep as a PNG next to ``out`` (nothing without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["every_s"] for r in rows]
    ax.plot(xs, [r["goodput_ft_useful"] for r in rows], "o-", label="fault-tolerant groups (torchft)")
    ax.plot(xs, [r["goodput_restart"] for r in rows], "s-", label="restart from checkpoint")
    ax.set_xlabel(f"seconds between failures (back after {restart_after:g} s)")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(out)[0] + ".png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--sync", type=int, default=25)
    p.add_argument("--every", default="20,40", help="seconds between failures, a comma-separated sweep")
    p.add_argument("--restart-after", dest="restart_after", type=float, default=5.0)
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=100)
    p.add_argument("--size", choices=["small", "medium"], default="small")
    p.add_argument("--seed", type=int, default=0, help="which group or rank each failure hits")
    p.add_argument("--out", default=None, help="result JSON (default: a fresh temp directory)")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="distkit-goodput-")
    result: dict[str, Any] = {"args": vars(args), "fault_tolerant": {}, "restart": {}}
    base_ft, base_rs = fault_tolerant(args, work, None), restart(args, work, None)
    result["fault_tolerant"]["none"], result["restart"]["none"] = base_ft, base_rs
    print(f"no failures: fault-tolerant {base_ft['wall_s']:.1f} s, one job {base_rs['wall_s']:.1f} s", flush=True)
    rows = []
    for every in [float(x) for x in args.every.split(",")]:
        ft, rs = fault_tolerant(args, work, every), restart(args, work, every)
        result["fault_tolerant"][f"{every:g}"], result["restart"][f"{every:g}"] = ft, rs
        row = {"every_s": every, "goodput_ft": base_ft["wall_s"] / ft["wall_s"],
               # useful samples per second over those of the run without failures (a healed group's skipped steps
               # and its discarded first period are not useful); the restarted job recomputes what it lost
               "goodput_ft_useful": (ft["useful_steps"] / ft["wall_s"]) / (base_ft["useful_steps"] / base_ft["wall_s"]),
               "goodput_restart": base_rs["wall_s"] / rs["wall_s"], "failures_ft": len(ft["failures"]),
               "failures_restart": len(rs["failures"]), "eval_loss_ratio_ft": ft["eval_loss"] / base_ft["eval_loss"],
               "eval_loss_ratio_restart": rs["eval_loss"] / base_rs["eval_loss"], "same_model_ft": ft["same_model"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["sweep"] = rows
    out = args.out or os.path.join(work, "goodput.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    plot(rows, out, args.restart_after)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
