"""The test tiers (tests/tiers.py, issue 34): a test's tier follows from what it starts, and the fast tier
(``make check``) keeps a real 2-rank parity case of every engine and mode, the conformance suite's core rows,
and the config, bad-input, checkpoint-format and CLI tests."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hosts as nethosts
import slurm as testslurm
import tiers
from conftest import ROOT, base_env, lighthouse_cmd, run
from distkit.backends import REGISTRY, strategy_class

#: what the fast tier must keep a parity case of: every registered engine in every mode it supports (the
#: conformance suite's engines, by family), so a new engine's first test run names the case it lacks
COVERED = [(e, m) for e in REGISTRY for m in sorted(strategy_class(e).supported_modes)]
#: modules whose every test stays in the fast tier (config, bad input, CLI), but for engine sweeps whose other
#: cases are fast
ALWAYS_FAST = ("test_config.py", "test_bad_input.py", "test_cli.py", "test_env.py", "test_tiers.py")
#: modules that keep tests in the fast tier (checkpoint format: what is written, and what a damaged file gives)
SOME_FAST = ("test_checkpoint_integrity.py", "test_portable.py")


def _builds_hosts() -> None:
    with nethosts.Hosts(2) as h:
        h.addr(0)


def _builds_hosts_imported_inside() -> None:
    import hosts as local_hosts  # an import inside the test, as test_fault_tolerance's cut-off test has it

    with local_hosts.Hosts(2) as h:
        h.addr(0)


def _helper_with_slurm(d: str) -> Any:
    return testslurm.Slurm(d)


def _through_a_helper() -> None:
    _helper_with_slurm("x")


def _kill_trials() -> Any:
    return run([sys.executable, str(ROOT / "benchmarks" / "kill_trials.py")])


def _with_a_lighthouse() -> list[str]:
    return lighthouse_cmd(1, 1)


def _four_ranks() -> Any:
    return run(["distkit", "train", "--nprocs", "4"])


def _four_ranks_not_started() -> list[str]:
    return ["distkit", "train", "--nprocs", "4"]


def _timed() -> None:
    import time
    t0 = time.monotonic()
    res = run(["distkit", "train"])
    took, ended = time.monotonic() - t0, time.time()
    assert res.returncode and took < 30 and ended


def _deadline_only() -> None:
    import time
    deadline = time.monotonic() + 120  # a bound on a wait, not a timing
    while time.monotonic() < deadline:
        assert run(["distkit", "train"]).returncode == 0


def _plain() -> float:
    return sum([1.0, 2.0])


def test_the_tier_follows_from_what_the_code_starts() -> None:
    # the samples are looked up by name: a test that named them would itself start what they start
    sample = globals()
    assert tiers.reasons([sample["_builds_hosts"]]) == {"network-namespace hosts"}
    assert tiers.reasons([sample["_builds_hosts_imported_inside"]]) == {"network-namespace hosts"}
    assert tiers.reasons([sample["_through_a_helper"]]) == {"SLURM daemons"}  # through a helper of tests/
    assert tiers.reasons([sample["_with_a_lighthouse"]]) == {"a torchft lighthouse"}
    assert tiers.reasons([sample["_kill_trials"]]) == {"kill trials (benchmarks/kill_trials.py)"}
    assert tiers.reasons([sample["_four_ranks"]]) == {"a run of more than 2 ranks"}
    assert tiers.reasons([sample["_plain"]]) == set()
    assert tiers.reasons([sample["_timed"]]) == {tiers.TIMED}
    assert tiers.reasons([sample["_deadline_only"]]) == set()
    # make test runs alone what times what it observes or uses machine-wide names; a result check shares
    assert tiers.serial({tiers.TIMED}) and tiers.serial({"network-namespace hosts"})
    # hosts and SLURM run one at a time among themselves (their own xdist group in make test)
    assert tiers.reasons([sample["_builds_hosts"], sample["_through_a_helper"]]) == tiers.MACHINE_WIDE
    assert not tiers.serial({tiers.SIGNAL, tiers.FULL_FRAGMENTS["DISTKIT_FAULT"], tiers.MORE_RANKS})
    assert tiers.reasons([sample["_four_ranks_not_started"]]) == set()  # strings only count for code that starts


def _collected(tmp_path: Path) -> list[dict[str, Any]]:
    """Every test of the suite with its tier, as a real `pytest --collect-only` sees it (whatever this run selected):
    this run's own collection where it was the whole suite (make test, make check: each xdist worker collects
    every test before -m deselects), else a `pytest --collect-only` of tests/ (30 to 70 s of CPU)."""
    from conftest import TIER_REPORT

    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    if files and {i["nodeid"].split("::")[0].rsplit("/", 1)[-1] for i in TIER_REPORT} == files:
        return list(TIER_REPORT)
    report = tmp_path / "tiers.json"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          "--tier-report", str(report), str(ROOT / "tests")], cwd=ROOT, env=base_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(report.read_text())


def test_the_fast_tier_keeps_every_engine_and_mode_and_the_input_tests(tmp_path: Path) -> None:
    items = _collected(tmp_path)
    fast = [i for i in items if i["tier"] == "fast"]
    covered = {tuple(p) for i in fast for p in i["parity"]}
    lost = [f"{e} {m}" for e, m in COVERED if (e, m) not in covered]
    assert not lost, f"no fast-tier parity case (pytest.mark.parity) left for: {', '.join(lost)}"
    def module(i: dict[str, Any]) -> str:
        return i["nodeid"].split("::")[0].rsplit("/", 1)[-1]

    def function(i: dict[str, Any]) -> str:
        return i["nodeid"].split("[")[0]

    fast_functions = {function(i) for i in fast}
    moved = [f"{i['nodeid']} ({'; '.join(i['reasons'])})" for i in items
             if i["tier"] == "full" and module(i) in ALWAYS_FAST
             and not (i["reasons"] == [tiers.SWEEP] and function(i) in fast_functions)]
    assert not moved, "config, bad-input and CLI tests belong to the fast tier: " + ", ".join(moved)
    assert {module(i) for i in fast} >= set(SOME_FAST), "checkpoint-format tests left the fast tier"
    core = [i for i in fast if "test_conformance.py::test_idiom" in i["nodeid"]]
    assert core, "the conformance suite has no row in the fast tier"
    full = [i for i in items if i["tier"] == "full"]
    assert full and all(i["reasons"] for i in full)  # every full-tier test says why
