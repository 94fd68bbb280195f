"""Kill at any instant, then resume: how many resumed runs end with the uninterrupted run's checksum.

    python benchmarks/kill_trials.py [--engines ddp,mpi,horovod,deepspeed] [--trials 50] [--steps 16] [--seed 0]

Per engine: one uninterrupted reference run (``distkit train configs/returnn_ddp.py --nprocs 2``,
Adam, a checkpoint after every step), then ``--trials`` trials. A trial starts the same run in a
fresh output directory and sends SIGKILL either to one rank drawn at random (found in the launcher's
process tree by its ``RANK``/``OMPI_COMM_WORLD_RANK``) or to the whole process group
(``--group-fraction`` of the trials). The moment: for ``--startup-fraction`` of the trials uniformly
inside start-up (before the first checkpoint, as long as the reference's start-up took), for the
rest uniformly inside the training, saving and shutdown that follow the trial's first checkpoint
(as long as the reference's took), so most kills land where checkpoints are being written. A run
that finished before its kill is not counted and is drawn again. Then ``++resume auto`` is run until the run completes (at
most 3 times). A trial counts as recovered when the final ``summary.json`` has the reference's
``param_checksum`` (sha256 of the fp32 parameters: bit-identical) and ``steps``; a resume that
fails, a wrong checksum, or a run that started over from step 0 while checkpoints existed are
failures, reported with their output directory kept.

Writes ``benchmarks/results/kill_trials_<engine>.json`` and prints one line per engine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from runenv import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DISTKIT = [sys.executable, "-m", "distkit"]
ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"backend": "ddp"},
    "mpi": {"backend": "mpi"},
    "horovod": {"backend": "horovod", "require_horovod": True},
    "deepspeed": {"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}},
}


def command(engine: str, steps: int, out: str, *extra: str) -> list[str]:
    return [*DISTKIT, "train", os.path.join(ROOT, "configs", "returnn_ddp.py"), "--nprocs", "2",
            "++max_steps", str(steps), "++checkpoint_every", "1", "++log_every", "1", "++eval_every", "None",
            "++progress_bar", "False", "++optimizer", "{'class': 'adam'}", "++learning_rate", "0.002",
            "++distributed", json.dumps(ENGINES[engine]), "++output_dir", out, *extra]


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent:
                out.append(int(entry))
                frontier.append(int(entry))
    return out


def rank_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            envs = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    for key in (b"RANK", b"OMPI_COMM_WORLD_RANK"):
        if key in envs:
            return int(envs[key])
    return None


def ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the training processes under ``launcher`` (the innermost process per rank)."""
    found: dict[int, int] = {}
    for pid in children(launcher):
        r = rank_of(pid)
        if r is not None:
            found[r] = pid  # descendants come after their parents: the last one is the python rank
    return found


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=ROOT)


