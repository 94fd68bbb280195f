"""How distkit's per-step cost grows with the model and the world size (issue 61, item 4).

    python benchmarks/growth.py [--sizes small,medium,large] [--engines ddp,mpi,horovod,zero2,zero3,fsdp]
                                [--nprocs 2,4] [--out DIR]
    python benchmarks/growth.py --render DIR          # the markdown table of a finished run, nothing started

One ``interleaved.py --path byo --pin`` job per engine, size and world size, one after another: each rank holds the
hand-written loop of its engine (side A: raw DDP, raw mpi4py, raw Horovod, raw DeepSpeed ZeRO-2/3, raw FSDP2) and
distkit's own loop (side B) and alternates blocks of steps between them (ABBA), so the two sides share processes,
cores and the machine's state. What the table gives per job:

* the hand-written step's wall and rank-0 CPU milliseconds (the median of side A's blocks over the block's steps):
  the absolute cost the ratio is relative to;
* distkit / hand-written, wall and CPU: the median of the per-pair ratios with its 95 % bootstrap interval
  (interleaved.py's statistics), warm-up pairs left out.

The per-rank batch is the same at every size (``--batch-size``, 8 by default), so the step grows with the model
alone; the blocks shorten as the step grows (:data:`BLOCK`) so that every job takes minutes, not hours. At 4 ranks
on this 2-core machine two ranks share each core: their wall time is the cores' time-slicing, so only the CPU
ratio says anything there (the table marks it). Timing never goes into a test.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
#: engine name in the table -> interleaved.py's flags for it
ENGINES: dict[str, list[str]] = {"ddp": ["--backend", "ddp"], "mpi": ["--backend", "mpi"],
                                 "horovod": ["--backend", "horovod"],
                                 "zero2": ["--backend", "deepspeed", "--zero-stage", "2"],
                                 "zero3": ["--backend", "deepspeed", "--zero-stage", "3"],
                                 "fsdp": ["--backend", "fsdp"]}
#: steps per block by size: a block of about a second or more at 2 ranks (the per-block timer's resolution is not
#: the limit; the pairs are)
BLOCK = {"small": 10, "medium": 4, "large": 2}
#: pairs per job by size (the first 4 are warm-up, left out)
PAIRS = {"small": 40, "medium": 28, "large": 16}
SIZE_NAMES = ("small", "medium", "large")


def job_name(engine: str, size: str, nprocs: int) -> str:
    return f"{engine}_{size}_n{nprocs}"


def command(engine: str, size: str, nprocs: int, batch: int, out: str) -> list[str]:
    return [sys.executable, os.path.join(HERE, "interleaved.py"), *ENGINES[engine], "--path", "byo", "--pin",
            "--size", size, "--nprocs", str(nprocs), "--batch-size", str(batch), "--block", str(BLOCK[size]),
            "--pairs", str(PAIRS[size]), "--out", out]


def step_ms(result: dict[str, Any], side: str, metric: str) -> float:
    """Median milliseconds per step of ``side``'s blocks (warm-up pairs left out), ``metric`` "wall" or "cpu"."""
    cfg = result["config"]
    blocks = [b for b in result["blocks"] if b["side"] == side and b["pair"] >= cfg["warmup_pairs"]]
    return 1000 * statistics.median(b[f"{metric}_s"] for b in blocks) / cfg["block"]


def params_of(size: str, seq_len: int = 64) -> int:
    """charlm's parameters at ``size`` (the model the jobs built: the pydoc corpus's vocabulary)."""
    from distkit.tasks.charlm import SIZES, CharTransformer, datasets

    width, layers, heads = SIZES[size]
    vocab = datasets(seq_len)[2]
    return sum(p.numel() for p in CharTransformer(vocab, seq_len, width, layers, heads).parameters())


def render(out: str) -> str:
    """The markdown table of every job result in ``out``."""
    rows = ["| size | ranks | engine | hand-written step, wall ms | its CPU ms (rank 0) | distkit / hand-written, "
            "wall (95 % interval) | CPU (95 % interval) | pairs | foreign load |",
            "|---|---|---|---|---|---|---|---|---|"]
    jobs = [m.groups() for f in sorted(os.listdir(out))
            if (m := re.fullmatch(r"([a-z0-9]+)_([a-z]+)_n(\d+)\.json", f)) and m[1] in ENGINES and m[2] in SIZE_NAMES]
    jobs.sort(key=lambda j: (SIZE_NAMES.index(j[1]), int(j[2]), list(ENGINES).index(j[0])))
    for engine, size, ranks in jobs:
        name, n = job_name(engine, size, int(ranks)), int(ranks)
        with open(os.path.join(out, name + ".json")) as f:
            r = json.load(f)
        # (4 ranks on mpi: Open MPI's blocking Allreduce (the hand-written loop's) and libnbc's Iallreduce
        # (distkit's buckets) add 4 ranks' fp32 values in different orders; at 2 ranks the order cannot differ)
        differ = "" if r["same_work"] else " (parameters differ)"
        pr = r["pair_ratio"]
        cell = {m: f"{pr[m]['median']:.4f} ({pr[m]['ci95'][0]:.4f}-{pr[m]['ci95'][1]:.4f})" for m in ("wall", "cpu")}
        wall = cell["wall"] if n <= (os.cpu_count() or 1) else f"({cell['wall']}: time-sliced)"
        rows.append(f"| {size} | {n} | {engine}{differ} | {step_ms(r, 'A', 'wall'):.1f} | {step_ms(r, 'A', 'cpu'):.1f} | "
                    f"{wall} | {cell['cpu']} | {pr['wall']['n']} | {r['foreign_load_cpus']:.2f} |")
    sizes = sorted({j[1] for j in jobs}, key=SIZE_NAMES.index)
    return "\n".join(rows) + "\n\n" + "Parameters: " + ", ".join(f"{s} {params_of(s):,}" for s in sizes) + ".\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="small,medium,large")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--nprocs", default="2", help="world sizes, comma-separated (4: CPU ratios only here)")
    ap.add_argument("--batch-size", type=int, default=8, help="per rank, the same at every size")
    ap.add_argument("--out", default="", help="directory for the JSON results (default: a fresh temp directory)")
    ap.add_argument("--render", default="", metavar="DIR", help="print the table of DIR's results; start nothing")
    args = ap.parse_args(argv)
    if args.render:
        print(render(args.render), end="")
        return 0
    bad = [e for e in args.engines.split(",") if e not in ENGINES] + \
        [s for s in args.sizes.split(",") if s not in BLOCK]
    if bad:
        print(f"growth: unknown engine or size {bad[0]!r}; engines {', '.join(ENGINES)}, sizes {', '.join(BLOCK)}",
              file=sys.stderr)
        return 2
    import tempfile

    out = args.out or tempfile.mkdtemp(prefix="growth-")
    os.makedirs(out, exist_ok=True)
    failed = []
    for n in (int(v) for v in args.nprocs.split(",")):
        for size in args.sizes.split(","):
            for engine in args.engines.split(","):
                dest = os.path.join(out, job_name(engine, size, n) + ".json")
                cmd = command(engine, size, n, args.batch_size, dest)
                t0 = time.monotonic()
                print(f"growth: {job_name(engine, size, n)}: {' '.join(cmd[1:])}", flush=True)
                rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
                print(f"growth: {job_name(engine, size, n)}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
                if rc != 0:
                    failed.append(job_name(engine, size, n))
    print(render(out), end="")
    print(f"growth: {'FAILED: ' + ', '.join(failed) if failed else 'every job ran'}; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
