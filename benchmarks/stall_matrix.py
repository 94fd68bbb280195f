"""Stalled, killed and failing ranks on every engine under each launcher it supports (issue 10, item 6).

    python benchmarks/stall_matrix.py [--timeout-s 4] [--faults stop,stop0,kill,raise,hang] [--cases ddp-nprocs,...]

For each case (engine x launcher) and fault, one real 2-rank run of the digits task with
``distributed.timeout_s = T``; after step 5 one rank (``DISTKIT_FAULT``, :mod:`distkit.health.faults`):

* ``stop``: rank 1 SIGSTOPs itself (frozen, as a stalled or cut-off process);
* ``stop0``: rank 0 does (the host of the heartbeat store, :mod:`distkit.health.watchdog`);
* ``kill``: rank 1 SIGKILLs itself;
* ``raise``: rank 1 raises RuntimeError;
* ``hang``: rank 1's main thread sleeps forever (alive: its heartbeat goes on, so the engine's own
  collective timeout must end the job; ``log_every`` 1000, so that rank 0 waits in the engine's
  gradient reduce, e.g. ZeRO-2's on DeepSpeed's clone of the world group).

Reported per run: the exit status, the seconds from the fault (the faulting rank writes the time to
``DISTKIT_FAULT_STAMP`` just before) to the launcher's exit, whether the output names the faulting
rank, and the processes of the run still alive 2 s after the launcher exited. The contract: exit
non-zero, named (a hang: "timed out"), nothing left, and for the stalls within ``T + 5`` s (the
others: the 30 s of ``tests/test_failures.py``). ``tests/test_stall.py`` runs the representative cases in the
test suite; this is the full sweep (5-20 s per run on a 2-core machine, 40 runs).

Writes ``benchmarks/results/stall_matrix.json`` and prints one line per run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from distkit.launch.spawner import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RESULTS = ROOT / "benchmarks" / "results"

CONFIG = """\
task = "digits"
num_epochs = 100
max_steps = 2000
batch_size = 16
log_every = 1
progress_bar = False
output_dir = {out!r}
"""
ZERO2 = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 2}}
ENGINE_FLAGS = {
    "ddp": ["++torch_distributed", "{}"],
    "mpi": ["++distributed", "{'backend': 'mpi'}"],
    "horovod": ["++use_horovod", "1", "++horovod_require", "True"],
    "deepspeed": ["--deepspeed", "--deepspeed_config", "DS_JSON"],
}
#: engine-launcher pairs: every launcher each engine supports
CASES = ["ddp-nprocs", "ddp-torchrun", "deepspeed-nprocs", "deepspeed-torchrun", "deepspeed-deepspeed",
         "mpi-mpirun", "horovod-mpirun", "horovod-horovodrun"]
FAULTS = {"stop": (1, "stop"), "stop0": (0, "stop"), "kill": (1, "kill"), "raise": (1, "raise"), "hang": (1, "hang")}
STEP = 5


def command(engine: str, launcher: str, cfg: Path, ds: Path, timeout_s: float, *extra: str) -> list[str]:
    """The launching command for one case (2 ranks)."""
    flags = [str(ds) if f == "DS_JSON" else f for f in ENGINE_FLAGS[engine]]
    train = ["train", str(cfg), *flags, "++distributed.timeout_s", str(timeout_s), *extra]
    py = [sys.executable, "-m", "distkit"]
    if launcher == "nprocs":
        return [*py, *train, "--nprocs", "2"]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "-m", "distkit", *train]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_accelerators", "2", "--master_port", str(free_port()),
                "--module", "distkit", *train]
    if launcher == "mpirun":
        return [str(BIN / "mpirun"), "--oversubscribe", "--bind-to", "none", "-np", "2", "-x", "DISTKIT_FAULT",
                "-x", "DISTKIT_FAULT_STAMP", "-x", "DISTKIT_MARK", *py, *train]
    if launcher == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", "2", "--gloo", *py, *train]
    raise ValueError(launcher)


def _marked(mark: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark.encode() in f.read():
                        pids.append(int(d))
            except OSError:
                continue
    return pids


def named(text: str, fault: str, rank: int) -> bool:
    """Whether the output names the faulting rank (distkit's line, or the launcher's own report)."""
    if fault == "stop":
        return f"rank {rank} stopped responding" in text
    if fault == "raise":
        return f"distkit: rank {rank} failed: RuntimeError: injected fault" in text
    if fault == "hang":  # the engine's own words: gloo, the mpi engine's watchdog, Horovod's stall shutdown
        return (any(w in text.lower() for w in ("timed out", "did not complete within", "horovod has been shut down"))
                and "stopped responding" not in text)
    return bool(re.search(rf"rank {rank} failed \(killed by SIGKILL\)|process rank {rank} with PID|"
                          rf"rank\s*:\s*{rank} \(local_rank|Process name: {rank}|exits with return code = -9", text))


def run_one(engine: str, launcher: str, fault_name: str, timeout_s: float, limit_s: float) -> dict[str, Any]:
    rank, fault = FAULTS[fault_name]
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        tmpd = Path(tmp)
        cfg, ds, stamp = tmpd / "cfg.py", tmpd / "ds.json", tmpd / "stamp"
        cfg.write_text(CONFIG.format(out=str(tmpd / "out")))
        ds.write_text(json.dumps(ZERO2))
        mark = f"stall-{uuid.uuid4().hex[:8]}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") and not k.startswith(("OMPI_", "PMIX_"))}
        env.update(DISTKIT_FAULT=f"{rank}:{STEP}:{fault}", DISTKIT_FAULT_STAMP=str(stamp), DISTKIT_MARK=mark,
                   OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        t0 = time.monotonic()
        extra = ["++log_every", "1000"] if fault == "hang" else []
        p = subprocess.Popen(command(engine, launcher, cfg, ds, timeout_s, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=limit_s)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            hung = True
        ended, total = time.time(), time.monotonic() - t0
        time.sleep(2)
        left = _marked(mark)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        after = ended - float(stamp.read_text().split()[1]) if stamp.exists() else None
    bound = timeout_s + 5 if fault == "stop" else 30.0
    row = {"engine": engine, "launcher": launcher, "fault": fault_name, "rank": rank, "exit": p.returncode, "hung": hung,
           "fired": after is not None, "s_after_fault": None if after is None else round(after, 2),
           "s_total": round(total, 1), "named": named(out, fault, rank), "left_behind": len(left), "bound_s": bound}
    row["ok"] = bool(not hung and p.returncode != 0 and after is not None and after < bound and row["named"] and not left)
    if not row["ok"]:
        row["output_tail"] = out[-3000:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout-s", type=float, default=4.0, help="distributed.timeout_s of every run (T)")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    ap.add_argument("--limit-s", type=float, default=90.0, help="a run still going after this long counts as hung")
    ap.add_argument("--out", default=str(RESULTS / "stall_matrix.json"))
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        engine, launcher = case.split("-")
        for fault in args.faults.split(","):
            row = run_one(engine, launcher, fault, args.timeout_s, args.limit_s)
            rows.append(row)
            print(f"{case:20s} {fault:6s} exit {row['exit']!s:>4} after fault {row['s_after_fault']!s:>6} s "
                  f"(total {row['s_total']:5.1f} s) named {row['named']!s:5} left {row['left_behind']} "
                  f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"timeout_s": args.timeout_s, "cpu_count": os.cpu_count(), "rows": rows,
              "ok": sum(r["ok"] for r in rows), "runs": len(rows)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['ok']}/{result['runs']} runs met the contract; wrote {args.out}")


if __name__ == "__main__":
    main()
