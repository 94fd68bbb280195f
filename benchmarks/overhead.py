"""distkit's per-step overhead against a hand-written engine script, interleaved A/B runs.

    python benchmarks/overhead.py [--backend ddp|horovod|mpi|deepspeed] [--repeats 5] [--steps 100] [--size small|medium]
    python benchmarks/overhead.py --backend ddp|horovod|mpi|deepspeed --path byo [--repeats 5] [--steps 100]
    python benchmarks/overhead.py --compare mpi-vs-ddp [--size medium]

For each repeat it runs the hand-written baseline (A, ``benchmarks/raw_ddp.py`` for ddp) and
distkit (B, ``python -m distkit train`` on a generated config) under the same launcher, the
same number of ranks, the same thread count and the same workload (``charlm``: model, data
order, per-rank batch, SGD, DDP bucket size). Runs are interleaved with alternating order
(A B, B A, A B, ...), so slow drift of the machine hits both sides equally.

Timing, identical on both sides and taken from outside the step function on rank 0:
``perf_counter`` at the start and end of every optimizer step (fetch + forward + backward +
optimizer step + zero_grad). The raw script does it inline; for distkit a small wrapper
(``--distkit-worker``) wraps ``distkit.trainer.TrainingRun.train_step`` and then runs the real
``distkit`` CLI entry point in-process, so nothing in distkit changes. The first
``--warmup`` steps are dropped. Three metrics per step:

* ``iter``: start of step k to start of step k+1, i.e. everything the loop does per step
  (distkit's logging / fault / checkpoint checks included). The headline numbers.
* ``step``: inside the step only (start to end of the same step).
* ``cpu``: rank 0's process CPU seconds during the step (robust to other processes).

p50 and p95 are taken over the pooled post-warm-up steps of all runs of one side; the
ratio is distkit / raw. Also reported: every run's own numbers and each A/B pair's p50
ratio. Each run's foreign load (CPUs busy with processes that are not ours, from
/proc/stat minus our children's rusage) is recorded; pairs above ``--noisy-load`` are
listed and the ``quiet`` section repeats the comparison without them. ``same_work`` is
false when the final parameters differ between runs (sha256, as ``summary.json``'s
``param_checksum``): then the two sides did not run the same work.

``--path byo``: B is ``benchmarks/byo_charlm.py`` instead, the same workload written as a user's
own loop on distkit's public API (``distkit.init``, ``dk.setup``, ``dk.dataloader``, ``dk.backward``,
``dk.step``), the engine chosen only by distkit's command line (``++distributed`` = the same
section as the CLI path's config). It times itself inline exactly as the raw scripts do (before
pulling the step's batch from the loader's iterator, after ``dk.step()``); ``same_work`` compares
its final parameters with the raw script's. Writes ``overhead_byo_<backend>.json``.

Backends: ddp (``raw_ddp.py``, torchrun), horovod (``raw_horovod.py``, mpirun), mpi (``raw_mpi.py``,
mpirun), deepspeed (``raw_deepspeed.py``, torchrun, ``--zero-stage``). ``--compare mpi-vs-ddp`` runs
two distkit engines against each other instead (A = ddp over gloo, B = mpi, both under mpirun).

Writes ``overhead_<backend>.json`` (``mpi_vs_ddp.json`` for the comparison; + a PNG when matplotlib
is there) into a fresh directory under the system's temp directory, printed at the end, so a trial
run never overwrites the committed results; ``--out PATH`` writes where asked (the commands in
``benchmarks/README.md`` that regenerate ``benchmarks/results/`` pass it). Another backend = one more
entry in ``BACKENDS`` with its baseline script, launcher and distkit ``distributed`` section.

``--pin`` (each rank on its own core, both sides), ``--warmup auto`` (:func:`auto_warmup`), ``--budget S`` (more
pairs while they fit) and ``--aa`` (distkit against itself) are for resolving small differences; every result
has the median of the per-pair ratios with a 95 % bootstrap interval (``pair_ratio``).

Each run (one side of one pair) has ``--run-timeout`` seconds (default 600). A run past it is killed
with everything it started (its process group, and the ranks torchrun puts in sessions of their own);
the script names the run, prints its captured output's tail and exits with status 124 (as
``timeout(1)``), writing no result: a benchmark with a missing run is not retried or reported.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET_P50_RATIO = 1.03


# --------------------------------------------------------------------------- backends
def _torchrun(nprocs: int) -> list[str]:
    # --standalone: a local rendezvous on a free port, so parallel benchmark runs never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]


def _mpirun(nprocs: int) -> list[str]:
    # The venv's Open MPI. --bind-to none: like torchrun, no core pinning (Open MPI would pin each of
    # 2 ranks to a core), so the launcher is not what differs from the torchrun benchmarks; -x passes
    # the thread count and PYTHONPATH (set by _env) to every rank explicitly.
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun") or "mpirun"
    # (--oversubscribe only where the ranks outnumber the cores, as growth.py's 4 ranks on 2: Open MPI refuses them)
    over = ["--oversubscribe"] if nprocs > (os.cpu_count() or 1) else []
    return [mpirun, "-np", str(nprocs), *over, "--bind-to", "none", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH",
            "-x", "DS_ACCELERATOR", sys.executable]


@dataclass(frozen=True)
class Backend:
    """How to run one engine both ways. ``launcher(nprocs)`` prefixes a Python script path."""

    name: str
    baseline: str                                       # script in benchmarks/
    launcher: Callable[[int], list[str]]
    distributed: Callable[[argparse.Namespace], dict[str, Any]]  # distkit's `distributed` section
    baseline_args: Callable[[argparse.Namespace], list[str]] = lambda a: []
    launcher_name: str = "torchrun --standalone"
    #: what carries the gradients (for the JSON's config block)
    transport: str = "gloo"


BACKENDS: dict[str, Backend] = {
    "ddp": Backend("ddp", "raw_ddp.py", _torchrun,
                   lambda a: {"backend": "ddp", "reduce_type": "grad", "pg_backend": "gloo",
                              "options": {"bucket_cap_mb": a.bucket_cap_mb}}),
    # require_horovod: a distkit run that silently fell back to the mpi engine would not be a Horovod run.
    "horovod": Backend("horovod", "raw_horovod.py", _mpirun,
                       lambda a: {"backend": "horovod", "reduce_type": "grad", "require_horovod": True},
                       launcher_name="mpirun --bind-to none", transport="horovod (MPI)"),
    "mpi": Backend("mpi", "raw_mpi.py", _mpirun,
                   lambda a: {"backend": "mpi", "reduce_type": "grad", "bucket_cap_mb": a.bucket_cap_mb},
                   launcher_name="mpirun --bind-to none", transport="mpi4py (Open MPI)"),
    "deepspeed": Backend("deepspeed", "raw_deepspeed.py", _torchrun,
                         lambda a: {"backend": "deepspeed", "reduce_type": "grad", "pg_backend": "gloo",
                                    "deepspeed_config": {"zero_optimization": {"stage": a.zero_stage}}},
                         baseline_args=lambda a: ["--zero-stage", str(a.zero_stage)]),
    # FSDP2 (fully_shard) over gloo; raw_fsdp.py shards the same units distkit's engine picks
    "fsdp": Backend("fsdp", "raw_fsdp.py", _torchrun,
                    lambda a: {"backend": "fsdp", "reduce_type": "grad", "pg_backend": "gloo"}),
}

#: --knob: one distkit feature off (side A) against on, as shipped (side B), the rest the same
KNOBS: dict[str, str] = {
    "preemption": "the preemption check: one MAX all-reduce of one number after every optimizer step "
                  "(preemption = False on the off side)",
    "watchdog": "the stall watchdog: a heartbeat thread per rank writing to rank 0's TCPStore every second "
                "(not started on the off side, by the timing wrapper: no config key turns it off)",
}

#: ``--compare NAME``: two distkit configurations against each other (A = first, B = second), same launcher.
COMPARES: dict[str, tuple[str, str, Callable[[int], list[str]], str]] = {
    # Both under mpirun (distkit's DDP runs under mpirun too), so the launcher and core binding are the same.
    "mpi-vs-ddp": ("ddp", "mpi", _mpirun, "mpirun --bind-to none"),
}


# --------------------------------------------------------------------------- one run each way
def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # Same thread count on both sides (torchrun's own default would be 1 with a warning).
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed on a CPU-only machine (distkit sets it itself; the raw script too)
    env.pop("DISTKIT_FAULT", None)
    if getattr(args, "what_if", None):
        env["DISTKIT_BENCH_WHAT_IF"] = args.what_if
    if getattr(args, "pin", False):
        env["DISTKIT_BENCH_PIN"] = "1"  # each rank to its own core (workload.pin_rank), on both sides
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


#: exit status of the script when a run exceeds ``--run-timeout`` (the one ``timeout(1)`` uses)
TIMEOUT_EXIT = 124


def _log_tail(log: str, chars: int = 3000) -> str:
    with open(log, errors="replace") as f:
        return f.read()[-chars:] or "(the run wrote no output)"


def _start_time(pid: int) -> Optional[str]:
    """A process's start time (clock ticks after boot, /proc/PID/stat field 22): with the pid, its identity
    (pids are reused); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # comm, which may hold ") ", ends at the last ")"
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """Every live process below ``root`` in the process tree (from /proc's parent pids), with its start time."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then the parent pid
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            start = _start_time(child)
            if start is not None:
                found[child] = start
                todo.append(child)
    return found


def _signal(pid: int, sig: int) -> None:
    """``sig`` to ``pid`` and to its process group, unless that group is this script's."""
    try:
        pgid = os.getpgid(pid)
        if pgid != os.getpgrp():
            os.killpg(pgid, sig)
        os.kill(pid, sig)
    except ProcessLookupError:  # already gone
        pass


