"""Experiment trackers (issue 27 item 1): ``loggers = ["tensorboard", "mlflow", "wandb", "csv", <object>]``.

What each tracker holds is read back with the library's own reader (TensorBoard's event reader, MLflow's client, the
W&B offline run file parsed with W&B's own record schema) and must be exactly metrics.jsonl's points, on ddp,
mpi and DeepSpeed: the same steps, the same values (TensorBoard stores float32), the config's keys as hyperparameters, the
summary at the end. A run killed mid-way and resumed continues the same tracker runs with no duplicate step. A
tracker that is not installed is one line with the pip command, exit 2, nothing written; one that cannot start
stops every rank with one line.
"""
from __future__ import annotations

import csv
import glob
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import base_env, distkit, ok, summary, venv_without
from distkit.trackers.wandb import offline_records

ENGINES = {
    "ddp": [],
    "mpi": ["++distributed", "{'backend': 'mpi'}"],
    "deepspeed": ["++deepspeed_config", "{'zero_optimization': {'stage': 1}}"],
}
ALL = "['tensorboard', 'mlflow', 'wandb', 'csv']"

# a user's own logger object (Accelerate's tracker methods): rank 0 calls it; it writes what it got to a file
CONFIG = '''
import json, os, time

task = "digits"
max_steps = 12
log_every = 2
eval_every = 6
batch_size = 16
progress_bar = False


class MyLogger:
    def __init__(self, path):
        self.path = path

    def _write(self, **record):
        with open(self.path, "a") as f:
            f.write(json.dumps({**record, "t": time.perf_counter()}) + "\\n")

    def store_init_configuration(self, config):
        self._write(config=config, pid=os.getpid())

    def log(self, metrics, step):
        self._write(step=step, metrics=metrics, pid=os.getpid())

    def finish(self):
        self._write(finished=True, pid=os.getpid())


class MyLightningStyleLogger(MyLogger):  # a Lightning logger's method names
    log_hyperparams, log_metrics = MyLogger.store_init_configuration, MyLogger.log
    store_init_configuration = log = finish = None

    def finalize(self, status):
        self._write(finalized=status, pid=os.getpid())


# one user object first (it finishes first, right after the summary), one last (it starts after W&B's seconds of
# start-up): the clock check below
loggers = [MyLogger(os.environ["MY_LOGGER_FILE"]), "tensorboard", "mlflow", "wandb", "csv",
           MyLightningStyleLogger(os.environ["MY_LOGGER_FILE"] + ".lightning")]
'''


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _mine(path: Path) -> list[dict[str, Any]]:
    """What the user's logger object got, less the clock reading of each call."""
    return [{k: v for k, v in r.items() if k != "t"} for r in _jsonl(path)]


def _trackers_started_before_the_loop(path: Path, s: dict[str, Any]) -> bool:
    """The summary's wall_time_s (the loop) leaves out the trackers' start: it is at most the time from the last
    tracker's start (after W&B's, which takes seconds) to the first one's finish (right after the summary); rank 0's
    perf_counter on both sides. Before: wall_time_s counted from the end of dk.setup, W&B's start included."""
    last_started = [r for r in _jsonl(Path(f"{path}.lightning")) if "config" in r][-1]  # this start's (a resume appends)
    return s["wall_time_s"] <= _jsonl(path)[-1]["t"] - last_started["t"]


def _series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def tensorboard_run(out: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, Any]]:
    """Every scalar series (tag -> [(step, value)]) and the HPARAMS session's values, by TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    scalars = {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    hparams: dict[str, Any] = {}
    for content in ea.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                hparams[key] = getattr(value, value.WhichOneof("kind"))
    return scalars, hparams


def mlflow_runs(out: Path) -> list[Any]:
    """The MLflow runs in the run's local store, by MLflow's own client."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{out / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("distkit").experiment_id])
    mlflow.set_tracking_uri(uri)
    return [(mlflow.get_run(r.info.run_id), client) for r in runs]


def wandb_runs(out: Path) -> list[dict[str, Any]]:
    """Each offline run directory's run id, history {step: {key: value}}, config, summary and exit code."""
    runs = []
    for path in sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))):
        run: dict[str, Any] = {"history": {}, "config": {}, "summary": {}, "exit_code": None}
        for rec in offline_records(path):  # W&B's own record schema; the file's framing is LevelDB's log
            kind = rec.WhichOneof("record_type")
            if kind == "run":  # the config given to wandb.init comes with the run record
                run["id"] = rec.run.run_id
                run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                run["history"][items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "config":
                run["config"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.config.update})
            elif kind == "summary":
                run["summary"].update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.summary.update})
            elif kind == "exit":
                run["exit_code"] = rec.exit.exit_code
        runs.append(run)
    return runs


