"""What a group that dies inside a new quorum costs the others (fault_tolerance, torchft).

    python benchmarks/ft_dead_in_quorum.py [--timeout-s 300] [--connect-timeout-s 30] [--out FILE.json]

The worst moment for a fault-tolerant group to die: after it asked the lighthouse for a quorum that is new.
The lighthouse still counts it (its heartbeat is fresh), the others receive a quorum with it and rebuild
torchft's gloo group, waiting for it to connect. The choreography is the one of
``tests/test_fault_tolerance.py::test_a_group_dead_inside_a_new_quorum_costs_the_others_connect_timeout_not_timeout_s``:
3 groups of 1 rank (ddp, param mode, sync every 5 of 40 steps); groups 0 and 2 sync, group 0 pauses after
step 10, group 2 asks for step 15's quorum, group 1 (started late) asks for its first; then group 2 is
SIGKILLed and group 0 released. Prints, and writes as JSON, the seconds from the kill until groups 0 and 1
have finished, and their membership records. Before ``connect_timeout_s`` existed the wait was
``distributed.timeout_s``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from distkit.launch.spawner import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wait_for(what: str, ok: Any, procs: list["subprocess.Popen[bytes]"], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what}: not within {timeout:g} s, or a group ended")
        time.sleep(0.01)


def _synced(metrics: str) -> bool:
    """Whether the group writing ``metrics`` (its metrics.jsonl) has logged a sync (its first one is logged)."""
    try:
        return any(json.loads(line).get("event") == "sync" for line in open(metrics).read().splitlines())
    except (OSError, ValueError):
        return False  # not written yet, or a line being written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout-s", type=float, default=300.0, help="distributed.timeout_s (default 300, distkit's)")
    ap.add_argument("--connect-timeout-s", type=float, default=30.0, help="fault_tolerance.connect_timeout_s")
    ap.add_argument("--out", default=None, help="JSON file (default: a fresh temp directory)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ft_dead_in_quorum_")
    out, release, log = os.path.join(work, "ft"), os.path.join(work, "release"), os.path.join(work, "lighthouse.log")
    port = free_port()
    with open(log, "w") as sink:  # a file: the lighthouse blocks on a full pipe (docs/fault_tolerance.md)
        lh = subprocess.Popen([sys.executable, "-m", "distkit", "lighthouse", "--port", str(port), "--min-replicas", "2",
                               "--join-timeout", "30"], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                              start_new_session=True)
    procs: list["subprocess.Popen[bytes]"] = []

    def group(i: int, **env: str) -> "subprocess.Popen[bytes]":
        ft = (f"{{'lighthouse': 'http://127.0.0.1:{port}', 'replica_id': {i}, 'num_replicas': 3, "
              f"'connect_timeout_s': {args.connect_timeout_s}}}")
        dist = f"{{'backend': 'ddp', 'reduce_type': 'param', 'param_sync_step': 5, 'timeout_s': {args.timeout_s}}}"
        p = subprocess.Popen([sys.executable, "-m", "distkit", "train", os.path.join(ROOT, "configs", "returnn_ddp.py"),
                              "++progress_bar", "False", "++max_steps", "40", "++output_dir", out, "++distributed", dist,
                              "++fault_tolerance", ft], cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                             stderr=open(os.path.join(work, f"group-{i}.err"), "w"), start_new_session=True)
        procs.append(p)
        return p

    try:
        _wait_for("the lighthouse", lambda: "Lighthouse listening" in open(log).read(), [lh], 30)
        g0 = group(0, DISTKIT_FAULT="0:10:delay=300", DISTKIT_FAULT_UNTIL=release)
        victim = group(2)
        _wait_for("group 2's first sync", lambda: _synced(os.path.join(out, "group-2", "metrics.jsonl")), procs)
        g1 = group(1)
        _wait_for("group 1's quorum request",
                  lambda: "Received quorum request for replica distkit_group_1" in open(log).read(), procs)
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        open(release, "w").close()
        codes = [p.wait(timeout=args.timeout_s + 120) for p in (g0, g1)]
        seconds = time.monotonic() - killed
    finally:
        for p in [*procs, lh]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    result = {"timeout_s": args.timeout_s, "connect_timeout_s": args.connect_timeout_s, "exit_codes": codes,
              "seconds_from_kill_to_end": round(seconds, 1),
              "membership": [json.load(open(os.path.join(out, f"group-{i}", "summary.json")))["fault_tolerance"]["membership"]
                             for i in range(2)]}
    path = args.out or os.path.join(work, "ft_dead_in_quorum.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"groups 0 and 1 ended {seconds:.1f} s after group 2 died inside their new quorum "
          f"(timeout_s {args.timeout_s:g}, connect_timeout_s {args.connect_timeout_s:g}; exit codes {codes}): {path}")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
