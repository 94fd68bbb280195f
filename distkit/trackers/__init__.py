"""Experiment trackers (``loggers = ["tensorboard", "mlflow", "wandb", "csv", <object>]``): rank 0 hands every record
it writes to ``metrics.jsonl`` to each tracker, the run's config as hyperparameters at start and the summary at the
end. One module per tracker; each library is imported only when its name is asked for.

Cross-rank contract: trackers live on rank 0 only; the other ranks never import a tracker library. A tracker that
fails to start stops every rank with one line (the trainer raises its error on all of them).

Resume: a resumed run continues the same tracker run (the same TensorBoard directory, the MLflow run tagged with
distkit's run id, the W&B run of that id) on the same step axis; records of steps the earlier run had logged
already (those after its last checkpoint) are not logged again, in ``metrics.jsonl`` or any tracker. What a tracker
lost when the earlier run was killed (W&B writes asynchronously and lost every record of a SIGKILLed start) is
replayed from ``metrics.jsonl``: each built-in tracker says the last step it holds (``held_through``), read back
from its own store, and gets the records after it. A resumed run's trackers hold every step exactly once.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Optional, Protocol

from distkit.errors import ConfigError

#: tracker name -> (module of distkit.trackers, the modules it needs, the pip command that installs them)
TRACKERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "tensorboard": ("tensorboard", ("tensorboard",), "pip install 'distkit[trackers]' (or: pip install tensorboard)"),
    # the default local store is MLflow's own recommended backend, SQLite, which needs SQLAlchemy and Alembic
    "mlflow": ("mlflow", ("mlflow", "sqlalchemy", "alembic"),
               "pip install 'distkit[trackers]' (or: pip install mlflow-skinny sqlalchemy alembic)"),
    "wandb": ("wandb", ("wandb",), "pip install 'distkit[trackers]' (or: pip install wandb)"),
    "csv": ("csv", (), ""),
}


class Tracker(Protocol):
    """What a tracker (built in or a user's object) offers. Only ``log`` is required of a user's object; the others
    are called when present (Hugging Face Accelerate's ``GeneralTracker`` has these names; a Lightning logger's
    ``log_metrics``/``log_hyperparams``/``finalize`` are taken too)."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...  # the numbers of one record (ints stay ints)


def check(loggers: Any) -> list[Any]:
    """The ``loggers`` key, checked before anything is written: a list of tracker names and objects (a single name
    or object is taken as a list of one). An unknown name, or one whose library is not installed, is a
    :class:`ConfigError` naming the fix."""
    items = [loggers] if isinstance(loggers, str) or _is_logger_object(loggers) else loggers
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"'loggers' must be a list of tracker names ({', '.join(TRACKERS)}) or objects with "
                          f"log(metrics, step), got {loggers!r}")
    for item in items:
        if isinstance(item, str):
            if item not in TRACKERS:
                raise ConfigError(f"'loggers': unknown tracker {item!r}: use any of {', '.join(TRACKERS)}, or an object "
                                  f"with log(metrics, step)")
            _, needs, pip = TRACKERS[item]
            missing = [m for m in needs if importlib.util.find_spec(m) is None]
            if item == "mlflow" and _mlflow_uri_set():
                missing = [m for m in missing if m == "mlflow"]  # a tracking server or URI of the user's own
            if missing:
                raise ConfigError(f"'loggers': {item!r} needs {', '.join(missing)}, which is not installed here: {pip}")
        elif not _is_logger_object(item):
            raise ConfigError(f"'loggers': {item!r} is neither a tracker name ({', '.join(TRACKERS)}) nor an object with "
                              f"log(metrics, step) or log_metrics(metrics, step)")
    if len({i for i in items if isinstance(i, str)}) != sum(isinstance(i, str) for i in items):
        raise ConfigError(f"'loggers': a tracker is named twice in {loggers!r}: name each once")
    return list(items)


def check_reachable(loggers: list[Any], timeout_s: float = 5.0) -> None:
    """ConfigError (exit 2) when "mlflow" is asked for with an http(s) ``MLFLOW_TRACKING_URI`` whose server accepts no
    TCP connection within ``timeout_s``: checked before anything is written (MLflow's client retried for minutes,
    then the run failed with its outputs written). Not collective: one connection, then closed."""
    import os
    import socket
    import urllib.parse

    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    url = urllib.parse.urlparse(uri)
    if "mlflow" not in loggers or url.scheme not in ("http", "https"):
        return
    fix = "start the tracking server, fix MLFLOW_TRACKING_URI, or remove 'mlflow' from loggers"
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError as e:  # a port over 65535
        raise ConfigError(f"MLFLOW_TRACKING_URI={uri!r} (loggers 'mlflow'): {e}: {fix}") from None
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout_s).close()
    except OSError as e:
        why = e.strerror or str(e) or type(e).__name__
        raise ConfigError(f"MLFLOW_TRACKING_URI={uri!r} (loggers 'mlflow') is unreachable ({why}, within "
                          f"{timeout_s:g} s): {fix}") from None