def _train(out: Path, engine: str, *extra: str, **env: str) -> Any:
    cfg = out.parent / f"{out.name}-config.py"
    cfg.write_text(CONFIG)
    return distkit("train", str(cfg), "--nprocs", "2", "++output_dir", str(out), *ENGINES[engine], *extra,
                   MY_LOGGER_FILE=str(out.parent / f"{out.name}-mylogger.jsonl"), **env)


# (Horovod is left out here to keep the suite's time: the trackers see only dk.is_main, and under Horovod it
# comes from mpirun's rank as under the mpi engine; every Horovod test reads rank 0's metrics.jsonl and summary)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_tracker_holds_exactly_the_runs_records(tmp_path: Path, engine: str) -> None:
    out = tmp_path / "run"
    ok(_train(out, engine))
    records, s = _jsonl(out / "metrics.jsonl"), summary(out)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6, 8, 10, 12] and [r["step"] for r in records if "eval_loss" in r] == [6, 12]
    keys = sorted({k for r in records for k in r if k != "step"})  # loss, lr, samples_per_s, eval_loss, ...

    scalars, hparams = tensorboard_run(out)
    for key in keys:
        assert scalars[key] == [(st, pytest.approx(v, rel=1e-6)) for st, v in _series(records, key)], key  # float32
    assert scalars["summary/eval_loss"] == [(12, pytest.approx(s["eval_loss"], rel=1e-6))]
    assert hparams["distributed.backend"] == s["backend"] and hparams["max_steps"] == 12

    [(run, client)] = mlflow_runs(out)
    assert run.info.status == "FINISHED" and run.data.tags["distkit.run_id"] == s["run_id"]
    assert run.data.params["distributed.backend"] == s["backend"] and run.data.params["batch_size"] == "16"
    for key in keys:
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] == _series(records, key), key
    assert run.data.metrics["summary/eval_loss"] == s["eval_loss"]

    [wb] = wandb_runs(out)
    assert wb["id"] == s["run_id"] and wb["exit_code"] == 0
    assert wb["history"] == {st: {k: v for k, v in r.items() if k != "step"} for st, r in _merged(records).items()}
    assert wb["history"][6]["time_s"] < wb["history"][6]["eval_time_s"]  # both kept: the eval came after the step
    assert wb["config"]["distributed.backend"] == s["backend"] and wb["summary"]["eval_loss"] == s["eval_loss"]

    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [{k: v for k, v in row.items() if v != ""} for row in rows] == \
        [{k: str(v) for k, v in r.items()} for r in records]

    mine = _mine(out.parent / "run-mylogger.jsonl")
    assert mine[0]["config"]["distributed.backend"] == s["backend"] and mine[-1] == {"finished": True, "pid": mine[0]["pid"]}
    assert [(m["step"], m["metrics"]) for m in mine[1:-1]] == [(r["step"], {k: v for k, v in r.items() if k != "step"})
                                                             for r in records]
    assert len({m["pid"] for m in mine}) == 1  # rank 0 only
    theirs = _mine(out.parent / "run-mylogger.jsonl.lightning")
    assert theirs[:-1] == mine[:-1] and theirs[-1] == {"finalized": "success", "pid": mine[0]["pid"]}
    assert _trackers_started_before_the_loop(out.parent / "run-mylogger.jsonl", s)  # failed before: W&B's start


