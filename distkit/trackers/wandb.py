"""Weights & Biases: offline (files under ``output_dir/wandb``, uploaded later with ``wandb sync``) unless the user
has configured W&B (``WANDB_MODE``, ``WANDB_API_KEY``, or ``wandb login``'s entry in ~/.netrc), then as configured.
The project is ``WANDB_PROJECT`` (default "distkit"), the run's id distkit's run id (a resumed run continues it,
``resume="allow"``), its name the ``output_dir``'s.

History under the names of ``metrics.jsonl`` at the optimizer step (W&B's ``_step``; an eval record's other keys with
the ``eval_`` prefix, e.g. ``eval_time_s``, as W&B merges a step's records into one row); the config as the run's
config; the summary in the run's summary (the summary's own keys) and its exit code: 0, 75 (preempted) or 1.
"""
from __future__ import annotations

import netrc
import os
from typing import Any, Optional

_EXIT = {"finished": 0, "preempted": 75, "failed": 1}


def _configured() -> bool:
    """The user set W&B up: an API key in the environment or from ``wandb login`` (~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    def __init__(self, output_dir: str, run_id: str, params: dict[str, Any]) -> None:
        import wandb

        mode = None if os.environ.get("WANDB_MODE") or _configured() else "offline"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "distkit", id=_wandb_id(run_id),
                              name=os.path.basename(os.path.abspath(output_dir)), dir=output_dir, config=params,
                              resume="allow", mode=mode, reinit="create_new")
        self.last_step = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        # W&B keeps one history row per step and merges what is logged at it: an eval record at a training record's
        # step overwrote its ``time_s`` (issue 36). Its keys that are not eval metrics get the eval_ prefix.
        if any(k.startswith("eval_") for k in metrics):
            metrics = {k if k.startswith("eval_") else f"eval_{k}": v for k, v in metrics.items()}
        self.run.log(metrics, step=step)
        self.last_step = max(self.last_step, step)

    def finish(self, summary: Optional[dict[str, Any]], status: str) -> None:
        if summary is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish(exit_code=_EXIT[status])


def _wandb_id(run_id: str) -> str:
    """W&B run ids allow letters, digits, ``-`` and ``_`` (at most 64)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_id)[:64]


def open_tracker(output_dir: str, run_id: str, params: dict[str, Any], resumed: bool) -> WandbTracker:
    return WandbTracker(output_dir, run_id, params)
