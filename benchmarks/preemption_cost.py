"""What the preemption check costs per step: ``distkit train`` with ``preemption = True`` (one MAX all-reduce of one
number after every optimizer step, :mod:`distkit.health.preemption`) against the same run with ``preemption = False``.

    python benchmarks/preemption_cost.py [--engine ddp|mpi] [--size small|medium] [--steps 200] [--repeats 5]

Interleaved A/B pairs (False, True; True, False; ...) of ``--nprocs 2`` runs of the charlm task; each run's loop
time per step is ``summary.json``'s ``wall_time_s / steps`` (the loop only: set-up excluded). Prints and writes
(``--out``, default a fresh temp directory) the per-run numbers, the median of each side and their ratio; both
sides must end with the same ``param_checksum`` (the check changes no number)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(out: str, preemption: bool, args: argparse.Namespace) -> dict:
    engine = [] if args.engine == "ddp" else ["++torch_distributed", "None", "++distributed.backend", args.engine]
    cmd = [sys.executable, "-m", "distkit", "train", os.path.join(ROOT, "configs", "returnn_ddp.py"), "--nprocs", "2",
           "++task", "charlm", "++charlm_size", args.size, "++max_steps", str(args.steps), "++log_every", "50",
           "++progress_bar", "False", "++output_dir", out, "++preemption", str(preemption), *engine]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=args.run_timeout)
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    return {"preemption": preemption, "step_s": s["wall_time_s"] / s["steps"], "checksum": s["param_checksum"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["ddp", "mpi"], default="ddp")
    p.add_argument("--size", choices=["small", "medium"], default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--run-timeout", dest="run_timeout", type=float, default=600)
    p.add_argument("--out", default=None, help="result JSON (default: a fresh temp directory)")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="distkit-preemption-cost-")
    runs = []
    for i in range(args.repeats):
        for preemption in ((False, True) if i % 2 == 0 else (True, False)):
            runs.append(one_run(os.path.join(work, f"run{i}-{preemption}"), preemption, args))
            print(json.dumps(runs[-1]), flush=True)
    off = statistics.median(r["step_s"] for r in runs if not r["preemption"])
    on = statistics.median(r["step_s"] for r in runs if r["preemption"])
    result = {"engine": args.engine, "size": args.size, "steps": args.steps, "repeats": args.repeats,
              "median_step_s_without": off, "median_step_s_with": on, "ratio_with_over_without": on / off,
              "same_work": len({r["checksum"] for r in runs}) == 1, "runs": runs}
    out = args.out or os.path.join(work, f"preemption_cost_{args.engine}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{args.engine} charlm {args.size}: {off * 1e3:.2f} ms/step without, {on * 1e3:.2f} ms/step with the "
          f"check: ratio {on / off:.3f}; same work: {result['same_work']}; wrote {out}")


if __name__ == "__main__":
    main()