def _is_logger_object(obj: Any) -> bool:
    return not isinstance(obj, (str, list, tuple, dict)) and obj is not None and (
        callable(getattr(obj, "log", None)) or callable(getattr(obj, "log_metrics", None)))


def _mlflow_uri_set() -> bool:
    import os

    return bool(os.environ.get("MLFLOW_TRACKING_URI"))


class Trackers:
    """Rank 0's trackers, fanned out: each record to each of them. Empty (does nothing) on other ranks."""

    def __init__(self, trackers: list[Any]) -> None:
        self.trackers = trackers

    @classmethod
    def open(cls, loggers: list[Any], output_dir: str, run_id: str, config: dict[str, Any], resumed: bool) -> "Trackers":
        """Start (or, ``resumed``, continue) each tracker of ``loggers`` for the run ``run_id`` writing to
        ``output_dir``; ``config`` (the resolved config) goes to each as its hyperparameters."""
        opened: list[Any] = []
        params = flatten(config)
        for item in loggers:
            if isinstance(item, str):
                module = importlib.import_module(f"distkit.trackers.{TRACKERS[item][0]}")
                opened.append(module.open_tracker(output_dir=output_dir, run_id=run_id, params=params, resumed=resumed))
            else:
                opened.append(_UserTracker(item, params))
        return cls(opened)

    def log(self, record: dict[str, Any]) -> None:
        """One record of ``metrics.jsonl`` (a training or an eval point): its numbers, at its step."""
        if not self.trackers or "step" not in record or "event" in record:
            return
        for t in self.trackers:
            self._log_to(t, record)

    @staticmethod
    def _log_to(tracker: Any, record: dict[str, Any]) -> None:
        metrics = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        tracker.log(metrics, int(record["step"]))

    def catch_up(self, records: list[dict[str, Any]]) -> list[str]:
        """A resumed run, before its first record: hand each tracker that can say what it holds (``held_through()``,
        the last step it holds, 0 for none) the records of ``records`` (the earlier run's ``metrics.jsonl``) after
        that step. Returns one line per tracker that lacked some, for rank 0 to print."""
        said = []
        for t in self.trackers:
            held = getattr(t, "held_through", None)
            if held is None:  # a user's object: it is not asked (it holds whatever it kept)
                continue
            through = held()
            lacking = [r for r in records if "step" in r and "event" not in r and r["step"] > through]
            for r in lacking:
                self._log_to(t, r)
            if lacking:
                said.append(f"distkit: {getattr(t, 'name', type(t).__name__)} held steps up to {through} of the earlier run; "
                            f"{len(lacking)} record(s) of steps {lacking[0]['step']}-{lacking[-1]['step']} replayed to it "
                            f"from metrics.jsonl")
        return said

    def finish(self, summary: Optional[dict[str, Any]], status: str) -> None:
        """The run ended: ``status`` "finished" (``summary`` is the run's), "preempted" or "failed" (no summary)."""
        for t in self.trackers:
            t.finish(summary, status)
        self.trackers = []


class _UserTracker:
    """A user's own logger object: Accelerate's tracker method names, or a Lightning logger's."""

    def __init__(self, obj: Any, params: dict[str, Any]) -> None:
        self.obj = obj
        for name in ("store_init_configuration", "log_hyperparams"):
            if callable(getattr(obj, name, None)):
                getattr(obj, name)(params)
                break

    def log(self, metrics: dict[str, float], step: int) -> None:
        if callable(getattr(self.obj, "log", None)):
            self.obj.log(metrics, step=step)
        else:
            self.obj.log_metrics(metrics, step=step)

    def finish(self, summary: Optional[dict[str, Any]], status: str) -> None:
        if summary is not None and callable(getattr(self.obj, "log_summary", None)):
            self.obj.log_summary(summary)
        if callable(getattr(self.obj, "finish", None)):
            self.obj.finish()
        elif callable(getattr(self.obj, "finalize", None)):
            self.obj.finalize("success" if status == "finished" else status)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``{"distributed.backend": "ddp", ...}`` with values every tracker takes as a
    hyperparameter (str, int, float, bool; None and lists as their JSON text)."""
    import json

    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (str, int, float, bool)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def summary_numbers(summary: dict[str, Any]) -> dict[str, float]:
    """The summary's numbers (booleans as 0/1) as ``summary/<key>``: what a tracker shows for the run's end."""
    return {f"summary/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))}