def _merged(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Records of one step (a training and an eval point) as one: W&B keeps one history row per step, so an eval
    record's other keys carry the eval_ prefix (its time_s overwrote the training record's: issue 36 item 16)."""
    rows: dict[int, dict[str, Any]] = {}
    for r in records:
        if any(k.startswith("eval_") for k in r):
            r = {k if k.startswith("eval_") or k == "step" else f"eval_{k}": v for k, v in r.items()}
        rows.setdefault(r["step"], {}).update(r)
    return rows


def test_a_resumed_run_continues_the_same_tracker_runs_with_every_step_exactly_once(tmp_path: Path) -> None:
    # rank 0 killed (SIGKILL) in step 9, logged through 8, the last checkpoint at step 5: the resumed run recomputes
    # 6-8 and must not log them again; what a tracker lost with the kill is replayed (W&B writes from a process of
    # its own, asynchronously: the killed start's offline file held none of its records, issue 36 item 15)
    out = tmp_path / "run"
    res = _train(out, "ddp", "++checkpoint_every", "5", DISTKIT_FAULT="0:9:kill")
    assert res.returncode != 0 and [r["step"] for r in _jsonl(out / "metrics.jsonl")] == [2, 4, 6, 6, 8]
    # rank 1 names the rank that died, with no traceback of its own and none of torch's C++ (issue 36 item 12)
    assert "rank 1 failed: RankLost: rank 0 (host " in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "frame #" not in res.stderr, res.stderr[-3000:]
    held = max([st for run in wandb_runs(out) for st in run["history"]], default=0)
    resumed = ok(_train(out, "ddp", "++checkpoint_every", "5", "++resume", "auto"))
    assert "metrics.jsonl holds steps up to 8 from the earlier run; steps 6-8 are not logged again" in resumed.stdout
    records, s = _jsonl(out / "metrics.jsonl"), summary(out)
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [2, 4, 6, 8, 10, 12]  # metrics.jsonl itself: no step twice
    if held < 8:  # what W&B lost is replayed, and said
        lacking = [r for r in records if held < r["step"] <= 8]
        assert (f"distkit: wandb held steps up to {held} of the earlier run; {len(lacking)} record(s) of steps "
                f"{lacking[0]['step']}-8 replayed to it from metrics.jsonl") in resumed.stdout

    scalars, _ = tensorboard_run(out)
    assert scalars["loss"] == [(st, pytest.approx(v, rel=1e-6)) for st, v in _series(records, "loss")]
    assert scalars["eval_loss"] == [(st, pytest.approx(v, rel=1e-6)) for st, v in _series(records, "eval_loss")]
    [(run, client)] = mlflow_runs(out)  # one MLflow run, continued
    assert run.info.status == "FINISHED" and run.data.tags["distkit.run_id"] == s["run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == _series(records, "loss")
    first, second = wandb_runs(out)  # W&B offline: one file per start, the same run id (`wandb sync` joins them)
    assert second["id"] == s["run_id"] and second["exit_code"] == 0 and first.get("id", s["run_id"]) == s["run_id"]
    assert not set(first["history"]) & set(second["history"])  # every step once...
    both = {**first["history"], **second["history"]}
    assert both == {st: {k: v for k, v in r.items() if k != "step"} for st, r in _merged(records).items()}  # ...all
    with open(out / "metrics.csv", newline="") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [r["step"] for r in records]
    mine = _mine(out.parent / "run-mylogger.jsonl")
    assert [m["step"] for m in mine if "step" in m] == [r["step"] for r in records]
    assert _trackers_started_before_the_loop(out.parent / "run-mylogger.jsonl", s)


def test_a_tracker_that_is_not_installed_is_one_line_with_the_pip_command(tmp_path: Path) -> None:
    python = venv_without(tmp_path, "tensorboard")
    env = base_env()
    env.pop("PYTHONPATH")
    out = tmp_path / "run"
    import subprocess

    res = subprocess.run([str(python), "-m", "distkit", "train", "configs/demo.py", "++output_dir", str(out),
                          "++loggers", "['csv', 'tensorboard']"], env=env, cwd=Path(__file__).parent.parent,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-1] == (
        "distkit: error: 'loggers': 'tensorboard' needs tensorboard, which is not installed here: "
        "pip install 'distkit[trackers]' (or: pip install tensorboard)")
    assert not out.exists()


@pytest.mark.parametrize("loggers,needle", [
    ("['tensorbord']", "'loggers': unknown tracker 'tensorbord': use any of tensorboard, mlflow, wandb, csv"),
    ("['csv', 'csv']", "'loggers': a tracker is named twice"),
    ("[3]", "'loggers': 3 is neither a tracker name"),
])
def test_bad_loggers_are_one_line_and_write_nothing(tmp_path: Path, loggers: str, needle: str) -> None:
    res = distkit("train", "configs/demo.py", "++output_dir", str(tmp_path / "run"), "++loggers", loggers)
    assert res.returncode == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    # an MLflow store rank 0 cannot create (its directory would be inside a file): the other rank must not wait
    out, blocker = tmp_path / "run", tmp_path / "a-file"
    blocker.write_text("")
    res = distkit("train", "configs/demo.py", "--nprocs", "2", "++output_dir", str(out), "++loggers", "['mlflow']",
                  MLFLOW_TRACKING_URI=f"sqlite:///{blocker}/mlflow.db", timeout=90)
    assert res.returncode != 0 and not (out / "summary.json").exists()
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("distkit: error")]
    assert len(lines) == 1 and "a tracker of 'loggers' could not start:" in lines[0], res.stderr[-3000:]
