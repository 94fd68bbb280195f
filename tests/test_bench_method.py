"""The overhead measurement's own logic (issue 37), without timing anything: ``benchmarks/interleaved.py``'s block
schedule and statistics, and ``benchmarks/bench_check.py``'s verdicts. (The timings themselves never go into a test.)"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))  # (after every other entry: no shadowing)

import bench_check  # noqa: E402
import interleaved  # noqa: E402


def test_the_schedule_alternates_abba_and_both_sides_take_the_same_steps() -> None:
    """B's steps drive the schedule: every B block has exactly ``block`` steps, A's blocks run between them in ABBA
    order, each side's steps are its own 0, 1, 2, ... in order, and B's extra step (whose start closes its last
    block) is matched by one more of A's: both end having taken the same steps."""
    pairs, block = 5, 3
    log: list[tuple[str, int]] = []
    alt = interleaved.Alternator(pairs, block, lambda i: log.append(("A", i)))
    assert alt.b_total == pairs * block + 1
    for i in range(alt.b_total):
        alt.tick()
        log.append(("B", i))
    assert alt.done and alt.a_step == alt.b_total
    assert [s for s, _ in log] == (["A"] * 3 + ["B"] * 6 + ["A"] * 6 + ["B"] * 6 + ["A"] * 6 + ["B"] * 3
                                   + ["A", "B"])  # A B | B A | A B | B A | A B, then the extra step of each
    for side in "AB":
        assert [i for s, i in log if s == side] == list(range(alt.b_total))
    assert [(b["side"], b["pair"]) for b in alt.blocks] == [
        (s, p) for p in range(pairs) for s in (("A", "B") if p % 2 == 0 else ("B", "A"))]


def test_pair_ratios_leave_out_the_warm_up_and_divide_b_by_a() -> None:
    blocks = [{"side": s, "pair": p, "wall_s": w, "cpu_s": c} for s, p, w, c in [
        ("A", 0, 1.0, 1.0), ("B", 0, 9.0, 9.0),   # warm-up: left out
        ("A", 1, 2.0, 1.0), ("B", 1, 3.0, 1.5),
        ("B", 2, 4.0, 2.0), ("A", 2, 4.0, 4.0)]]
    r = interleaved.pair_ratios(blocks, warmup_pairs=1)
    assert r == {"wall": [1.5, 1.0], "cpu": [1.5, 0.5]}
    s = interleaved.summarize(r)
    assert s["wall"]["median"] == 1.25 and s["wall"]["n"] == 2
    assert s["wall"]["ci95"][0] <= 1.25 <= s["wall"]["ci95"][1]


def _result(lo: float, hi: float, n: int = 100, same: bool = True) -> dict[str, Any]:
    ratio = {"median": (lo + hi) / 2, "ci95": [lo, hi], "n": n}
    return {"pair_ratio": {"wall": ratio, "cpu": dict(ratio)}, "same_work": same}


def test_bench_check_fails_only_an_interval_above_the_bound_and_says_when_it_could_not_tell() -> None:
    assert bench_check.check(_result(0.99, 1.01), 1.03) == ("pass", [])
    assert bench_check.check(_result(1.01, 1.05), 1.03) == ("pass, undecided", ["wall", "cpu"])
    assert bench_check.check(_result(1.031, 1.05), 1.03) == ("FAIL", ["wall", "cpu"])
    verdict, why = bench_check.check(_result(0.99, 1.01, n=bench_check.MIN_PAIRS - 1), 1.03)
    assert verdict == "FAIL" and "more --pairs" in why[0]
    assert bench_check.check(_result(0.99, 1.01, same=False), 1.03) == (
        "FAIL", ["the two sides ended with different parameters"])
