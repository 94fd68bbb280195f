"""How long training stops for a checkpoint, synchronous vs ``checkpoint_async = true``.

    python benchmarks/checkpoint_stall.py [--engine ddp] [--size large] [--steps 60] [--every 10] [--repeats 2]

Runs the real ``distkit train configs/charlm.json --nprocs 2`` (charlm ``--size``, Adam, a
checkpoint every ``--every`` steps) twice per repeat, interleaved: with synchronous checkpoints and
with ``checkpoint_async = true``. The stall is what ``summary.json`` reports per checkpoint in
``checkpoint_stalls_s``: the time rank 0 was blocked in checkpoint calls (sync: the whole save; async:
copying the state aside and planning, plus waiting for its files at the next checkpoint if they are
not written yet). The final checkpoint (always synchronous, after training) is not counted. Both modes must end with the same ``param_checksum`` (checked).

Writes ``benchmarks/results/checkpoint_stall.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"backend": "ddp"},
    "mpi": {"backend": "mpi"},
    "horovod": {"backend": "horovod", "require_horovod": True},
    "deepspeed": {"backend": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}}},
}


def run(engine: str, size: str, steps: int, every: int, asynchronous: bool, out: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "distkit", "train", os.path.join(ROOT, "configs", "charlm.json"), "--nprocs", "2",
           "++charlm_size", size, "++max_steps", str(steps), "++checkpoint_every", str(every), "++log_every", str(every),
           "++eval_every", "None", "++progress_bar", "False", "++optimizer", "{'class': 'adam'}",
           "++distributed", json.dumps(ENGINES[engine]), "++checkpoint_async", str(asynchronous),
           "++keep_checkpoints", "2", "++output_dir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"checkpoint_stall: {' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)  # type: ignore[no-any-return]


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--engine", default="ddp", choices=sorted(ENGINES))
    p.add_argument("--size", default="large", choices=["small", "medium", "large"])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="ckpt-stall-") as work:
        for i in range(a.repeats):
            for mode in ("sync", "async"):
                s = run(a.engine, a.size, a.steps, a.every, mode == "async", os.path.join(work, f"{mode}-{i}"))
                periodic = s["checkpoint_stalls_s"][:-1]  # the last one is the final, synchronous save
                rows[mode].append({"stall_s": sum(periodic), "checkpoints": len(periodic),
                                   "wall_time_s": s["wall_time_s"], "param_checksum": s["param_checksum"]})
                print(f"  {mode} #{i + 1}: {sum(periodic) / max(len(periodic), 1) * 1e3:.1f} ms per checkpoint "
                      f"({len(periodic)} checkpoints), loop {s['wall_time_s']:.1f} s", flush=True)
    checksums = {r["param_checksum"] for m in rows.values() for r in m}
    if len(checksums) != 1:
        raise SystemExit(f"checkpoint_stall: sync and async runs ended with different parameters: {checksums}")
    per = {m: statistics.median(r["stall_s"] / max(r["checkpoints"], 1) for r in rs) for m, rs in rows.items()}
    wall = {m: statistics.median(r["wall_time_s"] for r in rs) for m, rs in rows.items()}
    report = {"engine": a.engine, "size": a.size, "steps": a.steps, "every": a.every, "repeats": a.repeats,
              "stall_per_checkpoint_s": per, "loop_wall_s": wall, "ratio_sync_over_async": per["sync"] / max(per["async"], 1e-9),
              "runs": rows}
    print(f"\n| {a.engine}, charlm {a.size}, 2 ranks | stall per checkpoint (median) | training loop wall (median) |")
    print("|---|---|---|")
    for m in ("sync", "async"):
        print(f"| {m} | {per[m] * 1e3:.1f} ms | {wall[m]:.1f} s |")
    print(f"\nsync / async stall: {report['ratio_sync_over_async']:.1f}x (bit-identical parameters)")
    if not a.no_save:
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        with open(os.path.join(HERE, "results", "checkpoint_stall.json"), "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
