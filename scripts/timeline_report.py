"""Summarise a run recorded by scripts/pytest_timeline.py: per worker and per test file, wall and CPU seconds; the
machine's busy share per minute (CPU of the tests that ran in it, spread over each test's span); the costliest tests.

    python scripts/timeline_report.py /tmp/timeline [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    recs = [json.loads(line) for f in glob.glob(os.path.join(args.dir, "*.jsonl")) for line in open(f)]
    if not recs:
        raise SystemExit(f"no records in {args.dir}")
    start, end = min(r["t0"] for r in recs), max(r["t1"] for r in recs)
    cpu = {id(r): r["cpu_children"] + r["cpu_self"] for r in recs}
    print(f"{len(recs)} tests over {end - start:.0f} s, {sum(cpu.values()):.0f} s of CPU")
    workers: dict[str, list[dict]] = collections.defaultdict(list)
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in recs:
        workers[r["w"]].append(r)
        f = files[r["id"].split("::")[0]]
        f[0] += 1
        f[1] += r["t1"] - r["t0"]
        f[2] += cpu[id(r)]
    for w, rs in sorted(workers.items()):
        print(f"{w}: {len(rs)} tests, busy {sum(r['t1'] - r['t0'] for r in rs):.0f} s, "
              f"last end {max(r['t1'] for r in rs) - start:.0f} s, CPU {sum(cpu[id(r)] for r in rs):.0f} s")
    minute = [0.0] * (int((end - start) // 60) + 1)
    for r in recs:
        a, b = r["t0"] - start, r["t1"] - start
        for i in range(int(a // 60), int(b // 60) + 1):
            lo, hi = max(a, i * 60), min(b, (i + 1) * 60)
            if hi > lo:
                minute[i] += cpu[id(r)] * (hi - lo) / max(b - a, 1e-6)
    print("CPU % per minute:", " ".join(f"{c / 60 * 100:.0f}" for c in minute))
    print(f"\n{'file':42s} {'tests':>5s} {'wall s':>7s} {'CPU s':>7s}")
    for name, (n, wall, c) in sorted(files.items(), key=lambda kv: -kv[1][2]):
        print(f"{name:42s} {n:5d} {wall:7.0f} {c:7.0f}")
    print(f"\ncostliest {args.top} tests (CPU s, wall s):")
    for r in sorted(recs, key=lambda r: -cpu[id(r)])[:args.top]:
        print(f"{cpu[id(r)]:6.1f} {r['t1'] - r['t0']:6.1f} {r['id']}")


if __name__ == "__main__":
    main()
