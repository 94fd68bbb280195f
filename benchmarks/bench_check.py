"""The overhead guard (``make bench-check``): every engine and path against its hand-written loop, fails when a
ratio's interval lies above its bound.

    python benchmarks/bench_check.py [--engines ddp,mpi,horovod,deepspeed,fsdp] [--paths cli,byo] [--pairs N]
                                     [--bridges fabric,lightning,paramsync,trainer] [--quick] [--bound 1.03]
                                     [--target 1.01] [--size small] [--out DIR]

For each engine and path it runs ``interleaved.py --pin --pairs N`` (one job: distkit and the hand-written loop in
the same processes, alternating blocks of 10 steps; the median of the per-pair ratios with its 95 % bootstrap
interval; both sides must end with the same parameters) and reads the result. Then, for each bridge,
``interleaved_bridges.py --bridge B --pin`` the same way (the Fabric, the Lightning Trainer, Accelerate's
``LocalSGD`` loop and the transformers Trainer, each against its framework's own DDP; ``--bridges ''`` for none).
``N`` is ``--pairs`` where given, else the engine's own default (:data:`PAIRS`: ddp, mpi and horovod 110,
ZeRO-2 100, fsdp 64, about the same minutes each; about 33 minutes in all), or with ``--quick``
:data:`QUICK_PAIRS` (a first look for an engine's own change: ``--engines fsdp --quick``). A check fails
when the interval's lower end is above ``--bound`` for the wall time per block or rank 0's CPU time per block: the engine is then slower than its hand-written loop by more than the bound, beyond what the
measurement's noise explains. An interval that straddles the bound passes and is marked: the measurement could
not tell (more ``--pairs`` narrow it). ``--target`` (issue 61's 1.01) fails nothing: the verdict line counts the
intervals whose upper end lies above it.

Output: one table, then the directory of every JSON (``--out``, a fresh temp directory by default), and last the
verdict (:func:`verdict_line`): ``bench-check: pass (worst: horovod byo wall 1.0122 (1.0053-1.0160); ...)``, the
worst being the interval whose lower end is highest (the one nearest to failing). Exit status 1 when any check
fails, 0 otherwise.

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
ENGINES = ("ddp", "mpi", "horovod", "deepspeed", "fsdp")
PATHS = ("cli", "byo")
#: seconds one pair takes on the quiet 2-core machine, the job's start left out ((job wall - START_S) / pairs, from
#: benchmarks/results/bench_check_interleaved_20261129, issue61_20261206 and issue61_20261206_quiet, and
#: benchmarks/README.md's timings; horovod's since its polling thread yields: 172 s a job at 120 pairs). fsdp's
#: three gloo collectives per unit and step make its pair about twice the others'; a bridge's pair runs a framework's
#: loop on each side. At the old counts (120, fsdp 80) this gives 36.3 minutes; about 36 were measured
PAIR_S: dict[str, float] = {"ddp": 1.33, "mpi": 1.24, "horovod": 1.31, "deepspeed": 1.47, "fsdp": 2.8,
                            "fabric": 1.33, "lightning": 1.43, "paramsync": 1.7, "trainer": 1.43}
#: seconds a job spends outside its pairs (launch, imports, the two models, the final parameter check)
START_S = 15.0
#: issue 61, item 5: the whole default check must fit this many minutes on the quiet machine
BUDGET_MIN = 35.0
#: pairs per engine and path by default (warm-up pairs included), sized so that every case takes about the same
#: minutes and the whole check fits :data:`BUDGET_MIN` by :func:`planned_minutes`: about 32.5 minutes (each 95 %
#: interval about 5 % wider than at 120 pairs, fsdp's about 12 % wider than at 80)
PAIRS: dict[str, int] = {"ddp": 110, "mpi": 110, "horovod": 110, "deepspeed": 100, "fsdp": 64,
                         "fabric": 40, "lightning": 40, "paramsync": 40, "trainer": 40}
#: the bridges against their framework's own way (interleaved_bridges.py --bridge)
BRIDGES = ("fabric", "lightning", "paramsync", "trainer")
#: ``--quick``: pairs per engine and path (36 measured after the 4 warm-up pairs: about ±2 % on this machine)
QUICK_PAIRS = 40


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


def pairs_for(engine: str, pairs: Optional[int], quick: bool) -> int:
    """The pairs one engine's jobs run: ``--pairs`` where given, else :data:`QUICK_PAIRS` with ``--quick``, else the
    engine's :data:`PAIRS`."""
    if pairs is not None:
        return pairs
    return QUICK_PAIRS if quick else PAIRS[engine]


def planned_minutes(jobs: list[tuple[str, int]]) -> float:
    """Minutes the check's ``jobs`` (engine or bridge, pairs) take on the quiet machine, by :data:`PAIR_S` and
    :data:`START_S`: an estimate printed before the first job (a loaded machine stretches it)."""
    return sum(START_S + n * PAIR_S[name] for name, n in jobs) / 60


Row = tuple[str, str, str, str, Optional[dict[str, Any]]]


