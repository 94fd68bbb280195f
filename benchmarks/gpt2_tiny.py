"""Training throughput (samples/s) of the Hugging Face GPT-2 tiny config per engine and mode.

    python benchmarks/gpt2_tiny.py [--repeats 2] [--steps 300] [--nprocs 2] [--cases ddp-grad,mpi-param,...]

Every case is the real ``distkit train configs/gpt2_tiny.py --nprocs N`` with the engine and mode
picked on the command line (``++distributed "{...}"``), nothing else changed: ddp, mpi, horovod (the
real Horovod: ``require_horovod``) and DeepSpeed ZeRO-2, each in grad mode and in param mode
(averaging every ``--sync`` steps). The config's own AdamW, batch 8 per rank, ``--steps`` optimizer
steps, ``OMP_NUM_THREADS`` = cores // ranks (as ``overhead.py``).

Throughput is read from distkit's own ``metrics.jsonl`` (rank 0 logs every ``--log-every`` steps the
global samples so far and ``samples_per_s`` = samples / seconds since the loop started): between the
first and the last record, ``(samples_b - samples_a) / (t_b - t_a)``, so the first window (warm-up:
allocations, DeepSpeed's first step) and everything outside the loop (process start, imports, the
final eval and checkpoint) are left out. ``summary.json``'s whole-run ``samples_per_s`` (since
``setup``, eval and final checkpoint included) is recorded too. Cases run interleaved (all cases,
then all again), so slow drift of the machine hits every case alike; the table gives the median over
repeats and each case's foreign load (CPUs busy with other processes, from /proc/stat).

Writes ``benchmarks/results/gpt2_tiny.json`` and prints a markdown table.
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

from overhead import ROOT, cpu_snapshot, foreign_load, machine_info

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(ROOT, "configs", "gpt2_tiny.py")
ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"backend": "ddp"},
    "mpi": {"backend": "mpi"},
    "horovod": {"backend": "horovod", "require_horovod": True},
    "deepspeed-z2": {"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}},
}
CASES = [f"{e}-{m}" for e in ENGINES for m in ("grad", "param")]


def distributed(case: str, sync: int) -> dict[str, Any]:
    engine, mode = case.rsplit("-", 1)
    d = dict(ENGINES[engine])
    if mode == "param":
        d.update(reduce_type="param", param_sync_step=sync)
    return d


def steady_samples_per_s(metrics_path: str) -> float:
    """Samples/s between rank 0's first and last training log record (first window left out)."""
    with open(metrics_path) as f:
        recs = [r for r in map(json.loads, f) if "samples_per_s" in r]
    if len(recs) < 2:
        raise SystemExit(f"gpt2_tiny: fewer than 2 log records in {metrics_path}: use more --steps")
    a, b = recs[0], recs[-1]
    t_a, t_b = a["samples"] / a["samples_per_s"], b["samples"] / b["samples_per_s"]
    return (b["samples"] - a["samples"]) / (t_b - t_a)


def run_case(case: str, args: argparse.Namespace, work: str, rep: int) -> dict[str, Any]:
    out = os.path.join(work, f"{case}-{rep}")
    cmd = [sys.executable, "-m", "distkit", "train", CONFIG, "--nprocs", str(args.nprocs),
           "++distributed", repr(distributed(case, args.sync)), "++max_steps", str(args.steps),
           "++log_every", str(args.log_every), "++output_dir", out, "++progress_bar", "False"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR="cpu",
               PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    env.pop("DISTKIT_FAULT", None)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    before = cpu_snapshot()
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    after = cpu_snapshot()
    if res.returncode != 0:
        raise SystemExit(f"gpt2_tiny: {case} failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout[-2000:]}\n"
                         f"{res.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    return {"case": case, "repeat": rep, "samples_per_s": steady_samples_per_s(os.path.join(out, "metrics.jsonl")),
            "run_samples_per_s": s["samples_per_s"], "compute_fraction": s["compute_fraction"],
            "steps": s["steps"], "samples": s["samples"], "eval_loss": s["eval_loss"], "ranks_in_sync": s["ranks_in_sync"],
            "backend_impl": s["backend_impl"], "comm_bytes": s["comm_bytes"], "process_wall_s": after[0] - before[0],
            "foreign_load": foreign_load(before, after)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs per case (interleaved)")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--log-every", type=int, default=25, help="distkit's log_every (the measuring windows)")
    ap.add_argument("--sync", type=int, default=10, help="param mode: param_sync_step")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS per rank (default cores // nprocs)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpt2_tiny.json"))
    args = ap.parse_args(argv)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.nprocs)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}: choose from {CASES}")
    runs: list[dict[str, Any]] = []
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="distkit-gpt2-bench-") as work:
        for rep in range(args.repeats):
            for case in cases if rep % 2 == 0 else cases[::-1]:  # alternate the order: drift hits all alike
                r = run_case(case, args, work, rep)
                print(f"{case:20s} repeat {rep}: {r['samples_per_s']:8.1f} samples/s "
                      f"(foreign load {r['foreign_load']:.2f} CPUs)", flush=True)
                runs.append(r)
    table = []
    for case in cases:
        mine = [r for r in runs if r["case"] == case]
        table.append({"case": case, "engine": case.rsplit("-", 1)[0], "mode": case.rsplit("-", 1)[1],
                      "samples_per_s_median": statistics.median(r["samples_per_s"] for r in mine),
                      "samples_per_s_runs": [round(r["samples_per_s"], 1) for r in mine],
                      "run_samples_per_s_median": statistics.median(r["run_samples_per_s"] for r in mine),
                      "foreign_load_mean": statistics.fmean(r["foreign_load"] for r in mine),
                      "ranks_in_sync": all(r["ranks_in_sync"] for r in mine), "backend_impl": mine[0]["backend_impl"]})
    result = {"benchmark": "gpt2_tiny", "config": "configs/gpt2_tiny.py", "nprocs": args.nprocs,
              "batch_size_per_rank": 8, "steps": args.steps, "log_every": args.log_every, "param_sync_step": args.sync,
              "threads_per_rank": args.threads, "repeats": args.repeats, "seconds": time.time() - t0,
              "machine": machine_info(), "table": table, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nGPT-2 tiny ({args.nprocs} ranks x batch 8, {args.steps} steps, param_sync_step {args.sync}; "
          f"samples/s after the first {args.log_every} steps, median of {args.repeats})\n")
    print("| engine | mode | samples/s | runs | whole run (samples/s) | foreign load (CPUs) |")
    print("|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['engine']} | {row['mode']} | {row['samples_per_s_median']:.0f} | "
              f"{', '.join(f'{x:.0f}' for x in row['samples_per_s_runs'])} | {row['run_samples_per_s_median']:.0f} | "
              f"{row['foreign_load_mean']:.2f} |")
    print(f"\nwritten: {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