def _kill_run(proc: "subprocess.Popen[bytes]", grace_s: float = 5.0) -> None:
    """End a run and everything it started. First SIGTERM to the run's process group (its id is the
    launcher's pid: ``start_new_session``), so torchrun / mpirun stop their ranks and clean up (a
    SIGKILLed mpirun leaves a session directory that can break a later one, see ``distkit.launch.ompi_leftovers``).
    After ``grace_s``, whatever is left is frozen (SIGSTOP: a stopped process cannot fork) and SIGKILLed:
    the group, and every process of the tree found before the SIGTERM or since (torchrun starts each rank
    in a session of its own, which the group does not reach), each with its own group."""
    known = _descendants(proc.pid)  # now: once the launcher is gone, its orphaned ranks are not below it
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    stopped: set[int] = set()
    while True:
        tree = dict(known)
        if proc.returncode is None:  # not reaped yet, so its pid is still its own (a reaped one may be reused)
            tree.update(_descendants(proc.pid))
        left = {pid for pid, start in tree.items() if _start_time(pid) == start}  # the same processes, alive
        if proc.returncode is None:
            left.add(proc.pid)
        new = left - stopped
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    try:
        # the group may outlive its leader; its id is not reused while a member lives, so this hits only ours
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    proc.wait()


def _run(cmd: list[str], env: dict[str, str], log: str, timeout_s: float) -> None:
    """Run one side of one pair, output to ``log``. Past ``timeout_s``, or on Ctrl-C (the run's own session
    does not get the terminal's SIGINT), the run is ended with all it started (:func:`_kill_run`); a timeout
    ends the script (status :data:`TIMEOUT_EXIT`) naming the run, before any result is written."""
    name = os.path.splitext(os.path.basename(log))[0]  # the run's tag, e.g. 03-distkit
    with open(log, "w") as f:
        # its own session: its process group can be killed as one without touching this script
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            tail = _log_tail(log)  # what it had written when time ran out, not the launcher's shutdown messages
            _kill_run(proc)
            print(f"overhead: run {name} exceeded --run-timeout {timeout_s:g} s and was killed with its processes; "
                  f"no result written\ncommand: {' '.join(cmd)}\n--- output tail ---\n{tail}",
                  file=sys.stderr, flush=True)
            raise SystemExit(TIMEOUT_EXIT) from None
        except BaseException:  # KeyboardInterrupt, or anything else: leave no ranks behind
            _kill_run(proc)
            raise
    if rc != 0:
        raise SystemExit(f"overhead: run {name} failed ({rc}): {' '.join(cmd)}\n--- log tail ---\n{_log_tail(log)}")


