"""``distkit plot RUN [RUN ...] [-o out.png] [--x step|time]``: the curves of one or more runs, overlaid.

Six panels from each run's ``metrics.jsonl``: loss (train solid, eval dashed with markers), learning rate,
samples/s over each log window (:func:`windowed_rates`), the seconds blocked on the training collectives
(cumulative, rank 0), param mode's bytes per sync over each log window (rank 0's, from the records' ``sync_bytes``
and ``syncs``: :func:`windowed_bytes_per_sync`), and for fault-tolerant groups the groups each sync averaged
(:func:`sync_groups`: the ``"event": "sync"`` records; a sync that went ahead without a group, with fewer groups than
``num_replicas``, is a filled marker, a failed one a cross), against the step, or against rank 0's wall time since
training started (``--x time``; the sync events have steps only: their panel stays on steps). Each run's legend
entry is its directory name with its engine and mode (from ``config.resolved.json``: ``ddp grad``, ``deepspeed
ZeRO-2 param``), so two engines or two modes of one script compare at a glance. A run of fault-tolerant groups is
plotted by giving each group's directory.

The PNG goes to ``-o`` or, by default, ``plot.png`` inside the first run's directory. Needs matplotlib
(``pip install 'distkit[plot]'``). A RUN that is not a run's output directory is one line, exit 2, nothing
written.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional

from distkit.errors import BackendUnavailable, ConfigError

#: the panels: (title, the key of the training records on the y axis; the last two are derived, see figure())
PANELS = (("loss", "loss"), ("learning rate", "lr"), ("samples/s (each log window)", "samples_per_s"),
          ("blocked on communication (s, cumulative)", "comm_wait_s"),
          ("bytes per param-mode sync (rank 0, each log window)", "sync_bytes"),
          ("groups in each sync (fault-tolerant groups)", "groups"))


def windowed_rates(train: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """Samples/s over each log window: (step, the samples trained since the previous record over rank 0's seconds
    since it), from the records' cumulative ``samples`` and ``time_s``. The first window starts when training
    started. A record whose ``time_s`` is below the one before starts a new process (a resume: its clock starts
    again, its samples do not): no window ends there. Not the records' own ``samples_per_s``, which averages
    since the start and so carries start-up and early steps to the end of the curve."""
    out, before = [], None
    for r in train:
        if "samples" not in r or "time_s" not in r:
            continue
        if before is None:
            if r["time_s"] > 0:
                out.append((r["step"], r["samples"] / r["time_s"]))
        elif r["time_s"] > before["time_s"]:
            out.append((r["step"], (r["samples"] - before["samples"]) / (r["time_s"] - before["time_s"])))
        before = r
    return out


def windowed_bytes_per_sync(train: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """Bytes per sync over each log window: (step, the bytes rank 0 handed to the syncs' collectives since the
    previous record over the syncs since it). ``distkit train`` writes it into each record, ``bytes_per_sync``
    (null where the window had no sync), with ``sync_bytes`` and ``syncs`` counted since the run started (a resume
    continues them: :func:`distkit.trackers.records.sync_record`); a record without ``bytes_per_sync`` (another writer's,
    counting since its process started) gives it from its ``sync_bytes`` and ``syncs``, a record whose ``time_s``
    or ``syncs`` is below the one before starting a new process (a resume: its counters start again at 0), its
    window from 0. A window without a sync has no point; records without the keys (grad mode) give none."""
    out: list[tuple[int, float]] = []
    before: Optional[dict[str, Any]] = None
    for r in train:
        if "bytes_per_sync" in r:  # the window's own, from run-long counters (a resume does not start them again)
            if r["bytes_per_sync"] is not None:
                out.append((r["step"], float(r["bytes_per_sync"])))
            before = r
            continue
        if "sync_bytes" not in r or "syncs" not in r:
            continue
        if before is None or r["syncs"] < before["syncs"] or r.get("time_s", 0) < before.get("time_s", 0):
            syncs, sent = r["syncs"], r["sync_bytes"]
        else:
            syncs, sent = r["syncs"] - before["syncs"], r["sync_bytes"] - before["sync_bytes"]
        if syncs > 0:
            out.append((r["step"], sent / syncs))
        before = r
    return out


def sync_groups(events: list[dict[str, Any]], num_replicas: Optional[int]) -> dict[str, list[tuple[int, int]]]:
    """The groups each sync across fault-tolerant groups averaged, from the ``"event": "sync"`` records (written at
    each sync whose groups or outcome changed, so the count holds until the next record): ``{"groups": [(step,
    groups)], "without": [(step, groups)] (committed syncs that went ahead with fewer than ``num_replicas`` groups:
    the first of each stretch, which lasts until the next record), "failed": [(step, groups)] (syncs not
    committed)}``."""
    syncs = [e for e in events if e.get("event") == "sync" and "step" in e and "groups" in e]
    return {"groups": [(e["step"], e["groups"]) for e in syncs],
            "without": [(e["step"], e["groups"]) for e in syncs
                        if e.get("committed", True) and num_replicas is not None and e["groups"] < num_replicas],
            "failed": [(e["step"], e["groups"]) for e in syncs if not e.get("committed", True)]}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="plot loss, lr, samples/s, communication time, bytes per sync and fault-tolerant "
                       "groups of runs, overlaid (PNG)",
                       description=(__doc__ or "").split("\n\n")[0].strip(), allow_abbrev=False)
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's output directory (holding metrics.jsonl)")
    p.add_argument("-o", "--output", default=None, metavar="PNG", help="where to write the PNG (default RUN/plot.png)")
    p.add_argument("--x", choices=("step", "time"), default="step", help="the x axis: step (default) or wall time (s)")


def load_run(path: str) -> dict[str, Any]:
    """One run's records: ``{"label", "train": [...], "eval": [...]}``; ConfigError when ``path`` holds no run."""
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise ConfigError(f"{path} is not a run's output directory (no metrics.jsonl): give the output_dir of a "
                          "`distkit train` run")
    train, evals, events = [], [], []
    with open(metrics) as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{metrics}, line {n}: not JSON (a damaged file): {line[:80]!r}") from None
            if "event" in record:
                events.append(record)  # membership records of fault-tolerant groups
                continue
            if "loss" in record:
                train.append(record)
            elif any(k.startswith("eval_") for k in record):
                evals.append(record)
    return {"label": _label(path), "train": train, "eval": evals, "events": events,
            "num_replicas": _num_replicas(path)}


