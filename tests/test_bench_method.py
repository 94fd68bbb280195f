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


def _row(engine: str, path: str, wall: tuple[float, float, float], cpu: tuple[float, float, float],
         verdict: str = "pass") -> bench_check.Row:
    cell = {m: {"median": v[1], "ci95": [v[0], v[2]], "n": 100} for m, v in (("wall", wall), ("cpu", cpu))}
    return (engine, path, verdict, "", {"pair_ratio": cell, "same_work": True})


def test_the_verdict_line_names_the_interval_nearest_to_failing_and_counts_those_above_the_target() -> None:
    """The last line of ``make bench-check`` (issue 61 item 5): pass or FAIL, the worst interval (highest lower
    end, then highest median) over every case and metric, and how many intervals end above ``--target``."""
    rows = [_row("ddp", "cli", (0.996, 1.0012, 1.0131), (1.0012, 1.0085, 1.0170)),
            _row("horovod", "byo", (1.0053, 1.0122, 1.0160), (1.0061, 1.0112, 1.0171)),
            _row("mpi", "byo", (0.9808, 0.9877, 0.9948), (0.9595, 0.9654, 0.9698))]
    assert bench_check.verdict_line(rows, 1.01) == (
        "bench-check: pass (worst: horovod byo cpu 1.0112 (1.0061-1.0171); 4 of 6 intervals end above 1.01)")
    rows.append(_row("fsdp", "cli", (1.031, 1.04, 1.05), (0.99, 1.0, 1.01), verdict="FAIL"))
    rows.append(("deepspeed", "byo", "ERROR", "interleaved.py exited 1", None))
    line = bench_check.verdict_line(rows, 1.01)
    assert line.startswith("bench-check: FAIL (fsdp cli: FAIL; deepspeed byo: ERROR (interleaved.py exited 1); "
                           "worst: fsdp cli wall 1.0400 (1.0310-1.0500); ")
    assert bench_check.verdict_line([("ddp", "cli", "ERROR", "x", None)], 1.01) == (
        "bench-check: FAIL (ddp cli: ERROR (x); nothing measured)")


def test_pairs_per_engine_quick_and_explicit() -> None:
    """``--pairs`` wins; else ``--quick``'s count; else the engine's own (fsdp's blocks are about twice as long)."""
    assert bench_check.pairs_for("ddp", None, False) == bench_check.PAIRS["ddp"]
    assert bench_check.pairs_for("fsdp", None, False) == bench_check.PAIRS["fsdp"] < bench_check.PAIRS["ddp"]
    assert bench_check.pairs_for("fsdp", None, True) == bench_check.QUICK_PAIRS
    assert bench_check.pairs_for("fsdp", 20, True) == 20
    assert set(bench_check.PAIRS) == set(bench_check.ENGINES) | set(bench_check.BRIDGES)
    # every engine has its hand-written baseline and launcher in overhead.py (interleaved.py's --backend choices)
    import overhead

    assert set(bench_check.ENGINES) <= set(overhead.BACKENDS)
    assert bench_check.QUICK_PAIRS > 4 + 4 and bench_check.QUICK_PAIRS - 4 >= bench_check.MIN_PAIRS


def test_the_default_check_fits_its_budget() -> None:
    """Issue 61, item 5: every engine's two paths and the four bridges at their default pairs fit 35 minutes by the
    per-pair costs measured on the quiet machine (the estimate's closed form: starts + pairs x seconds), and no case
    takes more than twice another's minutes (the pairs follow the cost)."""
    assert bench_check.planned_minutes([("ddp", 100), ("fsdp", 10)]) == (
        2 * bench_check.START_S + 100 * bench_check.PAIR_S["ddp"] + 10 * bench_check.PAIR_S["fsdp"]) / 60
    jobs = ([(e, bench_check.PAIRS[e]) for e in bench_check.ENGINES for _ in bench_check.PATHS]
            + [(b, bench_check.PAIRS[b]) for b in bench_check.BRIDGES])
    assert bench_check.planned_minutes(jobs) <= bench_check.BUDGET_MIN == 35.0
    each = [bench_check.planned_minutes([job]) for job in jobs[:2 * len(bench_check.ENGINES)]]
    assert max(each) < 2 * min(each), each


