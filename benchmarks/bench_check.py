"""The overhead guard (``make bench-check``): every engine and path against its hand-written loop, fails when a
ratio's interval lies above its bound.

    python benchmarks/bench_check.py [--engines ddp,mpi,horovod,deepspeed] [--paths cli,byo] [--pairs 120]
                                     [--bound 1.03] [--size small] [--out DIR]

For each engine and path it runs ``interleaved.py --pin --pairs N`` (one job: distkit and the hand-written loop in
the same processes, alternating blocks of 10 steps; the median of the per-pair ratios with its 95 % bootstrap
interval; both sides must end with the same parameters) and reads the result. A check
fails when the interval's lower end is above ``--bound`` for the wall time per block or rank 0's CPU time
per block: the engine is then slower than its hand-written loop by more than the bound, beyond what the
measurement's noise explains. An interval that straddles the bound passes and is marked: the measurement could
not tell (more ``--pairs`` narrow it). Exit status 1 when any check fails, 0 otherwise; one table on stdout,
every JSON in ``--out`` (a fresh temp directory by default).

Not part of ``make test``: timing never goes into a test. Run it on a quiet machine (``interleaved.py`` records the
foreign load of every job; a loaded machine widens the intervals).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ENGINES = ("ddp", "mpi", "horovod", "deepspeed")
PATHS = ("cli", "byo")


#: fewer pairs than this give no interval worth the name: the check fails, asking for more pairs
MIN_PAIRS = 20
#: what is checked: wall time per block and rank 0's CPU time per block (interleaved.py)
METRICS = ("wall", "cpu")


def check(result: dict[str, Any], bound: float) -> tuple[str, list[str]]:
    """("pass" | "FAIL" | "pass, undecided", what failed) for one overhead.py result against ``bound``."""
    ratio = result["pair_ratio"]
    if ratio["wall"]["n"] < MIN_PAIRS:
        return "FAIL", [f"{ratio['wall']['n']} pair(s), fewer than {MIN_PAIRS}: more --pairs"]
    if not result["same_work"]:
        return "FAIL", ["the two sides ended with different parameters"]
    above = [m for m in METRICS if ratio[m]["ci95"][0] > bound]
    straddles = [m for m in METRICS if ratio[m]["ci95"][0] <= bound < ratio[m]["ci95"][1]]
    if above:
        return "FAIL", above
    return ("pass, undecided" if straddles else "pass"), straddles


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--pairs", type=int, default=120, help="pairs per engine and path (interleaved.py --pairs; 120: "
                    "about 2.5 minutes each for the small model here)")
    ap.add_argument("--bound", type=float, default=1.03, help="the largest ratio distkit / hand-written allowed")
    ap.add_argument("--size", default="small", choices=["small", "medium"])
    ap.add_argument("--out", default=None, help="directory for the JSON results (default: a fresh temp directory)")
    args = ap.parse_args(argv)
    engines, paths = args.engines.split(","), args.paths.split(",")
    bad = [e for e in engines if e not in ENGINES] + [p for p in paths if p not in PATHS]
    if bad:
        print(f"bench_check: unknown engine or path {', '.join(bad)}: engines {', '.join(ENGINES)}; paths "
              f"{', '.join(PATHS)}", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="distkit-bench-check-")
    os.makedirs(out, exist_ok=True)
    rows, failed = [], False
    for engine in engines:
        for path in paths:
            dest = os.path.join(out, f"{engine}_{path}.json")
            cmd = [sys.executable, os.path.join(HERE, "interleaved.py"), "--backend", engine, "--path", path, "--pin",
                   "--pairs", str(args.pairs), "--size", args.size, "--out", dest]
            print(f"bench_check: {engine} {path}: {' '.join(cmd[1:])}", flush=True)
            res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if res.returncode != 0:
                print(res.stdout[-3000:], file=sys.stderr)
                rows.append((engine, path, "ERROR", f"interleaved.py exited {res.returncode}", None))
                failed = True
                continue
            with open(dest) as f:
                result = json.load(f)
            verdict, which = check(result, args.bound)
            failed = failed or verdict == "FAIL"
            rows.append((engine, path, verdict, ", ".join(which), result))
    print(f"\n{'engine':10s} {'path':4s} {'pairs':>5s}  {'wall ratio (95 % interval)':28s} "
          f"{'cpu ratio (95 % interval)':28s} load  verdict (bound {args.bound})")
    for engine, path, verdict, which, result in rows:
        if result is None:
            print(f"{engine:10s} {path:4s} {'':>5s}  {which}")
            continue
        r = result["pair_ratio"]
        cell = {m: f"{r[m]['median']:.4f} ({r[m]['ci95'][0]:.4f}-{r[m]['ci95'][1]:.4f})" for m in METRICS}
        print(f"{engine:10s} {path:4s} {r['wall']['n']:5d}  {cell['wall']:28s} {cell['cpu']:28s} "
              f"{result['foreign_load_cpus']:4.2f}  {verdict}{f' ({which})' if which else ''}")
    print(f"results: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