def summary(out: str) -> Optional[dict[str, Any]]:
    path = os.path.join(out, "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)  # type: ignore[no-any-return]


def wait_for_first_checkpoint(out: str, proc: "subprocess.Popen[str]") -> float:
    """Seconds from now until ``out`` has a complete checkpoint (``latest``) or ``proc`` ended."""
    t0 = time.perf_counter()
    pointer = os.path.join(out, "checkpoints", "latest")
    while not os.path.isfile(pointer) and proc.poll() is None:
        time.sleep(0.01)
    return time.perf_counter() - t0


def trial(engine: str, steps: int, timing: tuple[float, float], rng: random.Random, ref: dict[str, Any],
          work: str) -> dict[str, Any]:
    """One kill and its resumes. ``timing`` is the reference's (seconds to its first checkpoint, seconds
    from then to its end): a share ``--startup-fraction`` of the kills falls into start-up, the rest
    uniformly into the training and saving that follows the first checkpoint (where the checkpoint
    protocol is exercised), timed from the moment this trial's first checkpoint appears."""
    out = tempfile.mkdtemp(prefix=f"kill-{engine}-", dir=work)
    to_first, training = timing
    during_startup = rng.random() < ARGS.startup_fraction
    delay = rng.uniform(0.2, to_first) if during_startup else rng.uniform(0.0, training)
    whole = rng.random() < ARGS.group_fraction
    proc = subprocess.Popen(command(engine, steps, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), cwd=ROOT, start_new_session=True)
    t0 = time.perf_counter()
    if not during_startup:
        wait_for_first_checkpoint(out, proc)
    time.sleep(delay)
    at = time.perf_counter() - t0
    victim: Any = "group"
    if proc.poll() is None:
        if whole:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            found = ranks(proc.pid)
            victim = rng.choice(sorted(found)) if found else "group"
            if found:
                os.kill(found[victim], signal.SIGKILL)
            else:  # not started yet: kill the launch itself
                os.killpg(proc.pid, signal.SIGKILL)
    else:
        victim = None  # the run had finished: no kill happened (not counted as a trial)
    try:
        proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"at_s": at, "victim": victim, "ok": False, "why": "the others did not exit within 120 s", "out": out}
    pointer = os.path.join(out, "checkpoints", "latest")
    with open(pointer if os.path.isfile(pointer) else os.devnull) as f:
        latest = f.read().strip() or None  # the checkpoint the kill left (None: killed before the first)
    resumes = 0
    while resumes < 3:
        s = summary(out)
        if s is not None and s.get("steps") == steps:
            break
        resumes += 1
        res = run(command(engine, steps, out, "++resume", "auto"))
        if res.returncode != 0:
            continue
        if latest is not None and "resumed from" not in res.stdout:
            return {"at_s": at, "victim": victim, "ok": False, "why": f"started over although {latest} existed",
                    "out": out}
    s = summary(out)
    ok = bool(s and s.get("steps") == steps and s.get("param_checksum") == ref["param_checksum"])
    result = {"at_s": round(at, 3), "victim": victim, "checkpoint_at_kill": latest, "resumes": resumes, "ok": ok}
    if ok:
        shutil.rmtree(out, ignore_errors=True)
    else:
        result.update(why="checksum differs" if s else "no summary after 3 resumes", out=out)
    return result


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--engines", default="ddp,mpi,horovod,deepspeed")
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-fraction", type=float, default=0.25, help="share of trials that kill every process")
    p.add_argument("--startup-fraction", type=float, default=0.1,
                   help="share of kills timed inside start-up (before the first checkpoint); the rest fall after it")
    p.add_argument("--work", default=None, help="where trial output goes (default: a temporary directory)")
    p.add_argument("--no-save", action="store_true", help="do not write benchmarks/results")
    ARGS = p.parse_args()
    work = ARGS.work or tempfile.mkdtemp(prefix="kill-trials-")
    failed = 0
    for engine in ARGS.engines.split(","):
        ref_out = os.path.join(work, f"ref-{engine}")
        t0 = time.perf_counter()
        proc = subprocess.Popen(command(engine, ARGS.steps, ref_out), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=child_env(), cwd=ROOT)
        to_first = wait_for_first_checkpoint(ref_out, proc)
        _, stderr = proc.communicate(timeout=300)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{engine}: the reference run failed:\n{stderr[-2000:]}", file=sys.stderr)
            return 1
        ref = summary(ref_out)
        assert ref is not None
        rng = random.Random(f"{ARGS.seed}-{engine}")
        results: list[dict[str, Any]] = []
        finished_first = 0
        while len(results) < ARGS.trials and finished_first < 3 * ARGS.trials:  # bounded: a run too short to hit
            r = trial(engine, ARGS.steps, (to_first, wall - to_first), rng, ref, work)
            if r["victim"] is None:
                finished_first += 1
                continue
            results.append(r)
            print(f"  {engine} trial {len(results)}/{ARGS.trials}: kill {r['victim']} at {r['at_s']:.2f} s "
                  f"(latest: {r['checkpoint_at_kill']}) -> {'recovered' if r['ok'] else 'FAILED: ' + r['why']}",
                  flush=True)
        good = sum(r["ok"] for r in results)
        failed += ARGS.trials - good
        report = {"engine": engine, "trials": len(results), "recovered": good, "steps": ARGS.steps,
                  "reference_wall_s": round(wall, 2), "reference_first_checkpoint_s": round(to_first, 2),
                  "runs_that_finished_before_the_kill": finished_first,
                  "reference_checksum": ref["param_checksum"], "results": results}
        print(f"{engine}: {good}/{len(results)} killed runs resumed to the uninterrupted run's checksum "
              f"(reference {wall:.1f} s, first checkpoint at {to_first:.1f} s, {ARGS.steps} steps, a checkpoint "
              f"every step; {finished_first} runs finished before their kill and were drawn again)", flush=True)
        if not ARGS.no_save:
            os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
            with open(os.path.join(HERE, "results", f"kill_trials_{engine}.json"), "w") as f:
                json.dump(report, f, indent=2)
    return 1 if failed else 0


ARGS: argparse.Namespace

if __name__ == "__main__":
    sys.exit(main())