def _num_replicas(path: str) -> Optional[int]:
    """``fault_tolerance.num_replicas`` of the run's resolved config (None: no fault-tolerant groups, or unknown)."""
    try:
        with open(os.path.join(path, "config.resolved.json")) as f:
            ft = json.load(f).get("fault_tolerance") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    n = ft.get("num_replicas") if isinstance(ft, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _label(path: str) -> str:
    """``<directory> (<engine> [ZeRO-N] <mode>, <N> ranks)`` from the run's resolved config, or the directory
    alone."""
    name = os.path.basename(os.path.normpath(path))
    try:
        with open(os.path.join(path, "config.resolved.json")) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return name
    d = cfg.get("distributed", {})
    stage = ((d.get("deepspeed_config") or {}).get("zero_optimization") or {}).get("stage")
    engine = d.get("backend", "?") + (f" ZeRO-{stage}" if d.get("backend") == "deepspeed" and stage is not None else "")
    return f"{name} ({engine} {d.get('reduce_type', '?')}, {cfg.get('world_size', '?')} ranks)"


def figure(runs: list[dict[str, Any]], x: str = "step") -> Any:
    """The matplotlib Figure of ``runs`` (from :func:`load_run`): one line per run and panel, eval loss dashed."""
    try:
        import matplotlib
    except ImportError:
        raise BackendUnavailable("distkit plot needs matplotlib: pip install 'distkit[plot]'") from None
    matplotlib.use("Agg")  # files only: no display on a cluster node
    import matplotlib.pyplot as plt

    key = "step" if x == "step" else "time_s"
    fig, axes = plt.subplots(3, 2, figsize=(11, 10.5))
    for ax, (title, y) in zip(axes.flat, PANELS):
        for i, run in enumerate(runs):
            color = f"C{i % 10}"
            if y == "groups":
                _plot_groups(ax, run, color)
                continue
            if y in ("samples_per_s", "sync_bytes"):  # over each log window, not since the start
                at = {r["step"]: r[key] for r in run["train"] if key in r}
                windowed = windowed_rates if y == "samples_per_s" else windowed_bytes_per_sync
                windows = windowed(run["train"])
                points = [(at[step], value) for step, value in windows if step in at]
            else:
                points = [(r[key], r[y]) for r in run["train"] if key in r and y in r]
            if points:
                ax.plot(*zip(*points), color=color, label=run["label"])
            if y == "loss":
                evals = [(r[key], r["eval_loss"]) for r in run["eval"] if key in r and "eval_loss" in r]
                if evals:
                    ax.plot(*zip(*evals), color=color, linestyle="--", marker="o", markersize=3,
                            label=f"{run['label']} eval")
        if y in ("sync_bytes", "groups"):
            if not ax.get_lines():  # say why the panel is empty
                ax.text(0.5, 0.5, "no param-mode syncs logged" if y == "sync_bytes" else "no fault-tolerant groups",
                        ha="center", va="center", transform=ax.transAxes, color="0.5")
            elif y == "sync_bytes":
                ax.set_yscale("log")  # codecs differ by orders of magnitude (fp32 4 bytes an element, top-k 0.07)
        ax.set_title(title)
        ax.set_xlabel("step" if x == "step" or y == "groups" else "wall time (s)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_groups(ax: Any, run: dict[str, Any], color: str) -> None:
    """The groups each sync averaged (a step line: the count holds until the next record), the syncs that went ahead
    without a group (filled markers) and the failed ones (crosses), against the step."""
    groups = sync_groups(run["events"], run["num_replicas"])
    if groups["groups"]:
        ax.step(*zip(*groups["groups"]), where="post", color=color, label=run["label"])
    if groups["without"]:
        ax.plot(*zip(*groups["without"]), color=color, linestyle="none", marker="o", markersize=4,
                label=f"{run['label']}: went ahead without a group")
    if groups["failed"]:
        ax.plot(*zip(*groups["failed"]), color=color, linestyle="none", marker="x", markersize=6,
                label=f"{run['label']}: failed")


def run(args: argparse.Namespace) -> int:
    runs = [load_run(path) for path in args.runs]  # every RUN checked before anything is written
    out = os.path.abspath(args.output or os.path.join(args.runs[0], "plot.png"))
    if not out.lower().endswith(".png"):
        raise ConfigError(f"-o {args.output}: the plot is a PNG; give a path ending in .png")
    fig = figure(runs, args.x)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fig.savefig(out + ".part.png", dpi=110)
    os.replace(out + ".part.png", out)
    print(f"distkit: wrote {out} ({len(runs)} run(s), x = {args.x})")
    return 0