def test_raw_fsdp_shards_the_units_distkit_picks() -> None:
    """``raw_fsdp.py``'s hand-written unit list is distkit's fsdp engine's for charlm at every size (the same
    submodules, in the same innermost-first order), and the same rule on a model with a ModuleList."""
    import torch
    from torch import nn

    from distkit.backends.fsdp import units
    from distkit.tasks.charlm import SIZES, CharTransformer

    raw_fsdp = __import__("raw_fsdp")

    for size, (width, layers, heads) in SIZES.items():
        model = CharTransformer(20, 16, width, layers, heads)
        path = {id(m): n for n, m in model.named_modules()}
        assert raw_fsdp.unit_paths(model) == [path[id(u)] for u in units(model, None)], size
    assert raw_fsdp.unit_paths(CharTransformer(20, 16, 8, 1, 2)) == ["head", "norm", "blocks", "pos", "tok"]

    class Listed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)])
            self.out = nn.Linear(4, 2)

    torch.manual_seed(0)
    m = Listed()
    path = {id(x): n for n, x in m.named_modules()}
    assert raw_fsdp.unit_paths(m) == [path[id(u)] for u in units(m, None)] == ["out", "layers.2", "layers.0", "emb"]


def test_the_bridges_refuse_blocks_that_would_hold_different_numbers_of_syncs() -> None:
    """``interleaved_bridges.py --bridge paramsync``: every block must hold the same number of LocalSGD / ParamSync
    averages on both sides (``--block`` a multiple of ``--local-sgd-steps``), else the ratio would compare syncs,
    not the bridges; refused before any process starts."""
    import pytest

    import interleaved_bridges

    with pytest.raises(SystemExit) as e:
        interleaved_bridges.main(["--bridge", "paramsync", "--block", "10", "--local-sgd-steps", "3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        interleaved_bridges.main(["--bridge", "fabric", "--pairs", "8"])  # fewer than warm-up + 5
    assert e.value.code == 2
    assert set(interleaved_bridges.BRIDGES) == set(bench_check.BRIDGES) == {"fabric", "lightning", "paramsync",
                                                                            "trainer"}


def test_a_threaded_loop_takes_exactly_its_blocks_and_never_runs_beside_the_other_side() -> None:
    """``threaded_side.ThreadedLoop`` (side A as a framework's whole loop in a thread, for the Lightning Trainer and
    the transformers Trainer): driven by ``interleaved.Alternator``, the two loops' steps come in the schedule's
    order (ABBA blocks), one loop at a time, and A ends having taken as many steps as B; a failure in A's loop
    reaches the main thread."""
    import threading

    import pytest

    import interleaved
    from threaded_side import ThreadedLoop

    order: list[str] = []
    running = threading.Lock()  # held by whichever side is taking a step: never both

    def loop(before_step: Any, steps: int) -> int:
        for _ in range(steps):
            before_step()
            assert running.acquire(blocking=False), "both sides ran at once"
            order.append("A")
            running.release()
        return steps

    pairs, block = 4, 3
    holder: dict[str, Any] = {}
    side_a = ThreadedLoop(lambda before: loop(before, holder["steps"]))
    alt = interleaved.Alternator(pairs, block, lambda i: side_a.run_block(1), side_a.run_block)
    holder["steps"] = alt.b_total
    side_a.start()
    assert order == [] and side_a.steps == 0
    for _ in range(alt.b_total):
        alt.tick()
        assert running.acquire(blocking=False)
        order.append("B")
        running.release()
    assert side_a.join() == alt.b_total and order.count("A") == order.count("B") == alt.b_total
    schedule = "".join("AB" if p % 2 == 0 else "BA" for p in range(pairs))  # pair p: A B for even p, B A for odd
    assert "".join(order[i] for i in range(0, 2 * pairs * block, block)) == schedule
    assert order[2 * pairs * block:] == ["A", "B"] or order[2 * pairs * block:] == ["B", "A"]  # (the extra steps)
    assert "".join(b["side"] for b in alt.blocks) == schedule

    def broken(before_step: Any) -> None:
        before_step()
        raise ValueError("the framework's loop failed")

    side = ThreadedLoop(broken)
    side.start()
    with pytest.raises(RuntimeError, match="side A's loop failed after 1 steps: ValueError"):
        side.run_block(2)
