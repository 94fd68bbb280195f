"""MLflow: the run's points in an MLflow run, by default in a local store ``output_dir/mlflow.db`` (SQLite, MLflow's
own recommended backend: ``mlflow ui --backend-store-uri sqlite:///output_dir/mlflow.db``), or wherever
``MLFLOW_TRACKING_URI`` points. The experiment is ``MLFLOW_EXPERIMENT_NAME`` (default "distkit"); the run is named
after ``output_dir`` and tagged ``distkit.run_id``, which is how a resumed run finds it again.

Metrics under the names of ``metrics.jsonl`` at the optimizer step; the config's keys as params (MLflow params are
immutable: a resumed run adds the keys that are new and keeps the first values of the others); the summary's
numbers as ``summary/<key>``; the run ends FINISHED, KILLED (preempted) or FAILED.
"""
from __future__ import annotations

import os
import time
from typing import Any, Optional

from distkit.trackers import summary_numbers

#: MLflow's limit on a param's value (characters); longer config values are cut there
_MAX_PARAM = 6000
_STATUS = {"finished": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}


class MlflowTracker:
    name = "mlflow"

    def __init__(self, output_dir: str, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        default = "sqlite:///" + os.path.abspath(os.path.join(output_dir, "mlflow.db"))
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or default
        self.client = MlflowClient(tracking_uri=self.uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "distkit"
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            experiment_id = exp.experiment_id
        elif self.uri == default:  # artifacts next to the store, not in the working directory
            experiment_id = self.client.create_experiment(
                name, artifact_location="file://" + os.path.abspath(os.path.join(output_dir, "mlflow-artifacts")))
        else:
            experiment_id = self.client.create_experiment(name)
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`distkit.run_id` = '{run_id}'",
                                        max_results=1)
        if found:  # the same distkit run continues: the same MLflow run
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            have = found[0].data.params
        else:
            run = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(output_dir)),
                                         tags={"distkit.run_id": run_id})
            self.run_id, have = run.info.run_id, {}
        new = [Param(k, str(v)[:_MAX_PARAM]) for k, v in params.items() if k not in have]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        self.last_step = 0

    def held_through(self) -> int:
        """The last step of any metric of the MLflow run (0: none), by MLflow's client; the summary's
        ``summary/*`` metrics are not counted."""
        keys = [k for k in self.client.get_run(self.run_id).data.metrics if not k.startswith("summary/")]
        return max((m.step for k in keys for m in self.client.get_metric_history(self.run_id, k)), default=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])
        self.last_step = max(self.last_step, step)

    def finish(self, summary: Optional[dict[str, Any]], status: str) -> None:
        from mlflow.entities import Metric

        if summary is not None:
            now, step = int(time.time() * 1000), int(summary.get("steps", self.last_step))
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in summary_numbers(summary).items()])
        self.client.set_terminated(self.run_id, _STATUS[status])


def open_tracker(output_dir: str, run_id: str, params: dict[str, Any], resumed: bool) -> MlflowTracker:
    return MlflowTracker(output_dir, run_id, params)