def run_raw(be: Backend, args: argparse.Namespace, work: str, tag: str) -> dict[str, Any]:
    return _run_script(be, args, work, tag, be.baseline,
                       ["--seed", str(args.seed), "--bucket-cap-mb", str(args.bucket_cap_mb), *be.baseline_args(args)])


def _run_script(be: Backend, args: argparse.Namespace, work: str, tag: str, script: str,
                extra: list[str]) -> dict[str, Any]:
    """Run a benchmark script (``workload.add_workload_arguments`` flags + ``extra``) under the backend's
    launcher; returns the times record rank 0 wrote, plus the process's wall time."""
    times = os.path.join(work, f"{tag}.times.json")
    cmd = be.launcher(args.nprocs) + [
        os.path.join(HERE, script), "--size", args.size, "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--lr", str(args.lr),
        "--times", times, *extra]
    t0 = time.perf_counter()
    _run(cmd, _env(args), os.path.join(work, f"{tag}.log"), args.run_timeout)
    with open(times) as f:
        rec = json.load(f)
    rec["process_wall_s"] = time.perf_counter() - t0
    rec["launched_at"] = t0  # perf_counter is the system's monotonic clock: comparable with the ranks' "ends"
    return rec


def distkit_config(be: Backend, args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    return {
        "task": "charlm", "charlm_size": args.size, "charlm_seq_len": args.seq_len,
        "distributed": be.distributed(args),
        "optimizer": {"class": "sgd"}, "learning_rate": args.lr,
        "batch_size": args.batch_size, "max_steps": args.steps, "num_epochs": 10_000,
        "seed": args.seed, "device": "cpu",
        # One metrics record, at the last step: the raw script does no per-step reduction either.
        "log_every": args.steps, "eval_every": None, "checkpoint_every": None,
        "progress_bar": False, "output_dir": output_dir,
    }


def run_distkit(be: Backend, args: argparse.Namespace, work: str, tag: str,
                launcher: Optional[Callable[[int], list[str]]] = None, knob_off: Optional[str] = None,
                distributed: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One ``distkit train`` run; ``knob_off`` (a :data:`KNOBS` name) runs it with that feature turned off;
    ``distributed`` updates the engine's ``distributed`` section (e.g. ``{"reduce_type": "param"}``)."""
    out_dir = os.path.join(work, f"{tag}.out")
    cfg_path = os.path.join(work, f"{tag}.config.json")
    cfg, env = distkit_config(be, args, out_dir), _env(args)
    cfg["distributed"].update(distributed or {})
    if knob_off == "preemption":
        cfg["preemption"] = False
    elif knob_off == "watchdog":
        env["DISTKIT_BENCH_NO_WATCHDOG"] = "1"  # distkit_worker starts no watchdog (no config key turns it off)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    times = os.path.join(work, f"{tag}.times.json")
    cmd = (launcher or be.launcher)(args.nprocs) + [os.path.abspath(__file__), "--distkit-worker", times, "--", "train", cfg_path]
    t0 = time.perf_counter()
    _run(cmd, env, os.path.join(work, f"{tag}.log"), args.run_timeout)
    with open(times) as f:
        rec = json.load(f)
    rec["process_wall_s"] = time.perf_counter() - t0
    rec["launched_at"] = t0
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    rec["param_checksum"] = summary["param_checksum"]
    rec["final_loss"] = summary["final_train_loss"]
    rec["summary"] = {k: summary[k] for k in ("backend_impl", "launcher", "steps", "wall_time_s", "compute_fraction")}
    shutil.rmtree(os.path.join(out_dir, "checkpoints"), ignore_errors=True)  # the final checkpoint: not needed
    return rec


def byo_overrides(be: Backend, args: argparse.Namespace) -> list[str]:
    """distkit's command line for ``byo_charlm.py``: the same ``distributed`` section (and seed, device)
    as the CLI path's config, as ``++key value`` pairs (Python literals, which is what ``++`` parses)."""
    return ["++seed", str(args.seed), "++device", "cpu", "++distributed", repr(be.distributed(args))]


def run_byo(be: Backend, args: argparse.Namespace, work: str, tag: str) -> dict[str, Any]:
    """One run of ``byo_charlm.py`` (distkit's bring-your-own-loop API) under the baseline's launcher."""
    return _run_script(be, args, work, tag, "byo_charlm.py", byo_overrides(be, args))


def _what_if_persistent_buffers() -> None:
    """``--what-if persistent-buffers`` (benchmark only, distkit's files are untouched): after the mpi /
    horovod engine's setup, sync only persistent buffers before each forward (the proposed fix), so a
    constant buffer such as charlm's causal mask is no longer broadcast every step."""
    from distkit.backends import horovod, mpi

    def persistent(model: Any) -> list[Any]:
        return [b for mod in model.modules() for n, b in mod._buffers.items()
                if b is not None and n not in mod._non_persistent_buffers_set]

    classes: list[Any] = list({mpi.MPIStrategy, horovod.HorovodStrategy})  # the same class twice under the fallback
    for cls in classes:
        inner = cls.setup

        def setup(self: Any, model: Any, optimizer: Any, _inner: Any = inner) -> Any:
            out = _inner(self, model, optimizer)
            self._buffers = persistent(model)
            if not self._buffers and getattr(self, "_buffer_hook", None) is not None:
                self._buffer_hook.remove()
                self._buffer_hook = None
            return out

        cls.setup = setup


def distkit_worker(times_path: str, argv: list[str]) -> int:
    """Per rank, under the launcher: time every ``TrainingRun.train_step`` call, then run the real CLI."""
    from time import perf_counter, process_time

    from workload import launcher_rank, pin_rank

    pin_rank()  # (--pin) as the hand-written scripts do, before torch starts threads
    import torch

    from distkit import trainer


    from distkit.commands import cli
    starts: list[float] = []
    ends: list[float] = []
    cpu_starts: list[float] = []
    cpu_ends: list[float] = []
    inner = trainer.TrainingRun.train_step

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:  # train_step(self, batches): the batch fetch is inside
        t0, c0 = perf_counter(), process_time()
        out = inner(self, *args, **kwargs)
        ends.append(perf_counter())
        cpu_ends.append(process_time())
        starts.append(t0)
        cpu_starts.append(c0)
        return out

    trainer.TrainingRun.train_step = timed  # type: ignore[method-assign]
    if os.environ.get("DISTKIT_BENCH_WHAT_IF") == "persistent-buffers":
        _what_if_persistent_buffers()
    if os.environ.get("DISTKIT_BENCH_NO_WATCHDOG") == "1":  # --knob watchdog, its off side
        from distkit import job

        job.start_watchdog = lambda strategy, timeout_s: None  # type: ignore[assignment]
    rc = cli.main(argv)
    rank = launcher_rank()
    if rc == 0 and rank == 0:
        with open(times_path, "w") as f:
            json.dump({"impl": "distkit", "starts": starts, "ends": ends, "cpu_starts": cpu_starts, "cpu_ends": cpu_ends,
                       "torch_threads": torch.get_num_threads()}, f)
    return rc


# --------------------------------------------------------------------------- statistics
def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


METRICS = ("iter", "step", "cpu")


def auto_warmup(rec: dict[str, Any], window: int = 5, within: float = 1.1) -> int:
    """The warm-up rule (``--warmup auto``): the steps before the first window of ``window`` steps whose median
    step time (start to end) is within ``within`` times the median of the run's second half, the steady state.
    At most half the run."""
    s, e = rec["starts"], rec["ends"]
    steps = [b - a for a, b in zip(s, e)]
    half = len(steps) // 2
    steady = statistics.median(steps[half:])
    for w in range(half):
        if statistics.median(steps[w:w + window]) <= within * steady:
            return w
    return half


def bootstrap_ci(values: list[float], level: float = 0.95, resamples: int = 4000,
                 seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of ``values`` (``level`` of the resampled medians, seeded:
    the same values give the same interval)."""
    import random

    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo = meds[int((1 - level) / 2 * resamples)]
    hi = meds[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return lo, hi


def step_series(rec: dict[str, Any], warmup: int) -> dict[str, list[float]]:
    """Post-warm-up per-step seconds: ``iter`` (start to next start), ``step`` (start to end),
    ``cpu`` (rank 0's process CPU time, all threads, start to end of the step)."""
    s, e, cs, ce = rec["starts"], rec["ends"], rec["cpu_starts"], rec["cpu_ends"]
    return {"iter": [s[i + 1] - s[i] for i in range(warmup, len(s) - 1)],
            "step": [e[i] - s[i] for i in range(warmup, len(s))],
            "cpu": [ce[i] - cs[i] for i in range(warmup, len(s))]}


# --------------------------------------------------------------------------- machine noise
def cpu_snapshot() -> tuple[float, float, float]:
    """(wall s, whole-machine busy CPU s from /proc/stat, CPU s of this process + its waited-for children)."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        busy = (sum(v) - v[3] - v[4]) / hz
    except (OSError, ValueError):
        busy = float("nan")
    ours = sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))
    return time.perf_counter(), busy, ours


def foreign_load(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """Busy CPUs that were not this benchmark's processes, averaged over the interval (0 = quiet)."""
    wall = after[0] - before[0]
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / max(wall, 1e-9))


def wait_quiet(max_wait_s: float, threshold: float) -> float:
    """Wait (at most ``max_wait_s``) until other processes use less than ``threshold`` CPUs
    over a 1 s sample; returns the last sample's load."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        a = cpu_snapshot()
        time.sleep(1.0)
        load = foreign_load(a, cpu_snapshot())
        if load < threshold or time.perf_counter() >= deadline:
            return load


def describe(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": 1e3 * percentile(xs, 50), "p95_ms": 1e3 * percentile(xs, 95),
            "mean_ms": 1e3 * statistics.fmean(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs)}


def machine_info() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "distkit"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = None, None
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "git_commit": commit, "distkit_dirty": dirty}


def plot(result: dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    a_side, b_side = result["sides"]
    for side, color in ((a_side, "tab:blue"), (b_side, "tab:orange")):
        for i, run in enumerate(r for r in result["runs"] if r["side"] == side):
            ax.plot([1e3 * t for t in run["iter_s"]], color=color, alpha=0.6, lw=0.8,
                    label=side if i == 0 else None)
    ax.set_xlabel("step (after warm-up)")
    ax.set_ylabel("step time (ms)")
    ratio = result["ratio_p50"]
    noisy = f", {len(result['noisy_pairs'])} noisy pairs" if result["noisy_pairs"] else ""
    ax.set_title(f"{result['backend']} grad, charlm {result['config']['size']}, {result['config']['nprocs']} ranks: "
                 f"{b_side}/{a_side} p50 = {ratio:.3f}{noisy}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute (the temp default)."""
    rel = os.path.relpath(path)
    return path if rel.startswith(os.pardir) else rel


# --------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--distkit-worker"]:
        rest = argv[3:] if argv[2:3] == ["--"] else argv[2:]
        return distkit_worker(argv[1], rest)
    ap = argparse.ArgumentParser(description="distkit vs hand-written engine script: per-step time, interleaved A/B.")
    ap.add_argument("--backend", default="ddp", choices=sorted(BACKENDS))
    ap.add_argument("--path", default="cli", choices=["cli", "byo"],
                    help="which distkit side B is: cli = `distkit train` on a generated config (the Trainer); "
                         "byo = benchmarks/byo_charlm.py, the same workload through the bring-your-own-loop API "
                         "(distkit.init / dk.setup / dk.dataloader / dk.backward / dk.step)")
    ap.add_argument("--compare", default=None, choices=sorted(COMPARES),
                    help="instead of distkit vs a hand-written script: two distkit engines against each other "
                         "(mpi-vs-ddp: A = distkit ddp over gloo, B = distkit mpi; both under mpirun); "
                         "ratio = B / A, so < 1 means the mpi engine is faster")
    ap.add_argument("--repeats", type=int, default=5, help="A/B pairs (at least 5 for the issue's numbers)")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps per run, warm-up included")
    ap.add_argument("--warmup", default="10", help="leading steps of each run left out of the stats: a number, or "
                    "'auto' (auto_warmup: until a 5-step window's median is within 1.1x the run's second half)")
    ap.add_argument("--pin", action="store_true", help="each rank bound to its own core, on both sides (pin_rank)")
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="after --repeats pairs, more pairs while the next one fits into S seconds in all")
    ap.add_argument("--aa", action="store_true",
                    help="A/A: distkit against itself (the B side on both sides): the ratio must be 1 within its "
                         "interval, which shows what the measurement can resolve")
    ap.add_argument("--knob", default=None, choices=sorted(KNOBS),
                    help="what one distkit feature costs: A = distkit with it off, B = as shipped (on); the ratio's "
                         "interval holding 1 means no cost this measurement can resolve. " +
                         "; ".join(f"{k}: {v}" for k, v in KNOBS.items()))
    ap.add_argument("--size", default="small", choices=["small", "medium", "large"], help="charlm model size")
    ap.add_argument("--nprocs", type=int, default=2, help="ranks")
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP / mpi-engine bucket size in MiB, both sides")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3], help="--backend deepspeed: ZeRO stage")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--what-if", default=None, choices=["persistent-buffers"],
                    help="run distkit with a proposed fix patched in by the timing wrapper (distkit's files are "
                         "untouched): persistent-buffers = mpi/horovod sync only persistent buffers before each "
                         "forward (no per-step broadcast of charlm's constant causal mask)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per rank (default cores // nprocs)")
    ap.add_argument("--quiet-wait", type=float, default=3.0, metavar="S",
                    help="before each run wait up to S seconds for other processes to go quiet (0: don't)")
    ap.add_argument("--noisy-load", type=float, default=0.1, metavar="CPUS",
                    help="a run during which other processes used more than this many CPUs on average is "
                         "flagged noisy, and so is its pair")
    ap.add_argument("--nice", type=int, default=0,
                    help="scheduling priority for this benchmark and its ranks (e.g. -10 as root on a shared "
                         "machine, so other processes disturb the timings less); 0 leaves it unchanged")
    ap.add_argument("--out", default=None,
                    help="JSON path (the PNG goes next to it). Default: a new directory under the system's temp "
                         "directory (printed at the end) holding overhead_<backend>.json, overhead_byo_<backend>.json "
                         "with --path byo, or <compare with _>.json, e.g. mpi_vs_ddp.json. The committed results "
                         "are rewritten only when asked: --out benchmarks/results/<name>.json")
    ap.add_argument("--run-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="wall-clock limit of each run (one side of one pair, start-up included); past it the run "
                         "and all its processes are killed, its output's tail is printed and the script exits "
                         f"with status {TIMEOUT_EXIT}, writing no result (default 600)")
    ap.add_argument("--keep", action="store_true", help="keep the per-run work directory (logs, configs, times)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if not args.run_timeout > 0:
        ap.error("--run-timeout must be > 0 seconds")
    if args.warmup != "auto" and not args.warmup.isdigit():
        ap.error(f"--warmup must be a number of steps or 'auto', got {args.warmup!r}")
    if args.warmup != "auto" and args.steps < int(args.warmup) + 10:
        ap.error("--steps must exceed --warmup by at least 10")
    if args.aa and args.compare:
        ap.error("--aa runs one side against itself: it does not combine with --compare")
    if args.knob and (args.aa or args.compare or args.path == "byo" or args.what_if):
        ap.error("--knob compares distkit train with and without one feature: it does not combine with --aa, "
                 "--compare, --path byo or --what-if")
    if args.path == "byo" and args.compare:
        ap.error("--path byo compares against a hand-written script: it does not combine with --compare")
    if args.path == "byo" and args.what_if:
        ap.error("--what-if patches the CLI path's worker: use it with --path cli")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.nprocs)
    if args.nice:
        try:  # the ranks inherit it
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        except OSError as e:
            print(f"overhead: cannot set nice {args.nice} ({e}); running at the current priority", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="distkit-overhead-")
    runners: dict[str, Callable[[str], dict[str, Any]]]
    if args.compare:
        a_name, b_name, launcher, launcher_name = COMPARES[args.compare]
        be_a, be_b = BACKENDS[a_name], BACKENDS[b_name]
        sides = (f"distkit_{a_name}", f"distkit_{b_name}")
        runners = {sides[0]: lambda tag: run_distkit(be_a, args, work, tag, launcher),
                   sides[1]: lambda tag: run_distkit(be_b, args, work, tag, launcher)}
        title, be = args.compare, be_b
        name = f"{args.compare.replace('-', '_')}.json"
        baseline = None
        side_desc = {sides[0]: f"distkit {a_name} grad ({be_a.transport})", sides[1]: f"distkit {b_name} grad ({be_b.transport})"}
        dk_configs = {sides[0]: distkit_config(be_a, args, "<tmp>"), sides[1]: distkit_config(be_b, args, "<tmp>")}
    elif args.knob:
        be = BACKENDS[args.backend]
        knob = args.knob
        sides = (f"{knob}_off", f"{knob}_on")
        runners = {sides[0]: lambda tag: run_distkit(be, args, work, tag, knob_off=knob),
                   sides[1]: lambda tag: run_distkit(be, args, work, tag)}
        title, launcher_name, baseline = args.backend, be.launcher_name, None
        name = f"knob_{knob}_{args.backend}.json"
        side_desc = {sides[0]: f"distkit {be.name} grad without {KNOBS[knob]}", sides[1]: f"distkit {be.name} grad as shipped"}
        dk_configs = {sides[1]: distkit_config(be, args, "<tmp>")}
    elif args.path == "byo":
        be = BACKENDS[args.backend]
        sides = ("raw", "byo")
        runners = {"raw": lambda tag: run_raw(be, args, work, tag), "byo": lambda tag: run_byo(be, args, work, tag)}
        title, launcher_name, baseline = args.backend, be.launcher_name, f"benchmarks/{be.baseline}"
        name = f"overhead_byo_{args.backend}.json"
        side_desc = {"raw": f"{baseline} ({be.transport})",
                     "byo": f"benchmarks/byo_charlm.py: distkit {be.name} grad through distkit.init/dk.step "
                            f"({be.transport})"}
        dk_configs = {"byo": {"command_line": byo_overrides(be, args), "batch_size": args.batch_size,
                              "size": args.size, "seq_len": args.seq_len, "lr": args.lr, "steps": args.steps}}
    else:
        be = BACKENDS[args.backend]
        sides = ("raw", "distkit")
        runners = {"raw": lambda tag: run_raw(be, args, work, tag), "distkit": lambda tag: run_distkit(be, args, work, tag)}
        title, launcher_name, baseline = args.backend, be.launcher_name, f"benchmarks/{be.baseline}"
        suffix = f"_whatif_{args.what_if.replace('-', '_')}" if args.what_if else ""
        name = f"overhead_{args.backend}{suffix}.json"
        side_desc = {"raw": f"{baseline} ({be.transport})", "distkit": f"distkit {be.name} grad ({be.transport})"}
        dk_configs = {"distkit": distkit_config(be, args, "<tmp>")}
    if args.aa:  # the B side twice, under two names: A/A
        b_run = runners[sides[1]]
        sides = (f"{sides[1]}_a", f"{sides[1]}_b")
        runners = {sides[0]: b_run, sides[1]: b_run}
        side_desc = {side: side_desc[side.rsplit("_", 1)[0]] for side in sides}
        name = name.replace(".json", "_aa.json")
    a_side, b_side = sides
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # a bad path fails before the runs

    runs: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    try:
        pair = 0
        while pair < args.repeats or (args.budget is not None and
                                      time.perf_counter() - t_all + (time.perf_counter() - t_all) / pair <= args.budget):
            order = (a_side, b_side) if pair % 2 == 0 else (b_side, a_side)  # A B, B A, ...
            for side in order:
                tag = f"{pair:02d}-{side}"
                load_before = wait_quiet(args.quiet_wait, args.noisy_load) if args.quiet_wait > 0 else None
                snap = cpu_snapshot()
                rec = runners[side](tag)
                load = foreign_load(snap, cpu_snapshot())
                warmup = auto_warmup(rec) if args.warmup == "auto" else int(args.warmup)
                series = step_series(rec, warmup)
                run = {"pair": pair, "side": side, "warmup": warmup, **{m: describe(series[m]) for m in METRICS},
                       "process_wall_s": round(rec["process_wall_s"], 3),
                       "foreign_load_cpus": round(load, 3),
                       "foreign_load_before_cpus": None if load_before is None else round(load_before, 3),
                       "param_checksum": rec["param_checksum"], "final_loss": rec["final_loss"],
                       "torch_threads": rec["torch_threads"], **{f"{m}_s": series[m] for m in METRICS}}
                if "summary" in rec:
                    run["distkit_summary"] = rec["summary"]
                runs.append(run)
                print(f"pair {pair} {side:15s}  iter p50 {run['iter']['p50_ms']:7.2f} ms  p95 {run['iter']['p95_ms']:7.2f} ms"
                      f"  cpu p50 {run['cpu']['p50_ms']:7.2f} ms  other load {load:4.2f} cpus"
                      f"  ({run['process_wall_s']:.1f}s)", flush=True)
            pair += 1
    finally:
        if args.keep:
            print(f"work directory kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    def by_pair(pair: int, side: str) -> dict[str, Any]:
        return next(r for r in runs if r["pair"] == pair and r["side"] == side)

    def compare(pairs: list[int]) -> dict[str, Any]:
        """Pooled p50/p95/mean per side over ``pairs`` and the B/A ratios, per metric."""
        if not pairs:
            return {"pairs": []}
        res: dict[str, Any] = {"pairs": pairs}
        for m in METRICS:
            st = {side: describe([t for p in pairs for t in by_pair(p, side)[f"{m}_s"]]) for side in sides}
            res[m] = {**st, "ratio": {q: st[b_side][f"{q}_ms"] / st[a_side][f"{q}_ms"] for q in ("p50", "p95", "mean")}}
        res["pair_ratios_iter_p50"] = [by_pair(p, b_side)["iter"]["p50_ms"] / by_pair(p, a_side)["iter"]["p50_ms"]
                                       for p in pairs]
        res["pair_ratio_iter_p50_median"] = statistics.median(res["pair_ratios_iter_p50"])
        res["pair_ratios_cpu_p50"] = [by_pair(p, b_side)["cpu"]["p50_ms"] / by_pair(p, a_side)["cpu"]["p50_ms"]
                                      for p in pairs]
        # the figure to quote: the median of the per-pair ratios with its 95 % bootstrap interval
        res["pair_ratio"] = {m: {"median": statistics.median(res[f"pair_ratios_{m}_p50"]),
                                 "ci95": bootstrap_ci(res[f"pair_ratios_{m}_p50"])} for m in ("iter", "cpu")}
        return res

    all_pairs = sorted({r["pair"] for r in runs})
    quiet_pairs = [p for p in all_pairs
                   if max(by_pair(p, a_side)["foreign_load_cpus"], by_pair(p, b_side)["foreign_load_cpus"]) <= args.noisy_load]
    every, quiet = compare(all_pairs), compare(quiet_pairs)
    checksums = {r["param_checksum"] for r in runs}
    loads = [r["foreign_load_cpus"] for r in runs]
    result = {
        "benchmark": "compare" if args.compare else f"knob {args.knob}" if args.knob else "overhead", "backend": title, "mode": "grad",
        **({} if args.compare else {"path": args.path}),
        "sides": list(sides), "side_descriptions": side_desc,
        "ratio_definition": f"{b_side} / {a_side}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *argv]),
        "machine": machine_info(),
        "config": {"task": "charlm", "size": args.size, "seq_len": args.seq_len, "nprocs": args.nprocs,
                   "batch_size_per_rank": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                   "repeats": args.repeats, "pairs_run": len(all_pairs), "budget_s": args.budget, "pin": args.pin,
                   "aa": args.aa, "knob": args.knob, "bucket_cap_mb": args.bucket_cap_mb, "optimizer": "sgd", "lr": args.lr,
                   "seed": args.seed, "omp_num_threads": args.threads, "transport": be.transport,
                   "what_if": args.what_if,
                   **({"zero_stage": args.zero_stage} if be.name == "deepspeed" else {}),
                   "launcher": launcher_name, "baseline": baseline,
                   "quiet_wait_s": args.quiet_wait, "noisy_load_cpus": args.noisy_load,
                   "nice": os.getpriority(os.PRIO_PROCESS, 0),
                   "distkit_config": dk_configs},
        "method": (("rank 0 perf_counter/process_time at start and end of every optimizer step, inline in both "
                    "scripts (raw and byo_charlm.py: before pulling the step's batch, after the optimizer step "
                    "and zero_grad)" if args.path == "byo" else
                    "rank 0 perf_counter/process_time at start and end of every optimizer step, taken outside the "
                    "step function on both sides (distkit: a wrapper around TrainingRun.train_step, the real CLI run "
                    "in-process)") + "; first `warmup` steps dropped; 'iter' = start to next start (headline), 'step' = "
                   "inside the step, 'cpu' = rank 0's CPU seconds in the step (insensitive to other processes); "
                   "p50/p95 over the pooled steps of all runs of a side; runs interleaved A B, B A, ...; "
                   "foreign_load_cpus = CPUs busy with processes not ours during the run (/proc/stat minus rusage)"),
        # Headline: every pair, as the issue asks. `quiet` repeats it over the pairs no other process disturbed.
        "ratio_p50": every["iter"]["ratio"]["p50"],
        "ratio_p95": every["iter"]["ratio"]["p95"],
        "cpu_ratio_p50": every["cpu"]["ratio"]["p50"],
        "cpu_ratio_p95": every["cpu"]["ratio"]["p95"],
        "foreign_load_cpus": {"mean": statistics.fmean(loads), "max": max(loads)},
        # Faster = the pooled p50 AND the median of the per-pair p50 ratios below 1 (one lucky pair cannot decide it).
        **({"target": "mpi engine faster than DDP over gloo: ratio_p50 < 1 and median per-pair p50 ratio < 1",
            "meets_target": every["iter"]["ratio"]["p50"] < 1.0 and every["pair_ratio_iter_p50_median"] < 1.0}
           if args.compare else
           {"target": f"{'A/A' if args.aa else args.knob + ' off/on'}: 1 inside the median pair ratio's 95 % interval (iter)",
            "meets_target": every["pair_ratio"]["iter"]["ci95"][0] <= 1.0 <= every["pair_ratio"]["iter"]["ci95"][1]}
           if args.aa or args.knob else
           {"target_ratio_p50": TARGET_P50_RATIO, "meets_target": every["iter"]["ratio"]["p50"] <= TARGET_P50_RATIO}),
        "noisy_pairs": [p for p in all_pairs if p not in quiet_pairs],
        "same_work": len(checksums) == 1,
        "all": every,
        "quiet": quiet,
        "total_wall_s": round(time.perf_counter() - t_all, 1),
        "runs": runs,
    }
    if args.out:
        out = args.out
    else:
        # A fresh directory per invocation, made only once there is a result: a default run (make bench, a
        # trial) never overwrites benchmarks/results/, which holds the committed measurements.
        out = os.path.join(tempfile.mkdtemp(prefix="distkit-overhead-results-"), name)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    png = plot(result, os.path.splitext(out)[0] + ".png")

    def line(name: str, c: dict[str, Any]) -> str:
        if not c["pairs"]:
            return f"{name}: no pairs"
        it, cpu = c["iter"], c["cpu"]
        return (f"{name} ({len(c['pairs'])} pairs): {a_side} p50 {it[a_side]['p50_ms']:.2f} / p95 {it[a_side]['p95_ms']:.2f} ms, "
                f"{b_side} p50 {it[b_side]['p50_ms']:.2f} / p95 {it[b_side]['p95_ms']:.2f} ms -> "
                f"ratio p50 {it['ratio']['p50']:.4f}, p95 {it['ratio']['p95']:.4f}; "
                f"per-pair p50 ratios {', '.join(f'{x:.3f}' for x in c['pair_ratios_iter_p50'])}; "
                + "".join(f"median pair ratio, {m}: {c['pair_ratio'][m]['median']:.4f} "
                          f"(95 % interval {c['pair_ratio'][m]['ci95'][0]:.4f}-{c['pair_ratio'][m]['ci95'][1]:.4f}); "
                          for m in ("iter", "cpu")) +
                f"cpu-time ratio p50 {cpu['ratio']['p50']:.4f}, p95 {cpu['ratio']['p95']:.4f}")
    target = ("ratio p50 < 1 and median pair ratio < 1 (mpi faster)" if args.compare else
              "A/A: 1 inside the interval" if args.aa else
              f"{args.knob} costs nothing measurable: 1 inside the interval" if args.knob else f"ratio p50 <= {TARGET_P50_RATIO}")
    print("\n" + line("all pairs", every) + "\n" + line("quiet pairs", quiet) +
          f"\nforeign load: mean {result['foreign_load_cpus']['mean']:.2f}, max {result['foreign_load_cpus']['max']:.2f} cpus"
          f"\ntarget: {target} -> {'met' if result['meets_target'] else 'NOT met'}"
          + (f" (noisy pairs {result['noisy_pairs']}: other processes were using the CPUs)" if result["noisy_pairs"] else "")
          + f"\nsame final parameters on both sides: {result['same_work']}\n"
          f"wrote {_shown(out)}" + (f" and {_shown(png)}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
