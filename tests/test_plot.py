"""``distkit plot`` (issue 27 item 3): the curves it draws are the numbers in each run's metrics.jsonl, each run
labelled with its engine and mode; the PNG is written where asked; bad input is one line, exit 2, nothing written.
Issue 60 item 6: param mode's bytes per sync over each log window, and the groups each fault-tolerant sync averaged
(the syncs that went ahead without a group marked), from records written by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SHORT, distkit, ok
from distkit.commands.plot import figure, load_run, sync_groups, windowed_bytes_per_sync, windowed_rates


@pytest.fixture(scope="module")
def param_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plot") / "param"
    ok(distkit("train", "configs/returnn_ddp.py", "--nprocs", "2", "++output_dir", str(out), *SHORT, "++eval_every", "10",
               "++distributed", "{'reduce_type': 'param', 'param_sync_step': 5}"))
    return out


def _records(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_figure_draws_each_runs_logged_numbers_with_its_engine_and_mode(ddp_short_ref: Path, param_run: Path) -> None:
    fig = figure([load_run(str(ddp_short_ref)), load_run(str(param_run))])
    loss, lr, speed, comm, sync_bytes, groups = fig.axes
    train = [r for r in _records(param_run) if "loss" in r]
    evals = [r for r in _records(param_run) if "eval_loss" in r]
    assert [r["step"] for r in train] == [5, 10, 15, 20] and [r["step"] for r in evals] == [10, 20]
    lines = {line.get_label(): line for line in loss.get_lines()}
    assert set(lines) == {"ddp (ddp grad, 2 ranks)", "param (ddp param, 2 ranks)", "param (ddp param, 2 ranks) eval"}
    mine = lines["param (ddp param, 2 ranks)"]
    assert list(mine.get_xdata()) == [5, 10, 15, 20] and list(mine.get_ydata()) == [r["loss"] for r in train]
    dashed = lines["param (ddp param, 2 ranks) eval"]
    assert dashed.get_linestyle() == "--" and list(dashed.get_ydata()) == [r["eval_loss"] for r in evals]
    for ax, key in ((lr, "lr"), (comm, "comm_wait_s")):
        assert list(ax.get_lines()[1].get_ydata()) == [r[key] for r in train], key
    # samples/s over each log window (issue 36 item 17: the cumulative figure carried start-up to the end)
    window = [train[0]["samples"] / train[0]["time_s"]] + [
        (b["samples"] - a["samples"]) / (b["time_s"] - a["time_s"]) for a, b in zip(train, train[1:])]
    assert list(speed.get_lines()[1].get_ydata()) == window and list(speed.get_lines()[1].get_xdata()) == [5, 10, 15, 20]
    assert [s for _, s in windowed_rates([{"step": 5, "samples": 80, "time_s": 2.0}, {"step": 10, "samples": 160,
             "time_s": 3.0}, {"step": 15, "samples": 240, "time_s": 0.5}, {"step": 20, "samples": 320, "time_s": 1.5}])] \
        == [40.0, 80.0, 80.0]  # a resumed process's clock starts again at 0: no window across it
    assert all(r["comm_wait_s"] >= 0 and r["time_s"] > 0 for r in train)
    # the records' bytes per sync where the run logged them; no fault-tolerant groups: that panel is empty
    drawn = [list(zip(line.get_xdata(), line.get_ydata())) for line in sync_bytes.get_lines()]
    assert drawn == ([windowed_bytes_per_sync(train)] if windowed_bytes_per_sync(train) else [])
    assert groups.get_lines() == [] and [t.get_text() for t in groups.texts] == ["no fault-tolerant groups"]
    timed = figure([load_run(str(param_run))], x="time")
    assert list(timed.axes[0].get_lines()[0].get_xdata()) == [r["time_s"] for r in train]


def test_distkit_train_writes_the_bytes_per_sync_its_averager_counts(param_run: Path) -> None:
    """``distkit train``'s records carry rank 0's ``sync_bytes`` and ``syncs`` since the run started and each log
    window's ``bytes_per_sync``; uncompressed (the fp32 all-reduce of the parameters; the MLP has no floating buffers)
    4 bytes per parameter: ``4 n`` a sync, one sync per window of 5 steps (``param_sync_step`` 5)."""
    from conftest import final_params

    n = sum(t.numel() for t in final_params(param_run).values() if t.is_floating_point())
    assert n == 17_226
    train = [r for r in _records(param_run) if "loss" in r]
    assert [(r["syncs"], r["sync_bytes"], r["bytes_per_sync"]) for r in train] == [
        (k, k * 4 * n, 4 * n) for k in (1, 2, 3, 4)]
    assert windowed_bytes_per_sync(train) == [(5, 4 * n), (10, 4 * n), (15, 4 * n), (20, 4 * n)]


def test_the_records_bytes_per_sync_outlive_a_resume() -> None:
    """Records with ``bytes_per_sync`` (``distkit train``'s, from counters a resume continues): each window's value as
    written, also across a resume (the clock starts again, the counters do not), none where a window had no sync."""
    records = [{"step": 4, "time_s": 1.0, "sync_bytes": 2000, "syncs": 2, "bytes_per_sync": 1000.0},
               {"step": 8, "time_s": 2.0, "sync_bytes": 5000, "syncs": 4, "bytes_per_sync": 1500.0},
               {"step": 10, "time_s": 2.5, "sync_bytes": 5000, "syncs": 4, "bytes_per_sync": None},
               {"step": 12, "time_s": 0.5, "sync_bytes": 5900, "syncs": 5, "bytes_per_sync": 900.0}]  # resumed at 8
    assert windowed_bytes_per_sync(records) == [(4, 1000.0), (8, 1500.0), (12, 900.0)]


def test_the_command_writes_the_png(ddp_short_ref: Path, param_run: Path, tmp_path: Path) -> None:
    res = ok(distkit("plot", str(param_run), str(ddp_short_ref), "--x", "time"))
    assert res.stdout.strip() == f"distkit: wrote {param_run / 'plot.png'} (2 run(s), x = time)"
    png = (param_run / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    ok(distkit("plot", str(ddp_short_ref), "-o", str(tmp_path / "sub" / "cmp.png")))
    assert (tmp_path / "sub" / "cmp.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,needle", [
    (["{missing}"], "is not a run's output directory (no metrics.jsonl)"),
    (["{run}", "-o", "{tmp}/out.pdf"], "the plot is a PNG"),
])
def test_bad_input_is_one_line_and_writes_nothing(param_run: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    filled = [a.format(missing=tmp_path / "nope", run=param_run, tmp=tmp_path) for a in args]
    res = distkit("plot", *filled)
    assert res.returncode == 2 and res.stderr.strip().startswith("distkit: error: ") and needle in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_bytes_per_sync_and_the_syncs_without_a_group(tmp_path: Path) -> None:
    """A param-mode run of fault-tolerant groups (3 replicas), resumed once, its records written by hand: the bytes
    panel is each log window's bytes over its syncs (the resumed process's counters start at 0); the groups panel
    steps through each recorded sync's groups, marks the one that went ahead with 2 of 3 groups and the failed one."""
    run = tmp_path / "ft"
    run.mkdir()
    (run / "config.resolved.json").write_text(json.dumps({"world_size": 1, "fault_tolerance": {"num_replicas": 3},
                                                          "distributed": {"backend": "ddp", "reduce_type": "param"}}))
    def train(step: int, time_s: float, sync_bytes: int, syncs: int) -> dict[str, float]:
        return {"step": step, "samples": 16 * step, "loss": 2.0, "lr": 0.1, "time_s": time_s, "comm_wait_s": 0.1,
                "sync_bytes": sync_bytes, "syncs": syncs}

    def event(step: int, groups: int, committed: bool = True, healed: bool = False) -> dict[str, object]:
        return {"event": "sync", "step": step, "groups": groups, "members": list(range(groups)),
                "committed": committed, "healed": healed}

    records = [train(4, 1.0, 2000, 2), event(4, 3), event(6, 2), train(8, 2.0, 5000, 4), train(10, 2.5, 5000, 4),
               event(12, 2, committed=False),
               train(12, 0.5, 900, 1),  # a resume from step 8: the process's clock and counters start again
               event(14, 3, healed=True), train(16, 1.5, 2900, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = load_run(str(run))
    assert loaded["num_replicas"] == 3 and len(loaded["events"]) == 4 and len(loaded["train"]) == 5
    # (2000 / 2), (3000 / 2), no sync in (8, 10], 900 / 1 from the resumed process's start, 2000 / 2
    assert windowed_bytes_per_sync(loaded["train"]) == [(4, 1000.0), (8, 1500.0), (12, 900.0), (16, 1000.0)]
    assert sync_groups(loaded["events"], 3) == {"groups": [(4, 3), (6, 2), (12, 2), (14, 3)], "without": [(6, 2)],
                                                "failed": [(12, 2)]}
    assert sync_groups(loaded["events"], None)["without"] == []  # (not fault-tolerant: no count to fall short of)
    fig = figure([loaded])
    sync_bytes, groups = fig.axes[4], fig.axes[5]
    (line,) = sync_bytes.get_lines()
    assert list(zip(line.get_xdata(), line.get_ydata())) == [(4, 1000.0), (8, 1500.0), (12, 900.0), (16, 1000.0)]
    assert sync_bytes.get_yscale() == "log"
    steps, without, failed = groups.get_lines()
    assert list(steps.get_xdata()) == [4, 6, 12, 14] and list(steps.get_ydata()) == [3, 2, 2, 3]
    assert steps.get_drawstyle() == "steps-post"
    assert (list(without.get_xdata()), without.get_marker()) == ([6], "o") and "without a group" in without.get_label()
    assert (list(failed.get_xdata()), failed.get_marker()) == ([12], "x")
    timed = figure([loaded], x="time")  # the bytes at rank 0's clock; the sync events stay on steps
    assert list(timed.axes[4].get_lines()[0].get_xdata()) == [1.0, 2.0, 0.5, 1.5]
    assert timed.axes[5].get_xlabel() == "step"
