"""Kill at any instant (issue 10, item 7): a handful of ``benchmarks/kill_trials.py``'s trials.

The full sweep (50 trials per engine) lives in the benchmark; here two trials on ddp (seed 8: the first
kills the whole process group, the second one rank), both timed after the first checkpoint of a run
that checkpoints every step. Each killed run is resumed with ``++resume auto`` and must end with
the uninterrupted run's ``param_checksum`` (bit-identical) without starting over."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from conftest import ROOT, run


def test_killed_runs_resume_to_the_uninterrupted_checksum(tmp_path: Path) -> None:
    res = run([sys.executable, str(ROOT / "benchmarks" / "kill_trials.py"), "--engines", "ddp", "--trials", "2",
               "--steps", "12", "--seed", "8", "--no-save", "--work", str(tmp_path)], timeout=400)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    trials = re.findall(r"trial \d/2: kill (\S+) at [\d.]+ s \(latest: (\S+)\) -> (\S+)", res.stdout)
    assert len(trials) == 2 and all(outcome == "recovered" for _, _, outcome in trials), res.stdout
    assert "ddp: 2/2 killed runs resumed to the uninterrupted run's checksum" in res.stdout