def verdict_line(rows: list[Row], target: float) -> str:
    """The last line printed: ``bench-check: pass|FAIL (...)``. FAIL names the failed cases first; then the worst
    interval over every case and metric (wall, CPU): the one whose lower end is highest, ties broken by the higher
    median, as ``ENGINE PATH METRIC MEDIAN (LOW-HIGH)``; then how many intervals end above ``target``."""
    failed = [f"{e} {p}: {verdict}{f' ({which})' if which else ''}"
              for e, p, verdict, which, _ in rows if verdict in ("FAIL", "ERROR")]
    cells = [(r["pair_ratio"][m]["ci95"][0], r["pair_ratio"][m]["median"], r["pair_ratio"][m]["ci95"][1], e, p, m)
             for e, p, _, _, r in rows if r is not None for m in METRICS]
    parts = []
    if failed:
        parts.append("; ".join(failed))
    if cells:
        lo, med, hi, e, p, m = max(cells, key=lambda c: (c[0], c[1]))
        parts.append(f"worst: {e} {p} {m} {med:.4f} ({lo:.4f}-{hi:.4f})")
        above = sum(1 for c in cells if c[2] > target)
        parts.append(f"{above} of {len(cells)} intervals end above {target}")
    else:
        parts.append("nothing measured")
    return f"bench-check: {'FAIL' if failed else 'pass'} ({'; '.join(parts)})"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--bridges", default=",".join(BRIDGES), help="bridges against their framework's own way "
                    "(interleaved_bridges.py; '' for none)")
    ap.add_argument("--pairs", type=int, default=None, help="pairs per engine and path (interleaved.py --pairs; "
                    "default: the engine's own, PAIRS: 120, fsdp 80, about 3 minutes each for the small model here)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_PAIRS} pairs per engine and path (unless --pairs): "
                    "a first look for an engine's own change, e.g. --engines fsdp --quick (about 1-2 minutes a case)")
    ap.add_argument("--bound", type=float, default=1.03, help="the largest ratio distkit / hand-written allowed")
    ap.add_argument("--target", type=float, default=1.01, help="reported only: how many intervals end above it")
    ap.add_argument("--size", default="small", choices=["small", "medium"])
    ap.add_argument("--out", default=None, help="directory for the JSON results (default: a fresh temp directory)")
    args = ap.parse_args(argv)
    engines, paths = [e for e in args.engines.split(",") if e], [p for p in args.paths.split(",") if p]
    bridges = [b for b in args.bridges.split(",") if b]
    bad = ([e for e in engines if e not in ENGINES] + [p for p in paths if p not in PATHS] +
           [b for b in bridges if b not in BRIDGES])
    if bad:
        print(f"bench_check: unknown engine, path or bridge {', '.join(bad)}: engines {', '.join(ENGINES)}; paths "
              f"{', '.join(PATHS)}; bridges {', '.join(BRIDGES)}", file=sys.stderr)
        return 2
    out = args.out or tempfile.mkdtemp(prefix="distkit-bench-check-")
    os.makedirs(out, exist_ok=True)
    rows: list[Row] = []
    failed = False
    cases = [(engine, path, [os.path.join(HERE, "interleaved.py"), "--backend", engine, "--path", path,
                             "--pairs", str(pairs_for(engine, args.pairs, args.quick))])
             for engine in engines for path in paths]
    cases += [("bridge", bridge, [os.path.join(HERE, "interleaved_bridges.py"), "--bridge", bridge, "--pairs",
                                  str(pairs_for(bridge, args.pairs, args.quick))]) for bridge in bridges]
    plan = [(engine if engine != "bridge" else path, int(job[-1])) for engine, path, job in cases]
    print(f"bench_check: {len(cases)} case(s), about {planned_minutes(plan):.0f} minutes on a quiet machine",
          flush=True)
    for engine, path, job in cases:
        dest = os.path.join(out, f"{engine}_{path}.json")
        cmd = [sys.executable, *job, "--pin", "--size", args.size, "--out", dest]
        print(f"bench_check: {engine} {path}: {' '.join(cmd[1:])}", flush=True)
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if res.returncode != 0:
            print(res.stdout[-3000:], file=sys.stderr)
            rows.append((engine, path, "ERROR", f"{os.path.basename(job[0])} exited {res.returncode}", None))
            failed = True
            continue
        with open(dest) as f:
            result = json.load(f)
        verdict, which = check(result, args.bound)
        failed = failed or verdict == "FAIL"
        rows.append((engine, path, verdict, ", ".join(which), result))
    print(f"\n{'engine':10s} {'path':9s} {'pairs':>5s}  {'wall ratio (95 % interval)':28s} "
          f"{'cpu ratio (95 % interval)':28s} load  job s  verdict (bound {args.bound})")
    for engine, path, verdict, which, result in rows:
        if result is None:
            print(f"{engine:10s} {path:9s} {'':>5s}  {which}")
            continue
        r = result["pair_ratio"]
        cell = {m: f"{r[m]['median']:.4f} ({r[m]['ci95'][0]:.4f}-{r[m]['ci95'][1]:.4f})" for m in METRICS}
        print(f"{engine:10s} {path:9s} {r['wall']['n']:5d}  {cell['wall']:28s} {cell['cpu']:28s} "
              f"{result['foreign_load_cpus']:4.2f}  {result['job_wall_s']:5.0f}  "
              f"{verdict}{f' ({which})' if which else ''}")
    print(f"results: {out}")
    print(verdict_line(rows, args.target), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
