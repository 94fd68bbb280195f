"""Goodput of fault-tolerant replica groups (torchft) against today's restart from a checkpoint.

    python benchmarks/goodput.py [--groups 3] [--steps 800] [--sync 25] [--every 15,30] [--restart-after 5]
                                 [--checkpoint-every 100] [--size small] [--rounds 3] [--budget 600]
                                 [--out results/goodput.json]
    python benchmarks/goodput.py --slow D [--slow-every K] [--grace S] [--same-samples] [--steps 400] [--sync 25]

Workload: the charlm task (``--size``), ``--groups`` groups of 1 rank, ``--steps`` optimizer steps each, param
mode with a sync every ``--sync`` steps. Two ways to run it, each first without failures and then with a failure
every F seconds (``--every``, a list: the sweep) and the failed part back R seconds later (``--restart-after``):

* **fault-tolerant** (``fault_tolerance``, a ``distkit lighthouse``): every group a process of its own; a failure
  SIGKILLs one random group, which is started again R s later with the same command and heals at its next
  sync; the other groups train on.
* **restart** (today): one job of ``--groups`` ranks (``--nprocs``), checkpoint every ``--checkpoint-every``
  steps; a failure SIGKILLs one random rank, which ends the whole job; R s later it is started again with
  ``++resume auto``.

``--slow D`` measures something else (issue 60 item 3, syncs that do not wait for the late): no failure, but one
group (the last) slowed, a DISTKIT_FAULT delay of D s before every ``--slow-every``-th sync from the second on, run
three ways on the same steps and data: without the delay (the reference), today's *wait for everyone*
(``late = 'heal'``, a lighthouse whose join timeout outlasts the delay) and *merge the late* (``late = 'merge'``,
``grace_s`` = ``--grace``, lighthouse --join-timeout 1: a sync goes ahead without the slowed group, whose
pseudo-gradient is merged at the next sync it joins, weighted by its samples). Goodput = useful steps per second
(every step a group executed that reached the final model: with ``merge`` the slowed group skips the others'
steps while it waits for their next sync, and nothing it trained is dropped unless it healed without merging,
counted as ``dropped``) over the reference's; with it the eval loss, the steps executed and the syncs that went ahead
without a group. ``--same-samples`` adds a fourth run: the merge run lengthened by whole periods until it executes at
least the steps (samples) waiting for everyone executed, so that the two compare at the same samples: its wall time
and eval loss over waiting's.

Goodput = useful samples per second with failures / samples per second without. The restarted job recomputes
what it lost, so all its samples are useful: its goodput is the time without failures / the time with. In the
fault-tolerant run a killed group loses its steps since its last sync and its restart's steps before the heal
(:func:`useful_steps`): ``goodput_ft_useful`` counts only useful samples; ``goodput_ft`` is the plain time ratio
(on a machine with fewer cores than groups it flatters: a dead group leaves its core to the others). Quality: the final eval loss against the run without failures. Failures start F
s after the first launch and stop once a group (or the job) has reached 70 % of its steps, so that no failure
restarts a group whose peers have finished (it would train alone from the start). Each run is repeated
``--rounds`` times (round r draws its failures with seed + r, against its own runs without failures): the
figures are the median over the rounds and their range. A run still going after ``--budget`` seconds is ended
there and counts the useful work it had made (a restarted job whose start-up under load is near F can make none:
each life dies before its next checkpoint). Writes the JSON (``--out``, default a fresh temp directory) and a
PNG next to it when matplotlib is installed (``pip install 'distkit[bench]'``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from distkit.launch.spawner import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
#: no failure once a group (or the job) is this far: a group restarted after the others finished would train alone
#: from the start (there is nobody left to heal from), which measures nothing
LAST_FAILURE = 0.7


def _common(args: argparse.Namespace, steps: Optional[int] = None) -> list[str]:
    """``distkit train``'s command line for one group (``steps``: its ``max_steps``, default ``--steps``)."""
    return ["train", os.path.join(ROOT, "configs", "returnn_ddp.py"), "++task", "charlm", "++charlm_size", args.size,
            "++max_steps", str(steps or args.steps), "++log_every", "50", "++progress_bar", "False",
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


def start_lighthouse(*flags: str) -> tuple["subprocess.Popen[bytes]", int]:
    """``distkit lighthouse --port P FLAGS`` on a free port P, its output discarded, once it answers: (process, P)."""
    port = free_port()
    lh = subprocess.Popen([PY, "-m", "distkit", "lighthouse", "--port", str(port), *flags], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError("the lighthouse did not start")
            time.sleep(0.1)
    return lh, port


def fault_tolerant(args: argparse.Namespace, work: str, every: Optional[float]) -> dict[str, Any]:
    """One fault-tolerant run; a failure every ``every`` seconds (None: none)."""
    lh, port = start_lighthouse("--join-timeout", "30", "--heartbeat-timeout", "2")
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
    finished = True
    try:
        while True:
            now = time.monotonic()
            if now - t0 > args.budget:  # ended here: its goodput is what it had made useful by now
                finished = False
                break
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
    if not finished:
        ends = [_progress(os.path.join(out, f"group-{i}")) for i in range(args.groups)]
        return {"wall_s": wall, "finished": False, "failures": failures, "eval_loss": None,
                "useful_steps": useful_steps(logs, failures, ends, args.sync), "same_model": None, "heals": None}
    sums = [_summary(os.path.join(out, f"group-{i}")) for i in range(args.groups)]
    return {"wall_s": wall, "finished": True, "failures": failures, "eval_loss": sums[0]["eval_loss"],
            "useful_steps": useful_steps(logs, failures, [args.steps] * args.groups, args.sync),
            "same_model": len({s["param_checksum"] for s in sums}) == 1,
            "heals": sum(s["fault_tolerance"]["heals"] for s in sums),
            "membership": sums[0]["fault_tolerance"]["membership"]}


def slowed(args: argparse.Namespace, work: str, name: str, late: str, delay: float,
           steps: Optional[int] = None) -> dict[str, Any]:
    """One run of ``--slow``: ``late`` 'heal' (wait for everyone) or 'merge', the last group delayed ``delay`` s
    before every ``--slow-every``-th sync from the second on (0: no delay), ``steps`` steps per group (default
    ``--steps``)."""
    steps = steps or args.steps
    join = "1" if late == "merge" else str(max(30.0, 3 * delay))
    lh, port = start_lighthouse("--join-timeout", join, "--min-replicas", str(max(1, args.groups - 1)), "--quiet")
    out = os.path.join(work, name)
    os.makedirs(out, exist_ok=True)
    extra = f", 'late': 'merge', 'grace_s': {args.grace}" if late == "merge" else ""
    slow = args.groups - 1
    fault = ",".join(f"0:{k * args.sync - 1}:delay={delay:g}" for k in range(2, steps // args.sync + 1, args.slow_every))
    procs, logs = [], []
    t0 = time.monotonic()
    for i in range(args.groups):
        cmd = [*_common(args, steps), "++log_every", "1", "++output_dir", out, "++fault_tolerance",
               f"{{'lighthouse': 'http://127.0.0.1:{port}', 'replica_id': {i}, 'num_replicas': {args.groups}{extra}}}"]
        logs.append(os.path.join(out, f"group-{i}.log"))
        env = {"DISTKIT_FAULT": fault} if i == slow and delay > 0 and fault else {}
        with open(logs[-1], "ab") as f:
            procs.append(subprocess.Popen([PY, "-m", "distkit", *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1", **env)))
    try:
        for i, p in enumerate(procs):
            if p.wait(timeout=max(1.0, args.budget - (time.monotonic() - t0))) != 0:
                raise RuntimeError(f"group {i} failed (exit {p.returncode}): see {logs[i]}")
        wall = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
        _kill(lh)
    executed, dropped, syncs0 = 0, 0, []
    for i in range(args.groups):
        with open(os.path.join(out, f"group-{i}", "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        trained = {r["step"] for r in records if "loss" in r and "event" not in r}
        executed += len(trained)
        syncs = [r for r in records if r.get("event") == "sync"]
        # a heal that merged nothing (late = 'heal', or no anchor): the group's period since its last sync is lost
        dropped += sum(args.sync for r in syncs if r.get("healed") and not r.get("late"))
        syncs0 = syncs0 or syncs
    sums = [_summary(os.path.join(out, f"group-{i}")) for i in range(args.groups)]
    return {"steps": steps, "wall_s": wall, "executed_steps": executed, "useful_steps": executed - dropped, "dropped_steps": dropped,
            "eval_loss": sums[0]["eval_loss"], "same_model": len({s["param_checksum"] for s in sums}) == 1,
            # group 0's counts (its sync records: written at each sync whose groups changed)
            "syncs_ahead_without_a_group": max([r.get("ahead_without", 0) for r in syncs0], default=0),
            "late_merged": max([r.get("late_merged", 0) for r in syncs0], default=0),
            "wait_s_group0": sums[0]["fault_tolerance"]["wait_s"]}


def slow_main(args: argparse.Namespace) -> None:
    """``--slow``: reference, wait for everyone, merge the late; each ``--rounds`` times."""
    work = tempfile.mkdtemp(prefix="distkit-goodput-slow-")
    rows = []
    for r in range(args.rounds):
        rwork = os.path.join(work, f"round-{r}")
        ref = slowed(args, rwork, "reference", "heal", 0.0)
        wait = slowed(args, rwork, "wait", "heal", args.slow)
        merge = slowed(args, rwork, "merge", "merge", args.slow)
        row = {"round": r, "reference": ref, "wait": wait, "merge": merge,
               "goodput_wait": (wait["useful_steps"] / wait["wall_s"]) / (ref["useful_steps"] / ref["wall_s"]),
               "goodput_merge": (merge["useful_steps"] / merge["wall_s"]) / (ref["useful_steps"] / ref["wall_s"]),
               "eval_loss_ratio_wait": wait["eval_loss"] / ref["eval_loss"],
               "eval_loss_ratio_merge": merge["eval_loss"] / ref["eval_loss"]}
        if args.same_samples:
            # the merged run executes fewer steps (the slowed group skips the others' steps while it waits for
            # their next sync): run it again, longer by that share (whole periods, constant learning rate), so
            # that it trains on at least the samples waiting for everyone did; compared: wall time and eval loss
            steps = -(-args.steps * wait["executed_steps"] // (merge["executed_steps"] * args.sync)) * args.sync
            same = slowed(args, rwork, "merge_same_samples", "merge", args.slow, steps)
            row.update(merge_same_samples=same,
                       wall_ratio_same_samples=same["wall_s"] / wait["wall_s"],
                       executed_ratio_same_samples=same["executed_steps"] / wait["executed_steps"],
                       eval_loss_ratio_same_samples=same["eval_loss"] / wait["eval_loss"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"args": vars(args), "rounds": rows, "load": os.getloadavg(),
              "goodput_wait": _spread([x["goodput_wait"] for x in rows]),
              "goodput_merge": _spread([x["goodput_merge"] for x in rows])}
    out = args.out or os.path.join(work, "goodput_slow.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"slowed group, {args.slow:g} s before every {args.slow_every} sync(s): goodput wait for everyone "
          f"{result['goodput_wait']['median']:.3f}, merge the late {result['goodput_merge']['median']:.3f}")
    if args.same_samples:
        print("same samples (merge run longer, whole periods): wall / waiting's "
              + ", ".join(f"{x['wall_ratio_same_samples']:.3f}" for x in rows) + "; eval loss / waiting's "
              + ", ".join(f"{x['eval_loss_ratio_same_samples']:.5f}" for x in rows) + "; steps executed / waiting's "
              + ", ".join(f"{x['executed_ratio_same_samples']:.3f}" for x in rows))
    print(f"wrote {out}")


def useful_steps(logs: list[str], failures: list[dict[str, Any]], ends: list[int], sync: int) -> int:
    """Optimizer steps whose work reached the final model, over the groups, from each group's log (every life of
    it, appended) and the failures: a life counts from its start (step 0, or the step it healed at) to its last
    sync before it was killed (the step of the kill, read from metrics.jsonl every 50 steps, rounded down to a
    sync), or for each group's last life to its ``ends`` entry (the run's steps when it finished; its last logged
    step, rounded down to a sync, when the budget ended it). What a restarted life trained before its heal was replaced,
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
            end = (kills[i] // sync) * sync if i < len(kills) else (ends[g] // sync) * sync
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
    finished = True
    try:
        while True:
            now = time.monotonic()
            if now - t0 > args.budget:
                finished = False
                break
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
    if not finished:  # the job's useful work is what its last checkpoint holds
        return {"wall_s": wall, "finished": False, "failures": failures, "eval_loss": None,
                "useful_steps": _checkpoint_step(out)}
    return {"wall_s": wall, "finished": True, "failures": failures, "eval_loss": _summary(out)["eval_loss"],
            "useful_steps": args.steps}


def _checkpoint_step(out: str) -> int:
    """The step of the checkpoint ``out/checkpoints/latest`` names (0 when none)."""
    try:
        with open(os.path.join(out, "checkpoints", "latest")) as f:
            return int(f.read().strip().rsplit("-", 1)[-1])
    except (OSError, ValueError):
        return 0


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
    for key, mark, label in (("goodput_ft_useful", "o-", "fault-tolerant groups (torchft)"),
                             ("goodput_restart", "s-", "restart from checkpoint")):
        med = [r[key]["median"] for r in rows]  # the median over the rounds, the bar their range
        err = [[m - r[key]["min"] for m, r in zip(med, rows)], [r[key]["max"] - m for m, r in zip(med, rows)]]
        ax.errorbar(xs, med, yerr=err, fmt=mark, capsize=3, label=label)
    ax.set_xlabel(f"seconds between failures (back after {restart_after:g} s)")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(out)[0] + ".png", dpi=120)


def _rate(run: dict[str, Any]) -> float:
    return run["useful_steps"] / run["wall_s"]


def _spread(xs: list[float]) -> dict[str, float]:
    """Median and range of one figure over the rounds."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--sync", type=int, default=25)
    p.add_argument("--every", default="15,30", help="seconds between failures, a comma-separated sweep")
    p.add_argument("--restart-after", dest="restart_after", type=float, default=5.0)
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=100)
    p.add_argument("--size", choices=["small", "medium"], default="small")
    p.add_argument("--rounds", type=int, default=3, help="every run repeated this often (its own failure draws): "
                                                         "the spread")
    p.add_argument("--budget", type=float, default=600.0, metavar="S",
                   help="a run still going after S seconds is ended there; its goodput is the useful work it had "
                        "made by then (a restarted job can make none when F is near its start-up time)")
    p.add_argument("--seed", type=int, default=0, help="which group or rank each failure hits (round r: seed + r)")
    p.add_argument("--out", default=None, help="result JSON (default: a fresh temp directory)")
    p.add_argument("--slow", type=float, default=None, metavar="D",
                   help="instead of failures: the last group slowed D s before syncs (late 'heal' against 'merge')")
    p.add_argument("--slow-every", dest="slow_every", type=int, default=1, metavar="K",
                   help="--slow: the delay before every K-th sync (default every one)")
    p.add_argument("--grace", type=float, default=1.0, help="--slow: fault_tolerance.grace_s of the merge run")
    p.add_argument("--same-samples", dest="same_samples", action="store_true",
                   help="--slow: also the merge run lengthened (whole periods) to at least the samples of waiting for "
                        "everyone; its wall time and eval loss against waiting's")
    args = p.parse_args()
    if args.slow is not None:
        if args.slow <= 0 or args.slow_every < 1 or args.groups < 3:
            p.error("--slow must be > 0 and --slow-every >= 1, with --groups >= 3 (torchft's lighthouse never leaves "
                    "one of 2 heartbeating groups out)")
        slow_main(args)
        return
    if min(args.groups, args.steps, args.sync, args.rounds) < 1 or args.budget <= 0:
        p.error("--groups, --steps, --sync and --rounds must be >= 1, --budget > 0")
    everys = [float(x) for x in args.every.split(",")]
    work = tempfile.mkdtemp(prefix="distkit-goodput-")
    result: dict[str, Any] = {"args": vars(args), "rounds": []}
    per_f: dict[float, list[dict[str, Any]]] = {f: [] for f in everys}
    for r in range(args.rounds):
        rargs = argparse.Namespace(**{**vars(args), "seed": args.seed + r})
        rwork = os.path.join(work, f"round-{r}")
        base_ft, base_rs = fault_tolerant(rargs, rwork, None), restart(rargs, rwork, None)
        if not (base_ft["finished"] and base_rs["finished"]):
            raise SystemExit(f"goodput: round {r}: a run without failures did not finish within --budget "
                             f"{args.budget:g} s: give a larger budget or fewer --steps")
        print(f"round {r + 1}/{args.rounds}, no failures: fault-tolerant {base_ft['wall_s']:.1f} s, one job "
              f"{base_rs['wall_s']:.1f} s", flush=True)
        rnd: dict[str, Any] = {"none": {"fault_tolerant": base_ft, "restart": base_rs}}
        for every in everys:
            ft, rs = fault_tolerant(rargs, rwork, every), restart(rargs, rwork, every)
            row = {"round": r, "every_s": every, "goodput_ft": base_ft["wall_s"] / ft["wall_s"],
                   # useful samples per second over those of the run without failures (a healed group's skipped
                   # steps and its discarded first period are not useful); the restarted job recomputes what it lost
                   "goodput_ft_useful": _rate(ft) / _rate(base_ft), "goodput_restart": _rate(rs) / _rate(base_rs),
                   "finished_ft": ft["finished"], "finished_restart": rs["finished"],
                   "failures_ft": len(ft["failures"]), "failures_restart": len(rs["failures"]),
                   "eval_loss_ratio_ft": ft["eval_loss"] / base_ft["eval_loss"] if ft["finished"] else None,
                   "eval_loss_ratio_restart": rs["eval_loss"] / base_rs["eval_loss"] if rs["finished"] else None,
                   "same_model_ft": ft["same_model"]}
            rnd[f"{every:g}"] = {"fault_tolerant": ft, "restart": rs}
            per_f[every].append(row)
            print(json.dumps(row), flush=True)
        result["rounds"].append(rnd)
    rows = []
    for every, rs_ in per_f.items():
        row = {"every_s": every, "rounds": len(rs_),
               "goodput_ft_useful": _spread([x["goodput_ft_useful"] for x in rs_]),
               "goodput_restart": _spread([x["goodput_restart"] for x in rs_]),
               "goodput_ft": _spread([x["goodput_ft"] for x in rs_]),
               "unfinished_ft": sum(not x["finished_ft"] for x in rs_),
               "unfinished_restart": sum(not x["finished_restart"] for x in rs_)}
        rows.append(row)
        print(f"F = {every:g} s over {len(rs_)} round(s): goodput fault-tolerant {row['goodput_ft_useful']['median']:.3f} "
              f"({row['goodput_ft_useful']['min']:.3f}-{row['goodput_ft_useful']['max']:.3f}), restart "
              f"{row['goodput_restart']['median']:.3f} ({row['goodput_restart']['min']:.3f}-"
              f"{row['goodput_restart']['max']:.3f})", flush=True)
    result["sweep"] = rows
    result["load"] = os.getloadavg()
    out = args.out or os.path.join(work, "goodput.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    plot(rows, out, args.restart_after)
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
