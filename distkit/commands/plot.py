"""``distkit plot RUN [RUN ...] [-o out.png] [--x step|time]``: the curves of one or more runs, overlaid.

Four panels from each run's ``metrics.jsonl``: loss (train solid, eval dashed with markers), learning rate,
samples/s over each log window (:func:`windowed_rates`), and the seconds blocked on the training collectives
(cumulative, rank 0), against the step, or against rank 0's wall time since training started (``--x time``). Each run's legend entry is its directory
name with its engine and mode (from ``config.resolved.json``: ``ddp grad``, ``deepspeed ZeRO-2 param``), so
two engines or two modes of one script compare at a glance. A run of fault-tolerant groups is plotted by
giving each group's directory.

The PNG goes to ``-o`` or, by default, ``plot.png`` inside the first run's directory. Needs matplotlib
(``pip install 'distkit[plot]'``). A RUN that is not a run's output directory is one line, exit 2, nothing
written.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from distkit.errors import BackendUnavailable, ConfigError

#: the panels: (title, the key of the training records on the y axis)
PANELS = (("loss", "loss"), ("learning rate", "lr"), ("samples/s (each log window)", "samples_per_s"),
          ("blocked on communication (s, cumulative)", "comm_wait_s"))


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


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="plot loss, lr, samples/s and communication time of runs, overlaid (PNG)",
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
    train, evals = [], []
    with open(metrics) as f:
        for n, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{metrics}, line {n}: not JSON (a damaged file): {line[:80]!r}") from None
            if "event" in record:
                continue  # membership records of fault-tolerant groups
            if "loss" in record:
                train.append(record)
            elif any(k.startswith("eval_") for k in record):
                evals.append(record)
    return {"label": _label(path), "train": train, "eval": evals}


def _label(path: str) -> str:
    """``<directory> (<engine> [ZeRO-N] <mode>)`` from the run's resolved config, or the directory alone."""
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
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (title, y) in zip(axes.flat, PANELS):
        for i, run in enumerate(runs):
            color = f"C{i % 10}"
            if y == "samples_per_s":  # over each log window, not since the start
                at = {r["step"]: r[key] for r in run["train"] if key in r}
                points = [(at[step], rate) for step, rate in windowed_rates(run["train"]) if step in at]
            else:
                points = [(r[key], r[y]) for r in run["train"] if key in r and y in r]
            if points:
                ax.plot(*zip(*points), color=color, label=run["label"])
            if y == "loss":
                evals = [(r[key], r["eval_loss"]) for r in run["eval"] if key in r and "eval_loss" in r]
                if evals:
                    ax.plot(*zip(*evals), color=color, linestyle="--", marker="o", markersize=3,
                            label=f"{run['label']} eval")
        ax.set_title(title)
        ax.set_xlabel("step" if x == "step" else "wall time (s)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


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
